"""Shared helpers for the `python -m mgrpo_jax.bench.NAME` benchmarks: timing, host devices and the final
JSON line."""

import json
import statistics
import time
from collections.abc import Callable

import jax


def time_call(fn: Callable[[], object], *, warmup: int = 1, repeats: int = 5) -> dict[str, float]:
    """Wall-clock seconds of `fn()` (blocking on its JAX outputs): median, min and all samples."""
    for _ in range(warmup):
        jax.block_until_ready(fn())
    samples = []
    for _ in range(repeats):
        start = time.perf_counter()
        jax.block_until_ready(fn())
        samples.append(time.perf_counter() - start)
    return {"median_s": statistics.median(samples), "min_s": min(samples), "samples_s": samples}


def host_devices(n: int) -> int:
    """Ask JAX for ``n`` CPU devices (one per core lets a program sharded over them run one partition per
    core); returns how many CPU devices there are.

    Works only before JAX has run anything; after that the count is fixed (an
    ``--xla_force_host_platform_device_count`` flag or an earlier call decided it) and is kept."""
    try:
        jax.config.update("jax_num_cpu_devices", n)
    except RuntimeError:  # the backend is already up
        pass
    return len(jax.devices("cpu"))


def emit(figures: dict) -> None:
    """Print the benchmark's figures as ONE JSON object on the last line of stdout."""
    print(json.dumps(figures, sort_keys=True), flush=True)
