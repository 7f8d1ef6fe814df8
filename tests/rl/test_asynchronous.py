"""Asynchronous M-GRPO (mgrpo_jax/rl/asynchronous.py): `max_staleness = 0` is the synchronous run, metric for
metric; the sampler never runs more than `max_staleness` versions ahead; a step's groups hold one question each;
partial rollouts restart when asked; every mode of one job runs; mgrpo_unsync is refused by name (the decoupled
jobs: tests/rl/test_decoupled.py)."""

import os
import threading
import time

import hypothesis.strategies as st
import pytest
from hypothesis import given, settings

from mgrpo_jax.config import get_config, validate
from mgrpo_jax.rl.trainer import Trainer
from mgrpo_jax.runtime.metrics import read_jsonl
from tests.rl import scripted_launch  # noqa: F401  (registers the `alternating` advantages the configs use)


def _config(mode="mgrpo", steps=3, **async_rl):
    config = get_config("xbench", f"smoke,{mode}")
    config.warmstart.steps, config.train.steps = 0, steps
    config.train.eval_every, config.train.eval_at_start = 0, False
    config.advantages.estimator = "alternating"
    for key, value in async_rl.items():
        config.async_rl[key] = value
    return config


def _rl_records(workdir):
    return [r for r in read_jsonl(os.path.join(workdir, "metrics.jsonl")) if "step" in r]


def _compared(record):
    """Every figure of a step but its clock readings (`time`, `time/*`, `throughput/*`) and the async ones."""
    return {k: v for k, v in record.items() if k != "time" and not k.startswith(("time/", "throughput/", "async/"))}


@pytest.mark.slow
def test_staleness_zero_reproduces_the_synchronous_metrics(tmp_path):
    Trainer(_config(), str(tmp_path / "sync")).run()
    Trainer(_config(enabled=True, max_staleness=0), str(tmp_path / "async")).run()
    sync, asynchronous = _rl_records(tmp_path / "sync"), _rl_records(tmp_path / "async")
    assert [r["step"] for r in asynchronous] == [1, 2, 3]
    # the updates move the policy the later steps sample from (the loss itself is 0 at ratio 1: per-row means of
    # balanced +1 / -1 advantages)
    assert all(r["main/train/grad_norm"] > 0 for r in sync)
    assert len({r["main/train/param_norm"] for r in sync}) == len(sync)
    for want, got in zip(sync, asynchronous, strict=True):
        assert _compared(got) == _compared(want)
        assert got["async/main/staleness_max"] == 0.0


@pytest.mark.slow
def test_a_resumed_run_at_staleness_zero_is_the_uninterrupted_one(tmp_path):
    """A checkpoint records the feed before the next step's questions, not where the sampler had drawn to."""
    Trainer(_config(steps=3, enabled=True, max_staleness=0), str(tmp_path / "straight")).run()
    interrupted = str(tmp_path / "interrupted")
    Trainer(_config(steps=1, enabled=True, max_staleness=0), interrupted).run()  # a checkpoint at step 1
    Trainer(_config(steps=3, enabled=True, max_staleness=0), interrupted).run()  # resumes at step 1
    straight, resumed = _rl_records(tmp_path / "straight"), _rl_records(interrupted)
    assert [r["step"] for r in resumed] == [1, 2, 3]
    for want, got in zip(straight, resumed, strict=True):
        assert _compared(got) == _compared(want)


@pytest.fixture(scope="module")
def trainer(tmp_path_factory):
    trainer = Trainer(_config(steps=1000, enabled=True, max_staleness=1, rollout_devices=2),
                      str(tmp_path_factory.mktemp("async")))
    trainer.warm_started = True
    return trainer


class _FakeCollector:
    """Stands in for the rollout: records the sampler's version at each step's start, takes `seconds`."""

    def __init__(self, rollouts, seconds, push_during=None):
        self.rollouts, self.seconds, self.push_during, self.versions = rollouts, seconds, push_during, {}

    def collect(self, step, questions):
        self.versions.setdefault(step, []).append(self.rollouts.version)
        if self.push_during is not None and len(self.versions[step]) == 1:
            self.push_during(step)
        time.sleep(self.seconds)
        return step


@settings(max_examples=8, deadline=None)
@given(st.integers(0, 3), st.lists(st.floats(0.0, 0.01), min_size=6, max_size=6), st.floats(0.0, 0.01))
def test_the_sampler_never_exceeds_max_staleness(trainer, staleness, learner_seconds, sampler_seconds):
    rollouts = trainer.rollouts
    real, rollouts.collector = rollouts.collector, _FakeCollector(rollouts, sampler_seconds)
    rollouts.max_staleness = staleness
    try:
        rollouts.start(0)
        for step, seconds in enumerate(learner_seconds):
            collected, figures = rollouts.take(step)
            assert collected == step and step - figures["async/sampled_version"] <= staleness
            assert figures["async/ready_steps"] <= staleness  # the hand-over is bounded
            time.sleep(seconds)  # the update
            rollouts.push(step + 1)
        for step, versions in rollouts.collector.versions.items():
            assert step - min(versions) <= staleness
    finally:
        rollouts.close(len(learner_seconds))
        rollouts.collector, rollouts.max_staleness = real, 1


def test_restart_samples_a_step_again_when_new_weights_arrive(trainer):
    rollouts = trainer.rollouts
    pushed = threading.Event()

    def push_once(step):  # the learner's update lands while step 1 is being sampled
        if step == 1 and not pushed.is_set():
            pushed.set()
            rollouts.push(1)

    real, rollouts.collector = rollouts.collector, _FakeCollector(rollouts, 0.0, push_once)
    rollouts.partial = "restart"
    try:
        rollouts.start(0)
        rollouts.take(0)
        _, figures = rollouts.take(1)
        assert figures["async/restarts"] == 1 and figures["async/sampled_version"] == 1
        assert rollouts.collector.versions[1] == [0, 1]
    finally:
        rollouts.close(2)
        rollouts.collector, rollouts.partial = real, "continue"


def test_groups_hold_one_question_and_tokens_their_versions(trainer):
    trainer.step = 0
    try:
        for _ in range(3):
            metrics = trainer.rl_step()
            assert metrics["async/main/staleness_max"] <= 1
        trainer.rollouts.start(trainer.step)
        collected, _ = trainer.rollouts.take(trainer.step)
    finally:
        trainer.stop_rollouts()
    for q, row in enumerate(collected.rollout.top):  # the K rollouts of question q, in the credit's group q
        assert [e.question_index for e in row] == [q] * len(row)
        for episode in row:
            assert all(sub.question_index == q for sub in episode.subs)
            assert len(episode.versions) == len(episode.tokens)
            sampled = {v for v, m in zip(episode.versions, episode.loss_mask, strict=True) if m}
            assert sampled and sampled <= {2, 3}  # sampled under version 3 - max_staleness or newer


@pytest.mark.parametrize("mode,partial", [("shared_mgrpo", "continue"), ("single_agent", "continue"),
                                          ("matpo", "continue"), ("frozen_sub", "restart")])
def test_other_modes_run_asynchronously(tmp_path, mode, partial):
    """A shared model's pooled rows (matpo's bucketed real calls among them) with per-token advantages, the single
    agent, a frozen sub-agent, and rollouts restarted when new weights arrive."""
    config = _config(mode, steps=3, enabled=True, max_staleness=1, partial_rollouts=partial)
    summary = Trainer(config, str(tmp_path)).run()
    learner = {"shared_mgrpo": "shared", "matpo": "shared", "single_agent": "single"}.get(mode, "main")
    assert summary[f"async/{learner}/staleness_max"] <= 1
    if partial == "restart":  # all of a step's tokens have the one version it was (re)sampled under
        assert summary["async/main/stale_share"] in (0.0, 1.0)


def test_the_unsync_fifo_is_refused_by_name_and_the_decoupled_jobs_are_not():
    config = _config(enabled=True)
    config.store = "file:///tmp/store"
    for job in ("main", "sub"):  # tests/rl/test_decoupled.py runs them
        validate(config, job)
    with pytest.raises(ValueError, match="async_rl.enabled=True: not with mode mgrpo_unsync"):
        validate(_config("mgrpo_unsync", enabled=True))
    with pytest.raises(ValueError, match="async_rl.partial_rollouts"):
        validate(_config(enabled=True, partial_rollouts="resume"))
