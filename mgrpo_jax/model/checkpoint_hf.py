"""Hugging Face checkpoint import / export (Llama, Qwen2, Qwen3, Qwen3-MoE, Gemma) in safetensors format.

- ``config_from_hf(d)`` / ``config_to_hf(cfg)``: ``config.json`` <-> ``ModelConfig``.
- ``load_hf(path, mesh=None, rules=..., **overrides) -> Transformer``: reads ``config.json`` and
  ``model.safetensors`` (or the sharded ``model.safetensors.index.json``) from a directory. Each
  device's shard is copied from views of the memory-mapped files straight into its placement
  (``jax.make_array_from_callback``), so no full host copy of the model is ever made.
- ``save_hf(model, path, dtype=None)``: writes ``config.json`` + safetensors that
  ``transformers.AutoModelForCausalLM.from_pretrained`` loads, one file (shard) at a time.

Layout. HF linear weights are ``[out, in]``; ours are ``[in, ...]`` with heads split out:
``q_proj [H*Dh, D] -> q [D, H, Dh]``, ``o_proj [D, H*Dh] -> o [H, Dh, D]``, ``gate/up [F, D] -> [D, F]``,
``down [D, F] -> [F, D]``, ``lm_head [V, D] -> [D, V]``, per-layer tensors stacked on a leading axis.
Qwen3-MoE: ``mlp.gate [E, D] -> router [D, E]``, each expert's ``mlp.experts.{e}.gate_proj/up_proj/down_proj``
(the hub's per-expert names, which transformers also writes) transposed like the dense MLP and stacked into
``expert_gate/expert_up [E, D, F]``, ``expert_down [E, F, D]``; the dense layers' MLP (``mlp_only_layers``)
stacked over those layers only.
RoPE: our rotary embedding uses the same "rotate_half" pairing as HF (dims ``i`` and ``i + Dh/2``), so
q/k weights are taken as they are, with no permutation. Gemma's RMSNorm weights are stored as ``w`` in
``x * (1 + w)`` by both, so they copy unchanged.

Files are written through the ``safetensors`` library and read through its header (``safe_open``: names,
dtypes, shapes, bfloat16 as ``ml_dtypes.bfloat16``) with the bytes viewed in place in the memory-mapped file;
paths may be local or gs:// URLs (``etils.epath``).
"""

from __future__ import annotations

import functools
import itertools
import json
import math
import os
import pathlib
import tempfile

import jax
import ml_dtypes  # (also registers bfloat16 with numpy, which safetensors' numpy reader needs)
import numpy as np
import safetensors
import safetensors.numpy
from etils import epath
from flax import nnx
from jax.experimental import multihost_utils
from jax.sharding import Mesh, SingleDeviceSharding

from mgrpo_jax.model.moe import MOE_PARAMS
from mgrpo_jax.model.shapes import ModelConfig
from mgrpo_jax.model.sharding import DEFAULT_RULES, MeshRules, Rules, logical_to_spec
from mgrpo_jax.model.transformer import DENSE_MLP_PARAMS, LAYER_PARAMS, PARAM_AXES, Transformer, param_shapes

# ---------------------------------------------------------------------------------------------------
# safetensors files (through the `safetensors` library; local paths or gs:// URLs)


def _local_copy(file: epath.Path, cache: pathlib.Path) -> pathlib.Path:
    """A local path for ``file``: itself when local, else a copy in ``cache`` (``safe_open`` maps local files)."""
    if not str(file).startswith(("gs://", "s3://")):
        return pathlib.Path(file)
    local = cache / file.name
    if not local.exists():
        file.copy(local)
    return local


def safetensors_files(path: str | os.PathLike) -> list[epath.Path]:
    """The .safetensors files of one checkpoint: a file, or a directory (single file or sharded index)."""
    path = epath.Path(path)
    if path.is_file():
        return [path]
    if (path / "model.safetensors.index.json").exists():
        index = json.loads((path / "model.safetensors.index.json").read_text())
        return [path / f for f in sorted(set(index["weight_map"].values()))]
    if (path / "model.safetensors").exists():
        return [path / "model.safetensors"]
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no safetensors checkpoint in {path}")
    return files


class SafetensorsCheckpoint:
    """The tensors of one checkpoint (single or sharded) as read-only numpy views of the memory-mapped files.

    ``safetensors.safe_open`` reads and validates each header (the format requires the tensors to tile the data
    section exactly, from its start to the end of the file, and the library rejects a file whose offsets do not),
    names the tensors in file order and gives their dtypes (bfloat16 as ``ml_dtypes.bfloat16``) and shapes; the
    bytes are then viewed in place. The library's own tensors are copies, and a copy per tensor (then one per
    device block, then the device's own) made loading 2-3x slower than views; here the only copy of a block is
    the one into its device buffer. Use as a context manager; gs:// files are copied to a temporary folder first.
    """

    def __init__(self, path: str | os.PathLike):
        self._files = safetensors_files(path)
        self._tmp = tempfile.TemporaryDirectory(prefix="hf_ckpt_")
        self._views: dict[str, np.ndarray] = {}
        for f in self._files:
            self._views.update(_file_views(_local_copy(f, pathlib.Path(self._tmp.name))))

    def __enter__(self) -> SafetensorsCheckpoint:
        return self

    def __exit__(self, *exc) -> None:
        self._views.clear()
        self._tmp.cleanup()

    def keys(self) -> list[str]:
        return sorted(self._views)

    def __contains__(self, name: str) -> bool:
        return name in self._views

    def get(self, name: str) -> np.ndarray:
        """A read-only view of tensor ``name`` in the mapped file (index it to read only that region)."""
        return self._views[name]


def _file_views(file: pathlib.Path) -> dict[str, np.ndarray]:
    with safetensors.safe_open(file, framework="numpy") as handle:
        names = handle.offset_keys()
        # An empty leading slice is the library's dtype for the tensor at no cost; a scalar is read whole.
        specs = [(tuple(s.get_shape()), (s[:0] if s.get_shape() else handle.get_tensor(n)).dtype)
                 for n in names for s in [handle.get_slice(n)]]
    data = np.memmap(file, dtype=np.uint8, mode="r")
    sizes = [math.prod(shape) * dtype.itemsize for shape, dtype in specs]
    offset = data.size - sum(sizes)  # the data section ends the file
    if offset != 8 + int.from_bytes(data[:8].tobytes(), "little"):
        raise ValueError(f"{file}: the tensors do not tile the data section after the header")
    views = {}
    for name, (shape, dtype), size in zip(names, specs, sizes, strict=True):
        views[name] = data[offset:offset + size].view(dtype).reshape(shape)
        offset += size
    return views


def write_safetensors(path: str | os.PathLike, tensors: dict[str, np.ndarray], metadata: dict | None = None) -> None:
    """One .safetensors file (local or gs://) written by the library from host arrays (bfloat16 included)."""
    epath.Path(path).write_bytes(safetensors.numpy.save(tensors, metadata=dict(metadata or {"format": "pt"})))


# ---------------------------------------------------------------------------------------------------
# config.json <-> ModelConfig

_MODEL_TYPES = {"llama": "llama", "mistral": "llama", "qwen2": "qwen2", "qwen3": "qwen3", "gemma": "gemma",
                "qwen3_moe": "qwen3_moe"}
_ARCH = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM",
         "gemma": "GemmaForCausalLM", "qwen3_moe": "Qwen3MoeForCausalLM"}
_QWEN3 = ("qwen3", "qwen3_moe")  # families with QK-norm


def _rope(d: dict) -> tuple[float, tuple | None]:
    params = d.get("rope_parameters") or d.get("rope_scaling") or {}
    theta = params.get("rope_theta", d.get("rope_theta", 10_000.0))
    kind = params.get("rope_type", params.get("type", "default"))
    if kind in (None, "default"):
        return float(theta), None
    if kind == "llama3":
        scaling = (float(params["factor"]), float(params["low_freq_factor"]), float(params["high_freq_factor"]),
                   int(params.get("original_max_position_embeddings", d.get("max_position_embeddings"))))
        return float(theta), scaling
    raise NotImplementedError(f"RoPE type {kind!r} is not supported")


def config_from_hf(d: dict, **overrides) -> ModelConfig:
    """``ModelConfig`` from a Hugging Face ``config.json`` dict (Llama / Qwen2 / Qwen3 / Qwen3-MoE / Gemma)."""
    mtype = d.get("model_type")
    if mtype not in _MODEL_TYPES:
        raise NotImplementedError(f"model_type {mtype!r} is not supported (have {sorted(_MODEL_TYPES)})")
    family = _MODEL_TYPES[mtype]
    if d.get("mlp_bias"):
        raise NotImplementedError("mlp_bias=True is not supported")
    if family == "llama" and d.get("attention_bias"):
        raise NotImplementedError("attention_bias=True (Llama) is not supported")
    if family in ("qwen2", *_QWEN3) and d.get("use_sliding_window"):
        raise NotImplementedError("sliding-window attention is not supported")
    if family in _QWEN3 and d.get("attention_bias"):
        raise NotImplementedError("attention_bias=True (Qwen3) is not supported")
    act = d.get("hidden_activation") or d.get("hidden_act") or ("gelu_pytorch_tanh" if family == "gemma" else "silu")
    if family == "gemma":
        act = "gelu"  # HF Gemma always runs the tanh approximation
    elif act != "silu":
        raise NotImplementedError(f"activation {act!r} is not supported for {mtype}")
    theta, scaling = _rope(d)
    n_heads = d["num_attention_heads"]
    head_dim = d.get("head_dim") or d["hidden_size"] // n_heads
    torch_dtype = d.get("dtype") or d.get("torch_dtype")
    kw = dict(
        vocab_size=d["vocab_size"], d_model=d["hidden_size"], n_layers=d["num_hidden_layers"],
        n_heads=n_heads, n_kv_heads=d.get("num_key_value_heads") or n_heads, head_dim=head_dim,
        mlp_dim=d["intermediate_size"], family=family, mlp_activation=act, rope_theta=theta,
        rope_llama3_scaling=scaling, norm_eps=float(d.get("rms_norm_eps", 1e-6)),
        norm_plus_one=family == "gemma", scale_embeddings=family == "gemma",
        tie_embeddings=bool(d.get("tie_word_embeddings", family == "gemma")),
        qk_norm=family in _QWEN3, qkv_bias=family == "qwen2",
        max_position_embeddings=int(d.get("max_position_embeddings", 8192)),
        dtype="bfloat16" if torch_dtype == "bfloat16" else "float32",
    )
    if family == "qwen3_moe":
        if d.get("shared_expert_intermediate_size"):
            raise NotImplementedError("a shared expert is not supported (Qwen3-MoE has none)")
        kw.update(num_experts=int(d.get("num_experts") or d["num_local_experts"]),
                  num_experts_per_tok=int(d["num_experts_per_tok"]),
                  moe_intermediate_size=int(d["moe_intermediate_size"]),
                  norm_topk_prob=bool(d.get("norm_topk_prob", False)),
                  decoder_sparse_step=int(d.get("decoder_sparse_step", 1)),
                  mlp_only_layers=tuple(d.get("mlp_only_layers") or ()),
                  router_aux_loss_coef=float(d.get("router_aux_loss_coef", 0.001)))
    kw.update(overrides)
    return ModelConfig(**kw)


def config_to_hf(cfg: ModelConfig, dtype: str = "float32") -> dict:
    """A ``config.json`` dict that transformers reads back into the same architecture."""
    if cfg.family == "gemma" and not (cfg.norm_plus_one and cfg.scale_embeddings):
        raise ValueError("a gemma-family config must have norm_plus_one and scale_embeddings")
    if cfg.family != "gemma" and (cfg.norm_plus_one or cfg.scale_embeddings):
        raise ValueError(f"{cfg.family} has no (1 + w) norm / embedding scaling in transformers")
    if cfg.qk_norm != (cfg.family in _QWEN3) or cfg.qkv_bias != (cfg.family == "qwen2"):
        raise ValueError(f"qk_norm / qkv_bias do not match the {cfg.family} architecture in transformers")
    if cfg.logit_softcap is not None or cfg.attn_logit_softcap is not None or cfg.query_pre_attn_scalar:
        raise ValueError("soft-capping / query_pre_attn_scalar have no equivalent in these HF architectures")
    if (cfg.mlp_activation == "gelu") != (cfg.family == "gemma"):
        raise ValueError(f"{cfg.family} in transformers uses {'gelu' if cfg.family == 'gemma' else 'silu'}")
    rope: dict = {"rope_type": "default", "rope_theta": cfg.rope_theta}
    if cfg.rope_llama3_scaling is not None:
        f, lo, hi, old = cfg.rope_llama3_scaling
        rope = {"rope_type": "llama3", "rope_theta": cfg.rope_theta, "factor": f, "low_freq_factor": lo,
                "high_freq_factor": hi, "original_max_position_embeddings": old}
    d = {
        "architectures": [_ARCH[cfg.family]], "model_type": cfg.family, "vocab_size": cfg.vocab_size,
        "hidden_size": cfg.d_model, "intermediate_size": cfg.mlp_dim, "num_hidden_layers": cfg.n_layers,
        "num_attention_heads": cfg.n_heads, "num_key_value_heads": cfg.n_kv_heads, "head_dim": cfg.head_dim,
        "rms_norm_eps": cfg.norm_eps, "tie_word_embeddings": cfg.tie_embeddings,
        "max_position_embeddings": cfg.max_position_embeddings, "rope_parameters": rope,
        "rope_theta": cfg.rope_theta, "dtype": dtype, "attention_dropout": 0.0,
    }
    if cfg.rope_llama3_scaling is not None:
        d["rope_scaling"] = dict(rope)
    if cfg.family == "gemma":
        d.update(hidden_act="gelu_pytorch_tanh", hidden_activation="gelu_pytorch_tanh")
    else:
        d["hidden_act"] = "silu"
    if cfg.family in ("llama", *_QWEN3):
        d["attention_bias"] = False
    if cfg.family == "llama":
        d["mlp_bias"] = False
    if cfg.family in ("qwen2", *_QWEN3):
        d.update(use_sliding_window=False, layer_types=["full_attention"] * cfg.n_layers)
    if cfg.family == "qwen3_moe":
        d.update(num_experts=cfg.num_experts, num_experts_per_tok=cfg.num_experts_per_tok,
                 moe_intermediate_size=cfg.moe_intermediate_size, norm_topk_prob=cfg.norm_topk_prob,
                 decoder_sparse_step=cfg.decoder_sparse_step, mlp_only_layers=list(cfg.mlp_only_layers),
                 router_aux_loss_coef=cfg.router_aux_loss_coef, output_router_logits=False)
    return d


# ---------------------------------------------------------------------------------------------------
# name / layout mapping


_EXPERT_PROJ = {"expert_gate": "gate_proj", "expert_up": "up_proj", "expert_down": "down_proj"}


def _param_layers(name: str, cfg: ModelConfig) -> list[int]:
    """The layers a stacked parameter holds, in order (the MLP's: only the dense or only the MoE layers)."""
    kinds = cfg.moe_layers
    if name in MOE_PARAMS:
        return [i for i, moe in enumerate(kinds) if moe]
    if name in DENSE_MLP_PARAMS:
        return [i for i, moe in enumerate(kinds) if not moe]
    return list(range(cfg.n_layers))


def _hf_entries(name: str, cfg: ModelConfig) -> list[tuple[str, tuple[int, ...]]]:
    """(HF tensor name, index into our stacked array) of every HF tensor one stacked parameter holds: one per
    layer, or per (layer, expert) for the experts' matrices."""
    layers = _param_layers(name, cfg)
    if name in _EXPERT_PROJ:
        return [(_hf_name(name, (layer, e)), (j, e)) for j, layer in enumerate(layers) for e in range(cfg.num_experts)]
    return [(_hf_name(name, layer), (j,)) for j, layer in enumerate(layers)]


def _hf_name(name: str, layer: int | tuple[int, int] | None) -> str:
    """HF tensor name of our parameter ``name`` at ``layer`` (``(layer, expert)`` for the experts' matrices)."""
    if name in _EXPERT_PROJ:
        layer, expert = layer
        return f"model.layers.{layer}.mlp.experts.{expert}.{_EXPERT_PROJ[name]}.weight"
    attn = {"q": "q_proj.weight", "k": "k_proj.weight", "v": "v_proj.weight", "o": "o_proj.weight",
            "q_bias": "q_proj.bias", "k_bias": "k_proj.bias", "v_bias": "v_proj.bias",
            "q_norm": "q_norm.weight", "k_norm": "k_norm.weight"}
    if layer is None:
        return {"embed": "model.embed_tokens.weight", "final_norm": "model.norm.weight",
                "lm_head": "lm_head.weight"}[name]
    p = f"model.layers.{layer}."
    if name in attn:
        return p + "self_attn." + attn[name]
    return p + {"attn_norm": "input_layernorm.weight", "mlp_norm": "post_attention_layernorm.weight",
                "gate": "mlp.gate_proj.weight", "up": "mlp.up_proj.weight",
                "down": "mlp.down_proj.weight", "router": "mlp.gate.weight"}[name]


def _hf_to_ours(name: str, t: np.ndarray, cfg: ModelConfig) -> np.ndarray:
    """One HF tensor (one layer) -> our layout (a view where numpy allows)."""
    H, K, Dh, D = cfg.n_heads, cfg.n_kv_heads, cfg.head_dim, cfg.d_model
    if name == "q":
        return t.T.reshape(D, H, Dh)
    if name in ("k", "v"):
        return t.T.reshape(D, K, Dh)
    if name == "o":
        return t.T.reshape(H, Dh, D)
    if name == "q_bias":
        return t.reshape(H, Dh)
    if name in ("k_bias", "v_bias"):
        return t.reshape(K, Dh)
    if name in ("gate", "up", "down", "lm_head", "router", *_EXPERT_PROJ):
        return t.T
    return t  # embed [V, D], norms


def _ours_to_hf(name: str, a: np.ndarray) -> np.ndarray:
    """One of our tensors (one layer) -> HF layout."""
    if name in ("q", "k", "v"):
        return a.reshape(a.shape[0], -1).T
    if name == "o":
        return a.reshape(-1, a.shape[-1]).T
    if name in ("q_bias", "k_bias", "v_bias"):
        return a.reshape(-1)
    if name in ("gate", "up", "down", "lm_head", "router", *_EXPERT_PROJ):
        return a.T
    return a


# ---------------------------------------------------------------------------------------------------
# import


def load_hf_params(path: str | os.PathLike, cfg: ModelConfig, mesh: Mesh | None = None,
                   rules: Rules = DEFAULT_RULES) -> dict[str, jax.Array]:
    """Our flat parameter dict (see ``transformer.param_shapes``) read from an HF checkpoint.

    Every array is assembled per device shard (``jax.make_array_from_callback``), each shard taken from views
    of the memory-mapped files (``SafetensorsCheckpoint``) in our layout, sharded by ``rules`` on ``mesh`` (or
    placed on the default device without a mesh): a shard of a tensor is read once, by the copy into its
    device buffer (a stacked parameter's shard: once more, into the block stacking its layers, converted to the
    parameter dtype on the way), and no full host copy of a parameter is ever made. A stacked parameter's
    leading axes (its layers, and the experts of an MoE layer) index HF tensors (``_hf_entries``).
    """
    pd = cfg.params_dtype
    out = {}
    with SafetensorsCheckpoint(path) as ckpt:
        for name, shape in param_shapes(cfg).items():
            top = name in ("embed", "final_norm", "lm_head")
            entries = [(_hf_name(name, None), ())] if top else _hf_entries(name, cfg)
            if name == "lm_head" and entries[0][0] not in ckpt:
                raise KeyError("checkpoint has no lm_head.weight but config.json says the head is untied")
            to_ours = functools.partial(_hf_to_ours, name, cfg=cfg)
            sources = {index: to_ours(ckpt.get(hf)) for hf, index in entries}  # views: nothing is read yet
            stacked = len(entries[0][1])  # leading axes that index HF tensors: 0, 1 (layers) or 2 (+ experts)
            ours_shape = sources[entries[0][1]].shape
            if ours_shape != tuple(shape[stacked:]):
                raise ValueError(f"{name}: checkpoint shape {ours_shape} != expected {shape[stacked:]}")

            def cb(index, sources=sources, stacked=stacked, shape=shape):
                if not stacked:
                    return np.asarray(sources[()][index], dtype=pd)  # a view when the dtypes agree: JAX copies it
                heads = [range(shape[k])[index[k]] for k in range(stacked)]
                # np.stack copies a transposed view an order of magnitude faster than assigning it into a block.
                blocks = np.stack([sources[i][index[stacked:]] for i in itertools.product(*heads)], dtype=pd)
                return blocks.reshape(*map(len, heads), *blocks.shape[1:])

            if mesh is None:
                sharding = SingleDeviceSharding(jax.devices()[0])
            else:
                sharding = jax.sharding.NamedSharding(mesh, logical_to_spec(PARAM_AXES[name], rules, mesh, shape))
            out[name] = jax.make_array_from_callback(shape, sharding, cb)
    return out


def _variables(model: Transformer) -> dict[str, nnx.Variable]:
    out = {n: getattr(model, n) for n in ("embed", "final_norm", "lm_head") if hasattr(model, n)}
    out.update({n: getattr(model.layers, n) for n in LAYER_PARAMS if hasattr(model.layers, n)})
    return out


def model_from_params(cfg: ModelConfig, params: dict[str, jax.Array], mesh: Mesh | None = None,
                      rules: Rules = DEFAULT_RULES) -> Transformer:
    """A ``Transformer`` holding exactly these arrays (no initialisation is run)."""
    mr = None if mesh is None else MeshRules(mesh, tuple(rules))
    model = nnx.eval_shape(lambda: Transformer(cfg, rngs=nnx.Rngs(0), mesh_rules=mr))
    variables = _variables(model)
    if set(variables) != set(params):
        raise ValueError(f"parameter names differ: {sorted(set(variables) ^ set(params))}")
    for name, var in variables.items():
        if tuple(var.shape) != tuple(params[name].shape):
            raise ValueError(f"{name}: shape {params[name].shape} != {var.shape}")
        var.set_value(params[name])
    return model


def load_hf(path: str | os.PathLike, mesh: Mesh | None = None, rules: Rules = DEFAULT_RULES,
            **config_overrides) -> Transformer:
    """Load an HF checkpoint directory (``config.json`` + safetensors) as a ``Transformer``.

    ``config_overrides`` replace ``ModelConfig`` fields that do not change the parameters (e.g.
    ``dtype='bfloat16'``, ``remat=True``, ``param_dtype``).
    """
    d = json.loads((epath.Path(path) / "config.json").read_text())
    cfg = config_from_hf(d, **config_overrides)
    return model_from_params(cfg, load_hf_params(path, cfg, mesh, rules), mesh, rules)


# ---------------------------------------------------------------------------------------------------
# export


def save_hf(model: Transformer, path: str | os.PathLike, dtype: str | None = None,
            max_shard_bytes: int = 4 << 30) -> None:
    """Write ``config.json`` and safetensors (``model.safetensors`` or numbered shards + index) to a local
    directory or a gs:// URL.

    ``dtype``: 'float32' | 'bfloat16' | 'float16' for the stored tensors (default: the param dtype).
    Host memory holds one of our (stacked) parameters plus the shard being written (``max_shard_bytes``). In a
    multi-process job every process calls it (parameters spread over hosts are gathered) and process 0 writes.
    """
    cfg = model.cfg
    path = epath.Path(path)
    writes = jax.process_index() == 0
    if writes:
        path.mkdir(parents=True, exist_ok=True)
    out_dtype = np.dtype(ml_dtypes.bfloat16) if (dtype or cfg.param_dtype) == "bfloat16" else \
        np.dtype(dtype or cfg.param_dtype)
    variables = _variables(model)

    # (hf name, hf shape, our name, index into our stacked array), grouped by our parameter (not by HF name) so
    # each stacked array is gathered to host once.
    entries = []
    for name, shape in param_shapes(cfg).items():
        if name in ("embed", "final_norm", "lm_head"):
            entries.append((_hf_name(name, None), _ours_to_hf(name, np.empty(shape, np.bool_)).shape, name, None))
        else:
            for hf_name, index in _hf_entries(name, cfg):
                hf_shape = _ours_to_hf(name, np.empty(shape[len(index):], np.bool_)).shape
                entries.append((hf_name, hf_shape, name, index))

    # Split into shards by size, keeping order.
    shards: list[list] = [[]]
    size = 0
    for e in entries:
        n = math.prod(e[1]) * out_dtype.itemsize
        if shards[-1] and size + n > max_shard_bytes:
            shards.append([])
            size = 0
        shards[-1].append(e)
        size += n

    host: dict[str, np.ndarray] = {}

    def hf_tensor(name: str, layer: tuple | None) -> np.ndarray:
        if name not in host:
            host.clear()  # one of our (stacked) params in host memory at a time
            value = variables[name][...]
            if not value.is_fully_addressable:
                value = multihost_utils.process_allgather(value, tiled=True)
            host[name] = np.asarray(jax.device_get(value))
        a = host[name] if layer is None else host[name][layer]
        return np.ascontiguousarray(_ours_to_hf(name, a), dtype=out_dtype)

    names = ["model.safetensors"] if len(shards) == 1 else \
        [f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i in range(len(shards))]
    weight_map = {}
    for fname, shard in zip(names, shards, strict=True):
        tensors = {e[0]: hf_tensor(e[2], e[3]) for e in shard}
        if writes:
            write_safetensors(path / fname, tensors, metadata={"format": "pt"})
        weight_map.update({e[0]: fname for e in shard})
    if not writes:
        return
    if len(shards) > 1:
        total = sum(math.prod(e[1]) * out_dtype.itemsize for e in entries)
        (path / "model.safetensors.index.json").write_text(
            json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}, indent=2))
    dname = {np.dtype(ml_dtypes.bfloat16): "bfloat16", np.dtype(np.float16): "float16"}.get(out_dtype, "float32")
    (path / "config.json").write_text(json.dumps(config_to_hf(cfg, dname), indent=2))
