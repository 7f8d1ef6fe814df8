import jax
import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from mgrpo_jax.core import align, d_histogram, gather_aligned, suggest_d_max


def test_delegating_0_3_8_and_11_times_with_d8():
    counts = np.array([[0, 3, 8, 11]])
    index, weight = (np.asarray(a) for a in align(counts, 8, jax.random.key(0)))
    assert index.shape == weight.shape == (1, 4, 8)
    # d_k = 0: the rollout's slots are masked out.
    np.testing.assert_array_equal(weight[0, 0], 0.0)
    # d_k = 3: calls 0, 1, 2 once in order, then 5 uniform copies of them.
    np.testing.assert_array_equal(index[0, 1, :3], [0, 1, 2])
    assert set(index[0, 1, 3:]) <= {0, 1, 2}
    np.testing.assert_array_equal(weight[0, 1], 1.0)
    # d_k = D: identity.
    np.testing.assert_array_equal(index[0, 2], np.arange(8))
    # d_k = 11 > D: 8 distinct calls out of 11, in call order.
    kept = index[0, 3]
    assert len(set(kept)) == 8 and kept.max() < 11 and np.all(np.diff(kept) > 0)
    np.testing.assert_array_equal(weight[0, 3], 1.0)


def test_mask_mode_pads_with_zero_weight_instead_of_copies():
    index, weight = (np.asarray(a) for a in align(np.array([[3, 0, 10]]), 5, jax.random.key(1), mode="mask"))
    np.testing.assert_array_equal(weight[0, 0], [1, 1, 1, 0, 0])
    np.testing.assert_array_equal(index[0, 0, :3], [0, 1, 2])
    np.testing.assert_array_equal(weight[0, 1], 0.0)
    np.testing.assert_array_equal(weight[0, 2], 1.0)
    assert len(set(index[0, 2])) == 5


def test_same_key_same_slots_and_keys_differ():
    counts = np.array([[1, 2, 5, 20]] * 3)
    a = np.asarray(align(counts, 4, jax.random.key(7))[0])
    np.testing.assert_array_equal(a, np.asarray(align(counts, 4, jax.random.key(7))[0]))
    assert not np.array_equal(a, np.asarray(align(counts, 4, jax.random.key(8))[0]))


def test_jit_equals_eager():
    counts = np.array([[0, 1, 4, 9], [2, 7, 3, 12]])
    key = jax.random.key(3)
    jitted = jax.jit(align, static_argnums=(1, 3))(counts, 6, key, "duplicate")
    eager = align(counts, 6, key)
    for got, want in zip(jitted, eager, strict=True):
        np.testing.assert_array_equal(got, want)


def test_duplicates_are_uniform_and_drops_are_uniform():
    n = 4000
    dup_index, _ = align(np.full((n, 1), 3), 4, jax.random.key(0))
    np.testing.assert_allclose(np.bincount(np.asarray(dup_index)[:, 0, 3], minlength=3) / n, 1 / 3, atol=0.03)
    keep_index, _ = align(np.full((n, 1), 10), 4, jax.random.key(1))
    frequency = np.bincount(np.asarray(keep_index).reshape(-1), minlength=10) / n
    np.testing.assert_allclose(frequency, 0.4, atol=0.03)  # each call kept with probability D / d_k


def test_bad_inputs_raise_clear_errors():
    with pytest.raises(ValueError, match="mode"):
        align(np.zeros((1, 2)), 4, jax.random.key(0), mode="drop")
    with pytest.raises(ValueError, match="d_max"):
        align(np.zeros((1, 2)), 0, jax.random.key(0))
    with pytest.raises(ValueError, match=r"\[Q, K\]"):
        align(np.zeros(3), 4, jax.random.key(0))


_jit_align = jax.jit(align, static_argnums=(1, 3))


# Fixed [Q, K] = [3, 5] so the jitted kernel compiles once per (d_max, mode), not once per example.
@given(
    hnp.arrays(np.int32, (3, 5), elements=st.integers(0, 20)),
    st.sampled_from([1, 3, 8]),
    st.integers(0, 2**31 - 1),
    st.sampled_from(["duplicate", "mask"]),
)
def test_alignment_properties(counts, d_max, seed, mode):
    index, weight = (np.asarray(a) for a in _jit_align(counts, d_max, jax.random.key(seed), mode))
    q, k = counts.shape
    assert index.shape == weight.shape == (q, k, d_max)
    for qi in range(q):
        for ki in range(k):
            n = counts[qi, ki]
            filled = weight[qi, ki] > 0
            # Every filled slot points at a call of its own rollout.
            assert np.all(index[qi, ki][filled] < max(n, 1)) and np.all(index[qi, ki] >= 0)
            if n == 0:
                assert not filled.any()
            elif n <= d_max:
                assert set(range(n)) <= set(index[qi, ki][filled])  # every real call appears
                assert filled.sum() == (d_max if mode == "duplicate" else n)
            else:
                assert filled.all() and len(set(index[qi, ki])) == d_max  # no call kept twice


def test_suggest_d_max_and_histogram():
    counts = np.array([0] * 10 + [1] * 50 + [2] * 30 + [3] * 9 + [12])
    assert suggest_d_max(counts, 0.99) == 3
    assert suggest_d_max(counts, 1.0) == 12
    assert suggest_d_max(counts, 0.5) == 1
    np.testing.assert_array_equal(d_histogram(counts, max_bin=4), [10, 50, 30, 9, 1])
    with pytest.raises(ValueError, match="quantile"):
        suggest_d_max(counts, 0.0)


def test_gather_aligned_builds_fixed_batches_with_an_index_map():
    def call(length, value):
        return {"tokens": np.full(length, value, np.int32), "mask": np.ones(length, np.float32)}

    calls = [[[call(2, 11), call(3, 12)], []]]  # Q=1, K=2: rollout 0 has two calls, rollout 1 none
    index = np.array([[[0, 1, 0], [0, 0, 0]]])
    weight = np.array([[[1, 1, 1], [0, 0, 0]]], np.float32)
    batch = gather_aligned(calls, index, weight, seq_len=4, pad_values={"tokens": -1})
    assert batch["tokens"].shape == (6, 4)
    np.testing.assert_array_equal(batch["tokens"][:3], [[11, 11, -1, -1], [12, 12, 12, -1], [11, 11, -1, -1]])
    np.testing.assert_array_equal(batch["tokens"][3:], -1)
    np.testing.assert_array_equal(batch["mask"][3:], 0.0)
    np.testing.assert_array_equal(batch["weight"], [1, 1, 1, 0, 0, 0])
    np.testing.assert_array_equal(batch["source"][:4], [[0, 0, 0], [0, 0, 1], [0, 0, 0], [0, 1, -1]])
    with pytest.raises(ValueError, match="seq_len=2"):
        gather_aligned(calls, index, weight, seq_len=2)
