"""The two halves of an M-GRPO step around its shared targets (`Trainer.rl_step` calls them in order).

  main_rollout  the main side's rollout, its judge arrays (published to the sub side) and its metrics;
  main_rows     the top-level agent's Q*K rows with their advantages;
  sub_rows      the sub-agent's rows: the Q*K*D aligned ones (`mgrpo`), none (`frozen_sub`), or the FIFO chunks
                popped this step (`mgrpo_unsync`, mgrpo_jax/train/unsync.py).
"""

from __future__ import annotations

import time

import numpy as np

from mgrpo_jax.core import d_histogram
from mgrpo_jax.env.prompts import SUB
from mgrpo_jax.rollout import batches
from mgrpo_jax.rollout.rewards import rollout_arrays
from mgrpo_jax.train import evaluation, system, unsync
from mgrpo_jax.train.seeds import derive_seed


def main_rollout(run):
    """(rollout, judge arrays, metrics with the rollout's `time/*`) of step `run.step`."""
    cfg = run.config
    metrics = run.exchange.before_step(run.step)
    rollout = run.engine.run(next(run.iterator), cfg.rollout.samples, seed=derive_seed(cfg.seed, "rollout", run.step))
    start = time.perf_counter()
    if run.is_main_process:
        evaluation.log_transcripts(evaluation.transcripts_path(run.workdir), rollout, run.step,
                                   cfg.train.log_transcripts)
    sub_tools = run.engine.sub.tool_names if run.engine.sub else None
    judge = system.reward_judge(cfg, run.env)
    arrays = rollout_arrays(rollout, judge, run.engine.top.tool_names, sub_tools, run.engine.grammar,
                            calls=cfg.rollout.max_sub_calls)
    run.exchange.publish(run.step, rollout, arrays)
    metrics.update(rollout.stats())
    metrics.update(judge.metrics())
    metrics.update({f"time/{k}": v for k, v in rollout.timings.items()})
    metrics["time/judge_s"] = time.perf_counter() - start
    return rollout, arrays, metrics


def main_rows(run, rollout, targets, stats) -> tuple[dict, dict]:
    name, agent = run.top_name, run.agents[run.top_name]
    metrics = {f"{name}/{k}": stats[f"main_{k}"] for k in ("reward", "correct", "format_ok", "zero_std_groups")}
    length = batches.bucket_length([len(e.tokens) for e in rollout.episodes(name)], agent.config.context_tokens)
    return metrics, batches.top_batch(rollout.top, targets.main_advantages, length, agent.tokenizer.pad_id,
                                      temperature=run.config.rollout.temperature)


def sub_rows(run, received, targets, stats) -> tuple[dict, list[dict]]:
    cfg, agent, counts = run.config, run.agents[SUB], np.asarray(received.arrays.counts)
    hist = d_histogram(counts, max_bin=max(cfg.rollout.d_max * 2, 1))
    out = {f"d_k/hist/{i}": int(c) for i, c in enumerate(hist)}
    out["sub/reward"] = stats["sub_reward"]
    if counts.max() > 0:
        out.update({"sub/expert": stats["sub_expert"], "sub/format_ok": stats["sub_format_ok"]})
    if cfg.mode == "mgrpo_unsync":  # pops the chunks waiting even when this step delegated nothing
        records = unsync.step_records(received.rollout, targets.sub_call_reward, run.step, received.versions,
                                      cfg.rollout.temperature)
        chunks, metrics = unsync.unsync_step(
            run.fifo, run.fifo_consumer, records, chunk=cfg.rollout.unsync_chunk, group=cfg.rollout.samples,
            seed=derive_seed(cfg.seed, "unsync", run.step), start_version=int(agent.state.step),
            passes=agent.config.passes, seq_len_limit=agent.config.context_tokens, pad_id=agent.tokenizer.pad_id,
            advantages=run.targets_config.advantages, timeout_s=float(cfg.decoupled.timeout_s))
        return {**out, **metrics}, chunks
    if counts.max() == 0:
        return out, []
    out["sub/zero_std_groups"] = stats["sub_zero_std_groups"]
    if not agent.trainable:
        return out, []
    length = batches.bucket_length([len(s.tokens) for s in received.rollout.episodes(SUB)],
                                   agent.config.context_tokens)
    return out, [batches.sub_batch(received.rollout.top, targets.sub_index, targets.sub_weight, targets.sub_advantages,
                                   length, agent.tokenizer.pad_id, temperature=cfg.rollout.temperature)]


def with_timings(metrics: dict, rollout, t0: float, t1: float, t2: float, t3: float) -> dict:
    """Adds the step's `time/*` (t0 start, t1 data in, t2 batches built, t3 trained) and, on the main side, the
    `throughput/*` of its rollout."""
    metrics.update({"time/rewards_s": t2 - t1 + metrics.pop("time/judge_s", 0.0), "time/training_s": t3 - t2,
                    "time/step_s": t3 - t0})
    if rollout is not None:
        metrics["time/other_s"] = t3 - t0 - sum(metrics[f"time/{k}"] for k in ("sampling_s", "tools_s", "rewards_s",
                                                                               "training_s"))
        metrics["throughput/episodes_per_s"] = sum(1 for _ in rollout.episodes()) / (t3 - t0)
        metrics["throughput/generated_tokens_per_s"] = sum(e.generated_tokens for e in rollout.episodes()) / (t3 - t0)
    return metrics


def unsync_fifo(run) -> tuple:
    """(the store's FIFO of sub-agent trajectories, the sub trainer's consumer) in `mgrpo_unsync` mode where this
    process trains the sub-agent; (None, None) otherwise."""
    if run.config.mode != "mgrpo_unsync" or SUB not in run.agents:
        return None, None
    fifo = run.store.fifo("sub_trajectories")
    return fifo, fifo.consumer("sub_trainer")


def shown(metrics: dict, top_name: str) -> dict:
    """The figures of a step's bar and log line: rewards, correctness, the sub job's serving figures, seconds."""
    keys = (f"{top_name}/reward", f"{top_name}/correct", "sub/reward", "sub/served", "sub/staleness", "time/step_s")
    return {k: metrics[k] for k in keys if k in metrics}
