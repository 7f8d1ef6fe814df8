"""Kernel benchmark: `mgrpo_targets` (rewards -> alignment -> advantages of both agents) and each agent's registered
policy loss with its gradient over the log-probs: what an RL step runs around the model.

    python -m mgrpo_jax.bench.kernels [--queries 64 --rollouts 8 --d_max 8 --seq_len 2048 --preset paper]
    python -m mgrpo_jax.bench.kernels --quick          # Q=K=D=2, T=64, one timed call: the code path in seconds

The functions timed are the trainer's own: `mgrpo_jax.core.mgrpo.mgrpo_targets` with the preset's
`TargetsConfig.from_config` (its reward weights, alignment mode and advantage estimator; `d_max` from
`--d_max`), then, for each agent, `jax.value_and_grad` over the log-probs of the loss its config names (the
`mgrpo_jax.core.losses` registry, `--loss` to override; grpo by default) with the config's `loss_hparams` over the
loss's own defaults, as `Learner` builds it. The main agent's Q*K rows take the targets' main advantages; the
sub-agent's Q*K*D aligned rows its advantages and alignment weights, as `rollout.batches.sub_batch` lays them
out. Rollout arrays are random ([Q, K, C] calls with C = 2D, d_k in 0..2D-1, so alignment duplicates and drops).

Both programs are compiled ahead of time (``compile_ms``, with ``targets_compile_ms`` and
``loss_grad_compile_ms``, is lowering + compilation, never in a timed figure), called once untimed, then
``--repeats`` times: ``kernel_ms`` is the median of the whole (targets, then both losses and gradients on the
targets' device arrays), ``targets_ms`` and ``loss_grad_ms`` the medians of each alone.

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
import dataclasses
import functools
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
from mgrpo_jax.config import get_config
from mgrpo_jax.core import PolicyLossInputs, RolloutArrays, TargetsConfig, get_loss, mgrpo_targets

QUICK = ["--queries", "2", "--rollouts", "2", "--d_max", "2", "--seq_len", "64", "--repeats", "1"]


def make_inputs(q: int, k: int, d: int, t: int, seed: int = 0) -> dict[str, np.ndarray]:
    """Random rollout arrays (`RolloutArrays` fields, C = 2d calls) and both agents' token arrays."""
    rng = np.random.default_rng(seed)
    calls = 2 * d
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
        "sub_format_ok": rng.random((q, k, calls)) < 0.9,
        "sub_expert": rng.random((q, k, calls)).astype(np.float32),
        "counts": rng.integers(0, calls, size=(q, k)).astype(np.int32),
        "main_logprobs": lp_m, "main_old": old_m, "main_mask": mask_m,
        "sub_logprobs": lp_s, "sub_old": old_s, "sub_mask": mask_s,
    }


def rollout_arrays(batch: dict) -> RolloutArrays:
    return RolloutArrays(*(batch[name] for name in RolloutArrays._fields))


def agent_loss(agent_cfg, name: str | None = None):
    """The registered loss `Learner` trains `agent_cfg` with: its name (or `name`), the config's set `loss_hparams`
    over the loss's own defaults (which `get_loss` applies)."""
    hparams = {k: v for k, v in agent_cfg.loss_hparams.to_dict().items() if v is not None}
    return functools.partial(get_loss(name or agent_cfg.loss), **hparams)


def losses_and_grads(tokens: dict, main_logprobs, sub_logprobs, main_advantages, sub_advantages, sub_weight, *,
                     main_loss, sub_loss):
    """Both agents' objectives (loss_sum / denominator) and d(objective)/d(log-probs), from the targets' arrays."""

    def value_and_grad(loss_fn, logprobs, old, mask, advantages, weights):
        def objective(lp):
            loss_sum, denominator, _ = loss_fn(PolicyLossInputs(lp, old, advantages, mask, weights))
            return loss_sum / denominator

        return jax.value_and_grad(objective)(logprobs)

    main = value_and_grad(main_loss, main_logprobs, tokens["main_old"], tokens["main_mask"],
                          main_advantages.reshape(-1), None)
    sub = value_and_grad(sub_loss, sub_logprobs, tokens["sub_old"], tokens["sub_mask"], sub_advantages.reshape(-1),
                         sub_weight.reshape(-1))
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


def _compile(lowered) -> tuple[object, float]:
    start = time.perf_counter()
    compiled = lowered.compile()
    return compiled, time.perf_counter() - start


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--queries", type=int, default=64)
    parser.add_argument("--rollouts", type=int, default=8)
    parser.add_argument("--d_max", type=int, default=8)
    parser.add_argument("--seq_len", type=int, default=2048)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--preset", default="paper",
                        help="the xbench preset whose reward weights, estimator and losses are timed")
    parser.add_argument("--loss", default=None, help="a registered loss for both agents (default: each agent's)")
    parser.add_argument("--default_malloc", action="store_true",
                        help="keep glibc's default of unmapping big freed blocks (page faults on every call)")
    parser.add_argument("--quick", action="store_true", help="tiny sizes, seconds: " + " ".join(QUICK))
    args = parser.parse_args(argv)
    if args.quick:  # the quick sizes first, so flags given beside --quick still override them
        args = parser.parse_args([*QUICK, *(argv if argv is not None else sys.argv[1:])])
    reused = False if args.default_malloc else reuse_freed_memory()
    q, k, d, t = args.queries, args.rollouts, args.d_max, args.seq_len

    config = get_config("xbench", args.preset)
    targets_config = dataclasses.replace(TargetsConfig.from_config(config), d_max=d)
    main_loss, sub_loss = agent_loss(config.main, args.loss), agent_loss(config.sub, args.loss)
    loss_names = {"main": args.loss or config.main.loss, "sub": args.loss or config.sub.loss}

    host = make_inputs(q, k, d, t)
    batch = {name: jnp.asarray(value) for name, value in host.items()}
    arrays = rollout_arrays(batch)
    tokens = {name: batch[name] for name in ("main_old", "main_mask", "sub_old", "sub_mask")}
    key = jax.random.key(0)

    targets_c, targets_compile_s = _compile(mgrpo_targets.lower(arrays, key, targets_config))
    first = jax.block_until_ready(targets_c(arrays, key))
    advantage_args = (first.main_advantages, first.sub_advantages, first.sub_weight)
    # The log-prob buffers are donated and the gradients written in place, as a train step donates its
    # batch (otherwise every call also maps ~38 MB of fresh output pages).
    loss_grad = jax.jit(functools.partial(losses_and_grads, main_loss=main_loss, sub_loss=sub_loss),
                        donate_argnums=(1, 2))
    loss_grad_c, loss_grad_compile_s = _compile(
        loss_grad.lower(tokens, batch["main_logprobs"], batch["sub_logprobs"], *advantage_args))
    temporaries = row_by_t_buffers(loss_grad_c.as_text(), q * k * d, t) - 1  # minus the gradient output
    fresh = lambda: (jnp.array(batch["main_logprobs"]), jnp.array(batch["sub_logprobs"]))  # noqa: E731

    def whole(lp, compiled=loss_grad_c):
        targets = targets_c(arrays, key)
        return compiled(tokens, *lp, targets.main_advantages, targets.sub_advantages, targets.sub_weight)

    kernel = _time_donated(whole, fresh, args.repeats)
    targets_alone = time_call(lambda: targets_c(arrays, key), repeats=args.repeats)
    loss_grad_alone = _time_donated(lambda lp: loss_grad_c(tokens, *lp, *advantage_args), fresh, args.repeats)
    fresh_alloc = jax.jit(functools.partial(losses_and_grads, main_loss=main_loss, sub_loss=sub_loss)).lower(
        tokens, batch["main_logprobs"], batch["sub_logprobs"], *advantage_args).compile()
    kernel_fresh = time_call(lambda: whole((batch["main_logprobs"], batch["sub_logprobs"]), fresh_alloc),
                             repeats=args.repeats)

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
        "shape": {"Q": q, "K": k, "D": d, "T": t, "main_rows": q * k, "sub_rows": q * k * d, "calls": 2 * d},
        "timed": "mgrpo_targets + value_and_grad(registered loss) per agent",
        "preset": args.preset,
        "loss": loss_names,
        "estimator": targets_config.estimator,
        "align_mode": targets_config.align_mode,
        "kernel_ms": 1e3 * kernel["median_s"],
        "kernel_ms_min": 1e3 * kernel["min_s"],
        "targets_ms": 1e3 * targets_alone["median_s"],
        "loss_grad_ms": 1e3 * loss_grad_alone["median_s"],
        "compile_ms": 1e3 * (targets_compile_s + loss_grad_compile_s),
        "targets_compile_ms": 1e3 * targets_compile_s,
        "loss_grad_compile_ms": 1e3 * loss_grad_compile_s,
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
        "load_avg_1m": os.getloadavg()[0],
    }
    print(f"mgrpo_targets + loss and gradient ({loss_names['main']}/{loss_names['sub']})  Q={q} K={k} D={d} T={t}: "
          f"{figures['kernel_ms']:.1f} ms (targets {figures['targets_ms']:.2f} ms, loss+grad "
          f"{figures['loss_grad_ms']:.1f} ms; compiled beforehand in {figures['compile_ms']:.0f} ms), "
          f"{kernel_gb_per_s:.2f} GB/s ({100 * figures['fraction_of_copy']:.0f}% of the {copy_gb_per_s:.2f} GB/s "
          "copy bandwidth)")
    emit(figures)
    return figures


if __name__ == "__main__":
    main()
