"""Task queue of decoupled mode, in one process (the same calls the two-process test makes)."""

import time

import pytest

from mgrpo_jax.store import Record, StoreTimeout, open_store


def _tasks(step, n=3):
    return [Record("task", step, q, 0, i, 2, {"task": f"find {q}.{i}"}) for q in range(n) for i in range(2)]


def test_post_claim_answer_wait(store_url, fast_poll):
    main = open_store(store_url, poll=fast_poll)
    sub = open_store(store_url, poll=fast_poll)
    tasks = _tasks(7)
    ids = main.tasks.post(tasks)
    assert main.tasks.post(tasks) == ids  # re-posting is harmless
    assert sub.tasks.task_ids(7) == sorted(ids)
    assert not sub.tasks.done(7)
    main.tasks.close(7, ids)
    assert sub.tasks.wait_closed(7, timeout_s=1) == sorted(ids)

    claimed_a = sub.tasks.claim(7, "worker_a", limit=4)
    claimed_b = sub.tasks.claim(7, "worker_b")
    assert len(claimed_a) == 4 and len(claimed_b) == 2  # no task is won twice
    assert {t.id for t in claimed_a} | {t.id for t in claimed_b} == set(ids)
    assert sub.tasks.claim(7, "worker_b") == claimed_b  # a restarted worker gets its own leases back

    for task in claimed_a + claimed_b:
        assert task.payload["task"].startswith("find") and task.policy_version == 2
        assert sub.tasks.answer(task, {"answer": task.payload["task"].upper()}, policy_version=5)
    assert not sub.tasks.answer(claimed_a[0], {"answer": "late duplicate"}, policy_version=6)  # first wins
    answers = main.tasks.wait_answers(7, ids, timeout_s=2)
    assert list(answers) == sorted(ids)
    for task in tasks:
        ans = answers[task.id]
        assert (ans.kind, ans.step, ans.query, ans.rollout, ans.invocation) == (
            "answer",
            7,
            task.query,
            0,
            task.invocation,
        )
        assert ans.payload == {"answer": task.payload["task"].upper()} and ans.policy_version == 5
    assert sub.tasks.pending(7) == [] and sub.tasks.done(7)
    assert len(store_keys := main.kv.list_prefix("tasks/0000000007/answer/")) == len(ids), store_keys


def test_expired_lease_is_taken_over(store_url):
    # A fake clock: a slow store (the emulator on a loaded CI machine) must not expire the lease early.
    now = [1000.0]
    store = open_store(store_url)
    store.tasks.clock = lambda: now[0]
    store.tasks.post(_tasks(1, n=1))
    assert len(store.tasks.claim(1, "dead_worker", lease_s=5.0)) == 2
    now[0] += 4.9
    assert store.tasks.claim(1, "live_worker") == []
    now[0] += 0.2
    assert len(store.tasks.claim(1, "live_worker")) == 2


def test_wait_answers_timeout_names_missing_ids(store_url, fast_poll):
    store = open_store(store_url, poll=fast_poll)
    tasks = _tasks(3, n=2)
    ids = store.tasks.post(tasks)
    store.tasks.answer(tasks[0], {"answer": "x"}, policy_version=0)
    start = time.monotonic()
    with pytest.raises(StoreTimeout) as info:
        store.tasks.wait_answers(3, ids, timeout_s=0.3)
    assert 0.25 < time.monotonic() - start < 30  # lower bound: it waited; upper: it gave up (a loaded CI is slow)
    message = str(info.value)
    assert "3 of 4 tasks of step 3" in message
    for rid in ids[1:]:
        assert rid in message
    assert ids[0] not in message
    assert info.value.missing == tuple(f"tasks/0000000003/answer/{rid}.json" for rid in sorted(ids[1:]))
    with pytest.raises(StoreTimeout, match="task set of step 3 to be closed"):
        store.tasks.wait_closed(3, timeout_s=0.05)


def test_task_inputs_validated():
    store = open_store("memory://tasks-bad")
    with pytest.raises(ValueError, match="kind='task'"):
        store.tasks.post([Record("answer", 0, 0, 0, 0, 0, {})])
    with pytest.raises(ValueError, match="invalid record id"):
        store.tasks.wait_answers(0, ["q1"], timeout_s=0)
    with pytest.raises(ValueError, match="invalid worker"):
        store.tasks.claim(0, "Worker A")
