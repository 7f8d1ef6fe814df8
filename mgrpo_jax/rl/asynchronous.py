"""Asynchronous M-GRPO with bounded staleness (`config.async_rl`, docs/async.md).

    rollouts = AsyncRollouts(config, system, feed, workdir, transcripts)
    rollouts.start(step)                 # weights to the samplers (version `step`), the sampler thread starts
    collected, figures = rollouts.take(step)   # the learner: step `step`'s finished groups (waits for them)
    rows, figures = rollouts.correct(learner, rows, version)   # stale tokens corrected (core/offpolicy.py)
    rollouts.push(step + 1)              # after the update: new weights to the samplers, on device
    rollouts.close()                     # stops the thread; the question feed back where training stands

A sampler thread rolls out the questions of step s, s + 1, ... on its own copy of each agent's weights (on the
agent's rollout devices, `async_rl.rollout_devices`, or beside the learner's), while the trainer's thread computes
credit and trains on the steps already sampled. Step s is sampled only once the samplers hold version
s - `max_staleness` or newer (version v: the weights after v RL updates of this run), so no token is trained more
than `max_staleness` versions after it was sampled, and at most `max_staleness` + 1 steps wait finished. A step's
groups are the K rollouts of each of its questions, formed by the rollout engine whatever order its episodes finish
in. `max_staleness = 0` samples step s after update s - 1 with the same weights, seeds and questions as the
synchronous step: the same metrics.

Each sampled token carries the version of the weights its turn began under (`Episode.versions`): new weights reach
the sampler between two decode calls, so with `partial_rollouts = "continue"` a turn in flight finishes under them
and its tokens keep the older tag (an upper bound on their staleness; the recorded behaviour log-probs, which the
correction uses, are exact either way). With "restart" a step whose rollouts saw new weights arrive is sampled again
from its start under them (at most `max_staleness` times: only that many updates can run without it).

Resume: a checkpoint at step s records the question feed's position before step s's questions; steps sampled ahead
are dropped with the thread, and the resumed run samples them again under the restored (step s) weights. Exact at
`max_staleness = 0`; above it the resumed steps' tokens are fresher than the uninterrupted run's.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import threading
import time

import jax
import numpy as np
from flax import nnx

from mgrpo_jax.agent.build import SHARED, agent_rollout_devices
from mgrpo_jax.agent.step import make_logprob_fn
from mgrpo_jax.core.offpolicy import behaviour_weights, decoupled_rows, per_token_advantages, stale_tokens
from mgrpo_jax.env.build import build_environment
from mgrpo_jax.env.prompts import MAIN
from mgrpo_jax.model import abstract_model, make_mesh
from mgrpo_jax.rl.sides import MainSide, row_multiple, trained_tokens
from mgrpo_jax.rl.system import build_engine
from mgrpo_jax.rollout import batches
from mgrpo_jax.sampling import Sampler

log = logging.getLogger(__name__)


@dataclasses.dataclass
class RolloutAgent:
    """What the rollout engine reads of an agent (`system.build_engine`): its sampler and its tokenizer."""

    sampler: Sampler
    tokenizer: object


def rollout_sampler(learner, devices: list | None) -> tuple[Sampler, object]:
    """(a sampler of `learner`'s policy on `devices`, the shardings its weights are pushed to). `devices` None: the
    learner's own devices, with a copy of the weights (each update donates the learner's buffers)."""
    own, params = learner.sampler, learner.policy_params()
    if devices:
        mesh = make_mesh(learner.config.mesh.to_dict(), devices)
        graphdef, abstract = abstract_model(learner.model_config, mesh, learner.rules)
        shardings = jax.tree.map(lambda a: a.sharding, nnx.state(nnx.merge(graphdef, abstract), nnx.Param))
    else:
        graphdef, shardings = own.graphdef, jax.tree.map(lambda x: x.sharding, params)
    state = jax.device_put(params, shardings, may_alias=False)
    sampler = Sampler(nnx.merge(graphdef, state), pad_id=own.pad_id, top_k=own.top_k, top_p=own.top_p,
                      batch_buckets=own.batch_buckets, length_buckets=own.length_buckets,
                      cache_dtype=own.cache_dtype, decode_phases=own.decode_phases, out_major=own.out_major)
    return sampler, shardings


@dataclasses.dataclass
class Sampled:
    """One step's finished rollouts (`MainSide.collect`'s), the version they started under, and what it cost."""

    collected: object
    version: int
    sampling_s: float
    restarts: int


class AsyncRollouts:
    """The sampler thread and its bounded hand-over to the learner (the module's docstring)."""

    def __init__(self, config, system, feed, workdir: str, transcripts: int, sub_executor=None):
        """`sub_executor`: where the samplers' delegations go when the sub-agent is another job's (the decoupled
        main job's `MainExchange.delegation()`); None: this job's own sub-agent sampler."""
        cfg = config.async_rl
        self.config, self.feed = config, feed
        self.max_staleness, self.partial = int(cfg.max_staleness), cfg.partial_rollouts
        self.correction, self.is_cap = cfg.correction, float(cfg.is_cap)
        self.learners, self.sub_executor = system.learners, sub_executor
        devices = agent_rollout_devices(config, only=tuple(system.agents))
        self.samplers, self.shardings = {}, {}
        for name, learner in self.learners.items():
            section = MAIN if name == SHARED else name
            self.samplers[name], self.shardings[name] = rollout_sampler(learner, devices.get(section))
        agents = {agent: RolloutAgent(self.samplers[learner.name], learner.tokenizer)
                  for agent, learner in system.agents.items()}
        self.env = build_environment(config)  # its own: a step posed in a twin must not reach the evaluation's world
        self.engine = build_engine(config, system.tokenizer, self.env, agents, sub_executor)
        self.collector = self._collector(system, workdir, transcripts)
        self._logprob_fns: dict = {}
        self._cond = threading.Condition()
        self._thread: threading.Thread | None = None
        self._ready: dict[int, Sampled] = {}
        self._positions: dict[int, dict] = {}  # step -> the feed's position before its questions
        self._error: BaseException | None = None
        self._stop = False
        self.version = 0
        self.sampler_blocked_s = self.learner_wait_s = 0.0
        self._busy: list[tuple[float, float]] = []  # (start, end) of every rollout (`perf_counter`); end inf: running

    def _collector(self, system, workdir: str, transcripts: int):
        """What samples a step: the top agent's side, on the samplers' engine."""
        return MainSide(system.agents[system.top_name], self.engine, self.env, self.config, workdir, transcripts)

    # -- the learner's side ------------------------------------------------------------------------------

    def start(self, step: int) -> None:
        """The samplers get the learners' weights as version `step`; the thread starts sampling step `step`."""
        if self._thread is not None:
            return
        self._stop, self._error, self._ready, self._positions = False, None, {}, {}
        self.push(step)
        self._thread = threading.Thread(target=self._produce, args=(step,), name="async-rollouts", daemon=True)
        self._thread.start()

    def take(self, step: int) -> tuple[object, dict]:
        """Step `step`'s finished rollouts (waiting for them) and the figures of their sampling."""
        start = time.perf_counter()
        with self._cond:
            self._cond.wait_for(lambda: step in self._ready or self._error is not None)
            if self._error is not None:
                raise RuntimeError("the asynchronous sampler failed") from self._error
            sampled = self._ready.pop(step)
            waiting = len(self._ready)
        wait = time.perf_counter() - start
        self.learner_wait_s += wait
        return sampled.collected, {"async/sampled_version": sampled.version, "async/wait_s": wait,
                                   "async/sampling_s": sampled.sampling_s, "async/restarts": sampled.restarts,
                                   "async/ready_steps": waiting}

    def push(self, version: int) -> None:
        """Every trainable learner's weights to its sampler (a device-to-device copy onto the sampler's shardings,
        dispatched before the next update donates them); then the samplers and the gate move to `version`."""
        for name, learner in self.learners.items():
            sampler = self.samplers[name]
            if learner.trainable or self._thread is None:
                sampler.update_weights(jax.device_put(learner.policy_params(), self.shardings[name],
                                                      may_alias=False))
            sampler.version = version  # after the weights: a turn tagged `version` samples under them
        with self._cond:
            self.version = version
            self._cond.notify_all()

    def correct(self, learner, rows: dict | None, version: int) -> tuple[dict | None, dict]:
        """`rows` of `learner` trained at `version`: their staleness figures, and with `max_staleness` > 0 and the
        decoupled correction, stale tokens corrected (mgrpo_jax/core/offpolicy.py; advantages per token). At
        `max_staleness` 0 every token is on-policy and the rows are returned as they are."""
        if rows is None or not len(rows["weights"]):
            return rows, {}
        trained = trained_tokens(rows) * (np.asarray(rows["weights"]) > 0)[:, None]
        stale = stale_tokens(rows["versions"], trained, version)
        counted = trained > 0
        age = (version - np.asarray(rows["versions"]))[counted]
        prefix = f"async/{learner.name}"
        figures = {f"{prefix}/staleness_max": float(age.max()) if age.size else 0.0,
                   f"{prefix}/staleness_mean": float(age.mean()) if age.size else 0.0,
                   f"{prefix}/stale_share": float(stale.sum() / max(counted.sum(), 1))}
        if self.max_staleness == 0 or self.correction == "none":
            return rows, figures
        if not stale.any():
            return per_token_advantages(rows), figures
        proximal = self.proximal_logprobs(learner, rows)
        weights = behaviour_weights(rows["old_logprobs"], proximal, stale, self.is_cap)[stale]
        figures.update({f"{prefix}/is_weight_mean": float(weights.mean()),
                        f"{prefix}/is_capped_share": float((weights >= self.is_cap).mean())})
        return decoupled_rows(rows, proximal, stale, self.is_cap), figures

    def proximal_logprobs(self, learner, rows: dict) -> np.ndarray:
        """[B, T] the behaviour-distribution log-probs of `rows` under `learner`'s current weights (the proximal
        policy), as its policy step computes them; rows padded to what its mesh splits, then cut back."""
        lora = learner.lora is not None
        key = (learner.name, id(learner.graphdef))
        if key not in self._logprob_fns:
            graphdef = learner.sampler.graphdef if lora else learner.graphdef
            sharding = jax.tree.map(lambda x: x.sharding, learner.policy_params()) if lora else learner.sharding
            self._logprob_fns = {key: make_logprob_fn(graphdef, sharding, learner.mesh,
                                                      micro_batches=learner.config.micro_batches,
                                                      top_k=learner.sampler.top_k, top_p=learner.sampler.top_p),
                                 **{k: v for k, v in self._logprob_fns.items() if k[0] != learner.name}}
        n, multiple = len(rows["weights"]), row_multiple(learner)
        keys = ("tokens", "positions", "attention_mask", "temperature", "weights")
        padded = batches.pad_rows({k: rows[k] for k in keys}, -(-n // multiple) * multiple)
        params = learner.policy_params() if lora else learner.state.params
        out = self._logprob_fns[key](params, padded["tokens"], padded["positions"], padded["attention_mask"],
                                     padded["temperature"])
        return np.asarray(jax.device_get(out))[:n]

    def iterator_state(self, step: int) -> dict:
        """The question feed's position before step `step`'s questions (what a checkpoint at `step` resumes)."""
        with self._cond:
            if step in self._positions:
                return self._positions[step]
            return self.feed.iterator.get_state()

    def sampler_busy_s(self, start: float, end: float) -> float:
        """Seconds of [start, end] (`time.perf_counter` readings) the sampler spent rolling out."""
        with self._cond:
            return sum(max(0.0, min(end, b) - max(start, a)) for a, b in self._busy)

    def close(self, step: int) -> None:
        """Stops the thread (after the rollout in flight) and drops what it sampled ahead; the feed goes back to
        step `step`'s questions."""
        thread = self._thread
        if thread is None:
            return
        with self._cond:
            self._stop = True
            self._cond.notify_all()
        thread.join()
        self._thread = None
        position = self._positions.get(step)
        if position is not None:
            self.feed.iterator.set_state(position)
        self._ready, self._positions = {}, {}

    # -- the sampler thread ------------------------------------------------------------------------------

    def _produce(self, step: int) -> None:
        try:
            while step < self.config.train.steps:
                start = time.perf_counter()
                with self._cond:
                    self._cond.wait_for(lambda step=step: self._stop or self.version >= step - self.max_staleness)
                    self.sampler_blocked_s += time.perf_counter() - start
                    if self._stop:
                        return
                    self._positions[step] = self.feed.iterator.get_state()
                    questions = next(self.feed.iterator)
                sampled = self._sample(step, questions)
                with self._cond:
                    self._ready[step] = sampled
                    self._cond.notify_all()
                step += 1
        except BaseException as e:  # handed to the learner's `take`
            log.exception("asynchronous sampler failed at step %d", step)
            with self._cond:
                self._error = e
                self._cond.notify_all()

    def _sample(self, step: int, questions) -> Sampled:
        restarts, start = 0, time.perf_counter()
        with self._rolling_out():
            while True:
                version = self.version
                if self.sub_executor is not None:  # the other job's sub-agent: tasks of this step, this main version
                    self.sub_executor.at(step, version)
                collected = self.collector.collect(step, questions)
                if self.partial == "continue" or self.version == version or self._stop:
                    break
                restarts += 1  # new weights arrived during the rollout: sample the step again under them
        return Sampled(collected, version, time.perf_counter() - start, restarts)

    @contextlib.contextmanager
    def _rolling_out(self):
        """Marks the samplers busy (`sampler_busy_s`) while the block runs."""
        start = time.perf_counter()
        with self._cond:
            self._busy.append((start, float("inf")))
            index = len(self._busy) - 1
        try:
            yield
        finally:
            with self._cond:
                self._busy[index] = (start, time.perf_counter())
