"""Mixture-of-experts agents (Qwen3-MoE): the block against a per-token reference, layer kinds, HF import and
export against `transformers`, the load-balancing loss against HF's, expert parallelism on the 8-device mesh,
cached decoding, and the train step's router loss and metrics."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
import torch
import transformers
from flax import nnx
from hypothesis import given, settings
from hypothesis import strategies as st

from mgrpo_jax.model import Transformer, get_model_config, make_mesh, shard_model
from mgrpo_jax.model.checkpoint_hf import config_from_hf, config_to_hf, load_hf, save_hf
from mgrpo_jax.model.moe import RouterStats, load_balancing_loss, moe_mlp, routing_metrics

TOL = 1e-5


def _cfg(**kw):
    base = dict(vocab_size=96, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=8, mlp_dim=64,
                num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16)
    base.update(kw)
    return get_model_config("qwen3-moe-tiny", **base)


def _reference_moe(x, w, k, norm):
    """Every token through its top-k experts one at a time (numpy, float64)."""
    x = np.asarray(x, np.float64)
    logits = x @ np.asarray(w["router"], np.float64)
    p = np.exp(logits - logits.max(-1, keepdims=True))
    p /= p.sum(-1, keepdims=True)
    out = np.zeros_like(x)
    for n in range(x.shape[0]):
        top = np.argsort(-p[n], kind="stable")[:k]
        weights = p[n, top] / (p[n, top].sum() if norm else 1.0)
        for e, wt in zip(top, weights, strict=True):
            g = x[n] @ np.asarray(w["expert_gate"][e], np.float64)
            u = x[n] @ np.asarray(w["expert_up"][e], np.float64)
            out[n] += wt * ((g / (1 + np.exp(-g)) * u) @ np.asarray(w["expert_down"][e], np.float64))
    return out


@settings(max_examples=8, deadline=None)
@given(seed=st.integers(0, 2**16), k=st.integers(1, 4), norm=st.booleans(), tokens=st.integers(1, 12))
def test_block_equals_per_token_reference(seed, k, norm, tokens):
    cfg = _cfg(num_experts_per_tok=k, norm_topk_prob=norm)
    keys = jax.random.split(jax.random.key(seed), 5)
    D, E, F = cfg.d_model, cfg.num_experts, cfg.moe_intermediate_size
    w = {"router": jax.random.normal(keys[0], (D, E)), "expert_gate": jax.random.normal(keys[1], (E, D, F)) / 6,
         "expert_up": jax.random.normal(keys[2], (E, D, F)) / 6,
         "expert_down": jax.random.normal(keys[3], (E, F, D)) / 4}
    h = jax.random.normal(keys[4], (1, tokens, D))
    mask = jnp.arange(tokens)[None] < max(1, tokens - 2)
    # Jitted: one compile per example instead of the tile loop's hundreds of small ops dispatched one by one.
    y, stats = jax.jit(moe_mlp, static_argnums=(0, 1))(cfg, None, w, h, mask)
    np.testing.assert_allclose(np.asarray(y[0]), _reference_moe(h[0], w, k, norm), atol=1e-4, rtol=1e-4)
    real = int(mask.sum())
    assert float(stats.tokens) == real
    assert float(stats.expert_tokens.sum()) == real * k  # every real token reaches exactly k experts
    np.testing.assert_allclose(float(stats.router_probs.sum()), real, rtol=1e-5)


def test_layer_kinds_follow_hf_rule_and_stack_per_kind():
    cfg = _cfg(n_layers=6, decoder_sparse_step=2, mlp_only_layers=(3,))
    assert cfg.moe_layers == (False, True, False, False, False, True)
    hf = transformers.Qwen3MoeConfig(num_hidden_layers=6, decoder_sparse_step=2, mlp_only_layers=[3], num_experts=4)
    model = transformers.Qwen3MoeModel.__new__(transformers.Qwen3MoeModel)  # the rule only, nothing built
    del model
    hf_kinds = tuple(i not in hf.mlp_only_layers and (i + 1) % hf.decoder_sparse_step == 0 for i in range(6))
    assert cfg.moe_layers == hf_kinds
    layers = Transformer(cfg, rngs=nnx.Rngs(0)).arrays()["layers"]
    assert layers["gate"].shape == (4, 32, 64) and layers["expert_gate"].shape == (2, 4, 32, 16)
    assert layers["router"].shape == (2, 32, 4) and layers["q"].shape[0] == 6
    with pytest.raises(ValueError, match="num_experts_per_tok"):
        _cfg(num_experts_per_tok=5)
    with pytest.raises(ValueError, match="qwen3_moe"):
        get_model_config("qwen3-tiny", num_experts=4, num_experts_per_tok=2, moe_intermediate_size=8)


def test_qwen3_30b_a3b_preset_counts():
    cfg = get_model_config("qwen3-30b-a3b")
    assert (cfg.n_layers, cfg.num_experts, cfg.num_experts_per_tok, cfg.vocab_size) == (48, 128, 8, 151_936)
    assert all(cfg.moe_layers)
    assert 30.4e9 < cfg.num_params() < 30.6e9  # "30.5B"
    assert 3.2e9 < cfg.num_params(active=True) < 3.4e9  # "3.3B activated"
    back = config_from_hf(config_to_hf(cfg), dtype=cfg.dtype, remat=cfg.remat)
    assert back == cfg
    hf_cfg = transformers.AutoConfig.for_model(**config_to_hf(cfg))
    assert (hf_cfg.num_experts, hf_cfg.moe_intermediate_size) == (128, 768)
    bench, dense = get_model_config("bench-moe"), get_model_config("bench")
    assert bench.num_params(active=True) - dense.num_params() == bench.n_layers * bench.d_model * bench.num_experts


# ---------------------------------------------------------------------------------------------------
# HF import / export


def _hf_moe(**kw):
    torch.manual_seed(0)
    cfg = transformers.Qwen3MoeConfig(vocab_size=96, hidden_size=32, intermediate_size=64, moe_intermediate_size=16,
                                      num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                                      num_experts=4, num_experts_per_tok=2, norm_topk_prob=True,
                                      mlp_only_layers=[1], max_position_embeddings=64, rope_theta=1_000_000.0,
                                      attn_implementation="eager", **kw)
    model = transformers.Qwen3MoeForCausalLM(cfg)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(1.0 + 0.2 * torch.randn_like(p))
            else:
                p.copy_(torch.randn_like(p) / np.sqrt(p.shape[-1]))
    return model.eval().float()


def _hf_out(model, tok, mask=None):
    with torch.no_grad():
        return model(input_ids=torch.as_tensor(tok, dtype=torch.long),
                     attention_mask=None if mask is None else torch.as_tensor(mask, dtype=torch.long),
                     output_router_logits=True)


def _tokens(B=2, T=10, seed=0):
    rng = np.random.default_rng(seed)
    tok = rng.integers(0, 96, (B, T)).astype(np.int32)
    return tok, np.broadcast_to(np.arange(T, dtype=np.int32), (B, T)).copy()


def test_import_matches_transformers_and_export_round_trips(tmp_path):
    hf = _hf_moe()
    hf.save_pretrained(tmp_path / "hf")
    tok, pos = _tokens()
    mask = np.ones(tok.shape, bool)
    mask[1, 6:] = False
    ref = _hf_out(hf, tok, mask)

    model = load_hf(tmp_path / "hf")
    assert model.cfg.family == "qwen3_moe" and model.cfg.moe_layers == (True, False, True)
    logits, _, stats = jax.jit(lambda t, p, m: model(t, p, attention_mask=m, router_stats=True))(tok, pos, mask)
    diff = np.abs(np.asarray(logits) - ref.logits.numpy())[mask].max()
    assert diff < TOL, diff
    # The load-balancing loss over the real tokens is HF's (``output_router_logits``, padding masked).
    ours_aux = float(load_balancing_loss(stats, model.cfg.num_experts))
    assert abs(ours_aux - float(ref.aux_loss)) < 1e-5, (ours_aux, float(ref.aux_loss))

    save_hf(model, tmp_path / "ours")
    hf2 = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "ours", attn_implementation="eager",
                                                            dtype=torch.float32)
    assert type(hf2) is transformers.Qwen3MoeForCausalLM
    ref2 = _hf_out(hf2.eval(), tok, mask)
    assert np.abs(ref2.logits.numpy() - ref.logits.numpy())[mask].max() < TOL
    again = load_hf(tmp_path / "ours")
    jax.tree.map(lambda a, b: np.testing.assert_array_equal(np.asarray(a), np.asarray(b)),
                 nnx.state(again, nnx.Param), nnx.state(model, nnx.Param))


def test_routing_metrics_by_hand():
    stats = RouterStats(jnp.array([6.0, 2.0, 0.0, 0.0]), jnp.array([2.0, 1.0, 0.5, 0.5]), jnp.array(4.0))
    m = routing_metrics(stats)
    assert [float(m[f"router_share_e{i}"]) for i in range(4)] == [0.75, 0.25, 0.0, 0.0]
    assert float(m["router_load_max_over_mean"]) == 3.0
    # 4 * (6/4 * 2/4 + 2/4 * 1/4) = 3.5
    assert abs(float(load_balancing_loss(stats, 4)) - 3.5) < 1e-6


# ---------------------------------------------------------------------------------------------------
# Expert parallelism and decoding


@pytest.mark.parametrize("shape", [{"data": 2, "expert": 4}, {"fsdp": 2, "tensor": 2, "expert": 2}])
def test_expert_parallel_forward_and_gradient_equal_single_device(shape):
    cfg = _cfg(n_layers=2)
    ref = Transformer(cfg, rngs=nnx.Rngs(3))
    rng = np.random.default_rng(1)
    tok = jnp.asarray(rng.integers(0, cfg.vocab_size, (4, 6)), jnp.int32)
    pos = jnp.broadcast_to(jnp.arange(6, dtype=jnp.int32), (4, 6))
    mask = jnp.asarray(np.arange(6)[None] < np.array([6, 4, 5, 2])[:, None])

    def loss(model):
        logits, _, stats = model(tok, pos, attention_mask=mask, router_stats=True)
        return jnp.mean(jnp.where(mask[..., None], logits, 0.0) ** 2) + load_balancing_loss(stats, cfg.num_experts)

    run = nnx.jit(nnx.value_and_grad(loss))
    ref_loss, ref_grad = run(ref)
    sharded = shard_model(ref, make_mesh(shape))
    assert sharded.layers.expert_gate[...].sharding.spec[1] == "expert"
    sh_loss, sh_grad = run(sharded)
    assert abs(float(sh_loss) - float(ref_loss)) < TOL
    for a, b in zip(jax.tree.leaves(sh_grad), jax.tree.leaves(ref_grad), strict=True):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=TOL, rtol=1e-4)


def test_cached_decode_equals_full_forward():
    cfg = dataclasses.replace(_cfg(n_layers=3, mlp_only_layers=(0,)), scan_layers=True)
    model = Transformer(cfg, rngs=nnx.Rngs(0))
    call = nnx.jit(lambda m, tok, pos, **kw: m(tok, pos, **kw))  # three programs, not the model op by op
    tok, pos = _tokens(T=8)
    full = call(model, jnp.asarray(tok), jnp.asarray(pos))[0]
    _, cache = call(model, jnp.asarray(tok[:, :5]), jnp.asarray(pos[:, :5]), cache=model.init_cache(2, 8),
                    cache_index=jnp.int32(0))
    steps = []
    for t in range(5, 8):
        logits, cache = call(model, jnp.asarray(tok[:, t:t + 1]), jnp.asarray(pos[:, t:t + 1]), cache=cache,
                             cache_index=jnp.int32(t))
        steps.append(logits)
    np.testing.assert_allclose(np.asarray(jnp.concatenate(steps, 1)), np.asarray(full[:, 5:]), atol=TOL)


# ---------------------------------------------------------------------------------------------------
# RL on an MoE agent: sampler and train step agree; the router loss in the step


def test_sampler_logprobs_are_the_train_steps_and_router_loss_is_added():
    from mgrpo_jax.agent.state import create_agent_state, model_from_state
    from mgrpo_jax.agent.step import make_policy_step
    from mgrpo_jax.sampling import Sampler
    from tests.rl.test_behaviour_logprobs import on_policy_batch

    sgd = optax.sgd(1.0)
    cfg = _cfg(vocab_size=64, n_layers=3, mlp_only_layers=(1,))
    mesh = make_mesh({"data": 2, "expert": 4})
    g, state, sharding = create_agent_state(cfg, sgd, mesh, seed=5)
    assert state.params["layers"]["expert_up"].sharding.spec[1] == "expert"
    batch = on_policy_batch(Sampler(model_from_state(g, state), pad_id=0), 1.0, seed=0, rows=4, max_new=8,
                            seq_len=24)

    metrics = {}
    for coef in (0.0, 0.5):
        step = make_policy_step(g, sgd, "grpo", {}, sharding, mesh, donate=False, router_aux_loss_coef=coef)
        metrics[coef] = jax.device_get(step(state, batch)[1])
    m = metrics[0.5]
    assert m["tokens"] > 0 and m["skipped"] == 0
    assert m["ratio_min"] == pytest.approx(1.0, abs=1e-5) and m["ratio_max"] == pytest.approx(1.0, abs=1e-5)
    # Uniform routing gives k; the tiny random router is near it.
    assert 1.9 < m["router_aux_loss"] < 3.0
    assert m["loss"] - metrics[0.0]["loss"] == pytest.approx(0.5 * m["router_aux_loss"], rel=1e-4)
    shares = [m[f"router_share_e{i}"] for i in range(cfg.num_experts)]
    assert sum(shares) == pytest.approx(1.0, abs=1e-5)
    assert m["router_load_max_over_mean"] == pytest.approx(max(shares) * cfg.num_experts, rel=1e-5)


def test_smoke_config_takes_moe_agents_and_validates_the_router_coefficient():
    from mgrpo_jax.config import get_config, validate

    c = get_config("xbench", "smoke")
    c.main.model = c.sub.model = "qwen3-moe-tiny"
    assert c.main.router_aux_loss_coef is None  # the model's own
    c.sub.router_aux_loss_coef = 0.01
    validate(c)
    c.sub.router_aux_loss_coef = -1.0
    with pytest.raises(ValueError, match="sub.router_aux_loss_coef"):
        validate(c)


@settings(max_examples=10, deadline=None)
@given(tokens=st.integers(1, 12), k=st.integers(1, 3), shards=st.sampled_from([1, 2, 4]),
       tile=st.sampled_from([1, 2, 4, 8]), seed=st.integers(0, 2**16))
def test_tiled_experts_equal_each_pair_through_its_expert_with_gradients(tokens, k, shards, tile, seed):
    """Any routing (empty experts, every pair on one expert), tile and share of the experts (one device's of an
    expert axis): each pair's output is its token through its own expert's SwiGLU, 0 for other devices' experts;
    the gradients of tokens and local weights agree too."""
    from mgrpo_jax.model.moe import tile_layout, tiled_experts

    E = 4
    kx, kw, ke, kc, kf = jax.random.split(jax.random.key(seed), 5)
    x = jax.random.normal(kx, (tokens, 3))
    gate, up, down = (jax.random.normal(kk, shape) for kk, shape in
                      zip(jax.random.split(kw, 3), [(E, 3, 5), (E, 3, 5), (E, 5, 3)], strict=True))
    skewed = jax.random.bernoulli(kf)  # half the examples route every pair to one expert
    experts = jnp.where(skewed, 1, jax.random.randint(ke, (tokens * k,), 0, E)).astype(jnp.int32)
    n_local = E // shards
    first = int(jax.random.randint(kf, (), 0, shards)) * n_local
    c = jax.random.normal(kc, (tokens * k, 3))
    local = slice(first, first + n_local)

    def tiled(x, gate, up, down):
        layout = tile_layout(experts, n_local, first, tile)
        return tiled_experts(x, layout, k, gate[local], up[local], down[local])

    def per_pair(x, gate, up, down):
        xp, e = jnp.repeat(x, k, axis=0), experts
        h = jax.nn.silu(jnp.einsum("pd,pdf->pf", xp, gate[e])) * jnp.einsum("pd,pdf->pf", xp, up[e])
        y = jnp.einsum("pf,pfd->pd", h, down[e])
        return jnp.where(((e >= first) & (e < first + n_local))[:, None], y, 0)

    @jax.jit  # one program per example
    def values_and_gradients(*args):
        def with_gradients(f):
            return f(*args), *jax.grad(lambda *a: jnp.sum(f(*a) * c), (0, 1, 2, 3))(*args)

        return [with_gradients(tiled), with_gradients(per_pair)]

    for a, b in zip(*values_and_gradients(x, gate, up, down), strict=True):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=1e-5)


def test_tiles_and_ragged_dot_blocks_agree_and_auto_picks_tiles_on_cpu():
    from mgrpo_jax.model.moe import matmul_method

    cfg = _cfg(moe_matmul="tiles", n_layers=1)
    assert matmul_method(dataclasses.replace(cfg, moe_matmul="auto"), None) == "tiles"  # tests run on the CPU
    tiles = Transformer(cfg, rngs=nnx.Rngs(2))
    ragged = Transformer(dataclasses.replace(cfg, moe_matmul="ragged_dot"), rngs=nnx.Rngs(2))
    tok, pos = _tokens(T=12)
    call = nnx.jit(lambda m, tok, pos: m(tok, pos)[0])
    np.testing.assert_allclose(np.asarray(call(tiles, jnp.asarray(tok), jnp.asarray(pos))),
                               np.asarray(call(ragged, jnp.asarray(tok), jnp.asarray(pos))), atol=TOL)


def test_paper_preset_is_qwen3_30b_a3b_with_an_expert_axis_and_paper_dense_keeps_8b():
    from mgrpo_jax.bench.plan import paper_plan

    moe, dense = paper_plan("sub", "paper"), paper_plan("sub", "paper_dense")
    assert moe.model.num_experts == 128 and moe.model.n_layers == 48 and moe.model.vocab_size == 151_936
    assert moe.mesh["expert"] == 8 and dense.mesh.get("expert", 1) == 1
    assert dense.model.num_experts == 0 and dense.model.d_model == 4096


def test_paper_scale_moe_traces_abstractly_on_an_expert_mesh():
    """Shape-check Qwen3-30B-A3B end to end on an fsdp x expert mesh (abstract: nothing allocated or compiled)."""
    from mgrpo_jax.model import abstract_model

    cfg = get_model_config("qwen3-30b-a3b")
    mesh = make_mesh({"fsdp": 2, "expert": 4})
    graphdef, state = abstract_model(cfg, mesh)
    assert state["layers"]["expert_down"].sharding.spec == jax.sharding.PartitionSpec(None, "expert", None, "fsdp")
    tok = jax.ShapeDtypeStruct((2, 16), jnp.int32)

    def fwd(state, tok):
        model = nnx.merge(graphdef, state)
        pos = jnp.broadcast_to(jnp.arange(16), (2, 16))
        return model(tok, pos, router_stats=True)

    logits, _, stats = jax.eval_shape(fwd, state, tok)
    assert logits.shape == (2, 16, cfg.vocab_size) and stats.expert_tokens.shape == (128,)


def test_token_chunks_give_the_same_values_statistics_and_gradients():
    cfg = _cfg(n_layers=1)
    chunked = dataclasses.replace(cfg, moe_chunk=4)
    tok, pos = _tokens(T=8)
    mask = np.ones(tok.shape, bool)
    mask[1, 5:] = False
    whole, parts = Transformer(cfg, rngs=nnx.Rngs(4)), Transformer(chunked, rngs=nnx.Rngs(4))

    def loss(model):
        logits, _, stats = model(jnp.asarray(tok), jnp.asarray(pos), attention_mask=jnp.asarray(mask),
                                 router_stats=True)
        return jnp.sum(logits[..., :4] ** 2) + load_balancing_loss(stats, cfg.num_experts), stats

    grad = nnx.jit(nnx.value_and_grad(loss, has_aux=True))  # one program per model, not the ops one by one
    (l1, s1), g1 = grad(whole)
    (l2, s2), g2 = grad(parts)
    assert abs(float(l1) - float(l2)) < 1e-4 and float(s2.tokens) == mask.sum()
    np.testing.assert_allclose(np.asarray(s1.expert_tokens), np.asarray(s2.expert_tokens))
    for a, b in zip(jax.tree.leaves(g1), jax.tree.leaves(g2), strict=True):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=1e-4, rtol=1e-4)
