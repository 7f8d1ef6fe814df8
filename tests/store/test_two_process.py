"""Main and sub roles as two OS processes exchanging tasks, answers and rewards through the store."""

import subprocess
import sys

import numpy as np
import pytest

from mgrpo_jax.store import Record, open_store

from .conftest import HERE, make_url, subprocess_env

Q, K, D = 3, 2, 2


@pytest.mark.parametrize("remote", ["file", "gs"])
def test_two_processes_exchange_tasks_and_rewards(remote, request, tmp_path, fast_poll):
    url = make_url(remote, request, tmp_path)
    step = 4
    sub = subprocess.Popen(
        [sys.executable, str(HERE / "sub_worker.py"), url, str(step), str(Q), str(K), str(D)],
        env=subprocess_env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        store = open_store(url, poll=fast_poll)
        tasks = [
            Record("task", step, q, k, i, 7, {"task": f"q{q}k{k}i{i}"})
            for q in range(Q)
            for k in range(K)
            for i in range(D)
        ]
        ids = store.tasks.post(tasks[: len(tasks) // 2])  # delegations arrive turn by turn
        ids += store.tasks.post(tasks[len(tasks) // 2 :])
        store.tasks.close(step, ids)
        answers = store.tasks.wait_answers(step, ids, timeout_s=60)
        for task in tasks:
            assert answers[task.id].payload["answer"] == task.payload["task"][::-1]
            assert answers[task.id].policy_version == 100 + step
        rewards = np.arange(Q * K, dtype=np.float32).reshape(Q, K)
        writer = store.step_writer(step, "main", policy_version=7)
        writer.put_array("rewards", rewards)
        writer.commit()
        view = store.wait_step(step, "sub", timeout_s=60)
        expected = np.repeat(rewards[:, :, None], D, axis=2) * 0.5 + np.arange(D, dtype=np.float32)
        np.testing.assert_array_equal(view.array("sub_rewards"), expected)
        assert view.meta == {"served": Q * K * D} and view.policy_version == 100 + step
        out, err = sub.communicate(timeout=60)
        assert sub.returncode == 0, err
    finally:
        if sub.poll() is None:
            sub.kill()
            sub.wait()
