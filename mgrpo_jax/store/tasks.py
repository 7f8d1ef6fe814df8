"""The task queue of decoupled mode: the main job posts delegation tasks, the sub job answers them.

Main job::

    store.tasks.post([Record("task", step, q, k, i, policy_version, {"task": ..., "context": ...}), ...])
    store.tasks.close(step, all_ids)                  # optional: the step's task set is complete
    answers = store.tasks.wait_answers(step, ids, timeout_s=600)   # {id: Record("answer", ...)}

Sub job::

    for task in store.tasks.claim(step, worker="sub-0"):          # or .pending(step)
        store.tasks.answer(task, {"answer": ...}, policy_version=v)

Each task and answer is one object: it is visible as soon as it is written (no commit marker needed), and
its key is derived from (step, query, rollout, invocation), so posting or answering twice stores one copy.
The first answer written for a task wins; later ones are ignored (``answer`` returns False).

**Batches** (what the decoupled jobs use: one round of delegations, one object each way)::

    bid = store.tasks.post_batch(tasks)                              # main: the round's tasks, one object
    for batch in store.tasks.claim_batches(step, worker="sub_0"):   # sub: one lease per batch
        store.tasks.answer_batch(batch, [Record("answer", ...) for task in batch.records])
    answers = store.tasks.wait_batch(step, bid, timeout_s=600)       # main: {task id: answer record}

A round of n delegations then costs the two jobs a fixed number of store operations (main: one write, one read
per poll; sub: two listings, a lease read and write, one read and one write) instead of about 4n. A batch's id
is derived from its task ids (``batch_id``), so re-posting the same round (a resumed main job) stores one copy
and finds its answers; the first answer to a batch wins, as for single tasks. ``task_ids`` and ``answers`` list
the tasks and answers of both kinds.
"""

from __future__ import annotations

import dataclasses
import hashlib
import re
import time
from collections.abc import Iterable, Mapping

from mgrpo_jax.store.errors import CorruptRecordError, StoreTimeout
from mgrpo_jax.store.kv import dumps
from mgrpo_jax.store.records import Record, check_name, parse_record_id, seal, step_dir, unseal
from mgrpo_jax.store.retry import poll_until

TASK_KIND = "task"
ANSWER_KIND = "answer"
BATCH, BATCH_ANSWER = "batch", "batch_answer"  # the sections of task batches and their answers
_BATCH_RE = re.compile(r"^b[0-9a-f]{16}$")


def batch_id(step: int, tasks: Iterable[Record]) -> str:
    """The id of the batch of ``tasks`` of ``step``: ``b`` + 16 hex digits of a sha256 of the sorted task ids and
    their payloads. The same tasks posted again are the same batch; the same ids with other payloads (a step sampled
    again under other weights after a resume, `mgrpo_jax/rl/asynchronous.py`) are another batch, so an answer to
    the earlier tasks can never be taken for the new ones."""
    entries = sorted((t.id, dumps(t.payload).decode()) for t in tasks)
    text = f"{step_dir(step)}:" + ",".join(f"{rid}={payload}" for rid, payload in entries)
    return "b" + hashlib.sha256(text.encode()).hexdigest()[:16]


@dataclasses.dataclass(frozen=True)
class TaskBatch:
    """A round of delegation tasks posted as one object (``TaskQueue.post_batch``)."""

    step: int
    id: str
    records: tuple[Record, ...]

    @property
    def ids(self) -> list[str]:
        return [r.id for r in self.records]


def _batch_body(step: int, bid: str, records: list[Record]) -> bytes:
    return seal({"step": step, "batch": bid, "records": [{**r.header(), "payload": r.payload} for r in records]})


def _batch_records(raw: bytes, kind: str, *, url: str, key: str) -> list[Record]:
    body = unseal(raw, url=url, key=key)
    try:
        records = [Record(**entry) for entry in body["records"]]
    except (ValueError, KeyError, TypeError, AttributeError) as exc:
        raise CorruptRecordError(f"corrupt or partial batch ({exc})", url=url, key=key) from exc
    if any(r.kind != kind for r in records):
        raise CorruptRecordError(f"a batch of kind {kind!r} holds other kinds", url=url, key=key)
    return records


class TaskQueue:
    def __init__(self, store):
        self.store = store
        self.kv = store.kv
        self.clock = time.time  # lease expiry is wall-clock time shared by both jobs; tests swap in a fake clock

    @staticmethod
    def _key(step: int, section: str, rid: str) -> str:
        return f"tasks/{step_dir(step)}/{section}/{rid}.json"

    def _ids(self, step: int, section: str) -> list[str]:
        prefix = f"tasks/{step_dir(step)}/{section}/"
        return [k[len(prefix) : -len(".json")] for k in self.kv.list_prefix(prefix) if k.endswith(".json")]

    def _read_records(self, step: int, section: str, ids: list[str]) -> dict[str, Record]:
        keys = [self._key(step, section, rid) for rid in ids]
        out = {}
        for rid, key, raw in zip(ids, keys, self.kv.read_many(keys), strict=True):
            if raw is not None:
                out[rid] = Record.decode(raw, url=self.store.url, key=key)
        return out

    # -- main side -------------------------------------------------------------------------------------
    def post(self, tasks: Iterable[Record]) -> list[str]:
        """Posts delegation tasks (records of kind ``"task"``); returns their ids. Re-posting is a no-op."""
        tasks = list(tasks)
        for t in tasks:
            if not isinstance(t, Record) or t.kind != TASK_KIND:
                raise ValueError(f"post expects Record(kind='task', ...), got {t!r}")
        self.kv.create_many((self._key(t.step, "task", t.id), t.encode()) for t in tasks)
        return [t.id for t in tasks]

    def close(self, step: int, ids: Iterable[str]) -> list[str]:
        """Declares the full set of task ids of ``step`` (first close wins); returns the stored set."""
        ids = sorted(set(ids))
        for rid in ids:
            parse_record_id(rid)
        key = f"tasks/{step_dir(step)}/closed.json"
        if not self.kv.create(key, seal({"step": step, "ids": ids})):
            raw, _ = self.kv.read(key)
            return list(unseal(raw, url=self.store.url, key=key)["ids"])
        return ids

    def closed_ids(self, step: int) -> list[str] | None:
        """The task ids declared by ``close``, or None while the step is still open."""
        key = f"tasks/{step_dir(step)}/closed.json"
        raw, _ = self.kv.read(key)
        return None if raw is None else list(unseal(raw, url=self.store.url, key=key)["ids"])

    def wait_closed(self, step: int, timeout_s: float) -> list[str]:
        ids = poll_until(lambda: self.closed_ids(step), timeout_s, self.store.poll)
        if ids is None:
            key = f"tasks/{step_dir(step)}/closed.json"
            raise StoreTimeout(
                f"timed out after {timeout_s:g}s waiting for the task set of step {step} to be closed: "
                f"missing {self.store.url}{key}",
                url=self.store.url,
                missing=(key,),
            )
        return ids

    def answers(self, step: int, ids: Iterable[str] | None = None) -> dict[str, Record]:
        """Answers present now (for ``ids``, or all of the step), single and batched."""
        wanted = None if ids is None else set(ids)
        out = self._read_records(step, "answer", self._ids(step, "answer") if ids is None else sorted(wanted))
        for records in self._read_batches(step, BATCH_ANSWER, self._ids(step, BATCH_ANSWER)).values():
            for r in records:
                if (wanted is None or r.id in wanted) and r.id not in out:
                    out[r.id] = r
        return out

    def wait_answers(self, step: int, ids: Iterable[str], timeout_s: float) -> dict[str, Record]:
        """Waits until every id in ``ids`` has an answer; returns ``{id: answer record}``.

        Raises StoreTimeout listing the ids (and keys) still unanswered when ``timeout_s`` runs out.
        """
        wanted = sorted(set(ids))
        for rid in wanted:
            parse_record_id(rid)
        got: dict[str, Record] = {}

        def check():
            missing = [rid for rid in wanted if rid not in got]
            got.update(self._read_records(step, "answer", missing))
            return got if len(got) == len(wanted) else None

        if poll_until(check, timeout_s, self.store.poll) is None:
            missing = [rid for rid in wanted if rid not in got]
            keys = tuple(self._key(step, "answer", rid) for rid in missing)
            raise StoreTimeout(
                f"timed out after {timeout_s:g}s waiting for answers to {len(missing)} of {len(wanted)} "
                f"tasks of "
                f"step {step}: missing {_short(missing)} (keys {self.store.url}{keys[0]}, …)",
                url=self.store.url,
                missing=keys,
            )
        return {rid: got[rid] for rid in wanted}

    # -- sub side --------------------------------------------------------------------------------------
    def task_ids(self, step: int) -> list[str]:
        """The ids of the tasks posted for ``step``, single and batched, sorted."""
        ids = set(self._ids(step, "task"))
        for records in self._read_batches(step, BATCH, self._ids(step, BATCH)).values():
            ids.update(r.id for r in records)
        return sorted(ids)

    def pending(self, step: int) -> list[Record]:
        """Tasks of ``step`` posted and not yet answered, in id order."""
        answered = set(self._ids(step, "answer"))
        todo = [rid for rid in self._ids(step, "task") if rid not in answered]
        found = self._read_records(step, "task", todo)
        return [found[rid] for rid in todo if rid in found]

    def claim(
        self, step: int, worker: str, *, limit: int | None = None, lease_s: float = 300.0
    ) -> list[Record]:
        """Claims up to ``limit`` pending tasks for ``worker`` (a lease of ``lease_s`` seconds).

        A task is claimable when unclaimed, claimed by this worker (a restarted worker gets its tasks
        back), or its lease expired (a dead worker's tasks go to another). Claims use conditional writes,
        so two workers never both win one task. Answers do not require a claim.
        """
        pending = self.pending(step)
        won = set(self._lease(step, [task.id for task in pending], worker, lease_s, limit))
        return [task for task in pending if task.id in won]

    def _lease(self, step: int, ids: list[str], worker: str, lease_s: float, limit: int | None = None) -> list[str]:
        """Takes the leases of ``ids`` (tasks or batches) that are free, ``worker``'s own or expired, up to
        ``limit``; returns the ids won. The reads and the conditional writes each go out at once."""
        check_name("worker", worker)
        keys = [self._key(step, "claim", rid) for rid in ids]
        now = self.clock()
        lease = seal({"worker": worker, "expires": now + lease_s})
        claimable = []  # (id, key, generation)
        for rid, key, (raw, generation) in zip(ids, keys, self.kv.read_many_stamped(keys), strict=True):
            if raw is not None:
                held = unseal(raw, url=self.store.url, key=key)
                if held["worker"] != worker and held["expires"] > now:
                    continue
            claimable.append((rid, key, generation))
        if limit is not None:
            claimable = claimable[:limit]  # a lost race can leave fewer than `limit` won: the caller polls again
        won = self.kv.write_many_if((key, lease, generation) for _, key, generation in claimable)
        return [rid for (rid, _, _), ok in zip(claimable, won, strict=True) if ok]

    def answer(self, task: Record, payload: Mapping, *, policy_version: int) -> bool:
        """Posts the answer to ``task``; True if stored, False if the task already had an answer (kept)."""
        return self.post_answers(
            [
                Record(
                    ANSWER_KIND,
                    task.step,
                    task.query,
                    task.rollout,
                    task.invocation,
                    policy_version,
                    dict(payload),
                )
            ]
        )[0]

    def post_answers(self, answers: Iterable[Record]) -> list[bool]:
        """Posts answer records (kind ``"answer"``); per answer True if stored, False if one existed."""
        answers = list(answers)
        for a in answers:
            if not isinstance(a, Record) or a.kind != ANSWER_KIND:
                raise ValueError(f"post_answers expects Record(kind='answer', ...), got {a!r}")
        return self.kv.create_many((self._key(a.step, "answer", a.id), a.encode()) for a in answers)

    # -- batches -----------------------------------------------------------------------------------------
    def _read_batches(self, step: int, section: str, bids: list[str]) -> dict[str, list[Record]]:
        kind = TASK_KIND if section == BATCH else ANSWER_KIND
        keys = [self._key(step, section, bid) for bid in bids]
        return {bid: _batch_records(raw, kind, url=self.store.url, key=key)
                for bid, key, raw in zip(bids, keys, self.kv.read_many(keys), strict=True) if raw is not None}

    def post_batch(self, tasks: Iterable[Record]) -> str:
        """Posts a round of delegation tasks (records of kind ``"task"``, one step) as one object; returns the
        batch id. Re-posting the same tasks is a no-op (the stored batch is kept); `batch_id` says when it is not."""
        tasks = list(tasks)
        if not tasks:
            raise ValueError("post_batch needs at least one task")
        for t in tasks:
            if not isinstance(t, Record) or t.kind != TASK_KIND:
                raise ValueError(f"post_batch expects Record(kind='task', ...), got {t!r}")
        step, ids = tasks[0].step, [t.id for t in tasks]
        if any(t.step != step for t in tasks) or len(set(ids)) != len(ids):
            raise ValueError(f"a batch's tasks must be of one step with distinct ids, got {_short(ids)}")
        bid = batch_id(step, tasks)
        self.kv.create(self._key(step, BATCH, bid), _batch_body(step, bid, tasks))
        return bid

    def claim_batches(self, step: int, worker: str, *, lease_s: float = 300.0) -> list[TaskBatch]:
        """Claims the unanswered batches of ``step`` for ``worker``, as ``claim`` claims single tasks (one lease
        per batch: unclaimed, this worker's own, or expired); returns them in id order."""
        check_name("worker", worker)
        answered = set(self._ids(step, BATCH_ANSWER))
        todo = [bid for bid in self._ids(step, BATCH) if bid not in answered]
        mine = self._lease(step, todo, worker, lease_s) if todo else []
        batches = self._read_batches(step, BATCH, mine)
        return [TaskBatch(step, bid, tuple(batches[bid])) for bid in mine if bid in batches]

    def answer_batch(self, batch: TaskBatch, answers: Iterable[Record]) -> bool:
        """Posts the answers to every task of ``batch`` as one object; True if stored, False if the batch already
        had its answers (kept: the first answer wins)."""
        answers = list(answers)
        for a in answers:
            if not isinstance(a, Record) or a.kind != ANSWER_KIND or a.step != batch.step:
                raise ValueError(f"answer_batch expects Record(kind='answer', step={batch.step}, ...), got {a!r}")
        if sorted(a.id for a in answers) != sorted(batch.ids):
            raise ValueError(f"batch {batch.id}: answers for {_short(sorted(a.id for a in answers))}, tasks "
                             f"{_short(sorted(batch.ids))}")
        return self.kv.create(self._key(batch.step, BATCH_ANSWER, batch.id),
                              _batch_body(batch.step, batch.id, answers))

    def batch_answers(self, step: int, bid: str) -> dict[str, Record] | None:
        """The answers to batch ``bid`` (``{task id: answer record}``), or None while it has none."""
        if not _BATCH_RE.match(bid):
            raise ValueError(f"invalid batch id {bid!r}: expected 'b' and 16 hex digits")
        found = self._read_batches(step, BATCH_ANSWER, [bid])
        return None if bid not in found else {r.id: r for r in found[bid]}

    def wait_batch(self, step: int, bid: str, timeout_s: float) -> dict[str, Record]:
        """Waits for the answers to batch ``bid``; StoreTimeout naming its key when ``timeout_s`` runs out."""
        answers = poll_until(lambda: self.batch_answers(step, bid), timeout_s, self.store.poll)
        if answers is None:
            key = self._key(step, BATCH_ANSWER, bid)
            raise StoreTimeout(f"timed out after {timeout_s:g}s waiting for the answers to task batch {bid} of "
                               f"step {step}: missing {self.store.url}{key}", url=self.store.url, missing=(key,))
        return answers

    def done(self, step: int) -> bool:
        """True once the step's task set is closed and every task in it has an answer."""
        ids = self.closed_ids(step)
        return ids is not None and set(ids) <= set(self._ids(step, "answer"))


def _short(ids: list[str], limit: int = 8) -> str:
    return ", ".join(ids[:limit]) + (f", … ({len(ids) - limit} more)" if len(ids) > limit else "")
