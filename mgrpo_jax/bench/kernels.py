"""Kernel benchmark: rewards -> alignment -> advantages -> policy loss + gradient, fused in one jit.

    python -m mgrpo_jax.bench.kernels [--queries 64 --rollouts 8 --d_max 8 --seq_len 2048]

The kernels are elementwise/reduction work over [rows, T] arrays, so they should be memory-bound: the
figure of merit is the achieved bandwidth (bytes of the token arrays read plus the gradients written,
divided by time), compared with this machine's copy bandwidth measured in the same run (a jitted copy
of an array of the same size, read + write bytes). Last line: one JSON object.
"""

import argparse
import platform
import statistics
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
    args = parser.parse_args(argv)
    q, k, d, t = args.queries, args.rollouts, args.d_max, args.seq_len

    host = make_inputs(q, k, d, t)
    batch = {name: jnp.asarray(value) for name, value in host.items()}
    key = jax.random.key(0)
    # The log-prob buffers are donated and the gradients written in place, as a train step donates its
    # batch: without it every call maps ~38 MB of fresh output pages, and first-touch page faults (not
    # the kernels) dominate the time on a CPU.
    step = jax.jit(pipeline, static_argnames=("d_max", "loss_name"), donate_argnums=(1, 2))
    fresh = lambda: (jnp.array(batch["main_logprobs"]), jnp.array(batch["sub_logprobs"]))  # noqa: E731
    kernel = _time_donated(lambda lp: step(batch, *lp, key, d_max=d), fresh, args.repeats)
    fresh_alloc = jax.jit(pipeline, static_argnames=("d_max", "loss_name"))
    kernel_fresh = time_call(
        lambda: fresh_alloc(batch, batch["main_logprobs"], batch["sub_logprobs"], key, d_max=d),
        repeats=args.repeats,
    )

    token_bytes = sum(host[name].nbytes for name in host if name.startswith(("main_", "sub_")))
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
