"""The policy step's log-probs are those of the sampling distribution the behaviour log-probs were recorded
under (temperature per row, the sampler's top-k / top-p), so an on-policy batch has importance ratios of 1.

Ratio tolerance 1e-5: the sampler's cached single-token decode and the train step's full causal forward agree
to float32 rounding (tests/sampling/test_sampler.py uses the same bound for log-probs).
"""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from mgrpo_jax.agent.state import create_agent_state, model_from_state
from mgrpo_jax.agent.step import EXCLUDED_LOGIT, make_logprob_fn, make_policy_step, policy_logits
from mgrpo_jax.core.losses import PolicyLossInputs, get_loss
from mgrpo_jax.model import gather_logprobs
from mgrpo_jax.rollout import batches
from mgrpo_jax.rollout.episode import Episode
from mgrpo_jax.sampling import Sampler
from mgrpo_jax.sampling.sampler import filter_logits, sample_logits

SGD = optax.sgd(1.0)
ROWS = 8
MAX_NEW = 12
SEQ_LEN = 32
# Per-row temperatures of the mixed batch: greedy rows (0) among sampled rows at several temperatures.
MIXED = np.asarray([0.7, 1.0, 0.0, 1.3, 0.7, 0.0, 2.0, 0.5], np.float32)


@pytest.fixture(scope="module")
def agent(tiny_cfg, mesh1):
    return create_agent_state(tiny_cfg, SGD, mesh1, seed=5)


def on_policy_batch(sampler, temperature, seed, rows=ROWS, max_new=MAX_NEW, seq_len=SEQ_LEN):
    """Prompts -> the real sampler -> Episodes -> batches.top_batch, as the rollout engine and trainer do."""
    rng = np.random.default_rng(seed)
    prompts = [list(rng.integers(1, 64, size=int(n))) for n in rng.integers(3, 8, size=rows)]
    out = sampler.sample(prompts, max_new=max_new, rng=seed, temperature=temperature)
    row = []
    for i, prompt in enumerate(prompts):
        episode = Episode(agent="main", question_index=0, rollout=i)
        episode.extend(prompt)
        n = int(out.lengths[i])
        episode.extend(out.tokens[i, :n], trained=True, logprobs=out.logprobs[i, :n])
        episode.temperature = float(np.broadcast_to(temperature, (rows,))[i])
        episode.top_k, episode.top_p = sampler.top_k, sampler.top_p
        row.append(episode)
    advantages = rng.normal(size=rows).astype(np.float32)
    return batches.top_batch([row], advantages, seq_len, pad_id=0)


@pytest.mark.parametrize(("top_k", "top_p"), [(0, 1.0), (5, 1.0), (0, 0.8)])
def test_on_policy_ratios_are_one(agent, mesh1, top_k, top_p):
    g, state, sharding = agent
    sampler = Sampler(model_from_state(g, state), pad_id=0, top_k=top_k, top_p=top_p)
    step = make_policy_step(g, SGD, "grpo", {}, sharding, mesh1, donate=False, top_k=sampler.top_k,
                            top_p=sampler.top_p)
    model_lp = make_logprob_fn(g, sharding, mesh1)  # the model's own (T = 1, unfiltered) log-probs
    for seed, temperature in enumerate((0.7, 1.0, MIXED)):
        batch = on_policy_batch(sampler, temperature, seed)
        assert batch["temperature"].shape == (ROWS,)
        _, metrics = step(state, batch)
        m = jax.device_get(metrics)
        label = (top_k, top_p, seed)
        assert m["tokens"] > 0 and m["skipped"] == 0, label
        assert m["ratio_min"] == pytest.approx(1.0, abs=1e-5), label
        assert m["ratio_max"] == pytest.approx(1.0, abs=1e-5), label
        assert m["clip_frac"] == 0.0, label
        assert abs(m["approx_kl"]) < 1e-9, label
        # The check has teeth: away from T = 1 or with a filter, the model's own log-probs are not the
        # behaviour log-probs (the ratios the step computed before the fix).
        own = np.asarray(model_lp(state.params, batch["tokens"], batch["positions"], batch["attention_mask"]))
        trained = batch["loss_mask"] > 0
        gap = np.abs(own - batch["old_logprobs"])[trained].max()
        if top_k == 0 and top_p == 1.0 and np.all(batch["temperature"] == 1.0):
            assert gap < 1e-5, label
        else:
            assert gap > 0.05, label


def test_logprob_fn_takes_the_behaviour_distribution(agent, mesh1):
    g, state, sharding = agent
    sampler = Sampler(model_from_state(g, state), pad_id=0, top_k=5)
    batch = on_policy_batch(sampler, MIXED, seed=7)
    fn = make_logprob_fn(g, sharding, mesh1, top_k=5, micro_batches=2)
    lp = np.asarray(fn(state.params, batch["tokens"], batch["positions"], batch["attention_mask"],
                       batch["temperature"]))
    trained = batch["loss_mask"] > 0
    np.testing.assert_allclose(lp[trained], batch["old_logprobs"][trained], atol=1e-5)


def test_policy_logits_are_the_samplers_distribution():
    """Same log-probs as `sample_logits` records (greedy rows: unfiltered T = 1), finite where it has -inf."""
    logits = jax.random.normal(jax.random.key(0), (6, 40)) * 3.0
    temp = jnp.asarray([0.7, 0.0, 1.0, 1.3, 0.0, 0.5])
    for top_k, top_p in ((0, 1.0), (4, 1.0), (0, 0.7), (6, 0.9)):
        tok, lp = jax.jit(sample_logits, static_argnums=(3, 4))(logits, jax.random.split(jax.random.key(1), 6),
                                                                 temp, top_k, top_p)
        x = jax.jit(policy_logits, static_argnums=(2, 3))(logits, temp, top_k, top_p)
        assert np.isfinite(np.asarray(x)).all()
        np.testing.assert_allclose(gather_logprobs(x, tok), lp, atol=1e-6)
        if top_k or top_p < 1.0:
            assert (np.asarray(x) == EXCLUDED_LOGIT).any()
    # Temperature 1 without filters: exactly the model's logits.
    ones = policy_logits(logits, jnp.ones(6))
    np.testing.assert_array_equal(np.asarray(ones), np.asarray(logits))


def _surrogate(logits, tokens, temperature, advantages, mask, weights, top_k=0, top_p=1.0, old=None):
    """The GRPO objective (loss_sum / denominator) of logits [B, T, V] as the policy step forms it."""
    t = jnp.broadcast_to(temperature[:, None], tokens.shape)
    lp = gather_logprobs(policy_logits(logits, t, top_k, top_p), tokens)
    old = jax.lax.stop_gradient(lp) if old is None else old
    loss_sum, denom, metrics = get_loss("grpo")(PolicyLossInputs(lp, old, advantages, mask, weights))
    return loss_sum / denom, metrics


def test_surrogate_gradient_by_hand_at_temperature():
    """At ratio 1, d(-J)/d logits[b, t] = -A_b * (onehot - softmax(logits / T)) / T * w_b * m_bt / (n_b * D),
    with n_b the row's trained tokens and D = sum of weights of rows with trained tokens
    (seq-mean-token-mean)."""
    B, T, V = 3, 4, 11
    logits = jax.random.normal(jax.random.key(2), (B, T, V)) * 2.0
    tokens = jax.random.randint(jax.random.key(3), (B, T), 0, V)
    temperature = jnp.full((B,), 0.7)
    advantages = jnp.asarray([1.5, -0.8, 0.3])
    mask = jnp.asarray([[1, 1, 1, 0], [0, 1, 1, 1], [1, 0, 0, 0]], jnp.float32)
    weights = jnp.asarray([1.0, 0.5, 2.0])
    grad = jax.jit(jax.grad(lambda x: _surrogate(x, tokens, temperature, advantages, mask, weights)[0]))(logits)

    probs = jax.nn.softmax(logits / 0.7, axis=-1)
    onehot = jax.nn.one_hot(tokens, V)
    n = mask.sum(-1)
    scale = weights / n / weights.sum()  # every row has trained tokens
    expected = -(advantages * scale)[:, None, None] * mask[..., None] * (onehot - probs) / 0.7
    np.testing.assert_allclose(np.asarray(grad), np.asarray(expected), atol=1e-6)

    # With a top-k filter (targets inside the kept set, as sampled tokens always are): the same formula with
    # the softmax over the kept logits, and zero on the excluded ones.
    k = 4
    ranks = jax.random.randint(jax.random.key(5), (B, T), 0, k)
    tokens_k = jnp.take_along_axis(jnp.argsort(-logits, axis=-1), ranks[..., None], -1)[..., 0]
    grad_k = jax.jit(jax.grad(
        lambda x: _surrogate(x, tokens_k, temperature, advantages, mask, weights, top_k=k)[0]))(logits)
    kept = np.isfinite(np.asarray(filter_logits(logits, jnp.full((B, T), 0.7), k)))
    assert (kept.sum(-1) == k).all()
    probs_k = jax.nn.softmax(jnp.where(kept, logits / 0.7, -jnp.inf), axis=-1)
    expected_k = -(advantages * scale)[:, None, None] * mask[..., None] * (jax.nn.one_hot(tokens_k, V) - probs_k) / 0.7
    np.testing.assert_allclose(np.asarray(grad_k), np.asarray(expected_k), atol=1e-6)
    assert (np.asarray(grad_k)[~kept] == 0).all()


def test_tokens_outside_the_filter_give_finite_gradients_and_ratio_zero():
    B, T, V = 2, 5, 16
    logits = jax.random.normal(jax.random.key(4), (B, T, V)) * 3.0
    # Every target is the least likely token: outside the top-3 set.
    tokens = jnp.argmin(logits, axis=-1)
    old = jnp.full((B, T), -2.0)
    mask = jnp.ones((B, T), jnp.float32).at[:, 0].set(0.0)
    for adv in (jnp.asarray([1.0, -1.0]), jnp.asarray([-2.0, 0.5])):
        (loss, metrics), grad = jax.jit(jax.value_and_grad(
            lambda x, adv=adv: _surrogate(x, tokens, jnp.full((B,), 0.7), adv, mask, jnp.ones(B), top_k=3, old=old),
            has_aux=True))(logits)
        assert np.isfinite(float(loss)) and np.isfinite(np.asarray(grad)).all()
        assert float(metrics["ratio_max"]) == 0.0 and np.isfinite(float(metrics["approx_kl"]))


def test_policy_step_with_off_filter_tokens_is_finite(agent, mesh1, batch_factory):
    """Random tokens, most of them outside the top-5 set: the step still updates with finite gradients."""
    g, state, sharding = agent
    step = make_policy_step(g, SGD, "grpo", {}, sharding, mesh1, donate=False, top_k=5)
    b = batch_factory(rows=ROWS, length=12, seed=8)
    b["old_logprobs"] = np.full_like(b["old_logprobs"], -3.0)
    b["temperature"] = np.full((ROWS,), 0.7, np.float32)
    new, metrics = step(state, b)
    m = jax.device_get(metrics)
    assert m["skipped"] == 0 and np.isfinite(m["grad_norm"]) and m["ratio_min"] == 0.0
    assert all(np.isfinite(np.asarray(x)).all() for x in jax.tree.leaves(jax.device_get(new.params)))


def test_temperature_one_column_changes_nothing(agent, mesh1, batch_factory):
    """A `temperature` column of ones gives the update of a batch without the key (the old batches)."""
    g, state, sharding = agent
    step = make_policy_step(g, SGD, "grpo", {}, sharding, mesh1, donate=False)
    b = batch_factory(rows=ROWS, length=12, seed=9)
    old = make_logprob_fn(g, sharding, mesh1)(state.params, b["tokens"], b["positions"], b["attention_mask"])
    b["old_logprobs"] = np.asarray(old) + np.random.default_rng(1).normal(0, 0.2, old.shape).astype(np.float32)
    new_a, ma = step(state, b)
    new_b, mb = step(state, dict(b, temperature=np.ones(ROWS, np.float32)))
    diff = max(float(np.abs(np.asarray(x) - np.asarray(y)).max())
               for x, y in zip(jax.tree.leaves(jax.device_get(new_a.params)),
                               jax.tree.leaves(jax.device_get(new_b.params)), strict=True))
    assert diff < 2e-6
    assert float(ma["loss"]) == pytest.approx(float(mb["loss"]), abs=1e-6)
