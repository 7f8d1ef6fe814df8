"""Test-wide setup: eight fake CPU devices so sharded code runs on a laptop.

The flag must be set before JAX initialises its backend, i.e. before any test imports jax.
"""

import os

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
os.environ.setdefault("JAX_PLATFORMS", "cpu")
# One persistent compilation cache for the whole test session, its workers and the runs they start as processes:
# the end-to-end tests compile the same smoke-sized programs again and again (a smoke run takes half the time
# with them cached). A fresh clone starts with an empty cache; the key covers the program and the devices.
os.environ.setdefault("JAX_COMPILATION_CACHE_DIR", os.path.join(os.path.dirname(os.path.dirname(
    os.path.abspath(__file__))), ".jax_test_cache"))
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0.1")
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES", "0")

import hypothesis  # noqa: E402

hypothesis.settings.register_profile("ci", max_examples=60, deadline=None, derandomize=True)
hypothesis.settings.register_profile("dev", max_examples=30, deadline=None)
hypothesis.settings.load_profile("ci" if os.environ.get("CI") else "dev")
