"""Sharding rules, per-agent meshes, directly-sharded init; sharded logits == single-device logits."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.sharding import PartitionSpec as P

from mgrpo_jax.model import (
    CACHE_AXES,
    DEFAULT_RULES,
    RULE_SETS,
    MeshRules,
    Transformer,
    abstract_model,
    cache_shape,
    cache_shardings,
    get_model_config,
    get_rules,
    init_sharded,
    logical_to_spec,
    make_mesh,
    shard_model,
)
from mgrpo_jax.model.transformer import PARAM_AXES

TOL = 1e-5


def _cfg(**kw):
    base = dict(vocab_size=96, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=8, mlp_dim=64)
    base.update(kw)
    return get_model_config("qwen3-tiny", **base)


@nnx.jit
def _forward(model, tokens, positions, mask):
    return model(tokens, positions, attention_mask=mask)[0]


@nnx.jit
def _step(model, tokens, positions, mask, cache, idx):
    return model(tokens, positions, attention_mask=mask, cache=cache, cache_index=idx)


def _inputs(cfg, B=8, T=8, seed=0):
    rng = np.random.default_rng(seed)
    tok = jnp.asarray(rng.integers(0, cfg.vocab_size, (B, T)), jnp.int32)
    pos = jnp.broadcast_to(jnp.arange(T, dtype=jnp.int32), (B, T))
    lens = rng.integers(1, T + 1, B)
    mask = jnp.asarray(np.arange(T)[None] < lens[:, None])
    return tok, pos, mask


def test_make_mesh_shapes_and_disjoint_subsets():
    devs = jax.devices()
    assert len(devs) == 8
    m = make_mesh({"data": 2, "fsdp": 2, "tensor": 2})
    assert dict(m.shape) == {"data": 2, "fsdp": 2, "tensor": 2}
    assert all(t == jax.sharding.AxisType.Auto for t in m.axis_types)
    a = make_mesh({"data": -1, "tensor": 2}, devs[:4])
    b = make_mesh({"fsdp": 4}, devs[4:])
    assert dict(a.shape) == {"data": 2, "tensor": 2}
    assert not set(a.devices.flat) & set(b.devices.flat)
    with pytest.raises(ValueError):
        make_mesh({"data": 3}, devs[:4])


def test_logical_rules_to_partition_specs():
    mesh = make_mesh({"data": 2, "fsdp": 2, "tensor": 2})
    assert logical_to_spec(("layers", "embed", "q_heads", "head_dim"), DEFAULT_RULES, mesh,
                           (2, 32, 4, 8)) == P(None, "fsdp", "tensor")
    # A dimension that the axis does not divide is replicated instead of failing.
    assert logical_to_spec(("layers", "embed", "kv_heads", "head_dim"), DEFAULT_RULES, mesh,
                           (2, 32, 1, 8)) == P(None, "fsdp")
    assert logical_to_spec(("act_batch", "act_seq", "act_embed"), DEFAULT_RULES, mesh,
                           (8, 5, 32)) == P(("data", "fsdp"))
    assert logical_to_spec(("act_batch",), DEFAULT_RULES, mesh, (2,)) == P("data")
    # An axis is used at most once per array; unknown names replicate; rules are plain data.
    rules = (("a", "tensor"), ("b", ("tensor", "data")))
    assert logical_to_spec(("a", "b", "zzz"), rules, mesh, (2, 2, 2)) == P("tensor", "data")
    # Axes missing from the mesh are dropped (same rules on a data-only mesh).
    small = make_mesh({"data": 8})
    assert logical_to_spec(("vocab", "embed"), DEFAULT_RULES, small, (96, 32)) == P()


def test_init_sharded_places_params_and_matches_unsharded_init():
    cfg = _cfg()
    mesh = make_mesh({"data": 2, "fsdp": 2, "tensor": 2})
    model = init_sharded(cfg, mesh, rng=3)
    q = model.layers.q[...]
    assert q.sharding.spec == P(None, "fsdp", "tensor")
    assert len(q.addressable_shards) == 8 and q.addressable_shards[0].data.shape == (2, 16, 2, 8)
    assert model.embed[...].sharding.spec == P("tensor", "fsdp")
    # Same values as a plain single-device init with the same key (mesh-independent init).
    ref = Transformer(cfg, rngs=nnx.Rngs(3))
    jax.tree.map(lambda a, b: np.testing.assert_array_equal(np.asarray(a), np.asarray(b)),
                 nnx.state(model, nnx.Param), nnx.state(ref, nnx.Param))
    _, abstract = abstract_model(cfg, mesh)
    assert abstract["layers"]["down"].sharding.spec == P(None, "tensor", "fsdp")


@pytest.mark.parametrize("shape", [{"data": 2, "fsdp": 2, "tensor": 2}, {"fsdp": 2, "tensor": 4}])
def test_sharded_logits_equal_single_device(shape):
    cfg = _cfg()
    ref_model = Transformer(cfg, rngs=nnx.Rngs(1))
    tok, pos, mask = _inputs(cfg)
    ref = _forward(ref_model, tok, pos, mask)
    model = shard_model(ref_model, make_mesh(shape))
    out = _forward(model, tok, pos, mask)
    assert len(out.sharding.device_set) == 8
    np.testing.assert_allclose(np.asarray(out), np.asarray(ref), atol=TOL, rtol=0)


def test_sharded_cache_decode_matches_full_forward():
    cfg = _cfg()
    mesh = make_mesh({"data": 2, "fsdp": 2, "tensor": 2})
    model = init_sharded(cfg, mesh, rng=2)
    tok, pos, _ = _inputs(cfg, B=4, T=6, seed=5)
    ones = jnp.ones(tok.shape, bool)
    ref = _forward(model, tok, pos, ones)
    cache = model.init_cache(4, 8)
    assert len(cache["k"]) == cfg.n_layers
    assert all(k.sharding.spec == P(("data", "fsdp"), "tensor") for k in cache["k"] + cache["v"])
    lg0, cache = _step(model, tok[:, :4], pos[:, :4], ones[:, :4], cache, jnp.int32(0))
    lg1, cache = _step(model, tok[:, 4:5], pos[:, 4:5], ones[:, 4:5], cache, jnp.int32(4))
    lg2, cache = _step(model, tok[:, 5:6], pos[:, 5:6], ones[:, 5:6], cache, jnp.int32(5))
    np.testing.assert_allclose(np.asarray(jnp.concatenate([lg0, lg1, lg2], 1)), np.asarray(ref), atol=TOL)


def test_two_agents_on_disjoint_device_subsets():
    cfg_main, cfg_sub = _cfg(), _cfg(d_model=48, n_layers=1)
    devs = jax.devices()
    main = init_sharded(cfg_main, make_mesh({"data": 2, "tensor": 2}, devs[:4]), rng=0)
    sub = init_sharded(cfg_sub, make_mesh({"data": 2, "tensor": 2}, devs[4:]), rng=1)
    tok, pos, mask = _inputs(cfg_main, B=4)
    out_main = _forward(main, tok, pos, mask)
    out_sub = _forward(sub, tok, pos, mask)
    assert out_main.sharding.device_set == set(devs[:4])
    assert out_sub.sharding.device_set == set(devs[4:])


@pytest.mark.parametrize("name", ["llama3-8b", "qwen3-8b", "gemma-7b"])
def test_paper_scale_forward_traces_abstractly_on_a_mesh(name):
    """Shape-check the 8B-class configs end to end (abstract: nothing is allocated or compiled)."""
    cfg = get_model_config(name)
    mesh = make_mesh({"data": 2, "fsdp": 2, "tensor": 2})
    graphdef, state = abstract_model(cfg, mesh)
    assert state["layers"]["gate"].sharding.spec == P(None, "fsdp", "tensor")
    tok = jax.ShapeDtypeStruct((2, 16), jnp.int32)

    def fwd(state, tok):
        model = nnx.merge(graphdef, state)
        cache = model.init_cache(2, 32)
        pos = jnp.broadcast_to(jnp.arange(16), (2, 16))
        return model(tok, pos, cache=cache, cache_index=0)

    logits, cache = jax.eval_shape(fwd, state, tok)
    assert logits.shape == (2, 16, cfg.vocab_size) and logits.dtype == jnp.float32
    assert len(cache["k"]) == len(cache["v"]) == cfg.n_layers
    assert all(k.shape == (2, cfg.n_kv_heads, cfg.head_dim, 32) for k in cache["k"])
    assert all(v.shape == (2, cfg.n_kv_heads, 32, cfg.head_dim) for v in cache["v"])
    assert all(k.dtype == jnp.bfloat16 for k in cache["k"])


# ---------------------------------------------------------------------------------------------------
# Named rule sets

# The logical names the model constrains its activations by (transformer.forward / block).
ACTIVATION_AXES = ("act_batch", "act_seq", "act_embed", "act_heads", "act_kv_heads", "act_head_dim", "act_mlp",
                   "act_vocab")


def test_rule_sets_by_name():
    assert get_rules("default") is DEFAULT_RULES
    assert set(RULE_SETS) >= {"default", "fsdp", "tensor", "data"}
    for name, rules in RULE_SETS.items():
        assert get_rules(name) is rules
    with pytest.raises(ValueError, match=r"'megatron'.*data, default, fsdp, tensor"):
        get_rules("megatron")


@pytest.mark.parametrize("name", sorted(RULE_SETS))
def test_rule_set_names_every_logical_axis_once(name):
    rules = RULE_SETS[name]
    names = [n for n, _ in rules]
    assert len(names) == len(set(names))
    used = {a for axes in PARAM_AXES.values() for a in axes} | {a for axes in CACHE_AXES.values() for a in axes}
    assert used | set(ACTIVATION_AXES) == set(names)
    # Batch rows are placed alike by every set (the train step shards its batches over data x fsdp).
    assert dict(rules)["act_batch"] == dict(rules)["cache_batch"] == ("data", "fsdp", "expert")


# Expected placement on the 2 x 2 x 2 mesh: q [L, D, H, Dh], down [L, F, D], embed [V, D], k cache entry.
ROWS = ("data", "fsdp")
EXPECTED = {
    "default": (P(None, "fsdp", "tensor"), P(None, "tensor", "fsdp"), P("tensor", "fsdp"), P(ROWS, "tensor")),
    "fsdp": (P(None, "fsdp"), P(None, None, "fsdp"), P(None, "fsdp"), P(ROWS)),
    "tensor": (P(None, None, "tensor"), P(None, "tensor"), P("tensor"), P(ROWS, "tensor")),
    "data": (P(), P(), P(), P(ROWS)),
}


@pytest.mark.parametrize("name", sorted(RULE_SETS))
def test_rule_set_gives_valid_shardings(name):
    """Every parameter and cache entry gets a NamedSharding that tiles its shape on the 8-device mesh."""
    rules = get_rules(name)
    cfg = _cfg()
    mesh = make_mesh({"data": 2, "fsdp": 2, "tensor": 2})
    _, state = abstract_model(cfg, mesh, rules)
    for leaf in jax.tree.leaves(state):
        assert isinstance(leaf.sharding, jax.sharding.NamedSharding) and leaf.sharding.mesh == mesh
        leaf.sharding.shard_shape(leaf.shape)  # raises unless the spec tiles the shape
    shapes, shardings = cache_shape(cfg, 4, 8), cache_shardings(cfg, 4, 8, MeshRules(mesh, rules))
    for leaf, sharding in zip(jax.tree.leaves(shapes), jax.tree.leaves(shardings), strict=True):
        sharding.shard_shape(leaf.shape)
    q, down, embed, k = EXPECTED[name]
    assert (state["layers"]["q"].sharding.spec, state["layers"]["down"].sharding.spec,
            state["embed"].sharding.spec, shardings["k"][0].spec) == (q, down, embed, k)


@pytest.mark.parametrize("name", sorted(RULE_SETS))
def test_sharded_forward_under_each_rule_set_equals_single_device(name):
    cfg = _cfg()
    ref_model = Transformer(cfg, rngs=nnx.Rngs(1))
    tok, pos, mask = _inputs(cfg, B=4, T=6, seed=7)
    ones = jnp.ones(tok.shape, bool)

    @nnx.jit
    def run(model):
        full = model(tok, pos, attention_mask=mask)[0]
        _, cache = model(tok[:, :5], pos[:, :5], attention_mask=ones[:, :5], cache=model.init_cache(4, 8),
                         cache_index=0)
        step = model(tok[:, 5:], pos[:, 5:], attention_mask=ones[:, 5:], cache=cache, cache_index=jnp.int32(5))
        return full, step[0]

    ref_full, ref_step = run(ref_model)
    full, step = run(shard_model(ref_model, make_mesh({"data": 2, "fsdp": 2, "tensor": 2}), get_rules(name)))
    assert len(full.sharding.device_set) == 8
    np.testing.assert_allclose(np.asarray(full), np.asarray(ref_full), atol=TOL, rtol=0)
    np.testing.assert_allclose(np.asarray(step), np.asarray(ref_step), atol=TOL, rtol=0)
