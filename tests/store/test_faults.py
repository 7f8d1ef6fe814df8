"""Fault tests of the decoupled exchange: a GCS outage mid-run, and corrupt or partial objects in the store.

(The killed-and-restarted sub job is tests/rl/test_decoupled.py; a corrupt step record read through
``StepView.records`` is tests/store/test_steps.py::test_corrupt_record_detected.)
"""

from __future__ import annotations

import json
import subprocess
import sys
import time

import numpy as np
import pytest

from mgrpo_jax.store import CorruptRecordError, Record, StoreError, open_store

from .conftest import BUCKET, HERE, free_port, start_emulator, stop_emulator, subprocess_env

STEPS, Q, K, ROUNDS = 4, 2, 3, 2
OUTAGE_S = 3.0


def _worker(role: str, url: str, env: dict) -> subprocess.Popen:
    args = [sys.executable, str(HERE / "exchange_worker.py"), role, url, *map(str, (STEPS, Q, K, ROUNDS))]
    return subprocess.Popen(args, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def _wait_for_line(proc: subprocess.Popen, text: str, timeout_s: float) -> list[str]:
    deadline = time.monotonic() + timeout_s
    lines = []
    while time.monotonic() < deadline:
        line = proc.stdout.readline()
        if not line:
            break
        lines.append(line)
        if text in line:
            return lines
    raise AssertionError(f"never printed {text!r}; said {lines}; stderr {proc.stderr.read()[-4000:]}")


@pytest.mark.slow
def test_emulator_outage_mid_run_loses_and_duplicates_nothing(tmp_path):
    """The on-disk emulator is stopped once the first step is through, stays down OUTAGE_S seconds and restarts
    on the same port and directory. Both sides ride the outage out on retries (ours or TensorStore's)
    and finish every step; then every task has exactly one answer (the right one), every step both
    commits with the right arrays, and the FIFO holds each sub-trajectory exactly once, in order, all popped."""
    port, data_dir = free_port(), tmp_path / "gcs"
    emulator_url = f"http://127.0.0.1:{port}"
    env = subprocess_env(emulator_url)
    url = f"gs://{BUCKET}/outage/store"
    emulator = start_emulator(port, data_dir)
    workers = []
    try:
        workers = [_worker("main", url, env), _worker("sub", url, env)]
        _wait_for_line(workers[0], "main step 0 done", timeout_s=120)
        assert all(w.poll() is None for w in workers), "a worker finished before the outage"
        stop_emulator(emulator)
        time.sleep(OUTAGE_S)
        assert all(w.poll() is None for w in workers), "a worker finished during the outage"
        emulator = start_emulator(port, data_dir)
        outputs = []
        for worker in workers:
            out, err = worker.communicate(timeout=240)
            assert worker.returncode == 0, err[-4000:]
            outputs.append(out)
        # Who absorbs the outage varies with timing: TensorStore's GCS driver retries requests itself (backing
        # off from 1 s), so on a slow machine our retry layer may count no error; both sides crossed it either way.
        assert all(out.strip().splitlines()[-1].rsplit(" ", 1)[1].isdigit() for out in outputs), outputs
        inspected = subprocess.run(
            [sys.executable, str(HERE / "exchange_worker.py"), "inspect", url, *map(str, (STEPS, Q, K, ROUNDS))],
            env=env, capture_output=True, text=True, timeout=120)
        assert inspected.returncode == 0, inspected.stderr[-4000:]
        state = json.loads(inspected.stdout)
    finally:
        for worker in workers:
            if worker.poll() is None:
                worker.kill()
                worker.wait()
        stop_emulator(emulator)

    slots = [(q, k, i) for q in range(Q) for k in range(K) for i in range(ROUNDS)]
    ids = sorted(f"q{q:06d}-r{k:04d}-i{i:04d}" for q, k, i in slots)
    keys = state["keys"]
    assert len(keys) == len(set(keys))
    for step in range(STEPS):
        entry = state["steps"][str(step)]
        assert sorted(entry["tasks"]) == sorted(entry["answers"]) == entry["closed"] == ids
        for rid, task in entry["tasks"].items():
            assert entry["answers"][rid] == task[::-1]
        prefix = f"tasks/{step:010d}/"
        for section in ("task", "answer", "claim"):
            assert len([k for k in keys if k.startswith(f"{prefix}{section}/")]) == len(ids), (step, section)
        rewards = np.arange(Q * K, dtype=np.float32).reshape(Q, K) + step
        np.testing.assert_array_equal(entry["main_rewards"], rewards)
        np.testing.assert_array_equal(entry["sub_rewards"], np.repeat(rewards[:, :, None], ROUNDS, axis=2) * 0.5)
    expected = [[s, q, k, i, float(s + q * K + k)] for s in range(STEPS) for q, k, i in slots]
    assert state["fifo_records"] == expected  # each once, in append order
    assert [int(key.rsplit("/", 1)[1][:12]) for key in state["fifo_items"]] == list(range(len(expected)))
    assert state["fifo_offset"] == len(expected)


# -- corrupt and partial objects ---------------------------------------------------------------------------


def _exchange(store, step: int = 2):
    """One small step of the exchange: three tasks, all claimed, the first two answered (their ids are
    returned), the main's arrays, a FIFO item."""
    tasks = [Record("task", step, q, 0, 0, 1, {"task": f"find {q}"}) for q in range(3)]
    store.tasks.close(step, store.tasks.post(tasks))
    for task in store.tasks.claim(step, "sub_0")[:2]:
        store.tasks.answer(task, {"answer": "x"}, policy_version=3)
    writer = store.step_writer(step, "main", policy_version=1)
    writer.put_array("main_reward", np.linspace(0, 1, 6, dtype=np.float32).reshape(2, 3))
    writer.commit()
    store.fifo("subs").append([Record("sub_trajectory", step, 0, 0, 0, 3, {"tokens": [1, 2, 3]})])
    return [t.id for t in tasks[:2]]


def _truncate(raw: bytes) -> bytes:
    return raw[: len(raw) // 2]


def _edit(raw: bytes) -> bytes:
    """Valid JSON, one character of the content changed: only the checksum can tell."""
    body = json.loads(raw)
    body["step"] += 1
    return json.dumps(body).encode()


# (what is damaged, how, the key, the reader that must notice it)
CASES = {
    "task_truncated": ("tasks/0000000002/task/q000002-r0000-i0000.json", _truncate,
                       lambda s, ids: s.tasks.pending(2)),
    "answer_bad_checksum": ("tasks/0000000002/answer/q000000-r0000-i0000.json", _edit,
                            lambda s, ids: s.tasks.wait_answers(2, ids, timeout_s=5)),
    "commit_marker_truncated": ("steps/0000000002/main/commit.json", _truncate,
                                lambda s, ids: s.wait_step(2, "main", timeout_s=5)),
    "claim_garbage": ("tasks/0000000002/claim/q000002-r0000-i0000.json", lambda raw: b"\x00\xffnot json",
                      lambda s, ids: s.tasks.claim(2, "sub_1")),
    "closed_set_bad_checksum": ("tasks/0000000002/closed.json", _edit, lambda s, ids: s.tasks.closed_ids(2)),
    "fifo_item_truncated": ("fifo/subs/items/000000000000.0000000002-sub_trajectory-q000000-r0000-i0000.json",
                            _truncate, lambda s, ids: s.fifo("subs").consumer("trainer").pop(1, timeout_s=5)),
    "array_half_written": ("steps/0000000002/main/arrays/main_reward/0.0", _truncate,
                           lambda s, ids: s.read_step(2, "main").array("main_reward")),
    "array_flipped": ("steps/0000000002/main/arrays/main_reward/0.0",
                      lambda raw: raw[:-1] + bytes([raw[-1] ^ 0x40]),
                      lambda s, ids: s.read_step(2, "main").array("main_reward")),
    "array_metadata_truncated": ("steps/0000000002/main/arrays/main_reward/.zarray", _truncate,
                                 lambda s, ids: s.read_step(2, "main").array("main_reward")),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_corrupt_object_is_reported_with_url_and_key(case, store_url):
    key, damage, read = CASES[case]
    store = open_store(store_url)
    ids = _exchange(store)
    raw, _ = store.kv.read(key)
    assert raw is not None, f"{key} not in {store.kv.list_prefix('')}"
    store.kv.write(key, damage(raw))
    reader = open_store(store_url)  # a fresh handle, as the other job has
    with pytest.raises(CorruptRecordError) as info:
        read(reader, ids)
    message = str(info.value)
    assert info.value.url == reader.url and reader.url in message
    assert info.value.key is not None and key.startswith(info.value.key.rstrip("/")) and info.value.key in message
    assert isinstance(info.value, StoreError)
