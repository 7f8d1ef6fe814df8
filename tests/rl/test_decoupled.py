"""Decoupled mode: `--role=main` and `--role=sub` as two OS processes that share nothing but the store URL,
over a file:// store and over gs:// against the patched GCS emulator, complete the `smoke` steps.

The main agent's first turn is scripted as a delegation (tests/rl/scripted_launch.py), so every rollout
sends at least one task through the store and the sub job trains on real sub-trajectories.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from mgrpo_jax.runtime.metrics import read_jsonl
from mgrpo_jax.store import open_store
from tests.store import conftest as store_conftest
from tests.store.conftest import REPO, make_url, subprocess_env

LAUNCH = Path(__file__).resolve().parent / "scripted_launch.py"
STEPS = 2
TIMEOUT_S = 600  # both processes; each waits at most 300 s for the other
ASYNC = ("--config.async_rl.enabled=True",)
MOVING = ("--config.advantages.estimator=alternating",)  # updates that move the policy at reward 0 (scripted_launch)


@pytest.fixture(scope="module")
def gcs_emulator():
    """The store tests' emulator when this session already runs it (same port), else one for this module."""
    with store_conftest.shared_emulator() as url:
        yield url


class Role:
    """One `launch/tpu_run.py --role=...` process of the smoke preset, logging to a file."""

    def __init__(self, role: str, url: str, workdir: Path, steps: int = STEPS, log_name: str | None = None,
                 extra: tuple = ()):
        flags = ["--config=experiments/xbench.py:smoke", f"--workdir={workdir}", f"--config.store={url}",
                 "--config.warmstart.steps=1", f"--config.train.steps={steps}", "--config.train.eval_every=0",
                 "--config.decoupled.timeout_s=300", *extra]
        env = subprocess_env()
        env.pop("XLA_FLAGS", None)  # one CPU device per job: the two jobs share the test machine's cores
        self.role = role
        self.log_path = workdir.parent / f"{log_name or role}.log"
        with open(self.log_path, "w") as log:
            self.proc = subprocess.Popen([sys.executable, str(LAUNCH), *flags, f"--role={role}"], cwd=REPO, env=env,
                                         stdout=log, stderr=subprocess.STDOUT)

    def log(self) -> str:
        return self.log_path.read_text()

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait()


def _finish(*roles: Role, timeout_s: float = TIMEOUT_S) -> None:
    """Waits for every role to exit 0 (killing all on a failure or timeout), with its log in the message."""
    deadline = time.monotonic() + timeout_s
    try:
        for role in roles:
            try:
                code = role.proc.wait(timeout=max(1.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                code = "a timeout"
            assert code == 0, f"--role={role.role} exited with {code}:\n{role.log()[-6000:]}"
    finally:
        for role in roles:
            role.kill()


def _steps(path: Path) -> list[dict]:
    return [r for r in read_jsonl(path) if "step" in r]


def _check_two_process_run(url: str, workdir: Path) -> None:
    main, sub = _steps(workdir / "main" / "metrics.jsonl"), _steps(workdir / "sub" / "metrics.jsonl")
    assert [r["step"] for r in main] == [r["step"] for r in sub] == list(range(1, STEPS + 1))
    store = open_store(url)
    for step, (m, s) in enumerate(zip(main, sub, strict=True)):
        view = store.read_step(step, "main")
        counts = view.array("sub_counts")
        # Every rollout delegated (the scripted first turn) and the sub job served exactly those tasks.
        assert counts.min() >= 1 and counts.sum() == m["sub/episodes"] == s["sub/episodes"]
        assert sorted(store.tasks.answers(step)) == sorted(store.tasks.task_ids(step))
        assert s["sub/main_correct"] == pytest.approx(float(view.array("main_correct").mean()))
        # The main job's published reward is its targets' R_M of the step it logged.
        assert float(view.array("main_reward").mean()) == pytest.approx(m["main/reward"], abs=1e-6)
        assert s["sub/staleness"] == 0.0 and "sub/train/loss" in s and "main/train/loss" in m
        assert store.read_step(step, "sub").policy_version == step  # one sub update per step
    # The sub job trained on the main job's tokenizer; each job checkpointed in its own folder.
    assert (workdir / "main" / "tokenizer.model").read_bytes() == (workdir / "sub" / "tokenizer.model").read_bytes()
    for role in ("main", "sub"):
        assert (workdir / role / "checkpoints").is_dir()
        assert json.loads((workdir / role / "summary.json").read_text())
    # The sub job keeps its trajectory cache from its second-newest checkpoint on (a resume point even when the
    # newest save is cut short): the last step's cache, and at most the one before it.
    cached = sorted(os.listdir(workdir / "sub" / "cache"))
    assert cached[-1] == f"{STEPS - 1:010d}.jsonl" and len(cached) <= 2


@pytest.mark.slow
def test_main_and_sub_roles_as_two_processes_over_gs(request, tmp_path):
    url = make_url("gs", request, tmp_path)
    workdir = tmp_path / "run"
    _finish(Role("main", url, workdir), Role("sub", url, workdir))
    _check_two_process_run(url, workdir)


@pytest.mark.slow
@pytest.mark.parametrize("extra", [(), (*ASYNC, "--config.async_rl.max_staleness=1")],
                         ids=["synchronous", "asynchronous"])
def test_killed_sub_job_resumes_from_its_checkpoint_and_cache(tmp_path, extra):
    """The sub process is killed (SIGKILL) after its second step and started again: it resumes from its latest
    checkpoint, takes the trajectories it had already served from its cache (asynchronous: also those it served
    ahead of its learner), and both jobs finish every step."""
    url, workdir, steps = (tmp_path / "store").as_uri(), tmp_path / "run", 4
    main = Role("main", url, workdir, steps, extra=extra)
    sub = Role("sub", url, workdir, steps, log_name="sub-1", extra=extra)
    try:
        deadline = time.monotonic() + TIMEOUT_S
        while "sub step 2/" not in sub.log():
            assert sub.proc.poll() is None and time.monotonic() < deadline, sub.log()[-6000:]
            time.sleep(0.2)
        sub.kill()
    except BaseException:
        main.kill()
        raise
    _finish(main, Role("sub", url, workdir, steps, log_name="sub-2", extra=extra))
    records = _steps(workdir / "sub" / "metrics.jsonl")
    assert [r["step"] for r in records] == list(range(1, steps + 1))  # resumed: no step twice, none missing
    store = open_store(url)
    for step in range(steps):
        assert store.read_step(step, "sub").policy_version == step
        assert sorted(store.tasks.answers(step)) == sorted(store.tasks.task_ids(step))
    assert "resumed from step" in (tmp_path / "sub-2.log").read_text()


def _warmstart_losses(path: Path, agent: str) -> list[float]:
    return [r[f"warmstart/{agent}/loss"] for r in read_jsonl(path) if f"warmstart/{agent}/loss" in r]


def _questions(path: Path) -> dict[int, set[str]]:
    out: dict[int, set[str]] = {}
    for record in read_jsonl(path):
        out.setdefault(record["step"], set()).add(record["question"])
    return out


@pytest.mark.slow
def test_decoupled_run_over_file_matches_the_colocated_run_with_the_same_seed(tmp_path):
    """A colocated `smoke` run and a decoupled one (file:// store) with the same seed and flags train on the same
    number of samples from the same starting weights and questions; their reward statistics differ, and why.

    Equal, and asserted:
    - the starting weights: `build_agents(only=...)` seeds each agent as in the full run (seed * 100 + agent
      index) and the warm start draws its demonstrations and batches from per-agent seeds, so each job's
      warm-start loss curve equals the colocated run's for its agent;
    - the questions of every step (the question iterator is seeded by `config.seed` in both jobs);
    - the samples trained on: Q * K main rollouts per step in both; the sub agent trains on the aligned
      [Q, K, D] slots of the step's sub-trajectories in both (synchronised mode), and every rollout delegates at
      least once (the scripted first turn), so each job served as many sub-episodes as its main job delegated.

    Different, and why: the sub agent's sampling RNG. Colocated, the rollout engine samples sub-agent turns
    inside its own loop with the key `_seed(rollout seed, engine iteration, "sub")`, split into one key per row
    of the batch of sub-episodes live at that iteration; the sub job samples the tasks it claimed with
    `_seed(seed, "serve", step, tasks already served)` over the batch it claimed. The keys differ, and a row's
    key depends on its position in a batch whose composition differs too, so the sub-agent's tokens and answers
    differ. The main agent then reads different answers, and its own later turns are sampled with other keys as
    well (colocated, a main episode resumes at the engine iteration its sub-episode ended; decoupled, all resume
    at the next iteration, once every answer of the round is in). From the second sampled token on, the two runs
    are different samples of the same policies: reward statistics agree in distribution, not value by value.
    """
    workdir_c, workdir_d = tmp_path / "colocated" / "run", tmp_path / "decoupled" / "run"
    workdir_c.parent.mkdir()
    workdir_d.parent.mkdir()
    url = (tmp_path / "store").as_uri()
    _finish(Role("colocated", f"memory://colocated-{os.getpid()}", workdir_c), Role("main", url, workdir_d),
            Role("sub", url, workdir_d))
    _check_two_process_run(url, workdir_d)  # the two-process test's checks, over file://, on the same run

    colocated = _steps(workdir_c / "metrics.jsonl")
    main, sub = _steps(workdir_d / "main" / "metrics.jsonl"), _steps(workdir_d / "sub" / "metrics.jsonl")
    assert len(colocated) == len(main) == len(sub) == STEPS
    for agent, run in (("main", workdir_d / "main"), ("sub", workdir_d / "sub")):
        losses = _warmstart_losses(workdir_c / "metrics.jsonl", agent)
        assert losses and _warmstart_losses(run / "metrics.jsonl", agent) == pytest.approx(losses, rel=1e-5)
    assert _questions(workdir_c / "transcripts.jsonl") == _questions(workdir_d / "main" / "transcripts.jsonl")
    queries, samples = 2, 2  # the smoke preset's Q and K
    store = open_store(url)
    for step, (c, m, s) in enumerate(zip(colocated, main, sub, strict=True)):
        assert c["main/episodes"] == m["main/episodes"] == queries * samples
        counts = store.read_step(step, "main").array("sub_counts")
        assert counts.shape == (queries, samples) and counts.min() >= 1
        assert s["sub/episodes"] == counts.sum() == m["sub/episodes"] >= queries * samples
        assert c["sub/episodes"] >= queries * samples
        for key in ("main/train/loss", "sub/train/loss"):
            assert key in c and key in (m if key.startswith("main") else s)
        for run in (c, m):
            assert 0.0 <= run["main/correct"] <= 1.0 and np.isfinite(run["main/reward"])
        assert np.isfinite(c["sub/reward"]) and np.isfinite(s["sub/reward"])


def _compared(record: dict) -> dict:
    """Every figure of a step but its clock readings (`time`, `time/*`, `throughput/*`) and the async ones."""
    return {k: v for k, v in record.items() if k != "time" and not k.startswith(("time/", "throughput/", "async/"))}




@pytest.mark.slow
def test_asynchronous_jobs_run_ahead_within_the_bound_and_at_staleness_zero_are_the_synchronous_jobs(tmp_path):
    """Three decoupled pairs over file:// stores, side by side: synchronous, asynchronous at `max_staleness=0` and at
    1. At 0 each job's metrics equal the synchronous job's, figure for figure (clock readings aside): the main job's
    sampler thread samples step s after update s - 1, the sub job's serving thread serves step s under version s,
    with the same seeds. At 1 both jobs finish, every trained token is at most one version old, and the sub job's
    step records list the batches it trained on."""
    pairs = {"sync": MOVING, "async0": (*MOVING, *ASYNC, "--config.async_rl.max_staleness=0"),
             "async1": (*MOVING, *ASYNC, "--config.async_rl.max_staleness=1")}
    roles, steps = [], STEPS + 1
    for name, extra in pairs.items():
        workdir = tmp_path / name / "run"
        workdir.parent.mkdir()
        url = (tmp_path / f"store-{name}").as_uri()
        roles += [Role(role, url, workdir, steps=steps, log_name=f"{name}-{role}", extra=extra)
                  for role in ("main", "sub")]
    _finish(*roles, timeout_s=2 * TIMEOUT_S)
    records = {name: {role: _steps(tmp_path / name / "run" / role / "metrics.jsonl") for role in ("main", "sub")}
               for name in pairs}
    for role in ("main", "sub"):
        sync, async0 = records["sync"][role], records["async0"][role]
        assert [r["step"] for r in async0] == [r["step"] for r in sync] == list(range(1, steps + 1))
        # The updates move the weights the next steps sample from.
        assert len({r[f"{role}/train/param_norm"] for r in sync}) == steps
        for want, got in zip(sync, async0, strict=True):
            assert _compared(got) == _compared(want)
            assert got[f"async/{role}/staleness_max"] == 0.0
    main, sub = records["async1"]["main"], records["async1"]["sub"]
    assert [r["step"] for r in main] == [r["step"] for r in sub] == list(range(1, steps + 1))
    assert max(r["async/main/staleness_max"] for r in main) <= 1
    assert max(r["async/sub/staleness_max"] for r in sub) <= 1 and max(r["sub/staleness"] for r in sub) <= 1
    store = open_store((tmp_path / "store-async1").as_uri())
    for step in range(steps - 1, steps):  # the store keeps the newest steps (`decoupled.keep_steps`)
        view = store.read_step(step, "main")
        assert view.meta["batches"] and set(view.meta["batches"]) <= set(store.tasks._ids(step, "batch"))
