"""Tokenizer: training, round trips, special tokens, chat template and loss mask."""

import io

import hypothesis.strategies as st
import numpy as np
import pytest
import sentencepiece as spm
from hypothesis import given

from mgrpo_jax import tokenizer as tk
from mgrpo_jax.tokenizer import PROTOCOL_TAGS, ROLES, SPECIAL_TOKENS, Tokenizer

CORPUS = [
    "The capital of Veldoria is Marrenport, founded in 1832 by the Ostrel company.",
    "<think>I should search for the founder.</think><tool_call>{\"name\": \"search\", "
    "\"arguments\": {\"query\": \"Marrenport founder\"}}</tool_call>",
    "<tool_response>Marrenport - a harbour city. Population 412,000.</tool_response>",
    "<think>Done.</think><answer>412000</answer>",
    "Grüße aus Köln — 東京 と 大阪, naïve café. 3.14159 + 2.71828 = 5.85987",
] * 50


@pytest.fixture(scope="module")
def tok(tmp_path_factory):
    path = tmp_path_factory.mktemp("tok") / "world.model"
    t = Tokenizer.train(iter(CORPUS), vocab_size=600, path=str(path))
    assert path.exists()
    return t


def test_train_and_load_agree(tok, tmp_path):
    path = tmp_path / "copy.model"
    tok.save(path)
    loaded = Tokenizer.load(path)
    assert loaded.vocab_size == tok.vocab_size
    text = CORPUS[1] + CORPUS[4]
    assert loaded.encode(text) == tok.encode(text)
    assert Tokenizer.from_bytes(tok.serialize()).encode(text) == tok.encode(text)


def test_control_ids(tok):
    assert (tok.pad_id, tok.eos_id, tok.bos_id, tok.unk_id) == (0, 1, 2, 3)
    assert tok.end_of_turn_id == tok.token_id(tk.TURN_END)
    assert tok.stop_ids == (tok.end_of_turn_id, tok.eos_id)
    assert tok.has_protocol_tokens
    assert 300 < tok.vocab_size <= 600


def test_special_tokens_are_single_ids(tok):
    ids = {tok.token_id(s) for s in SPECIAL_TOKENS}
    assert len(ids) == len(SPECIAL_TOKENS)
    for s in SPECIAL_TOKENS:
        assert tok.encode(s) == [tok.token_id(s)]
        assert tok.decode([tok.token_id(s)]) == s
        # Also inside running text, glued to other characters.
        ids_in_text = tok.encode("abc" + s + "xyz")
        assert tok.token_id(s) in ids_in_text
    assert set(PROTOCOL_TAGS) >= {"<think>", "</think>", "<tool_call>", "</tool_call>", "<tool_response>",
                                  "</tool_response>", "<answer>", "</answer>"}


def test_protocol_tags_are_the_environments_in_its_order():
    """The tokenizer repeats the grammar's tags (it sits below mgrpo_jax.env and does not import it)."""
    from mgrpo_jax.env.protocol import PROTOCOL_TAGS as env_tags

    assert tuple(env_tags) == PROTOCOL_TAGS


@given(st.text(max_size=200))
def test_round_trip_any_unicode(tok, text):
    assert tok.decode(tok.encode(text)) == text


@given(st.lists(st.sampled_from([*SPECIAL_TOKENS, "\u2581", " ", "\n", "a", "é", "\U0001d11e", "12"]),
                max_size=30))
def test_round_trip_special_and_meta(tok, parts):
    text = "".join(parts)
    assert tok.decode(tok.encode(text)) == text


def test_round_trip_meta_symbol(tok):
    s = "a\u2581b \u2581\u2581 c\u2581"
    assert tok.decode(tok.encode(s)) == s


def test_encode_replaces_lone_surrogates(tok):
    """SentencePiece raises on a lone surrogate (e.g. from a JSON `"\\ud800"` a model wrote); encode never does."""
    assert tok.encode("a\ud800b") == tok.encode("a\ufffdb")
    assert tok.decode(tok.encode("\udfff")) == "\ufffd"
    ids, _ = tok.render_chat([("tool", "x\ud800")])
    assert "x\ufffd" in tok.decode(ids)


def test_decode_takes_ids_outside_the_vocabulary(tok):
    """A model's embedding can be padded past the tokenizer's pieces; SentencePiece raises on those ids."""
    unknown = tok.decode([tok.unk_id])
    assert tok.decode([tok.vocab_size, -1, tok.vocab_size + 100]) == unknown * 3
    assert tok.decode(np.array([*tok.encode("hi"), tok.vocab_size], np.int32)) == "hi" + unknown


@given(st.lists(st.integers(-3, 800), max_size=60))
def test_decode_is_total_and_valid_unicode(tok, ids):
    """Any ids, byte pieces that are not valid UTF-8 included (they decode as U+FFFD)."""
    tok.decode(ids).encode("utf-8")


def test_decode_of_broken_utf8_byte_pieces(tok):
    pieces = [tok.token_id(f"<0x{b:02X}>") for b in (0xED, 0xA0, 0x80, 0xC3)]  # an encoded surrogate, a cut é
    assert set(tok.decode(pieces)) == {"\ufffd"}


def test_decode_skips_controls(tok):
    ids = [tok.bos_id, *tok.encode("hi"), tok.eos_id, tok.pad_id, tok.pad_id]
    assert tok.decode(ids) == "hi"
    assert tok.decode(np.array(ids, np.int32)) == "hi"


CHAT = [
    ("system", "You are the planner."),
    ("user", "What is the population of Marrenport?"),
    ("assistant", "<think>search</think><tool_call>{\"name\": \"search\"}</tool_call>"),
    ("tool", "<tool_response>Population 412,000.</tool_response>"),
    ("assistant", "<answer>412000</answer>"),
]


def test_render_chat_mask(tok):
    ids, mask = tok.render_chat(CHAT)
    assert len(ids) == len(mask)
    assert ids[0] == tok.bos_id and not mask[0]
    masked = [i for i, m in zip(ids, mask, strict=True) if m]
    expected = []
    for role, text in CHAT:
        if role == "assistant":
            expected += tok.encode(text) + [tok.end_of_turn_id]
    assert masked == expected
    # Role headers are never trained on.
    for i, m in zip(ids, mask, strict=True):
        if i in (tok.token_id(tk.TURN_START), *(tok.token_id(t) for t in tk.ROLE_TOKENS.values())):
            assert not m
    # Mask is exactly the contiguous assistant spans.
    spans = np.flatnonzero(np.diff(np.array([0, *mask, 0], np.int8)))
    assert len(spans) == 4
    assert tok.decode([i for i, m in zip(ids, mask, strict=True) if m]) == (
        CHAT[2][1] + tk.TURN_END + CHAT[4][1] + tk.TURN_END)


def test_render_chat_equals_incremental_pieces(tok):
    ids, _ = tok.render_chat(CHAT, add_generation_prompt=True)
    pieces = [tok.bos_id]
    for role, text in CHAT:
        if role == "assistant":  # The rollout engine's path: prefix + sampled ids + separator.
            pieces += tok.render_turn_prefix("assistant")
            pieces += tok.encode(text) + [tok.end_of_turn_id]
            pieces += tok.turn_separator_ids
        else:
            pieces += tok.render_message(role, text)
    pieces += tok.render_turn_prefix("assistant")
    assert ids == pieces
    assert tok.render_chat(CHAT, add_bos=False)[0] == ids[1:-len(tok.render_turn_prefix("assistant"))]


@given(st.lists(st.tuples(st.sampled_from(ROLES), st.text(max_size=40)), max_size=6))
def test_render_chat_properties(tok, messages):
    ids, mask = tok.render_chat(messages, add_bos=False)
    flat = []
    for role, text in messages:
        flat += tok.render_message(role, text)
    assert ids == flat
    n_assistant = sum(len(tok.encode(t)) + 1 for r, t in messages if r == "assistant")
    assert sum(mask) == n_assistant


def test_unknown_role(tok):
    with pytest.raises(ValueError):
        tok.render_turn_prefix("robot")


def test_vocab_too_small():
    with pytest.raises(ValueError):
        Tokenizer.train(iter(CORPUS), vocab_size=100)


def test_gemma_style_vocabulary():
    """A foreign vocabulary with Gemma's turn markers gets Gemma's template."""
    w = io.BytesIO()
    spm.SentencePieceTrainer.train(
        sentence_iterator=iter(CORPUS), model_writer=w, vocab_size=400, model_type="bpe", byte_fallback=True,
        user_defined_symbols=["<start_of_turn>", "<end_of_turn>"], pad_id=0, eos_id=1, bos_id=2, unk_id=3,
        add_dummy_prefix=False, normalization_rule_name="identity", remove_extra_whitespaces=False,
        hard_vocab_limit=False, minloglevel=2)  # Gemma's vocabulary keeps newlines, like this one.
    g = Tokenizer.from_bytes(w.getvalue())
    assert g.chat_format.name == "gemma" and not g.has_protocol_tokens
    ids, mask = g.render_chat([("user", "hi"), ("assistant", "ok")])
    assert g.decode(ids) == "<start_of_turn>user\nhi<end_of_turn>\n<start_of_turn>model\nok<end_of_turn>\n"
    assert g.decode([i for i, m in zip(ids, mask, strict=True) if m]) == "ok<end_of_turn>"


def test_no_chat_format_raises():
    w = io.BytesIO()
    spm.SentencePieceTrainer.train(
        sentence_iterator=iter(CORPUS), model_writer=w, vocab_size=400, model_type="bpe", byte_fallback=True,
        hard_vocab_limit=False, minloglevel=2)
    plain = Tokenizer.from_bytes(w.getvalue())
    assert plain.chat_format is None
    with pytest.raises(ValueError):
        plain.render_chat([("user", "hi")])
