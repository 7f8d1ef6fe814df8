"""One side of a multi-step decoupled exchange, run as its own OS process (the store fault tests).

    python tests/store/exchange_worker.py main|sub|inspect URL STEPS Q K ROUNDS

main     per step: ROUNDS rounds of Q*K delegation tasks (invocation = round), each waiting for its answers
         (paced, so that a run lasts a few seconds); closes the step's task set; commits its rewards [Q, K];
         waits for the sub's commit of the step before the next (max_lag 1).
sub      per step: claims and answers tasks until the step is done; reads the main's rewards; appends one
         sub-trajectory record per task to the FIFO ``subs`` and pops it in chunks of Q*K; commits its
         per-invocation rewards [Q, K, ROUNDS].
inspect  prints one JSON object describing everything in the store (keys, decoded records; any corrupt
         record raises), for the test to check that nothing was lost or duplicated.

Both sides print ``<role> step <s> done`` lines and, last, ``<role> transient errors <n>``: how many transient
store errors their retries absorbed (counted by wrapping the store's classifier).
"""

from __future__ import annotations

import json
import sys
import time

import numpy as np

from mgrpo_jax.store import PollPolicy, Record, open_store
from mgrpo_jax.store import retry as store_retry

POLL = PollPolicy(initial_s=0.01, max_s=0.2)
TIMEOUT_S = 120
PACE_S = 0.25
TRANSIENT = {"n": 0}
_classify = store_retry.is_transient


def _counting_is_transient(exc: BaseException) -> bool:
    transient = _classify(exc)
    TRANSIENT["n"] += transient
    return transient


store_retry.is_transient = _counting_is_transient  # call_with_retry looks it up at call time


def task_text(step: int, q: int, k: int, i: int) -> str:
    return f"step {step}: find fact {q}.{k}.{i}"


def main_role(url: str, steps: int, q: int, k: int, rounds: int) -> None:
    store = open_store(url, poll=POLL)
    for step in range(steps):
        ids = []
        for i in range(rounds):
            tasks = [Record("task", step, qi, ki, i, step, {"task": task_text(step, qi, ki, i)})
                     for qi in range(q) for ki in range(k)]
            round_ids = store.tasks.post(tasks)
            answers = store.tasks.wait_answers(step, round_ids, timeout_s=TIMEOUT_S)
            assert all(answers[t.id].payload["answer"] == t.payload["task"][::-1] for t in tasks)
            ids += round_ids
            time.sleep(PACE_S)
        store.tasks.close(step, ids)
        writer = store.step_writer(step, "main", policy_version=step)
        writer.put_array("rewards", np.arange(q * k, dtype=np.float32).reshape(q, k) + step)
        writer.commit()
        store.wait_step(step, "sub", timeout_s=TIMEOUT_S)
        print(f"main step {step} done", flush=True)


def sub_role(url: str, steps: int, q: int, k: int, rounds: int) -> None:
    store = open_store(url, poll=POLL)
    fifo = store.fifo("subs")
    consumer = fifo.consumer("trainer")
    for step in range(steps):
        deadline = time.monotonic() + TIMEOUT_S
        while not store.tasks.done(step):
            if time.monotonic() > deadline:
                raise TimeoutError(f"sub: step {step} not done after {TIMEOUT_S} s")
            batch = store.tasks.claim(step, "sub_0")
            store.tasks.post_answers([
                Record("answer", step, t.query, t.rollout, t.invocation, 100 + step,
                       {"answer": t.payload["task"][::-1]}) for t in batch])
            if not batch:
                time.sleep(0.02)
        rewards = store.wait_step(step, "main", timeout_s=TIMEOUT_S).array("rewards", shape=(q, k))
        fifo.append([Record("sub_trajectory", step, qi, ki, i, 100 + step, {"reward": float(rewards[qi, ki])})
                     for qi in range(q) for ki in range(k) for i in range(rounds)])
        while consumer.offset + q * k <= fifo.size():
            consumer.pop(q * k, timeout_s=TIMEOUT_S)
        writer = store.step_writer(step, "sub", policy_version=100 + step)
        writer.put_array("sub_rewards", np.repeat(rewards[:, :, None], rounds, axis=2) * 0.5)
        writer.commit({"served": q * k * rounds})
        print(f"sub step {step} done", flush=True)


def inspect(url: str, steps: int, q: int, k: int, rounds: int) -> dict:
    store = open_store(url, poll=POLL)
    out = {"keys": store.kv.list_prefix(""), "steps": {}}
    for step in range(steps):
        answers = store.tasks.answers(step)
        tasks = store.tasks._read_records(step, "task", store.tasks.task_ids(step))
        entry = {
            "tasks": {rid: t.payload["task"] for rid, t in tasks.items()},
            "answers": {rid: a.payload["answer"] for rid, a in answers.items()},
            "closed": store.tasks.closed_ids(step),
            "main_rewards": store.read_step(step, "main").array("rewards").tolist(),
            "sub_rewards": store.read_step(step, "sub").array("sub_rewards").tolist(),
        }
        out["steps"][str(step)] = entry
    items = store.kv.list_prefix("fifo/subs/items/")
    out["fifo_items"] = items
    out["fifo_records"] = [[r.step, r.query, r.rollout, r.invocation, r.payload["reward"]]
                           for r in (Record.decode(raw, url=store.url, key=key)
                                     for key, raw in zip(items, store.kv.read_many(items), strict=True))]
    out["fifo_offset"] = store.fifo("subs").consumer("trainer").offset
    return out


if __name__ == "__main__":
    role, url = sys.argv[1], sys.argv[2]
    steps, q, k, rounds = map(int, sys.argv[3:7])
    if role == "inspect":
        print(json.dumps(inspect(url, steps, q, k, rounds)))
        sys.exit(0)
    {"main": main_role, "sub": sub_role}[role](url, steps, q, k, rounds)
    print(f"{role} transient errors {TRANSIENT['n']}", flush=True)
