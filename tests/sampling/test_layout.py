"""The sampler's decode layout of the weights: same values, and ``forward`` gives the same logits on it."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from mgrpo_jax.model import Transformer, forward, get_model_config
from mgrpo_jax.sampling import decode_layout

TOL = 1e-5


def _model(name, **overrides):
    cfg = get_model_config(name, vocab_size=97, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=8,
                           mlp_dim=64, **overrides)
    model = Transformer(cfg, rngs=nnx.Rngs(0))
    # Non-trivial norms (and everything else), so the test exercises them.
    state = nnx.state(model, nnx.Param)
    keys = iter(jax.random.split(jax.random.key(100), len(jax.tree.leaves(state))))
    nnx.update(model, jax.tree.map(lambda x: x + 0.1 * jax.random.normal(next(keys), x.shape, x.dtype), state))
    return model


@pytest.mark.parametrize("name", ["llama-tiny", "qwen3-tiny", "gemma-tiny"])
def test_out_major_layout_gives_the_same_forward(name):
    model = _model(name)
    cfg = model.cfg
    arrays = model.arrays()
    plain, out_major = decode_layout(arrays), decode_layout(arrays, out_major=True)
    assert len(plain["layers"]) == len(out_major["layers"]) == cfg.n_layers
    for i, (a, b) in enumerate(zip(plain["layers"], out_major["layers"], strict=True)):
        assert set(a) == set(arrays["layers"])
        assert set(b) == set(a) - {"gate", "up", "down"} | {"gate_t", "up_t", "down_t"}
        for m in ("gate", "up", "down"):
            np.testing.assert_array_equal(np.asarray(a[m]), np.asarray(arrays["layers"][m][i]))
            np.testing.assert_array_equal(np.asarray(b[m + "_t"]), np.asarray(a[m]).T)
    if cfg.tie_embeddings:  # the tied head already is [vocab, d_model]
        assert "lm_head" not in out_major and "lm_head_t" not in out_major
    else:
        assert "lm_head" not in out_major
        np.testing.assert_array_equal(np.asarray(out_major["lm_head_t"]), np.asarray(arrays["lm_head"]).T)

    B, T = 2, 6
    tok = jax.random.randint(jax.random.key(7), (B, T), 0, cfg.vocab_size)
    pos = jnp.broadcast_to(jnp.arange(T, dtype=jnp.int32), (B, T))

    @functools.partial(nnx.jit, static_argnums=1)
    def run(model, out_major):
        params = decode_layout(model.arrays(), out_major=out_major)
        full = forward(cfg, None, params, tok, pos)[0]
        # A prefill of T - 1 tokens, then one cached decode step: the sampler's two calls.
        cache = model.init_cache(B, T)
        _, cache = forward(cfg, None, params, tok[:, :-1], pos[:, :-1], cache=cache, cache_index=0)
        step = forward(cfg, None, params, tok[:, -1:], pos[:, -1:], cache=cache, cache_index=jnp.int32(T - 1))[0]
        return full, step

    ref = nnx.jit(lambda model: model(tok, pos)[0])(model)
    (full_a, step_a), (full_b, step_b) = run(model, False), run(model, True)
    np.testing.assert_allclose(np.asarray(full_a), np.asarray(ref), atol=TOL, rtol=0)  # unrolled vs scanned
    np.testing.assert_allclose(np.asarray(full_b), np.asarray(full_a), atol=TOL, rtol=0)
    np.testing.assert_allclose(np.asarray(step_b), np.asarray(step_a), atol=TOL, rtol=0)
    np.testing.assert_allclose(np.asarray(step_b[:, 0]), np.asarray(full_a[:, -1]), atol=TOL, rtol=0)


def test_layout_accepts_a_per_layer_list_and_leaves_its_input_alone():
    arrays = _model("llama-tiny", tie_embeddings=False).arrays()
    once = decode_layout(arrays)
    twice = decode_layout(once, out_major=True)
    assert "gate" in once["layers"][0] and "gate_t" in twice["layers"][0] and "lm_head_t" in twice
    assert "gate" in once["layers"][0] and "lm_head" in once  # the out-major copy left the list it came from
    assert set(arrays["layers"]) >= {"gate", "up", "down"} and "lm_head" in arrays
