"""Shared helpers for the `python -m mgrpo_jax.bench.NAME` benchmarks: timing and the final JSON line."""

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


def emit(figures: dict) -> None:
    """Print the benchmark's figures as ONE JSON object on the last line of stdout."""
    print(json.dumps(figures, sort_keys=True), flush=True)
