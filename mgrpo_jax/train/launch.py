"""What `launch/tpu_run.py` calls after flags and process setup: pick the role, build, run."""

from __future__ import annotations

import logging
import os

from mgrpo_jax.config import validate

log = logging.getLogger("mgrpo_jax")

COMPILATION_CACHE = ".jax_cache"


def enable_compilation_cache(workdir: str) -> str | None:
    """JAX's persistent compilation cache in the workdir's parent (`<parent>/.jax_cache`): the many short processes
    of an experiment (warm start, stage 1, stage 2, seeds, modes) compile the same shapes, and each reuses what
    an earlier one compiled. Local workdirs only; returns the cache folder."""
    if "://" in workdir:
        return None
    import jax

    path = os.path.join(os.path.dirname(os.path.abspath(workdir)), COMPILATION_CACHE)
    jax.config.update("jax_compilation_cache_dir", path)
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.2)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)
    return path


def run(config, workdir: str, role: str = "colocated") -> dict:
    """`colocated`: both agents in this job. `main` / `sub`: one side of the decoupled mode (decoupled.py)."""
    validate(config, role)  # a bad config fails here, before anything is built
    enable_compilation_cache(workdir)
    if role == "colocated":
        from mgrpo_jax.train.trainer import Trainer

        summary = Trainer(config, workdir).run()
    elif role in ("main", "sub"):
        from mgrpo_jax.train.decoupled import MainRole, SubRole

        summary = (MainRole if role == "main" else SubRole)(config, workdir).run()
    else:
        raise ValueError(f"unknown role {role!r}: expected colocated, main or sub")
    log.info("done (%s): %s", role, {k: round(v, 4) for k, v in summary.items() if "reward" in k or "accuracy" in k})
    return summary
