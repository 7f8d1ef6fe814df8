"""The asynchronous run's off-policy correction (mgrpo_jax/core/offpolicy.py): on-policy tokens keep ratio 1 and
their log-probs, a stale token's weight is the hand-computed truncated ratio, and the corrected batch's loss is the
weighted PPO loss around the proximal policy."""

import math

import hypothesis.strategies as st
import jax.numpy as jnp
import numpy as np
from hypothesis import given

from mgrpo_jax.core.losses import PolicyLossInputs, get_loss
from mgrpo_jax.core.offpolicy import behaviour_weights, decoupled_rows, per_token_advantages, stale_tokens


def test_stale_tokens_are_trained_tokens_of_older_versions():
    versions = np.array([[3, 2, 3, 0]])
    trained = np.array([[1, 1, 1, 0]])
    assert stale_tokens(versions, trained, 3).tolist() == [[False, True, False, False]]


def test_on_policy_ratio_is_one_and_a_stale_token_matches_the_hand_computed_value():
    behaviour = np.array([[-1.0, -2.0, -0.5]], np.float32)
    proximal = np.array([[-1.3, -1.5, -0.1]], np.float32)
    stale = np.array([[False, True, True]])
    weights = behaviour_weights(behaviour, proximal, stale, cap=1.6)
    assert weights[0, 0] == 1.0  # on-policy: exactly 1, whatever the two log-probs say
    assert math.isclose(weights[0, 1], 1.6, rel_tol=1e-6)  # e^0.5 = 1.6487: truncated at the cap
    assert math.isclose(weights[0, 2], math.exp(0.4), rel_tol=1e-6)  # e^0.4 = 1.4918: below the cap


def test_cap_truncates_and_uncapped_ratio_is_exact():
    behaviour = np.array([[-2.0, -2.0]], np.float32)
    proximal = np.array([[-1.9, -0.1]], np.float32)
    weights = behaviour_weights(behaviour, proximal, np.ones((1, 2), bool), cap=2.0)
    assert math.isclose(weights[0, 0], math.exp(0.1), rel_tol=1e-6)
    assert weights[0, 1] == np.float32(2.0)


@given(st.integers(0, 2**31 - 1))
def test_corrected_rows_give_the_weighted_loss_around_the_proximal_policy(seed):
    rng = np.random.default_rng(seed)
    rows, length = 3, 5
    behaviour = -rng.uniform(0.1, 3.0, (rows, length)).astype(np.float32)
    proximal = behaviour + rng.normal(0, 0.5, (rows, length)).astype(np.float32)
    current = proximal + rng.normal(0, 0.3, (rows, length)).astype(np.float32)
    mask = (rng.random((rows, length)) < 0.8).astype(np.float32)
    stale = (rng.random((rows, length)) < 0.5) & (mask > 0)
    batch = {"tokens": np.zeros((rows, length), np.int32), "old_logprobs": behaviour,
             "advantages": rng.normal(size=rows).astype(np.float32)}
    corrected = decoupled_rows(batch, proximal, stale, cap=2.0)
    assert np.array_equal(corrected["old_logprobs"][~stale], behaviour[~stale])  # on-policy: as recorded
    loss = get_loss("grpo", {"aggregation": "token-mean"})
    got, _, _ = loss(PolicyLossInputs(jnp.asarray(current), jnp.asarray(corrected["old_logprobs"]),
                                      jnp.asarray(corrected["advantages"]), jnp.asarray(mask)))
    # By hand: w * max(-A r, -A clip(r)), r against pi_prox on stale tokens and against mu elsewhere.
    old = np.where(stale, proximal, behaviour)
    ratio = np.exp(current - old)
    advantage = batch["advantages"][:, None]
    surrogate = np.minimum(ratio * advantage, np.clip(ratio, 0.8, 1.28) * advantage)
    weight = np.where(stale, np.minimum(np.exp(proximal - behaviour), 2.0), 1.0)
    expected = (-(weight * surrogate) * mask).sum()
    assert np.isclose(float(got), expected, rtol=1e-4, atol=1e-5)


def test_per_token_advantages_broadcast_each_rows_one():
    rows = {"tokens": np.zeros((2, 3), np.int32), "advantages": np.array([1.0, -2.0], np.float32)}
    assert per_token_advantages(rows)["advantages"].tolist() == [[1.0] * 3, [-2.0] * 3]
