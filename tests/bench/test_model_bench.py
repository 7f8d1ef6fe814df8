"""The model benchmark's code path at tiny sizes (figures are not checked: no timing assertions)."""

import dataclasses

import pytest

from mgrpo_jax.bench import model as bench

# `--quick` end to end runs in tests/bench/test_quick_modes.py.


def test_decode_devices_must_divide_the_batch():
    with pytest.raises(ValueError, match="decode_devices=3"):
        bench.setup_ours(bench.get_model_config("tiny", n_layers=1, vocab_size=256),
                         dataclasses.replace(bench.QUICK, decode_devices=3))


def test_flop_count_of_bench_shape():
    cfg = bench.get_model_config("bench")
    # 4 layers x (q 256x256 + k,v 256x128 + o 256x256 + 3 MLP 256x1024) + LM head 256x2048.
    matmul_params = 4 * (2 * 256 * 256 + 2 * 256 * 128 + 3 * 256 * 1024) + 256 * 2048
    full_square = 3 * 4 * 4 * 384 * 4 * 64  # 3 passes x 4 layers x (QK^T + PV: 4 T H Dh)
    assert bench.train_flops_per_token(dataclasses.replace(cfg, causal_block=0), 384) == (
        6 * matmul_params + full_square)
    # causal_block 64 splits 384 into 6 blocks and computes the 21 of 36 on or below the diagonal.
    assert cfg.causal_block == 64
    assert bench.train_flops_per_token(cfg, 384) == pytest.approx(6 * matmul_params + full_square * 21 / 36)


def test_hf_peer_has_the_same_shape():
    pytest.importorskip("transformers")
    cfg = bench.get_model_config("bench")
    hf = bench.hf_config(cfg)
    assert (hf.vocab_size, hf.hidden_size, hf.num_hidden_layers, hf.num_attention_heads,
            hf.num_key_value_heads, hf.head_dim, hf.intermediate_size) == (2048, 256, 4, 4, 2, 64, 1024)
    assert hf.tie_word_embeddings is False


def test_the_default_is_a_cut_of_the_full_sizes():
    dense, moe, full = bench.choose_sizes("dense"), bench.choose_sizes("moe"), bench.choose_sizes("dense", full=True)
    assert full == bench.BenchSizes() and bench.choose_sizes("moe", full=True) == full
    assert (dense.decode_batches, dense.repeats, full.decode_batches, full.repeats) == ((32,), 2, (32, 64), 3)
    assert dataclasses.replace(moe, repeats=2, new_tokens=256) == dense  # the MoE pair: one round of 128 tokens
    assert (moe.repeats, moe.new_tokens) == (1, 128)
    # Fewer rounds and shapes, the same workloads: the default checks the figures of record (decode at batch 32, the
    # train step) at their sizes.
    assert dataclasses.replace(dense, decode_batches=full.decode_batches, repeats=full.repeats) == full
    assert bench.choose_sizes("moe", quick=True) == bench.QUICK


def test_qwen3_06b_shape_sizes_resolve():
    sizes = bench.choose_sizes("qwen3-0.6b")
    assert sizes == bench.QWEN3_06B and sizes.preset == "qwen3-0.6b" and sizes.overrides == ()
    assert (sizes.decode_batches, sizes.hf_decode_batch, sizes.prompt_len, sizes.new_tokens) == ((64,), 64, 128, 128)
    assert (sizes.train_batch, sizes.train_seq, sizes.train_micro_batches) == (8, 1024, 1)
    assert bench.choose_sizes("qwen3-0.6b", full=True).decode_batches == (64, 256)
    assert bench.choose_sizes("qwen3-0.6b", quick=True) == bench.QUICK
    assert bench.SHAPES["qwen3-0.6b"] == bench.QUICK_SHAPES["qwen3-0.6b"] == ("qwen3-0.6b", None)
    cfg = bench.get_model_config(sizes.preset)
    assert 0.5e9 < cfg.num_params() < 0.8e9  # 0.6B with the tied embedding counted once
    assert str(cfg.compute_dtype) == "bfloat16"


def test_hf_peer_of_qwen3_06b_has_the_same_shape():
    pytest.importorskip("transformers")
    cfg = bench.get_model_config("qwen3-0.6b")
    hf = bench.hf_config(cfg)
    assert (hf.num_hidden_layers, hf.hidden_size, hf.num_attention_heads, hf.num_key_value_heads, hf.head_dim,
            hf.intermediate_size, hf.vocab_size) == (28, 1024, 16, 8, 128, 3072, 151_936)
    assert hf.tie_word_embeddings is True and hf.rms_norm_eps == 1e-6
    assert bench.hf_precision(cfg) == "float32+autocast_bfloat16"
    assert bench.hf_precision(bench.get_model_config("bench")) == "float32"
    assert bench.hf_device() in ("cpu", "cuda")


def test_qwen3_06b_has_the_peers_parameter_count():
    # Shapes only (HF on torch's meta device, ours under eval_shape): 596,049,920 parameters each, Qwen3-0.6B's.
    torch = pytest.importorskip("torch")
    pytest.importorskip("transformers")
    import jax
    from flax import nnx
    from transformers import Qwen3ForCausalLM

    cfg = bench.get_model_config("qwen3-0.6b")
    with torch.device("meta"):
        hf = Qwen3ForCausalLM(bench.hf_config(cfg))
    ours = nnx.state(nnx.eval_shape(lambda: bench.Transformer(cfg, rngs=nnx.Rngs(0))), nnx.Param)
    assert sum(p.numel() for p in hf.parameters()) == sum(x.size for x in jax.tree.leaves(ours)) == cfg.num_params()
    assert cfg.num_params() == 596_049_920
