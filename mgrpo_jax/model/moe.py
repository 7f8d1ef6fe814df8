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
work), so on the CPU (``cfg.moe_matmul`` ``auto``, the platform of the mesh's devices) the block runs on
**tiles** instead: each expert's pairs are laid out in whole tiles of ``tile`` rows (``TileLayout``: at most
``N k / tile + E`` tiles, the last one of each expert padded with zero rows), the three SwiGLU products run tile
by tile, each with its expert's matrices read in place (``tile_swiglu``), and the outputs are gathered back to
pair order. The layout is computed once per layer; the moves between token order and tiles are gathers both
ways (``gather_rows``: the backward pass gathers through the inverse index rather than scatter-adding, which
XLA:CPU runs row by row), and each tile's weight gradient is added into its expert's slice in place.

**Expert parallelism.** With an ``expert`` mesh axis (and the rules placing the ``experts`` logical axis on it,
``sharding.py``) each device holds ``E / n`` experts. The block then runs under ``shard_map`` over that axis
(the other mesh axes, FSDP and tensor, stay automatic). The token rows are split over the axis too (the batch
rules include it): each device gathers its group's tokens from the axis, routes them, multiplies the contiguous
run of sorted rows routed to its own experts (on the CPU: lays out tiles of those pairs only), and the partial
outputs are summed and scattered back to their devices (``all_gather`` of ``[N, D]`` and ``psum_scatter`` of
``[N, D]`` per layer). Where the rows do not divide over the axis they stay whole on every device of it and the
outputs are summed (``psum``).

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

from mgrpo_jax.model.shapes import ModelConfig
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


class TileLayout(NamedTuple):
    """Where the (token, expert) pairs ``p = n k + j`` of one device's experts sit in tiles of ``tile`` rows:
    ``slot [P]`` each pair's row in the tiles (``T tile`` for pairs of other devices' experts), ``source
    [T tile]`` each tile row's pair (``P`` for padding) and ``tile_expert [T]`` each tile's local expert."""

    slot: jax.Array
    source: jax.Array
    tile_expert: jax.Array
    used: jax.Array  # tiles holding pairs (the first ones); the rest of the static bound is left out
    tile: int


def tile_layout(experts: jax.Array, num_local: int, first, tile: int) -> TileLayout:
    """The tiles of the pairs routed to experts ``first .. first + num_local - 1`` (``experts [P]``, the pairs'
    expert ids): each local expert's pairs in pair order, from the first row of its own tiles; at most ``P /
    tile + num_local`` tiles (a static bound)."""
    P = experts.shape[0]
    local = experts - first
    key = jnp.where((local >= 0) & (local < num_local), local, num_local)  # num_local: another device's
    order = jnp.argsort(key, stable=True)
    rank = jnp.zeros((P,), jnp.int32).at[order].set(jnp.arange(P, dtype=jnp.int32))  # position in sorted order
    sizes = jnp.bincount(key, length=num_local + 1)[:num_local].astype(jnp.int32)
    starts = jnp.cumsum(sizes) - sizes
    tiles = (sizes + tile - 1) // tile
    tile_ends = jnp.cumsum(tiles)
    first_tile = tile_ends - tiles
    n_tiles = -(-P // tile) + num_local
    e = jnp.minimum(key, num_local - 1)
    slot = jnp.where(key < num_local, first_tile[e] * tile + rank - starts[e], n_tiles * tile)
    tile_expert = jnp.minimum(jnp.searchsorted(tile_ends, jnp.arange(n_tiles), side="right"),
                              num_local - 1).astype(jnp.int32)
    row = jnp.arange(n_tiles * tile)
    g = tile_expert[row // tile]
    within = row - first_tile[g] * tile
    source = jnp.where(within < sizes[g], order[jnp.clip(starts[g] + within, 0, P - 1)], P)
    return TileLayout(slot, source, tile_expert, tile_ends[-1], tile)


@jax.custom_vjp
def gather_rows(x: jax.Array, index: jax.Array, inverse: jax.Array) -> jax.Array:
    """``x[index]`` (rows out of range give 0), where ``inverse [len(x), r]`` lists the output rows that read each
    row of ``x`` (out of range where fewer): the gradient gathers through it (and sums over ``r``)."""
    return jnp.take(x, index, axis=0, mode="fill", fill_value=0)


def _gather_rows_fwd(x, index, inverse):
    return gather_rows(x, index, inverse), inverse


def _gather_rows_bwd(inverse, dy):
    return jnp.take(dy, inverse, axis=0, mode="fill", fill_value=0).sum(axis=1), None, None


gather_rows.defvjp(_gather_rows_fwd, _gather_rows_bwd)


def _expert(w: jax.Array, e: jax.Array) -> jax.Array:
    return jax.lax.dynamic_index_in_dim(w, e, keepdims=False)


def _swiglu_tiles(xt, gate, up, down, tile_expert, used, keep: bool):
    """The forward loop of ``tile_swiglu``: ``(y, g, u)``, each tile's gate and up projections kept for the
    backward pass when ``keep`` (else ``g`` and ``u`` are None: inference carries no residuals)."""
    T, m, _ = xt.shape
    zeros = jnp.zeros((T, m, gate.shape[2]), xt.dtype) if keep else None

    def one_tile(t, carry):
        y, g_all, u_all = carry
        x, e = xt[t], tile_expert[t]
        g, u = _dot(x, _expert(gate, e)), _dot(x, _expert(up, e))
        y = _put(y, _dot(jax.nn.silu(g) * u, _expert(down, e)), t)
        return (y, _put(g_all, g, t), _put(u_all, u, t)) if keep else (y, None, None)

    return jax.lax.fori_loop(0, used, one_tile, (jnp.zeros(xt.shape[:2] + down.shape[2:], xt.dtype), zeros, zeros))


@jax.custom_vjp
def tile_swiglu(xt: jax.Array, gate: jax.Array, up: jax.Array, down: jax.Array, tile_expert: jax.Array,
                used: jax.Array) -> jax.Array:
    """Tiles ``xt [T, tile, D]`` through their experts' SwiGLU MLPs (``gate`` / ``up [G, D, F]``, ``down [G, F,
    D]``; ``tile_expert [T]``), one tile at a time with its expert's matrices read in place (a batched product
    would gather a copy of them per tile), the first ``used`` tiles only (the rest come back 0): ``[T, tile, D]``.
    The backward pass is one loop over the tiles too, adding each tile's weight gradients into its expert's
    slices in place."""
    return _swiglu_tiles(xt, gate, up, down, tile_expert, used, keep=False)[0]


def _tile_swiglu_fwd(xt, gate, up, down, tile_expert, used):
    y, g, u = _swiglu_tiles(xt, gate, up, down, tile_expert, used, keep=True)
    return y, (xt, g, u, gate, up, down, tile_expert, used)


def _tile_swiglu_bwd(res, dy):
    xt, g_all, u_all, gate, up, down, tile_expert, used = res

    def one_tile(t, grads):
        dx, dgate, dup, ddown = grads
        x, g, u, d, e = xt[t], g_all[t], u_all[t], dy[t], tile_expert[t]
        sig = jax.nn.sigmoid(g)
        silu = g * sig
        dh = _dot(d, _expert(down, e).T)
        du = dh * silu
        dg = dh * u * (sig + silu * (1 - sig))
        dx = _put(dx, _dot(dg, _expert(gate, e).T) + _dot(du, _expert(up, e).T), t)
        dgate = _add(dgate, _dot(x.T, dg), e)
        dup = _add(dup, _dot(x.T, du), e)
        ddown = _add(ddown, _dot((silu * u).T, d), e)
        return dx, dgate, dup, ddown

    zeros = (jnp.zeros_like(xt), jnp.zeros_like(gate), jnp.zeros_like(up), jnp.zeros_like(down))
    return (*jax.lax.fori_loop(0, used, one_tile, zeros), None, None)


tile_swiglu.defvjp(_tile_swiglu_fwd, _tile_swiglu_bwd)


def _dot(a, b):
    return jnp.dot(a, b, preferred_element_type=a.dtype)


def _put(out, tile, t):
    return jax.lax.dynamic_update_index_in_dim(out, tile.astype(out.dtype), t, 0)


def _add(grad, tile, e):
    """``grad[e] += tile`` in place."""
    return _put(grad, _expert(grad, e) + tile, e)


def tiled_experts(x: jax.Array, layout: TileLayout, k: int, gate: jax.Array, up: jax.Array,
                  down: jax.Array) -> jax.Array:
    """Tokens ``x [N, D]`` through the SwiGLU experts of their pairs on ``layout``'s tiles: ``[N k, D]`` in pair
    order (0 for pairs of experts not in ``gate`` / ``up`` / ``down``)."""
    N, D = x.shape
    xt = gather_rows(x, layout.source // k, layout.slot.reshape(N, k)).reshape(-1, layout.tile, D)
    yt = tile_swiglu(xt, gate, up, down, layout.tile_expert, layout.used)
    return gather_rows(yt.reshape(-1, D), layout.slot, layout.source[:, None])


def _tile_rows(rows: int, groups: int) -> int:
    """Rows per tile for ``rows`` rows over ``groups`` groups: a power of two near half a group's mean share,
    within [8, 256]. Larger tiles run faster on XLA:CPU (one [64, 256] x [256, 512] product per tile runs at
    about 60 % of one product over all the rows, [128, ...] at 70 %), and pad more (half a tile per group on
    average)."""
    return int(min(256, max(8, 2 ** max(0, (rows // (2 * groups)).bit_length() - 1))))


def _ragged_experts(x, experts, k, E, gate, up, down, first):
    """Tokens ``x [N, D]`` through their pairs' experts (``experts [N k]``) by ``jax.lax.ragged_dot`` over the
    pairs sorted by expert, with the experts ``first ..`` of ``gate`` / ``up`` / ``down`` only (one device's
    share of the ``expert`` axis: a contiguous run of the sorted rows; the other pairs come back 0): ``[N k, D]``
    in pair order."""
    order = jnp.argsort(experts, stable=True)
    group_sizes = jnp.bincount(experts, length=E).astype(jnp.int32)
    xs = jnp.take(x, order // k, axis=0)

    def swiglu(xs, sizes):
        def matmul(a, w):
            return jax.lax.ragged_dot(a, w, sizes, preferred_element_type=a.dtype)

        return matmul(jax.nn.silu(matmul(xs, gate)) * matmul(xs, up), down)

    if first is None:
        ys = swiglu(xs, group_sizes)
    else:
        start = (jnp.cumsum(group_sizes) - group_sizes)[first]
        local_sizes = jax.lax.dynamic_slice(group_sizes, (first,), (gate.shape[0],))
        ys = swiglu(jnp.roll(xs, -start, axis=0), local_sizes)
        ys = jnp.where((jnp.arange(xs.shape[0]) < jnp.sum(local_sizes))[:, None], ys, 0)
        ys = jnp.roll(ys, start, axis=0)
    return jnp.take(ys, jnp.argsort(order), axis=0)


def _routed(cfg: ModelConfig, method: str, x, mask, router, gate, up, down, first):
    """Tokens ``x [N, D]`` through the experts ``first ..`` of ``gate`` / ``up`` / ``down`` (one device's share
    of the ``expert`` axis; all of them when ``first`` is None): ``(y [N, D], RouterStats)``."""
    k, E = cfg.num_experts_per_tok, cfg.num_experts
    probs, weights, experts = route(x, router, cfg)
    flat = experts.reshape(-1)  # pair p = n * k + j
    if method == "ragged_dot":
        y = _ragged_experts(x, flat, k, E, gate, up, down, first)
    else:
        tile = _tile_rows(flat.shape[0], gate.shape[0])
        layout = tile_layout(flat, gate.shape[0], 0 if first is None else first, tile)
        y = tiled_experts(x, layout, k, gate, up, down)
    y = jnp.einsum("nkd,nk->nd", y.reshape(x.shape[0], k, -1), weights.astype(y.dtype))
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
