"""Per-agent train state: a pytree of ``(step, params, opt_state)`` born sharded on that agent's mesh.

Each agent (main, sub) owns its own ``AgentState``, optimizer and mesh; nothing is shared. The Flax NNX
*graph definition* (module structure, config, mesh rules) is static and kept outside the state::

    graphdef, state, sharding = create_agent_state(model_cfg, optim_cfg, mesh, rules, seed=0)
    model = nnx.merge(graphdef, state.params)        # a Transformer view, e.g. for evaluation

- ``state.step``: int32 scalar, number of train-step calls made on this state;
- ``state.params``: the ``nnx.State`` of the model (every variable is an ``nnx.Param``), exactly what
  ``nnx.split(model)`` returns, so ``nnx.merge(graphdef, state.params)`` rebuilds the model;
- ``state.opt_state``: the optax state of that optimizer.

``sharding`` is an ``AgentState`` of ``NamedSharding``s (parameters by the logical rules, optimizer moments
like their parameters, counters replicated); train steps use it as in/out shardings and checkpoints
restore into it (also on a different mesh: build the abstract target with ``abstract_agent_state`` there).

**Handing weights to the sampler.** The sampler (``mgrpo_jax.sampling.Sampler``) takes the parameters as
an *argument* of its jitted generate function, so new weights never trigger a recompile as long as their
shapes, dtypes and shardings are unchanged (they are: the train step's out_shardings equal its
in_shardings). After every update::

    sampler.update_weights(params_for_sampling(state))

The train step *donates* its input state, so the buffers of the previous parameters are invalid after
the next step: always update the sampler after each step before sampling again (the synchronous loop
does), or pass ``copy=True`` to give the sampler its own copy (for a sampler that runs concurrently with
training).
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import optax
from flax import nnx, struct
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from mgrpo_jax.agent.optim import make_optimizer
from mgrpo_jax.model import (
    DEFAULT_RULES,
    MeshRules,
    Transformer,
    abstract_model,
    state_shardings,
)
from mgrpo_jax.model.lora import merge_adapters


@struct.dataclass
class AgentState:
    """One agent's train state (a pytree; the graphdef is kept outside, see module docstring)."""

    step: jax.Array
    params: Any
    opt_state: Any


def as_optimizer(optimizer_or_cfg) -> optax.GradientTransformation:
    """An optax transformation as is, or :func:`make_optimizer` of an optimizer config."""
    if hasattr(optimizer_or_cfg, "init") and hasattr(optimizer_or_cfg, "update"):
        return optimizer_or_cfg
    return make_optimizer(optimizer_or_cfg)


def opt_state_shardings(optimizer: optax.GradientTransformation, abstract_params, param_shardings,
                        mesh: Mesh):
    """Shardings of ``optimizer.init(params)``: every params-shaped subtree (Adam moments, ...) like the
    parameters, everything else (counters, injected hyper-parameters) replicated."""
    replicated = NamedSharding(mesh, PartitionSpec())
    abs_opt = jax.eval_shape(optimizer.init, abstract_params)
    pdef = jax.tree.structure(abstract_params)
    pshapes = [x.shape for x in jax.tree.leaves(abstract_params)]

    def is_params_like(x):
        return (jax.tree.structure(x) == pdef
                and [getattr(a, "shape", None) for a in jax.tree.leaves(x)] == pshapes)

    def f(x):
        if is_params_like(x) and pdef.num_leaves > 1:
            return param_shardings
        return jax.tree.map(lambda _: replicated, x)

    return jax.tree.map(f, abs_opt, is_leaf=is_params_like)


def _strip(abstract_params):
    return jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype), abstract_params)


def agent_state_sharding(optimizer, abstract_params, mesh: Mesh, rules=DEFAULT_RULES) -> AgentState:
    """``AgentState`` of NamedShardings for these (abstract) parameters on ``mesh``."""
    pshard = state_shardings(abstract_params, mesh, tuple(rules))
    return AgentState(
        step=NamedSharding(mesh, PartitionSpec()),
        params=pshard,
        opt_state=opt_state_shardings(optimizer, _strip(abstract_params), pshard, mesh),
    )


def abstract_agent_state(model_cfg, optimizer_or_cfg, mesh: Mesh, rules: Sequence = DEFAULT_RULES):
    """``(graphdef, abstract AgentState of ShapeDtypeStructs with shardings, sharding)`` — no memory used.

    The abstract state is the restore target of :class:`mgrpo_jax.runtime.checkpoint.Checkpointer`; build it
    on whatever mesh the restored state should live on.
    """
    rules = tuple(rules)
    optimizer = as_optimizer(optimizer_or_cfg)
    graphdef, abs_params = abstract_model(model_cfg, mesh, rules)
    abs_params = _strip(abs_params)
    sharding = agent_state_sharding(optimizer, abs_params, mesh, rules)
    abs_state = AgentState(step=jax.ShapeDtypeStruct((), jnp.int32), params=abs_params,
                           opt_state=jax.eval_shape(optimizer.init, abs_params))
    abs_state = jax.tree.map(lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s),
                             abs_state, sharding)
    return graphdef, abs_state, sharding


def create_agent_state(model_cfg, optimizer_or_cfg, mesh: Mesh, rules: Sequence = DEFAULT_RULES,
                       seed: int | jax.Array = 0):
    """A freshly initialised agent: ``(graphdef, state, state_sharding)``, created directly sharded.

    One jitted init with ``out_shardings`` builds the parameters and the optimizer state, so each device
    only materialises its own shards. ``optimizer_or_cfg``: an optimizer config (see ``optim.py``) or an
    optax transformation. The parameter values depend on ``seed`` only, not on the mesh.
    """
    rules = tuple(rules)
    optimizer = as_optimizer(optimizer_or_cfg)
    graphdef, _, sharding = abstract_agent_state(model_cfg, optimizer, mesh, rules)
    mr = MeshRules(mesh, rules)
    key = seed if isinstance(seed, jax.Array) else jax.random.key(int(seed))

    def init(k):
        params = nnx.state(Transformer(model_cfg, rngs=nnx.Rngs(k), mesh_rules=mr))
        return AgentState(step=jnp.zeros((), jnp.int32), params=params, opt_state=optimizer.init(params))

    state = jax.jit(init, out_shardings=sharding)(key)
    return graphdef, state, sharding


def create_agent_state_from_params(model_cfg, params, optimizer_or_cfg, mesh: Mesh,
                                   rules: Sequence = DEFAULT_RULES, step: int = 0):
    """An agent whose parameters come from elsewhere (an imported checkpoint, another agent, a stage-1 run).

    ``params``: an ``nnx.State`` of a ``Transformer`` with this config (e.g. ``nnx.split(model)[1]``) or
    its pure nested dict (``nnx.to_pure_dict``). Values are placed on ``mesh`` by the rules (a copy: the
    inputs stay valid) and a fresh optimizer state is created there. Returns
    ``(graphdef, state, state_sharding)``; the graphdef carries this mesh's rules.
    """
    rules = tuple(rules)
    optimizer = as_optimizer(optimizer_or_cfg)
    graphdef, abs_state, sharding = abstract_agent_state(model_cfg, optimizer, mesh, rules)
    if not isinstance(params, nnx.State):
        target = jax.tree.map(lambda a: a, abs_state.params)
        nnx.replace_by_pure_dict(target, params)
        params = target
    if jax.tree.structure(params) != jax.tree.structure(abs_state.params):
        raise ValueError("params do not match the structure of a Transformer with this config")
    for got, want in zip(jax.tree.leaves(params), jax.tree.leaves(abs_state.params), strict=True):
        if tuple(got.shape) != tuple(want.shape):
            raise ValueError(f"parameter shape {got.shape} != expected {want.shape}")

    params = jax.device_put(jax.tree.map(lambda x, a: jnp.asarray(x, a.dtype), params, abs_state.params),
                            sharding.params)

    def init(p):
        return AgentState(step=jnp.asarray(step, jnp.int32), params=p, opt_state=optimizer.init(p))

    state = jax.jit(init, out_shardings=sharding)(params)
    return graphdef, state, sharding


@jax.jit
def _copy(tree):
    return jax.tree.map(jnp.copy, tree)


def params_for_sampling(state: AgentState, copy: bool = False):
    """The parameters to hand to the sampler after an update (see the module docstring).

    ``copy=False`` returns ``state.params`` itself (valid until the next train step donates it);
    ``copy=True`` returns fresh buffers with the same shardings (safe to keep across train steps).
    """
    return _copy(state.params) if copy else state.params


def model_from_state(graphdef, state: AgentState) -> Transformer:
    """The ``Transformer`` view of an agent's current parameters (shares the buffers)."""
    return nnx.merge(graphdef, state.params)


# ---------------------------------------------------------------------------------------------------
# LoRA agents: the state trains the adapters only; the base is a separate, frozen, never-donated pytree.
#
#     graphdef, state, sharding, base = create_lora_agent_state(model_cfg, spec, optim_cfg, mesh, rules, seed=0)
#     model = nnx.merge(graphdef, state.params, base)         # base + adapters (a LoRA Transformer)
#
# ``state.params`` holds the ``nnx.LoRAParam`` factors (float32), so gradients, optimizer moments and
# checkpoints cover the adapters only. ``base`` is exactly a plain ``Transformer``'s state (same paths, in
# ``param_dtype``): the KL reference (adapters off) and, merged with the adapters, the sampler's weights.


def split_lora(state):
    """``(adapters, base)`` of a LoRA Transformer's ``nnx.State``."""
    return nnx.filter_state(state, nnx.LoRAParam, nnx.Param)


def abstract_lora_agent_state(model_cfg, spec, optimizer_or_cfg, mesh: Mesh, rules: Sequence = DEFAULT_RULES):
    """``(graphdef, abstract AgentState of the adapters, its sharding, the base's sharding)`` — no memory used."""
    rules = tuple(rules)
    optimizer = as_optimizer(optimizer_or_cfg)
    graphdef, abs_all = abstract_model(model_cfg, mesh, rules, lora=spec)
    abs_adapters, abs_base = split_lora(_strip(abs_all))
    sharding = agent_state_sharding(optimizer, abs_adapters, mesh, rules)
    abs_state = AgentState(step=jax.ShapeDtypeStruct((), jnp.int32), params=abs_adapters,
                           opt_state=jax.eval_shape(optimizer.init, abs_adapters))
    abs_state = jax.tree.map(lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s), abs_state, sharding)
    return graphdef, abs_state, sharding, state_shardings(abs_base, mesh, rules)


def create_lora_agent_state(model_cfg, spec, optimizer_or_cfg, mesh: Mesh, rules: Sequence = DEFAULT_RULES,
                            seed: int | jax.Array = 0, base_params=None, step: int = 0):
    """A LoRA agent: ``(graphdef, state, state_sharding, base)``, born sharded.

    The base is ``base_params`` (a plain ``Transformer``'s ``nnx.State`` or pure dict: an imported checkpoint,
    a warm-started policy), placed by the rules in ``param_dtype``, or else the seed's initialisation (the
    values a plain ``create_agent_state`` with that seed has). The adapters come from the seed (B = 0, so the
    agent starts as its base) with a fresh optimizer state."""
    rules = tuple(rules)
    optimizer = as_optimizer(optimizer_or_cfg)
    graphdef, _, sharding, base_sharding = abstract_lora_agent_state(model_cfg, spec, optimizer, mesh, rules)
    mr = MeshRules(mesh, rules)
    key = seed if isinstance(seed, jax.Array) else jax.random.key(int(seed))

    def init(k):
        adapters, base = split_lora(nnx.state(Transformer(model_cfg, rngs=nnx.Rngs(k), mesh_rules=mr, lora=spec)))
        return AgentState(step=jnp.asarray(step, jnp.int32), params=adapters,
                          opt_state=optimizer.init(adapters)), base

    if base_params is None:
        state, base = jax.jit(init, out_shardings=(sharding, base_sharding))(key)
    else:  # the random base is dead code under jit: only the adapters are computed
        state = jax.jit(lambda k: init(k)[0], out_shardings=sharding)(key)
        _, base, _ = create_agent_state_from_params(model_cfg, base_params, optax.identity(), mesh, rules)
        base = base.params
    return graphdef, state, sharding, base


def reset_lora_optimizer(state: AgentState, sharding: AgentState, optimizer_or_cfg) -> AgentState:
    """``(state, sharding)``: the same adapters under a fresh optimizer state of ``optimizer_or_cfg`` (warm
    start -> RL)."""
    optimizer = as_optimizer(optimizer_or_cfg)
    shard = agent_state_sharding(optimizer, _strip(state.params), sharding.step.mesh)
    shard = AgentState(step=shard.step, params=sharding.params, opt_state=shard.opt_state)
    fresh = jax.jit(lambda p: AgentState(step=jnp.zeros((), jnp.int32), params=p, opt_state=optimizer.init(p)),
                    out_shardings=shard)
    return fresh(_copy(state.params)), shard


@functools.partial(jax.jit, static_argnums=(2,))
def merged_params(adapters, base, scale: float):
    """A plain ``Transformer``'s state: ``base`` with every adapter folded in (``W + scale A B``, ``W``'s dtype)."""
    layers = {n: v[...] for n, v in base["layers"].items()}
    folded = merge_adapters(layers, {n: v[...] for n, v in adapters["layers"].items()}, scale)
    out = jax.tree.map(lambda x: x, base)
    for name, value in folded.items():
        out["layers"][name] = out["layers"][name].replace(value)
    return out
