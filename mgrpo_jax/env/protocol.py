"""The turn grammar shared by every agent (DESIGN §2), its parser, and the renderers experts use.

An assistant turn is exactly one of

    <think>…</think><tool_call>{"name": "...", "arguments": {...}}</tool_call>
    <think>…</think><answer>…</answer>

with optional whitespace between and around the parts. Tool outputs come back to the agent as
`<tool_response>…</tool_response>`. The think part is mandatory by default so that a cloned policy keeps
its reasoning visible; `parse_turn(..., require_think=False)` relaxes that for other models.

`parse_turn` is total: whatever string a policy samples, it returns a `ToolCall`, a `FinalAnswer` or a
`FormatError`, and never raises. Every string in what it returns is valid Unicode (`valid_unicode`): a JSON
escape such as `"\\ud800"` parses to a lone surrogate, which becomes U+FFFD, so nothing a model writes reaches a
tokenizer (or a UTF-8 writer) as a string that cannot be encoded. The renderers are the only way the scripted
experts produce text, so a demonstration always parses back to the action that produced it.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

THINK_OPEN, THINK_CLOSE = "<think>", "</think>"
TOOL_CALL_OPEN, TOOL_CALL_CLOSE = "<tool_call>", "</tool_call>"
ANSWER_OPEN, ANSWER_CLOSE = "<answer>", "</answer>"
TOOL_RESPONSE_OPEN, TOOL_RESPONSE_CLOSE = "<tool_response>", "</tool_response>"

# Every tag of the grammar, in a fixed order; a tokenizer registers these as special symbols.
PROTOCOL_TAGS: tuple[str, ...] = (
    THINK_OPEN,
    THINK_CLOSE,
    TOOL_CALL_OPEN,
    TOOL_CALL_CLOSE,
    ANSWER_OPEN,
    ANSWER_CLOSE,
    TOOL_RESPONSE_OPEN,
    TOOL_RESPONSE_CLOSE,
)

_TAG_PATTERN = re.compile("|".join(re.escape(tag) for tag in PROTOCOL_TAGS))
_SURROGATE_ESCAPE = re.compile(r"\\u[dD][89a-fA-F]")  # a JSON escape of a UTF-16 surrogate, e.g. \ud800

# Reasons a turn is rejected. They are stable strings so metrics can count them by name.
MISSING_THINK = "missing_think"
NO_ACTION = "no_action"
MULTIPLE_ACTIONS = "multiple_actions"
UNBALANCED_TAGS = "unbalanced_tags"
MISPLACED_TAG = "misplaced_tag"
STRAY_TEXT = "stray_text"
BAD_JSON = "bad_json"
BAD_CALL_SCHEMA = "bad_call_schema"
UNKNOWN_TOOL = "unknown_tool"
EMPTY_ANSWER = "empty_answer"
NOT_A_STRING = "not_a_string"


@dataclass(frozen=True)
class ToolCall:
    """One tool invocation: `name` and its JSON-object `arguments`."""

    name: str
    arguments: Mapping[str, Any]
    think: str = ""


@dataclass(frozen=True)
class FinalAnswer:
    """The agent's final result for its episode (the question's answer, or a sub-agent's report)."""

    text: str
    think: str = ""


@dataclass(frozen=True)
class FormatError:
    """Why a turn does not follow the grammar; `reason` is one of the module's reason constants."""

    reason: str
    detail: str = ""


Action = ToolCall | FinalAnswer
ParsedTurn = ToolCall | FinalAnswer | FormatError


@dataclass(frozen=True)
class _Segment:
    tag: str  # the opening tag, e.g. "<think>"
    body: str


@dataclass
class _Scan:
    segments: list[_Segment] = field(default_factory=list)
    error: FormatError | None = None


_CLOSE_OF = {
    THINK_OPEN: THINK_CLOSE,
    TOOL_CALL_OPEN: TOOL_CALL_CLOSE,
    ANSWER_OPEN: ANSWER_CLOSE,
    TOOL_RESPONSE_OPEN: TOOL_RESPONSE_CLOSE,
}


def _scan(text: str) -> _Scan:
    """Split a turn into top-level tagged segments; anything outside tags must be whitespace."""
    scan = _Scan()
    position = 0
    open_tag: str | None = None
    body_start = 0
    for match in _TAG_PATTERN.finditer(text):
        tag = match.group(0)
        if open_tag is None:
            between = text[position : match.start()]
            if between.strip():
                scan.error = FormatError(STRAY_TEXT, f"text outside tags: {between.strip()[:40]!r}")
                return scan
            if tag not in _CLOSE_OF:
                scan.error = FormatError(UNBALANCED_TAGS, f"{tag} without its opening tag")
                return scan
            open_tag, body_start = tag, match.end()
        else:
            if tag != _CLOSE_OF[open_tag]:
                scan.error = FormatError(UNBALANCED_TAGS, f"{tag} inside {open_tag}")
                return scan
            scan.segments.append(_Segment(open_tag, text[body_start : match.start()]))
            open_tag, position = None, match.end()
    if open_tag is not None:
        scan.error = FormatError(UNBALANCED_TAGS, f"{open_tag} is never closed")
        return scan
    tail = text[position:]
    if tail.strip():
        scan.error = FormatError(STRAY_TEXT, f"text outside tags: {tail.strip()[:40]!r}")
    return scan


def valid_unicode(text: str) -> str:
    """`text` with every lone surrogate (U+D800..U+DFFF, not part of a pair) replaced by U+FFFD; a surrogate pair
    becomes the character it encodes. Such strings come from JSON escapes (`"\\ud800"`) and cannot be encoded as
    UTF-8, so the tokenizer would raise on them. Valid text is returned as is."""
    try:
        text.encode("utf-8")
        return text
    except UnicodeEncodeError:
        return text.encode("utf-16-le", "surrogatepass").decode("utf-16-le", "replace")


def _valid_json(value: Any) -> Any:
    """A parsed JSON value with `valid_unicode` applied to every string in it, keys included."""
    if isinstance(value, str):
        return valid_unicode(value)
    if isinstance(value, list):
        return [_valid_json(item) for item in value]
    if isinstance(value, dict):
        return {valid_unicode(key): _valid_json(item) for key, item in value.items()}
    return value


def _reject_non_finite(token: str) -> float:
    raise ValueError(f"{token} is not valid JSON")


def _parse_call(body: str, allowed_tools: Sequence[str] | None, think: str) -> ToolCall | FormatError:
    try:
        payload = json.loads(body, parse_constant=_reject_non_finite)
        if _SURROGATE_ESCAPE.search(body):  # valid text can only parse to a lone surrogate through an escape
            payload = _valid_json(payload)
    except (ValueError, RecursionError) as error:  # JSONDecodeError is a ValueError; deep nesting recurses
        return FormatError(BAD_JSON, str(error)[:80])
    if not isinstance(payload, dict):
        return FormatError(BAD_CALL_SCHEMA, "the tool call must be a JSON object")
    if set(payload) != {"name", "arguments"}:
        return FormatError(BAD_CALL_SCHEMA, f"keys must be exactly name, arguments; got {sorted(payload)}")
    name, arguments = payload["name"], payload["arguments"]
    if not isinstance(name, str) or not name:
        return FormatError(BAD_CALL_SCHEMA, "name must be a non-empty string")
    if not isinstance(arguments, dict):
        return FormatError(BAD_CALL_SCHEMA, "arguments must be a JSON object")
    if allowed_tools is not None and name not in allowed_tools:
        return FormatError(UNKNOWN_TOOL, f"{name!r} is not one of {list(allowed_tools)}")
    return ToolCall(name=name, arguments=arguments, think=think)


def parse_turn(
    text: Any, *, allowed_tools: Sequence[str] | None = None, require_think: bool = True
) -> ParsedTurn:
    """Parse one assistant turn into a `ToolCall`, a `FinalAnswer` or a `FormatError`; never raises.

    `allowed_tools`, when given, makes a call to any other tool name a format error (the agent's tool set
    is part of its grammar). A `<tool_response>` inside an assistant turn is a format error: only the
    environment writes those.
    """
    if not isinstance(text, str):
        return FormatError(NOT_A_STRING, type(text).__name__)
    scan = _scan(valid_unicode(text))
    if scan.error is not None:
        return scan.error
    segments = scan.segments
    think = ""
    if segments and segments[0].tag == THINK_OPEN:
        think = segments[0].body
        segments = segments[1:]
    elif require_think:
        return FormatError(MISSING_THINK, "the turn must start with <think>…</think>")
    actions = [segment for segment in segments if segment.tag in (TOOL_CALL_OPEN, ANSWER_OPEN)]
    if not actions:
        return FormatError(NO_ACTION, "expected one <tool_call> or <answer>")
    if len(segments) > 1:
        if len(actions) > 1:
            return FormatError(MULTIPLE_ACTIONS, f"{len(actions)} actions in one turn")
        extra = next(segment.tag for segment in segments if segment is not actions[0])
        return FormatError(MISPLACED_TAG, f"unexpected {extra} beside the action")
    (action,) = segments
    if action.tag == ANSWER_OPEN:
        if not action.body.strip():
            return FormatError(EMPTY_ANSWER, "the answer is empty")
        return FinalAnswer(text=action.body.strip(), think=think.strip())
    return _parse_call(action.body, allowed_tools, think.strip())


def trajectory_format_ok(
    turn_texts: Sequence[str], *, allowed_tools: Sequence[str] | None = None, require_think: bool = True
) -> bool:
    """The hard format gate of the rewards: every assistant turn parses, only the last is a final answer.

    An episode cut off by a turn or context limit (no final answer) fails the gate.
    """
    if not turn_texts:
        return False
    parsed = [
        parse_turn(text, allowed_tools=allowed_tools, require_think=require_think) for text in turn_texts
    ]
    if any(isinstance(turn, FormatError) for turn in parsed):
        return False
    return isinstance(parsed[-1], FinalAnswer) and all(isinstance(turn, ToolCall) for turn in parsed[:-1])


def contains_protocol_tag(text: str) -> bool:
    return _TAG_PATTERN.search(text) is not None


def neutralise_tags(text: str) -> str:
    """Escape protocol tags inside untrusted text (web pages, other agents' answers) so it cannot forge
    turn structure; `<answer>` becomes `&lt;answer&gt;`."""
    return _TAG_PATTERN.sub(lambda match: "&lt;" + match.group(0)[1:-1] + "&gt;", text)


def _checked_free_text(what: str, text: str) -> str:
    if contains_protocol_tag(text):
        raise ValueError(f"{what} must not contain protocol tags: {text[:60]!r}")
    return text


def render_tool_call(name: str, arguments: Mapping[str, Any], think: str = "") -> str:
    """The assistant turn that calls `name` with `arguments`; raises ValueError on text that could not
    parse back (a programming error in the caller, not a policy output)."""
    _checked_free_text("think", think)
    if not name:
        raise ValueError("tool name must be non-empty")
    for value in _json_leaves(arguments):
        if isinstance(value, float) and not math.isfinite(value):
            raise ValueError("arguments must be finite JSON")
    payload = json.dumps({"name": name, "arguments": dict(arguments)}, ensure_ascii=False)
    _checked_free_text("tool call", payload)
    return f"{THINK_OPEN}{think}{THINK_CLOSE}{TOOL_CALL_OPEN}{payload}{TOOL_CALL_CLOSE}"


def render_answer(answer: str, think: str = "") -> str:
    """The assistant turn that ends the episode with `answer` (non-empty, no protocol tags)."""
    _checked_free_text("think", think)
    _checked_free_text("answer", answer)
    if not answer.strip():
        raise ValueError("answer must be non-empty")
    return f"{THINK_OPEN}{think}{THINK_CLOSE}{ANSWER_OPEN}{answer}{ANSWER_CLOSE}"


def render_tool_response(output: str) -> str:
    """Wrap a tool's output for the agent; protocol tags inside the output are neutralised."""
    return f"{TOOL_RESPONSE_OPEN}{neutralise_tags(output)}{TOOL_RESPONSE_CLOSE}"


def render_action(action: Action) -> str:
    if isinstance(action, ToolCall):
        return render_tool_call(action.name, action.arguments, action.think)
    return render_answer(action.text, action.think)


def _json_leaves(value: Any):
    if isinstance(value, Mapping):
        for item in value.values():
            yield from _json_leaves(item)
    elif isinstance(value, list | tuple):
        for item in value:
            yield from _json_leaves(item)
    else:
        yield value
