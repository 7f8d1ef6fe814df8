"""Decoupled mode: `--role=main` and `--role=sub` as two OS processes that share nothing but the store URL,
over a file:// store and over gs:// against the patched GCS emulator, complete the `smoke` steps.

The main agent's first turn is scripted as a delegation (tests/train/scripted_launch.py), so every rollout
sends at least one task through the store and the sub job trains on real sub-trajectories.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from mgrpo_jax.store import open_store
from mgrpo_jax.train.metrics import read_jsonl
from tests.store import conftest as store_conftest
from tests.store.conftest import REPO, make_url, subprocess_env

LAUNCH = Path(__file__).resolve().parent / "scripted_launch.py"
STEPS = 2
TIMEOUT_S = 600  # both processes; each waits at most 300 s for the other


@pytest.fixture(scope="module")
def gcs_emulator():
    """The store tests' emulator when this session already runs it (same port), else one for this module."""
    if store_conftest.emulator_listening():
        yield store_conftest.EMULATOR_URL
    else:
        with store_conftest.running_emulator() as url:
            yield url


def _run_roles(url: str, workdir: Path) -> dict[str, tuple[int, str]]:
    flags = ["--config=experiments/xbench.py:smoke", f"--workdir={workdir}", f"--config.store={url}",
             "--config.warmstart.steps=1", f"--config.train.steps={STEPS}", "--config.train.eval_every=0",
             "--config.decoupled.timeout_s=300"]
    env = subprocess_env()
    env.pop("XLA_FLAGS", None)  # one CPU device per job: the two jobs share the test machine's cores
    procs, logs = {}, {}
    for role in ("main", "sub"):
        logs[role] = open(workdir.parent / f"{workdir.name}-{role}.log", "w+")  # noqa: SIM115
        procs[role] = subprocess.Popen([sys.executable, str(LAUNCH), *flags, f"--role={role}"], cwd=REPO, env=env,
                                       stdout=logs[role], stderr=subprocess.STDOUT)
    deadline = time.monotonic() + TIMEOUT_S
    out = {}
    try:
        for proc in procs.values():
            proc.wait(timeout=max(1.0, deadline - time.monotonic()))
    except subprocess.TimeoutExpired:
        pass
    finally:
        for role, proc in procs.items():
            if proc.poll() is None:
                proc.kill()
                proc.wait()
            logs[role].seek(0)
            out[role] = (proc.returncode, logs[role].read())
            logs[role].close()
    return out


def _steps(path: Path) -> list[dict]:
    return [r for r in read_jsonl(path) if "step" in r]


@pytest.mark.slow
@pytest.mark.parametrize("remote", ["file", "gs"])
def test_main_and_sub_roles_as_two_processes(remote, request, tmp_path):
    url = make_url(remote, request, tmp_path)
    workdir = tmp_path / "run"
    results = _run_roles(url, workdir)
    for role, (code, log) in results.items():
        assert code == 0, f"--role={role} exited with {code}:\n{log[-6000:]}"

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
        assert s["sub/staleness"] == 0.0 and "sub/train/loss" in s and "main/train/loss" in m
        assert store.read_step(step, "sub").policy_version == step  # one sub update per step
    # The sub job trained on the main job's tokenizer; each job checkpointed in its own folder.
    assert (workdir / "main" / "tokenizer.model").read_bytes() == (workdir / "sub" / "tokenizer.model").read_bytes()
    for role in ("main", "sub"):
        assert (workdir / role / "checkpoints").is_dir()
        assert json.loads((workdir / role / "summary.json").read_text())
    # The sub job's trajectory cache is pruned up to its latest checkpoint (the last save may still be in flight).
    assert all(int(name.split(".")[0]) >= STEPS - 1 for name in os.listdir(workdir / "sub" / "cache"))
