"""Decoupled mode: the main and the sub agent as two jobs sharing nothing but the store. Both run the same loop as
a colocated run (`Trainer(config, workdir, job="main" | "sub")`, mgrpo_jax/rl/trainer.py), each holding one
side (mgrpo_jax/rl/sides.py), over a store exchange instead of the in-process one.

    python launch/tpu_run.py --config=experiments/xbench.py:local --role=main --workdir=runs/x --config.store=URL
    python launch/tpu_run.py --config=experiments/xbench.py:local --role=sub  --workdir=runs/x --config.store=URL

URL is `file:///shared/path` or `gs://bucket/prefix`; each job keeps its checkpoints, logs and metrics in its
own `workdir/main` or `workdir/sub` and resumes from there on its own. Both jobs take the same config.

One RL step s, through the store (key layout: mgrpo_jax/store/store.py):

  main  runs the controller and M. Each engine iteration's delegations are task records (step s, query,
        rollout, invocation, M's policy version; payload: task, context, question id) posted together as one
        batch object, and the main waits for the batch's answers, one object, before its next turn
        (`MainExchange.delegate`, the engine's `sub_executor`; `TaskQueue.post_batch` / `wait_batch`).
  sub   claims the pending batches of step s (one lease each), runs their tasks with its own sampler and tools on
        the decode-slot engine, appends each trajectory to its cache (`workdir/sub/cache/<step>.jsonl`, in the
        bucket with a gs:// workdir), then answers each batch with one object.
        A round of n delegations costs a fixed number of store operations, not ~4n as with one object per task
        and answer (the slot engine delegates in every decode round where a main turn ended with a call;
        `python -m mgrpo_jax.bench.store` measures the exchange's share of a step, docs/benchmarks.md).
  main  judges its rollouts, computes the step's targets and commits `main_format_ok`, `main_correct`,
        `main_reward` (the targets'), `sub_counts` for step s, trains M.
  sub   once the main's commit of s is visible: rebuilds the step's [Q][K][d_k] layout from `sub_counts` and
        its cache, judges its calls (the expert judge looks the question up by id), and from there runs the
        same step as the colocated run (`Trainer.rl_step`: `mgrpo_targets`, then the sub side's `mgrpo` /
        `mgrpo_unsync` update); then commits its own step record.
  The main starts step s + 1 only once the sub has committed step s + 1 - max_lag, so the store's garbage
  collection (the main keeps the `decoupled.keep_steps` steps up to the one it finished, at least max_lag + 1)
  never removes data the sub has not read. Every wait gives up after `decoupled.timeout_s` with an error naming
  what is missing.

The main job's step record also lists the task batches its rollouts posted (`meta.batches`): the sub job builds
the step from those batches' trajectories only. With `async_rl.enabled` (docs/async.md) the main job samples ahead
on a sampler thread and the sub job serves ahead on one (`AsyncServing`), each within `async_rl.max_staleness`.

At start-up the main publishes its tokenizer (`control/tokenizer.json`) and the sub loads it and checks its
checksum, so both sides use the same ids. After its last step the main writes `control/done.json`; the sub
exits once it has trained every step the main ran. Staleness is logged as `sub/staleness`: the gap between the
sub policy's version when a trajectory was sampled and when it is trained on (tasks carry M's version, answers
and cached trajectories S's); in `mgrpo_unsync` it is that of the records popped from the FIFO, with
`sub/fifo_backlog`, the records left waiting.
"""

from __future__ import annotations

import base64
import hashlib
import json
import logging
import threading
import time

import numpy as np

from mgrpo_jax.core import RolloutArrays
from mgrpo_jax.env.build import reward_judge
from mgrpo_jax.env.prompts import MAIN, SUB
from mgrpo_jax.rl.asynchronous import AsyncRollouts
from mgrpo_jax.rl.exchange import Exchange, SubStep
from mgrpo_jax.rl.system import System, build_system
from mgrpo_jax.rollout.episode import Episode, RolloutBatch
from mgrpo_jax.rollout.judging import rollout_arrays
from mgrpo_jax.runtime import files
from mgrpo_jax.runtime.seeds import derive_seed
from mgrpo_jax.store import Record, StoreError, StoreTimeout
from mgrpo_jax.store.records import seal, unseal
from mgrpo_jax.store.retry import poll_until
from mgrpo_jax.store.tasks import TaskBatch

log = logging.getLogger(__name__)

TOKENIZER_KEY = "control/tokenizer.json"
DONE_KEY = "control/done.json"


def _put(store, key: str, body: dict) -> None:
    store.kv.write(key, seal(body))


def _get(store, key: str) -> dict | None:
    raw, _ = store.kv.read(key)
    return None if raw is None else unseal(raw, url=store.url, key=key)


def _sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def main_tokenizer(store, workdir: str, config) -> dict:
    """The sub job's start: waits for the main job's tokenizer; unless a path is configured, saves it where
    `system.build_tokenizer` looks."""
    timeout_s = float(config.decoupled.timeout_s)
    published = poll_until(lambda: _get(store, TOKENIZER_KEY), timeout_s, store.poll)
    if published is None:
        raise StoreTimeout(f"timed out after {timeout_s:g}s waiting for the main job's tokenizer: missing "
                           f"{store.url}{TOKENIZER_KEY} (is the --role=main job running on this store?)",
                           url=store.url, missing=(TOKENIZER_KEY,))
    path = files.as_path(workdir) / "tokenizer.model"
    if not config.tokenizer.path and not path.exists():
        files.write_atomic(path, base64.b64decode(published["model"]))
    return published


def check_tokenizer(tokenizer, published: dict, config, workdir: str) -> None:
    if _sha(tokenizer.serialize()) != published["model_sha256"]:
        raise ValueError(f"the sub job's tokenizer ({config.tokenizer.path or workdir}) differs from the main "
                         f"job's ({config.store}{TOKENIZER_KEY}): the two agents would not share token ids")


class Delegation:
    """The main job's sub executor (the engine's `sub_executor`): each engine round's delegations posted as one task
    batch of step `step`, tagged with the main agent's policy `version`, then the batch's answers awaited. The
    batch ids of each step are kept in `posted`, for the step's record (the sub job trains on exactly those)."""

    def __init__(self, store, timeout_s: float, posted: dict, lock: threading.Lock):
        self.store, self.timeout_s, self.posted, self.lock = store, timeout_s, posted, lock
        self.step = self.version = 0

    def at(self, step: int, version: int) -> None:
        """The step and the main policy version of the delegations that follow."""
        self.step, self.version = step, version

    def __call__(self, spawned: list[Episode], questions) -> list[Episode]:
        step = self.step
        tasks = [Record("task", step, e.question_index, e.rollout, e.invocation, self.version,
                        {**e.call, "question_id": questions[e.question_index].id}) for e in spawned]
        bid = self.store.tasks.post_batch(tasks)
        with self.lock:
            self.posted.setdefault(step, []).append(bid)
        answers = self.store.tasks.wait_batch(step, bid, timeout_s=self.timeout_s)
        for episode, task in zip(spawned, tasks, strict=True):
            reply = answers[task.id].payload
            episode.answer = reply["answer"]
            episode.end_reason = reply["end_reason"]
            episode.turns = list(reply["turns"])
            episode.tool_calls.update(reply["tool_calls"])
        return spawned


class MainExchange(Exchange):
    """The main job's transport: delegations become task records (`Delegation`), the step's judge arrays and
    targets a committed step record, which lists the step's task batches. Each task and record carries the main
    agent's policy version its rollouts were sampled under."""

    def __init__(self, store, config, workdir: str, *, resuming: bool):
        self.store, cfg = store, config.decoupled
        self.timeout_s, self.max_lag, self.keep_steps = float(cfg.timeout_s), int(cfg.max_lag), int(cfg.keep_steps)
        if not resuming and (store.steps() or store.kv.list_prefix("fifo/")):
            # Tasks are posted create-if-absent: another run's answers would be taken for this run's.
            raise ValueError(f"the store {store.url} holds another run's steps {store.steps()[:5]} but "
                             f"{workdir} has no checkpoint to resume: use a fresh store URL or empty it")
        store.kv.delete(DONE_KEY)  # a previous run's end marker must not stop this run's sub job
        self.posted: dict[int, list[str]] = {}  # step -> the batch ids its rollouts posted, in order
        self._lock = threading.Lock()
        self.delegate = self.delegation()

    def delegation(self) -> Delegation:
        """A sub executor of its own (an asynchronous sampler's, which posts the steps ahead of the learner's)."""
        return Delegation(self.store, self.timeout_s, self.posted, self._lock)

    def publish_tokenizer(self, tokenizer) -> None:
        """For the sub job, which waits for it (`main_tokenizer`) so that both agents share token ids."""
        store, proto = self.store, tokenizer.serialize()
        _put(store, TOKENIZER_KEY, {"model": base64.b64encode(proto).decode(), "model_sha256": _sha(proto)})

    def before_step(self, step, version):
        self.delegate.at(step, version)
        start = time.perf_counter()
        if step >= self.max_lag:
            self.store.wait_step(step - self.max_lag, SUB, timeout_s=self.timeout_s)
        return {"time/wait_sub_s": time.perf_counter() - start}

    def publish(self, step, arrays, targets):
        with self._lock:
            batches = self.posted.pop(step, [])
        writer = self.store.step_writer(step, MAIN, self.delegate.version)
        writer.put_array("main_format_ok", np.asarray(arrays.format_ok))
        writer.put_array("main_correct", np.asarray(arrays.correct))
        writer.put_array("main_reward", np.asarray(targets.main_reward))
        writer.put_array("sub_counts", np.asarray(arrays.counts))
        writer.commit({"batches": batches})

    def end_step(self, step):
        # By step, not by count: an asynchronous sampler may already have posted the steps after this one.
        self.store.gc(before_step=max(0, step + 1 - self.keep_steps))

    def finish(self, steps):
        _put(self.store, DONE_KEY, {"steps": steps})


class SubExchange(Exchange):
    """The sub job's transport: claims the main job's tasks, posts the answers, reads the main job's step record and
    end marker, commits the sub job's own record."""

    def __init__(self, store, config):
        self.store, self.timeout_s, self.worker = store, float(config.decoupled.timeout_s), config.decoupled.worker

    def answer(self, batches: list[TaskBatch], answers: dict[str, Record]) -> None:
        """Posts the answers (by task id) to each claimed batch, one object per batch."""
        for batch in batches:
            self.store.tasks.answer_batch(batch, [answers[rid] for rid in batch.ids])

    def claim(self, step: int) -> list[TaskBatch]:
        """The main job's unanswered task batches of `step`, leased to this worker."""
        return self.store.tasks.claim_batches(step, self.worker)

    def _next_event(self, step: int, serve: bool = True):
        batches = self.claim(step) if serve else None
        if batches:
            return "tasks", batches
        if self.store.is_committed(step, MAIN):
            return "commit", self.store.read_step(step, MAIN)
        done = _get(self.store, DONE_KEY)
        if done is not None and done["steps"] <= step:
            return "done", None
        return None

    def next_event(self, step: int, serve: bool = True, check=None) -> tuple[str, object]:
        """What the main job did next at `step`: ("tasks", claimed task batches), ("commit", its step record) or
        ("done", None) when it finished without this step; a StoreTimeout after `decoupled.timeout_s` of nothing.
        `serve=False`: the commit or the end only (an asynchronous serving thread claims the tasks); `check()`,
        called at every poll, may raise (that thread's failure)."""
        event = poll_until(lambda: (check and check()) or self._next_event(step, serve), self.timeout_s,
                           self.store.poll)
        if event is None:
            raise StoreTimeout(f"sub job: nothing from the main job for {self.timeout_s:g}s at step {step}: no "
                               f"pending task, no commit marker steps/{step:010d}/main/commit.json, no "
                               f"{DONE_KEY} in {self.store.url}", url=self.store.url,
                               missing=(f"steps/{step:010d}/main/commit.json",))
        return event

    def commit(self, step, version, served):
        self.store.step_writer(step, SUB, version).commit({"served": served})


class ServingSubSide:
    """The decoupled sub job's sub side: it collects a step by serving the main job's delegations with its own
    sampler and tools, caching each trajectory in its workdir, until the main job commits the step; the step's data
    is then the cached trajectories of the task batches the step's record lists, in the [Q][K][d_k] layout of the
    main job's rollouts. Rows, updates, state and version are those of the side it serves for (`inner`: a
    `SubSide`, or an `UnsyncSubSide` in `mgrpo_unsync`). With an asynchronous serving thread (`server`, an
    `AsyncServing`) the thread serves and `collect` only waits for the main job's record."""

    def __init__(self, inner, exchange: SubExchange, config, workdir: str, env, engine):
        self.inner, self.exchange, self.config, self.env, self.engine = inner, exchange, config, env, engine
        self.cache_dir = files.as_path(workdir) / "cache"  # in the bucket with a gs:// workdir
        self.cache_dir.mkdir(parents=True, exist_ok=True)
        self.question_by_id = {q.id: q for _, split in env.questions.items() for q in split}
        self.server = None
        self._lock = threading.RLock()  # the caches and tallies, shared with a serving thread
        self._caches: dict[int, dict] = {}  # step -> {(batch, query, rollout, invocation): cached entry}
        self._tallies: dict[int, dict] = {}  # step -> what serving it cost so far

    @property
    def version(self) -> int:
        return self.inner.version

    @property
    def learner(self):
        return self.inner.learner

    def rows(self, data, targets, stats, step):
        return self.inner.rows(data, targets, stats, step)

    def update(self, rows) -> dict:
        return self.inner.update(rows)

    def state(self) -> dict:
        return self.inner.state()

    def load_state(self, host: dict) -> None:
        self.inner.load_state(host)

    # -- the local trajectory cache ----------------------------------------------------------------------

    def _cache_path(self, step: int):
        return self.cache_dir / f"{step:010d}.jsonl"

    def cache(self, step: int) -> dict:
        """{(batch id, query, rollout, invocation): (sub-episode, sampling version, question id)} served at `step`
        (read from the workdir's cache file the first time: a resumed job keeps what it served)."""
        with self._lock:
            if step not in self._caches:
                self._caches[step] = self._load_cache(step)
            return self._caches[step]

    def _load_cache(self, step: int) -> dict:
        cache = {}
        for line in (files.read_text(self._cache_path(step)) or "").splitlines():
            try:
                entry = json.loads(line)
            except json.JSONDecodeError:  # a line cut short by a crash: that task is served again
                log.warning("skipping a partial line in %s", self._cache_path(step))
                continue
            key = (entry.get("batch", ""), entry["q"], entry["r"], entry["i"])
            cache[key] = (Episode.from_json(entry), entry["version"], entry["question_id"])
        return cache

    def _append_cache(self, step: int, served: list) -> None:
        with files.AppendFile(self._cache_path(step), durable=True) as f:
            for bid, (episode, version, question_id) in served:
                f.write(json.dumps({**episode.to_json(), "batch": bid, "version": version,
                                    "question_id": question_id}) + "\n")

    def after_save(self, checkpoint_steps):
        # The newest checkpoint may still be in flight (a kill now resumes from the one before it).
        before_step = ([0, 0] + list(checkpoint_steps))[-2]
        for path in self.cache_dir.iterdir():
            if path.name.endswith(".jsonl") and int(path.name.split(".")[0]) < before_step:
                path.unlink()

    # -- serving -----------------------------------------------------------------------------------------

    def serve(self, step: int, batches: list[TaskBatch], version: int, engine=None, again=None) -> int:
        """Runs the claimed batches' sub-agent episodes (those not already cached) together on `engine` (default:
        this side's) under policy `version`, caches them, answers every batch; returns how many ran. `again()`
        true after a run: run them again (new weights arrived, `async_rl.partial_rollouts = "restart"`)."""
        engine, cache = engine or self.engine, self.cache(step)
        with self._lock:
            tally = self._tallies.setdefault(step, {"served": 0, "sampling_s": 0.0, "tools_s": 0.0, "restarts": 0})
        tasks = sorted(((b.id, t) for b in batches for t in b.records), key=lambda bt: bt[1].id)  # as claimed
        fresh = [(bid, t) for bid, t in tasks if (bid, t.query, t.rollout, t.invocation) not in cache]
        seed = derive_seed(self.config.seed, "serve", step, len(cache))
        while True:
            episodes = [engine.start_sub(t.payload["task"], t.payload["context"], question_index=t.query,
                                         rollout=t.rollout, invocation=t.invocation) for _, t in fresh]
            timings = {"sampling_s": 0.0, "tools_s": 0.0}
            engine.run_subs(episodes, seed, timings)
            with self._lock:
                tally["sampling_s"] += timings["sampling_s"]
                tally["tools_s"] += timings["tools_s"]
            if again is None or not fresh or not again():
                break
            with self._lock:
                tally["restarts"] += 1
        served = [(bid, (e, version, t.payload["question_id"])) for e, (bid, t) in zip(episodes, fresh, strict=True)]
        self._append_cache(step, served)  # before answering: an answered task always has its trajectory here
        with self._lock:
            for bid, entry in served:
                cache[(bid, entry[0].question_index, entry[0].rollout, entry[0].invocation)] = entry
            tally["served"] += len(fresh)
        answers = {}
        for bid, t in tasks:
            episode, sampled_by, _ = cache[(bid, t.query, t.rollout, t.invocation)]
            answers[t.id] = Record("answer", step, t.query, t.rollout, t.invocation, sampled_by, {
                "answer": episode.answer, "end_reason": episode.end_reason, "turns": episode.turns,
                "tool_calls": dict(episode.tool_calls)})
        self.exchange.answer(batches, answers)
        return len(fresh)

    def collect(self, step: int, collected=None) -> SubStep | None:
        """Serves step `step`'s tasks until the main job commits it (with a serving thread: waits for the commit);
        None when the main job finished first."""
        version = self.version  # the policy that serves this step's calls (synchronous)
        start = time.perf_counter()
        check = self.server.check if self.server is not None else None
        while True:
            kind, value = self.exchange.next_event(step, serve=self.server is None, check=check)
            if kind == "done":
                return None
            if kind == "commit":
                view = value
                break
            self.serve(step, value, version)
        counts = view.array("sub_counts")
        rollout, chosen = self._cached_rollout(step, counts, view.meta.get("batches"))
        judge = reward_judge(self.config, self.env)
        own = rollout_arrays(rollout, judge, (), self.engine.sub.tool_names, self.engine.grammar,
                             calls=self.config.rollout.max_sub_calls)
        correct = view.array("main_correct")
        # The sub-agent's targets never read the main agent's format gate (a main job from before it was published
        # leaves it out); it is carried for completeness.
        has_format = "main_format_ok" in view.array_names
        format_ok = view.array("main_format_ok") if has_format else np.ones(counts.shape, bool)
        arrays = RolloutArrays(format_ok, correct, own.sub_format_ok, own.sub_expert, own.counts)
        versions = {key: entry[1] for key, entry in chosen.items()}
        with self._lock:
            tally = self._tallies.pop(step, {"served": 0, "sampling_s": 0.0, "tools_s": 0.0, "restarts": 0})
            for old in [s for s in self._caches if s <= step]:  # trained: the files keep them for a resume
                del self._caches[old]
        metrics = {"sub/served": tally["served"], "sub/main_correct": float(correct.mean()),
                   "sub/main_version": view.policy_version, "time/sampling_s": tally["sampling_s"],
                   "time/tools_s": tally["tools_s"], "time/serve_s": time.perf_counter() - start, **judge.metrics()}
        if self.server is not None:
            metrics["async/restarts"] = tally["restarts"]
        metrics.update({k: v for k, v in rollout.stats().items() if k.startswith("sub/")})
        if versions:
            metrics["sub/staleness"] = float(np.mean([self.version - v for v in versions.values()]))
        return SubStep(rollout, arrays, versions, metrics)

    def _cached_rollout(self, step: int, counts: np.ndarray, batches: list[str] | None) -> tuple[RolloutBatch, dict]:
        """The step's sub-trajectories in the [Q][K][d_k] layout the main job's `sub_counts` describe, from the
        task batches its record lists (`batches`; None, from a main job before the list: any cached batch), and
        {(query, rollout, invocation): their cache entries}."""
        wanted = None if batches is None else set(batches)
        chosen = {(q, r, i): entry for (bid, q, r, i), entry in sorted(self.cache(step).items(), key=lambda kv: kv[0])
                  if wanted is None or bid in wanted}
        keys = [(q, k, i) for q in range(counts.shape[0]) for k in range(counts.shape[1]) for i in range(counts[q, k])]
        missing = [key for key in keys if key not in chosen]
        if missing:
            raise StoreError(f"sub job: {len(missing)} of the {len(keys)} sub-trajectories of step {step} are not in "
                             f"the local cache ({self._cache_path(step)}), e.g. (query, rollout, invocation) "
                             f"{missing[:4]}: answered by another worker, or the cache was lost",
                             url=self.exchange.store.url, key=f"steps/{step:010d}/main/commit.json")
        top = [[Episode(agent=MAIN, question_index=q, rollout=k) for k in range(counts.shape[1])]
               for q in range(counts.shape[0])]
        questions = [None] * counts.shape[0]
        for q, k, i in keys:
            episode, _, question_id = chosen[(q, k, i)]
            top[q][k].subs.append(episode)
            questions[q] = self.question_by_id[question_id]
        return RolloutBatch(questions, top), {key: chosen[key] for key in keys}


class AsyncServing(AsyncRollouts):
    """The decoupled sub job's asynchronous mode (`async_rl.enabled`, docs/async.md): a serving thread answers the
    main job's delegations with the newest weights its sampler holds, for the step the learner trains next and the
    steps after it, while the learner trains on the steps the main job has committed. Step t is served only by
    weights of version t - `max_staleness` or newer (the learner trains step t at version t: one sub update per
    step), so no token trains more than `max_staleness` versions after it was sampled; at 0 the thread serves what
    the synchronous job would, under the same weights and seeds."""

    def __init__(self, config, system, feed, workdir: str, side: ServingSubSide):
        super().__init__(config, system, feed, workdir, 0)
        self.side, self.learner_step = side, 0
        self.poll_s = float(side.exchange.store.poll.max_s)
        side.server = self

    def _collector(self, system, workdir: str, transcripts: int):
        return None  # the sub job collects nothing: it serves

    def take(self, step: int) -> tuple[None, dict]:
        """The learner is at step `step` now (what came before is trained); its data is the side's cache."""
        with self._cond:
            self.check()
            self.learner_step = step
            self._cond.notify_all()
        return None, {}

    def check(self) -> None:
        """Raises the serving thread's failure, if it failed."""
        if self._error is not None:
            raise RuntimeError("the asynchronous serving thread failed") from self._error

    def _produce(self, step: int) -> None:
        try:
            self.learner_step = max(self.learner_step, step)
            while True:
                with self._cond:
                    if self._stop:
                        return
                    version, first = self.version, self.learner_step
                served = False
                for t in range(first, version + self.max_staleness + 1):  # the steps these weights may serve
                    batches = self.side.exchange.claim(t)
                    if batches:
                        again = (lambda v=version: self.version != v) if self.partial == "restart" else None
                        with self._rolling_out():
                            self.side.serve(t, batches, version, self.engine, again)
                        served = True
                        break
                if not served:
                    with self._cond:
                        self._cond.wait(timeout=self.poll_s)
        except BaseException as e:  # raised in the learner's thread by `check`
            log.exception("asynchronous serving thread failed")
            with self._cond:
                self._error = e
                self._cond.notify_all()


def job_system(config, job: str, workdir: str, store, *, resuming: bool) -> tuple[Exchange, System]:
    """Job `job`'s transport and parts. The main job's engine sends its delegations through the store and its
    tokenizer is published for the sub job; the sub job builds on the main job's tokenizer; a colocated job carries
    nothing."""
    if job == "main":
        exchange = MainExchange(store, config, workdir, resuming=resuming)
        system = build_system(config, job, workdir, sub_executor=exchange.delegate)
        exchange.publish_tokenizer(system.tokenizer)
        return exchange, system
    if job == "sub":
        published = main_tokenizer(store, workdir, config)
        system = build_system(config, job, workdir)
        check_tokenizer(system.tokenizer, published, config, workdir)
        return SubExchange(store, config), system
    return Exchange(), build_system(config, job, workdir)


def serving(exchange: SubExchange, config, workdir: str, system: System):
    """The sub job's wrapper of its sub side (`sides.build_sides(serving=...)`)."""
    return lambda inner: ServingSubSide(inner, exchange, config, workdir, system.env, system.engine)
