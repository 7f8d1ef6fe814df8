"""The JAX platform of a process that has no accelerator, chosen before JAX starts its backends (the launcher and
`python -m mgrpo_jax.agent.export` call it first)."""

from __future__ import annotations

import glob
import os
import sys

# What shows a TPU: its device files (/dev/accel* up to v5e, /dev/vfio/<n> from v5p) or the variables a TPU VM or
# pod sets. GPUs are not chosen against: only libtpu's failed probe is the noise this avoids.
TPU_ENV = ("TPU_ACCELERATOR_TYPE", "TPU_WORKER_HOSTNAMES", "TPU_WORKER_ID", "TPU_NAME", "TPU_PROCESS_BOUNDS",
           "CLOUD_TPU_TASK_ID")
ACCELERATOR_DEVICES = ("accel*", "vfio/[0-9]*", "nvidia[0-9]*", "kfd")


def choose_platform(environ=os.environ, dev: str = "/dev") -> str | None:
    """Runs JAX on the CPU when this machine has no accelerator, before JAX starts its backends: with libtpu
    installed (requirements-tpu.txt) and no TPU, JAX would probe it and print libtpu's errors first. A TPU VM
    (its device files or its environment) keeps its TPU, and a JAX_PLATFORMS the user set, even empty, wins.
    Returns the platform chosen, or None when JAX chooses."""
    if "JAX_PLATFORMS" in environ or any(environ.get(name) for name in TPU_ENV):
        return None
    if any(glob.glob(os.path.join(dev, pattern)) for pattern in ACCELERATOR_DEVICES):
        return None
    environ["JAX_PLATFORMS"] = "cpu"  # also for the processes this one starts
    if "jax" in sys.modules:  # imported already: its config read the variable then
        sys.modules["jax"].config.update("jax_platforms", "cpu")
    return "cpu"
