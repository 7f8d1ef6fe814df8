"""Tiny Hugging Face checkpoints built here (no downloads), for the `init_from` / `export` tests and by hand:

    PYTHONPATH=. python tests/model/tiny_hf.py qwen3 /tmp/tiny-qwen3    # then --config.main.init_from=/tmp/tiny-qwen3

* `tiny_qwen3(dir)`: a random `Qwen3ForCausalLM` (float32) and a byte-level BPE `tokenizer.json` trained by
  `tokenizers` with Qwen2's own pipeline (NFC, its split regex, byte level), Qwen3's special tokens (`<|im_start|>`,
  `<|im_end|>`, `<tool_call>`, `<think>`, `<tool_response>` and their closing tags; no `<answer>`), and padding
  rows past the tokenizer as in the real checkpoints.
* `tiny_llama3(dir)`: a random `LlamaForCausalLM` and a byte-level BPE `tokenizer.json` with Llama 3's header and
  end-of-turn tokens.
* `tiny_gemma(dir)`: a random `GemmaForCausalLM` and a SentencePiece `tokenizer.model` (Gemma's control pieces and
  turn markers, byte fallback).
Both directories carry a `tokenizer_config.json` with the family's chat template (`tokenizer_hf.CHAT_TEMPLATES`).
The corpus is the `smoke` world's tokenizer corpus (what the agents will read and write) unless one is given.
"""

from __future__ import annotations

import io
import json
import pathlib
import sys

import numpy as np
import sentencepiece as spm
import tokenizers
import torch
import transformers
from tokenizers import Regex, decoders, normalizers, pre_tokenizers

from mgrpo_jax.env.build import build_environment, tokenizer_corpus
from mgrpo_jax.tokenizer_hf import CHAT_TEMPLATES

QWEN3_SPECIALS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>", "<tool_call>", "</tool_call>", "<think>", "</think>",
                  "<tool_response>", "</tool_response>")
LLAMA3_SPECIALS = ("<|begin_of_text|>", "<|end_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>")
QWEN_SPLIT = (r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|"""
              r"""\s+(?!\S)|\s+""")
SHAPE = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
             head_dim=8, max_position_embeddings=2048)


def smoke_corpus(limit_questions: int = 40) -> list[str]:
    from mgrpo_jax.config import get_config

    config = get_config("xbench", "smoke")
    return tokenizer_corpus(build_environment(config), config, limit_questions)


def _random_weights(model, seed: int, gemma: bool):
    torch.manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_((0.0 if gemma else 1.0) + 0.1 * torch.randn_like(p))
            else:
                p.copy_(torch.randn_like(p) / np.sqrt(p.shape[-1]))
    return model.eval()


def byte_level_bpe(corpus, specials, vocab_size: int) -> tokenizers.Tokenizer:
    """A byte-level BPE trained on `corpus` with Qwen2's pipeline (what transformers' Qwen2Tokenizer rebuilds)."""
    tok = tokenizers.Tokenizer(tokenizers.models.BPE())
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(QWEN_SPLIT), behavior="isolated", invert=False),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    tok.decoder = decoders.ByteLevel()
    trainer = tokenizers.trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=list(specials),
                                             initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                             show_progress=False)
    tok.train_from_iterator(corpus if corpus is not None else smoke_corpus(), trainer)
    return tok


def tiny_qwen3(directory, corpus=None, vocab_size: int = 1000, padding_rows: int = 24, seed: int = 0) -> pathlib.Path:
    directory = pathlib.Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    tok = byte_level_bpe(corpus, QWEN3_SPECIALS, vocab_size)
    tok.save(str(directory / "tokenizer.json"))
    (directory / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "Qwen2Tokenizer", "bos_token": None, "eos_token": "<|im_end|>",
        "pad_token": "<|endoftext|>", "unk_token": None, "chat_template": CHAT_TEMPLATES["chatml"]}, indent=1))
    config = transformers.Qwen3Config(vocab_size=tok.get_vocab_size() + padding_rows, rope_theta=1_000_000.0,
                                      tie_word_embeddings=False, **SHAPE)
    _random_weights(transformers.Qwen3ForCausalLM(config), seed, gemma=False).save_pretrained(directory)
    return directory


def tiny_llama3(directory, corpus=None, vocab_size: int = 1000, seed: int = 0) -> pathlib.Path:
    """A random `LlamaForCausalLM` with a byte-level BPE `tokenizer.json` holding Llama 3's special tokens."""
    directory = pathlib.Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    tok = byte_level_bpe(corpus, LLAMA3_SPECIALS, vocab_size)
    tok.save(str(directory / "tokenizer.json"))
    (directory / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "<|begin_of_text|>", "eos_token": "<|eot_id|>",
        "chat_template": CHAT_TEMPLATES["llama3"]}, indent=1))
    config = transformers.LlamaConfig(vocab_size=tok.get_vocab_size(), rope_theta=500_000.0, **SHAPE)
    _random_weights(transformers.LlamaForCausalLM(config), seed, gemma=False).save_pretrained(directory)
    return directory


def tiny_gemma(directory, corpus=None, vocab_size: int = 600, seed: int = 0) -> pathlib.Path:
    directory = pathlib.Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    writer = io.BytesIO()
    spm.SentencePieceTrainer.train(
        sentence_iterator=iter([t for t in (corpus if corpus is not None else smoke_corpus()) if t]),
        model_writer=writer, vocab_size=vocab_size, model_type="bpe", byte_fallback=True, character_coverage=1.0,
        normalization_rule_name="identity", remove_extra_whitespaces=False, add_dummy_prefix=False,
        allow_whitespace_only_pieces=True, split_digits=True, hard_vocab_limit=False,
        user_defined_symbols=["<start_of_turn>", "<end_of_turn>"], pad_id=0, eos_id=1, bos_id=2, unk_id=3,
        pad_piece="<pad>", eos_piece="<eos>", bos_piece="<bos>", unk_piece="<unk>", minloglevel=2)
    (directory / "tokenizer.model").write_bytes(writer.getvalue())
    size = spm.SentencePieceProcessor(model_proto=writer.getvalue()).get_piece_size()
    (directory / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "GemmaTokenizer", "bos_token": "<bos>", "eos_token": "<eos>", "pad_token": "<pad>",
        "unk_token": "<unk>", "add_bos_token": False, "chat_template": CHAT_TEMPLATES["gemma"]}, indent=1))
    config = transformers.GemmaConfig(vocab_size=size, **SHAPE)
    _random_weights(transformers.GemmaForCausalLM(config), seed, gemma=True).save_pretrained(directory)
    return directory


if __name__ == "__main__":
    builders = {"qwen3": tiny_qwen3, "llama3": tiny_llama3, "gemma": tiny_gemma}
    if len(sys.argv) != 3 or sys.argv[1] not in builders:
        sys.exit(f"usage: PYTHONPATH=. python tests/model/tiny_hf.py {'|'.join(builders)} DIR")
    print(builders[sys.argv[1]](sys.argv[2]))
