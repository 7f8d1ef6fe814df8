"""The compact grammar: one token per tag, argument and value (README, "The compact miniature").

An assistant turn is exactly one bracketed action, its words separated by single spaces:

    main    [ask born_in Varn ]      delegate the lookup `born_in Varn` to the sub-agent
            [calc max 31 17 ]        the calculator (max / min of two numbers)
            [answer Drur ]           the final answer (one word)
    sub     [search born_in Varn ]   -> => r1 Varn city r2 Varn person r3 Kelt person
            [open r2 ]               -> => born_in Drur works_for Lorm age 31
            [answer Drur ]

Tool outputs come back as `=> …`; a question or a delegated task arrives as `? …`. The arity of each action is
part of the grammar (a call with the wrong number of arguments is a format error); whether an argument names
something that exists is the tool's business (it answers `=> error`). Calls parse to the canonical tool and
argument names of the chat grammar, so the tools and the rollout engine do not depend on the grammar.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from mgrpo_jax.env.protocol import (
    BAD_CALL_SCHEMA,
    EMPTY_ANSWER,
    MULTIPLE_ACTIONS,
    NO_ACTION,
    NOT_A_STRING,
    STRAY_TEXT,
    UNBALANCED_TAGS,
    UNKNOWN_TOOL,
    FinalAnswer,
    FormatError,
    ParsedTurn,
    ToolCall,
    valid_unicode,
)

ASK, CALC, SEARCH, OPEN, ANSWER = "[ask", "[calc", "[search", "[open", "[answer"
CLOSE, RESULT, QUESTION = "]", "=>", "?"
OPEN_TAGS = (ASK, CALC, SEARCH, OPEN, ANSWER)
TAGS = (*OPEN_TAGS, CLOSE, RESULT, QUESTION)
NONE = "none"  # a sub-agent's answer when the fact is not found; also what the main agent sees for a failed delegation
ERROR = "error"  # a tool's answer to a call it cannot serve

# tag -> (canonical tool name, argument names joined into that tool's one string argument)
_CALLS = {ASK: ("delegate", "task", 2), CALC: ("reason", "problem", 3), SEARCH: ("search", "query", 2),
          OPEN: ("visit", "url", 1)}
_TAG_OF = {tool: tag for tag, (tool, _, _) in _CALLS.items()}


def render_call(tool: str, *words: str) -> str:
    """`render_call("delegate", "born_in", "Varn")` -> `[ask born_in Varn ]`."""
    tag = _TAG_OF[tool]
    if len(words) != _CALLS[tag][2] or not all(_plain(w) for w in words):
        raise ValueError(f"{tool} takes {_CALLS[tag][2]} plain words, got {words!r}")
    return " ".join((tag, *words, CLOSE))


def render_answer(word: str) -> str:
    if not _plain(word):
        raise ValueError(f"an answer is one plain word, got {word!r}")
    return f"{ANSWER} {word} {CLOSE}"


def _plain(word: str) -> bool:
    return bool(word) and word not in TAGS and not any(c.isspace() for c in word)


class CompactGrammar:
    name = "compact"

    def parse_turn(self, text: Any, *, allowed_tools: Sequence[str] | None = None) -> ParsedTurn:
        if not isinstance(text, str):
            return FormatError(NOT_A_STRING, type(text).__name__)
        words = valid_unicode(text).split()
        if not words:
            return FormatError(NO_ACTION, "empty turn")
        head, body = words[0], words[1:]
        if head not in OPEN_TAGS:
            return FormatError(STRAY_TEXT, f"a turn starts with one of {OPEN_TAGS}, not {head[:20]!r}")
        if CLOSE not in body:
            return FormatError(UNBALANCED_TAGS, f"{head} is never closed")
        close = body.index(CLOSE)
        if close != len(body) - 1:
            extra = body[close + 1:]
            reason = MULTIPLE_ACTIONS if extra[0] in OPEN_TAGS else STRAY_TEXT
            return FormatError(reason, f"text after the action: {' '.join(extra)[:40]!r}")
        arguments = body[:-1]
        if any(word in TAGS for word in arguments):
            return FormatError(UNBALANCED_TAGS, "a tag inside an action")
        if head == ANSWER:
            if len(arguments) != 1:
                return FormatError(EMPTY_ANSWER if not arguments else BAD_CALL_SCHEMA,
                                   f"an answer is one word, got {len(arguments)}")
            return FinalAnswer(arguments[0])
        tool, argument, arity = _CALLS[head]
        if allowed_tools is not None and tool not in allowed_tools:
            return FormatError(UNKNOWN_TOOL, f"{head} is not one of this agent's actions")
        if len(arguments) != arity:
            return FormatError(BAD_CALL_SCHEMA, f"{head} takes {arity} arguments, got {len(arguments)}")
        return ToolCall(tool, {argument: " ".join(arguments)})

    def render_tool_response(self, output: str) -> str:
        return f"{RESULT} {output}"

    def render_tool_error(self, tool: str, error: Exception) -> str:
        """What the agent reads when a tool raised on its arguments (the rollout engine's last line of defence):
        the compact tools' own one-word `error`, not an English message a word-level agent could not read."""
        return ERROR

    def question_prompt(self, question_text: str) -> str:
        return f"{QUESTION} {question_text}"

    def sub_agent_prompt(self, task: str, context: str = "") -> str:
        return f"{QUESTION} {task}"  # a compact task names everything the sub-agent needs

    def no_answer_report(self, end_reason: str | None) -> str:
        return NONE


COMPACT = CompactGrammar()
