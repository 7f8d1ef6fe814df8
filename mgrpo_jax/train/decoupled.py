"""Decoupled mode (DESIGN.md section 3): the main and the sub agent as two jobs sharing nothing but the store.

    python launch/tpu_run.py --config=experiments/xbench.py:local --role=main --workdir=runs/x --config.store=URL
    python launch/tpu_run.py --config=experiments/xbench.py:local --role=sub  --workdir=runs/x --config.store=URL

URL is `file:///shared/path` or `gs://bucket/prefix`; each role keeps its checkpoints, logs and metrics in its
own `workdir/main` or `workdir/sub` and resumes from there on its own. Both roles take the same config.

One RL step s, through the store (key layout: mgrpo_jax/store/store.py):

  main  runs the controller and M. Each engine iteration's delegations are posted as task records
        (step s, query, rollout, invocation, M's policy version; payload: task, context, question id) and the
        main waits for their answers before its next turn (`MainRole._delegate`, the engine's `sub_executor`).
  sub   claims the pending tasks of step s, runs them with its own sampler and tools in lock-step batches,
        appends each trajectory to its local cache (`workdir/sub/cache/<step>.jsonl`), then answers.
  main  computes its rewards, commits `main_correct`, `main_reward`, `sub_counts` for step s, trains M.
  sub   once the main's commit of s is visible: rebuilds the step's [Q][K][d_k] layout from `sub_counts` and
        its cache, computes R_S (the expert judge looks the question up by id), aligns to D slots, computes the
        pooled advantages and trains S on exactly those Q*K*D rows (`mgrpo`), or appends them to the store's
        FIFO in a seeded random order and trains on every full fixed-size chunk waiting, grouped by arrival
        (`mgrpo_unsync`, mgrpo_jax/train/unsync.py); then commits its own step record.
  The main starts step s + 1 only once the sub has committed step s + 1 - max_lag, so the store's garbage
  collection (the main keeps the last 4 steps) never removes data the sub has not read.

At start-up the main publishes its tokenizer (`control/tokenizer.json`) and the sub loads it and checks its
checksum, so both sides use the same ids. After its last step the main writes `control/done.json`; the sub
exits once it has trained every step the main ran. Staleness is logged as `sub/staleness`: the gap between the
sub policy's version when a trajectory was sampled and when it is trained on (tasks carry M's version, answers
and cached trajectories S's); in `mgrpo_unsync` it is that of the records popped from the FIFO, with
`sub/fifo_backlog`, the records left waiting.
"""

from __future__ import annotations

import base64
import collections
import hashlib
import json
import logging
import os
import time

import numpy as np

from mgrpo_jax.env.prompts import MAIN, SUB
from mgrpo_jax.env.scoring import world_answer_correct
from mgrpo_jax.rollout import rewards
from mgrpo_jax.rollout.episode import Episode, RolloutBatch
from mgrpo_jax.store import Record, StoreError, StoreTimeout, open_store
from mgrpo_jax.store.records import seal, unseal
from mgrpo_jax.store.retry import poll_until
from mgrpo_jax.train.checkpoint import PreemptionGuard
from mgrpo_jax.train.trainer import Trainer, _seed

log = logging.getLogger(__name__)

TOKENIZER_KEY = "control/tokenizer.json"
DONE_KEY = "control/done.json"


def _check(config) -> None:
    if config.mode not in ("mgrpo", "frozen_sub", "mgrpo_unsync"):
        raise ValueError(f"--role=main/sub need a two-agent mode (mgrpo, frozen_sub, mgrpo_unsync), not {config.mode}")
    if config.store.startswith("memory://"):
        raise ValueError(f"--role=main/sub run as two jobs that share only the store: {config.store} is private to "
                         "one process; pass --config.store=file:///shared/path or gs://bucket/prefix")


def _put(store, key: str, body: dict) -> None:
    store.kv.write(key, seal(body))


def _get(store, key: str) -> dict | None:
    raw, _ = store.kv.read(key)
    return None if raw is None else unseal(raw, url=store.url, key=key)


def _sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


class MainRole(Trainer):
    """The main job: controller + main agent; delegations go to the sub job through the store."""

    agent_subset = (MAIN,)

    def __init__(self, config, workdir: str):
        _check(config)
        super().__init__(config, os.path.join(workdir, MAIN))
        self.timeout_s = float(config.decoupled.timeout_s)
        self.engine.sub_executor = self._delegate
        if self.checkpointer.latest_step() is None and (self.store.steps() or self.store.kv.list_prefix("fifo/")):
            # Tasks are posted create-if-absent: another run's answers would be taken for this run's.
            raise ValueError(f"the store {config.store} holds another run's steps {self.store.steps()[:5]} but "
                             f"{self.workdir} has no checkpoint to resume: use a fresh store URL or empty it")
        self.store.kv.delete(DONE_KEY)  # a previous run's end marker must not stop this run's sub job
        proto = self.tokenizer.serialize()
        _put(self.store, TOKENIZER_KEY, {"model": base64.b64encode(proto).decode(), "model_sha256": _sha(proto)})
        self._evaluation_warned = False

    def _delegate(self, spawned: list[Episode], questions) -> list[Episode]:
        """The engine's sub executor: post this iteration's delegations, wait for every answer."""
        version = int(self.agents[MAIN].state.step)
        tasks = [Record("task", self.step, e.question_index, e.rollout, e.invocation, version,
                        {**e.call, "question_id": questions[e.question_index].id}) for e in spawned]
        ids = self.store.tasks.post(tasks)
        answers = self.store.tasks.wait_answers(self.step, ids, timeout_s=self.timeout_s)
        for episode, rid in zip(spawned, ids, strict=True):
            reply = answers[rid].payload
            episode.answer = reply["answer"]
            episode.end_reason = reply["end_reason"]
            episode.turns = list(reply["turns"])
            episode.tool_calls.update(reply["tool_calls"])
        return spawned

    def rl_step(self) -> dict:
        start = time.perf_counter()
        lag = int(self.config.decoupled.max_lag)
        if self.step >= lag:
            self.store.wait_step(self.step - lag, SUB, timeout_s=self.timeout_s)
        waited = time.perf_counter() - start
        metrics = super().rl_step()
        metrics["time/wait_sub_s"] = waited
        return metrics

    def evaluate(self) -> dict:
        if not self._evaluation_warned:
            log.warning("decoupled main job: evaluation needs the sub agent and is skipped; evaluate the "
                        "checkpoints of both jobs with a colocated run")
            self._evaluation_warned = True
        return {}

    def run(self) -> dict:
        summary = super().run()
        if self.step >= self.config.train.steps:
            _put(self.store, DONE_KEY, {"steps": self.step})
        return summary


class SubRole(Trainer):
    """The sub job: serves the main job's delegations with its own sampler and tools, then trains on them."""

    agent_subset = (SUB,)

    def __init__(self, config, workdir: str):
        _check(config)
        workdir = os.path.join(workdir, SUB)
        self.timeout_s = float(config.decoupled.timeout_s)
        published = self._main_tokenizer(open_store(config.store), workdir, config)
        super().__init__(config, workdir)
        if _sha(self.tokenizer.serialize()) != published["model_sha256"]:
            raise ValueError(f"the sub job's tokenizer ({config.tokenizer.path or workdir}) differs from the main "
                             f"job's ({config.store}{TOKENIZER_KEY}): the two agents would not share token ids")
        self.worker = config.decoupled.worker
        self.cache_dir = os.path.join(workdir, "cache")
        os.makedirs(self.cache_dir, exist_ok=True)
        self.question_by_id = {q.id: q for _, split in self.env.questions.items() for q in split}

    def _main_tokenizer(self, store, workdir: str, config) -> dict:
        """Waits for the main job's tokenizer; unless a path is configured, saves it where build_tokenizer looks."""
        published = poll_until(lambda: _get(store, TOKENIZER_KEY), self.timeout_s, store.poll)
        if published is None:
            raise StoreTimeout(f"timed out after {self.timeout_s:g}s waiting for the main job's tokenizer: missing "
                               f"{store.url}{TOKENIZER_KEY} (is the --role=main job running on this store?)",
                               url=store.url, missing=(TOKENIZER_KEY,))
        path = os.path.join(workdir, "tokenizer.model")
        if not config.tokenizer.path and not os.path.exists(path):
            os.makedirs(workdir, exist_ok=True)
            with open(path + ".tmp", "wb") as f:
                f.write(base64.b64decode(published["model"]))
            os.replace(path + ".tmp", path)
        return published

    # -- the local trajectory cache ----------------------------------------------------------------------

    def _cache_path(self, step: int) -> str:
        return os.path.join(self.cache_dir, f"{step:010d}.jsonl")

    def _load_cache(self, step: int) -> dict:
        """{(query, rollout, invocation): (sub-episode, sampling version, question id)} served at `step`."""
        cache = {}
        if not os.path.exists(self._cache_path(step)):
            return cache
        with open(self._cache_path(step)) as f:
            for line in f:
                try:
                    entry = json.loads(line)
                except json.JSONDecodeError:  # a line cut short by a crash: that task is served again
                    log.warning("skipping a partial line in %s", self._cache_path(step))
                    continue
                episode = Episode(agent=SUB, question_index=entry["q"], rollout=entry["r"], invocation=entry["i"],
                                  task=entry["task"], call=entry["call"], tokens=entry["tokens"],
                                  loss_mask=entry["loss_mask"], logprobs=entry["logprobs"], turns=entry["turns"],
                                  tool_calls=collections.Counter(entry["tool_calls"]), answer=entry["answer"],
                                  end_reason=entry["end_reason"], format_error=entry["format_error"])
                cache[(entry["q"], entry["r"], entry["i"])] = (episode, entry["version"], entry["question_id"])
        return cache

    def _append_cache(self, step: int, served: list) -> None:
        with open(self._cache_path(step), "a") as f:
            for episode, version, question_id in served:
                f.write(json.dumps({
                    "q": episode.question_index, "r": episode.rollout, "i": episode.invocation, "version": version,
                    "question_id": question_id, "task": episode.task, "call": episode.call, "tokens": episode.tokens,
                    "loss_mask": episode.loss_mask, "logprobs": episode.logprobs, "turns": episode.turns,
                    "tool_calls": dict(episode.tool_calls), "answer": episode.answer,
                    "end_reason": episode.end_reason, "format_error": episode.format_error}) + "\n")
            f.flush()
            os.fsync(f.fileno())

    def _prune_cache(self, before_step: int) -> None:
        for name in os.listdir(self.cache_dir):
            if name.endswith(".jsonl") and int(name.split(".")[0]) < before_step:
                os.remove(os.path.join(self.cache_dir, name))

    # -- serving -----------------------------------------------------------------------------------------

    def _serve(self, step: int, tasks: list[Record], cache: dict, timings: dict) -> int:
        """Runs the claimed tasks' sub-agent episodes (those not already cached), caches them, answers all."""
        version = int(self.agents[SUB].state.step)
        fresh = [t for t in tasks if (t.query, t.rollout, t.invocation) not in cache]
        episodes = [self.engine.start_sub(t.payload["task"], t.payload["context"], question_index=t.query,
                                          rollout=t.rollout, invocation=t.invocation) for t in fresh]
        self.engine.run_subs(episodes, _seed(self.config.seed, "serve", step, len(cache)), timings)
        served = [(e, version, t.payload["question_id"]) for e, t in zip(episodes, fresh, strict=True)]
        self._append_cache(step, served)  # before answering: an answered task always has its trajectory here
        for entry in served:
            cache[(entry[0].question_index, entry[0].rollout, entry[0].invocation)] = entry
        answers = []
        for t in tasks:
            episode, sampled_by, _ = cache[(t.query, t.rollout, t.invocation)]
            answers.append(Record("answer", step, t.query, t.rollout, t.invocation, sampled_by, {
                "answer": episode.answer, "end_reason": episode.end_reason, "turns": episode.turns,
                "tool_calls": dict(episode.tool_calls)}))
        self.store.tasks.post_answers(answers)
        return len(fresh)

    def _next_event(self, step: int):
        tasks = self.store.tasks.claim(step, self.worker)
        if tasks:
            return "tasks", tasks
        if self.store.is_committed(step, MAIN):
            return "commit", self.store.read_step(step, MAIN)
        done = _get(self.store, DONE_KEY)
        if done is not None and done["steps"] <= step:
            return "done", None
        return None

    def sub_step(self) -> dict | None:
        """Serves step `self.step`, then trains on it once the main job has committed it; None if the main
        job finished without this step."""
        cfg, step = self.config, self.step
        t0 = time.perf_counter()
        timings = {"sampling_s": 0.0, "tools_s": 0.0}
        cache = self._load_cache(step)
        served = 0
        while True:
            event = poll_until(lambda: self._next_event(step), self.timeout_s, self.store.poll)
            if event is None:
                raise StoreTimeout(f"sub job: nothing from the main job for {self.timeout_s:g}s at step {step}: no "
                                   f"pending task, no commit marker steps/{step:010d}/main/commit.json, no "
                                   f"{DONE_KEY} in {self.store.url}", url=self.store.url,
                                   missing=(f"steps/{step:010d}/main/commit.json",))
            kind, value = event
            if kind == "done":
                return None
            if kind == "commit":
                view = value
                break
            served += self._serve(step, value, cache, timings)
        t1 = time.perf_counter()

        main_correct = view.array("main_correct")
        counts = view.array("sub_counts")
        rollout, keys = self._cached_rollout(step, counts, cache)
        inputs = rewards.reward_inputs(rollout, world_answer_correct, self.env.judge.score, (), self._sub_tools(),
                                       self.engine.grammar)
        adv_kw = dict(scale=cfg.advantages.scale, baseline=cfg.advantages.baseline, eps=cfg.advantages.eps)
        version = int(self.agents[SUB].state.step)
        metrics = {"sub/served": served, "sub/main_correct": float(main_correct.mean()),
                   "sub/main_version": view.policy_version}
        metrics.update({k: v for k, v in rollout.stats().items() if k.startswith("sub/")})
        sampled = {key: cache[key][1] for key in keys}
        if sampled:
            metrics["sub/staleness"] = float(np.mean([version - v for v in sampled.values()]))
        # mgrpo_unsync: the same FIFO path as the colocated trainer (Trainer._unsync_rows, train/unsync.py), with
        # each record's own sampling version; its `sub/staleness` (of the popped records) replaces the one above.
        sub_metrics, sub_batches = self._sub_side(rollout, inputs, main_correct, counts, adv_kw, versions=sampled)
        metrics.update(sub_metrics)
        t2 = time.perf_counter()
        agent = self.agents[SUB]
        if sub_batches and agent.trainable:
            metrics.update(self._train(agent, sub_batches))
        self.store.step_writer(step, SUB, version).commit({"served": served})
        t3 = time.perf_counter()
        timings.update({"serve_s": t1 - t0, "rewards_s": t2 - t1, "training_s": t3 - t2, "step_s": t3 - t0})
        metrics.update({f"time/{k}": v for k, v in timings.items()})
        return metrics

    def _cached_rollout(self, step: int, counts: np.ndarray, cache: dict) -> tuple[RolloutBatch, list]:
        """The step's sub-trajectories in the [Q][K][d_k] layout the main job's `sub_counts` describe."""
        keys = [(q, k, i) for q in range(counts.shape[0]) for k in range(counts.shape[1]) for i in range(counts[q, k])]
        missing = [key for key in keys if key not in cache]
        if missing:
            raise StoreError(f"sub job: {len(missing)} of the {len(keys)} sub-trajectories of step {step} are not in "
                             f"the local cache ({self._cache_path(step)}), e.g. (query, rollout, invocation) "
                             f"{missing[:4]}: answered by another worker, or the cache was lost",
                             url=self.store.url, key=f"steps/{step:010d}/main/commit.json")
        top = [[Episode(agent=MAIN, question_index=q, rollout=k) for k in range(counts.shape[1])]
               for q in range(counts.shape[0])]
        questions = [None] * counts.shape[0]
        for q, k, i in keys:
            episode, _, question_id = cache[(q, k, i)]
            top[q][k].subs.append(episode)
            questions[q] = self.question_by_id[question_id]
        return RolloutBatch(questions, top), keys

    # -- the run -----------------------------------------------------------------------------------------

    def run(self) -> dict:
        cfg = self.config
        summary = {}
        with PreemptionGuard() as guard:
            if not self.restore() and not self.warm_started:
                if not self.warm_start(guard):
                    return {}
                self.save(force=True)
            while self.step < cfg.train.steps:
                metrics = self.sub_step()
                if metrics is None:
                    log.info("the main job finished before step %d: stopping", self.step + 1)
                    break
                self.step += 1
                self.writer.write(self.step, metrics)
                summary = metrics
                log.info("sub step %d | reward %.3f | served %d | staleness %.1f | %.1f s", self.step,
                         metrics.get("sub/reward", float("nan")), metrics["sub/served"],
                         metrics.get("sub/staleness", 0.0), metrics["time/step_s"])
                stop = guard.should_stop()
                self.save(force=stop or self.step == cfg.train.steps)
                # The newest checkpoint may still be in flight (a kill now resumes from the one before it).
                self._prune_cache(([0, 0] + self.checkpointer.all_steps())[-2])
                if stop:
                    log.warning("preempted at step %d: checkpoint written, exiting", self.step)
                    break
        self.checkpointer.wait()
        if self.is_main_process:
            with open(os.path.join(self.workdir, "summary.json"), "w") as f:
                json.dump(summary, f, indent=1, sort_keys=True)
        return summary
