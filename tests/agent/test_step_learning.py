"""The steps learn, compile once, and the helpers around them (log-probs, PPO passes) behave."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from mgrpo_jax.agent.optim import default_optim_config, make_optimizer
from mgrpo_jax.agent.state import create_agent_state, model_from_state, params_for_sampling
from mgrpo_jax.agent.step import make_logprob_fn, make_policy_step, make_sft_step, run_passes
from mgrpo_jax.model import token_logprobs

OPTIM = default_optim_config(lr=1e-2, warmup_steps=2, decay="cosine", total_steps=20, grad_clip_norm=1.0)


@pytest.fixture(scope="module")
def agent(tiny_cfg, mesh1):
    return create_agent_state(tiny_cfg, OPTIM, mesh1, seed=3)


@pytest.fixture(scope="module")
def logprob_fn(agent, mesh1):
    g, _, sharding = agent
    return make_logprob_fn(g, sharding, mesh1)


@pytest.fixture(scope="module")
def policy_step(agent, mesh1):
    g, _, sharding = agent
    return make_policy_step(g, make_optimizer(OPTIM), "grpo", {"eps_low": 0.2, "eps_high": 0.28}, sharding,
                            mesh1, micro_batches=2, compute_entropy=True)


def _sampled_logprob(logprob_fn, params, b):
    lp = logprob_fn(params, b["tokens"], b["positions"], b["attention_mask"])
    return float((np.asarray(lp) * b["loss_mask"]).sum())


def test_logprob_fn_matches_token_logprobs(agent, mesh1, logprob_fn, batch_factory):
    g, state, sharding = agent
    b = batch_factory(rows=16, length=12, seed=4)
    lp = np.asarray(logprob_fn(state.params, b["tokens"], b["positions"], b["attention_mask"]))
    ref = np.asarray(token_logprobs(model_from_state(g, state), jnp.asarray(b["tokens"]),
                                    jnp.asarray(b["positions"]), jnp.asarray(b["attention_mask"])))
    np.testing.assert_allclose(lp, ref, atol=1e-5)
    assert (lp[:, 0] == 0).all() and (lp[~b["attention_mask"]] == 0).all()
    chunked = make_logprob_fn(g, sharding, mesh1, micro_batches=2)
    # Same values up to float32 rounding of a differently compiled program: a few ulps of log-probs ~ -5
    # (measured 1.4e-6 with jax 0.10.2 on CPU, where a flat 1e-6 failed).
    np.testing.assert_allclose(np.asarray(chunked(state.params, b["tokens"], b["positions"], b["attention_mask"])),
                               lp, rtol=1e-6, atol=1e-6)


def test_policy_step_learns_compiles_once_and_reports(agent, logprob_fn, policy_step, batch_factory):
    g, state, sharding = agent
    b = batch_factory(rows=16, length=12, seed=6, advantages=np.ones(16))
    b["old_logprobs"] = np.asarray(logprob_fn(state.params, b["tokens"], b["positions"], b["attention_mask"]))
    before = _sampled_logprob(logprob_fn, state.params, b)
    lrs = []
    for i in range(3):
        # Fresh values every call (numpy and device arrays alike): same shapes -> no retrace.
        bi = dict(b) if i == 0 else {k: jnp.asarray(v) for k, v in b.items()}
        state, metrics = policy_step(state, bi)
        lrs.append(float(metrics["lr"]))
        if i == 0:
            first = {k: float(v) for k, v in metrics.items()}
    after = _sampled_logprob(logprob_fn, state.params, b)
    assert after > before + 1.0, (before, after)  # positive advantage: sampled tokens more likely
    assert policy_step.trace_count == 1
    assert int(state.step) == 3
    np.testing.assert_allclose(lrs, [5e-3, 1e-2, 1e-2], rtol=1e-5)  # warm-up 2 steps, then the peak
    assert first["ratio_min"] == pytest.approx(1.0, abs=1e-5)  # old = current log-probs at the first step
    assert first["ratio_max"] == pytest.approx(1.0, abs=1e-5)
    assert first["loss"] == pytest.approx(-1.0, abs=1e-5)  # -mean(ratio * A) with ratio 1, A 1
    assert first["entropy"] > 0 and first["grad_norm"] > 0 and first["skipped"] == 0
    assert first["tokens"] == float(b["loss_mask"][:, 1:].sum())
    # The sampler's weights: same shardings as before the step, so handing them over never recompiles.
    for leaf, want in zip(jax.tree.leaves(params_for_sampling(state)), jax.tree.leaves(sharding.params),
                          strict=True):
        assert leaf.sharding.is_equivalent_to(want, leaf.ndim)
    copy = params_for_sampling(state, copy=True)
    assert copy["embed"][...] is not state.params["embed"][...]


def test_negative_advantage_lowers_logprob(tiny_cfg, mesh1, logprob_fn, policy_step, batch_factory):
    _, state, _ = create_agent_state(tiny_cfg, OPTIM, mesh1, seed=3)  # the module's state was donated
    b = batch_factory(rows=16, length=12, seed=6, advantages=-np.ones(16))
    b["old_logprobs"] = np.asarray(logprob_fn(state.params, b["tokens"], b["positions"], b["attention_mask"]))
    before = _sampled_logprob(logprob_fn, state.params, b)
    state, _ = policy_step(state, b)
    assert _sampled_logprob(logprob_fn, state.params, b) < before - 1.0


def test_run_passes_with_shuffled_minibatches(tiny_cfg, mesh1, logprob_fn, policy_step, batch_factory):
    _, state, _ = create_agent_state(tiny_cfg, OPTIM, mesh1, seed=3)
    big = batch_factory(rows=32, length=12, seed=8)
    big["old_logprobs"] = np.asarray(logprob_fn(state.params, big["tokens"], big["positions"],
                                                big["attention_mask"]))
    traces = policy_step.trace_count
    state, metrics = run_passes(policy_step, state, big, passes=3, key=jax.random.key(0), minibatches=2)
    assert len(metrics) == 6 and int(state.step) == 6
    # 16-row minibatches compile at most once (the module's fixture may already have traced them).
    assert policy_step.trace_count == max(traces, 1)
    # Later passes see ratios away from 1: PPO epochs over one batch of behaviour log-probs.
    assert float(metrics[0]["ratio_max"]) == pytest.approx(1.0, abs=1e-5)
    assert float(metrics[-1]["approx_kl"]) > 0


def test_sft_step_lowers_the_loss(tiny_cfg, mesh1, batch_factory):
    g, state, sharding = create_agent_state(tiny_cfg, OPTIM, mesh1, seed=1)
    step = make_sft_step(g, make_optimizer(OPTIM), sharding, mesh1, micro_batches=2)
    b = batch_factory(rows=16, length=12, seed=9)
    b = {k: b[k] for k in ("tokens", "positions", "attention_mask", "loss_mask")}
    b["tokens"] = np.tile(b["tokens"][:2], (8, 1))  # a tiny repeated batch
    b["attention_mask"] = np.tile(b["attention_mask"][:2], (8, 1))
    b["loss_mask"] = np.tile(b["loss_mask"][:2], (8, 1))
    losses = []
    for _ in range(12):
        state, metrics = step(state, b)
        losses.append(float(metrics["loss"]))
    assert losses[0] == pytest.approx(np.log(64), rel=0.15)  # about uniform at init
    assert losses[-1] < 0.5 * losses[0], losses
    assert float(metrics["accuracy"]) > 0.5
    assert step.trace_count == 1
