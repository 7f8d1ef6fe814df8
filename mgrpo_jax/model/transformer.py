"""Decoder-only transformer in Flax NNX (Llama / Qwen / Gemma families).

Call convention::

    logits, new_cache = model(tokens, positions, attention_mask=None, cache=None, cache_index=None)

- ``tokens``, ``positions``: ``[B, T]`` int32. ``positions`` drive RoPE per row, so a right-padded
  prompt keeps true positions for every row.
- ``attention_mask``: ``[B, T]`` bool, True for real tokens (default all True). Keys that are False
  are never attended to. Queries at padding tokens produce finite, meaningless logits.
- Without ``cache``: causal self-attention over the ``T`` tokens; returns ``(logits, None)``.
- With ``cache`` (from ``model.init_cache(B, S)``): the new tokens' keys/values are written at slots
  ``[cache_index, cache_index + T)`` (``cache_index`` a scalar int32, may be traced, same for all rows;
  the Python int 0 marks a prefill, which then attends to its own T keys only; or ``[B]``, each row at its
  own offset, tokens whose ``attention_mask`` is False left unwritten: the sampler's decode slots),
  their validity in ``cache['mask']`` is ``attention_mask``; the query of slot ``s`` attends to every
  valid slot ``<= s``. Returns ``(logits, new_cache)``; the input cache is not modified (donate it).
- ``logits``: ``[B, T, V]`` float32 (soft-capped if the config says so).

Cache pytree (a dict)::

    {'k': L x [B, K, Dh, S], 'v': L x [B, K, S, Dh]  (tuples, one buffer per layer; heads-major;
     compute dtype; keys after RoPE, stored transposed so that q k^T is a plain matmul over the cache),
     'mask': [B, S] bool  (slot holds a real key)}

The maths exists once, as the pure function ``forward(cfg, mesh_rules, params, tokens, positions, ...)``
over plain arrays (built from ``block``, ``rms_norm``, ``rope_sin_cos``, ``attention``, ``dense``):
``Transformer.__call__`` is ``forward`` on ``Transformer.arrays()``, and the sampler calls ``forward`` on the
same values laid out for its decode loop (:mod:`mgrpo_jax.sampling.layout`).

Parameters are stored stacked over layers (leading ``L`` axis). Without a cache the layers run under
``jax.lax.scan`` (compile time flat in depth) or unrolled (``cfg.scan_layers``); with a cache they are
unrolled over the per-layer KV buffers, so each layer updates its buffer in place and attention reads it
where it lies. Projections go through ``dense`` (a hand-written backward pass, see there). Each
parameter carries ``logical_axes`` metadata used by :mod:`mgrpo_jax.model.sharding`; ``abstract_model``,
``init_sharded`` and ``shard_model`` (end of this module) build a model placed by those rules. RoPE uses
the Hugging Face "rotate_half" layout (first half / second half of each head), so HF checkpoints load
without permutation.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Mapping
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import Mesh

from mgrpo_jax.model import lora as lora_lib
from mgrpo_jax.model.moe import MOE_PARAMS, RouterStats, moe_mlp
from mgrpo_jax.model.shapes import ModelConfig
from mgrpo_jax.model.sharding import DEFAULT_RULES, MeshRules, Rules, constrain, state_shardings

_NEG_INF = -0.7 * float(jnp.finfo(jnp.float32).max)

# Names of the per-layer (stacked) parameters, in a fixed order.
LAYER_PARAMS = ("attn_norm", "q", "k", "v", "o", "q_bias", "k_bias", "v_bias", "q_norm", "k_norm",
                "mlp_norm", "gate", "up", "down") + MOE_PARAMS
DENSE_MLP_PARAMS = ("gate", "up", "down")  # stacked over the dense layers only, as MOE_PARAMS over the MoE ones


# Logical axis names of every parameter (see sharding.py). Layer params have a leading 'layers' axis.
PARAM_AXES = {
    "embed": ("vocab", "embed"),
    "final_norm": ("norm",),
    "lm_head": ("embed", "vocab"),
    "attn_norm": ("layers", "norm"),
    "q": ("layers", "embed", "q_heads", "head_dim"),
    "k": ("layers", "embed", "kv_heads", "head_dim"),
    "v": ("layers", "embed", "kv_heads", "head_dim"),
    "o": ("layers", "q_heads", "head_dim", "embed"),
    "q_bias": ("layers", "q_heads", "head_dim"),
    "k_bias": ("layers", "kv_heads", "head_dim"),
    "v_bias": ("layers", "kv_heads", "head_dim"),
    "q_norm": ("layers", "head_dim"),
    "k_norm": ("layers", "head_dim"),
    "mlp_norm": ("layers", "norm"),
    "gate": ("layers", "embed", "mlp"),
    "up": ("layers", "embed", "mlp"),
    "down": ("layers", "mlp", "embed"),
    "router": ("layers", "embed", "router"),
    "expert_gate": ("layers", "experts", "embed", "expert_mlp"),
    "expert_up": ("layers", "experts", "embed", "expert_mlp"),
    "expert_down": ("layers", "experts", "expert_mlp", "embed"),
}


def param_shapes(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Shape of every parameter by name (flat: layer params are stacked over ``n_layers``, except the
    feed-forward ones: ``DENSE_MLP_PARAMS`` over the dense layers, ``MOE_PARAMS`` over the MoE layers)."""
    L, D, H, K, Dh, F, V = (cfg.n_layers, cfg.d_model, cfg.n_heads, cfg.n_kv_heads, cfg.head_dim,
                            cfg.mlp_dim, cfg.vocab_size)
    n_moe = sum(cfg.moe_layers)
    shapes = {"embed": (V, D), "final_norm": (D,), "attn_norm": (L, D), "q": (L, D, H, Dh),
              "k": (L, D, K, Dh), "v": (L, D, K, Dh), "o": (L, H, Dh, D), "mlp_norm": (L, D)}
    if n_moe < L:
        shapes.update(gate=(L - n_moe, D, F), up=(L - n_moe, D, F), down=(L - n_moe, F, D))
    if n_moe:
        E, Fe = cfg.num_experts, cfg.moe_intermediate_size
        shapes.update(router=(n_moe, D, E), expert_gate=(n_moe, E, D, Fe), expert_up=(n_moe, E, D, Fe),
                      expert_down=(n_moe, E, Fe, D))
    if not cfg.tie_embeddings:
        shapes["lm_head"] = (D, V)
    if cfg.qkv_bias:
        shapes.update(q_bias=(L, H, Dh), k_bias=(L, K, Dh), v_bias=(L, K, Dh))
    if cfg.qk_norm:
        shapes.update(q_norm=(L, Dh), k_norm=(L, Dh))
    return shapes


def init_params(cfg: ModelConfig, key: jax.Array) -> dict[str, jax.Array]:
    """Random initial parameters by name (flat dict; layer params stacked over ``n_layers``).

    Dense weights ~ N(0, 1/fan_in), output projections additionally scaled by 1/sqrt(2 L), embeddings
    ~ N(0, 1/d_model) (unit-scale logits with a tied head), norms at identity, biases at 0. All
    normals come from one draw, so the values depend only on the config and key, not on the mesh.
    """
    shapes = param_shapes(cfg)
    fan_in = {"embed": cfg.d_model, "lm_head": cfg.d_model, "q": cfg.d_model, "k": cfg.d_model,
              "v": cfg.d_model, "gate": cfg.d_model, "up": cfg.d_model,
              "o": cfg.n_heads * cfg.head_dim, "down": cfg.mlp_dim, "router": cfg.d_model,
              "expert_gate": cfg.d_model, "expert_up": cfg.d_model, "expert_down": cfg.moe_intermediate_size}
    out_scale = 1.0 / math.sqrt(2 * cfg.n_layers)
    spec = []
    for name, shape in sorted(shapes.items()):
        if name in fan_in:
            std = (out_scale if name in ("o", "down", "expert_down") else 1.0) / math.sqrt(fan_in[name])
            spec.append((name, shape, "normal", std))
        elif name.endswith("norm") and not cfg.norm_plus_one:
            spec.append((name, shape, "ones", 0.0))
        else:  # (1 + w) norms and biases
            spec.append((name, shape, "zeros", 0.0))
    return _init_arrays(tuple(spec), cfg.param_dtype, key)


@functools.partial(jax.jit, static_argnums=(0, 1))
def _init_arrays(spec, dtype, key):
    # One flat draw: XLA:CPU compiles each threefry call slowly, and with partitionable threefry the
    # flat draw is still generated shard-locally under init_sharded (per-device temp ~ 2.5x its params
    # for a 218M model on 8 fake devices, same as per-tensor draws).
    dtype = jnp.dtype(dtype)
    total = sum(math.prod(shape) for _, shape, kind, _ in spec if kind == "normal")
    flat = jax.random.normal(key, (total,), jnp.float32)
    out, off = {}, 0
    for name, shape, kind, std in spec:
        if kind == "normal":
            n = math.prod(shape)
            out[name] = (std * flat[off:off + n].reshape(shape)).astype(dtype)
            off += n
        else:
            out[name] = jnp.full(shape, 1.0 if kind == "ones" else 0.0, dtype)
    return out


def _param(arrays: dict, name: str) -> nnx.Param:
    return nnx.Param(arrays[name], logical_axes=PARAM_AXES[name])


class Layers(nnx.Module):
    """All decoder blocks' parameters, stacked on a leading ``n_layers`` axis, and their LoRA adapters
    (``nnx.LoRAParam``, see :mod:`mgrpo_jax.model.lora`) when ``lora`` is given."""

    def __init__(self, cfg: ModelConfig, arrays: dict[str, jax.Array], lora: lora_lib.LoraSpec | None = None,
                 key: jax.Array | None = None):
        for name in LAYER_PARAMS:
            if name in arrays:
                setattr(self, name, _param(arrays, name))
        self.lora = lora
        if lora is not None:
            for name, a in lora_lib.init_adapters(param_shapes(cfg), lora, key).items():
                setattr(self, name, nnx.LoRAParam(a, logical_axes=lora_lib.adapter_axes(PARAM_AXES, name)))

    def arrays(self) -> dict[str, jax.Array]:
        """The stacked arrays by name; each adapter's B factor comes already scaled by ``alpha / rank``."""
        out = {n: getattr(self, n)[...] for n in LAYER_PARAMS if hasattr(self, n)}
        if self.lora is not None:
            for n in self.lora.targets:
                out[n + lora_lib.SUFFIX_A] = getattr(self, n + lora_lib.SUFFIX_A)[...]
                out[n + lora_lib.SUFFIX_B] = getattr(self, n + lora_lib.SUFFIX_B)[...] * self.lora.scale
        return out


# ---------------------------------------------------------------------------------------------------
# Pure building blocks


def rms_norm(x: jax.Array, w: jax.Array, eps: float, plus_one: bool) -> jax.Array:
    """RMSNorm computed in float32, cast back to ``x.dtype``."""
    xf = x.astype(jnp.float32)
    xf = xf * jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + eps)
    wf = w.astype(jnp.float32)
    return (xf * (1.0 + wf if plus_one else wf)).astype(x.dtype)


def rope_inv_freq(cfg: ModelConfig) -> jax.Array:
    dh = cfg.head_dim
    inv = 1.0 / (cfg.rope_theta ** (jnp.arange(0, dh, 2, dtype=jnp.float32) / dh))
    if cfg.rope_llama3_scaling is not None:
        factor, low, high, old_ctx = cfg.rope_llama3_scaling
        low_wavelen = old_ctx / low
        high_wavelen = old_ctx / high
        wavelen = 2 * math.pi / inv
        scaled = jnp.where(wavelen > low_wavelen, inv / factor, inv)
        smooth = (old_ctx / wavelen - low) / (high - low)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
        inv = jnp.where(medium, smoothed, scaled)
    return inv


def rope_sin_cos(positions: jax.Array, cfg: ModelConfig) -> tuple[jax.Array, jax.Array]:
    """sin, cos of shape ``[B, T, head_dim/2]`` (float32)."""
    def sin_cos(positions):
        ang = positions.astype(jnp.float32)[..., None] * rope_inv_freq(cfg)
        return jnp.sin(ang), jnp.cos(ang)

    # Evaluated once, inside a conditional: XLA fuses a plain sin/cos into every rotary fusion of every layer
    # (forward and backward), where it is recomputed for each head's copy of each element; a conditional's
    # branch is not fused into its consumers. The predicate is always true.
    return jax.lax.cond(jnp.all(positions > jnp.iinfo(jnp.int32).min), sin_cos, sin_cos, positions)


def apply_rope(x: jax.Array, sin: jax.Array, cos: jax.Array) -> jax.Array:
    """Rotate ``x [B, T, N, Dh]`` in the rotate_half layout (pairs (i, i + Dh/2))."""
    xf = x.astype(jnp.float32)
    x1, x2 = jnp.split(xf, 2, axis=-1)
    s, c = sin[:, :, None, :], cos[:, :, None, :]
    return jnp.concatenate([x1 * c - x2 * s, x2 * c + x1 * s], axis=-1).astype(x.dtype)


def attention(q, k, v, mask, cfg: ModelConfig, causal: bool = False):
    """q ``[B,T,H,Dh]``, keys ``[B,K,Dh,S]`` and values ``[B,K,S,Dh]`` (the cache layout), mask ``[B,T,S]`` bool
    -> ``[B,T,H,Dh]``. Scores and softmax in float32; fully masked rows give finite values.

    ``causal``: the caller guarantees ``S == T`` and that ``mask`` is False above the diagonal (the uncached
    forward). Then with ``cfg.causal_block = C`` (T a multiple of C larger than C) query block ``i`` attends
    to keys ``[0, (i + 1) C)`` only: the fully masked upper blocks are never computed, in either pass
    (``(n + 1) / 2n`` of the dense work for ``n`` blocks). The blocks are unrolled, so this is for a few.

    With ``cfg.attn_chunk = C`` (and T a multiple of C larger than C) the queries are processed C at a time
    under ``lax.map``, each chunk rematerialised in the backward pass, so scores never exceed ``[C, S]``."""
    B, T, H, Dh = q.shape
    C = cfg.causal_block
    if causal and C and T > C and T % C == 0 and k.shape[3] == T:
        blocks = [_dense_attention(q[:, i:i + C], k[..., :i + C], v[:, :, :i + C], mask[:, i:i + C, :i + C], cfg)
                  for i in range(0, T, C)]
        return jnp.concatenate(blocks, axis=1)
    C = cfg.attn_chunk
    if C and T > C and T % C == 0:
        n = T // C
        qs = jnp.swapaxes(q.reshape(B, n, C, H, Dh), 0, 1)
        ms = jnp.swapaxes(mask.reshape(B, n, C, mask.shape[-1]), 0, 1)
        one = jax.checkpoint(lambda xs: _dense_attention(xs[0], k, v, xs[1], cfg), prevent_cse=False)
        o = jax.lax.map(one, (qs, ms))
        return jnp.swapaxes(o, 0, 1).reshape(B, T, H, Dh)
    return _dense_attention(q, k, v, mask, cfg)


def _dense_attention(q, k, v, mask, cfg: ModelConfig):
    B, T, H, Dh = q.shape
    K = k.shape[1]
    G = H // K
    # Queries grouped per KV head as rows of one matrix [B, K, G*T, Dh], so both products are plain batched
    # matmuls in their operands' own layouts (XLA:CPU runs a product whose output order differs from its
    # operands' as a slow transposing loop instead of a library matmul).
    qg = jnp.transpose(q.reshape(B, T, K, G, Dh), (0, 2, 3, 1, 4)).reshape(B, K, G * T, Dh)
    o = _attention_core(qg, k, v, mask, cfg.attn_scale, cfg.attn_logit_softcap)
    return jnp.transpose(o.reshape(B, K, G, T, Dh), (0, 3, 1, 2, 4)).reshape(B, T, H, Dh)


def _masked_scores(qg, k, mask, scale, softcap):
    """Scores ``[B, K, G, T, S]`` float32 (soft-capped; masked entries ``_NEG_INF``) and the capped scores."""
    B, K, GT, _ = qg.shape
    T, S = mask.shape[1], mask.shape[2]
    s = jnp.einsum("bkqd,bkds->bkqs", qg, k, preferred_element_type=jnp.float32) * scale
    if softcap is not None:
        s = softcap * jnp.tanh(s / softcap)
    s = s.reshape(B, K, GT // T, T, S)
    return jnp.where(mask[:, None, None], s, _NEG_INF), s


@functools.partial(jax.custom_vjp, nondiff_argnums=(4, 5))
def _attention_core(qg, k, v, mask, scale, softcap):
    """softmax(mask(q k^T * scale)) v for grouped queries ``qg [B, K, G*T, Dh]``, keys ``[B, K, Dh, S]`` and
    values ``[B, K, S, Dh]``.

    Flash-attention arithmetic without tiling: the forward keeps only the output and each row's max and sum;
    the backward recomputes the probabilities from them and forms the softmax gradient with the row sums
    of ``do * o`` (``Dh`` wide) instead of ``dp * p`` (``S`` wide). Fully masked rows average all values, as
    a softmax over equal scores does, and pass no gradient to q or k."""
    return _attention_fwd(qg, k, v, mask, scale, softcap)[0]


def _attention_fwd(qg, k, v, mask, scale, softcap):
    B, K, GT, Dh = qg.shape
    s, _ = _masked_scores(qg, k, mask, scale, softcap)
    m = jnp.max(s, axis=-1, keepdims=True)
    p = jnp.exp(s - m)
    lsum = jnp.sum(p, axis=-1, keepdims=True)
    o = jnp.einsum("bkqs,bksd->bkqd", p.reshape(B, K, GT, -1).astype(v.dtype), v,
                   preferred_element_type=jnp.float32) / lsum.reshape(B, K, GT, 1)
    o = o.astype(v.dtype)
    # The row max and the inverse row sum, not their log-sum-exp: for a fully masked row the max is
    # _NEG_INF, and adding log(sum) to it would round the sum away.
    return o, (qg, k, v, mask, o, m, 1.0 / lsum)


def _attention_bwd(scale, softcap, res, do):
    qg, k, v, mask, o, m, inv_sum = res
    B, K, GT, Dh = qg.shape
    s, capped = _masked_scores(qg, k, mask, scale, softcap)
    p = jnp.exp(s - m) * inv_sum
    do_f = do.astype(jnp.float32)
    row = jnp.sum(do_f * o.astype(jnp.float32), axis=-1).reshape(p.shape[:-1] + (1,))
    dp = jnp.einsum("bkqd,bksd->bkqs", do, v, preferred_element_type=jnp.float32).reshape(p.shape)
    ds = jnp.where(mask[:, None, None], p * (dp - row), 0.0)
    if softcap is not None:
        ds = ds * (1.0 - jnp.square(capped / softcap))
    ds = (ds * scale).reshape(B, K, GT, -1)
    p = p.reshape(B, K, GT, -1)
    dq = jnp.einsum("bkqs,bkds->bkqd", ds.astype(k.dtype), k, preferred_element_type=jnp.float32)
    dk = jnp.einsum("bkqs,bkqd->bkds", ds.astype(qg.dtype), qg, preferred_element_type=jnp.float32)
    dv = jnp.einsum("bkqs,bkqd->bksd", p.astype(do.dtype), do, preferred_element_type=jnp.float32)
    return dq.astype(qg.dtype), dk.astype(k.dtype), dv.astype(v.dtype), None


_attention_core.defvjp(_attention_fwd, _attention_bwd)


def dense(x: jax.Array, w: jax.Array, n_in: int = 1) -> jax.Array:
    """Contract the last ``n_in`` axes of ``x`` with the first ``n_in`` axes of ``w`` (a projection).

    Same values as the ``einsum``; the backward pass (``_dense_bwd``) forms the weight gradient as
    ``x^T @ g`` with the activation first, so XLA transposes the activation when it is the narrower
    operand. JAX's own rule emits ``(g^T @ x)^T``, and XLA:CPU then materialises ``g`` transposed: for the
    MLP that is a [tokens, mlp_dim] strided copy that costs more than the matmul it feeds.
    """
    lead, k_shape, m_shape = x.shape[:-n_in], w.shape[:n_in], w.shape[n_in:]
    y = _dense2d(x.reshape(-1, math.prod(k_shape)), w.reshape(math.prod(k_shape), -1))
    return y.reshape(*lead, *m_shape)


@jax.custom_vjp
def _dense2d(x, w):
    return jnp.dot(x, w, preferred_element_type=x.dtype)


def _dense_fwd(x, w):
    return _dense2d(x, w), (x, w)


def _dense_bwd(res, g):
    x, w = res
    dx = jnp.dot(g, w.T, preferred_element_type=x.dtype)
    dw = jax.lax.dot_general(x, g, (((0,), (0,)), ((), ())), preferred_element_type=w.dtype)
    return dx, dw


_dense2d.defvjp(_dense_fwd, _dense_bwd)


def _project(x: jax.Array, w: dict, name: str, n_in: int = 1) -> jax.Array:
    """``dense(x, w[name], n_in)``, or the same product from the ``[out, in]`` copy ``w[name + "_t"]`` (a decode
    layout, :mod:`mgrpo_jax.sampling.layout`), plus the LoRA term ``dense(dense(x, A), scale B)`` when ``w``
    holds the projection's adapter factors."""
    wt = w.get(name + "_t")
    if wt is None:
        y = dense(x, w[name], n_in)
    else:
        y = jax.lax.dot_general(x, wt, (((x.ndim - 1,), (1,)), ((), ())), preferred_element_type=x.dtype)
    a = w.get(name + lora_lib.SUFFIX_A)
    if a is not None:
        y = y + dense(dense(x, a, n_in), w[name + lora_lib.SUFFIX_B])
    return y


def block(cfg: ModelConfig, mr: MeshRules | None, lp: dict, x, sin, cos, mask, kv_update, token_mask,
          causal=False, attend=None):
    """One decoder block over one layer's parameters ``lp`` (the MLP matrices ``gate`` / ``up`` / ``down`` may
    come transposed, ``[out, in]``, as ``gate_t`` / ``up_t`` / ``down_t``: same values; a layer with a
    ``router`` runs the mixture of experts, :mod:`mgrpo_jax.model.moe`, instead).
    ``kv_update(k_new, v_new) -> (k_all, v_all, state)`` supplies the keys; ``token_mask [B, T]`` marks the
    real tokens (for the routing statistics). ``attend(q, k, v) -> (o, kv_state)``, if given, replaces
    ``kv_update`` and the attention: keys and values the caller keeps itself (``forward``'s ``attend``). Returns
    ``(x, kv_state, RouterStats or None)``."""
    cdt = cfg.compute_dtype
    w = {n: a.astype(cdt) for n, a in lp.items() if n not in ("attn_norm", "mlp_norm", "q_norm", "k_norm")}
    eps, p1 = cfg.norm_eps, cfg.norm_plus_one

    h = rms_norm(x, lp["attn_norm"], eps, p1)
    q = _project(h, w, "q")
    k = _project(h, w, "k")
    v = _project(h, w, "v")
    if cfg.qkv_bias:
        q, k, v = q + w["q_bias"], k + w["k_bias"], v + w["v_bias"]
    q = constrain(q, ("act_batch", "act_seq", "act_heads", "act_head_dim"), mr)
    k = constrain(k, ("act_batch", "act_seq", "act_kv_heads", "act_head_dim"), mr)
    v = constrain(v, ("act_batch", "act_seq", "act_kv_heads", "act_head_dim"), mr)
    if cfg.qk_norm:
        q = rms_norm(q, lp["q_norm"], eps, p1)
        k = rms_norm(k, lp["k_norm"], eps, p1)
    q = apply_rope(q, sin, cos)
    k = apply_rope(k, sin, cos)
    if attend is not None:
        o, kv_state = attend(q, k, v)
    else:
        # The cache layout: keys [B, K, Dh, T], values [B, K, T, Dh].
        k_all, v_all, kv_state = kv_update(jnp.transpose(k, (0, 2, 3, 1)), jnp.swapaxes(v, 1, 2))
        o = attention(q, k_all, v_all, mask, cfg, causal)
    o = constrain(o, ("act_batch", "act_seq", "act_heads", "act_head_dim"), mr)
    x = x + _project(o, w, "o", 2)
    x = constrain(x, ("act_batch", "act_seq", "act_embed"), mr)

    h = rms_norm(x, lp["mlp_norm"], eps, p1)
    stats = None
    if "router" in w:
        y, stats = moe_mlp(cfg, mr, w, h, token_mask)
        x = x + y
    else:
        g = _project(h, w, "gate")
        u = _project(h, w, "up")
        act = jax.nn.silu(g) if cfg.mlp_activation == "silu" else jax.nn.gelu(g, approximate=True)
        m = constrain(act * u, ("act_batch", "act_seq", "act_mlp"), mr)
        x = x + _project(m, w, "down")
    x = constrain(x, ("act_batch", "act_seq", "act_embed"), mr)
    return x, kv_state, stats


# ---------------------------------------------------------------------------------------------------


class Transformer(nnx.Module):
    """Decoder-only LM. See the module docstring for the call convention and cache format."""

    def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs, mesh_rules: MeshRules | None = None,
                 lora: lora_lib.LoraSpec | None = None):
        self.cfg = cfg
        self.mesh_rules = mesh_rules
        arrays = init_params(cfg, rngs.params())
        self.embed = _param(arrays, "embed")
        # The adapters' key is drawn only with LoRA, so a plain model's values are unchanged.
        self.layers = Layers(cfg, arrays, lora, rngs.params() if lora is not None else None)
        self.final_norm = _param(arrays, "final_norm")
        if not cfg.tie_embeddings:
            self.lm_head = _param(arrays, "lm_head")

    # -- cache --------------------------------------------------------------------------------------

    def init_cache(self, batch: int, max_len: int, dtype=None) -> dict:
        """Empty KV cache for ``batch`` rows and ``max_len`` slots (sharded when the model is)."""
        return init_cache(self.cfg, batch, max_len, dtype=dtype, mesh_rules=self.mesh_rules)

    # -- forward ------------------------------------------------------------------------------------

    def arrays(self) -> dict[str, Any]:
        """The parameters as plain arrays, the ``params`` of :func:`forward`: ``embed``, ``final_norm``,
        ``layers`` (the stacked dict) and, without tied embeddings, ``lm_head``."""
        out = {"embed": self.embed[...], "final_norm": self.final_norm[...], "layers": self.layers.arrays()}
        if not self.cfg.tie_embeddings:
            out["lm_head"] = self.lm_head[...]
        return out

    def __call__(self, tokens, positions, *, attention_mask=None, cache=None, cache_index=None, logits_at=None,
                 router_stats=False):
        """``forward`` over this model's parameters (module docstring: the call convention).

        ``logits_at`` ([B] int): only those positions' logits, ``[B, 1, V]`` (a prefill needs each row's last
        prompt position only; the full ``[B, T, V]`` float32 logits of a long prompt can outweigh the model).
        ``router_stats``: also return the layer-summed ``RouterStats`` (``None`` without MoE layers)."""
        return forward(self.cfg, self.mesh_rules, self.arrays(), tokens, positions, attention_mask=attention_mask,
                       cache=cache, cache_index=cache_index, logits_at=logits_at, router_stats=router_stats)


def unstack_layers(stacked: Mapping[str, jax.Array], moe_layers: tuple[bool, ...] | None = None,
                   ) -> list[dict[str, jax.Array]]:
    """Each layer's parameters sliced out of the stacked arrays. ``moe_layers`` (``cfg.moe_layers``) says which
    layers are MoE where dense and MoE layers mix (their MLP parameters are stacked over their own layers)."""
    if moe_layers is None:
        sizes = {a.shape[0] for a in stacked.values()}
        if len(sizes) > 1:
            raise ValueError("the layers mix dense and MoE blocks: unstack_layers needs moe_layers (cfg.moe_layers)")
        moe_layers = (MOE_PARAMS[0] in stacked,) * sizes.pop()
    out = []
    for i, is_moe in enumerate(moe_layers):
        rank = sum(moe_layers[:i]) if is_moe else i - sum(moe_layers[:i])  # index among layers of its kind
        own, other = (MOE_PARAMS, DENSE_MLP_PARAMS) if is_moe else (DENSE_MLP_PARAMS, MOE_PARAMS)
        out.append({name: a[rank if name in own else i] for name, a in stacked.items() if name not in other})
    return out


def _sum_stats(stats: list) -> RouterStats | None:
    stats = [s for s in stats if s is not None]
    return jax.tree.map(lambda *a: sum(a), *stats) if stats else None


def forward(cfg: ModelConfig, mesh_rules: MeshRules | None, params: Mapping[str, Any], tokens, positions, *,
            attention_mask=None, cache=None, cache_index=None, logits_at=None, router_stats=False, attend=None):
    """The model's forward pass, a pure function: ``(logits, new_cache)`` (module docstring: the call convention),
    and with ``router_stats`` a third value, the MoE layers' summed ``RouterStats`` (``None`` without any).

    ``params``: ``Transformer.arrays()`` (``embed [V, D]``, ``final_norm [D]``, ``layers``, ``lm_head [D, V]``
    unless the embeddings are tied), or the same values in another layout, for a caller that calls this many
    times over the same weights (the sampler's decode loop, :mod:`mgrpo_jax.sampling.layout`):

    - ``layers``: the stacked dict, or a sequence of per-layer dicts (``unstack_layers``; each may hold MLP
      matrices transposed, see ``block``). An unrolled forward slices each layer's weights out of the stacked
      arrays, and XLA does not hoist those copies out of a ``while`` loop by itself: a loop passes the list.
    - ``lm_head_t [V, D]`` instead of ``lm_head``.

    ``mesh_rules``: constrain activations by the logical rules (``None``: no constraints).

    ``attend(layer, q, k, v) -> (o, state)``, in place of ``cache``: each layer's attention over keys and values the
    caller keeps itself (the paged KV blocks of :mod:`mgrpo_jax.sampling.paged`); ``q [B, T, H, Dh]``, ``k`` and ``v``
    ``[B, T, K, Dh]`` the layer's new ones after RoPE, ``o [B, T, H, Dh]``. The second value returned is then the
    layers' states, a tuple."""
    mr = mesh_rules
    cdt = cfg.compute_dtype
    B, T = tokens.shape
    if attention_mask is None:
        attention_mask = jnp.ones((B, T), jnp.bool_)
    attention_mask = attention_mask.astype(jnp.bool_)

    x = jnp.take(params["embed"], tokens, axis=0).astype(cdt)
    if cfg.scale_embeddings:
        x = x * jnp.asarray(math.sqrt(cfg.d_model), cdt)
    x = constrain(x, ("act_batch", "act_seq", "act_embed"), mr)
    sin, cos = rope_sin_cos(positions, cfg)
    layers = params["layers"]
    mixed = len(set(cfg.moe_layers)) > 1  # dense and MoE layers: no common stacked shape to scan over
    if isinstance(layers, Mapping) and (cache is not None or attend is not None or not cfg.scan_layers or mixed):
        layers = unstack_layers(layers, cfg.moe_layers)  # a loop over the layers (else a scan over the stacked arrays)
    stats = []

    if attend is not None:
        states = []
        for i, lp in enumerate(layers):
            x, state, layer_stats = block(cfg, mr, lp, x, sin, cos, None, None, attention_mask,
                                          attend=functools.partial(attend, i))
            states.append(state)
            stats.append(layer_stats)
        new_cache = tuple(states)
    elif cache is None:
        causal = jnp.tril(jnp.ones((T, T), jnp.bool_))
        mask = causal[None] & attention_mask[:, None, :]

        def body(x, lp):
            x, _, layer_stats = block(cfg, mr, lp, x, sin, cos, mask, lambda k, v: (k, v, None), attention_mask,
                                      causal=True)
            return x, layer_stats

        if cfg.remat:
            policy = getattr(jax.checkpoint_policies, cfg.remat_policy)
            body = jax.checkpoint(body, policy=policy, prevent_cse=False)
        if isinstance(layers, Mapping):
            x, scanned = jax.lax.scan(body, x, layers)
            stats.append(jax.tree.map(lambda a: a.sum(0), scanned))
        else:
            for lp in layers:
                x, layer_stats = body(x, lp)
                stats.append(layer_stats)
        new_cache = None
    else:
        if cache_index is None:
            raise ValueError("cache_index is required with a cache")
        idx = jnp.asarray(cache_index, jnp.int32)
        S = cache["mask"].shape[1]
        zero = jnp.zeros((), jnp.int32)
        per_row = idx.ndim == 1
        if per_row:
            # Each row writes at its own offset (decode slots: every slot holds an episode of its own length).
            # A masked token is not written at all: its index is pushed past the cache and the scatter drops
            # it, so a row with nothing to add leaves its slot exactly as it was.
            q_slot = idx[:, None] + jnp.arange(T, dtype=jnp.int32)[None]
            write = jnp.where(attention_mask, q_slot, S)
            rows = jnp.arange(B, dtype=jnp.int32)[:, None]
            slot_mask = cache["mask"].at[rows, write].set(True, mode="drop")
            mask = (jnp.arange(S, dtype=jnp.int32)[None, None, :] <= q_slot[:, :, None]) & slot_mask[:, None, :]
        else:
            slot_mask = jax.lax.dynamic_update_slice(cache["mask"], attention_mask, (zero, idx))
        # A prefill into slot 0 (``cache_index`` the Python int 0) attends to its own T keys only: the
        # slots after them are masked anyway, so reading the whole cache would only add work.
        fresh = isinstance(cache_index, int) and cache_index == 0
        if fresh:
            mask = jnp.tril(jnp.ones((T, T), jnp.bool_))[None] & attention_mask[:, None, :]
        elif not per_row:
            q_slot = idx + jnp.arange(T, dtype=jnp.int32)
            mask = (jnp.arange(S, dtype=jnp.int32)[None, :] <= q_slot[:, None])[None] & slot_mask[:, None, :]

        # Layers unrolled over per-layer cache buffers: each layer's update is in place and attention
        # reads its keys where they lie (a scan would slice a copy of every layer's cache per token).
        ks, vs = list(cache["k"]), list(cache["v"])
        for i, lp in enumerate(layers):

            def kv_update(k, v, i=i):
                if per_row:  # k [B, K, Dh, T], v [B, K, T, Dh] scattered at [rows, :, :, write], [rows, :, write, :]
                    nk = ks[i].at[rows, :, :, write].set(jnp.transpose(k, (0, 3, 1, 2)).astype(ks[i].dtype),
                                                         mode="drop")
                    nv = vs[i].at[rows, :, write, :].set(jnp.transpose(v, (0, 2, 1, 3)).astype(vs[i].dtype),
                                                         mode="drop")
                    return nk.astype(cdt), nv.astype(cdt), (nk, nv)
                nk = jax.lax.dynamic_update_slice(ks[i], k.astype(ks[i].dtype), (zero, zero, zero, idx))
                nv = jax.lax.dynamic_update_slice(vs[i], v.astype(vs[i].dtype), (zero, zero, idx, zero))
                if fresh:
                    return k, v, (nk, nv)
                return nk.astype(cdt), nv.astype(cdt), (nk, nv)

            x, (ks[i], vs[i]), layer_stats = block(cfg, mr, lp, x, sin, cos, mask, kv_update, attention_mask,
                                                   causal=fresh)
            stats.append(layer_stats)
        new_cache = {"k": tuple(ks), "v": tuple(vs), "mask": slot_mask}

    if logits_at is not None:
        x = jnp.take_along_axis(x, jnp.asarray(logits_at, jnp.int32)[:, None, None], axis=1)
    x = rms_norm(x, params["final_norm"], cfg.norm_eps, cfg.norm_plus_one)
    head_t = params["embed"] if cfg.tie_embeddings else params.get("lm_head_t")
    if head_t is not None:  # [vocab, d_model]
        logits = jnp.einsum("btd,vd->btv", x, head_t.astype(cdt), preferred_element_type=jnp.float32)
    else:
        logits = jnp.einsum("btd,dv->btv", x, params["lm_head"].astype(cdt), preferred_element_type=jnp.float32)
    if cfg.logit_softcap is not None:
        logits = cfg.logit_softcap * jnp.tanh(logits / cfg.logit_softcap)
    logits = constrain(logits, ("act_batch", "act_seq", "act_vocab"), mr)
    if router_stats:
        return logits, new_cache, _sum_stats(stats)
    return logits, new_cache


# ---------------------------------------------------------------------------------------------------
# Helpers used by the sampler and the trainer


CACHE_AXES = {
    "k": ("cache_batch", "cache_kv_heads", "cache_head_dim", "cache_slots"),  # each layer's entry
    "v": ("cache_batch", "cache_kv_heads", "cache_slots", "cache_head_dim"),
    "mask": ("cache_batch", "cache_slots"),
}


def cache_shape(cfg: ModelConfig, batch: int, max_len: int, dtype=None) -> dict:
    """``jax.ShapeDtypeStruct`` pytree of the cache (no allocation)."""
    dt = jnp.dtype(dtype) if dtype is not None else cfg.compute_dtype
    k = jax.ShapeDtypeStruct((batch, cfg.n_kv_heads, cfg.head_dim, max_len), dt)
    v = jax.ShapeDtypeStruct((batch, cfg.n_kv_heads, max_len, cfg.head_dim), dt)
    return {"k": (k,) * cfg.n_layers, "v": (v,) * cfg.n_layers,
            "mask": jax.ShapeDtypeStruct((batch, max_len), jnp.bool_)}


def cache_shardings(cfg: ModelConfig, batch: int, max_len: int, mesh_rules: MeshRules) -> dict:
    """NamedSharding per cache entry (batch over data x fsdp, KV heads over tensor)."""
    shapes = cache_shape(cfg, batch, max_len)
    return {n: jax.tree.map(lambda s, n=n: mesh_rules.sharding(CACHE_AXES[n], s.shape), shapes[n])
            for n in shapes}


def init_cache(cfg: ModelConfig, batch: int, max_len: int, dtype=None,
               mesh_rules: MeshRules | None = None) -> dict:
    shapes = cache_shape(cfg, batch, max_len, dtype)

    def make():
        return jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), shapes)

    if mesh_rules is None:
        return make()
    return jax.jit(make, out_shardings=cache_shardings(cfg, batch, max_len, mesh_rules))()


def gather_logprobs(logits: jax.Array, targets: jax.Array) -> jax.Array:
    """``log_softmax(logits)[..., targets]`` in float32 without materialising the full log-softmax."""
    logits = logits.astype(jnp.float32)
    lse = jax.nn.logsumexp(logits, axis=-1)
    tgt = jnp.take_along_axis(logits, targets[..., None].astype(jnp.int32), axis=-1)[..., 0]
    return tgt - lse


def token_logprobs(model: Transformer, tokens, positions, attention_mask=None) -> jax.Array:
    """Teacher-forced ``log p(tokens[:, t] | tokens[:, :t])`` as ``[B, T]`` float32.

    Column 0 is 0 (no context), and so is every column whose token is padding
    (``attention_mask`` False). Same numerics as the model's forward pass.
    """
    B, T = tokens.shape
    logits, _ = model(tokens, positions, attention_mask=attention_mask)
    lp = gather_logprobs(logits[:, :-1], tokens[:, 1:])
    lp = jnp.concatenate([jnp.zeros((B, 1), jnp.float32), lp], axis=1)
    if attention_mask is not None:
        lp = jnp.where(attention_mask.astype(jnp.bool_), lp, 0.0)
    return lp


# ---------------------------------------------------------------------------------------------------
# A Transformer placed on a mesh by logical rules (sharding.py)


def abstract_model(cfg: ModelConfig, mesh: Mesh | None = None, rules: Rules = DEFAULT_RULES,
                   lora: lora_lib.LoraSpec | None = None):
    """(graphdef, abstract state with shardings) of a ``Transformer`` (with ``lora``'s adapters) — no memory
    allocated."""
    mr = None if mesh is None else MeshRules(mesh, tuple(rules))
    model = nnx.eval_shape(lambda: Transformer(cfg, rngs=nnx.Rngs(0), mesh_rules=mr, lora=lora))
    graphdef, state = nnx.split(model)
    if mesh is not None:
        shard = state_shardings(state, mesh, rules)
        state = jax.tree.map(lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s), state, shard)
    return graphdef, state


def init_sharded(cfg: ModelConfig, mesh: Mesh, rules: Rules = DEFAULT_RULES, rng: int | jax.Array = 0):
    """A ``Transformer`` whose parameters are created directly in their sharded placement.

    The initialiser runs inside one ``jax.jit`` with ``out_shardings`` from the rules, so each device
    only materialises its own shards. The returned model also constrains its activations by the rules.
    """
    rules = tuple(rules)
    mr = MeshRules(mesh, rules)
    graphdef, abs_state = nnx.split(
        nnx.eval_shape(lambda: Transformer(cfg, rngs=nnx.Rngs(0), mesh_rules=mr)))
    shard = state_shardings(abs_state, mesh, rules)
    key = rng if isinstance(rng, jax.Array) else jax.random.key(int(rng))

    def _init(k):
        return nnx.state(Transformer(cfg, rngs=nnx.Rngs(k), mesh_rules=mr))

    state = jax.jit(_init, out_shardings=shard)(key)
    return nnx.merge(graphdef, state)


def shard_model(model: Transformer, mesh: Mesh, rules: Rules = DEFAULT_RULES) -> Transformer:
    """Move an existing (e.g. single-device) model onto ``mesh`` by the rules; returns a new model."""
    rules = tuple(rules)
    graphdef, state = nnx.split(model)
    shard = state_shardings(state, mesh, rules)
    state = jax.device_put(state, shard)
    new = nnx.merge(graphdef, state)
    new.mesh_rules = MeshRules(mesh, rules)
    return new
