"""LoRA agents (mgrpo_jax/model/lora.py): only the adapters train, the base never changes, the KL reference is the
base with the adapters off, and the sampler's merged weights record the log-probs the train step recomputes."""

import types

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import pytest
from flax import nnx

from mgrpo_jax.agent.build import build_agent
from mgrpo_jax.agent.state import create_agent_state
from mgrpo_jax.config import base_config, validate
from mgrpo_jax.model import Transformer, token_logprobs
from mgrpo_jax.model.lora import PROJECTIONS, lora_delta, lora_spec, merge_adapters
from tests.conftest import make_batch
from tests.rl.test_behaviour_logprobs import on_policy_batch

TOKENIZER = types.SimpleNamespace(vocab_size=64, pad_id=0)
TINY = {"d_model": 32, "n_layers": 2, "mlp_dim": 64, "n_heads": 2, "n_kv_heads": 1, "head_dim": 16, "vocab_size": 64}


def _agent_cfg(rank=4, kl_coef=0.0, param_dtype="float32", target="."):
    cfg = base_config().main
    cfg.model_overrides.update({**TINY, "param_dtype": param_dtype})
    cfg.mesh.update({"data": 2, "fsdp": 2, "tensor": 2})
    cfg.lora.update({"rank": rank, "alpha": 8.0, "target": target})
    cfg.loss_hparams.kl_coef = kl_coef
    cfg.optim.lr = 1e-2
    return cfg


def _learner(**kw):
    return build_agent("main", _agent_cfg(**kw), TOKENIZER, jax.devices()[:8], seed=3)


def _batch(learner, seed=0):
    batch = make_batch(rows=8, length=12, seed=seed, vocab=64)
    batch["temperature"] = np.ones(8, np.float32)
    return batch


def test_spec_from_the_config():
    spec = lora_spec(ml_collections.ConfigDict({"rank": 8, "alpha": 16.0, "target": "layers/(q|v)$", "dropout": 0.0}))
    assert spec.targets == ("q", "v") and spec.scale == 2.0
    assert lora_spec(ml_collections.ConfigDict({"rank": 0, "alpha": 1.0, "target": ".", "dropout": 0.0})) is None
    assert lora_spec(ml_collections.ConfigDict({"rank": 2, "alpha": 1.0, "target": ".", "dropout": 0.0})).targets == \
        tuple(PROJECTIONS)


@pytest.mark.parametrize(("field", "value", "message"), [
    ("rank", -1, "main.lora.rank=-1: must be >= 0"),
    ("alpha", 0.0, "main.lora.alpha=0.0: must be > 0"),
    ("dropout", 0.1, "main.lora.dropout=0.1: only 0 is supported"),
    ("target", "embed", "main.lora.target='embed': matches none of the projections"),
    ("target", "(", "main.lora.target='(': not a regular expression"),
])
def test_validate_names_the_bad_lora_field(field, value, message):
    config = base_config()
    config.main.lora.rank = 4
    config.main.lora[field] = value
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace("[", r"\[")):
        validate(config)


def test_merged_weights_equal_the_unmerged_forward():
    """dense(x, W + s A B) == dense(x, W) + dense(dense(x, A), s B), for every projection shape (o contracts 2)."""
    rng = np.random.default_rng(0)
    layers = {"q": rng.normal(size=(2, 6, 3, 4)), "o": rng.normal(size=(2, 3, 4, 6)), "up": rng.normal(size=(2, 6, 5))}
    adapters = {"q_lora_a": rng.normal(size=(2, 6, 2)), "q_lora_b": rng.normal(size=(2, 2, 3, 4)),
                "o_lora_a": rng.normal(size=(2, 3, 4, 2)), "o_lora_b": rng.normal(size=(2, 2, 6)),
                "up_lora_a": rng.normal(size=(2, 6, 2)), "up_lora_b": rng.normal(size=(2, 2, 5))}
    merged = merge_adapters({k: jnp.asarray(v, jnp.float32) for k, v in layers.items()},
                            {k: jnp.asarray(v, jnp.float32) for k, v in adapters.items()}, 0.5)
    for name in layers:
        a, b = adapters[name + "_lora_a"], adapters[name + "_lora_b"]
        by_hand = layers[name] + 0.5 * np.stack([np.tensordot(a[i], b[i], axes=1) for i in range(2)])
        np.testing.assert_allclose(np.asarray(merged[name]), by_hand, rtol=1e-5, atol=1e-5)
        np.testing.assert_allclose(np.asarray(lora_delta(a, b, 0.5)), by_hand - layers[name], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("param_dtype", ["float32", "bfloat16"])
def test_only_adapters_train_and_the_base_is_unchanged_bit_for_bit(param_dtype):
    learner = _learner(param_dtype=param_dtype)
    base_before = jax.device_get(learner.base)
    adapters_before = jax.device_get(learner.state.params)
    # Gradients and optimizer state cover the adapters only.
    assert all(k.endswith(("_lora_a", "_lora_b")) for k in learner.state.params["layers"])
    assert {x.shape for x in jax.tree.leaves(learner.state.opt_state) if np.ndim(x)} <= \
        {x.shape for x in jax.tree.leaves(learner.state.params)}
    assert {x.dtype for x in jax.tree.leaves(learner.base)} == {jnp.dtype(param_dtype)}
    for seed in range(3):
        metrics = learner.train(_batch(learner, seed))
        assert metrics["main/train/skipped"] == 0
    for a, b in zip(jax.tree.leaves(base_before), jax.tree.leaves(jax.device_get(learner.base)), strict=True):
        assert a.dtype == b.dtype and np.array_equal(a, b)
    after = jax.tree.leaves(jax.device_get(learner.state.params))
    changed = [not np.array_equal(a, b) for a, b in zip(jax.tree.leaves(adapters_before), after, strict=True)]
    assert all(changed)  # A moves once B does, B from the first step


def test_a_fresh_adapter_is_the_base_model():
    learner = _learner()
    plain = create_agent_state(learner.model_config, learner.config.optim, learner.mesh, learner.rules, seed=3)[1]
    for a, b in zip(jax.tree.leaves(plain.params), jax.tree.leaves(learner.base), strict=True):
        assert np.array_equal(np.asarray(a), np.asarray(b))
    for a, b in zip(jax.tree.leaves(learner.policy_params()), jax.tree.leaves(learner.base), strict=True):
        assert np.array_equal(np.asarray(a), np.asarray(b))  # B = 0


def test_the_kl_reference_is_the_base_with_adapters_off():
    learner = _learner(kl_coef=0.1)
    assert learner.reference is None and learner.checkpoint_items().keys() == {"main"}  # no second copy
    copy = jax.tree.map(np.array, jax.device_get(learner.base))  # a separately held frozen copy
    for seed in range(2):
        learner.train(_batch(learner, seed))
    batch = _batch(learner, 5)
    reference = np.asarray(learner.reference_logprobs(batch))
    frozen = Transformer(learner.model_config, rngs=nnx.Rngs(0))
    nnx.update(frozen, copy)
    expected = np.asarray(token_logprobs(frozen, jnp.asarray(batch["tokens"]), jnp.asarray(batch["positions"]),
                                         jnp.asarray(batch["attention_mask"])))
    np.testing.assert_allclose(reference, expected, atol=1e-5)
    # The check has teeth: the trained policy's log-probs differ from the reference's.
    policy = nnx.merge(learner.sampler.graphdef, jax.device_get(learner.policy_params()))
    trained = np.asarray(token_logprobs(policy, jnp.asarray(batch["tokens"]), jnp.asarray(batch["positions"]),
                                        jnp.asarray(batch["attention_mask"])))
    assert np.abs(trained - reference).max() > 1e-3


def test_sampler_logprobs_equal_the_train_steps():
    """The sampler runs base + adapters merged (once per update); the train step the unmerged sum."""
    learner = _learner(target="layers/(q|o|down)$")
    for seed in range(2):  # adapters away from B = 0
        learner.train(_batch(learner, seed))
    for seed, temperature in enumerate((1.0, 0.7)):
        batch = on_policy_batch(learner.sampler, temperature, seed)
        _, metrics = learner.policy_step(jax.tree.map(jnp.copy, learner.state), batch)
        m = jax.device_get(metrics)
        assert m["tokens"] > 0 and m["skipped"] == 0
        assert m["ratio_min"] == pytest.approx(1.0, abs=1e-5) and m["ratio_max"] == pytest.approx(1.0, abs=1e-5)
