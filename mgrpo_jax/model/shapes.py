"""Model configuration: one frozen dataclass plus family x size presets.

Families differ only in a few switches (see ``ModelConfig``):

- ``llama``: plain RMSNorm (``x * w``), SwiGLU, untied head (Llama-3).
- ``qwen2``: Llama plus biases on the q/k/v projections.
- ``qwen3``: Llama plus RMSNorm on queries and keys per head (QK-norm) before RoPE.
- ``gemma``: embeddings scaled by ``sqrt(d_model)``, ``(1 + w)`` RMSNorm, GeGLU (tanh GELU), tied head.
- ``qwen3_moe``: Qwen3 with mixture-of-experts feed-forward blocks (``num_experts`` SwiGLU experts of width
  ``moe_intermediate_size``, ``num_experts_per_tok`` active per token, no shared expert) in the layers that
  ``moe_layers`` names (HF ``decoder_sparse_step`` / ``mlp_only_layers``); the other layers keep the dense MLP.

``get_model_config(name)`` accepts ``"<family>-<size>"`` (``llama-tiny``, ``qwen3-tiny``,
``gemma-tiny``), the fixed benchmark shape ``bench``, and the real checkpoint shapes ``llama3-8b``,
``qwen3-8b``, ``gemma-7b``, the mixture-of-experts shapes ``qwen3-moe-tiny``, ``bench-moe`` (the bench shape
with 8 experts, top-2, of half the MLP width: the active parameters of ``bench``) and ``qwen3-30b-a3b``. Any
preset can be edited with ``dataclasses.replace``.
"""

from __future__ import annotations

import dataclasses
from typing import Literal

import jax.numpy as jnp

Family = Literal["llama", "qwen2", "qwen3", "gemma", "qwen3_moe"]
_FAMILIES = ("llama", "qwen2", "qwen3", "gemma", "qwen3_moe")


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    """Shape and numerics of a decoder-only LM. Hashable, so it can be a static jit argument."""

    vocab_size: int
    d_model: int
    n_layers: int
    n_heads: int
    n_kv_heads: int
    head_dim: int
    mlp_dim: int
    family: Family = "llama"
    mlp_activation: Literal["silu", "gelu"] = "silu"  # gated: SwiGLU / GeGLU (tanh-approx GELU)
    rope_theta: float = 10_000.0
    # Llama-3.1 style frequency rescaling: (factor, low_freq_factor, high_freq_factor, original_max_pos).
    rope_llama3_scaling: tuple[float, float, float, int] | None = None
    norm_eps: float = 1e-6
    norm_plus_one: bool = False  # Gemma: y = x_hat * (1 + w), w initialised at 0
    scale_embeddings: bool = False  # Gemma: h0 = embed * sqrt(d_model)
    tie_embeddings: bool = False
    qk_norm: bool = False  # Qwen3
    qkv_bias: bool = False  # Qwen2
    logit_softcap: float | None = None  # logits = c * tanh(logits / c)
    attn_logit_softcap: float | None = None
    query_pre_attn_scalar: float | None = None  # attention scale = scalar**-0.5 (default head_dim)
    dtype: str = "float32"  # compute dtype: 'float32' | 'bfloat16'
    param_dtype: str = "float32"
    # Uncached forward (training, scoring): the layers under ``lax.scan`` (compile time flat in depth) or
    # unrolled (no stacked per-layer residual buffers: faster on XLA:CPU for a few layers). The cached
    # forward (prefill, decode) always unrolls over the per-layer KV buffers.
    scan_layers: bool = True
    remat: bool = False
    remat_policy: str = "nothing_saveable"  # name in jax.checkpoint_policies
    # Queries per attention chunk (0: all at once). Long sequences need it: dense scores are [T, S] per head
    # (32k tokens: 4 GiB per head in float32); chunks of C queries, each rematerialised, need [C, S].
    attn_chunk: int = 0
    # Uncached causal forward: queries in blocks of this many, each attending only to keys up to its own
    # block's end, so the masked upper triangle is skipped (0: off). Unrolled: for a few blocks per sequence.
    causal_block: int = 0
    max_position_embeddings: int = 8192  # metadata only (export); RoPE has no table
    # Mixture of experts (family qwen3_moe; HF Qwen3MoeConfig names). 0 experts: every layer dense.
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    norm_topk_prob: bool = True  # renormalise the top-k router probabilities to sum to 1
    decoder_sparse_step: int = 1  # layer i is MoE when (i + 1) % step == 0 and i not in mlp_only_layers
    mlp_only_layers: tuple[int, ...] = ()
    router_aux_loss_coef: float = 0.001  # the load-balancing loss's default weight in the train step
    # The experts' grouped matmul (mgrpo_jax/model/moe.py): 'ragged_dot' (jax.lax.ragged_dot), 'tiles' (the
    # same product as one batched matmul over expert-aligned tiles: XLA:CPU runs ragged_dot as a masked
    # product with every expert), 'auto' (tiles on the CPU, ragged_dot on TPU / GPU).
    moe_matmul: Literal["auto", "ragged_dot", "tiles"] = "auto"
    # Tokens per MoE chunk (0: all at once): the dropless block sorts N * num_experts_per_tok (token, expert)
    # rows; chunks of C tokens, each rematerialised, bound those buffers by C (moe.py).
    moe_chunk: int = 0

    def __post_init__(self):
        if self.family not in _FAMILIES:
            raise ValueError(f"family must be one of {_FAMILIES}, got {self.family!r}")
        if self.mlp_activation not in ("silu", "gelu"):
            raise ValueError(f"mlp_activation must be 'silu' or 'gelu', got {self.mlp_activation!r}")
        if self.n_heads % self.n_kv_heads:
            raise ValueError(f"n_heads={self.n_heads} not a multiple of n_kv_heads={self.n_kv_heads}")
        if self.head_dim % 2:
            raise ValueError("head_dim must be even for RoPE")
        if self.dtype not in ("float32", "bfloat16", "float16"):
            raise ValueError(f"unsupported compute dtype {self.dtype!r}")
        if (self.family == "qwen3_moe") != (self.num_experts > 0):
            raise ValueError(f"num_experts={self.num_experts}: family qwen3_moe needs experts and only it has them")
        if self.num_experts and not 0 < self.num_experts_per_tok <= self.num_experts:
            raise ValueError(f"num_experts_per_tok={self.num_experts_per_tok} must be in [1, num_experts="
                             f"{self.num_experts}]")
        if self.num_experts and (self.moe_intermediate_size <= 0 or self.decoder_sparse_step <= 0):
            raise ValueError("moe_intermediate_size and decoder_sparse_step must be positive with experts")
        if self.moe_matmul not in ("auto", "ragged_dot", "tiles"):
            raise ValueError(f"moe_matmul must be 'auto', 'ragged_dot' or 'tiles', got {self.moe_matmul!r}")
        object.__setattr__(self, "mlp_only_layers", tuple(int(i) for i in self.mlp_only_layers))

    @property
    def moe_layers(self) -> tuple[bool, ...]:
        """For each layer whether its feed-forward block is the mixture of experts (HF Qwen3MoeDecoderLayer)."""
        return tuple(self.num_experts > 0 and i not in self.mlp_only_layers
                     and (i + 1) % self.decoder_sparse_step == 0 for i in range(self.n_layers))

    @property
    def compute_dtype(self):
        return jnp.dtype(self.dtype)

    @property
    def params_dtype(self):
        return jnp.dtype(self.param_dtype)

    @property
    def attn_scale(self) -> float:
        s = self.query_pre_attn_scalar if self.query_pre_attn_scalar is not None else self.head_dim
        return float(s) ** -0.5

    def num_params(self, active: bool = False) -> int:
        """Parameter count (embeddings counted once when tied); ``active``: counting only the
        ``num_experts_per_tok`` experts each token runs through (the router counts whole)."""
        d, h, kv, dh, f, v = (self.d_model, self.n_heads, self.n_kv_heads, self.head_dim,
                              self.mlp_dim, self.vocab_size)
        attn = d * h * dh * 2 + d * kv * dh * 2
        if self.qkv_bias:
            attn += h * dh + 2 * kv * dh
        if self.qk_norm:
            attn += 2 * dh
        n_moe = sum(self.moe_layers)
        experts = self.num_experts_per_tok if active else self.num_experts
        mlp = (self.n_layers - n_moe) * 3 * d * f + n_moe * (experts * 3 * d * self.moe_intermediate_size
                                                             + d * self.num_experts)
        head = 0 if self.tie_embeddings else d * v
        return v * d + self.n_layers * (attn + 2 * d) + mlp + d + head


def family_defaults(family: Family) -> dict:
    """The switches that make a family; shapes are added by the size presets."""
    if family == "llama":
        return dict(family="llama", mlp_activation="silu", norm_eps=1e-5, rope_theta=500_000.0)
    if family == "qwen2":
        return dict(family="qwen2", mlp_activation="silu", norm_eps=1e-6, rope_theta=1_000_000.0,
                    qkv_bias=True)
    if family == "qwen3":
        return dict(family="qwen3", mlp_activation="silu", norm_eps=1e-6, rope_theta=1_000_000.0,
                    qk_norm=True)
    if family == "qwen3_moe":
        return dict(family_defaults("qwen3"), family="qwen3_moe")
    if family == "gemma":
        return dict(family="gemma", mlp_activation="gelu", norm_eps=1e-6, rope_theta=10_000.0,
                    norm_plus_one=True, scale_embeddings=True, tie_embeddings=True)
    raise ValueError(f"unknown family {family!r}")


# Size presets (shape only). 'tiny' trains on a 2-core CPU in minutes.
_SIZES = {
    "tiny": dict(vocab_size=1024, d_model=128, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=32,
                 mlp_dim=512, tie_embeddings=True, scan_layers=False),
    "small": dict(vocab_size=8192, d_model=512, n_layers=8, n_heads=8, n_kv_heads=4, head_dim=64,
                  mlp_dim=2048),
}

# Real checkpoint shapes (Hugging Face config.json values).
_NAMED = {
    # Fixed benchmark shape (issue 3 part 6): Qwen-3 style, float32.
    "bench": dict(family_defaults("qwen3"), vocab_size=2048, d_model=256, n_layers=4, n_heads=4,
                  n_kv_heads=2, head_dim=64, mlp_dim=1024, tie_embeddings=False, dtype="float32",
                  scan_layers=False, causal_block=64),
    # The bench shape with 8 experts of half its MLP width, 2 per token: the active parameters of 'bench'.
    "bench-moe": dict(family_defaults("qwen3_moe"), vocab_size=2048, d_model=256, n_layers=4, n_heads=4,
                      n_kv_heads=2, head_dim=64, mlp_dim=1024, num_experts=8, num_experts_per_tok=2,
                      moe_intermediate_size=512, tie_embeddings=False, dtype="float32", scan_layers=False,
                      causal_block=64),
    "qwen3-moe-tiny": dict(family_defaults("qwen3_moe"), vocab_size=1024, d_model=128, n_layers=2, n_heads=4,
                           n_kv_heads=2, head_dim=32, mlp_dim=512, num_experts=4, num_experts_per_tok=2,
                           moe_intermediate_size=128, tie_embeddings=True, scan_layers=False),
    "qwen3-30b-a3b": dict(family_defaults("qwen3_moe"), vocab_size=151_936, d_model=2048, n_layers=48,
                          n_heads=32, n_kv_heads=4, head_dim=128, mlp_dim=6144, num_experts=128,
                          num_experts_per_tok=8, moe_intermediate_size=768, norm_topk_prob=True,
                          router_aux_loss_coef=0.001, rope_theta=1_000_000.0, norm_eps=1e-6,
                          tie_embeddings=False, dtype="bfloat16", remat=True, max_position_embeddings=40_960),
    "llama3-8b": dict(family_defaults("llama"), vocab_size=128_256, d_model=4096, n_layers=32,
                      n_heads=32, n_kv_heads=8, head_dim=128, mlp_dim=14_336, rope_theta=500_000.0,
                      norm_eps=1e-5, tie_embeddings=False, dtype="bfloat16", remat=True,
                      max_position_embeddings=8192),
    "llama3.1-8b": dict(family_defaults("llama"), vocab_size=128_256, d_model=4096, n_layers=32,
                        n_heads=32, n_kv_heads=8, head_dim=128, mlp_dim=14_336, rope_theta=500_000.0,
                        rope_llama3_scaling=(8.0, 1.0, 4.0, 8192), norm_eps=1e-5, tie_embeddings=False,
                        dtype="bfloat16", remat=True, max_position_embeddings=131_072),
    "qwen3-8b": dict(family_defaults("qwen3"), vocab_size=151_936, d_model=4096, n_layers=36,
                     n_heads=32, n_kv_heads=8, head_dim=128, mlp_dim=12_288, rope_theta=1_000_000.0,
                     norm_eps=1e-6, tie_embeddings=False, dtype="bfloat16", remat=True,
                     max_position_embeddings=40_960),
    "qwen3-0.6b": dict(family_defaults("qwen3"), vocab_size=151_936, d_model=1024, n_layers=28,
                       n_heads=16, n_kv_heads=8, head_dim=128, mlp_dim=3072, rope_theta=1_000_000.0,
                       norm_eps=1e-6, tie_embeddings=True, dtype="bfloat16",
                       max_position_embeddings=40_960),
    "gemma-7b": dict(family_defaults("gemma"), vocab_size=256_000, d_model=3072, n_layers=28,
                     n_heads=16, n_kv_heads=16, head_dim=256, mlp_dim=24_576, rope_theta=10_000.0,
                     norm_eps=1e-6, dtype="bfloat16", remat=True, max_position_embeddings=8192),
    "gemma-2b": dict(family_defaults("gemma"), vocab_size=256_000, d_model=2048, n_layers=18,
                     n_heads=8, n_kv_heads=1, head_dim=256, mlp_dim=16_384, rope_theta=10_000.0,
                     norm_eps=1e-6, dtype="bfloat16", max_position_embeddings=8192),
}

PRESETS = tuple(sorted(_NAMED)) + tuple(f"{f}-{s}" for f in _FAMILIES if f != "qwen3_moe" for s in _SIZES)


def get_model_config(name: str, **overrides) -> ModelConfig:
    """Preset by name (see module docstring); keyword overrides replace fields."""
    if name in _SIZES:  # bare size: Qwen-3 family (like the benchmark shape)
        name = f"qwen3-{name}"
    if name in _NAMED:
        kw = dict(_NAMED[name])
    else:
        family, _, size = name.partition("-")
        if family not in _FAMILIES or family == "qwen3_moe" or size not in _SIZES:
            raise ValueError(f"unknown model preset {name!r}; known: {', '.join(PRESETS)}")
        kw = dict(family_defaults(family))
        kw.update(_SIZES[size])
    kw.update(overrides)
    return ModelConfig(**kw)
