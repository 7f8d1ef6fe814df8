"""Attention variants give the dense attention's logits, gradients and cached decoding: `attn_chunk` (chunks of
queries, for long contexts) and `causal_block` (query blocks that skip the masked upper triangle); the attention
kernel's hand-written backward equals autodiff of the textbook softmax; `logits_at` (a prefill's last positions
only) gives those positions' logits."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from mgrpo_jax.model import Transformer, get_model_config
from mgrpo_jax.model.transformer import _NEG_INF, _attention_core

VARIANTS = [{"attn_chunk": 4}, {"causal_block": 4}, {"causal_block": 8, "scan_layers": True}]


def _models(variant=VARIANTS[0]):
    dense_cfg = get_model_config("tiny", vocab_size=64, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=8,
                                 mlp_dim=64, remat=True)
    chunked_cfg = dataclasses.replace(dense_cfg, **variant)
    dense = Transformer(dense_cfg, rngs=nnx.Rngs(0))
    chunked = Transformer(chunked_cfg, rngs=nnx.Rngs(0))
    return dense, chunked


def _inputs(B=2, T=16):
    rng = np.random.default_rng(0)
    tokens = jnp.asarray(rng.integers(1, 64, size=(B, T)), jnp.int32)
    positions = jnp.broadcast_to(jnp.arange(T, dtype=jnp.int32), (B, T))
    mask = jnp.asarray(np.arange(T)[None] < np.array([[T], [T - 5]]), jnp.bool_)
    return tokens, positions, mask


@pytest.mark.parametrize("variant", VARIANTS)
def test_chunked_attention_matches_dense_forward_and_gradient(variant):
    dense, chunked = _models(variant)
    tokens, positions, mask = _inputs()

    def loss(model):
        logits, _ = model(tokens, positions, attention_mask=mask)
        return jnp.sum(jnp.where(mask[..., None], jax.nn.log_softmax(logits), 0.0) * 0.01)

    # Jitted: a program per model instead of the (remat, chunk-loop) ops dispatched one by one.
    forward, grad = nnx.jit(lambda m: m(tokens, positions, attention_mask=mask)[0]), nnx.jit(nnx.grad(loss))
    want, got = forward(dense), forward(chunked)
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=1e-5)
    g_want = jax.tree.leaves(grad(dense))
    g_got = jax.tree.leaves(grad(chunked))
    assert len(g_want) == len(g_got) and any(float(jnp.abs(g).sum()) > 0 for g in g_want)
    for a, b in zip(g_got, g_want, strict=True):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-4, atol=1e-6)


@pytest.mark.parametrize("variant", VARIANTS)
def test_chunked_prefill_with_a_cache_matches_dense(variant):
    dense, chunked = _models(variant)
    tokens, positions, mask = _inputs()
    outs = []
    call = nnx.jit(lambda m, *args, **kw: m(*args, **kw))
    for model in (dense, chunked):
        cache = model.init_cache(2, 20)
        logits, cache = call(model, tokens, positions, attention_mask=mask, cache=cache, cache_index=jnp.int32(0))
        step, _ = call(model, tokens[:, :1], positions[:, -1:] + 1, attention_mask=jnp.ones((2, 1), jnp.bool_),
                       cache=cache, cache_index=jnp.int32(16))
        outs.append((np.asarray(logits), np.asarray(step)))
    for a, b in zip(outs[0], outs[1], strict=True):
        np.testing.assert_allclose(b, a, rtol=1e-5, atol=1e-5)


def test_logits_at_gives_the_full_logits_at_those_positions():
    dense, chunked = _models()
    tokens, positions, mask = _inputs()
    at = jnp.asarray([15, 10], jnp.int32)
    call = nnx.jit(lambda m, *args, **kw: m(*args, **kw))
    for model in (dense, chunked):
        full = np.asarray(call(model, tokens, positions, attention_mask=mask)[0])
        cache = model.init_cache(2, 16)
        some, _ = call(model, tokens, positions, attention_mask=mask, cache=cache, cache_index=jnp.int32(0),
                       logits_at=at)
        assert some.shape == (2, 1, 64)
        np.testing.assert_allclose(np.asarray(some[:, 0]), full[[0, 1], [15, 10]], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("softcap", [None, 5.0])
def test_attention_kernel_backward_equals_autodiff_of_softmax(softcap):
    """Grouped queries (K=2 KV heads, G=2 queries each), a padded key, a fully masked query row."""
    B, K, G, T, S, Dh, scale = 2, 2, 2, 3, 5, 4, 0.5
    keys = jax.random.split(jax.random.key(0), 4)
    qg = jax.random.normal(keys[0], (B, K, G * T, Dh))
    k, v = jax.random.normal(keys[1], (B, K, Dh, S)), jax.random.normal(keys[2], (B, K, S, Dh))
    mask = jnp.ones((B, T, S), bool).at[0, :, 4].set(False).at[1, 2, :].set(False)
    cot = jax.random.normal(keys[3], (B, K, G * T, Dh))

    def reference(qg, k, v):
        s = jnp.einsum("bkqd,bkds->bkqs", qg, k) * scale
        if softcap is not None:
            s = softcap * jnp.tanh(s / softcap)
        s = jnp.where(mask[:, None, None], s.reshape(B, K, G, T, S), _NEG_INF)
        p = jax.nn.softmax(s, axis=-1).reshape(B, K, G * T, S)
        return jnp.vdot(jnp.einsum("bkqs,bksd->bkqd", p, v), cot)

    ours = lambda qg, k, v: jnp.vdot(_attention_core(qg, k, v, mask, scale, softcap), cot)
    np.testing.assert_allclose(jax.jit(ours)(qg, k, v), reference(qg, k, v), rtol=1e-5)
    got, want = jax.jit(jax.grad(ours, (0, 1, 2)))(qg, k, v), jax.grad(reference, (0, 1, 2))(qg, k, v)
    for a, b in zip(got, want, strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-5)
    # The fully masked row of batch 1 averages the values and sends nothing back to its query.
    assert float(jnp.abs(got[0][1, :, [2, T + 2]]).max()) == 0.0
