"""The policy step is exact: micro-batching, sharding and padding rows do not change the update.

Updates are compared under plain SGD with lr = 1, so the parameter change *is* the gradient (Adam's first
step would hide gradient errors behind sign(g)). Tolerance: 2e-6 absolute on every parameter, with
gradient norms ~5; measured differences are ~2e-7 (float32 summation order).
"""

import jax
import numpy as np
import optax
import pytest

from mgrpo_jax.agent.state import create_agent_state
from mgrpo_jax.agent.step import make_logprob_fn, make_policy_step

ATOL = 2e-6
SGD = optax.sgd(1.0)


def _max_diff(a, b):
    return max(jax.tree.leaves(jax.tree.map(lambda x, y: float(np.abs(np.asarray(x) - np.asarray(y)).max()),
                                            jax.device_get(a), jax.device_get(b))))


@pytest.fixture(scope="module")
def agent1(tiny_cfg, mesh1):
    return create_agent_state(tiny_cfg, SGD, mesh1, seed=0)


@pytest.fixture(scope="module")
def batch(agent1, mesh1, batch_factory):
    g, state, sharding = agent1
    b = batch_factory(rows=16, length=12, seed=1)
    lp = make_logprob_fn(g, sharding, mesh1)(state.params, b["tokens"], b["positions"], b["attention_mask"])
    # Behaviour log-probs a little off the current policy, so ratios differ from 1 (some get clipped).
    b["old_logprobs"] = np.asarray(lp) + np.random.default_rng(2).normal(0, 0.2, lp.shape).astype(np.float32)
    return b


@pytest.fixture(scope="module")
def step1(agent1, mesh1):
    g, _, sharding = agent1
    return make_policy_step(g, SGD, "grpo", {}, sharding, mesh1, micro_batches=1, donate=False)


@pytest.fixture(scope="module")
def reference(step1, agent1, batch):
    new, metrics = step1(agent1[1], batch)
    return jax.device_get(new.params), jax.device_get(metrics)


def test_micro_batches_give_the_same_update(agent1, mesh1, batch, reference):
    g, state, sharding = agent1
    step4 = make_policy_step(g, SGD, "grpo", {}, sharding, mesh1, micro_batches=4, donate=False)
    new, metrics = step4(state, batch)
    ref_params, ref_metrics = reference
    assert _max_diff(new.params, ref_params) < ATOL
    metrics = jax.device_get(metrics)
    for k in ("loss", "grad_norm", "tokens", "loss_denominator", "ratio_mean", "clip_frac", "approx_kl",
              "ratio_min", "ratio_max"):
        np.testing.assert_allclose(metrics[k], ref_metrics[k], rtol=1e-5, atol=1e-6, err_msg=k)
    assert ref_metrics["clip_frac"] > 0  # the clip is exercised
    assert ref_metrics["skipped"] == 0


def test_sharded_step_equals_single_device(tiny_cfg, mesh8, batch, reference):
    g, state, sharding = create_agent_state(tiny_cfg, SGD, mesh8, seed=0)
    assert state.params["embed"][...].sharding.mesh.size == 8
    step = make_policy_step(g, SGD, "grpo", {}, sharding, mesh8, micro_batches=2)
    new, metrics = step(state, batch)
    ref_params, ref_metrics = reference
    assert _max_diff(new.params, ref_params) < ATOL
    np.testing.assert_allclose(float(metrics["loss"]), ref_metrics["loss"], rtol=1e-5)
    # The new state keeps the declared shardings (so the sampler never recompiles on new weights).
    for leaf, want in zip(jax.tree.leaves(new), jax.tree.leaves(sharding), strict=True):
        assert leaf.sharding.is_equivalent_to(want, leaf.ndim)


def test_zero_weight_rows_change_nothing(agent1, step1, batch):
    _, state, _ = agent1
    weights = np.array([1.0] * 8 + [0.0] * 8, np.float32)
    a = dict(batch, weights=weights)
    b = dict(a)
    rng = np.random.default_rng(5)
    # Scramble everything in the padding rows.
    b["tokens"] = np.where(weights[:, None] > 0, a["tokens"], rng.integers(1, 64, a["tokens"].shape)).astype(np.int32)
    b["advantages"] = np.where(weights > 0, a["advantages"], 100.0).astype(np.float32)
    b["old_logprobs"] = np.where(weights[:, None] > 0, a["old_logprobs"], -30.0).astype(np.float32)
    new_a, ma = step1(state, a)
    new_b, mb = step1(state, b)
    assert _max_diff(new_a.params, new_b.params) < 1e-7
    assert float(ma["loss"]) == pytest.approx(float(mb["loss"]), abs=1e-7)
    assert float(ma["tokens"]) == float(mb["tokens"]) < float(batch["loss_mask"][:, 1:].sum())


def test_all_padding_batch_is_skipped(agent1, step1, batch):
    _, state, _ = agent1
    new, metrics = step1(state, dict(batch, weights=np.zeros(16, np.float32)))
    assert float(metrics["skipped"]) == 1.0
    assert _max_diff(new.params, state.params) == 0.0
    assert int(new.step) == int(state.step) + 1


def test_rows_must_divide_into_micro_batches_and_shards(agent1, mesh1, batch):
    g, state, sharding = agent1
    step = make_policy_step(g, SGD, "grpo", {}, sharding, mesh1, micro_batches=3, donate=False)
    with pytest.raises(ValueError, match="micro_batches"):
        step(state, batch)


def test_bfloat16_params_keep_their_dtype_and_compile_once(tiny_cfg, mesh1, batch_factory):
    import dataclasses

    from mgrpo_jax.agent.optim import default_optim_config, make_optimizer

    cfg = dataclasses.replace(tiny_cfg, dtype="bfloat16", param_dtype="bfloat16")
    optim = default_optim_config(lr=1e-3)
    g, state, sharding = create_agent_state(cfg, optim, mesh1, seed=0)
    step = make_policy_step(g, make_optimizer(optim), "grpo", {}, sharding, mesh1, micro_batches=2)
    b = batch_factory(rows=8, length=12, seed=3)
    for _ in range(2):
        state, metrics = step(state, b)
    assert step.trace_count == 1 and float(metrics["skipped"]) == 0
    assert {x.dtype for x in jax.tree.leaves(state.params)} == {np.dtype("bfloat16")}
