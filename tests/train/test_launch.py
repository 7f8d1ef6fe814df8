"""launch.enable_compilation_cache: JAX's persistent cache in the workdir's parent, local workdirs only."""

import os

import jax

from mgrpo_jax.train.launch import COMPILATION_CACHE, enable_compilation_cache


def test_cache_goes_to_the_workdir_parent_and_not_to_remote_workdirs(tmp_path):
    before = jax.config.jax_compilation_cache_dir
    try:
        path = enable_compilation_cache(str(tmp_path / "runs" / "a"))
        assert path == os.path.join(str(tmp_path / "runs"), COMPILATION_CACHE)
        assert jax.config.jax_compilation_cache_dir == path
        assert enable_compilation_cache("gs://bucket/runs/a") is None
        assert jax.config.jax_compilation_cache_dir == path  # unchanged by the remote workdir
    finally:
        jax.config.update("jax_compilation_cache_dir", before)
