"""Learning-rate schedules, the optimizer's clipping / weight decay, and sharded agent states."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

from mgrpo_jax.agent.optim import current_lr, default_optim_config, lr_schedule, make_optimizer
from mgrpo_jax.agent.state import abstract_agent_state, create_agent_state, create_agent_state_from_params
from mgrpo_jax.model import Transformer


def test_schedules():
    cos = lr_schedule(default_optim_config(lr=1.0, warmup_steps=4, decay="cosine", total_steps=14,
                                           end_lr_ratio=0.1))
    np.testing.assert_allclose([float(cos(s)) for s in range(4)], [0.25, 0.5, 0.75, 1.0])
    assert float(cos(4)) == pytest.approx(1.0)
    assert float(cos(9)) == pytest.approx(0.55)  # half-way through the decay
    assert float(cos(14)) == pytest.approx(0.1) and float(cos(100)) == pytest.approx(0.1)
    lin = lr_schedule(default_optim_config(lr=2.0, decay="linear", total_steps=10))
    assert [float(lin(s)) for s in (0, 5, 10)] == pytest.approx([2.0, 1.0, 0.0])
    const = lr_schedule(default_optim_config(lr=3e-4, warmup_steps=0, decay="constant"))
    assert float(const(0)) == pytest.approx(3e-4) and float(const(10**6)) == pytest.approx(3e-4)
    with pytest.raises(ValueError):
        lr_schedule(default_optim_config(decay="step"))


def test_optimizer_clips_decays_and_reports_lr():
    params = {"w": jnp.ones((3, 3)), "attn_norm": jnp.ones((3,))}
    cfg = default_optim_config(lr=0.1, grad_clip_norm=1.0, weight_decay=0.5, b1=0.0, b2=0.0, eps=1e-12)
    tx = make_optimizer(cfg)
    state = tx.init(params)
    grads = {"w": jnp.full((3, 3), 100.0), "attn_norm": jnp.zeros((3,))}
    updates, state = tx.update(grads, state, params)
    # Adam with b1 = b2 = 0 gives sign(g); decay 0.5 * w on the matrix only (norms are not decayed).
    np.testing.assert_allclose(updates["w"], -0.1 * (1.0 + 0.5), rtol=1e-6)
    np.testing.assert_allclose(updates["attn_norm"], 0.0)
    assert float(current_lr(state)) == pytest.approx(0.1)
    assert np.isnan(float(current_lr(optax.sgd(0.1).init(params))))
    # Stages: clip, adam, decay, lr — the clip and the decay stages are dropped when disabled.
    assert len(tx.init(params)) == 4
    assert len(make_optimizer(default_optim_config(grad_clip_norm=None)).init(params)) == 2


def test_agent_state_is_born_sharded_and_reloads_on_another_mesh(tiny_cfg, mesh8, mesh1):
    optim = default_optim_config(lr=1e-3, weight_decay=0.1)
    g, state, sharding = create_agent_state(tiny_cfg, optim, mesh8, seed=7)
    # Parameters by the rules, Adam moments like their parameters, counters replicated.
    assert state.params["layers"]["q"][...].sharding.spec == jax.sharding.PartitionSpec(None, "fsdp", "tensor")
    mu = state.opt_state[1].mu
    assert mu["layers"]["q"][...].sharding == state.params["layers"]["q"][...].sharding
    assert state.step.sharding.spec == jax.sharding.PartitionSpec()
    # Values depend on the seed only, not on the mesh.
    ref = nnx.state(Transformer(tiny_cfg, rngs=nnx.Rngs(jax.random.key(7))))
    np.testing.assert_array_equal(np.asarray(state.params["embed"][...]), np.asarray(ref["embed"][...]))
    # Abstract target (for checkpoints) matches the concrete state.
    _, abstract, _ = abstract_agent_state(tiny_cfg, optim, mesh8)
    assert jax.tree.structure(abstract) == jax.tree.structure(state)
    for a, s in zip(jax.tree.leaves(abstract), jax.tree.leaves(state), strict=True):
        assert a.shape == s.shape and a.dtype == s.dtype and a.sharding == s.sharding
    # From existing parameters (an nnx.State or a pure dict) onto a different mesh.
    for params in (state.params, nnx.to_pure_dict(state.params)):
        g1, s1, sh1 = create_agent_state_from_params(tiny_cfg, params, optim, mesh1, step=5)
        assert int(s1.step) == 5
        assert s1.params["embed"][...].sharding.mesh.size == 1
        np.testing.assert_array_equal(np.asarray(s1.params["layers"]["up"][...]),
                                      np.asarray(state.params["layers"]["up"][...]))
    with pytest.raises(ValueError):
        create_agent_state_from_params(tiny_cfg.__class__(**{**tiny_cfg.__dict__, "d_model": 32}),
                                       state.params, optim, mesh1)
