"""The unsynchronised ablation's FIFO path (mgrpo_jax/rl/unsync.py): shuffled pushes, every full chunk
popped (bounded backlog), arrival groups, staleness, and every real sub-trajectory pushed once."""

import itertools

import jax
import numpy as np
import pytest

from mgrpo_jax.core import RolloutArrays, TargetsConfig, mgrpo_targets
from mgrpo_jax.rl import unsync
from mgrpo_jax.rollout.episode import Episode, RolloutBatch
from mgrpo_jax.store import Record, open_store

ADV = dict(scale="group", baseline="mean", eps=1e-6)
_stores = itertools.count()


def _fifo():
    store = open_store(f"memory://unsync-test-{next(_stores)}")
    fifo = store.fifo("sub_trajectories")
    return fifo, fifo.consumer("sub_trainer")


def _records(step, count, version, rng, queries=4):
    """`count` sub-trajectory records of one step, in (query, rollout, invocation) order."""
    out = []
    for n in range(count):
        q, rest = n % queries, n // queries
        length = int(rng.integers(3, 9))
        out.append(Record(unsync.RECORD_KIND, step, q, rest % 100, rest // 100, version, {
            "tokens": [int(t) for t in rng.integers(1, 50, length)], "loss_mask": [0.0] + [1.0] * (length - 1),
            "old_logprobs": [0.0] + [-1.0] * (length - 1), "temperature": 0.7, "reward": float(rng.random())}))
    return sorted(out, key=lambda r: (r.query, r.rollout, r.invocation))


def test_backlog_stays_below_one_chunk_whatever_the_push_counts():
    fifo, consumer = _fifo()
    rng = np.random.default_rng(0)
    chunk, group, passes = 16, 4, 1
    version = pushed = popped = 0
    for step in range(80):
        count = int(rng.choice([0, 3, 10, 17, 40, 64]))  # d_k varies from step to step, with bursts
        records = _records(step, count, version, rng)
        chunks, m = unsync.unsync_step(fifo, consumer, records, chunk=chunk, group=group, seed=step,
                                       start_version=version, passes=passes, seq_len_limit=64, pad_id=0,
                                       advantages=TargetsConfig().advantages)
        pushed += count
        popped += int(m["sub/fifo_popped"])
        assert m["sub/fifo_pushed"] == count
        assert 0 <= m["sub/fifo_backlog"] < chunk  # never a full chunk left waiting
        assert pushed - popped == m["sub/fifo_backlog"] == consumer.backlog()
        assert len(chunks) == m["sub/unsync_chunks"] == m["sub/fifo_popped"] / chunk
        for batch in chunks:  # the sub's compiled row count, with the behaviour temperature
            assert batch["tokens"].shape[0] == chunk and batch["advantages"].shape == (chunk,)
            np.testing.assert_array_equal(batch["temperature"], np.float32(0.7))
            assert batch["old_logprobs"].shape == batch["loss_mask"].shape
        if chunks:
            assert m["sub/staleness"] >= 0
        version += len(chunks) * passes  # what the trainer's updates would do to the policy version
    assert pushed > 80 * chunk // 2  # the pushes did outpace one chunk per step at times


def test_step_pop_trains_once_per_step_on_the_previous_steps_records_in_the_sync_batch():
    fifo, consumer = _fifo()
    rng = np.random.default_rng(3)
    rows, group, version, sampled_at = 40, 4, 0, 0
    counts = [12, 0, 30, 55, 7]  # 55 > rows: the 15 left over wait for the next step
    expected_pops = [0, 12, 0, 30, 40]
    for step, (count, expect) in enumerate(zip(counts, expected_pops, strict=True)):
        records = _records(step, count, version, rng)
        batches, m = unsync.unsync_step(fifo, consumer, records, chunk=16, group=group, seed=step,
                                        start_version=version, passes=1, seq_len_limit=64, pad_id=0,
                                        advantages=TargetsConfig().advantages, pop="step", rows=rows)
        assert m["sub/fifo_popped"] == expect and m["sub/fifo_pushed"] == count
        assert len(batches) == (1 if expect else 0)  # at most one update per step, like the synchronised mode
        for batch in batches:
            assert batch["tokens"].shape[0] == rows and batch["advantages"].shape == (rows,)
            np.testing.assert_array_equal(batch["weights"], [1.0] * expect + [0.0] * (rows - expect))
            assert not batch["loss_mask"][expect:].any() and not batch["advantages"][expect:].any()
            # Every popped record was sampled by the previous step's policy.
            assert m["sub/staleness"] == version - sampled_at
        sampled_at = version
        version += len(batches)
    assert m["sub/fifo_backlog"] == consumer.backlog() == 55 - 40 + 7


def test_a_popped_group_mixes_queries_and_the_order_is_seeded():
    rng = np.random.default_rng(1)
    records = _records(step=0, count=32, version=0, rng=rng, queries=8)  # 8 queries x 4 records, query-sorted
    group = 4
    queries = [r.query for r in records]
    # Without the shuffle, every arrival group of 4 would be one query's records.
    assert all(len(set(queries[i:i + group])) == 1 for i in range(0, 32, group))
    order = unsync.arrival_order(32, seed=12345)
    np.testing.assert_array_equal(order, unsync.arrival_order(32, seed=12345))  # deterministic
    assert not np.array_equal(order, unsync.arrival_order(32, seed=54321))
    assert sorted(order) == list(range(32))

    fifo, consumer = _fifo()
    chunks, m = unsync.unsync_step(fifo, consumer, records, chunk=16, group=group, seed=12345, start_version=0,
                                   passes=1, seq_len_limit=64, pad_id=0, advantages=TargetsConfig().advantages)
    assert m["sub/fifo_popped"] == 32 and m["sub/fifo_backlog"] == 0
    arrived = consumer.fifo.consumer("reader").peek(32, timeout_s=0)  # the FIFO's order = arrival order
    assert [(r.query, r.rollout) for r in arrived] == [(records[i].query, records[i].rollout) for i in order]
    groups = [[r.query for r in arrived[i:i + group]] for i in range(0, 32, group)]
    assert all(len(set(g)) > 1 for g in groups), groups  # grouped regardless of query
    # The advantages are z-scores within each arrival group of 4, in popped order.
    rewards = np.asarray([r.payload["reward"] for r in arrived], np.float32).reshape(-1, group)
    expected = (rewards - rewards.mean(1, keepdims=True)) / rewards.std(1, keepdims=True)
    got = np.concatenate([c["advantages"] for c in chunks]).reshape(-1, group)
    np.testing.assert_allclose(got, expected, rtol=1e-5, atol=1e-5)


def test_arrival_advantages_score_a_short_trailing_group_on_its_own():
    r = np.asarray([1.0, 0.0, 1.0, 0.0, 3.0, 1.0], np.float32)  # groups of 4: [1, 0, 1, 0], then [3, 1]
    adv = unsync.arrival_advantages(r, 4, **ADV)
    np.testing.assert_allclose(adv, [1, -1, 1, -1, 1, -1], atol=1e-6)
    assert unsync.arrival_advantages([], 4, **ADV).shape == (0,)


def test_staleness_on_a_hand_made_example():
    def rec(version):
        return Record(unsync.RECORD_KIND, 0, 0, 0, 0, version, {})

    # Chunk 0 is trained at version 7, chunk 1 (after 2 passes) at version 9.
    chunks = [[rec(7), rec(7), rec(5), rec(6)], [rec(7), rec(3), rec(9), rec(9)]]
    gaps = [0, 0, 2, 1] + [2, 6, 0, 0]
    assert unsync.staleness(chunks, start_version=7, passes=2) == pytest.approx(np.mean(gaps))
    assert unsync.staleness([], start_version=7) == 0.0


def test_staleness_through_the_fifo():
    fifo, consumer = _fifo()
    rng = np.random.default_rng(2)
    kw = dict(chunk=4, group=2, seq_len_limit=64, pad_id=0, advantages=TargetsConfig().advantages)
    # Step 0: 6 records sampled by version 0; one chunk trained at version 0 (gap 0), 2 records left.
    chunks, m = unsync.unsync_step(fifo, consumer, _records(0, 6, 0, rng), seed=0, start_version=0, passes=2, **kw)
    assert (len(chunks), m["sub/staleness"], m["sub/fifo_backlog"]) == (1, 0.0, 2)
    # Step 1 (version 2 after that chunk's 2 passes): 6 more; two chunks: the first at version 2 holds the 2
    # left from step 0 (gap 2) and 2 new ones (gap 0), the second at version 4 holds 4 new ones (gap 2).
    chunks, m = unsync.unsync_step(fifo, consumer, _records(1, 6, 2, rng), seed=1, start_version=2, passes=2, **kw)
    assert len(chunks) == 2 and m["sub/fifo_backlog"] == 0
    assert m["sub/staleness"] == pytest.approx((2 + 2 + 0 + 0 + 2 * 4) / 8)


def _episode(q, k, subs):
    main = Episode(agent="main", question_index=q, rollout=k)
    for i, length in enumerate(subs):
        sub = Episode(agent="sub", question_index=q, rollout=k, invocation=i)
        sub.extend([5] * 3)
        sub.extend([7] * length, trained=True, logprobs=[-0.5] * length)
        main.subs.append(sub)
    return main


def _arrays(fmt, expert, correct) -> RolloutArrays:
    """The judge arrays of ragged [Q][K][d_k] sub-call verdicts, padded to the widest rollout."""
    counts = np.asarray([[len(calls) for calls in row] for row in fmt], np.int32)
    width = max(int(counts.max()), 1)
    sub_format = np.zeros(counts.shape + (width,), bool)
    sub_expert = np.zeros(counts.shape + (width,), np.float32)
    for q, row in enumerate(fmt):
        for k, calls in enumerate(row):
            sub_format[q, k, :len(calls)] = calls
            sub_expert[q, k, :len(calls)] = expert[q][k]
    return RolloutArrays(np.ones(counts.shape, bool), np.asarray(correct, np.float32), sub_format, sub_expert, counts)


def _call_reward(arrays, beta=(0.1, 0.4, 0.5)):
    return np.asarray(mgrpo_targets(arrays, jax.random.key(0), TargetsConfig(beta=beta, d_max=2)).sub_call_reward)


def test_step_records_push_every_real_sub_trajectory_once_with_its_reward():
    # d_k = 3, 0, 1, 5: no duplicates for small d_k and nothing dropped for d_k above any D.
    sub_lengths = [[[2, 3, 4], []], [[5], [1, 2, 3, 4, 6]]]
    top = [[_episode(q, k, sub_lengths[q][k]) for k in range(2)] for q in range(2)]
    rollout = RolloutBatch([None, None], top)
    fmt = [[[True, False, True], []], [[True], [True] * 5]]
    expert = [[[1.0, 1.0, 0.5], []], [[0.0], [0.2, 0.4, 0.6, 0.8, 1.0]]]
    main_correct = np.asarray([[1.0, 0.0], [0.0, 1.0]], np.float32)
    call_reward = _call_reward(_arrays(fmt, expert, main_correct))
    versions = {(q, k, i): 10 * q + k + i for q in range(2) for k in range(2) for i in range(5)}
    for e in rollout.episodes("sub"):  # the settings the engine drew each sub-episode with
        e.temperature, e.top_k, e.top_p = 0.7, 5, 0.9
    records = unsync.step_records(rollout, call_reward, step=3, versions=versions)
    assert [(r.query, r.rollout, r.invocation) for r in records] == [
        (0, 0, 0), (0, 0, 1), (0, 0, 2), (1, 0, 0), (1, 1, 0), (1, 1, 1), (1, 1, 2), (1, 1, 3), (1, 1, 4)]
    for r in records:
        q, k, i = r.query, r.rollout, r.invocation
        want = (0.1 + 0.4 * main_correct[q, k] + 0.5 * expert[q][k][i]) if fmt[q][k][i] else 0.0
        assert r.payload["reward"] == pytest.approx(want)
        assert r.policy_version == versions[(q, k, i)] and r.step == 3
        assert (r.payload["temperature"], r.payload["top_k"], r.payload["top_p"]) == (0.7, 5, 0.9)
        assert r.payload["tokens"] == top[q][k].subs[i].tokens
        assert len(r.payload["old_logprobs"]) == len(r.payload["loss_mask"]) == len(r.payload["tokens"])
    same = unsync.step_records(rollout, call_reward, step=3, versions=4)
    assert {r.policy_version for r in same} == {4}
    empty = RolloutBatch([None], [[_episode(0, 0, [])]])
    assert unsync.step_records(empty, np.zeros((1, 1, 1)), 0, 0) == []


class _UnsyncHarness:
    """A smoke `mgrpo_unsync` trainer whose sub side is fed hand-built steps: sub-trajectories sampled by the sub
    agent's own sampler at the rollout temperature, `counts[q, k]` calls per rollout, random expert rewards."""

    def __init__(self, tmp_path):
        from mgrpo_jax.config import get_config
        from mgrpo_jax.rl.trainer import Trainer

        self.config = config = get_config("xbench", "smoke,mgrpo_unsync")
        config.rollout.temperature = 0.7
        config.warmstart.steps = 0
        config.store = f"memory://unsync-trainer-{next(_stores)}"  # memory stores are shared within a process
        self.trainer = Trainer(config, str(tmp_path))
        self.sub = self.trainer.agents["sub"]
        self.rng = np.random.default_rng(0)

    def step(self, counts, main_correct, side=None):
        """One step's sub side (`side`, default the trainer's: `UnsyncSubSide.rows`): (metrics, chunks)."""
        from mgrpo_jax.rl.exchange import SubStep

        rollout, arrays = self.rollout_with(counts, main_correct)
        trainer = self.trainer
        targets = jax.device_get(mgrpo_targets(arrays, jax.random.key(trainer.step), trainer.targets_config))
        stats = {k: float(v) for k, v in targets.stats.items()}
        return (side or trainer.sub).rows(SubStep(rollout, arrays, self.sub.version), targets, stats, trainer.step)

    def rollout_with(self, counts, main_correct):
        config, rng = self.config, self.rng
        prompts = [list(rng.integers(5, 200, int(rng.integers(4, 9)))) for _ in range(int(counts.sum()))]
        out = self.sub.sampler.sample(prompts, max_new=8, rng=int(rng.integers(1 << 30)),
                                      temperature=config.rollout.temperature)
        top, n = [], 0
        for q in range(config.rollout.queries):
            top.append([])
            for k in range(config.rollout.samples):
                main = Episode(agent="main", question_index=q, rollout=k)
                for i in range(counts[q, k]):
                    e = Episode(agent="sub", question_index=q, rollout=k, invocation=i)
                    e.extend(prompts[n])
                    length = int(out.lengths[n])
                    e.extend(out.tokens[n, :length], trained=True, logprobs=out.logprobs[n, :length])
                    e.temperature = config.rollout.temperature
                    main.subs.append(e)
                    n += 1
                top[q].append(main)
        fmt = [[[True] * c for c in row] for row in counts]
        expert = [[list(rng.random(c)) for c in row] for row in counts]
        return RolloutBatch([None] * config.rollout.queries, top), _arrays(fmt, expert, main_correct)


@pytest.mark.slow
def test_trainer_unsync_path_trains_on_policy_chunks_and_keeps_up(tmp_path):
    """The run loop's sub side (`UnsyncSubSide.rows` -> `unsync.unsync_step` -> `Learner.train`) on sub-
    trajectories sampled by the sub agent's own sampler at the rollout temperature: a chunk of fresh records
    trains at ratio 1, and the FIFO keeps up with varying delegation counts."""
    h = _UnsyncHarness(tmp_path)
    trainer, sub, rng, config = h.trainer, h.sub, h.rng, h.config
    chunk = config.rollout.unsync_chunk
    q_count, k_count = config.rollout.queries, config.rollout.samples

    # Step 0: exactly one chunk of fresh records: trained on-policy.
    counts = np.zeros((q_count, k_count), np.int32)
    counts.flat[:chunk] = 1
    main_correct = np.asarray(rng.random((q_count, k_count)) > 0.5, np.float32)
    out, chunks = h.step(counts, main_correct)
    assert len(chunks) == 1 and out["sub/staleness"] == 0.0 and out["sub/fifo_backlog"] == 0
    np.testing.assert_array_equal(chunks[0]["temperature"], np.float32(0.7))
    metrics = sub.train(chunks)
    assert metrics["sub/train/ratio_min"] == pytest.approx(1.0, abs=1e-5)
    assert metrics["sub/train/ratio_max"] == pytest.approx(1.0, abs=1e-5)
    assert metrics["sub/train/clip_frac"] == 0.0

    # Later steps: varying delegation counts; the backlog never reaches a chunk.
    popped = pushed = chunk
    for step in range(1, 6):
        trainer.step = step
        counts = rng.integers(0, 4, (q_count, k_count)).astype(np.int32)
        version = int(sub.state.step)
        out, chunks = h.step(counts, main_correct)
        pushed += int(counts.sum())
        popped += len(chunks) * chunk
        assert out["sub/fifo_backlog"] == pushed - popped < chunk
        if chunks:
            metrics = sub.train(chunks)
            assert int(sub.state.step) == version + len(chunks) * sub.config.passes
            assert np.isfinite(metrics["sub/train/loss"]) and out["sub/staleness"] >= 0



@pytest.mark.slow
def test_the_checkpoint_keeps_the_waiting_records_for_a_new_process_store(tmp_path):
    """The default memory:// store dies with its process. The sub side's checkpoint state keeps the records waiting
    in the FIFO, so a side resumed on a new, empty store pops what the uninterrupted one pops; a state that keeps
    no records, on a store that lost them, is refused by name (it once popped a chunk of -6,453 records)."""
    import json

    from mgrpo_jax.rl.sides import UnsyncSubSide

    h = _UnsyncHarness(tmp_path)
    q_count, k_count, chunk = h.config.rollout.queries, h.config.rollout.samples, h.config.rollout.unsync_chunk
    correct = np.ones((q_count, k_count), np.float32)
    out, _ = h.step(np.full((q_count, k_count), 2, np.int32), correct)  # 8 records: 2 chunks, none left
    counts = np.zeros((q_count, k_count), np.int32)
    counts.flat[: chunk - 1] = 1
    h.trainer.step = 1
    out, _ = h.step(counts, correct)
    assert out["sub/fifo_backlog"] == chunk - 1  # records wait across the checkpoint

    state = json.loads(json.dumps(h.trainer.sub.state()))  # as the checkpoint's host state stores it
    assert state["fifo_offset"] == 2 * chunk and len(state["fifo_pending"]) == chunk - 1
    moved = UnsyncSubSide(h.sub, open_store(f"memory://unsync-moved-{next(_stores)}"), h.config)
    moved.load_state(state)
    assert (moved.consumer.offset, moved.consumer.backlog()) == (0, chunk - 1)

    h.trainer.step = 2
    counts = np.zeros((q_count, k_count), np.int32)
    counts.flat[:2] = 1
    rng_state = h.rng.bit_generator.state
    want, want_chunks = h.step(counts, correct)  # the uninterrupted side
    h.rng.bit_generator.state = rng_state
    got, got_chunks = h.step(counts, correct, side=moved)  # the same step on the resumed one
    for key in ("sub/fifo_pushed", "sub/fifo_popped", "sub/fifo_backlog", "sub/unsync_chunks", "sub/staleness"):
        assert got[key] == want[key], key
    assert (got["sub/fifo_popped"], got["sub/fifo_backlog"]) == (chunk, 1)
    assert len(got_chunks) == len(want_chunks) == 1
    for key in want_chunks[0]:
        np.testing.assert_array_equal(got_chunks[0][key], want_chunks[0][key], err_msg=key)

    lost = UnsyncSubSide(h.sub, open_store(f"memory://unsync-lost-{next(_stores)}"), h.config)
    with pytest.raises(ValueError, match=r"offset is 8 with 0 records pending, but .* holds 0 items and the "
                                         r"checkpoint keeps no pending records"):
        lost.load_state({"fifo_offset": 8})
