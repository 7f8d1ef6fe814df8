"""MATPO's credit assignment (`matpo_targets`) against hand-computed values, padding never read, jit, properties,
the credit registry, and the pooled token mean of its loss."""

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from mgrpo_jax.core import (
    MatpoConfig,
    RolloutArrays,
    TargetsConfig,
    aggregate,
    available_credits,
    credit_config_type,
    get_credit,
    matpo_targets,
    mgrpo_targets,
    register_credit,
)

T, F = True, False
KEY = jax.random.key(0)


def _hand_arrays(padding=0.0):
    """Q=2 queries, K=4 planner rollouts with 0, 1, 2, 3 worker calls, C=3 call slots. `padding` fills every entry
    past counts in the per-call arrays (the targets must never read it). Per-call arrays are float so NaN fits."""
    p = padding
    return RolloutArrays(
        format_ok=np.array([[T, T, F, T], [T, T, T, T]]),
        correct=np.array([[1, 0, 1, 0], [1, 1, 1, 1]], np.float32),
        sub_format_ok=np.array([[[p, p, p], [0, p, p], [1, 1, p], [1, 0, 1]],
                                [[1, 1, 1], [p, p, p], [1, p, p], [1, 1, p]]], np.float32),
        sub_expert=np.array([[[p, p, p], [0.5, p, p], [1, 0, p], [0.2, 0.4, 0.6]],
                             [[1, 1, 1], [p, p, p], [1, p, p], [1, 1, p]]], np.float32),
        counts=np.array([[0, 1, 2, 3], [3, 0, 1, 2]], np.int32),
    )


# R = 0.9 * correct + 0.1 * format_term; format_term = (planner + mean of real worker formats) / 2, where a rollout
# without calls averages its planner's format with 0 (MATPO's reward manager; some rollout of this step calls).
# Query 0:
#   k0: 0 calls,  planner T, correct 1: (1 + 0)/2 = 0.5                              -> R = 0.9 + 0.05 = 0.95 (228/240)
#   k1: 1 call,   planner T, correct 0: workers [F]     mean 0,   (1+0)/2 = 0.5    -> R = 0.05            (12/240)
#   k2: 2 calls,  planner F, correct 1: workers [T, T]  mean 1,   (0+1)/2 = 0.5    -> R = 0.9 + 0.05 = 0.95 (228/240)
#   k3: 3 calls,  planner T, correct 0: workers [T,F,T] mean 2/3, (1+2/3)/2 = 5/6  -> R = 0.1 * 5/6 = 1/12 (20/240)
HAND_REWARD_Q0 = [0.95, 0.05, 0.95, 1 / 12]
# In units of 1/240: rewards [228, 12, 228, 20], mean 488/4 = 122, deviations [106, -110, 106, -102]; squares
# 11236 + 12100 + 11236 + 10404 = 44976; the sample variance (ddof 1, as torch.std) is 44976 / 3 = 14992, the std
# sqrt(14992) = 122.441823 in the same units; z = deviation / std:
#   106 / 122.441823 = 0.865717, -110 / 122.441823 = -0.898386, -102 / 122.441823 = -0.833049.
HAND_ADVANTAGE_Q0 = [0.865717, -0.898386, 0.865717, -0.833049]
# Query 1: every rollout correct, every format kept, but k1 made no call: (1 + 0)/2 -> R = 0.95, the others 1.0.
# In units of 1/240: [240, 228, 240, 240], mean 237, deviations [3, -9, 3, 3], sample variance 108 / 3 = 36, std 6.
HAND_REWARD_Q1 = [1.0, 0.95, 1.0, 1.0]
HAND_ADVANTAGE_Q1 = [0.5, -1.5, 0.5, 0.5]


def test_targets_equal_hand_computed_values():
    t = jax.device_get(matpo_targets(_hand_arrays(), KEY, MatpoConfig()))
    np.testing.assert_allclose(t.main_reward, [HAND_REWARD_Q0, HAND_REWARD_Q1], atol=1e-6)
    np.testing.assert_allclose(t.main_advantages, [HAND_ADVANTAGE_Q0, HAND_ADVANTAGE_Q1], atol=1e-5)
    # Each real call (i < counts) carries its parent's advantage with weight 1; padding has weight 0, advantage 0.
    a0, a1, a2, a3 = HAND_ADVANTAGE_Q0
    b0, _, b2, b3 = HAND_ADVANTAGE_Q1
    np.testing.assert_allclose(t.sub_advantages[0], [[0, 0, 0], [a1, 0, 0], [a2, a2, 0], [a3, a3, a3]], atol=1e-5)
    np.testing.assert_allclose(t.sub_advantages[1], [[b0, b0, b0], [0, 0, 0], [b2, 0, 0], [b3, b3, 0]], atol=1e-5)
    np.testing.assert_array_equal(t.sub_weight, [[[0, 0, 0], [1, 0, 0], [1, 1, 0], [1, 1, 1]],
                                                 [[1, 1, 1], [0, 0, 0], [1, 0, 0], [1, 1, 0]]])
    np.testing.assert_allclose(t.sub_reward[0], [[0, 0, 0], [0.05, 0, 0], [0.95, 0.95, 0], [1 / 12] * 3], atol=1e-6)
    np.testing.assert_allclose(t.sub_reward[1], [[1, 1, 1], [0, 0, 0], [1, 0, 0], [1, 1, 0]], atol=1e-6)
    np.testing.assert_allclose(t.sub_call_reward, t.sub_reward)
    # No alignment: slot i is raw call i.
    np.testing.assert_array_equal(t.sub_index, np.broadcast_to(np.arange(3), (2, 4, 3)))
    stats = {k: float(v) for k, v in t.stats.items()}
    assert stats["main_reward"] == pytest.approx((0.95 + 0.05 + 0.95 + 1 / 12 + 3.95) / 8)
    assert stats["main_correct"] == pytest.approx(6 / 8)
    assert stats["main_format_ok"] == pytest.approx(7 / 8)
    assert stats["main_format_term"] == pytest.approx((0.5 + 0.5 + 0.5 + 5 / 6 + 3 * 1 + 0.5) / 8)
    assert stats["main_zero_std_groups"] == 0
    assert stats["sub_calls"] == 12
    # Per call: query 0's calls 1 + 2 + 3, query 1's 3 + 1 + 2 (all credited R = 1).
    assert stats["sub_reward"] == pytest.approx((0.05 + 2 * 0.95 + 3 / 12 + 6) / 12)
    assert stats["sub_expert"] == pytest.approx((0.5 + 1 + 0 + 0.2 + 0.4 + 0.6 + 6) / 12)
    assert stats["sub_format_ok"] == pytest.approx((0 + 2 + 2 + 6) / 12)
    assert stats["sub_zero_std_groups"] == 0


def test_a_step_without_calls_takes_the_planners_format_alone():
    """MATPO's reward manager averages with 0 only when some rollout of the batch called a worker; a batch without
    any takes its planner-only path (`_call_only_main_agent`): R = 0.9 * correct + 0.1 * planner format."""
    arrays = _hand_arrays()._replace(counts=np.zeros((2, 4), np.int32))
    t = jax.device_get(matpo_targets(arrays, KEY, MatpoConfig()))
    np.testing.assert_allclose(t.main_reward, [[1.0, 0.1, 0.9, 0.1], [1.0] * 4], atol=1e-6)
    np.testing.assert_array_equal(t.sub_weight, 0.0)


def test_the_group_std_is_the_sample_std_and_the_population_one_on_request():
    """Query 1's rewards [1, 0.95, 1, 1]: deviations [3, -9, 3, 3] / 240; sample std 6 / 240 (ddof 1), population
    std sqrt(108 / 4) / 240 = sqrt(27) / 240."""
    population = jax.device_get(matpo_targets(_hand_arrays(), KEY, MatpoConfig(std_ddof=0)))
    np.testing.assert_allclose(population.main_advantages[1], np.array([3, -9, 3, 3]) / np.sqrt(27), atol=1e-5)
    sample = jax.device_get(matpo_targets(_hand_arrays(), KEY, MatpoConfig()))
    np.testing.assert_allclose(sample.main_advantages[1], HAND_ADVANTAGE_Q1, atol=1e-5)
    # M-GRPO's estimator keeps the population std (TargetsConfig passes no ddof).
    rewards = np.array([[1.0, 0.95, 1.0, 1.0]], np.float32)
    np.testing.assert_allclose(TargetsConfig().advantages(rewards, np.ones_like(rewards))[0],
                               np.array([3, -9, 3, 3]) / np.sqrt(27), atol=1e-5)


def test_reward_weights_are_config_fields():
    t = matpo_targets(_hand_arrays(), KEY, MatpoConfig(correct_weight=0.5, format_weight=0.5))
    # Query 0: 0.5 * correct + 0.5 * format_term with format terms [0.5, 0.5, 0.5, 5/6].
    np.testing.assert_allclose(t.main_reward[0], [0.75, 0.25, 0.75, 5 / 12], atol=1e-6)


def test_config_from_run_config_reads_the_estimator_and_optional_weights():
    run = ml_collections.ConfigDict({
        "rewards": {"alpha": (0.1, 0.9), "beta": (0.1, 0.4, 0.5), "matpo_format_weight": 0.2},
        "rollout": {"d_max": 4, "align_mode": "duplicate"},
        "advantages": {"estimator": "grpo", "scale": "none", "baseline": "mean", "eps": 1e-6},
    })
    config = MatpoConfig.from_config(run)
    assert (config.correct_weight, config.format_weight) == (0.9, 0.2)
    assert dict(config.estimator_options)["scale"] == "none"
    assert config.estimator_options == TargetsConfig.from_config(run).estimator_options


@pytest.mark.parametrize("padding", [np.nan, 1.0, -7.5, 1e30])
@pytest.mark.parametrize("jitted", [True, False])
def test_padding_is_never_read(padding, jitted):
    """Eagerly too: XLA's CPU compiler may fold `mask * x` into a select, which would hide a NaN read under jit."""
    with jax.disable_jit(not jitted):
        clean = jax.device_get(matpo_targets(_hand_arrays(0.0), KEY, MatpoConfig()))
        dirty = jax.device_get(matpo_targets(_hand_arrays(padding), KEY, MatpoConfig()))
    for name, value in dirty._asdict().items():
        leaves = value.values() if name == "stats" else [value]
        assert all(np.isfinite(np.asarray(x, np.float64)).all() for x in leaves), name
    jax.tree.map(np.testing.assert_array_equal, dirty, clean)


def test_jit_matches_eager_inside_an_outer_jit():
    config = MatpoConfig()
    with jax.disable_jit():
        eager = matpo_targets(_hand_arrays(), KEY, config)
    jitted = jax.jit(lambda arrays: matpo_targets(arrays, KEY, config))(_hand_arrays())
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, atol=1e-6), jitted, eager)


Q, K, C = 3, 4, 3


@st.composite
def rollout_arrays(draw):
    """Random judged rollouts with NaN in every padded per-call entry."""
    counts = draw(hnp.arrays(np.int32, (Q, K), elements=st.integers(0, C)))
    real = np.arange(C)[None, None, :] < counts[..., None]
    sub_format_ok = draw(hnp.arrays(np.float32, (Q, K, C), elements=st.sampled_from([0.0, 1.0])))
    sub_expert = draw(hnp.arrays(np.float32, (Q, K, C), elements=st.sampled_from([0.0, 0.5, 1.0])))
    return RolloutArrays(
        format_ok=draw(hnp.arrays(np.bool_, (Q, K))),
        correct=draw(hnp.arrays(np.float32, (Q, K), elements=st.sampled_from([0.0, 1.0]))),
        sub_format_ok=np.where(real, sub_format_ok, np.nan),
        sub_expert=np.where(real, sub_expert, np.nan),
        counts=counts,
    )


@settings(max_examples=60, deadline=None)
@given(rollout_arrays())
def test_workers_inherit_their_parents_advantage_and_groups_are_centred(arrays):
    t = jax.device_get(matpo_targets(arrays, KEY, MatpoConfig()))
    real = np.arange(C)[None, None, :] < arrays.counts[..., None]
    parent = np.broadcast_to(t.main_advantages[..., None], real.shape)
    np.testing.assert_array_equal(t.sub_advantages[real], parent[real])
    np.testing.assert_array_equal(t.sub_advantages[~real], 0.0)
    np.testing.assert_array_equal(t.sub_weight, real.astype(np.float32))
    assert ((t.main_reward >= 0) & (t.main_reward <= 1 + 1e-6)).all()
    varies = np.ptp(t.main_reward, axis=-1) > 1e-6
    np.testing.assert_allclose(t.main_advantages[varies].sum(-1), 0.0, atol=1e-4)
    np.testing.assert_array_equal(t.main_advantages[~varies], 0.0)
    assert all(np.isfinite(np.asarray(v)).all() for v in t.stats.values())


def test_registry_ships_both_credits_and_names_them_on_an_unknown_name():
    assert {"matpo", "mgrpo"} <= set(available_credits())
    assert get_credit("matpo") is matpo_targets and get_credit("mgrpo") is mgrpo_targets
    assert credit_config_type("matpo") is MatpoConfig and credit_config_type("mgrpo") is TargetsConfig
    with pytest.raises(KeyError, match="unknown credit assignment 'coma'; registered credit assignments: .*matpo"):
        get_credit("coma")
    with pytest.raises(KeyError, match="mgrpo"):
        credit_config_type("coma")
    # Every registered credit takes (arrays, key, config) and returns the same Targets fields.
    for name in ("matpo", "mgrpo"):
        t = get_credit(name)(_hand_arrays(), KEY, credit_config_type(name)())
        assert t.main_advantages.shape == (2, 4) and t.sub_advantages.ndim == 3


def test_registry_accepts_a_new_credit_and_refuses_a_silent_overwrite():
    @register_credit("test_planner_only", config_type=MatpoConfig)
    def planner_only(arrays, key, config):
        t = matpo_targets(arrays, key, config)
        return t._replace(sub_weight=jnp.zeros_like(t.sub_weight))

    assert get_credit("test_planner_only") is planner_only
    with pytest.raises(ValueError, match="already registered"):
        register_credit("test_planner_only")(lambda arrays, key, config: None)


def test_pooled_token_mean_is_the_sum_of_token_mean_pairs():
    """MATPO's loss: one token mean over planner and worker tokens pooled. `aggregate(..., "token-mean")` gives each
    side's (sum, count); adding the pairs equals aggregating the concatenated rows, and the hand-computed mean."""
    planner_losses = np.array([[1.0, 2.0, 9.0], [3.0, 9.0, 9.0]], np.float32)
    planner_mask = np.array([[1, 1, 0], [1, 0, 0]], np.float32)
    worker_losses = np.array([[4.0, 5.0, 6.0], [9.0, 9.0, 9.0], [7.0, 9.0, 9.0]], np.float32)
    worker_mask = np.array([[1, 1, 1], [1, 1, 1], [1, 0, 0]], np.float32)
    worker_weight = np.array([1.0, 0.0, 1.0], np.float32)  # the middle worker row is padding
    p_sum, p_count = aggregate(planner_losses, planner_mask, np.ones(2, np.float32), "token-mean", None)
    w_sum, w_count = aggregate(worker_losses, worker_mask, worker_weight, "token-mean", None)
    pooled = (p_sum + w_sum) / (p_count + w_count)
    # Planner tokens 1, 2, 3; worker tokens 4, 5, 6, 7 (the padding row's excluded): 28 / 7 = 4.
    np.testing.assert_allclose(pooled, 4.0, rtol=1e-6)
    c_sum, c_count = aggregate(np.concatenate([planner_losses, worker_losses]),
                               np.concatenate([planner_mask, worker_mask]),
                               np.concatenate([np.ones(2, np.float32), worker_weight]), "token-mean", None)
    np.testing.assert_allclose(c_sum / c_count, pooled, rtol=1e-6)
    # Not the mean of the two sides' means ((1+2+3)/3 = 2 and (4+5+6+7)/4 = 5.5 -> 3.75).
    assert abs(float(pooled) - 3.75) > 0.1
