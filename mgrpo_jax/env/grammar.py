"""The turn grammars behind one interface: `chat` (Qwen-style tags with JSON tool calls) and `compact`.

`chat` is the grammar of `mgrpo_jax.env.protocol` and `mgrpo_jax.env.prompts`, for pretrained checkpoints and
the pod-scale presets. `compact` (`mgrpo_jax.env.compact.grammar`) writes one token per tag, argument and value,
e.g. `[ask born_in Varn ]`, so agents of a few hundred thousand parameters can learn it on a laptop CPU
(README, "The compact miniature"). The rollout engine, the rewards' format gate and the experts only talk to a
`Grammar`:

    grammar = get_grammar(config.env.grammar)
    parsed = grammar.parse_turn(text, allowed_tools=("delegate", "reason"))   # ToolCall | FinalAnswer | FormatError

Both parsers are total: whatever a policy samples becomes a `FormatError` at worst, never an exception.
Tool calls parse to the canonical tool names (`delegate`, `reason`, `search`, `visit`) and argument names
(`task`, `context`, `problem`, `query`, `url`) in both grammars, so tools and the engine are grammar-free.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, Protocol

from mgrpo_jax.env import protocol
from mgrpo_jax.env.protocol import FinalAnswer, FormatError, ParsedTurn, ToolCall


class Grammar(Protocol):
    name: str

    def parse_turn(self, text: Any, *, allowed_tools: Sequence[str] | None = None) -> ParsedTurn: ...

    def render_tool_response(self, output: str) -> str: ...

    def render_tool_error(self, tool: str, error: Exception) -> str: ...

    def question_prompt(self, question_text: str) -> str: ...

    def sub_agent_prompt(self, task: str, context: str = "") -> str: ...

    def no_answer_report(self, end_reason: str | None) -> str: ...


def trajectory_format_ok(grammar: Grammar, turn_texts: Sequence[str], *,
                         allowed_tools: Sequence[str] | None = None) -> bool:
    """The rewards' hard format gate in any grammar: every assistant turn parses, only the last one is a final
    answer. An episode cut off by a turn or context limit (no final answer) fails the gate."""
    if not turn_texts:
        return False
    parsed = [grammar.parse_turn(text, allowed_tools=allowed_tools) for text in turn_texts]
    if any(isinstance(turn, FormatError) for turn in parsed):
        return False
    return isinstance(parsed[-1], FinalAnswer) and all(isinstance(turn, ToolCall) for turn in parsed[:-1])


def delegation(arguments: Mapping[str, Any]) -> tuple[str, str]:
    """(task, context) of a `delegate` call's arguments, as strings."""
    return str(arguments.get("task", "")), str(arguments.get("context", ""))


MAX_ERROR_CHARS = 200  # of an exception's message in a tool error's response


class ChatGrammar:
    """`<think>…</think><tool_call>{json}</tool_call>` turns (mgrpo_jax.env.protocol)."""

    name = "chat"

    def parse_turn(self, text: Any, *, allowed_tools: Sequence[str] | None = None) -> ParsedTurn:
        return protocol.parse_turn(text, allowed_tools=allowed_tools)

    def render_tool_response(self, output: str) -> str:
        return protocol.render_tool_response(output)

    def render_tool_error(self, tool: str, error: Exception) -> str:
        """What the agent reads when a tool raised on its arguments: the exception's type and message, on one line."""
        message = " ".join(str(error).split())[:MAX_ERROR_CHARS]
        return f"Error: {tool} failed on its arguments: {type(error).__name__}: {message}"

    def question_prompt(self, question_text: str) -> str:
        from mgrpo_jax.env.prompts import question_prompt

        return question_prompt(question_text)

    def sub_agent_prompt(self, task: str, context: str = "") -> str:
        from mgrpo_jax.env.prompts import sub_agent_prompt

        return sub_agent_prompt(task, context)

    def no_answer_report(self, end_reason: str | None) -> str:
        return f"The sub-agent returned no answer (it stopped: {end_reason})."


CHAT = ChatGrammar()
GRAMMARS = ("chat", "compact")


def get_grammar(name: str) -> Grammar:
    if name == "chat":
        return CHAT
    if name == "compact":
        from mgrpo_jax.env.compact.grammar import COMPACT

        return COMPACT
    raise ValueError(f"config.env.grammar={name!r} is not one of {GRAMMARS}")
