"""Test-wide setup: eight fake CPU devices so sharded code runs on a laptop.

The flag must be set before JAX initialises its backend, i.e. before any test imports jax.
"""

import os

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import hypothesis  # noqa: E402

hypothesis.settings.register_profile("ci", max_examples=60, deadline=None, derandomize=True)
hypothesis.settings.register_profile("dev", max_examples=30, deadline=None)
hypothesis.settings.load_profile("ci" if os.environ.get("CI") else "dev")
