"""Kernel benchmark: rewards -> alignment -> advantages -> policy loss + gradient, fused in one jit.

    python -m mgrpo_jax.bench.kernels [--queries 64 --rollouts 8 --d_max 8 --seq_len 2048]

The kernels are elementwise/reduction work over [rows, T] arrays, so they should be memory-bound: the
figure of merit is the achieved bandwidth (bytes of the token arrays read plus the gradients written,
divided by time), compared with this machine's copy bandwidth measured in the same run (a jitted copy
of an array of the same size, read + write bytes). Last line: one JSON object.

Two things about XLA:CPU (jaxlib 0.10) decide the figure, both measured here rather than assumed:

* Fresh pages. glibc serves every block over 32 MiB with its own mmap and unmaps it on free, so each
  [4096, 2048] f32 temporary XLA allocates costs first-touch page faults on every call (~1 GB/s, far
  below memory bandwidth). A long-running trainer wants freed blocks reused; `reuse_freed_memory()`
  tells glibc to keep them (mallopt, process-wide; it only takes effect when set before the big
  allocations, so `main` sets it first). Then `kernel_gb_per_s` is comparable with the copy baselines,
  which also write into already-mapped memory. `--default_malloc` leaves glibc alone, for comparison.
* Reductions do not fuse their elementwise producers on XLA:CPU (the YNNPACK reduce fusion only
  takes a few op kinds; the native emitter splits reductions into unfused reduce-windows), so the
  loss's forward materialises [rows, T] temporaries (the ratio and the clipped surrogate):
  `hlo_row_by_t_buffers` counts them in the optimised HLO (at the sub-agent shape). Measured and
  rejected: a custom_vjp recomputing the ratio in the backward, select-free clip formulations and
  `--xla_cpu_experimental_ynn_fusion_type=` (YNNPACK off) each kept >= 2 temporaries and were slower
  (a copy of the donated log-probs, or materialised broadcasts), so core/losses.py keeps plain autodiff.
  `XLA_FLAGS` set by the caller are honoured and reported.
"""

import argparse
import ctypes
import os
import platform
import re
import statistics
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

from mgrpo_jax.bench.common import emit, time_call
from mgrpo_jax.core import (
    PolicyLossInputs,
    align,
    get_loss,
    main_advantages,
    main_reward,
    sub_advantages,
    sub_reward,
)


def make_inputs(q: int, k: int, d: int, t: int, seed: int = 0) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    lengths_main = rng.integers(t // 4, t + 1, size=q * k)
    lengths_sub = rng.integers(t // 8, t + 1, size=q * k * d)

    def token_arrays(rows, lengths):
        logprobs = -rng.exponential(1.0, size=(rows, t)).astype(np.float32)
        old = logprobs + rng.normal(0.0, 0.05, size=(rows, t)).astype(np.float32)
        mask = (np.arange(t)[None, :] < lengths[:, None]).astype(np.float32)
        return logprobs, old, mask

    lp_m, old_m, mask_m = token_arrays(q * k, lengths_main)
    lp_s, old_s, mask_s = token_arrays(q * k * d, lengths_sub)
    return {
        "format_ok": rng.random((q, k)) < 0.9,
        "correct": (rng.random((q, k)) < 0.4).astype(np.float32),
        "sub_format_ok": rng.random((q, k, d)) < 0.9,
        "expert": rng.random((q, k, d)).astype(np.float32),
        "counts": rng.integers(0, 2 * d, size=(q, k)).astype(np.int32),
        "main_logprobs": lp_m, "main_old": old_m, "main_mask": mask_m,
        "sub_logprobs": lp_s, "sub_old": old_s, "sub_mask": mask_s,
    }


def pipeline(batch, main_logprobs, sub_logprobs, key, d_max: int, loss_name: str = "grpo"):
    """One M-GRPO step's kernels for both agents; returns both losses and d(loss)/d(logprobs)."""
    loss_fn = get_loss(loss_name)
    rewards_main = main_reward(batch["format_ok"], batch["correct"])
    adv_main = main_advantages(rewards_main)
    _, weight = align(batch["counts"], d_max, key)
    rewards_sub = sub_reward(batch["sub_format_ok"], batch["correct"][..., None], batch["expert"])
    adv_sub = sub_advantages(rewards_sub, weight)

    def objective(logprobs, old, mask, advantages, weights):
        loss_sum, denominator, _ = loss_fn(PolicyLossInputs(logprobs, old, advantages, mask, weights))
        return loss_sum / denominator

    grad = jax.value_and_grad(objective)
    main = grad(main_logprobs, batch["main_old"], batch["main_mask"], adv_main.reshape(-1), None)
    sub = grad(sub_logprobs, batch["sub_old"], batch["sub_mask"], adv_sub.reshape(-1), weight.reshape(-1))
    return main, sub


def reuse_freed_memory() -> bool:
    """Ask glibc to keep freed memory mapped (no mmap for big blocks, no trimming); False if not glibc."""
    if not sys.platform.startswith("linux") or platform.libc_ver()[0] != "glibc":
        return False
    libc = ctypes.CDLL("libc.so.6")
    m_trim_threshold, m_mmap_max = -1, -4  # <malloc.h>
    return bool(libc.mallopt(m_mmap_max, 0)) and bool(libc.mallopt(m_trim_threshold, 1 << 40))


def row_by_t_buffers(compiled_text: str, rows: int, t: int) -> int:
    """How many [rows, t] arrays the optimised HLO's entry computation writes (outputs included)."""
    entry = compiled_text[compiled_text.index("ENTRY"):]
    shape = re.compile(rf"= f32\[{rows},{t}\]")
    return sum(1 for line in entry.splitlines() if shape.search(line) and "parameter(" not in line)


def _time_donated(fn, make_args, repeats: int) -> dict[str, float]:
    """Like `time_call`, for a function that donates its argument: fresh arguments are built untimed."""
    samples = []
    for i in range(repeats + 1):
        args = jax.block_until_ready(make_args())
        start = time.perf_counter()
        jax.block_until_ready(fn(args))
        if i:  # the first call compiles
            samples.append(time.perf_counter() - start)
    return {"median_s": statistics.median(samples), "min_s": min(samples), "samples_s": samples}


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--queries", type=int, default=64)
    parser.add_argument("--rollouts", type=int, default=8)
    parser.add_argument("--d_max", type=int, default=8)
    parser.add_argument("--seq_len", type=int, default=2048)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--default_malloc", action="store_true",
                        help="keep glibc's default of unmapping big freed blocks (page faults on every call)")
    args = parser.parse_args(argv)
    reused = False if args.default_malloc else reuse_freed_memory()
    q, k, d, t = args.queries, args.rollouts, args.d_max, args.seq_len

    host = make_inputs(q, k, d, t)
    batch = {name: jnp.asarray(value) for name, value in host.items()}
    key = jax.random.key(0)
    # The log-prob buffers are donated and the gradients written in place, as a train step donates its
    # batch (otherwise every call also maps ~38 MB of fresh output pages).
    step = jax.jit(pipeline, static_argnames=("d_max", "loss_name"), donate_argnums=(1, 2))
    fresh = lambda: (jnp.array(batch["main_logprobs"]), jnp.array(batch["sub_logprobs"]))  # noqa: E731
    run_step = lambda lp: step(batch, *lp, key, d_max=d)  # noqa: E731
    compiled = step.lower(batch, batch["main_logprobs"], batch["sub_logprobs"], key, d_max=d).compile()
    temporaries = row_by_t_buffers(compiled.as_text(), q * k * d, t) - 1  # minus the gradient output

    kernel = _time_donated(run_step, fresh, args.repeats)
    fresh_alloc = jax.jit(pipeline, static_argnames=("d_max", "loss_name"))
    kernel_fresh = time_call(
        lambda: fresh_alloc(batch, batch["main_logprobs"], batch["sub_logprobs"], key, d_max=d),
        repeats=args.repeats,
    )

    # Bytes the kernels must move at least: log-probs, old log-probs and mask of both agents read once,
    # and both gradients written once. (Rewards/advantages/alignment arrays are O(Q*K*D), negligible.)
    token_bytes = sum(host[f"{agent}_{name}"].nbytes
                      for agent in ("main", "sub") for name in ("logprobs", "old", "mask"))
    grad_bytes = host["main_logprobs"].nbytes + host["sub_logprobs"].nbytes
    moved = token_bytes + grad_bytes

    # This machine's copy bandwidth, same run, read + write bytes of an array as large as the token
    # inputs: memcpy into a preallocated buffer (numpy) and a jitted in-place (donated) copy; the higher.
    host_src = np.random.default_rng(1).random(token_bytes // 4, dtype=np.float32)
    host_dst = np.empty_like(host_src)
    numpy_copy = time_call(lambda: np.copyto(host_dst, host_src), repeats=args.repeats)
    numpy_copy_gb_per_s = 2 * host_src.nbytes / numpy_copy["median_s"] / 1e9
    source = jnp.asarray(host_src)
    copy = jax.jit(lambda x, out: out.at[:].set(x), donate_argnums=1)
    jax_copy = _time_donated(lambda out: copy(source, out), lambda: jnp.empty_like(source), args.repeats)
    jax_copy_gb_per_s = 2 * source.nbytes / jax_copy["median_s"] / 1e9
    copy_gb_per_s = max(numpy_copy_gb_per_s, jax_copy_gb_per_s)

    kernel_gb_per_s = moved / kernel["median_s"] / 1e9
    figures = {
        "shape": {"Q": q, "K": k, "D": d, "T": t, "main_rows": q * k, "sub_rows": q * k * d},
        "kernel_ms": 1e3 * kernel["median_s"],
        "kernel_ms_min": 1e3 * kernel["min_s"],
        "bytes_moved_mb": moved / 1e6,
        "kernel_gb_per_s": kernel_gb_per_s,
        "copy_gb_per_s": copy_gb_per_s,
        "kernel_fresh_alloc_gb_per_s": moved / kernel_fresh["median_s"] / 1e9,
        "reuse_freed_memory": reused,
        "hlo_row_by_t_buffers": temporaries,
        "xla_flags": os.environ.get("XLA_FLAGS", ""),
        "numpy_copy_gb_per_s": numpy_copy_gb_per_s,
        "jax_copy_gb_per_s": jax_copy_gb_per_s,
        "fraction_of_copy": kernel_gb_per_s / copy_gb_per_s,
        "backend": jax.default_backend(),
        "devices": jax.device_count(),
        "cpu": platform.processor() or platform.machine(),
    }
    print(f"rewards->alignment->advantages->loss+grad  Q={q} K={k} D={d} T={t}: "
          f"{figures['kernel_ms']:.1f} ms, {kernel_gb_per_s:.2f} GB/s "
          f"({100 * figures['fraction_of_copy']:.0f}% of the {copy_gb_per_s:.2f} GB/s copy bandwidth)")
    emit(figures)
    return figures


if __name__ == "__main__":
    main()
