import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from mgrpo_jax.core import degenerate_groups, main_advantages, sub_advantages

PAPER_REWARDS = np.array([[1.0, 0.1, 0.1, 0.0, 1.0, 0.1, 0.1, 0.1]], np.float32)


def test_main_advantages_hand_computed_k8():
    # mean = 2.5 / 8 = 0.3125; population var = (2 * 0.6875^2 + 5 * 0.2125^2 + 0.3125^2) / 8 = 0.15859375
    std = np.sqrt(0.15859375)
    expected = (PAPER_REWARDS - 0.3125) / std
    np.testing.assert_allclose(main_advantages(PAPER_REWARDS), expected, rtol=1e-5)


def test_equal_rewards_give_zero_advantage_under_every_option():
    rewards = np.full((1, 8), 0.1, np.float32)
    for scale in ("group", "batch", "none"):
        for baseline in ("mean", "leave_one_out"):
            out = main_advantages(rewards, scale=scale, baseline=baseline)
            np.testing.assert_array_equal(out, np.zeros((1, 8)))
    assert bool(degenerate_groups(rewards, np.ones_like(rewards))[0])


def test_invalid_rollouts_are_excluded_and_get_zero():
    valid = np.array([[True] * 6 + [False] * 2])
    rewards = PAPER_REWARDS.copy()
    rewards[0, 6:] = 100.0  # must not leak into the statistics
    out = np.asarray(main_advantages(rewards, valid))
    np.testing.assert_array_equal(out[0, 6:], 0.0)
    np.testing.assert_allclose(out[0, :6], np.asarray(main_advantages(PAPER_REWARDS[:, :6]))[0], rtol=1e-6)


def test_dr_grpo_and_leave_one_out_hand_computed():
    r = np.array([[1.0, 0.0, 0.0, 0.5]], np.float32)
    np.testing.assert_allclose(main_advantages(r, scale="none"), r - 0.375, atol=1e-6)
    loo = np.array([[1.0 - 0.5 / 3, 0.0 - 1.5 / 3, 0.0 - 1.5 / 3, 0.5 - 1.0 / 3]])
    np.testing.assert_allclose(main_advantages(r, scale="none", baseline="leave_one_out"), loo, atol=1e-6)


def test_batch_scale_uses_the_std_of_all_centred_rewards():
    r = np.array([[1.0, 0.0], [0.5, 0.3]], np.float32)
    centred = np.array([[0.5, -0.5], [0.1, -0.1]])
    expected = centred / np.sqrt((centred**2).mean())
    np.testing.assert_allclose(main_advantages(r, scale="batch"), expected, rtol=1e-5)


def test_sub_advantages_pool_k_times_d_with_duplicates_counted_per_copy():
    # One query, K=2, D=3. Rollout 0: two real calls (rewards 1.0, 0.2) and a copy of call 0.
    # Rollout 1: d_k = 0, masked out.
    rewards = np.array([[[1.0, 0.2, 1.0], [9.0, 9.0, 9.0]]], np.float32)
    weights = np.array([[[1, 1, 1], [0, 0, 0]]], np.float32)
    pooled = np.array([1.0, 0.2, 1.0])
    expected = (pooled - pooled.mean()) / pooled.std()
    out = np.asarray(sub_advantages(rewards, weights))
    np.testing.assert_allclose(out[0, 0], expected, rtol=1e-5)
    np.testing.assert_array_equal(out[0, 1], 0.0)


def test_shape_errors_name_the_input():
    with pytest.raises(ValueError, match=r"\[Q, K\]"):
        main_advantages(np.zeros(8))
    with pytest.raises(ValueError, match=r"\[Q, K, D\]"):
        sub_advantages(np.zeros((2, 8)), np.ones((2, 8)))
    with pytest.raises(ValueError, match="scale"):
        main_advantages(np.zeros((1, 8)), scale="global")


# A fixed [Q, K, D] shape keeps the kernels compiled once across examples.
rewards_qkd = hnp.arrays(np.float32, (3, 6, 4), elements=st.sampled_from([0.0, 0.1, 0.5, 0.6, 1.0]))
_sub = jax.jit(sub_advantages, static_argnames=("scale", "baseline"))
_main = jax.jit(main_advantages, static_argnames=("scale", "baseline"))


@given(rewards_qkd, st.data())
def test_weighted_advantages_have_zero_mean_per_query(rewards, data):
    weights = data.draw(hnp.arrays(np.float32, rewards.shape, elements=st.sampled_from([0.0, 1.0])))
    for baseline_scale in (("mean", "group"), ("mean", "none"), ("mean", "batch")):
        baseline, scale = baseline_scale
        adv = np.asarray(_sub(rewards, weights, scale=scale, baseline=baseline), np.float64)
        per_query = (adv * weights).reshape(rewards.shape[0], -1).sum(-1)
        np.testing.assert_allclose(per_query, 0.0, atol=1e-4)
        assert np.all(adv[weights == 0] == 0)


@given(rewards_qkd, st.randoms(use_true_random=False))
def test_permuting_rollouts_permutes_advantages(rewards, rng):
    weights = np.ones_like(rewards)
    perm = np.arange(rewards.shape[1])
    rng.shuffle(perm)
    base = np.asarray(_sub(rewards, weights))
    permuted = np.asarray(_sub(rewards[:, perm], weights[:, perm]))
    np.testing.assert_allclose(permuted, base[:, perm], atol=1e-5)
    main = np.asarray(_main(rewards[..., 0]))
    np.testing.assert_allclose(np.asarray(_main(rewards[:, perm, 0])), main[:, perm], atol=1e-5)


@given(rewards_qkd)
def test_group_scaled_advantages_have_unit_std_or_are_zero(rewards):
    adv = np.asarray(_main(rewards[..., 0]), np.float64)
    for q in range(adv.shape[0]):
        if np.ptp(rewards[q, :, 0]) > 0:
            np.testing.assert_allclose(adv[q].std(), 1.0, rtol=1e-4)
        else:
            np.testing.assert_array_equal(adv[q], 0.0)


def test_jit_equals_eager():
    rng = np.random.default_rng(0)
    rewards = rng.choice([0.0, 0.1, 1.0], size=(4, 8, 3)).astype(np.float32)
    weights = rng.choice([0.0, 1.0], size=(4, 8, 3)).astype(np.float32)
    for baseline in ("mean", "leave_one_out"):
        for scale in ("group", "batch", "none"):
            kw = dict(scale=scale, baseline=baseline)
            jitted = jax.jit(lambda r, w, kw=kw: sub_advantages(r, w, **kw))(rewards, weights)
            np.testing.assert_allclose(jitted, sub_advantages(rewards, weights, **kw), atol=1e-6)
    assert jnp.all(jnp.isfinite(jax.jit(main_advantages)(rewards[..., 0], weights[..., 0] > 0)))


def test_ddof_1_divides_by_the_sample_std_and_weights_count_as_multiplicities():
    # The paper's rewards: squared deviations sum to 8 * 0.15859375 = 1.26875; sample var 1.26875 / 7.
    expected = (PAPER_REWARDS - 0.3125) / np.sqrt(1.26875 / 7)
    np.testing.assert_allclose(main_advantages(PAPER_REWARDS, ddof=1), expected, rtol=1e-5)
    # Weight 2 on one slot counts it twice: [1, 0, 0 (x2)] -> mean 1/4, squares 9/16 + 3 * 1/16 = 3/4, var 3/4 / 3.
    out = main_advantages(np.array([[1.0, 0.0, 0.0]], np.float32), np.array([[1.0, 1.0, 2.0]]), ddof=1)
    np.testing.assert_allclose(out, [[0.75 / 0.5, -0.25 / 0.5, -0.25 / 0.5]], rtol=1e-5)
    # A group of one valid slot has no sample std: degenerate, advantage 0 (no division by count - 1 = 0).
    np.testing.assert_array_equal(main_advantages(np.array([[0.7, 0.1]], np.float32), np.array([[1.0, 0.0]]),
                                                  ddof=1), [[0.0, 0.0]])
    with pytest.raises(ValueError, match="ddof=2"):
        main_advantages(PAPER_REWARDS, ddof=2)
