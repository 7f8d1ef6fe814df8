"""Sharding as config data: named mesh axes, logical axis names, rules that map one to the other.

Every parameter of ``Transformer`` carries a tuple of *logical* axis names in its ``logical_axes``
metadata (e.g. ``('layers', 'embed', 'q_heads', 'head_dim')``). Activations are constrained with
logical names too (``act_batch``, ``act_heads``, ...). A *rules* tuple of ``(logical, mesh_axes)``
pairs turns logical names into a ``PartitionSpec`` for a given mesh:

- ``mesh_axes`` is ``None`` (replicate), one mesh-axis name, or a tuple of names (sharded over their
  product);
- mesh axes the mesh lacks, of size 1, already used by an earlier dimension of the same array, or that
  do not divide the dimension, are dropped (so the same rules work on any mesh shape: a KV-head axis of
  size 2 is simply replicated on a 4-way ``tensor`` axis);
- logical names without a rule are replicated.

Rule sets are named (``RULE_SETS``, ``get_rules``): ``default`` (FSDP + tensor parallelism), ``fsdp``,
``tensor`` and ``data``; see each one's comment. Every set places the batch rows the same way (over
``data`` x ``fsdp`` x ``expert``: the train step shards its batches over ``data`` x ``fsdp`` and the model
splits them further over ``expert`` where the rows divide), so they differ in where the parameters live
and which activations are split over heads.

``make_mesh`` builds a mesh with ``Auto`` axis types (classic ``jax.jit`` + ``NamedSharding``) from any
device subset, so each agent gets its own mesh on disjoint devices. The functions that build a sharded
``Transformer`` (``abstract_model``, ``init_sharded``, ``shard_model``) live in ``transformer.py``: this
module is data and placement only, and imports nothing else of the model.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from typing import Any

import jax
import numpy as np
from flax import nnx
from jax.sharding import AxisType, Mesh, NamedSharding, PartitionSpec

MESH_AXES = ("data", "fsdp", "tensor", "expert")

# (logical name, mesh axes). Parameters: FSDP over the model dimension, Megatron-style tensor
# parallelism over heads / MLP hidden / vocab, experts over expert. Activations: batch over data x fsdp x expert
# (the expert axis also splits the rows outside the MoE blocks), heads over tensor.
DEFAULT_RULES: tuple[tuple[str, Any], ...] = (
    # parameters
    ("vocab", "tensor"),
    ("embed", "fsdp"),
    ("q_heads", "tensor"),
    ("kv_heads", "tensor"),
    ("head_dim", None),
    ("mlp", "tensor"),
    ("layers", None),
    ("norm", None),
    # mixture of experts: experts [E, ...] over ``expert`` (expert parallelism, mgrpo_jax/model/moe.py), each
    # expert's hidden units over ``tensor``; the router's [D, E] (small, read by every token) replicated
    ("experts", "expert"),
    ("expert_mlp", "tensor"),
    ("router", None),
    # activations
    ("act_batch", ("data", "fsdp", "expert")),
    ("act_seq", None),
    ("act_embed", None),
    ("act_heads", "tensor"),
    ("act_kv_heads", "tensor"),
    ("act_head_dim", None),
    ("act_mlp", "tensor"),
    ("act_vocab", "tensor"),
    # KV cache per layer: keys [batch, kv_heads, head_dim, slots], values [batch, kv_heads, slots, head_dim];
    # its mask [batch, slots]
    ("cache_batch", ("data", "fsdp", "expert")),
    ("cache_slots", None),
    ("cache_kv_heads", "tensor"),
    ("cache_head_dim", None),
)

Rules = tuple[tuple[str, Any], ...]


def _with(rules: Rules, **changes: Any) -> Rules:
    """``rules`` with the mesh axes of some logical names replaced (same names, same order)."""
    unknown = set(changes) - {name for name, _ in rules}
    if unknown:
        raise ValueError(f"no rule for {sorted(unknown)}")
    return tuple((name, changes.get(name, axes)) for name, axes in rules)


_NO_TENSOR = dict(vocab=None, q_heads=None, kv_heads=None, mlp=None, expert_mlp=None, act_heads=None,
                  act_kv_heads=None, act_mlp=None, act_vocab=None, cache_kv_heads=None)

# ZeRO-3 style: every parameter sharded over ``fsdp`` along the model dimension (gathered layer by layer
# where it is used), no tensor parallelism: activations and the KV cache keep whole heads, the MLP hidden
# and the vocabulary on every device. Meant for meshes whose ``tensor`` axis is 1 (where it places exactly
# as ``default`` does); a ``tensor`` axis > 1 would hold replicas.
FSDP_RULES: Rules = _with(DEFAULT_RULES, **_NO_TENSOR)

# Megatron-style tensor parallelism only: heads, MLP hidden and vocabulary over ``tensor``; parameters are
# whole along the model dimension, i.e. replicated over ``data`` and ``fsdp``, which both split the batch
# (no weight gathers per layer: the choice for a model that fits a ``tensor`` group, e.g. for decoding,
# where ``default`` gathers every FSDP-sharded weight again for each token).
TENSOR_RULES: Rules = _with(DEFAULT_RULES, embed=None)

# Plain data parallelism: every parameter and every head replicated, only the batch rows split (over
# ``data`` x ``fsdp``). For models small enough to hold on every device.
DATA_RULES: Rules = _with(FSDP_RULES, embed=None)

RULE_SETS: dict[str, Rules] = {
    "default": DEFAULT_RULES,
    "fsdp": FSDP_RULES,
    "tensor": TENSOR_RULES,
    "data": DATA_RULES,
}


def get_rules(name: str) -> Rules:
    """The rule set registered under ``name`` in ``RULE_SETS`` (e.g. from ``agent.sharding_rules``)."""
    try:
        return RULE_SETS[name]
    except (KeyError, TypeError):
        raise ValueError(f"unknown sharding rule set {name!r}; known: {', '.join(sorted(RULE_SETS))}") from None


def resolve_mesh_shape(shape: dict[str, int] | Sequence[tuple[str, int]], n: int) -> dict[str, int]:
    """``shape`` (axis name -> size, in order; one size may be ``-1``: the remaining devices) for ``n`` devices,
    every size given; a clear error when the sizes cannot cover exactly ``n``."""
    items = list(shape.items()) if isinstance(shape, dict) else list(shape)
    names = [name for name, _ in items]
    sizes = [int(s) for _, s in items]
    if sizes.count(-1) > 1:
        raise ValueError("at most one mesh axis may be -1")
    if -1 in sizes:
        known = math.prod(s for s in sizes if s != -1)
        if n % known:
            raise ValueError(f"{n} devices do not divide into known axes of product {known}")
        sizes[sizes.index(-1)] = n // known
    if math.prod(sizes) != n:
        raise ValueError(f"mesh {dict(zip(names, sizes, strict=True))} needs {math.prod(sizes)} devices, "
                         f"got {n}")
    return dict(zip(names, sizes, strict=True))


def make_mesh(shape: dict[str, int] | Sequence[tuple[str, int]], devices: Sequence[Any] | None = None,
              ) -> Mesh:
    """A mesh with named axes over ``devices`` (default: all), every axis ``AxisType.Auto``.

    ``shape`` maps axis name -> size in order, e.g. ``{'data': 2, 'fsdp': 2, 'tensor': 2}``; one size may
    be ``-1`` (fill with the remaining devices). The product must equal the number of devices given, so
    two agents can get meshes over disjoint subsets: ``make_mesh(s, jax.devices()[:4])`` and
    ``make_mesh(s, jax.devices()[4:])``.
    """
    devices = list(jax.devices() if devices is None else devices)
    resolved = resolve_mesh_shape(shape, len(devices))
    names, sizes = tuple(resolved), list(resolved.values())
    types = (AxisType.Auto,) * len(names)
    all_devices = jax.devices()
    if len(devices) == len(all_devices) and set(devices) == set(all_devices):
        # Let JAX pick a topology-aware device order (matters on TPU).
        return jax.make_mesh(tuple(sizes), names, axis_types=types, devices=devices)
    return Mesh(np.asarray(devices, dtype=object).reshape(sizes), names, axis_types=types)


def _rule_lookup(rules: Rules) -> dict[str, Any]:
    table: dict[str, Any] = {}
    for name, axes in rules:
        table.setdefault(name, axes)  # first rule wins
    return table


def logical_to_spec(logical_axes: Sequence[str | None], rules: Rules, mesh: Mesh | None = None,
                    shape: Sequence[int] | None = None) -> PartitionSpec:
    """PartitionSpec for an array whose dims have these logical names (see module docstring)."""
    table = _rule_lookup(rules)
    used: set[str] = set()
    out = []
    for i, name in enumerate(logical_axes):
        axes = table.get(name) if name is not None else None
        if axes is None:
            out.append(None)
            continue
        axes = (axes,) if isinstance(axes, str) else tuple(axes)
        kept = []
        size = 1
        for ax in axes:
            if ax in used:
                continue
            if mesh is not None:
                if ax not in mesh.shape or mesh.shape[ax] == 1:
                    continue
                if shape is not None and shape[i] % (size * mesh.shape[ax]):
                    continue
                size *= mesh.shape[ax]
            kept.append(ax)
        used.update(kept)
        out.append(None if not kept else kept[0] if len(kept) == 1 else tuple(kept))
    while out and out[-1] is None:
        out.pop()
    return PartitionSpec(*out)


@dataclasses.dataclass(frozen=True)
class MeshRules:
    """A mesh plus logical rules: what the model needs to place parameters and constrain activations."""

    mesh: Mesh
    rules: Rules = DEFAULT_RULES

    def spec(self, logical_axes, shape=None) -> PartitionSpec:
        return logical_to_spec(logical_axes, self.rules, self.mesh, shape)

    def sharding(self, logical_axes, shape=None) -> NamedSharding:
        return NamedSharding(self.mesh, self.spec(logical_axes, shape))

    def constrain(self, x: jax.Array, logical_axes) -> jax.Array:
        return jax.lax.with_sharding_constraint(x, self.sharding(logical_axes, x.shape))


def constrain(x: jax.Array, logical_axes, mesh_rules: MeshRules | None) -> jax.Array:
    """``with_sharding_constraint`` by logical names; a no-op without a mesh."""
    if mesh_rules is None:
        return x
    return mesh_rules.constrain(x, logical_axes)


def _var_logical_axes(v: nnx.Variable) -> tuple | None:
    return v.get_metadata().get("logical_axes")


def state_shardings(state: nnx.State, mesh: Mesh, rules: Rules = DEFAULT_RULES) -> nnx.State:
    """A NamedSharding for every variable of an (abstract or concrete) model state."""

    def f(v):
        axes = _var_logical_axes(v)
        spec = PartitionSpec() if axes is None else logical_to_spec(axes, rules, mesh, v.shape)
        return v.replace(NamedSharding(mesh, spec))

    return jax.tree.map(f, state, is_leaf=lambda x: isinstance(x, nnx.Variable))
