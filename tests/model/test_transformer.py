"""Transformer forward, KV cache, padding, jit, gradients, remat (tiny configs, float32)."""

import dataclasses
import functools
import inspect

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from mgrpo_jax.model import (
    Transformer,
    forward,
    gather_logprobs,
    get_model_config,
    token_logprobs,
    unstack_layers,
)

TOL = 1e-5  # float32 equivalence tolerance (max abs diff of logits)

FAMILIES = ["llama-tiny", "qwen3-tiny", "gemma-tiny"]  # qwen2 (biases): test_checkpoint_hf


def _cfg(name, **kw):
    base = dict(vocab_size=97, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=8, mlp_dim=64)
    base.update(kw)
    return get_model_config(name, **base)


def _model(cfg, seed=0):
    model = Transformer(cfg, rngs=nnx.Rngs(seed))
    # Give norms / biases non-trivial values so the test exercises them.
    nnx.update(model, _perturb(nnx.state(model, nnx.Param), seed))
    return model


@jax.jit
def _perturb(state, seed):
    leaves, tree = jax.tree.flatten(state)
    flat = jax.random.normal(jax.random.key(seed + 100), (sum(x.size for x in leaves),))
    out, off = [], 0
    for x in leaves:
        out.append(x + 0.1 * flat[off:off + x.size].reshape(x.shape).astype(x.dtype))
        off += x.size
    return jax.tree.unflatten(tree, out)


@nnx.jit
def _forward(model, tokens, positions, mask):
    return model(tokens, positions, attention_mask=mask)[0]


@nnx.jit
def _step(model, tokens, positions, mask, cache, idx):
    return model(tokens, positions, attention_mask=mask, cache=cache, cache_index=idx)


def _positions(B, T):
    return jnp.broadcast_to(jnp.arange(T, dtype=jnp.int32), (B, T))


@pytest.mark.parametrize("name", FAMILIES)
def test_cache_decode_matches_full_forward_right_padded(name):
    cfg = _cfg(name, logit_softcap=30.0 if name.startswith("gemma") else None)
    model = _model(cfg)
    rng = np.random.default_rng(0)
    lens = np.array([6, 3, 1])  # prompt lengths, right-padded to P
    B, P, G, S = len(lens), 6, 5, 16
    prompt = rng.integers(0, cfg.vocab_size, (B, P)).astype(np.int32)
    pmask = np.arange(P)[None] < lens[:, None]
    prompt = np.where(pmask, prompt, 0)
    gen = rng.integers(0, cfg.vocab_size, (B, G)).astype(np.int32)

    cache = model.init_cache(B, S)
    pre_logits, cache = _step(model, jnp.asarray(prompt), _positions(B, P), jnp.asarray(pmask), cache,
                              jnp.int32(0))
    dec = []
    for j in range(G):
        pos = jnp.asarray(lens + j, jnp.int32)[:, None]
        lg, cache = _step(model, jnp.asarray(gen[:, j:j + 1]), pos, jnp.ones((B, 1), bool), cache,
                          jnp.int32(P + j))
        dec.append(lg[:, 0])
    assert cache["mask"].sum() == lens.sum() + B * G

    # Reference: each row's real tokens, contiguous from position 0, right-padded into one batch
    # (right padding never changes real tokens' logits: test_padding_invariance_no_cache).
    N = P + G
    ref_tok = np.zeros((B, N), np.int32)
    ref_mask = np.zeros((B, N), bool)
    for b in range(B):
        n = lens[b] + G
        ref_tok[b, :n] = np.concatenate([prompt[b, :lens[b]], gen[b]])
        ref_mask[b, :n] = True
    ref = _forward(model, jnp.asarray(ref_tok), _positions(B, N), jnp.asarray(ref_mask))
    assert np.isfinite(np.asarray(pre_logits)).all()
    for b in range(B):
        np.testing.assert_allclose(pre_logits[b, :lens[b]], ref[b, :lens[b]], atol=TOL, rtol=0)
        got = jnp.stack([d[b] for d in dec])
        np.testing.assert_allclose(got, ref[b, lens[b]:lens[b] + G], atol=TOL, rtol=0)


def test_multi_token_chunks_into_cache_match_full():
    cfg = _cfg("qwen3-tiny")
    model = _model(cfg)
    B, T, S = 2, 9, 12
    tok = jax.random.randint(jax.random.key(1), (B, T), 0, cfg.vocab_size)
    ref = _forward(model, tok, _positions(B, T), jnp.ones((B, T), bool))
    cache = model.init_cache(B, S)
    outs = []
    for a, b in [(0, 4), (4, 5), (5, 9)]:
        lg, cache = _step(model, tok[:, a:b], _positions(B, T)[:, a:b], jnp.ones((B, b - a), bool), cache,
                          jnp.int32(a))
        outs.append(lg)
    np.testing.assert_allclose(jnp.concatenate(outs, 1), ref, atol=TOL, rtol=0)


def test_padding_invariance_no_cache():
    """A row's logits on its real tokens do not depend on padding length, padding ids, or other rows."""
    cfg = _cfg("llama-tiny")
    model = _model(cfg)
    rng = np.random.default_rng(1)
    seq = rng.integers(0, cfg.vocab_size, (1, 5)).astype(np.int32)
    ref = _forward(model, jnp.asarray(seq), _positions(1, 5), jnp.ones((1, 5), bool))[0]
    for T, pad_id in [(8, 0), (8, 7), (11, 3)]:
        tok = np.full((2, T), pad_id, np.int32)
        tok[0, :5] = seq[0]
        tok[1] = rng.integers(0, cfg.vocab_size, T)
        mask = np.ones((2, T), bool)
        mask[0, 5:] = False
        out = _forward(model, jnp.asarray(tok), _positions(2, T), jnp.asarray(mask))
        np.testing.assert_allclose(out[0, :5], ref, atol=TOL, rtol=0)
        assert np.isfinite(np.asarray(out)).all()
    # Left padding with explicit positions is equivalent too; fully-masked queries stay finite.
    tok = np.zeros((1, 8), np.int32)
    tok[0, 3:] = seq[0]
    mask = np.arange(8)[None] >= 3
    pos = np.maximum(np.arange(8) - 3, 0)[None].astype(np.int32)
    out = _forward(model, jnp.asarray(tok), jnp.asarray(pos), jnp.asarray(mask))
    np.testing.assert_allclose(out[0, 3:], ref, atol=TOL, rtol=0)
    assert np.isfinite(np.asarray(out)).all()


def test_jit_equals_eager():
    cfg = _cfg("gemma-tiny", attn_logit_softcap=50.0, logit_softcap=30.0)
    model = _model(cfg)
    tok = jax.random.randint(jax.random.key(2), (2, 7), 0, cfg.vocab_size)
    mask = jnp.array([[1] * 7, [1] * 4 + [0] * 3], bool)
    eager, _ = model(tok, _positions(2, 7), attention_mask=mask)
    jitted = _forward(model, tok, _positions(2, 7), mask)
    np.testing.assert_allclose(eager, jitted, atol=TOL, rtol=0)
    assert float(jnp.abs(eager).max()) <= 30.0


def _loss(model, tok, mask):
    lp = token_logprobs(model, tok, _positions(*tok.shape), mask)
    return -lp.sum() / mask[:, 1:].sum()


@pytest.mark.parametrize("scan_layers", [False, True])
def test_gradients_flow_to_every_param_and_remat_and_scan_match(scan_layers):
    """Loss and gradients agree across the layer loop's forms (scan / unrolled) and with remat."""
    cfg = _cfg("qwen3-tiny", scan_layers=False, remat=False)
    tok = jax.random.randint(jax.random.key(3), (2, 8), 0, cfg.vocab_size)
    mask = jnp.ones((2, 8), bool)
    ref_loss, ref = nnx.jit(nnx.value_and_grad(_loss))(_model(cfg), tok, mask)
    for remat in (False, True):
        model = _model(dataclasses.replace(cfg, scan_layers=scan_layers, remat=remat))
        loss, g = nnx.jit(nnx.value_and_grad(_loss))(model, tok, mask)
        for path, leaf in jax.tree_util.tree_leaves_with_path(g):
            assert float(jnp.abs(leaf).max()) > 0, f"no gradient reaches {path}"
        np.testing.assert_allclose(loss, ref_loss, atol=1e-6)
        jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, atol=1e-6, rtol=1e-5), g, ref)


@pytest.mark.parametrize(("x_shape", "w_shape", "n_in", "spec"), [
    ((3, 5, 8), (8, 4, 6), 1, "btd,dhk->bthk"),
    ((3, 5, 4, 6), (4, 6, 8), 2, "bthk,hkd->btd"),
    ((7, 16), (16, 3), 1, "nd,df->nf"),  # activation wider than the output: the other transpose order
])
def test_dense_matches_einsum_values_and_gradients(x_shape, w_shape, n_in, spec):
    from mgrpo_jax.model.transformer import dense

    x = jax.random.normal(jax.random.key(0), x_shape)
    w = jax.random.normal(jax.random.key(1), w_shape)
    cot = jax.random.normal(jax.random.key(2), jnp.einsum(spec, x, w).shape)
    ours = jax.jit(lambda x, w: jnp.vdot(dense(x, w, n_in), cot))
    ref = lambda x, w: jnp.vdot(jnp.einsum(spec, x, w), cot)
    np.testing.assert_allclose(ours(x, w), ref(x, w), rtol=1e-5)
    for a, b in zip(jax.grad(ours, (0, 1))(x, w), jax.grad(ref, (0, 1))(x, w), strict=True):
        assert a.shape == b.shape
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5)


def test_prefill_at_python_zero_equals_traced_index_and_ignores_stale_slots():
    """cache_index=0 (a Python int) attends to the prompt's own keys only; a traced 0 reads the whole cache.
    Both must give the same logits and the same cache, also over a cache holding an earlier call's keys."""
    cfg = _cfg("qwen3-tiny", causal_block=4)
    model = _model(cfg)
    tok = jax.random.randint(jax.random.key(5), (2, 8), 0, cfg.vocab_size)
    mask = jnp.asarray(np.arange(8)[None] < np.array([[8], [5]]))
    pos = _positions(2, 8)

    @functools.partial(nnx.jit, static_argnums=2)
    def prefill(model, cache, python_zero):
        idx = 0 if python_zero else jnp.int32(0)
        return model(tok, pos, attention_mask=mask, cache=cache, cache_index=idx)

    stale = _step(model, tok[:, ::-1], pos, jnp.ones((2, 8), bool), model.init_cache(2, 12), jnp.int32(0))[1]
    for cache in (model.init_cache(2, 12), stale):
        (a, ca), (b, cb) = prefill(model, cache, True), prefill(model, cache, False)
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=TOL, rtol=0)
        jax.tree.map(lambda x, y: np.testing.assert_allclose(np.asarray(x), np.asarray(y), atol=TOL), ca, cb)


def test_call_is_forward_on_the_models_arrays_and_takes_per_layer_lists():
    """``Transformer.__call__`` is ``forward`` on ``arrays()``; a per-layer list of the same weights (what a
    decode loop passes) gives the same cached forward bit for bit, and the uncached one unrolled instead of
    scanned."""
    cfg = _cfg("llama-tiny", scan_layers=True)
    model = _model(cfg)
    tok = jax.random.randint(jax.random.key(4), (2, 5), 0, cfg.vocab_size)
    pos = _positions(2, 5)
    assert cfg.tie_embeddings and set(model.arrays()) == {"embed", "final_norm", "layers"}
    untied = _model(_cfg("qwen3-tiny", tie_embeddings=False))
    assert set(untied.arrays()) == {"embed", "final_norm", "layers", "lm_head"}

    @functools.partial(nnx.jit, static_argnums=1)
    def run(model, how):
        cache = model.init_cache(2, 8)
        if how == "call":
            return model(tok, pos)[0], model(tok, pos, cache=cache, cache_index=jnp.int32(0))[0]
        params = model.arrays()
        if how == "list":
            params = dict(params, layers=unstack_layers(params["layers"]))
        return (forward(cfg, None, params, tok, pos)[0],
                forward(cfg, None, params, tok, pos, cache=cache, cache_index=jnp.int32(0))[0])

    assert cfg.scan_layers
    ref_full, ref_cached = run(model, "call")
    for how in ("stacked", "list"):
        full, cached = run(model, how)
        np.testing.assert_array_equal(np.asarray(cached), np.asarray(ref_cached))
        if how == "stacked":
            np.testing.assert_array_equal(np.asarray(full), np.asarray(ref_full))
        np.testing.assert_allclose(np.asarray(full), np.asarray(ref_full), atol=TOL, rtol=0)


def test_call_has_one_path():
    """No layout knobs in the model's call: those live in the sampler (mgrpo_jax.sampling.layout)."""
    params = inspect.signature(Transformer.__call__).parameters
    assert list(params) == ["self", "tokens", "positions", "attention_mask", "cache", "cache_index", "logits_at",
                            "router_stats"]
    assert not hasattr(Transformer, "layer_list") and not hasattr(Transformer, "head_out_major")


def test_token_logprobs_matches_manual_log_softmax():
    cfg = _cfg("llama-tiny")
    model = _model(cfg)
    tok = jax.random.randint(jax.random.key(4), (2, 6), 0, cfg.vocab_size)
    mask = jnp.array([[1] * 6, [1] * 4 + [0] * 2], bool)
    lp = np.asarray(nnx.jit(token_logprobs)(model, tok, _positions(2, 6), mask))
    logits = _forward(model, tok, _positions(2, 6), mask)
    full = np.asarray(jax.nn.log_softmax(logits, -1))
    tok_np, mask_np = np.asarray(tok), np.asarray(mask)
    for b in range(2):
        for t in range(6):
            want = 0.0 if t == 0 or not mask_np[b, t] else full[b, t - 1, tok_np[b, t]]
            assert abs(lp[b, t] - want) < 1e-5
    np.testing.assert_allclose(gather_logprobs(logits, tok), np.take_along_axis(full, tok_np[..., None], -1)[..., 0],
                               atol=1e-5)


def test_bfloat16_compute_close_to_float32():
    cfg = _cfg("qwen3-tiny")
    model = _model(cfg)
    tok = jax.random.randint(jax.random.key(5), (2, 8), 0, cfg.vocab_size)
    ref = _forward(model, tok, _positions(2, 8), jnp.ones((2, 8), bool))
    model_bf = Transformer(dataclasses.replace(cfg, dtype="bfloat16"), rngs=nnx.Rngs(0))
    nnx.update(model_bf, nnx.state(model, nnx.Param))
    out = _forward(model_bf, tok, _positions(2, 8), jnp.ones((2, 8), bool))
    assert out.dtype == jnp.float32
    assert model_bf.layers.q[...].dtype == jnp.float32  # params stay float32
    assert float(jnp.abs(out - ref).max()) < 0.1 * float(jnp.abs(ref).max())
    cache = model_bf.init_cache(2, 8)
    assert all(k.dtype == jnp.bfloat16 for k in cache["k"] + cache["v"])


@pytest.mark.parametrize(("name", "billions"), [("llama3-8b", 8.03), ("qwen3-8b", 8.19), ("gemma-7b", 8.54),
                                                ("bench", None)])
def test_paper_scale_presets_have_real_shapes(name, billions):
    cfg = get_model_config(name)
    if billions is not None:
        assert abs(cfg.num_params() / 1e9 - billions) < 0.01
    abstract = nnx.eval_shape(lambda: Transformer(cfg, rngs=nnx.Rngs(0)))
    n = sum(x.size for x in jax.tree.leaves(nnx.state(abstract, nnx.Param)))
    assert n == cfg.num_params()
    if name == "bench":
        assert (cfg.vocab_size, cfg.d_model, cfg.n_layers, cfg.n_heads, cfg.n_kv_heads, cfg.head_dim,
                cfg.mlp_dim, cfg.dtype, cfg.qk_norm) == (2048, 256, 4, 4, 2, 64, 1024, "float32", True)


def test_unknown_preset_and_bad_config_raise():
    with pytest.raises(ValueError):
        get_model_config("nope-tiny")
    with pytest.raises(ValueError):
        get_model_config("llama-tiny", n_heads=3, n_kv_heads=2)
