"""A Hugging Face checkpoint's own tokenizer behind ``mgrpo_jax.tokenizer.ChatTokenizer``.

    tok = load_checkpoint_tokenizer("gs://bucket/Qwen3-8B", PROTOCOL_TAGS)   # or a local directory

* ``tokenizer.json`` (Qwen2/3, Llama 3 ship only that) is read by the ``tokenizers`` library (``HFTokenizer``);
  else ``tokenizer.model`` by SentencePiece (Gemma, Llama 2; ``mgrpo_jax.tokenizer.Tokenizer``). The control
  tokens (BOS, EOS, padding) are the ones ``tokenizer_config.json`` names, as in ``transformers``.
* The chat template is the family's, found from the special tokens (``detect_chat_format``: ChatML, Gemma,
  Llama 3); ``CHAT_TEMPLATES`` holds the same templates in Jinja for the ``tokenizer_config.json`` of an export,
  so ``transformers``' ``apply_chat_template`` renders the ids this code renders.
* The ``chat`` grammar's tags (``<think>``, ``<tool_call>``, ``<answer>``, ...) must each be one token. A tag the
  vocabulary already has as a single token keeps its id (Qwen3 has ``<tool_call>``, ``<think>``,
  ``<tool_response>``); every other one is appended after the vocabulary (``WithAddedTokens``: ids
  ``base.vocab_size + i``, split out of text before the base tokenizer sees it, as ``transformers`` treats added
  tokens). The model gets rows for them (``mgrpo_jax.agent.pretrained``).

Encoding splits special tokens out first and encodes the pieces between them, so a rendered conversation is the
concatenation of its messages' ids (the rollout engine never re-tokenizes a trajectory).
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Iterable, Sequence

import numpy as np
import tokenizers
from etils import epath

from mgrpo_jax.tokenizer import ChatTokenizer, Tokenizer, _valid_unicode, detect_chat_format

TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "tokenizer_config.json", "special_tokens_map.json")

# The templates detect_chat_format renders, for transformers (roles as there: a tool turn of ChatML is a user turn).
CHAT_TEMPLATES = {
    "mgrpo": (  # the SentencePiece models trained here (mgrpo_jax.tokenizer): one token per turn marker and role
        "{{ bos_token }}{% for message in messages %}"
        "{{ '<|im_start|><|' + message['role'] + '|>' + message['content'] + '<|im_end|>' }}{% endfor %}"
        "{% if add_generation_prompt %}{{ '<|im_start|><|assistant|>' }}{% endif %}"),
    "chatml": (
        "{% for message in messages %}{% set role = 'user' if message['role'] == 'tool' else message['role'] %}"
        "{{ '<|im_start|>' + role + '\n' + message['content'] + '<|im_end|>' + '\n' }}{% endfor %}"
        "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"),
    "gemma": (
        "{{ bos_token }}{% for message in messages %}"
        "{% set role = 'model' if message['role'] == 'assistant' else message['role'] %}"
        "{{ '<start_of_turn>' + role + '\n' + message['content'] + '<end_of_turn>\n' }}{% endfor %}"
        "{% if add_generation_prompt %}{{ '<start_of_turn>model\n' }}{% endif %}"),
    "llama3": (
        "{{ bos_token }}{% for message in messages %}"
        "{% set role = 'ipython' if message['role'] == 'tool' else message['role'] %}"
        "{{ '<|start_header_id|>' + role + '<|end_header_id|>\n\n' + message['content'] + '<|eot_id|>' }}"
        "{% endfor %}{% if add_generation_prompt %}{{ '<|start_header_id|>assistant<|end_header_id|>\n\n' }}"
        "{% endif %}"),
}


def _token_text(entry) -> str | None:
    """A ``tokenizer_config.json`` token entry: a string, or an AddedToken dict with ``content``."""
    return entry.get("content") if isinstance(entry, dict) else entry


class HFTokenizer(ChatTokenizer):
    """A ``tokenizers.Tokenizer`` (``tokenizer.json``) with the control tokens of its ``tokenizer_config.json``."""

    def __init__(self, tokenizer: tokenizers.Tokenizer, config: dict | None = None):
        self.tok = tokenizer
        config = config or {}
        self._size = tokenizer.get_vocab_size(with_added_tokens=True)
        ids = {k: self.piece_id(_token_text(config.get(f"{k}_token")) or "") for k in ("bos", "eos", "pad")}
        self._bos = -1 if ids["bos"] is None else ids["bos"]
        self._eos = -1 if ids["eos"] is None else ids["eos"]
        self._pad = ids["pad"] if ids["pad"] is not None else max(self._eos, 0)
        self.chat_format = detect_chat_format(self)

    @classmethod
    def load(cls, directory: str | os.PathLike) -> HFTokenizer:
        directory = epath.Path(directory)
        config_path = directory / "tokenizer_config.json"
        config = json.loads(config_path.read_text()) if config_path.exists() else {}
        return cls(tokenizers.Tokenizer.from_str((directory / "tokenizer.json").read_text()), config)

    @property
    def vocab_size(self) -> int:
        return self._size

    @property
    def bos_id(self) -> int:
        return self._bos

    @property
    def eos_id(self) -> int:
        return self._eos

    @property
    def pad_id(self) -> int:
        return self._pad

    def piece_id(self, piece: str) -> int | None:
        return self.tok.token_to_id(piece) if piece else None

    def encode(self, text: str) -> list[int]:
        return self.tok.encode(_valid_unicode(text), add_special_tokens=False).ids

    def decode(self, ids: Iterable[int] | np.ndarray) -> str:
        """Ids -> text, special tokens included; an id outside the vocabulary decodes as U+FFFD."""
        flat = [int(i) for i in np.asarray(ids).reshape(-1)]
        return _decode_runs(flat, lambda i: 0 <= i < self._size,
                            lambda run: self.tok.decode(run, skip_special_tokens=False), lambda i: "\ufffd")


def _decode_runs(ids: list[int], is_base, decode_base, other) -> str:
    """Decodes maximal runs of ids the base tokenizer owns in one call each (byte-level pieces of one character may
    span tokens), and every other id on its own."""
    out, run = [], []
    for i in ids:
        if is_base(i):
            run.append(i)
            continue
        if run:
            out.append(decode_base(run))
            run = []
        out.append(other(i))
    if run:
        out.append(decode_base(run))
    return "".join(out)


class WithAddedTokens(ChatTokenizer):
    """``base`` plus tokens appended after its vocabulary (ids ``base.vocab_size + i``), each split out of text
    before ``base`` encodes the rest and decoded back to its text."""

    def __init__(self, base: ChatTokenizer, added: Sequence[str]):
        self.base = base
        self.added = {token: base.vocab_size + i for i, token in enumerate(added)}
        self._text = {i: token for token, i in self.added.items()}
        longest_first = sorted(self.added, key=len, reverse=True)
        self._split = re.compile("(" + "|".join(map(re.escape, longest_first)) + ")") if added else None
        self.chat_format = detect_chat_format(self)

    @property
    def vocab_size(self) -> int:
        return self.base.vocab_size + len(self.added)

    @property
    def bos_id(self) -> int:
        return self.base.bos_id

    @property
    def eos_id(self) -> int:
        return self.base.eos_id

    @property
    def pad_id(self) -> int:
        return self.base.pad_id

    def piece_id(self, piece: str) -> int | None:
        return self.added.get(piece, self.base.piece_id(piece))

    def encode(self, text: str) -> list[int]:
        if self._split is None:
            return self.base.encode(text)
        out: list[int] = []
        for part in self._split.split(_valid_unicode(text)):
            if part in self.added:
                out.append(self.added[part])
            elif part:
                out.extend(self.base.encode(part))
        return out

    def decode(self, ids: Iterable[int] | np.ndarray) -> str:
        flat = [int(i) for i in np.asarray(ids).reshape(-1)]
        return _decode_runs(flat, lambda i: i not in self._text, self.base.decode, self._text.__getitem__)


def load_checkpoint_tokenizer(directory: str | os.PathLike, required: Sequence[str] = ()) -> ChatTokenizer:
    """The tokenizer of an HF checkpoint directory (local or gs://), with every token of ``required`` one token
    (added after the vocabulary where it is not one already). Raises when it has no chat template known here."""
    directory = epath.Path(directory)
    if (directory / "tokenizer.json").exists():
        base: ChatTokenizer = HFTokenizer.load(directory)
    elif (directory / "tokenizer.model").exists():
        base = Tokenizer.load(directory / "tokenizer.model")
    else:
        raise FileNotFoundError(f"{directory}: no tokenizer.json or tokenizer.model")
    if base.chat_format is None:
        raise ValueError(f"{directory}: the tokenizer has no turn markers of a chat template known here (Qwen "
                         "<|im_start|>/<|im_end|>, Gemma <start_of_turn>/<end_of_turn>, Llama 3 header tokens)")
    missing = [token for token in dict.fromkeys(required) if base.piece_id(token) is None]
    return WithAddedTokens(base, missing) if missing else base


def added_tokens(tok: ChatTokenizer) -> dict[str, int]:
    """The tokens ``load_checkpoint_tokenizer`` appended to a checkpoint's vocabulary ({} when none)."""
    return dict(tok.added) if isinstance(tok, WithAddedTokens) else {}


def write_tokenizer_files(tok: ChatTokenizer, source: str | os.PathLike | None, out: str | os.PathLike) -> None:
    """The checkpoint's tokenizer files copied from ``source`` to ``out``, with the appended tokens added (to
    ``tokenizer.json`` and to ``tokenizer_config.json``'s ``added_tokens_decoder``) and the family's chat template
    set, so ``transformers.AutoTokenizer.from_pretrained(out)`` encodes and renders chats as ``tok`` does.
    ``source=None``: ``tok`` is a SentencePiece model trained here, written as ``tokenizer.model`` for
    ``transformers``' ``GemmaTokenizer`` (the same options: no dummy prefix, no normalisation, byte fallback)."""
    out = epath.Path(out)
    out.mkdir(parents=True, exist_ok=True)
    if source is None:
        if not isinstance(tok, Tokenizer):
            raise ValueError("write_tokenizer_files: source=None needs a SentencePiece Tokenizer")
        (out / "tokenizer.model").write_bytes(tok.serialize())
        controls = {"bos_token": tok.bos_id, "eos_token": tok.eos_id, "pad_token": tok.pad_id, "unk_token": tok.unk_id}
        # GemmaTokenizer appends a "<mask>" token unless told there is none: one entry past the model's vocabulary.
        config = {"tokenizer_class": "GemmaTokenizer", "add_bos_token": False, "mask_token": None,
                  **{k: tok.id_to_piece(i) for k, i in controls.items() if i >= 0}}
        if tok.chat_format is not None and tok.chat_format.name in CHAT_TEMPLATES:
            config["chat_template"] = CHAT_TEMPLATES[tok.chat_format.name]
        (out / "tokenizer_config.json").write_text(json.dumps(config, indent=2))
        return
    source = epath.Path(source)
    for name in TOKENIZER_FILES:
        if (source / name).exists() and name != "tokenizer_config.json":
            (out / name).write_bytes((source / name).read_bytes())
    extra = added_tokens(tok)
    config_path = source / "tokenizer_config.json"
    config = json.loads(config_path.read_text()) if config_path.exists() else {}
    decoder = dict(config.get("added_tokens_decoder") or {})
    if (out / "tokenizer.json").exists():
        fast = tokenizers.Tokenizer.from_str((out / "tokenizer.json").read_text())
        fast.add_special_tokens(list(extra))
        if any(fast.token_to_id(t) != i for t, i in extra.items()):
            raise ValueError(f"{source}: tokenizer.json does not give the appended tokens the ids {extra}")
        (out / "tokenizer.json").write_text(fast.to_str())
        # transformers rebuilds e.g. Qwen2Tokenizer from the vocabulary and merges: the added tokens it keeps are
        # the ones this table lists, so it lists all of them.
        added = {i: (t.content, t.special) for i, t in fast.get_added_tokens_decoder().items()}
    else:
        added = {i: (t, True) for t, i in extra.items()}
    for i, (content, special) in sorted(added.items()):
        decoder[str(i)] = {"content": content, "lstrip": False, "normalized": False, "rstrip": False,
                           "single_word": False, "special": special}
    if decoder:
        config["added_tokens_decoder"] = decoder
    fmt = tok.chat_format.name if tok.chat_format is not None else None
    if fmt in CHAT_TEMPLATES and not config.get("chat_template"):
        config["chat_template"] = CHAT_TEMPLATES[fmt]
    (out / "tokenizer_config.json").write_text(json.dumps(config, indent=2))
