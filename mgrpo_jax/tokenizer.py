"""SentencePiece tokenizer with the agent protocol's special tokens and a chat template.

Two ways to get one:

* ``Tokenizer.train(texts, vocab_size, path)`` trains a byte-fallback BPE model from a text iterator (the
  offline world's corpus). The protocol's special tokens (turn markers, role headers and the protocol tags
  ``<think>``, ``<tool_call>``, ...) are ``user_defined_symbols``: each is always exactly one id, also when it
  appears inside ordinary text, so a sampled ``<answer>`` is one token the parser and the sampler can see.
* ``Tokenizer.load(path)`` loads any SentencePiece ``.model`` (ours, or e.g. Gemma's). A foreign model that
  lacks our turn markers gets its family's template (``detect_chat_format``: Gemma's
  ``<start_of_turn>role\\n ... <end_of_turn>\\n``, ChatML or Llama 3 headers) when it has those pieces; otherwise
  chat rendering is unavailable and raises.

``ChatTokenizer`` is the interface the rest of the code uses; ``mgrpo_jax.tokenizer_hf`` implements it for a
Hugging Face checkpoint's ``tokenizer.json`` (Qwen, Llama 3) and adds tokens a checkpoint lacks.

Chat template (our own models)::

    [<bos>] <|im_start|><|role|> content <|im_end|>   <|im_start|><|role|> content <|im_end|> ...

A message is rendered as ``prefix(role) + encode(content) + [end_of_turn] + separator`` with every piece
tokenised on its own, so a conversation's ids are exactly the concatenation of its messages' ids. This is
what the rollout engine relies on in token-in/token-out mode: it appends ``render_turn_prefix('assistant')``,
then the ids the sampler produced (which end with ``end_of_turn_id``), then ``turn_separator_ids``, then the
next rendered message, and never re-tokenises text. The loss mask covers exactly the tokens an assistant
generates: its content and its end-of-turn token, not the role header or the separator.

Round trip: for models trained here, ``decode(encode(s)) == s`` for every Python string ``s`` that UTF-8 can
encode (identity normalisation, no dummy prefix, no whitespace folding, byte fallback; the whitespace meta symbol
U+2581, which SentencePiece would otherwise turn into a space, is encoded through its UTF-8 byte pieces).

Both directions are total, because model-written text crosses them: ``encode`` replaces a lone surrogate (e.g.
from a JSON ``"\\ud800"`` escape; SentencePiece would raise) with U+FFFD, and ``decode`` takes any ids, an id
outside the vocabulary (a model's padded embedding rows) decoding as the unknown piece and byte pieces that
are not valid UTF-8 as U+FFFD.
"""

from __future__ import annotations

import io
import os
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass

import numpy as np
import sentencepiece as spm
from etils import epath

ROLES: tuple[str, ...] = ("system", "user", "assistant", "tool")

TURN_START = "<|im_start|>"
TURN_END = "<|im_end|>"
ROLE_TOKENS: dict[str, str] = {role: f"<|{role}|>" for role in ROLES}
# The protocol grammar's tags, as `mgrpo_jax.env.protocol.PROTOCOL_TAGS` lists them (same strings, same order, so
# the special-token ids are the same): the tokenizer sits below the environment and does not import it
# (tests/tokenizer checks the two agree).
PROTOCOL_TAGS: tuple[str, ...] = (
    "<think>",
    "</think>",
    "<tool_call>",
    "</tool_call>",
    "<answer>",
    "</answer>",
    "<tool_response>",
    "</tool_response>",
)
SPECIAL_TOKENS: tuple[str, ...] = (TURN_START, TURN_END, *ROLE_TOKENS.values(), *PROTOCOL_TAGS)

# Fixed control ids of models trained here (Gemma's layout).
PAD_ID, EOS_ID, BOS_ID, UNK_ID = 0, 1, 2, 3

_META = "\u2581"  # SentencePiece's whitespace meta symbol.

Message = tuple[str, str]  # (role, text)


def _valid_unicode(text: str) -> str:
    """``text`` with lone surrogates replaced by U+FFFD (``mgrpo_jax.env.protocol.valid_unicode``; repeated here so
    this module imports on its own)."""
    try:
        text.encode("utf-8")
        return text
    except UnicodeEncodeError:
        return text.encode("utf-16-le", "surrogatepass").decode("utf-16-le", "replace")


@dataclass(frozen=True)
class ChatFormat:
    """How turns are delimited for one vocabulary. Prefix/separator ids are precomputed once."""

    name: str
    end_of_turn_id: int
    prefix_ids: dict[str, tuple[int, ...]]
    separator_ids: tuple[int, ...]


def detect_chat_format(tok: ChatTokenizer) -> ChatFormat | None:
    """The chat template a vocabulary supports, found from its special pieces: ours (role tokens), Qwen's ChatML
    (``<|im_start|>role\\n ... <|im_end|>\\n``; a tool turn is a ``user`` turn, as in Qwen's own template), Gemma's
    (``<start_of_turn>role\\n ... <end_of_turn>\\n``; the assistant is ``model``) or Llama 3's
    (``<|start_header_id|>role<|end_header_id|>\\n\\n ... <|eot_id|>``; a tool turn is ``ipython``)."""
    start, end = tok.piece_id(TURN_START), tok.piece_id(TURN_END)
    roles = {r: tok.piece_id(t) for r, t in ROLE_TOKENS.items()}
    if start is not None and end is not None and all(v is not None for v in roles.values()):
        return ChatFormat(
            name="mgrpo",
            end_of_turn_id=end,
            prefix_ids={r: (start, roles[r]) for r in ROLES},
            separator_ids=(),
        )
    if start is not None and end is not None:  # ChatML (Qwen2, Qwen3)
        names = {"system": "system", "user": "user", "assistant": "assistant", "tool": "user"}
        return ChatFormat(name="chatml", end_of_turn_id=end,
                          prefix_ids={r: (start, *tok.encode(names[r] + "\n")) for r in ROLES},
                          separator_ids=tuple(tok.encode("\n")))
    g_start, g_end = tok.piece_id("<start_of_turn>"), tok.piece_id("<end_of_turn>")
    if g_start is not None and g_end is not None:  # Gemma's template; its roles are user/model.
        names = {"system": "system", "user": "user", "assistant": "model", "tool": "tool"}
        return ChatFormat(
            name="gemma",
            end_of_turn_id=g_end,
            prefix_ids={r: (g_start, *tok.encode(names[r] + "\n")) for r in ROLES},
            separator_ids=tuple(tok.encode("\n")),
        )
    h_start, h_end, eot = (tok.piece_id(p) for p in ("<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"))
    if h_start is not None and h_end is not None and eot is not None:  # Llama 3
        names = {"system": "system", "user": "user", "assistant": "assistant", "tool": "ipython"}
        return ChatFormat(name="llama3", end_of_turn_id=eot,
                          prefix_ids={r: (h_start, *tok.encode(names[r]), h_end, *tok.encode("\n\n"))
                                      for r in ROLES},
                          separator_ids=())
    return None


class ChatTokenizer:
    """What the rollout engine, the warm start and the batches need of a tokenizer, whatever its implementation
    (SentencePiece: ``Tokenizer``; Hugging Face ``tokenizers``: ``mgrpo_jax.tokenizer_hf``). A subclass provides
    ``encode``, ``decode``, ``piece_id``, ``vocab_size``, ``bos_id`` / ``eos_id`` / ``pad_id`` and sets
    ``chat_format`` (``detect_chat_format(self)``); the chat template is rendered here, the same way for all."""

    chat_format: ChatFormat | None = None

    def encode(self, text: str) -> list[int]:
        raise NotImplementedError

    def decode(self, ids: Iterable[int] | np.ndarray) -> str:
        raise NotImplementedError

    def piece_id(self, piece: str) -> int | None:
        raise NotImplementedError

    @property
    def end_of_turn_id(self) -> int:
        return self._require_chat().end_of_turn_id

    @property
    def stop_ids(self) -> tuple[int, ...]:
        """Ids that end an assistant turn when sampling: end-of-turn and end-of-sequence."""
        ids = [self.end_of_turn_id]
        if self.eos_id >= 0 and self.eos_id not in ids:
            ids.append(self.eos_id)
        return tuple(ids)

    def token_id(self, special: str) -> int:
        """Id of a special token (e.g. ``'<answer>'``); raises if it is not a single piece here."""
        pid = self.piece_id(special)
        if pid is None:
            raise KeyError(f"{special!r} is not a single token of this vocabulary")
        return pid

    @property
    def has_protocol_tokens(self) -> bool:
        return all(self.piece_id(s) is not None for s in SPECIAL_TOKENS)

    # ------------------------------------------------------------------ chat template
    def _require_chat(self) -> ChatFormat:
        if self.chat_format is None:
            raise ValueError("this vocabulary has no turn markers (ours, ChatML, Gemma or Llama 3)")
        return self.chat_format

    def render_turn_prefix(self, role: str) -> list[int]:
        """Ids of a turn's header (start marker + role); the model generates what follows."""
        if role not in ROLES:
            raise ValueError(f"unknown role {role!r}; expected one of {ROLES}")
        return list(self._require_chat().prefix_ids[role])

    @property
    def turn_separator_ids(self) -> list[int]:
        """Ids that follow an end-of-turn token before the next turn (empty for our own template)."""
        return list(self._require_chat().separator_ids)

    def render_message(self, role: str, text: str) -> list[int]:
        """One complete message: prefix + content + end-of-turn + separator."""
        fmt = self._require_chat()
        return [*self.render_turn_prefix(role), *self.encode(text), fmt.end_of_turn_id, *fmt.separator_ids]

    def render_message_with_mask(self, role: str, text: str) -> tuple[list[int], list[bool]]:
        """``render_message`` plus the loss mask: True on an assistant's content and end-of-turn token."""
        fmt = self._require_chat()
        prefix, content = self.render_turn_prefix(role), self.encode(text)
        ids = [*prefix, *content, fmt.end_of_turn_id, *fmt.separator_ids]
        trained = role == "assistant"
        mask = [False] * len(prefix) + [trained] * (len(content) + 1) + [False] * len(fmt.separator_ids)
        return ids, mask

    def render_chat(
        self, messages: Sequence[Message], *, add_bos: bool = True, add_generation_prompt: bool = False
    ) -> tuple[list[int], list[bool]]:
        """Render ``[(role, text), ...]`` to ``(ids, assistant_mask)``.

        The mask is True exactly on tokens an assistant generated (its content and its end-of-turn token).
        With ``add_generation_prompt`` the assistant's turn prefix is appended, ready for sampling.
        """
        ids: list[int] = []
        mask: list[bool] = []
        if add_bos and self.bos_id >= 0:
            ids.append(self.bos_id)
            mask.append(False)
        for role, text in messages:
            m_ids, m_mask = self.render_message_with_mask(role, text)
            ids.extend(m_ids)
            mask.extend(m_mask)
        if add_generation_prompt:
            prefix = self.render_turn_prefix("assistant")
            ids.extend(prefix)
            mask.extend([False] * len(prefix))
        return ids, mask



class Tokenizer(ChatTokenizer):
    """A SentencePiece processor plus the protocol's special tokens and chat template."""

    def __init__(self, processor: spm.SentencePieceProcessor, model_proto: bytes | None = None):
        self.sp = processor
        self._proto = model_proto if model_proto is not None else processor.serialized_model_proto()
        self._unk = processor.unk_id()
        self._meta_byte_ids = self._byte_ids(_META.encode("utf-8"))
        self.chat_format = detect_chat_format(self)

    # ------------------------------------------------------------------ construction
    @classmethod
    def load(cls, path: str | os.PathLike) -> Tokenizer:
        """Load any SentencePiece ``.model`` file (a local path or a gs:// URL)."""
        return cls.from_bytes(epath.Path(path).read_bytes())

    @classmethod
    def from_bytes(cls, model_proto: bytes) -> Tokenizer:
        return cls(spm.SentencePieceProcessor(model_proto=model_proto), model_proto)

    def serialize(self) -> bytes:
        """The model proto; ``Tokenizer.from_bytes(t.serialize())`` gives the same tokenizer."""
        return self._proto

    def save(self, path: str | os.PathLike) -> None:
        """Writes the model proto to ``path`` (local or ``gs://``)."""
        epath.Path(path).write_bytes(self._proto)

    @classmethod
    def train(
        cls,
        texts: Iterable[str],
        vocab_size: int,
        path: str | os.PathLike | None = None,
        *,
        model_type: str = "bpe",
        extra_symbols: Sequence[str] = (),
        character_coverage: float = 1.0,
        max_sentence_length: int = 1 << 16,
        input_sentence_size: int = 0,
        num_threads: int = 1,
        **trainer_kwargs,
    ) -> Tokenizer:
        """Train a byte-fallback model from an iterator of texts; optionally also write it to ``path``.

        ``vocab_size`` must leave room for the 4 control ids, the 256 byte pieces and the special tokens.
        ``hard_vocab_limit`` is off, so a tiny corpus yields a smaller vocabulary rather than an error; read
        ``tokenizer.vocab_size`` for the real size. Extra keyword arguments go to the SentencePiece trainer.
        """
        symbols = list(dict.fromkeys([*SPECIAL_TOKENS, *extra_symbols]))
        minimum = 4 + 256 + len(symbols) + 1
        if vocab_size < minimum:
            raise ValueError(f"vocab_size {vocab_size} < {minimum} (controls + 256 bytes + special tokens)")

        def sentences() -> Iterator[str]:
            for text in texts:
                if text:
                    yield text

        writer = io.BytesIO()
        options = dict(
            sentence_iterator=sentences(),
            model_writer=writer,
            vocab_size=vocab_size,
            model_type=model_type,
            byte_fallback=True,
            character_coverage=character_coverage,
            normalization_rule_name="identity",
            remove_extra_whitespaces=False,
            add_dummy_prefix=False,
            allow_whitespace_only_pieces=True,
            split_digits=True,
            user_defined_symbols=symbols,
            pad_id=PAD_ID,
            eos_id=EOS_ID,
            bos_id=BOS_ID,
            unk_id=UNK_ID,
            max_sentence_length=max_sentence_length,
            input_sentence_size=input_sentence_size,
            shuffle_input_sentence=False,
            hard_vocab_limit=False,
            num_threads=num_threads,
            minloglevel=2,
        )
        options.update(trainer_kwargs)
        spm.SentencePieceTrainer.train(**options)
        tok = cls.from_bytes(writer.getvalue())
        if path is not None:
            tok.save(path)
        return tok

    # ------------------------------------------------------------------ vocabulary
    @property
    def vocab_size(self) -> int:
        return self.sp.get_piece_size()

    @property
    def pad_id(self) -> int:
        pid = self.sp.pad_id()
        return pid if pid >= 0 else 0

    @property
    def bos_id(self) -> int:
        return self.sp.bos_id()

    @property
    def eos_id(self) -> int:
        return self.sp.eos_id()

    @property
    def unk_id(self) -> int:
        return self._unk

    def piece_id(self, piece: str) -> int | None:
        """Id of a piece that is a single token in this vocabulary, else None."""
        pid = self.sp.piece_to_id(piece)
        if pid == self._unk and piece != self.sp.id_to_piece(self._unk):
            return None
        return pid

    def id_to_piece(self, i: int) -> str:
        return self.sp.id_to_piece(int(i))

    # ------------------------------------------------------------------ encode / decode
    def _byte_ids(self, data: bytes) -> list[int] | None:
        ids = [self.sp.piece_to_id(f"<0x{b:02X}>") for b in data]
        return None if any(i == self._unk for i in ids) else ids

    def encode(self, text: str) -> list[int]:
        """Text -> ids, no BOS/EOS. Special tokens in the text become their single ids; a lone surrogate is
        encoded as U+FFFD."""
        text = _valid_unicode(text)
        if _META not in text or self._meta_byte_ids is None:
            return list(self.sp.encode(text))
        out: list[int] = []
        for i, part in enumerate(text.split(_META)):
            if i:
                out.extend(self._meta_byte_ids)
            if part:
                out.extend(self.sp.encode(part))
        return out

    def decode(self, ids: Iterable[int] | np.ndarray) -> str:
        """Ids -> text. Control ids (pad/bos/eos) decode to nothing, ids outside the vocabulary (which
        SentencePiece would raise on) as the unknown piece."""
        size = self.vocab_size
        return self.sp.decode([i if 0 <= i < size else self._unk for i in map(int, np.asarray(ids).reshape(-1))])
