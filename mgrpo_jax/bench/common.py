"""Shared helpers for the `python -m mgrpo_jax.bench.NAME` benchmarks: timing, host devices and the final
JSON line."""

import argparse
import json
import statistics
import sys
import time
from collections.abc import Callable, Sequence

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


# The default warm start of the benchmarks that run RL steps (bench.rollout, bench.store), supervised steps per agent:
# the compact agents keep the format from about 100 steps on (mgrpo_jax/presets.py) and their episodes then have a
# real run's lengths (12 generated tokens per episode on local, as after the preset's own 500: bench.rollout).
WARMSTART_STEPS = 100


def warmstart_arg(text: str) -> int | None:
    """A ``--warmstart-steps`` value: steps per agent, or ``preset`` (None): the preset's own ``warmstart.min_steps``,
    as far as its runs warm-start."""
    return None if text == "preset" else int(text)


def parse_sized(parser: argparse.ArgumentParser, argv: Sequence[str] | None, quick: Sequence[str],
                full: Sequence[str] = ()) -> argparse.Namespace:
    """Parses ``argv`` (default ``sys.argv[1:]``) with the benchmark's sizes: ``--quick`` (tiny sizes, seconds: every
    code path, what CI runs) puts ``quick``'s flags first, ``--full`` (the long version, where the default is a cut of
    it that runs in minutes) puts ``full``'s; flags given beside either still apply. Adds both flags to ``parser``."""
    parser.add_argument("--quick", action="store_true", help="tiny sizes, seconds: " + " ".join(quick))
    if full:
        parser.add_argument("--full", action="store_true", help="the long version: " + " ".join(full))
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parser.parse_args(argv)
    if args.quick and getattr(args, "full", False):
        parser.error("--quick and --full: one or the other")
    mode = quick if args.quick else full if getattr(args, "full", False) else ()
    return parser.parse_args([*mode, *argv]) if mode else args


def emit(figures: dict) -> None:
    """Print the benchmark's figures as ONE JSON object on the last line of stdout."""
    print(json.dumps(figures, sort_keys=True), flush=True)
