"""The sides of an M-GRPO step. Every mode and job runs the same loop over two of them, one `Side` protocol:

    collect(step, inputs) -> data     what the side's step trains on: the main side's rollouts of the step's
                                      questions; the sub side's view of them (by reference here, or served and
                                      cached in the decoupled sub job); None when there is nothing (more) to train
    rows(data, targets, stats, step)  its figures and its batch rows from the step's credit targets
    update(rows) -> metrics           its learner's policy update on those rows
    state() / load_state(host)        what a checkpoint keeps of it beyond its learner's arrays
    after_save(checkpoint_steps)      after each checkpoint: drops what the checkpoints make redundant
    version                           the policy version of its learner (what sampled the step's data)

    MainSide(learner, engine, ...)    the top-level agent (main, or the single agent): the whole-system rollouts and
                                      their judge arrays; rows are its Q*K episodes with their advantages
    RemoteMain()                      the decoupled sub job's main side: the main agent is the other job's
    SubSide(learner)                  the sub-agent: the Q*K*D aligned rows (`mgrpo`), none (`frozen_sub`: its
                                      learner is not trainable)
    UnsyncSubSide(learner, store, ..) the FIFO chunks popped this step (`mgrpo_unsync`, mgrpo_jax/rl/unsync.py)
    NoSubSide()                       no sub-agent here: the single agent's, or the decoupled main job's (the sub
                                      job trains it); its data is the main side's, for the credit
    ServingSubSide (rl/decoupled.py)  the decoupled sub job's sub side: collects by serving the main job's tasks

A `SidePair` updates both sides, each its own learner; a `PooledPair` (the shared-policy modes `matpo`,
`shared_mgrpo`) trains their one model once on both sides' rows pooled into one batch, each role weighted as
`rollout.shared_role_weighting` says. `build_sides` chooses them. Each row's sampling settings come from its
episode (`rollout.batches`).

Under MATPO's credit the sub rows are one per possible call, Q*K*C, most of them weight-0 padding: the sub side
keeps only the real ones, and the batch a learner trains on is padded to a bucketed size (`bucket_rows`: a few
sizes per run, each compiled once) instead of the whole Q*K*C. Weight-0 rows train nothing, so the update is the
same.
"""

from __future__ import annotations

import time
from typing import Protocol

import numpy as np

from mgrpo_jax.agent.step import batch_shards
from mgrpo_jax.config import SHARED_MODES, agent_names, credit_name, rl_batch_rows
from mgrpo_jax.core import TargetsConfig, d_histogram
from mgrpo_jax.core.losses import balance_roles, role_denominators
from mgrpo_jax.env.build import reward_judge
from mgrpo_jax.env.compact.world import TWINS
from mgrpo_jax.env.prompts import MAIN, SUB
from mgrpo_jax.rl import evaluation, unsync
from mgrpo_jax.rl.exchange import MainStep, SubStep
from mgrpo_jax.rollout import batches
from mgrpo_jax.rollout.judging import rollout_arrays
from mgrpo_jax.runtime.seeds import derive_seed
from mgrpo_jax.store import Record


def counterfactual_twin(config, step: int, stream: str = "twin") -> int:
    """The twin (1..TWINS) step `step`'s questions are posed in, or 0 (the world): a seeded draw per step with
    probability `rollout.counterfactual_share`. `stream` names the draws: the RL steps' ("twin") or the stage-2
    curriculum filter's batches' (mgrpo_jax/rl/curriculum.py)."""
    share = float(config.rollout.counterfactual_share)
    if not share:
        return 0
    rng = np.random.default_rng(derive_seed(config.seed, stream, step))
    return int(rng.integers(1, TWINS + 1)) if rng.random() < share else 0


def bucket_rows(needed: int, multiple: int, cap: int) -> int:
    """The row count a batch of `needed` rows is padded to: the next of 1, 2, 3, 4, 6, 8, 12, 16, ... (powers of two
    and 1.5 times them: at most a third of a batch is padding), rounded up to `multiple` (what the train step's
    micro-batches and row shards split) and at most `cap` (the unbucketed size, itself a multiple of `multiple`)."""
    power = 1 << max(int(needed) - 1, 0).bit_length()  # the smallest power of two >= needed
    size = power * 3 // 4 if power >= 4 and power * 3 // 4 >= needed else power
    return min(-(-size // multiple) * multiple, cap)


def row_multiple(learner) -> int:
    """What every batch of `learner`'s policy step must be a multiple of: its micro-batches times its row shards."""
    return int(learner.config.micro_batches) * batch_shards(learner.mesh)


def real_rows(rows: dict) -> dict:
    """The rows of weight > 0 of a policy batch (a train step gives the others no gradient and no denominator)."""
    keep = np.asarray(rows["weights"]) > 0
    return {key: value[keep] for key, value in rows.items()}


def trained_tokens(batch: dict) -> np.ndarray:
    """[B, T] the tokens the policy step trains (its `_trained_mask`: loss mask on real tokens, never column 0)."""
    mask = np.asarray(batch["loss_mask"], np.float32) * np.asarray(batch["attention_mask"], np.float32)
    mask[:, 0] = 0.0
    return mask


class Side(Protocol):
    """One side of the step (the module's docstring says what each method does)."""

    version: int

    def collect(self, step: int, inputs): ...

    def rows(self, data, targets, stats: dict, step: int) -> tuple[dict, object]: ...

    def update(self, rows) -> dict: ...

    def state(self) -> dict: ...

    def load_state(self, host: dict) -> None: ...

    def after_save(self, checkpoint_steps: list[int]) -> None: ...


class RemoteMain:
    """The main side in the decoupled sub job: the main agent collects, trains and counts versions in the other
    job, so here it collects nothing, has no rows and no updates."""

    version = 0  # never read: the sub job's exchange posts no tasks

    def collect(self, step: int, questions) -> None:
        return None

    def rows(self, data, targets, stats: dict, step: int) -> tuple[dict, None]:
        return {}, None

    def update(self, rows) -> dict:
        return {}

    def throughput(self, collected, seconds: float) -> dict:
        return {}

    def state(self) -> dict:
        return {}

    def load_state(self, host: dict) -> None:
        pass

    def after_save(self, checkpoint_steps: list[int]) -> None:
        """After a checkpoint of `checkpoint_steps` (the complete ones, oldest first): drop what they make redundant."""


class NoSubSide(RemoteMain):
    """No sub-agent learner in this job (the single agent's run, or the decoupled main job): the step's data is the
    main side's, for the credit; no rows, no updates."""

    def collect(self, step: int, collected: MainStep) -> SubStep:
        return SubStep(collected.rollout, collected.arrays, self.version, dict(collected.metrics))


class MainSide(RemoteMain):
    """The top-level agent's side. `transcripts`: how many rollouts a step writes to `transcripts.jsonl` in
    `workdir` (0: none, e.g. on every process but the first)."""

    def __init__(self, learner, engine, env, config, workdir: str, transcripts: int):
        self.learner, self.engine, self.env, self.config = learner, engine, env, config
        self.agent = agent_names(config.mode)[0]  # its figures' prefix (the learner may serve both agents)
        self.transcripts_path, self.transcripts = evaluation.transcripts_path(workdir), transcripts

    @property
    def version(self) -> int:
        return self.learner.version

    def collect(self, step: int, questions) -> MainStep:
        """Q*K whole-system rollouts of `questions` and their judge arrays, with the rollout's `time/*`; posed in a
        counterfactual twin of the compact world on a `rollout.counterfactual_share` of the steps."""
        twin = counterfactual_twin(self.config, step)
        if not twin:
            return self._collect(step, questions)
        with self.env.posed_in_twin(twin, questions) as posed:
            collected = self._collect(step, posed)
        collected.metrics["counterfactual/twin"] = twin
        return collected

    def _collect(self, step: int, questions) -> MainStep:
        cfg, engine = self.config, self.engine
        rollout = engine.run(questions, cfg.rollout.samples, seed=derive_seed(cfg.seed, "rollout", step))
        start = time.perf_counter()
        evaluation.log_transcripts(self.transcripts_path, rollout, step, self.transcripts)
        judge = reward_judge(cfg, self.env)
        arrays = rollout_arrays(rollout, judge, engine.top.tool_names, engine.sub.tool_names if engine.sub else None,
                                engine.grammar, calls=cfg.rollout.max_sub_calls)
        metrics = {**rollout.stats(), **judge.metrics(), **{f"time/{k}": v for k, v in rollout.timings.items()},
                   "time/judge_s": time.perf_counter() - start}
        return MainStep(rollout, arrays, metrics)

    def rows(self, collected: MainStep, targets, stats: dict, step: int) -> tuple[dict, dict]:
        """The agent's Q*K rows with their advantages, and its reward figures."""
        learner = self.learner
        metrics = {f"{self.agent}/{k}": stats[f"main_{k}"] for k in ("reward", "correct", "format_ok",
                                                                       "zero_std_groups")}
        top = collected.rollout.top
        length = batches.bucket_length([len(e.tokens) for row in top for e in row], learner.config.context_tokens)
        return metrics, batches.top_batch(top, targets.main_advantages, length, learner.tokenizer.pad_id)

    def update(self, rows: dict) -> dict:
        return self.learner.train(rows)

    def throughput(self, collected: MainStep, seconds: float) -> dict:
        episodes = list(collected.rollout.episodes())
        return {"throughput/episodes_per_s": len(episodes) / seconds,
                "throughput/generated_tokens_per_s": sum(e.generated_tokens for e in episodes) / seconds}


class SubSide(NoSubSide):
    """The sub-agent's side in the synchronised modes: the Q*K*D aligned rows of `mgrpo_targets`; a learner
    that is not trainable (`frozen_sub`) gets the figures only. Its data is the main side's rollout, by reference.
    `bucket_cap`: under MATPO's credit (one row per possible call), the Q*K*C rows of the unbucketed batch: its rows
    are then the real calls only, and its own learner trains on them padded to `bucket_rows(real, ..., bucket_cap)`
    (None: the whole aligned batch, as the credit gives it)."""

    def __init__(self, learner, bucket_cap: int | None = None):
        self.learner, self.bucket_cap = learner, bucket_cap

    @property
    def version(self) -> int:
        return self.learner.version

    def figures(self, data: SubStep, targets, stats: dict) -> dict:
        """The delegation histogram (up to twice D) and the sub-agent's reward figures."""
        counts = np.asarray(data.arrays.counts)
        hist = d_histogram(counts, max_bin=max(2 * targets.sub_index.shape[-1], 1))
        out = {f"d_k/hist/{i}": int(c) for i, c in enumerate(hist)}
        out["sub/reward"] = stats["sub_reward"]
        if counts.max() > 0:
            out.update({"sub/expert": stats["sub_expert"], "sub/format_ok": stats["sub_format_ok"]})
        return out

    def rows(self, data: SubStep, targets, stats: dict, step: int) -> tuple[dict, list[dict]]:
        out = self.figures(data, targets, stats)
        if np.asarray(data.arrays.counts).max() == 0:
            return out, []
        out["sub/zero_std_groups"] = stats["sub_zero_std_groups"]
        if not self.learner.trainable:
            return out, []
        learner = self.learner
        length = batches.bucket_length([len(s.tokens) for s in data.rollout.episodes(SUB)],
                                       learner.config.context_tokens)
        rows = batches.sub_batch(data.rollout.top, targets.sub_index, targets.sub_weight, targets.sub_advantages,
                                 length, learner.tokenizer.pad_id)
        return out, [rows if self.bucket_cap is None else real_rows(rows)]

    def update(self, rows: list[dict]) -> dict:
        if self.bucket_cap is not None:
            pad_id, multiple = self.learner.tokenizer.pad_id, row_multiple(self.learner)
            rows = [batches.pad_rows(part, bucket_rows(len(part["weights"]), multiple, self.bucket_cap), pad_id)
                    for part in rows]
        return self.learner.train(rows)


class UnsyncSubSide(SubSide):
    """The unsynchronised ablation's sub side (`mgrpo_unsync`): every real call of the step into the store's FIFO,
    then every full chunk waiting, oldest first (mgrpo_jax/rl/unsync.py)."""

    def __init__(self, learner, store, config):
        super().__init__(learner)
        self.config, self.advantages = config, TargetsConfig.from_config(config).advantages
        self.fifo = store.fifo("sub_trajectories")
        self.consumer = self.fifo.consumer("sub_trainer")

    def rows(self, data: SubStep, targets, stats: dict, step: int) -> tuple[dict, list[dict]]:
        cfg, learner = self.config, self.learner
        records = unsync.step_records(data.rollout, targets.sub_call_reward, step, data.versions)
        # Pops the chunks waiting even when this step delegated nothing.
        chunks, metrics = unsync.unsync_step(
            self.fifo, self.consumer, records, chunk=cfg.rollout.unsync_chunk, group=cfg.rollout.samples,
            seed=derive_seed(cfg.seed, "unsync", step), start_version=learner.version,
            passes=learner.config.passes, seq_len_limit=learner.config.context_tokens,
            pad_id=learner.tokenizer.pad_id, advantages=self.advantages,
            timeout_s=float(cfg.decoupled.timeout_s), pop=cfg.rollout.unsync_pop,
            rows=rl_batch_rows(cfg, SUB))
        return {**self.figures(data, targets, stats), **metrics}, chunks

    def state(self) -> dict:
        # The records pushed and not yet popped go into the checkpoint too: the default memory:// store does not
        # outlive its process, and a resumed run must pop them where the uninterrupted one does.
        offset = self.consumer.offset
        backlog = self.fifo.size() - offset
        pending = self.consumer.peek(backlog, timeout_s=float(self.config.decoupled.timeout_s)) if backlog else []
        return {"fifo_offset": offset, "fifo_pending": [r.encode().decode() for r in pending]}

    def load_state(self, host: dict) -> None:
        offset, size = int(host.get("fifo_offset", 0)), self.fifo.size()
        pending = [Record.decode(raw.encode(), key="host_state/fifo_pending") for raw in host.get("fifo_pending", [])]
        if size >= offset + len(pending):  # the store kept the FIFO (file://, gs://, or this process's memory://)
            self.consumer.seek(offset)
        elif size == 0 and "fifo_pending" in host:  # a new process's memory:// store: the checkpoint's records
            self.fifo.restore(pending)
            self.consumer.seek(0)
        else:
            raise ValueError(
                f"cannot resume the sub-agent's FIFO: the checkpoint's consumer offset is {offset} with "
                f"{len(pending)} records pending, but {self.fifo.store.url}fifo/{self.fifo.name}/ holds {size} items"
                + ("" if "fifo_pending" in host else " and the checkpoint keeps no pending records (it predates "
                   "them); start the run again in a fresh workdir, or resume it on the store it ran on"))


class SidePair:
    """The step's two sides; `update` trains each side's own learner on its own rows."""

    def __init__(self, main: Side, sub: Side):
        self.main, self.sub = main, sub

    def update(self, main_rows, sub_rows) -> dict:
        return {**self.main.update(main_rows), **self.sub.update(sub_rows)}


class PooledPair(SidePair):
    """Both sides hold one model (a shared-policy mode): one update of it on their rows pooled into one batch (main
    rows, then sub rows, then weight-0 padding rows; every row as long as the longest) of `rl_batch_rows(config,
    "main")` rows, or under MATPO's credit (whose sub side keeps its real calls only) of `bucket_rows` of them.

    `rollout.shared_role_weighting`: "per_role" (default) rescales the rows' weights (`core.losses.balance_roles`)
    so the objective is the mean of the two roles' own normalised losses, each by its own denominator under the
    loss's aggregation (rows for the row means, tokens for the token mean), as two distinct models weigh them;
    "pooled" keeps one mean over every row or token of the batch (MATPO's code), where the role with more rows or
    tokens weighs more (e.g. 128 main rows against 512 sub slots: 20 % and 80 %). Either way the update logs each
    role's share of the objective, `shared/main_weight` and `shared/sub_weight` (0.5 / 0.5 under per_role)."""

    def __init__(self, main: MainSide, sub: SubSide, config):
        super().__init__(main, sub)
        if main.learner is not sub.learner:
            raise ValueError(f"a pooled pair needs one learner on both sides, got {main.learner.name!r} and "
                             f"{sub.learner.name!r}")
        self.learner, self.rows_per_batch = main.learner, rl_batch_rows(config, MAIN)
        self.bucketed = credit_name(config) == "matpo"
        self.per_role = config.rollout.shared_role_weighting == "per_role"
        self.aggregation = self.learner.loss_hparams.get("aggregation")
        if self.per_role and self.aggregation is None:
            raise ValueError(f"rollout.shared_role_weighting='per_role' normalises each role by its loss's "
                             f"denominator, but loss {self.learner.config.loss!r} has no `aggregation`; set "
                             "rollout.shared_role_weighting=pooled")

    def update(self, main_rows, sub_rows) -> dict:
        pad_id = self.learner.tokenizer.pad_id
        parts = [main_rows, *[part for part in sub_rows if len(part["weights"])]]
        pooled = batches.concat_rows(parts, pad_id)
        rows = self.rows_per_batch
        if self.bucketed:
            rows = bucket_rows(len(pooled["weights"]), row_multiple(self.learner), self.rows_per_batch)
        pooled = batches.pad_rows(pooled, rows, pad_id)
        if self.aggregation is None:
            return self.learner.train(pooled)
        roles = (np.arange(rows) >= len(main_rows["weights"])).astype(np.int32)  # 0: main rows, 1: the rest
        mask = trained_tokens(pooled)
        if self.per_role:
            pooled["weights"] = np.asarray(balance_roles(mask, pooled["weights"], roles, 2, self.aggregation))
        own = np.asarray(role_denominators(mask, pooled["weights"], roles, 2, self.aggregation), np.float64)
        shares = own / max(own.sum(), 1e-12)
        return {**self.learner.train(pooled), "shared/main_weight": float(shares[0]),
                "shared/sub_weight": float(shares[1])}


def build_sides(config, learners: dict, engine, env, store, workdir: str, is_main_process: bool,
                serving=None) -> SidePair:
    """The sides of a job holding `learners`: a main side whose agent is not here is a `RemoteMain`, a sub side a
    `NoSubSide`; `serving(sub side)` wraps the sub side of the decoupled sub job (`decoupled.ServingSubSide`)."""
    top_name = agent_names(config.mode)[0]
    main = RemoteMain()
    if top_name in learners:
        main = MainSide(learners[top_name], engine, env, config, workdir,
                        config.train.log_transcripts if is_main_process else 0)
    sub = NoSubSide()
    if SUB in learners:
        # MATPO's credit: one row per possible call; with two models the sub learner trains on its real calls,
        # bucketed (in a shared mode the pooled pair buckets the pooled batch).
        bucket_cap = rl_batch_rows(config, SUB) if credit_name(config) == "matpo" else None
        if config.mode == "mgrpo_unsync":
            sub = UnsyncSubSide(learners[SUB], store, config)
        else:
            sub = SubSide(learners[SUB], bucket_cap)
        if serving is not None:
            sub = serving(sub)
    if config.mode in SHARED_MODES:
        return PooledPair(main, sub, config)
    return SidePair(main, sub)


def step_timings(metrics: dict, t0: float, t1: float, t2: float, t3: float) -> dict:
    """Adds the step's `time/*` to `metrics` (t0 start, t1 data in, t2 rows built, t3 trained): the judges'
    `time/judge_s` counts in `time/rewards_s`, and `time/other_s` is what the named phases leave of the step.
    `time/collect_s`: t0 to t1, the rollouts and their judges (an asynchronous step: its wait for them)."""
    metrics.update({"time/rewards_s": t2 - t1 + metrics.pop("time/judge_s", 0.0), "time/training_s": t3 - t2,
                    "time/step_s": t3 - t0, "time/collect_s": t1 - t0})
    if "time/sampling_s" in metrics:
        metrics["time/other_s"] = t3 - t0 - sum(metrics[f"time/{k}"] for k in ("sampling_s", "tools_s", "rewards_s",
                                                                               "training_s"))
    return metrics


def shown(metrics: dict, top_name: str) -> dict:
    """The figures of a step's bar and log line: rewards, correctness, the sub job's serving figures, seconds."""
    keys = (f"{top_name}/reward", f"{top_name}/correct", "sub/reward", "sub/served", "sub/staleness", "time/step_s")
    return {k: metrics[k] for k in keys if k in metrics}
