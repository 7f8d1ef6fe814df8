"""Shared helpers for the `python -m mgrpo_jax.bench.NAME` benchmarks: timing and the final JSON line."""

import ctypes
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


def keep_host_memory() -> bool:
    """Make glibc keep freed memory for reuse: no mmap'd blocks, no trimming, one arena (``mallopt``).

    XLA:CPU allocates an execution's buffers afresh on every call. With glibc's defaults each large buffer
    is a new ``mmap`` whose pages fault in on first touch, and on this machine faulting in a 50 MB activation
    costs more than the matmul that writes it (the bench shape's train step: 4.1 s with the defaults, 3.5 s
    with these settings). The price is a resident size that does not shrink (5.4 GB against 3.2 GB there).
    Process-wide, so it covers whatever else runs in the process (the benchmarks' PyTorch peers too). Call it
    before JAX starts its threads. Returns False where glibc's ``mallopt`` is not available.
    """
    try:
        libc = ctypes.CDLL("libc.so.6")
    except OSError:
        return False
    m_trim_threshold, m_mmap_max, m_arena_max = -1, -4, -8  # <malloc.h>
    settings = ((m_arena_max, 1), (m_mmap_max, 0), (m_trim_threshold, -1))  # -1: never trim
    return all(libc.mallopt(param, value) == 1 for param, value in settings)
