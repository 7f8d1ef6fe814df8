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
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Mapping

from mgrpo_jax.store.errors import StoreTimeout
from mgrpo_jax.store.records import Record, check_name, parse_record_id, seal, step_dir, unseal
from mgrpo_jax.store.retry import poll_until

TASK_KIND = "task"
ANSWER_KIND = "answer"


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
        """Answers present now (for ``ids``, or all of the step)."""
        ids = self._ids(step, "answer") if ids is None else list(ids)
        return self._read_records(step, "answer", ids)

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
        return self._ids(step, "task")

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
        check_name("worker", worker)
        pending = self.pending(step)
        keys = [self._key(step, "claim", task.id) for task in pending]
        now = self.clock()
        lease = seal({"worker": worker, "expires": now + lease_s})
        claimable = []  # (task, key, generation): the reads and the conditional writes each go out at once
        for task, key, (raw, generation) in zip(pending, keys, self.kv.read_many_stamped(keys), strict=True):
            if raw is not None:
                held = unseal(raw, url=self.store.url, key=key)
                if held["worker"] != worker and held["expires"] > now:
                    continue
            claimable.append((task, key, generation))
        if limit is not None:
            claimable = claimable[:limit]  # a lost race can leave fewer than `limit` won: the caller polls again
        won = self.kv.write_many_if((key, lease, generation) for _, key, generation in claimable)
        return [task for (task, _, _), ok in zip(claimable, won, strict=True) if ok]

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

    def done(self, step: int) -> bool:
        """True once the step's task set is closed and every task in it has an answer."""
        ids = self.closed_ids(step)
        return ids is not None and set(ids) <= set(self._ids(step, "answer"))


def _short(ids: list[str], limit: int = 8) -> str:
    return ", ".join(ids[:limit]) + (f", … ({len(ids) - limit} more)" if len(ids) > limit else "")
