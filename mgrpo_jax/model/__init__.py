"""Decoder-only LMs (Llama / Qwen / Gemma families) in Flax NNX, sharding rules, HF checkpoint I/O.

Public API::

    from mgrpo_jax.model import ModelConfig, get_model_config, Transformer, token_logprobs
    cfg = get_model_config("qwen3-tiny")
    model = Transformer(cfg, rngs=nnx.Rngs(0))
    logits, _ = model(tokens, positions, attention_mask=mask)             # full sequence
    cache = model.init_cache(batch, max_len)                               # KV cache pytree
    logits, cache = model(tok, pos, attention_mask=m, cache=cache, cache_index=i)

``forward(cfg, mesh_rules, model.arrays(), tokens, positions, ...)`` is the same call as a pure function
(what ``Transformer.__call__`` and the sampler run). See ``transformer.py`` for the cache format and
``sharding.py`` for meshes and rules (named rule sets: ``RULE_SETS``, ``get_rules``).
"""

from mgrpo_jax.model.shapes import PRESETS, ModelConfig, family_defaults, get_model_config
from mgrpo_jax.model.sharding import (
    DEFAULT_RULES,
    MESH_AXES,
    RULE_SETS,
    MeshRules,
    Rules,
    get_rules,
    logical_to_spec,
    make_mesh,
    state_shardings,
)
from mgrpo_jax.model.transformer import (
    CACHE_AXES,
    Transformer,
    abstract_model,
    cache_shape,
    cache_shardings,
    forward,
    gather_logprobs,
    init_cache,
    init_sharded,
    shard_model,
    token_logprobs,
    unstack_layers,
)

__all__ = [
    "CACHE_AXES",
    "DEFAULT_RULES",
    "MESH_AXES",
    "PRESETS",
    "RULE_SETS",
    "MeshRules",
    "ModelConfig",
    "Rules",
    "Transformer",
    "abstract_model",
    "cache_shape",
    "cache_shardings",
    "family_defaults",
    "forward",
    "gather_logprobs",
    "get_model_config",
    "get_rules",
    "init_cache",
    "init_sharded",
    "logical_to_spec",
    "make_mesh",
    "shard_model",
    "state_shardings",
    "token_logprobs",
    "unstack_layers",
]
