"""`mgrpo_targets`: one step's rewards, alignment and advantages, against hand-computed values and the kernels."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from mgrpo_jax.core import (
    RolloutArrays,
    TargetsConfig,
    align,
    main_advantages,
    mgrpo_targets,
    register_advantage,
    sub_advantages,
)

T, F = True, False


def _hand_arrays():
    # Q=2 queries, K=2 rollouts, C=3 raw call slots; padding (i >= d_k) holds values that must never be read.
    return RolloutArrays(
        format_ok=np.array([[T, T], [T, F]]),
        correct=np.array([[1, 0], [1, 1]], np.float32),
        sub_format_ok=np.array([[[T, T, T], [T, T, T]], [[T, F, T], [T, T, T]]]),
        sub_expert=np.array([[[0.5, 1, 1], [1, 1, 1]], [[1, 0.2, 1], [0, 1, 1]]], np.float32),
        counts=np.array([[1, 0], [2, 2]], np.int32),
    )


def test_targets_equal_hand_computed_values():
    config = TargetsConfig(alpha=(0.1, 0.9), beta=(0.1, 0.4, 0.5), d_max=2, align_mode="mask")
    t = jax.device_get(mgrpo_targets(_hand_arrays(), jax.random.key(0), config))
    # R_M = 0.1 + 0.9 * correct, 0 when the format breaks; z-scored over each query's two rollouts.
    np.testing.assert_allclose(t.main_reward, [[1.0, 0.1], [1.0, 0.0]], atol=1e-6)
    np.testing.assert_allclose(t.main_advantages, [[1, -1], [1, -1]], atol=1e-5)
    # d_k <= D: slot j holds call j; masked slots past d_k; the d_k = 0 rollout is all masked.
    np.testing.assert_array_equal(t.sub_weight, [[[1, 0], [0, 0]], [[1, 1], [1, 1]]])
    np.testing.assert_array_equal(t.sub_index, [[[0, 0], [0, 0]], [[0, 1], [0, 1]]])
    # R_S = 0.1 + 0.4 * correct(main) + 0.5 * expert, 0 when the call breaks the format (the main agent's own
    # format does not gate the sub-agent: rollout (1, 1) broke it, its calls still score).
    np.testing.assert_allclose(t.sub_reward, [[[0.75, 0], [0, 0]], [[1.0, 0.0], [0.5, 1.0]]], atol=1e-6)
    np.testing.assert_allclose(t.sub_call_reward, [[[0.75, 0, 0], [0, 0, 0]], [[1.0, 0, 0], [0.5, 1.0, 0]]],
                               atol=1e-6)
    # Query 0 has one valid slot: a degenerate group, advantage 0. Query 1 pools 4 slots: mean 0.625,
    # population std sqrt(0.171875).
    std = np.sqrt(0.171875)
    np.testing.assert_allclose(t.sub_advantages[0], 0.0, atol=1e-6)
    np.testing.assert_allclose(t.sub_advantages[1].reshape(-1), (np.array([1.0, 0, 0.5, 1.0]) - 0.625) / std,
                               atol=1e-5)
    stats = {k: float(v) for k, v in t.stats.items()}
    assert stats["main_reward"] == pytest.approx(2.1 / 4)
    assert stats["main_correct"] == pytest.approx(0.75)
    assert stats["main_format_ok"] == pytest.approx(0.75)
    assert stats["main_zero_std_groups"] == 0
    assert stats["sub_reward"] == pytest.approx((0.75 + 1 + 0 + 0.5 + 1) / 5)
    assert stats["sub_expert"] == pytest.approx((0.5 + 1 + 0.2 + 0 + 1) / 5)
    assert stats["sub_format_ok"] == pytest.approx(4 / 5)
    assert stats["sub_zero_std_groups"] == 1


def test_duplicated_slots_repeat_the_call_reward():
    arrays = RolloutArrays(np.ones((1, 2), bool), np.array([[1, 0]], np.float32), np.ones((1, 2, 1), bool),
                           np.array([[[1.0], [0.0]]], np.float32), np.array([[1, 1]], np.int32))
    t = mgrpo_targets(arrays, jax.random.key(3), TargetsConfig(d_max=3))
    np.testing.assert_array_equal(t.sub_index, 0)
    np.testing.assert_array_equal(t.sub_weight, 1)
    np.testing.assert_allclose(t.sub_reward, [[[1.0] * 3, [0.1] * 3]], atol=1e-6)  # 0.1+0.4+0.5 and 0.1
    np.testing.assert_allclose(t.sub_advantages, [[[1.0] * 3, [-1.0] * 3]], atol=1e-5)


# A few [Q, K, C] shapes, from one call and one rollout up: each example's values are new, but each (shape, static
# config) compiles `mgrpo_targets` once, so the examples share their programs instead of compiling one each.
SHAPES = ((1, 1, 1), (2, 3, 2), (3, 4, 5))


@st.composite
def rollout_arrays(draw):
    q, k, c = draw(st.sampled_from(SHAPES))
    rng = np.random.default_rng(draw(st.integers(0, 2**31)))
    return RolloutArrays(rng.random((q, k)) < 0.7, (rng.random((q, k)) < 0.5).astype(np.float32),
                         rng.random((q, k, c)) < 0.7, rng.random((q, k, c)).astype(np.float32),
                         rng.integers(0, c + 1, (q, k)).astype(np.int32))


@settings(max_examples=25, deadline=None)
@given(rollout_arrays(), st.sampled_from([1, 3]), st.sampled_from(["duplicate", "mask"]),
       st.sampled_from(["group", "none"]))
def test_targets_equal_the_kernels_composed_by_hand(arrays, d_max, mode, scale):
    options = (("baseline", "mean"), ("eps", 1e-6), ("scale", scale))
    config = TargetsConfig(d_max=d_max, align_mode=mode, estimator_options=options)
    key = jax.random.key(7)
    t = jax.device_get(mgrpo_targets(arrays, key, config))
    main_r = np.where(arrays.format_ok, 0.1 + 0.9 * arrays.correct, 0.0)
    np.testing.assert_allclose(t.main_reward, main_r, atol=1e-6)
    np.testing.assert_allclose(t.main_advantages, main_advantages(main_r, **dict(options)), atol=1e-4)
    index, weight = jax.device_get(align(arrays.counts, d_max, key, mode=mode))
    np.testing.assert_array_equal(t.sub_index, index)
    np.testing.assert_array_equal(t.sub_weight, weight)
    q_count, k_count, _ = index.shape
    expected = np.zeros(index.shape, np.float32)
    for q in range(q_count):  # the ragged gather written out: slot -> own call -> its R_S
        for k in range(k_count):
            for j in range(d_max):
                if weight[q, k, j] > 0:
                    i = index[q, k, j]
                    assert i < arrays.counts[q, k]
                    expected[q, k, j] = (0.1 + 0.4 * arrays.correct[q, k] + 0.5 * arrays.sub_expert[q, k, i]
                                         ) * arrays.sub_format_ok[q, k, i]
    np.testing.assert_allclose(t.sub_reward, expected, atol=1e-6)
    np.testing.assert_allclose(t.sub_advantages, sub_advantages(expected, weight, **dict(options)), atol=1e-4)


@settings(max_examples=10, deadline=None)
@given(rollout_arrays())
def test_sub_targets_do_not_read_the_main_format(arrays):
    # The decoupled sub job fills the main agent's format gate from the store; only `correct` may matter to it.
    flipped = arrays._replace(format_ok=~np.asarray(arrays.format_ok))
    a, b = (mgrpo_targets(x, jax.random.key(1), TargetsConfig(d_max=2)) for x in (arrays, flipped))
    for name in ("sub_index", "sub_weight", "sub_reward", "sub_advantages", "sub_call_reward"):
        np.testing.assert_array_equal(getattr(a, name), getattr(b, name))


def test_a_registered_estimator_is_used_at_both_levels():
    @register_advantage("centred_only_for_test", overwrite=True)
    def centred(rewards, weights, **unused):
        mean = (rewards * weights).sum(-1, keepdims=True) / jnp.maximum(weights.sum(-1, keepdims=True), 1e-12)
        return (rewards - mean) * (weights > 0)

    config = TargetsConfig(alpha=(0.1, 0.9), d_max=2, align_mode="mask", estimator="centred_only_for_test")
    t = jax.device_get(mgrpo_targets(_hand_arrays(), jax.random.key(0), config))
    np.testing.assert_allclose(t.main_advantages, [[0.45, -0.45], [0.5, -0.5]], atol=1e-6)
    np.testing.assert_allclose(t.sub_advantages[1].reshape(-1), np.array([1.0, 0, 0.5, 1.0]) - 0.625, atol=1e-6)
    with pytest.raises(KeyError, match="unknown advantage estimator 'nope'; registered: .*grpo"):
        mgrpo_targets(_hand_arrays(), jax.random.key(0), TargetsConfig(estimator="nope"))


def test_from_config_reads_the_run_config():
    from mgrpo_jax.config import base_config

    c = base_config()
    c.rollout.d_max, c.rollout.align_mode, c.rewards.beta = 3, "mask", (0.2, 0.3, 0.5)
    config = TargetsConfig.from_config(c)
    assert (config.d_max, config.align_mode, config.beta, config.alpha) == (3, "mask", (0.2, 0.3, 0.5), (0.1, 0.9))
    assert dict(config.estimator_options) == {"scale": "group", "baseline": "mean", "eps": 1e-6}
    hash(config)  # static under jit
