"""Multi-process runs: `launch/tpu_run.py` as 2 JAX processes x 4 CPU devices (jax.distributed with a coordinator
on 127.0.0.1, gloo collectives) forms one 8-device job whose `smoke` run equals the 1 process x 8 devices run:
the same warm-start losses, rollouts, RL metrics and final parameters. Only process 0 logs and writes metrics;
the checkpoint both processes wrote together restores in one process, onto a different mesh.

The smoke rewards are all 0 (an untrained tiny model), so the RL updates are weight decay only; the one warm-start
step is the real gradient check (it runs the same jitted step machinery with a non-zero gradient, over batch rows
that each process placed on its own devices), and the sampled transcripts check the sampler across processes.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import jax
import numpy as np
import pytest

from mgrpo_jax.agent.state import abstract_agent_state
from mgrpo_jax.config import get_config
from mgrpo_jax.model import DEFAULT_RULES, get_model_config, make_mesh
from mgrpo_jax.rl.trainer import Trainer
from mgrpo_jax.runtime.checkpoint import Checkpointer
from mgrpo_jax.runtime.metrics import read_jsonl
from mgrpo_jax.tokenizer import Tokenizer

REPO = Path(__file__).resolve().parents[2]
LAUNCH = REPO / "launch" / "tpu_run.py"
OVERRIDES = {"warmstart.steps": 1, "train.steps": 1, "train.eval_every": 0}
TIMEOUT_S = 600


def _config():
    config = get_config("xbench", "smoke")
    for key, value in OVERRIDES.items():
        section, field = key.split(".")
        config[section][field] = value
    return config


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _start_processes(workdir: Path, n: int = 2, devices_each: int = 4) -> list[tuple[subprocess.Popen, Path]]:
    env = dict(os.environ, JAX_PLATFORMS="cpu", XLA_FLAGS=f"--xla_force_host_platform_device_count={devices_each}")
    env["PYTHONPATH"] = str(REPO) + os.pathsep + env.get("PYTHONPATH", "")
    coordinator = f"127.0.0.1:{_free_port()}"
    flags = ["--config=experiments/xbench.py:smoke", f"--workdir={workdir}",
             *(f"--config.{k}={v}" for k, v in OVERRIDES.items()),
             f"--coordinator={coordinator}", f"--num_processes={n}"]
    procs = []
    for i in range(n):
        log_path = workdir.parent / f"process{i}.log"
        with open(log_path, "w") as log:
            procs.append((subprocess.Popen([sys.executable, str(LAUNCH), *flags, f"--process_id={i}"], cwd=REPO,
                                           env=env, stdout=log, stderr=subprocess.STDOUT), log_path))
    return procs


def _finish(procs) -> None:
    deadline = time.monotonic() + TIMEOUT_S
    try:
        for i, (proc, log_path) in enumerate(procs):
            try:
                code = proc.wait(timeout=max(1.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                code = "a timeout"
            assert code == 0, f"process {i} exited with {code}:\n{log_path.read_text()[-6000:]}"
    finally:
        for proc, _ in procs:
            if proc.poll() is None:
                proc.kill()
            proc.wait()


def _records(workdir: Path) -> list[dict]:
    return read_jsonl(workdir / "metrics.jsonl")


def _restore_params(workdir: Path, config, mesh) -> dict:
    """Every agent's parameters of the latest checkpoint, restored onto `mesh` in this (one) process."""
    vocab = Tokenizer.load(str(workdir / "tokenizer.model")).vocab_size
    targets = {}
    for name in ("main", "sub"):
        agent = config[name]
        model_cfg = get_model_config(agent.model, **{"vocab_size": vocab, **agent.model_overrides.to_dict()})
        targets[name] = abstract_agent_state(model_cfg, agent.optim, mesh, DEFAULT_RULES)[1]
    checkpointer = Checkpointer(workdir)
    try:
        states, host = checkpointer.restore(targets)
    finally:
        checkpointer.close()
    assert host["step"] == OVERRIDES["train.steps"]
    out = {}
    for name, state in states.items():
        leaves = jax.tree_util.tree_leaves_with_path(state.params)
        for _, leaf in leaves:
            assert leaf.sharding.mesh.shape == mesh.shape  # placed on the mesh asked for
        out[name] = {jax.tree_util.keystr(p): np.asarray(leaf) for p, leaf in leaves}
    return out


@pytest.mark.slow
def test_two_processes_equal_one_process_and_their_checkpoint_restores_in_one(tmp_path):
    assert jax.process_count() == 1 and jax.device_count() == 8  # tests/conftest.py: 8 fake CPU devices
    multi, single = tmp_path / "multi" / "run", tmp_path / "single" / "run"
    multi.parent.mkdir()
    procs = _start_processes(multi)  # 2 processes x 4 devices, while this process runs 1 x 8
    try:
        Trainer(_config(), str(single)).run()
    finally:
        _finish(procs)

    logs = [path.read_text() for _, path in procs]
    assert "8 devices, 2 processes" in logs[0] and "step 1/1 |" in logs[0]
    assert "step 1/1 |" not in logs[1] and "[step 1/1]" not in logs[1]  # only process 0 reports progress

    a, b = _records(single), _records(multi)
    assert [r.get("step", r.get("warmstart")) for r in b] == [r.get("step", r.get("warmstart")) for r in a]
    assert [r["step"] for r in b if "step" in r] == [1]  # one writer: each step once
    warm = [k for r in a for k in r if k.startswith("warmstart/")]
    assert warm and all(np.isfinite(r[k]) and r[k] > 0 for r in a for k in r if k in warm)
    for ra, rb in zip(a, b, strict=True):
        for key, value in ra.items():
            if key.startswith(("time/", "throughput/")) or not isinstance(value, int | float):
                continue
            assert rb[key] == pytest.approx(value, rel=1e-5, abs=1e-6), key
    # The same sampled episodes (token for token, rendered): the sampler agrees across processes.
    transcripts = [(d / "transcripts.jsonl").read_text() for d in (single, multi)]
    assert transcripts[0] and transcripts[0] == transcripts[1]
    assert (single / "tokenizer.model").read_bytes() == (multi / "tokenizer.model").read_bytes()

    # The collectively written checkpoint restores in one process, onto another mesh (fsdp and tensor axes).
    mesh = make_mesh({"data": 2, "fsdp": 2, "tensor": 2})
    want, got = _restore_params(single, _config(), mesh), _restore_params(multi, _config(), mesh)
    moved = 0
    for name in ("main", "sub"):
        assert want[name].keys() == got[name].keys()
        for key in want[name]:
            np.testing.assert_allclose(got[name][key], want[name][key], rtol=1e-5, atol=1e-6, err_msg=key)
        moved += sum(float(np.abs(v).sum()) for v in want[name].values())
    assert moved > 0
    assert json.loads((multi / "summary.json").read_text())["main/reward"] == pytest.approx(
        json.loads((single / "summary.json").read_text())["main/reward"])
