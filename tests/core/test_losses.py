import inspect

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from mgrpo_jax.core import (
    PolicyLossInputs,
    available_losses,
    get_loss,
    kl_penalty,
    loss_defaults,
    ppo_clip_loss,
    register_loss,
    resolve_loss_hparams,
)
from mgrpo_jax.core.losses import AGGREGATIONS, balance_roles, role_denominators

GRPO = get_loss("grpo")  # ppo_clip_loss with grpo's defaults: what most tests here exercise


def _inputs(logprobs, old, adv, mask, **kw):
    return PolicyLossInputs(jnp.asarray(logprobs, jnp.float32), jnp.asarray(old, jnp.float32),
                            jnp.asarray(adv, jnp.float32), jnp.asarray(mask, jnp.float32), **kw)


def _loss(inputs, **kw):
    loss_sum, denom, _ = GRPO(inputs, **kw)
    return loss_sum / denom


def test_hand_computed_token_level_clipped_loss():
    # Ratios exp(log 1.5)=1.5 (clipped to 1.28 for A>0), 1.0, 0.5 (clipped to 0.8 for A<0 -> min picks 0.8*A).
    old = np.zeros((2, 3))
    new = np.log(np.array([[1.5, 1.0, 1.0], [0.5, 1.0, 1.0]]))
    adv = np.array([1.0, -2.0])
    mask = np.array([[1, 1, 0], [1, 1, 1]])
    # row 0: tokens -min(1.5, 1.28)*1 = -1.28, -1.0 -> mean -1.14
    # row 1: -min(0.5*-2, 0.8*-2) = 1.6, 2.0, 2.0 -> mean 1.8666..
    expected = (-1.14 + (1.6 + 2.0 + 2.0) / 3) / 2
    np.testing.assert_allclose(_loss(_inputs(new, old, adv, mask)), expected, rtol=1e-6)
    _, _, metrics = GRPO(_inputs(new, old, adv, mask))
    np.testing.assert_allclose(metrics["clip_frac"], 2 / 5)
    np.testing.assert_allclose(metrics["ratio_max"], 1.5, rtol=1e-6)
    np.testing.assert_allclose(metrics["ratio_min"], 0.5, rtol=1e-6)
    assert float(metrics["tokens"]) == 5


def test_aggregation_modes_hand_computed():
    # At ratio 1 every token's loss is -A. Row 0 has 1 token (A=1), row 1 has 3 tokens (A=2).
    mask = np.array([[1, 0, 0, 0], [1, 1, 1, 0]])
    inputs = _inputs(np.zeros((2, 4)), np.zeros((2, 4)), [1.0, 2.0], mask)
    want = {
        "seq-mean-token-mean": (-1 - 2) / 2,
        "token-mean": (-1 - 6) / 4,
        "seq-mean-token-sum": (-1 - 6) / 2,
        "seq-mean-token-sum-norm": (-1 / 4 - 6 / 4) / 2,
    }
    for mode, value in want.items():
        np.testing.assert_allclose(_loss(inputs, aggregation=mode), value, rtol=1e-6, err_msg=mode)


def test_row_weights_multiply_in_and_zero_weight_rows_vanish():
    mask = np.ones((3, 2))
    adv = np.array([1.0, 3.0, 100.0])
    inputs = _inputs(np.zeros((3, 2)), np.zeros((3, 2)), adv, mask, weights=jnp.array([2.0, 1.0, 0.0]))
    np.testing.assert_allclose(_loss(inputs), (2 * -1 + 1 * -3) / 3, rtol=1e-6)


@settings(max_examples=25)
@given(st.sampled_from(AGGREGATIONS), st.sampled_from(["token", "sequence", "sequence-mean"]), st.integers(0, 999))
def test_micro_batches_add_up_exactly(aggregation, ratio_level, seed):
    rng = np.random.default_rng(seed)
    b, t = 6, 5
    mask = (rng.random((b, t)) < 0.7).astype(np.float32)
    inputs = _inputs(rng.normal(size=(b, t)) * 0.1, rng.normal(size=(b, t)) * 0.1, rng.normal(size=b), mask,
                     weights=jnp.asarray(rng.choice([0.0, 1.0, 2.0], size=b), jnp.float32))
    kw = dict(aggregation=aggregation, ratio_level=ratio_level, max_tokens=t)
    full_sum, full_denom, _ = GRPO(inputs, **kw)
    parts = [GRPO(jax.tree.map(lambda x, s=s: x[s], inputs), **kw) for s in (slice(0, 2), slice(2, 6))]
    np.testing.assert_allclose(sum(p[0] for p in parts), full_sum, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(sum(p[1] for p in parts), full_denom, rtol=1e-6)


def test_positive_advantage_gradient_raises_sampled_token_logprobs():
    mask = np.array([[1, 1, 1, 0]], np.float32)
    grad = jax.grad(lambda lp: _loss(_inputs(lp, np.zeros((1, 4)), [1.5], mask)))(jnp.zeros((1, 4)))
    # Gradient descent moves against the gradient: a negative gradient raises the log-probability.
    assert np.all(np.asarray(grad)[0, :3] < 0)
    assert np.asarray(grad)[0, 3] == 0  # untrained token
    grad_neg = jax.grad(lambda lp: _loss(_inputs(lp, np.zeros((1, 4)), [-1.5], mask)))(jnp.zeros((1, 4)))
    assert np.all(np.asarray(grad_neg)[0, :3] > 0)


def test_clipped_tokens_get_zero_gradient():
    old = np.zeros((1, 4))
    # ratios 1.5 (A>0: clipped), 0.5 (A>0: not clipped), 1.1 (inside), 0.7 (A>0, below 1-eps: not clipped)
    lp = jnp.log(jnp.array([[1.5, 0.5, 1.1, 0.7]]))
    grad = np.asarray(jax.grad(lambda x: _loss(_inputs(x, old, [1.0], np.ones((1, 4)))))(lp))
    assert grad[0, 0] == 0 and np.all(grad[0, 1:] != 0)
    # With A<0 the low side is the clipped one.
    lp_neg = jnp.log(jnp.array([[0.5, 1.5, 1.0, 0.9]]))
    grad_neg = np.asarray(jax.grad(lambda x: _loss(_inputs(x, old, [-1.0], np.ones((1, 4)))))(lp_neg))
    assert grad_neg[0, 0] == 0 and np.all(grad_neg[0, 1:] != 0)


def test_dual_clip_bounds_the_loss_for_negative_advantages():
    inputs = _inputs(np.log([[5.0]]), np.zeros((1, 1)), [-1.0], np.ones((1, 1)))
    np.testing.assert_allclose(_loss(inputs), 5.0, rtol=1e-6)
    np.testing.assert_allclose(_loss(inputs, dual_clip=3.0), 3.0, rtol=1e-6)
    with pytest.raises(ValueError, match="dual_clip"):
        _loss(inputs, dual_clip=0.5)


def test_dual_clip_is_verls_clip_ratio_c_token_by_token():
    """verl's compute_policy_loss with clip_ratio_c = 3: for A < 0, min(max(-A r, -A clip(r)), -3 A). One row of
    four trained tokens at A = -2: ratios 5 (capped: min(10, 6) = 6), 2 (max(4, 2.56) = 4, under the cap), 0.5
    (max(1, 1.6) = 1.6), 1 (2); and a row at A = +2 with ratio 5: -min(10, 2.56) = -2.56, untouched by the cap."""
    lp = np.log(np.array([[5.0, 2.0, 0.5, 1.0], [5.0, 1.0, 1.0, 1.0]]))
    mask = np.array([[1, 1, 1, 1], [1, 0, 0, 0]])
    inputs = _inputs(lp, np.zeros((2, 4)), [-2.0, 2.0], mask)
    loss_sum, denom, metrics = GRPO(inputs, dual_clip=3.0, aggregation="token-mean")
    np.testing.assert_allclose(loss_sum, 6.0 + 4.0 + 1.6 + 2.0 - 2.56, rtol=1e-6)
    assert float(denom) == 5
    np.testing.assert_allclose(metrics["dual_clip_frac"], 1 / 5)  # the ratio-5 token at A < 0 only
    plain_sum, _, plain = GRPO(inputs, aggregation="token-mean")
    np.testing.assert_allclose(plain_sum, 10.0 + 4.0 + 1.6 + 2.0 - 2.56, rtol=1e-6)
    assert "dual_clip_frac" not in plain  # off: the metrics (and the program) are the plain surrogate's
    for bad in (1.0, 0.5, -3.0):
        with pytest.raises(ValueError, match=f"dual_clip must be > 1 \\(or None\\), got {bad}"):
            GRPO(inputs, dual_clip=bad)


@settings(max_examples=30, deadline=None)
@given(st.lists(st.floats(-3.0, 3.0), min_size=6, max_size=6), st.floats(0.01, 3.0))
def test_dual_clip_leaves_positive_advantages_bit_for_bit(log_ratios, advantage):
    """With every advantage positive the dual clip never binds: the same bits as without it."""
    lp = np.asarray(log_ratios, np.float32).reshape(2, 3)
    inputs = _inputs(lp, np.zeros((2, 3)), [advantage, 2 * advantage], np.ones((2, 3)))
    with_cap, without = GRPO(inputs, dual_clip=3.0), GRPO(inputs)
    assert np.asarray(with_cap[0]).tobytes() == np.asarray(without[0]).tobytes()
    assert float(with_cap[2]["dual_clip_frac"]) == 0.0


def test_sequence_ratio_is_the_product_of_token_ratios():
    lp = np.log([[1.1, 1.1, 2.0]])
    mask = np.array([[1, 1, 0]])
    inputs = _inputs(lp, np.zeros((1, 3)), [1.0], mask)
    # product over trained tokens = 1.21 -> clipped at 1.28? no: 1.21 < 1.28, so loss = -1.21
    np.testing.assert_allclose(_loss(inputs, ratio_level="sequence"), -1.21, rtol=1e-5)
    # GSPO's geometric mean = 1.1, clipped to 1 + 4e-4 by its narrow range.
    np.testing.assert_allclose(get_loss("gspo")(inputs)[0], -(1 + 4e-4), rtol=1e-6)


def test_kl_estimators_hand_computed():
    lp = jnp.log(jnp.array([0.5]))
    ref = jnp.log(jnp.array([0.25]))
    np.testing.assert_allclose(kl_penalty(lp, ref, "k1"), np.log(2.0), rtol=1e-6)
    np.testing.assert_allclose(kl_penalty(lp, ref, "k3"), 0.5 - np.log(0.5) - 1, rtol=1e-6)
    inputs = _inputs(lp[None], np.log([[0.5]]), [0.0], np.ones((1, 1)), ref_logprobs=ref[None])
    np.testing.assert_allclose(_loss(inputs, kl_coef=0.1, kl_estimator="k1"), 0.1 * np.log(2), rtol=1e-5)
    np.testing.assert_allclose(GRPO(inputs)[2]["kl_ref"], 0.5 - np.log(0.5) - 1, rtol=1e-5)


def test_registry_ships_three_losses_and_accepts_new_ones():
    assert {"grpo", "dr_grpo", "gspo"} <= set(available_losses())
    with pytest.raises(KeyError, match="registered losses: .*grpo"):
        get_loss("ppo_v9")

    @register_loss("test_reinforce")
    def reinforce(inputs, **_):
        token = -inputs.advantages[:, None] * inputs.logprobs
        return (token * inputs.mask).sum(), inputs.mask.sum(), {}

    assert get_loss("test_reinforce") is reinforce
    with pytest.raises(ValueError, match="already registered"):
        register_loss("test_reinforce")(lambda inputs: None)


def test_dr_grpo_defaults_to_constant_length_normalisation():
    inputs = _inputs(np.zeros((1, 4)), np.zeros((1, 4)), [1.0], np.array([[1, 1, 0, 0]]))
    loss_sum, denom, _ = get_loss("dr_grpo")(inputs)
    np.testing.assert_allclose(loss_sum / denom, -2 / 4)


def test_jit_equals_eager_for_every_registered_loss():
    rng = np.random.default_rng(0)
    inputs = _inputs(rng.normal(size=(4, 7)) * 0.2, rng.normal(size=(4, 7)) * 0.2, rng.normal(size=4),
                     rng.random((4, 7)) < 0.8, entropy=jnp.ones((4, 7)))
    for name in ("grpo", "dr_grpo", "gspo"):
        fn = get_loss(name)
        eager = fn(inputs)
        jitted = jax.jit(fn)(inputs)
        np.testing.assert_allclose(jitted[0], eager[0], rtol=1e-6)
        np.testing.assert_allclose(jitted[1], eager[1], rtol=1e-6)
        np.testing.assert_allclose(jitted[2]["entropy"], 1.0)


def test_bad_options_are_named():
    inputs = _inputs(np.zeros((1, 1)), np.zeros((1, 1)), [1.0], np.ones((1, 1)))
    with pytest.raises(ValueError, match="aggregation='mean'"):
        GRPO(inputs, aggregation="mean")
    with pytest.raises(ValueError, match="ratio_level"):
        GRPO(inputs, ratio_level="turn")
    with pytest.raises(ValueError, match="kl_estimator"):
        GRPO(inputs._replace(ref_logprobs=jnp.zeros((1, 1))), kl_estimator="k2")


def test_a_default_lives_in_the_registration_only():
    """ppo_clip_loss has no defaults of its own, every registered loss names each of its keywords, and the config's
    values override the registration's where set (None: unset)."""
    keywords = [p for p in inspect.signature(ppo_clip_loss).parameters.values() if p.name != "inputs"]
    assert all(p.default is inspect.Parameter.empty for p in keywords)
    for name in ("grpo", "dr_grpo", "gspo"):
        assert set(loss_defaults(name)) == {p.name for p in keywords}, name
    assert resolve_loss_hparams("gspo", {"eps_low": None, "eps_high": 0.5, "kl_coef": 0.0}) == {
        **loss_defaults("gspo"), "eps_high": 0.5}
    assert resolve_loss_hparams("grpo") == loss_defaults("grpo")


@pytest.mark.parametrize("aggregation", AGGREGATIONS)
def test_balanced_roles_make_one_batch_the_mean_of_each_roles_own_loss(aggregation):
    """Role 0: 2 rows (3 and 1 trained tokens); role 1: 4 rows (2, 2, 3 tokens, and a padding row of weight 0).
    One loss over the pooled rows with `balance_roles` weights equals the two roles' own losses averaged, and so
    does the sum over any split into micro-batches (rows r % 2) of sums divided by the sum of denominators."""
    rng = np.random.default_rng(0)
    mask = np.array([[1, 1, 1, 0], [1, 0, 0, 0], [1, 1, 0, 0], [0, 1, 1, 0], [0, 1, 1, 1], [1, 1, 0, 0]], np.float32)
    logprobs = rng.normal(0, 0.3, mask.shape).astype(np.float32)
    advantages = np.array([1.0, -0.5, 2.0, -1.0, 0.5, 7.0], np.float32)
    weights = np.array([1, 1, 1, 1, 1, 0], np.float32)
    roles = np.array([0, 0, 1, 1, 1, 1])
    rows = np.arange(6)

    def loss(rows, w):
        out = GRPO(_inputs(logprobs[rows], np.zeros_like(logprobs[rows]), advantages[rows], mask[rows],
                           weights=jnp.asarray(w)), aggregation=aggregation)
        return float(out[0]), float(out[1])

    own = [loss(roles == r, weights[roles == r]) for r in (0, 1)]
    want = (own[0][0] / own[0][1] + own[1][0] / own[1][1]) / 2
    np.testing.assert_allclose(role_denominators(mask, weights, roles, 2, aggregation), [own[0][1], own[1][1]])
    balanced = np.asarray(balance_roles(mask, weights, roles, 2, aggregation))
    total_sum, total_denom = loss(rows, balanced)
    np.testing.assert_allclose(total_sum / total_denom, want, rtol=1e-6)
    np.testing.assert_allclose(total_denom, own[0][1] + own[1][1], rtol=1e-6)  # the pooled denominator, kept
    parts = [loss(rows % 2 == m, balanced[rows % 2 == m]) for m in (0, 1)]
    np.testing.assert_allclose(sum(p[0] for p in parts) / sum(p[1] for p in parts), want, rtol=1e-6)
    # Each role's share of the denominator is a half; without the balance it is its own share.
    np.testing.assert_allclose(role_denominators(mask, balanced, roles, 2, aggregation) / total_denom, [0.5, 0.5],
                               rtol=1e-6)
    pooled_sum, pooled_denom = loss(rows, weights)
    assert abs(pooled_sum / pooled_denom - want) > 1e-3  # the plain pooled mean weighs the roles otherwise


def test_a_role_without_rows_leaves_the_other_whole():
    mask = np.ones((3, 2), np.float32)
    weights = np.array([1.0, 1.0, 0.0], np.float32)
    roles = np.array([0, 0, 1])
    np.testing.assert_allclose(balance_roles(mask, weights, roles, 2, "token-mean"), [1.0, 1.0, 0.0])
