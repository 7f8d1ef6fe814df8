"""HF checkpoint import/export against real `transformers` models (tiny, random, float32).

Each test builds a tiny random model with transformers, saves it with `save_pretrained`, imports it,
and compares logits; then exports ours, reloads it with transformers and compares again.
Tolerance: max abs logit difference < 1e-4 (float32; measured ~1e-6).
"""

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
import transformers
from flax import nnx

from mgrpo_jax.model import Transformer, get_model_config, make_mesh
from mgrpo_jax.model.checkpoint_hf import (
    SafetensorsCheckpoint,
    config_from_hf,
    config_to_hf,
    load_hf,
    save_hf,
)

TOL = 1e-4

SHAPE = dict(vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
             num_attention_heads=4, num_key_value_heads=2, head_dim=8, max_position_embeddings=64)


def _hf_model(kind: str, **kw):
    torch.manual_seed(0)
    if kind == "llama":
        cfg = transformers.LlamaConfig(**SHAPE, rope_theta=500_000.0, rms_norm_eps=1e-5, **kw)
        model = transformers.LlamaForCausalLM(cfg)
    elif kind == "llama3.1":
        rope = {"rope_type": "llama3", "rope_theta": 500_000.0, "factor": 8.0, "low_freq_factor": 1.0,
                "high_freq_factor": 4.0, "original_max_position_embeddings": 16}
        cfg = transformers.LlamaConfig(**SHAPE, rope_parameters=rope, **kw)
        model = transformers.LlamaForCausalLM(cfg)
    elif kind == "qwen3":
        cfg = transformers.Qwen3Config(**SHAPE, rope_theta=1_000_000.0, **kw)
        model = transformers.Qwen3ForCausalLM(cfg)
    elif kind == "qwen2":
        cfg = transformers.Qwen2Config(**SHAPE, tie_word_embeddings=True, **kw)
        model = transformers.Qwen2ForCausalLM(cfg)
    elif kind == "gemma":
        cfg = transformers.GemmaConfig(**SHAPE, **kw)
        model = transformers.GemmaForCausalLM(cfg)
    else:
        raise ValueError(kind)
    # Random, non-trivial values everywhere (norm weights and biases too), unit-scale logits.
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_((0.0 if kind == "gemma" else 1.0) + 0.2 * torch.randn_like(p))
            elif "bias" in name:
                p.copy_(0.2 * torch.randn_like(p))
            else:
                p.copy_(torch.randn_like(p) / np.sqrt(p.shape[-1]))
    return model.eval().float()


def _hf_logits(model, tokens: np.ndarray, positions=None, mask=None) -> np.ndarray:
    with torch.no_grad():
        out = model(input_ids=torch.as_tensor(tokens, dtype=torch.long),
                    position_ids=None if positions is None else torch.as_tensor(positions, dtype=torch.long),
                    attention_mask=None if mask is None else torch.as_tensor(mask, dtype=torch.long))
    return out.logits.float().numpy()


@nnx.jit
def _ours(model, tokens, positions, mask):
    return model(tokens, positions, attention_mask=mask)[0]


def _inputs(B=2, T=12, seed=0):
    rng = np.random.default_rng(seed)
    tok = rng.integers(0, SHAPE["vocab_size"], (B, T)).astype(np.int32)
    pos = np.broadcast_to(np.arange(T, dtype=np.int32), (B, T)).copy()
    return tok, pos


def _ours_logits(model, tok, pos, mask=None):
    mask = np.ones(tok.shape, bool) if mask is None else mask
    return np.asarray(_ours(model, jnp.asarray(tok), jnp.asarray(pos), jnp.asarray(mask)))


@pytest.mark.parametrize("kind", ["llama", "qwen3", "gemma", "qwen2", "llama3.1"])
def test_import_matches_transformers_and_export_round_trips(kind, tmp_path):
    hf = _hf_model(kind, attn_implementation="eager")
    hf.save_pretrained(tmp_path / "hf", safe_serialization=True)
    tok, pos = _inputs()
    ref = _hf_logits(hf, tok)

    model = load_hf(tmp_path / "hf")
    expect_family = {"llama3.1": "llama"}.get(kind, kind)
    assert model.cfg.family == expect_family
    ours = _ours_logits(model, tok, pos)
    assert np.abs(ours - ref).max() < TOL, np.abs(ours - ref).max()

    # Right-padded batch with per-row positions: real tokens agree with HF's (HF gets the same mask).
    mask = np.ones(tok.shape, bool)
    mask[1, 7:] = False
    ours_p = _ours_logits(model, tok, pos, mask)
    ref_p = _hf_logits(hf, tok, pos, mask)
    assert np.abs(ours_p[mask] - ref_p[mask]).max() < TOL

    # Export -> transformers loads it -> same logits.
    save_hf(model, tmp_path / "ours")
    hf2 = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "ours", attn_implementation="eager",
                                                            dtype=torch.float32)
    assert type(hf2) is type(hf)
    ref2 = _hf_logits(hf2.eval(), tok)
    assert np.abs(ref2 - ref).max() < TOL
    # ... and our own re-import of the export is bit-identical.
    again = load_hf(tmp_path / "ours")
    jax.tree.map(lambda a, b: np.testing.assert_array_equal(np.asarray(a), np.asarray(b)),
                 nnx.state(again, nnx.Param), nnx.state(model, nnx.Param))


def test_import_directly_sharded_matches_single_device(tmp_path):
    hf = _hf_model("qwen3")
    hf.save_pretrained(tmp_path, safe_serialization=True)
    mesh = make_mesh({"data": 2, "fsdp": 2, "tensor": 2})
    model = load_hf(tmp_path, mesh=mesh)
    q = model.layers.q[...]
    assert q.sharding.spec == jax.sharding.PartitionSpec(None, "fsdp", "tensor")
    assert q.addressable_shards[0].data.shape == (2, 16, 2, 8)
    tok, pos = _inputs(B=4)
    ours = _ours_logits(model, tok, pos)
    assert np.abs(ours - _hf_logits(hf, tok)).max() < TOL


def test_bfloat16_export_and_sharded_files(tmp_path):
    cfg = get_model_config("llama-tiny", vocab_size=96, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2,
                           head_dim=8, mlp_dim=64)
    model = Transformer(cfg, rngs=nnx.Rngs(0))
    save_hf(model, tmp_path, dtype="bfloat16", max_shard_bytes=8_000)
    index = json.loads((tmp_path / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) > 1
    assert json.loads((tmp_path / "config.json").read_text())["dtype"] == "bfloat16"
    with SafetensorsCheckpoint(tmp_path) as ckpt:
        assert ckpt.get("model.embed_tokens.weight").dtype.name == "bfloat16"
    # transformers reads the sharded bf16 export; logits equal ours run on the bf16-rounded params.
    hf = transformers.AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.float32).eval()
    back = load_hf(tmp_path)
    assert back.cfg.dtype == "bfloat16"
    back32 = load_hf(tmp_path, dtype="float32")
    tok, pos = _inputs()
    assert np.abs(_ours_logits(back32, tok, pos) - _hf_logits(hf, tok)).max() < TOL
    diff = jax.tree.map(lambda a, b: float(jnp.abs(a - b).max()), nnx.state(back32, nnx.Param),
                        nnx.state(model, nnx.Param))
    assert 0 < max(jax.tree.leaves(diff)) < 0.05  # bf16 rounding only


def test_config_round_trip_and_unsupported():
    for name in ("llama3-8b", "llama3.1-8b", "qwen3-8b", "gemma-7b"):
        cfg = get_model_config(name)
        back = config_from_hf(config_to_hf(cfg), dtype=cfg.dtype, remat=cfg.remat)
        assert back == cfg, name
        # transformers itself accepts the config (shapes only; nothing is allocated).
        hf_cfg = transformers.AutoConfig.for_model(**config_to_hf(cfg))
        assert hf_cfg.num_hidden_layers == cfg.n_layers
    with pytest.raises(NotImplementedError):
        config_from_hf({"model_type": "gpt2"})
    with pytest.raises(ValueError):
        config_to_hf(get_model_config("gemma-tiny", logit_softcap=30.0))


def test_tensors_are_read_only_views_of_the_mapped_files(tmp_path):
    """What the reader hands to the device placement are views of the memory-mapped files, equal to what the
    safetensors library reads (its tensors are copies: the 2-3x slower load of issue 30)."""
    import safetensors.numpy

    cfg = get_model_config("llama-tiny", vocab_size=96, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2,
                           head_dim=8, mlp_dim=64)
    save_hf(Transformer(cfg, rngs=nnx.Rngs(0)), tmp_path, dtype="bfloat16", max_shard_bytes=8_000)
    library = {}
    for file in sorted(tmp_path.glob("*.safetensors")):
        library.update(safetensors.numpy.load_file(file))
    with SafetensorsCheckpoint(tmp_path) as ckpt:
        assert ckpt.keys() == sorted(library)
        for name, expected in library.items():
            view = ckpt.get(name)
            base = view
            while base.base is not None and not isinstance(base, np.memmap):
                base = base.base
            assert isinstance(base, np.memmap) and not view.flags.writeable, name
            assert view.dtype == expected.dtype and np.array_equal(view, expected), name
