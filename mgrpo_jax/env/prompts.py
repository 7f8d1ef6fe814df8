"""The text each agent starts from: system prompts (grammar + tools) and first user messages.

The rollout engine and the scripted experts build episodes from these same functions, so a model cloned
from the experts sees at rollout time exactly the prompts it was trained on.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass

from mgrpo_jax.env.protocol import (
    ANSWER_CLOSE,
    ANSWER_OPEN,
    THINK_CLOSE,
    THINK_OPEN,
    TOOL_CALL_CLOSE,
    TOOL_CALL_OPEN,
    TOOL_RESPONSE_CLOSE,
    TOOL_RESPONSE_OPEN,
)
from mgrpo_jax.env.tools import ToolSpec

MAIN, SUB, SINGLE = "main", "sub", "single"
SYSTEM, USER, ASSISTANT, TOOL = "system", "user", "assistant", "tool"

_ROLE_INTRO = {
    MAIN: "You are the planner of a research team. Break the question into focused sub-tasks, delegate "
    "each to a sub-agent, use reason for any calculation or comparison, and give the final answer.",
    SUB: "You are a research assistant. Solve the task you are given by searching the web and visiting "
    "pages, then answer briefly with the fact that was asked for.",
    SINGLE: "You are a researcher. Answer the question by searching the web, visiting pages and using "
    "reason for any calculation or comparison.",
}


@dataclass(frozen=True)
class Message:
    """One chat message: `role` is system, user, assistant or tool; tool messages are already wrapped
    in <tool_response> tags."""

    role: str
    text: str


def system_prompt(agent: str, tools: Sequence[ToolSpec]) -> str:
    tool_lines = "\n".join(json.dumps(spec.to_json(), ensure_ascii=False) for spec in tools)
    return (
        f"{_ROLE_INTRO[agent]}\n\n"
        "Every turn you write is one of:\n"
        f'{THINK_OPEN}your reasoning{THINK_CLOSE}{TOOL_CALL_OPEN}{{"name": "<tool>", "arguments": {{...}}}}'
        f"{TOOL_CALL_CLOSE}\n"
        f"{THINK_OPEN}your reasoning{THINK_CLOSE}{ANSWER_OPEN}the final answer{ANSWER_CLOSE}\n"
        f"Tool results come back as {TOOL_RESPONSE_OPEN}…{TOOL_RESPONSE_CLOSE}. Make exactly one tool call "
        "per turn. Keep the final answer short: a name, a number or a date.\n\n"
        f"Tools:\n{tool_lines}"
    )


def question_prompt(question_text: str) -> str:
    """The first user message of a main-agent or single-agent episode."""
    return f"Question: {question_text}"


def sub_agent_prompt(task: str, context: str = "") -> str:
    """The first user message of a sub-agent episode for `delegate(task, context)`."""
    return f"Task: {task}\nContext: {context}" if context.strip() else f"Task: {task}"
