"""A stand-in sub-agent job for the two-process store test (run as a separate OS process).

    python tests/store/sub_worker.py URL STEP Q K D

Serves the delegation tasks of STEP (claim, answer), then reads the main job's committed rewards for the
step and commits its own per-invocation rewards — the decoupled exchange, without models.
"""

from __future__ import annotations

import sys
import time

import numpy as np

from mgrpo_jax.store import PollPolicy, open_store


def main(url: str, step: int, q: int, k: int, d: int) -> int:
    store = open_store(url, poll=PollPolicy(initial_s=0.005, max_s=0.05))
    deadline = time.monotonic() + 60
    served = 0
    while not store.tasks.done(step):
        if time.monotonic() > deadline:
            print(f"sub worker: gave up on step {step}", file=sys.stderr)
            return 1
        batch = store.tasks.claim(step, "sub_0")
        for task in batch:
            answer = {"answer": task.payload["task"][::-1], "pid_tokens": [task.query, task.invocation]}
            served += store.tasks.answer(task, answer, policy_version=100 + step)
        if not batch:
            time.sleep(0.01)
    rewards = store.wait_step(step, "main", timeout_s=60).array("rewards", shape=(q, k), dtype=np.float32)
    sub = np.repeat(rewards[:, :, None], d, axis=2) * 0.5 + np.arange(d, dtype=np.float32)
    writer = store.step_writer(step, "sub", policy_version=100 + step)
    writer.put_array("sub_rewards", sub, shape=(q, k, d), dtype=np.float32)
    writer.commit({"served": served})
    return 0


if __name__ == "__main__":
    url, step, q, k, d = sys.argv[1], *map(int, sys.argv[2:6])
    sys.exit(main(url, step, q, k, d))
