"""Task queue of decoupled mode, in one process (the same calls the two-process test makes)."""

import time

import pytest

from mgrpo_jax.store import Record, StoreObserver, StoreTimeout, observe, open_store
from mgrpo_jax.store.tasks import TaskBatch, batch_id


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


class _Ops(StoreObserver):
    """Counts the store operations of each kind (reads, writes, listings)."""

    def __init__(self):
        self.reads = self.writes = self.lists = 0

    def on_read(self, key, value):
        self.reads += 1

    def on_write(self, key, value):
        self.writes += 1

    def on_list(self, lo, hi):
        self.lists += 1


def _round(main, sub, step, tasks, answer):
    """One round of the batched exchange; returns the answers and the operations each call made."""
    ops = {}
    with observe(_Ops()) as ops["post"]:
        bid = main.tasks.post_batch(tasks)
    with observe(_Ops()) as ops["claim"]:
        batches = sub.tasks.claim_batches(step, "sub_0")
    with observe(_Ops()) as ops["answer"]:
        for batch in batches:
            sub.tasks.answer_batch(batch, [answer(t) for t in batch.records])
    with observe(_Ops()) as ops["wait"]:
        answers = main.tasks.wait_batch(step, bid, timeout_s=2)
    return answers, ops


def test_a_batched_round_costs_the_same_few_operations_whatever_its_size(store_url, fast_poll):
    """One object each way per round: the store operations of a round do not grow with its tasks."""
    main, sub = open_store(store_url, poll=fast_poll), open_store(store_url, poll=fast_poll)

    def answer(t):
        return Record("answer", t.step, t.query, t.rollout, t.invocation, 5, {"answer": t.payload["task"][::-1]})

    costs = []
    for step, n in ((1, 1), (2, 8), (3, 64)):
        answers, ops = _round(main, sub, step, _tasks(step, n), answer)
        assert len(answers) == 2 * n
        costs.append({name: (o.reads, o.writes, o.lists) for name, o in ops.items()})
        assert ops["post"].writes == 1 and ops["answer"].writes == 1 and ops["claim"].writes == 1
        assert ops["claim"].lists == 2 and ops["claim"].reads == 2 and ops["wait"].reads == 1
        assert len(main.kv.list_prefix(f"tasks/{step:010d}/")) == 3  # the batch, its lease, its answers
    assert costs[0] == costs[1] == costs[2]


def test_a_batched_exchange_returns_the_answers_of_the_per_task_one(store_url, fast_poll):
    """The same tasks through one object per task (claim, answer, wait_answers) and through a batch give the same
    answer records; both kinds are listed by task_ids / answers; re-posting a batch finds its answers."""
    main, sub = open_store(store_url, poll=fast_poll), open_store(store_url, poll=fast_poll)

    def answer(t):
        return Record("answer", t.step, t.query, t.rollout, t.invocation, 5, {"answer": t.payload["task"].upper()})

    single = [Record("task", 4, t.query, t.rollout, t.invocation, 2, t.payload) for t in _tasks(4, 5)]
    ids = main.tasks.post(single)
    sub.tasks.post_answers([answer(t) for t in sub.tasks.claim(4, "sub_0")])
    per_task = main.tasks.wait_answers(4, ids, timeout_s=2)
    batched, _ = _round(main, sub, 5, _tasks(5, 5), answer)
    assert list(batched) == list(per_task) == sorted(ids)
    for rid, record in batched.items():
        other = per_task[rid]
        assert (record.kind, record.query, record.rollout, record.invocation, record.policy_version,
                record.payload) == (other.kind, other.query, other.rollout, other.invocation,
                                    other.policy_version, other.payload)
        assert record.step == 5 and other.step == 4
    assert sub.tasks.task_ids(5) == sorted(batched) == sorted(sub.tasks.answers(5))
    # A resumed main job posts the same round again: the same batch, answered already (the first answer wins).
    bid = main.tasks.post_batch(list(reversed(_tasks(5, 5))))
    assert main.tasks.wait_batch(5, bid, timeout_s=0) == batched
    assert sub.tasks.claim_batches(5, "sub_0") == []
    batch = TaskBatch(5, bid, tuple(_tasks(5, 5)))
    assert not sub.tasks.answer_batch(batch, [answer(t) for t in batch.records])
    # The same ids with other payloads (a step sampled again under other weights) are another batch, unanswered.
    other = [Record("task", 5, t.query, t.rollout, t.invocation, 3, {"task": "again"}) for t in _tasks(5, 5)]
    assert batch_id(5, other) != bid and batch_id(5, reversed(_tasks(5, 5))) == bid
    assert main.tasks.batch_answers(5, main.tasks.post_batch(other)) is None


def test_batch_leases_and_inputs(store_url, fast_poll):
    now = [1000.0]
    store = open_store(store_url, poll=fast_poll)
    store.tasks.clock = lambda: now[0]
    bid = store.tasks.post_batch(_tasks(1, n=2))
    assert [b.id for b in store.tasks.claim_batches(1, "dead_worker", lease_s=5.0)] == [bid]
    assert store.tasks.claim_batches(1, "live_worker") == []
    assert [b.id for b in store.tasks.claim_batches(1, "dead_worker", lease_s=5.0)] == [bid]  # its own again
    now[0] += 5.1
    (batch,) = store.tasks.claim_batches(1, "live_worker")
    assert batch.ids == [t.id for t in _tasks(1, n=2)]
    with pytest.raises(ValueError, match="answers for"):
        store.tasks.answer_batch(batch, [])
    with pytest.raises(StoreTimeout, match="batch_answer"):
        store.tasks.wait_batch(1, bid, timeout_s=0.05)
    with pytest.raises(ValueError, match="one step"):
        store.tasks.post_batch(_tasks(1, n=1) + _tasks(2, n=1))
    with pytest.raises(ValueError, match="at least one"):
        store.tasks.post_batch([])
    with pytest.raises(ValueError, match="batch id"):
        store.tasks.batch_answers(1, "q000000-r0000-i0000")
