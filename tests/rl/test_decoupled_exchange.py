"""The decoupled jobs' delegation exchange in one process: the main job's `MainExchange.delegate` (the engine's sub
executor) against the sub job's `SubExchange` and `ServingSubSide._serve` on a scripted sub-agent engine.

Each engine round's delegations cross the store as one batch object and come back as one answers object: the store
writes of a round do not grow with its delegations, and the answers are those the sub-agent gave each task."""

from __future__ import annotations

import threading
import time
import types

import numpy as np
import pytest

from mgrpo_jax.config import get_config
from mgrpo_jax.rl.decoupled import MainExchange, ServingSubSide, SubExchange
from mgrpo_jax.rollout.episode import Episode
from mgrpo_jax.store import PollPolicy, StoreObserver, observe, open_store


class _Writes(StoreObserver):
    def __init__(self):
        self.keys = []

    def on_write(self, key, value):
        self.keys.append(key)


class _ScriptedSubEngine:
    """The sub job's engine: a sub-agent episode's answer is its task reversed; records the seeds it ran with."""

    def __init__(self):
        self.seeds = []

    def start_sub(self, task, context="", **fields):
        return Episode(agent="sub", task=task, call={"task": task, "context": context}, **fields)

    def run_subs(self, episodes, seed, timings):
        self.seeds.append((seed, len(episodes)))
        for e in episodes:
            e.answer, e.end_reason, e.turns = e.call["task"][::-1], "answer", [f"<answer>{e.call['task']}</answer>"]
            e.tool_calls.update({"search": 1})


def _spawned(step_round: int, n: int) -> list[Episode]:
    return [Episode(agent="sub", question_index=q, rollout=k, invocation=step_round,
                    call={"task": f"find {q}.{k}.{step_round}", "context": ""})
            for q in range(n) for k in range(2)]


@pytest.fixture
def jobs(tmp_path):
    config = get_config("xbench", "smoke")
    config.decoupled.timeout_s = 30.0
    url = (tmp_path / "store").as_uri()
    poll = PollPolicy(initial_s=0.001, max_s=0.01)
    main = MainExchange(open_store(url, poll=poll), config, str(tmp_path / "main"), resuming=False)
    sub_exchange = SubExchange(open_store(url, poll=poll), config)
    engine = _ScriptedSubEngine()
    env = types.SimpleNamespace(questions={})
    side = ServingSubSide(types.SimpleNamespace(version=3), sub_exchange, config, str(tmp_path / "sub"), env,
                          engine)
    return main, sub_exchange, side, engine


def test_each_round_crosses_the_store_as_one_batch_each_way(jobs):
    main, sub_exchange, side, engine = jobs
    main.before_step(0, version=7)
    questions = [types.SimpleNamespace(id=f"question-{q}") for q in range(16)]
    served, stop = [], threading.Event()

    def serve():
        while not stop.is_set():
            event = sub_exchange._next_event(0)
            if event is not None:
                served.append(side.serve(0, event[1], 3))

    thread = threading.Thread(target=serve)
    thread.start()
    try:
        writes_per_round = []
        for step_round, n in enumerate((1, 4, 16)):
            spawned = _spawned(step_round, n)
            with observe(_Writes()) as writes:  # both jobs' writes: the sub job answers while the main waits
                done = main.delegate(spawned, questions)
            writes_per_round.append(sorted(key.split("/")[2] for key in writes.keys))
            assert done is spawned
            for e in spawned:  # each episode got the answer to its own task
                assert e.answer == e.call["task"][::-1] and e.end_reason == "answer"
                assert e.turns == [f"<answer>{e.call['task']}</answer>"] and e.tool_calls["search"] == 1
    finally:
        stop.set()
        thread.join(timeout=30)
    # O(1) store writes per round, not O(delegations): the main job's batch, the sub job's lease and its answers.
    assert writes_per_round == [["batch", "batch_answer", "claim"]] * 3
    assert served == [2, 8, 32]
    store = main.store
    assert sorted(store.tasks.answers(0)) == sorted(store.tasks.task_ids(0)) and len(store.tasks.task_ids(0)) == 42
    # The sub job ran each round's tasks together, seeded by how many it had served in the step (as before).
    assert [n for _, n in engine.seeds] == [2, 8, 32]
    assert sorted(key[1:] for key in side.cache(0)) == sorted((q, k, i) for i, n in enumerate((1, 4, 16))
                                                              for q in range(n) for k in range(2))


def test_a_step_sampled_again_trains_on_the_batches_its_record_lists(jobs, tmp_path):
    """A resumed asynchronous main job samples the steps it had sampled ahead again, under other weights: the same
    task ids with other payloads are another batch, answered anew (never by the earlier batch's answers), and the sub
    job builds the step from the batches the main job's record lists, not from everything it served."""
    main, sub_exchange, _, engine = jobs
    questions = [types.SimpleNamespace(id=f"question-{q}") for q in range(2)]
    side = ServingSubSide(types.SimpleNamespace(version=0), sub_exchange, main_config(), str(tmp_path / "sub2"),
                          types.SimpleNamespace(questions={"train": questions}), engine)
    main.before_step(0, version=0)
    before, after = _spawned(0, 2), _spawned(0, 2)
    for e in after:
        e.call = {"task": "again " + e.call["task"], "context": ""}
    for spawned in (before, after):
        if spawned is after:
            main.posted.clear()  # the restarted job knows only what it posted since
        thread = threading.Thread(target=lambda: side.serve(0, sub_exchange.claim(0) or _wait_claim(sub_exchange), 0))
        thread.start()
        main.delegate(spawned, questions)
        thread.join(timeout=30)
        assert [e.answer for e in spawned] == [e.call["task"][::-1] for e in spawned]
    assert len(side.cache(0)) == 8  # both samplings' trajectories, 4 each
    counts = np.ones((2, 2), np.int32)
    arrays = types.SimpleNamespace(format_ok=np.ones((2, 2), bool), correct=np.zeros((2, 2), bool), counts=counts)
    main.publish(0, arrays, types.SimpleNamespace(main_reward=np.zeros((2, 2), np.float32)))
    view = main.store.read_step(0, "main")
    assert len(view.meta["batches"]) == 1
    rollout, chosen = side._cached_rollout(0, counts, view.meta["batches"])
    assert sorted(chosen) == [(q, k, 0) for q in range(2) for k in range(2)]
    assert all(s.call["task"].startswith("again ") for row in rollout.top for e in row for s in e.subs)


def main_config():
    config = get_config("xbench", "smoke")
    config.decoupled.timeout_s = 30.0
    return config


def _wait_claim(exchange, step=0, timeout_s=30.0):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        batches = exchange.claim(step)
        if batches:
            return batches
        time.sleep(0.005)
    raise TimeoutError("no batch to claim")


def test_serving_runs_a_round_again_when_new_weights_arrive_and_answers_once(jobs):
    """`partial_rollouts = "restart"` in the sub job: a round whose episodes saw new weights arrive is run again
    from its start before anything is cached or answered (the same seed: only the weights differ)."""
    main, sub_exchange, side, engine = jobs
    main.before_step(0, version=0)
    questions = [types.SimpleNamespace(id=f"question-{q}") for q in range(2)]
    arrivals = iter([True, False])  # new weights during the first run only
    thread = threading.Thread(target=lambda: side.serve(0, _wait_claim(sub_exchange), 1, again=lambda: next(arrivals)))
    thread.start()
    spawned = _spawned(0, 2)
    main.delegate(spawned, questions)
    thread.join(timeout=30)
    assert [n for _, n in engine.seeds] == [4, 4] and engine.seeds[0][0] == engine.seeds[1][0]
    assert len(side.cache(0)) == 4 and side._tallies[0]["restarts"] == 1 and side._tallies[0]["served"] == 4
    assert [e.answer for e in spawned] == [e.call["task"][::-1] for e in spawned]
