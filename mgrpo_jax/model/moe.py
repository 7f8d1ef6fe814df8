"""The mixture-of-experts feed-forward block of Qwen3-MoE, dropless, as grouped matmuls.

For tokens ``h [N, D]`` and one layer's ``router [D, E]``, ``expert_gate`` / ``expert_up [E, D, F]`` and
``expert_down [E, F, D]`` (HF ``Qwen3MoeSparseMoeBlock``; no shared expert)::

    p = softmax(h @ router)                      # float32
    w, e = top_k(p, k)                           # k experts per token; w / sum(w) when norm_topk_prob
    y[n] = sum_j w[n, j] * down_e(silu(gate_e(h[n])) * up_e(h[n]))   with e = e[n, j]

Every token reaches its k experts (no capacity, nothing dropped): the ``N k`` (token, expert) pairs are sorted
by expert and each expert's contiguous rows multiplied by its weights with ``jax.lax.ragged_dot`` (a grouped
matmul; per-expert row counts as the group sizes), then the rows are put back in token order and summed with
their weights. The work is that of ``N k`` tokens through one expert, not of every token through every expert.

XLA:CPU lowers ``ragged_dot`` to a masked product of every row with every group's matrix (``E`` times the
work), so on the CPU (``cfg.moe_matmul`` ``auto``, the platform of the mesh's devices) the same grouped product
is formed by :func:`tiled_ragged_dot`: each expert's rows padded to whole tiles, one batched matmul over the
tiles with each tile's expert matrix (same values; at most ``E (tile - 1)`` padding rows of extra work).

**Expert parallelism.** With an ``expert`` mesh axis (and the rules placing the ``experts`` logical axis on it,
``sharding.py``) each device holds ``E / n`` experts. The block then runs under ``shard_map`` over that axis
(the other mesh axes, FSDP and tensor, stay automatic). The token rows are split over the axis too (the batch
rules include it): each device gathers its group's tokens from the axis, routes them, multiplies the contiguous
run of sorted rows routed to its own experts, and the partial outputs are summed and scattered back to their
devices (``all_gather`` of ``[N, D]`` and ``psum_scatter`` of ``[N, D]`` per layer). Where the rows do not
divide over the axis they stay whole on every device of it and the outputs are summed (``psum``).

**Routing statistics** (``RouterStats``, per layer, over the real tokens of ``token_mask``): how many top-k
assignments each expert got, the sum of each expert's router probability, and the token count. Summed over
layers they give HF's ``load_balancing_loss_func`` (:func:`load_balancing_loss`) and the load metrics the train
step logs (:func:`routing_metrics`).
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec

from mgrpo_jax.model.config import ModelConfig
from mgrpo_jax.model.sharding import MeshRules

MOE_PARAMS = ("router", "expert_gate", "expert_up", "expert_down")  # one MoE layer's parameters
EXPERT_AXIS = "expert"  # the mesh axis of expert parallelism


class RouterStats(NamedTuple):
    """Routing counts over real tokens (float32): ``expert_tokens [E]`` top-k assignments per expert,
    ``router_probs [E]`` summed router probabilities, ``tokens []`` routed tokens (summed over layers: the
    rows of HF's pooled per-layer router logits)."""

    expert_tokens: jax.Array
    router_probs: jax.Array
    tokens: jax.Array


def route(h: jax.Array, router: jax.Array, cfg: ModelConfig) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Router probabilities ``[N, E]`` float32, the top-k weights ``[N, k]`` (renormalised when
    ``cfg.norm_topk_prob``) and expert ids ``[N, k]`` int32, for tokens ``h [N, D]``."""
    logits = jnp.dot(h, router, preferred_element_type=h.dtype)
    probs = jax.nn.softmax(logits.astype(jnp.float32), axis=-1)
    weights, experts = jax.lax.top_k(probs, cfg.num_experts_per_tok)
    if cfg.norm_topk_prob:
        weights = weights / jnp.sum(weights, axis=-1, keepdims=True)
    return probs, weights, experts.astype(jnp.int32)


def tiled_ragged_dot(x: jax.Array, w: jax.Array, group_sizes: jax.Array, tile: int) -> jax.Array:
    """``jax.lax.ragged_dot(x [M, K], w [G, K, N], group_sizes [G])`` (rows after the groups give 0) as one
    batched matmul over tiles of ``tile`` rows, each group's rows padded to whole tiles (static bound: ``M /
    tile + G`` tiles), each tile multiplied by its group's matrix."""
    M, G = x.shape[0], w.shape[0]
    n_tiles = -(-M // tile) + G
    ends = jnp.cumsum(group_sizes)
    tiles_per_group = (group_sizes + tile - 1) // tile
    tile_ends = jnp.cumsum(tiles_per_group)
    group = jnp.searchsorted(ends, jnp.arange(M), side="right")  # G: after every group
    g = jnp.minimum(group, G - 1)
    dest = (tile_ends[g] - tiles_per_group[g]) * tile + jnp.arange(M) - (ends[g] - group_sizes[g])
    dest = jnp.where(group < G, dest, n_tiles * tile)  # out of range: dropped, read back as 0
    padded = jnp.zeros((n_tiles * tile, x.shape[1]), x.dtype).at[dest].set(x, mode="drop")
    tile_group = jnp.minimum(jnp.searchsorted(tile_ends, jnp.arange(n_tiles), side="right"), G - 1)
    y = jnp.einsum("tmk,tkn->tmn", padded.reshape(n_tiles, tile, -1), jnp.take(w, tile_group, axis=0),
                   preferred_element_type=x.dtype)
    return jnp.take(y.reshape(n_tiles * tile, -1), dest, axis=0, mode="fill", fill_value=0)


def _tile_rows(rows: int, groups: int) -> int:
    """Rows per tile for ``rows`` rows over ``groups`` groups: a power of two near a quarter of a group's
    mean share, within [8, 128] (padding at most ``groups`` partial tiles against few, large matmuls)."""
    return int(min(128, max(8, 2 ** max(0, (rows // (4 * groups)).bit_length() - 1))))


def _grouped(method: str):
    """The grouped matmul ``(x, w, group_sizes) -> [M, N]`` of ``cfg.moe_matmul`` (resolved, not ``auto``)."""
    if method == "ragged_dot":
        return lambda x, w, sizes: jax.lax.ragged_dot(x, w, sizes, preferred_element_type=x.dtype)
    return lambda x, w, sizes: tiled_ragged_dot(x, w, sizes, _tile_rows(x.shape[0], w.shape[0]))


def _swiglu_experts(xs: jax.Array, gate: jax.Array, up: jax.Array, down: jax.Array, group_sizes: jax.Array,
                    method: str = "ragged_dot"):
    """Rows ``xs [M, D]`` sorted by expert (``group_sizes [G]`` rows each, the rest after them untouched and
    returned as 0) through their expert's SwiGLU MLP: ``[M, D]``."""
    matmul = _grouped(method)
    g = matmul(xs, gate, group_sizes)
    u = matmul(xs, up, group_sizes)
    return matmul(jax.nn.silu(g) * u, down, group_sizes)


def _local_experts(xs, gate, up, down, group_sizes, first, method):
    """``_swiglu_experts`` over the experts ``first ..`` of ``gate`` / ``up`` / ``down`` (one device's share of
    the ``expert`` axis): their rows are a contiguous run of the sorted rows; the others come back 0."""
    n_local = gate.shape[0]
    start = (jnp.cumsum(group_sizes) - group_sizes)[first]
    local_sizes = jax.lax.dynamic_slice(group_sizes, (first,), (n_local,))
    out = _swiglu_experts(jnp.roll(xs, -start, axis=0), gate, up, down, local_sizes, method)
    out = jnp.where((jnp.arange(xs.shape[0]) < jnp.sum(local_sizes))[:, None], out, 0)
    return jnp.roll(out, start, axis=0)


def _routed(cfg: ModelConfig, method: str, x, mask, router, gate, up, down, first):
    """Tokens ``x [N, D]`` through the experts ``first ..`` of ``gate`` / ``up`` / ``down`` (all of them when
    ``first`` is None): ``(y [N, D], RouterStats)``."""
    k, E = cfg.num_experts_per_tok, cfg.num_experts
    probs, weights, experts = route(x, router, cfg)
    flat = experts.reshape(-1)  # pair p = n * k + j
    order = jnp.argsort(flat, stable=True)
    group_sizes = jnp.bincount(flat, length=E).astype(jnp.int32)
    xs = jnp.take(x, order // k, axis=0)
    if first is None:
        ys = _swiglu_experts(xs, gate, up, down, group_sizes, method)
    else:
        ys = _local_experts(xs, gate, up, down, group_sizes, first, method)
    y = jnp.take(ys, jnp.argsort(order), axis=0).reshape(x.shape[0], k, -1)  # back to pair order
    y = jnp.einsum("nkd,nk->nd", y, weights.astype(y.dtype))
    m = mask.astype(jnp.float32)
    counts = jnp.zeros((E,), jnp.float32).at[flat].add(jnp.repeat(m, k))
    return y, RouterStats(counts, jnp.einsum("ne,n->e", probs, m), jnp.sum(m))


def _routed_in_chunks(cfg: ModelConfig, method: str, x, mask, router, gate, up, down, first):
    """``_routed`` over chunks of ``cfg.moe_chunk`` tokens under ``lax.map``, each rematerialised in the backward
    pass (tokens are routed independently: same values), so the sorted pairs and the experts' activations never
    exceed one chunk's; all at once without a chunk size or where it does not divide the tokens."""
    C, N = cfg.moe_chunk, x.shape[0]
    if not C or N <= C or N % C:
        return _routed(cfg, method, x, mask, router, gate, up, down, first)
    one = jax.checkpoint(lambda xm: _routed(cfg, method, xm[0], xm[1], router, gate, up, down, first),
                         prevent_cse=False)
    y, stats = jax.lax.map(one, (x.reshape(N // C, C, -1), mask.reshape(N // C, C)))
    return y.reshape(N, -1), jax.tree.map(lambda a: a.sum(0), stats)


def _expert_shard(cfg, method, split_tokens, x, mask, router, gate, up, down, first_expert):
    """One device of the ``expert`` axis (under ``shard_map``): its tokens gathered from the axis when they are
    split over it, routed through its own experts, the partial outputs summed over the axis (and scattered
    back to each device's tokens). ``first_expert [1]`` is an input split over the axis, not ``axis_index``:
    the TPU partitioner rejects the partition id in a partly manual computation."""
    if split_tokens:
        x = jax.lax.all_gather(x, EXPERT_AXIS, axis=0, tiled=True)
        mask = jax.lax.all_gather(mask, EXPERT_AXIS, axis=0, tiled=True)
    y, stats = _routed_in_chunks(cfg, method, x, mask, router, gate, up, down, first_expert[0])
    if split_tokens:
        return jax.lax.psum_scatter(y, EXPERT_AXIS, scatter_dimension=0, tiled=True), stats
    return jax.lax.psum(y, EXPERT_AXIS), stats


def _expert_parallel(mr: MeshRules | None, shape: tuple[int, ...]) -> bool:
    """Whether the rules split the experts ``[E, ...]`` over a mesh ``expert`` axis."""
    if mr is None or mr.mesh.shape.get(EXPERT_AXIS, 1) == 1:
        return False
    spec = mr.spec(("experts",), shape[:1])
    return len(spec) > 0 and spec[0] == EXPERT_AXIS


def matmul_method(cfg: ModelConfig, mr: MeshRules | None) -> str:
    """``cfg.moe_matmul`` with ``auto`` resolved by the platform the block runs on (the mesh's devices, else
    JAX's default backend): ``tiles`` on the CPU, ``ragged_dot`` elsewhere."""
    if cfg.moe_matmul != "auto":
        return cfg.moe_matmul
    platform = mr.mesh.devices.flat[0].platform if mr is not None else jax.default_backend()
    return "tiles" if platform == "cpu" else "ragged_dot"


def moe_mlp(cfg: ModelConfig, mr: MeshRules | None, w: dict, h: jax.Array, token_mask: jax.Array):
    """The MoE block over ``h [B, T, D]`` with one layer's weights ``w`` (``MOE_PARAMS``, compute dtype):
    ``(y [B, T, D], RouterStats)``; ``token_mask [B, T]`` bool marks the tokens the statistics count."""
    B, T, D = h.shape
    x, mask = h.reshape(B * T, D), token_mask.reshape(B * T)
    weights = (w["router"], w["expert_gate"], w["expert_up"], w["expert_down"])
    method = matmul_method(cfg, mr)
    if not _expert_parallel(mr, w["expert_gate"].shape):
        y, stats = _routed_in_chunks(cfg, method, x, mask, *weights, None)
        return y.reshape(B, T, D), stats
    n_shards = mr.mesh.shape[EXPERT_AXIS]
    # The rows go in as the rules split them: over the expert axis too (then gathered in the block) when the
    # batch rule includes it and the rows divide; else whole on every device of the axis.
    split_tokens = EXPERT_AXIS in jax.tree.leaves(tuple(mr.spec(("act_batch",), (B,))))
    rows = PartitionSpec(EXPERT_AXIS) if split_tokens else PartitionSpec()
    experts = PartitionSpec(EXPERT_AXIS)
    first_experts = jnp.arange(n_shards, dtype=jnp.int32) * (cfg.num_experts // n_shards)
    run = jax.shard_map(functools.partial(_expert_shard, cfg, method, split_tokens), mesh=mr.mesh,
                        axis_names={EXPERT_AXIS},
                        in_specs=(rows, rows, PartitionSpec(), experts, experts, experts, experts),
                        out_specs=(rows, PartitionSpec()), check_vma=False)
    y, stats = run(x, mask, *weights, first_experts)
    return y.reshape(B, T, D), stats


def load_balancing_loss(stats: RouterStats, num_experts: int) -> jax.Array:
    """HF ``load_balancing_loss_func`` (Switch Transformer) over layer-summed statistics:
    ``E * sum_e f_e P_e`` with ``f_e`` the expert's top-k assignments and ``P_e`` its summed router probability,
    both per routed token (``k`` for perfectly uniform routing, up to ``E k`` when one expert gets everything)."""
    rows = jnp.maximum(stats.tokens, 1.0)
    return num_experts * jnp.sum((stats.expert_tokens / rows) * (stats.router_probs / rows))


def routing_metrics(stats: RouterStats) -> dict[str, jax.Array]:
    """Per-expert share of the top-k assignments (``router_share_e{i}``, summing to 1) and the load imbalance
    ``router_load_max_over_mean`` (the busiest expert's assignments over the mean; 1 when balanced)."""
    total = jnp.maximum(jnp.sum(stats.expert_tokens), 1.0)
    share = stats.expert_tokens / total
    out = {f"router_share_e{i}": share[i] for i in range(share.shape[0])}
    out["router_load_max_over_mean"] = jnp.max(share) * share.shape[0]
    return out
