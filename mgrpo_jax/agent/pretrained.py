"""An agent that starts from a Hugging Face checkpoint: `agent.init_from=DIR` (a local directory or a gs:// URL
holding `config.json`, safetensors, sharded or not, and the tokenizer files).

    tokenizer = agent_tokenizer(config, "main", shared)     # the checkpoint's own (tokenizer_hf)
    model_config, params = load_pretrained(config.main, tokenizer, mesh, rules)

The architecture is the checkpoint's (`config.json`); of `agent.model_overrides` only the fields that leave the
parameters as they are (`RUNTIME_FIELDS`: compute and parameter dtypes, remat, scan, attention chunking) apply,
the rest (a preset's sizes) are ignored with a log line. Parameters are read straight into the agent's mesh
(`checkpoint_hf.load_hf_params`).

**Tokens the checkpoint lacks.** The `chat` grammar's tags are single tokens; those the vocabulary does not have
are appended to it (`tokenizer_hf.WithAddedTokens`, ids after the tokenizer's vocabulary). Their rows of the
embedding (and of an untied output head) are set to the mean of the tokenizer's real rows: a new tag starts as
an "average token", neither favoured nor impossible under the head, and the warm start or RL moves it from there.
A checkpoint whose matrices are padded past its tokenizer (Qwen3: 151,936 rows for 151,669 tokens) gives the
new tokens padding rows; otherwise the matrices grow by exactly the rows needed.
"""

from __future__ import annotations

import dataclasses
import json
import logging

import jax
import jax.numpy as jnp
from etils import epath
from flax import nnx
from jax.sharding import NamedSharding, SingleDeviceSharding

from mgrpo_jax.model import DEFAULT_RULES, logical_to_spec
from mgrpo_jax.model.checkpoint_hf import config_from_hf, load_hf_params, model_from_params
from mgrpo_jax.model.shapes import ModelConfig
from mgrpo_jax.model.transformer import PARAM_AXES, param_shapes
from mgrpo_jax.tokenizer import ChatTokenizer
from mgrpo_jax.tokenizer_hf import added_tokens

log = logging.getLogger(__name__)

# ModelConfig fields an `init_from` agent takes from `agent.model_overrides`: none changes a parameter's shape.
RUNTIME_FIELDS = ("dtype", "param_dtype", "scan_layers", "remat", "remat_policy", "attn_chunk", "causal_block",
                  "moe_matmul", "moe_chunk")


def checkpoint_model_config(agent_cfg) -> ModelConfig:
    """The model config of `agent_cfg.init_from`'s `config.json`, with the runtime overrides."""
    path = epath.Path(agent_cfg.init_from)
    if not (path / "config.json").exists():
        raise FileNotFoundError(f"init_from={agent_cfg.init_from!r}: no config.json there")
    overrides = dict(agent_cfg.model_overrides.to_dict())
    ignored = sorted(set(overrides) - set(RUNTIME_FIELDS))
    if ignored:
        log.info("init_from=%s: the checkpoint's architecture is used; ignoring model_overrides %s", path, ignored)
    return config_from_hf(json.loads((path / "config.json").read_text()),
                          **{k: v for k, v in overrides.items() if k in RUNTIME_FIELDS})


def load_pretrained(agent_cfg, tokenizer: ChatTokenizer, mesh=None,
                    rules=DEFAULT_RULES) -> tuple[ModelConfig, nnx.State]:
    """(model config, parameters placed on `mesh` by `rules`) of `agent_cfg.init_from`, with rows for the tokens
    `tokenizer` appended to the checkpoint's vocabulary (module docstring)."""
    cfg = checkpoint_model_config(agent_cfg)
    params = load_hf_params(agent_cfg.init_from, cfg, mesh, rules)
    extra = added_tokens(tokenizer)
    if extra:
        real_rows = min(extra.values())  # the tokenizer's own vocabulary ends where the appended tokens start
        cfg = dataclasses.replace(cfg, vocab_size=max(cfg.vocab_size, tokenizer.vocab_size))
        for name, axis in (("embed", 0), ("lm_head", 1)):
            if name in params:
                params[name] = _mean_rows(params[name], axis, real_rows, sorted(extra.values()), cfg.vocab_size,
                                          _sharding(name, cfg, mesh, rules))
        log.info("init_from=%s: tokens %s appended to the vocabulary (ids %d..%d), rows set to the mean row",
                 agent_cfg.init_from, list(extra), min(extra.values()), max(extra.values()))
    elif cfg.vocab_size < tokenizer.vocab_size:
        raise ValueError(f"init_from={agent_cfg.init_from!r}: {cfg.vocab_size} embedding rows for a tokenizer of "
                         f"{tokenizer.vocab_size} tokens")
    return cfg, nnx.state(model_from_params(cfg, params, mesh, rules))


def _sharding(name: str, cfg: ModelConfig, mesh, rules):
    if mesh is None:
        return SingleDeviceSharding(jax.devices()[0])
    return NamedSharding(mesh, logical_to_spec(PARAM_AXES[name], rules, mesh, param_shapes(cfg)[name]))


def _mean_rows(table: jax.Array, axis: int, real_rows: int, ids: list[int], size: int, sharding) -> jax.Array:
    """`table` grown along `axis` to `size` entries, entries `ids` set to the mean of the first `real_rows`."""

    def grow(t):
        mean = jnp.mean(jax.lax.slice_in_dim(t, 0, real_rows, axis=axis).astype(jnp.float32), axis=axis,
                        keepdims=True).astype(t.dtype)
        shape = list(t.shape)
        shape[axis] = size - t.shape[axis]
        t = jnp.concatenate([t, jnp.broadcast_to(mean, shape)], axis=axis)
        shape[axis] = len(ids)
        return t.at[(slice(None),) * axis + (jnp.asarray(ids),)].set(jnp.broadcast_to(mean, shape))

    return jax.jit(grow, out_shardings=sharding)(table)
