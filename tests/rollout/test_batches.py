"""Every policy batch carries the sampling temperature of its rows (the train step recomputes the behaviour
log-probs under it); rows rebuilt from stored records line up like the engine's."""

import numpy as np

from mgrpo_jax.rollout import batches
from mgrpo_jax.rollout.episode import Episode


def _episode(q, k, generated, invocation=-1, agent="main"):
    e = Episode(agent=agent, question_index=q, rollout=k, invocation=invocation)
    e.extend([3, 4, 5])
    e.extend(list(range(10, 10 + generated)), trained=True, logprobs=[-0.25] * generated)
    return e


def _top():
    top = [[_episode(q, k, 2 + q + k) for k in range(2)] for q in range(2)]
    for q in range(2):
        for k in range(2):
            top[q][k].subs = [_episode(q, k, 1 + i, invocation=i, agent="sub") for i in range(q + 1)]
    return top


def _sampled_at(top, temperature, top_k=0, top_p=1.0):
    for row in top:
        for e in row:
            for x in (e, *e.subs):
                x.temperature, x.top_k, x.top_p = temperature(x), top_k, top_p
    return top


def test_top_batch_takes_each_rows_sampling_settings_from_its_episode():
    default = batches.top_batch(_top(), np.zeros((2, 2)), seq_len=16)
    np.testing.assert_array_equal(default["temperature"], np.ones(4, np.float32))  # an episode's default: 1
    np.testing.assert_array_equal(default["top_k"], 0)
    per_row = batches.top_batch(_sampled_at(_top(), lambda e: [[0.5, 1.0], [0.0, 2.0]][e.question_index][e.rollout],
                                            top_k=5, top_p=0.8), np.zeros((2, 2)), seq_len=16)
    assert per_row["temperature"].dtype == np.float32
    np.testing.assert_array_equal(per_row["temperature"], np.asarray([0.5, 1.0, 0.0, 2.0], np.float32))
    np.testing.assert_array_equal(per_row["top_k"], np.full(4, 5, np.int32))
    np.testing.assert_allclose(per_row["top_p"], 0.8)
    for key in ("tokens", "loss_mask", "old_logprobs", "advantages", "weights"):
        np.testing.assert_array_equal(default[key], per_row[key])


def test_sub_batch_takes_each_slots_settings_from_the_call_it_holds_and_pads_with_ones():
    top = _sampled_at(_top(), lambda e: 0.5 + 0.1 * e.invocation if e.agent == "sub" else 9.0)
    index = np.zeros((2, 2, 2), np.int32)
    index[1, :, 1] = 1
    weight = np.ones((2, 2, 2), np.float32)
    weight[0, 1, 1] = 0.0  # a masked slot: padding, temperature 1
    out = batches.sub_batch(top, index, weight, np.ones((2, 2, 2)), seq_len=16)
    assert out["temperature"].shape == (8,)
    expected = np.asarray([0.5, 0.5, 0.5, 1.0, 0.5, 0.6, 0.5, 0.6], np.float32)
    np.testing.assert_allclose(out["temperature"], expected)


def test_record_rows_rebuild_episode_rows():
    episodes = [_episode(0, 0, 3), _episode(0, 1, 9)]
    payloads = [{"tokens": e.tokens, "loss_mask": e.loss_mask, "old_logprobs": e.logprobs, "temperature": 0.7}
                for e in episodes]
    payloads[1].pop("temperature")  # a record from before the field: temperature 1
    rows = batches.record_rows(payloads, [0.5, -0.5], seq_len=8)
    ref = batches.top_batch([episodes[:1]], [0.5], seq_len=8)
    for key in ("tokens", "positions", "attention_mask", "loss_mask", "old_logprobs"):
        np.testing.assert_array_equal(rows[key][:1], ref[key], err_msg=key)
    np.testing.assert_array_equal(rows["temperature"], np.asarray([0.7, 1.0], np.float32))
    np.testing.assert_array_equal(rows["advantages"], np.asarray([0.5, -0.5], np.float32))
    np.testing.assert_array_equal(rows["weights"], 1.0)
    assert rows["tokens"].shape == (2, 8) and rows["attention_mask"][1].all()  # the long one is truncated
