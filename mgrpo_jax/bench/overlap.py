"""Synchronous vs asynchronous M-GRPO steps (`config.async_rl`, docs/async.md) in one run on 8 forced CPU devices.

    python -m mgrpo_jax.bench.overlap            # local preset, 100 warm-start steps, 2 timed steps of each kind
    python -m mgrpo_jax.bench.overlap --full     # 3 timed steps of each kind after up to 6 untimed ones
    python -m mgrpo_jax.bench.overlap --quick    # smoke preset, 2-step warm start, 1 step of each kind: every path

One `Trainer` of the preset with `async_rl.enabled` and `async_rl.rollout_devices = 2`: of the 8 devices, the main
agent trains on 0-1 and samples on 2-3, the sub-agent trains on 4-5 and samples on 6-7. It warm-starts, then runs
`--steps` synchronous RL steps (the trainer's own loop, each agent sampling and training on its training devices;
the asynchronous sampler set aside), then `--steps` asynchronous ones (the sampler thread on the sampling devices,
`--max-staleness` versions ahead), each after untimed ones until one compiles nothing (at most
`--max-warmup-steps`). Per kind it reports the median wall time of an RL step (`*_step_s`; the mean beside it, and
the compiles the timed steps still ran) and the busy shares of the timed wall time: the samplers' (whole-system
rollouts and their judges) and the learners' (credit, rows, correction, updates, weight pushes: the steps less
their waits for rollouts). `wall_ratio` is the synchronous step's median wall time over the asynchronous one's
(> 1: the overlap is faster).

The last stdout line also holds a projection for the `paper` preset on v5p-64 (`paper_*`, `projection_model`), from
the model in `paper_projection`: phase times from a roofline of the preset's sizes, the overlap from the slot
utilisation bench.rollout measured. It is a model, not a measurement: docs/async.md says what it assumes.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time

from mgrpo_jax.bench.common import emit, host_devices, parse_sized, warmstart_arg

QUICK = ["--preset", "smoke", "--warmstart-steps", "2", "--max-warmup-steps", "1", "--steps", "1"]
# The default (2 untimed and 2 timed steps of each kind) runs in about 3 minutes on 2 cores; --full is longer.
FULL = ["--max-warmup-steps", "6", "--steps", "3"]
DEVICES, ROLLOUT_DEVICES = 8, 2
# The slot engine's decode-slot utilisation (sampled tokens / slot steps) that `python -m mgrpo_jax.bench.rollout
# --workload=local --local-warmstart-steps preset` measured on 500-step agents (docs/benchmarks.md, issue 37).
SLOT_UTILISATION = 0.70

# v5p, per chip (Google's published figures): bf16 peak and HBM bandwidth.
V5P_FLOPS, V5P_HBM_BYTES_PER_S, V5P64_CHIPS = 459e12, 2.765e12, 32


def paper_projection(utilisation: float, *, generated_tokens: int = 1024, row_tokens: int = 8192,
                     train_mfu: float = 0.35, decode_bandwidth: float = 0.6) -> dict:
    """The `paper` preset's step on v5p-64 (each agent's model on its own 32 chips, as bench.plan plans two models),
    synchronous and asynchronous, from a roofline model:

    - training L: 6 x active parameters x trained tokens x passes / (chips x peak x `train_mfu`), each agent's rows
      (main Q*K, sub Q*K*D) of `row_tokens` tokens; the asynchronous step adds one forward (2 x) for the proximal
      log-probs of stale rows;
    - sampling S: a decode step reads every weight and each slot's KV once, at `decode_bandwidth` of HBM; a main
      episode decodes `generated_tokens` tokens and waits on its d_max delegations, one after another, each
      decoding as many on the sub-agent's chips (whose slots decode the step's Q*K*D delegations at once);
    - the asynchronous step on the same chips (`async_rl.rollout_devices = 0`) fills the decode slots' idle share
      (1 - `utilisation`, bench.rollout's measured figure) with the learner's work: max(S, L, utilisation x S + L),
      against S + L.
    """
    from mgrpo_jax.config import get_config
    from mgrpo_jax.model import get_model_config

    config = get_config("xbench", "paper")
    q, k, d = config.rollout.queries, config.rollout.samples, config.rollout.d_max
    out, decode_step, train, proximal = {}, {}, {}, {}
    for name, rows in (("main", q * k), ("sub", q * k * d)):
        agent = config[name]
        model = get_model_config(agent.model)
        active, total = model.num_params(active=True), model.num_params()
        flops_per_s = V5P64_CHIPS * V5P_FLOPS * train_mfu
        train[name] = 6 * active * rows * row_tokens * int(agent.passes) / flops_per_s
        proximal[name] = 2 * active * rows * row_tokens / flops_per_s
        kv_per_token = 2 * model.n_layers * model.n_kv_heads * model.head_dim * 2  # K and V, bf16
        step_bytes = 2 * total + rows * (row_tokens / 2) * kv_per_token  # the KV half full on average
        decode_step[name] = step_bytes / (V5P64_CHIPS * V5P_HBM_BYTES_PER_S * decode_bandwidth)
    # A main episode decodes its own turns and waits on its d_max delegations, decoded on the sub-agent's chips.
    sample = {"main": generated_tokens * (decode_step["main"] + d * decode_step["sub"]),
              "sub": generated_tokens * d * decode_step["sub"]}
    sync_s = async_s = 0.0
    for name in ("main", "sub"):
        out.update({f"paper_{name}_training_s": train[name], f"paper_{name}_sampling_s": sample[name]})
        sync_s = max(sync_s, sample[name] + train[name])  # each agent on its own chips: the slower sets the pace
        learner = train[name] + proximal[name]
        async_s = max(async_s, sample[name], learner, utilisation * sample[name] + learner)
    out.update({"paper_v5p64_sync_step_s": sync_s, "paper_v5p64_async_step_s": async_s,
                "paper_v5p64_wall_ratio": sync_s / async_s, "paper_slot_utilisation": utilisation,
                "projection_model": f"roofline: train 6*N_active*tokens at MFU {train_mfu:.2f}, decode weights+KV at "
                                    f"{100 * decode_bandwidth:.0f}% HBM bandwidth, {generated_tokens} generated tokens "
                                    f"per episode, {row_tokens}-token rows; async = max(S, L, u*S + L) with u "
                                    "bench.rollout's slot utilisation"})
    return out


def run_phase(trainer, timer, steps: int, most_warmup: int, label: str) -> dict:
    """Untimed RL steps until one compiles nothing (at most `most_warmup`), then `steps` timed ones: their wall
    times, the seconds of them the samplers were busy (synchronous: each step's `time/collect_s`; asynchronous: the
    sampler thread's rollouts within the timed window), the seconds the learner waited for rollouts (synchronous:
    the same; asynchronous: its waits in `AsyncRollouts.take`) and the compiles the timed steps still ran."""
    from mgrpo_jax.bench.rollout import warm_up

    warm = warm_up(trainer, timer, 1, most_warmup, quiet=1, label=f"{label} untimed")
    rollouts, collected, waited, walls = trainer.rollouts, 0.0, 0.0, []
    start = time.perf_counter()
    for _ in range(steps):
        began = time.perf_counter()
        metrics = trainer.rl_step()
        walls.append(time.perf_counter() - began)
        collected += metrics["time/collect_s"]
        waited += metrics.get("async/wait_s", metrics["time/collect_s"])
        print(f"{label} rl step {trainer.step}: {walls[-1]:.2f} s", flush=True)
    end = time.perf_counter()
    busy = collected if rollouts is None else rollouts.sampler_busy_s(start, end)
    return {"wall_s": end - start, "step_s": statistics.median(walls), "step_mean_s": (end - start) / steps,
            "sampler_busy_s": busy, "waited_s": waited, "compiles": timer.compiles,
            "warmup_steps": warm["warmup_steps_run"]}


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--preset", default="local")
    parser.add_argument("--warmstart-steps", type=warmstart_arg, default=100,
                        help="supervised steps per agent before RL (`preset`: the preset's own minimum)")
    parser.add_argument("--max-warmup-steps", type=int, default=2,
                        help="untimed RL steps before each kind's timed ones, until one compiles nothing")
    parser.add_argument("--steps", type=int, default=2, help="timed RL steps of each kind")
    parser.add_argument("--max-staleness", type=int, default=1)
    parser.add_argument("--utilisation", type=float, default=SLOT_UTILISATION,
                        help="the projection's decode-slot utilisation (default: bench.rollout's on local)")
    args = parse_sized(parser, argv, QUICK, FULL)
    devices = host_devices(DEVICES)

    from mgrpo_jax.bench.rollout import ComputeTimer, prepare_config
    from mgrpo_jax.rl.trainer import Trainer
    from mgrpo_jax.sampling import observe

    total = 2 * (args.max_warmup_steps + args.steps)
    config, warm = prepare_config("xbench", args.preset, args.warmstart_steps, total, "bench-overlap")
    config.train.eval_every, config.train.eval_at_start = 0, False
    config.async_rl.enabled, config.async_rl.max_staleness = True, args.max_staleness
    config.async_rl.rollout_devices = ROLLOUT_DEVICES if devices >= DEVICES else 0
    out = {"preset": args.preset, "devices": devices, "warmstart_steps": warm, "steps": args.steps,
           "max_staleness": args.max_staleness, "rollout_devices": config.async_rl.rollout_devices,
           "split": "main trains on devices 0-1 and samples on 2-3, sub trains on 4-5 and samples on 6-7 (async); "
                    "sync samples and trains on the training devices"}
    with tempfile.TemporaryDirectory(prefix="bench-overlap-") as workdir:
        trainer = Trainer(config, workdir)
        start = time.perf_counter()
        trainer.warm_start()
        out["warmstart_s"] = time.perf_counter() - start
        rollouts, trainer.rollouts = trainer.rollouts, None  # the synchronous phase: the trainer's own loop
        with observe(ComputeTimer()) as timer:
            sync = run_phase(trainer, timer, args.steps, args.max_warmup_steps, "sync")
            trainer.rollouts = rollouts
            try:
                asynchronous = run_phase(trainer, timer, args.steps, args.max_warmup_steps, "async")
            finally:
                trainer.stop_rollouts()
    for name, phase in (("sync", sync), ("async", asynchronous)):
        wall = phase["wall_s"]
        out.update({f"{name}_step_s": phase["step_s"], f"{name}_step_mean_s": phase["step_mean_s"],
                    f"{name}_sampler_busy_share": phase["sampler_busy_s"] / wall,
                    f"{name}_learner_busy_share": (wall - phase["waited_s"]) / wall,
                    f"{name}_timed_compiles": phase["compiles"], f"{name}_warmup_steps": phase["warmup_steps"]})
    out["wall_ratio"] = sync["step_s"] / asynchronous["step_s"]
    out.update(paper_projection(args.utilisation))
    emit(out)
    return out


if __name__ == "__main__":
    main()
