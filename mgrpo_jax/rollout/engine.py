"""The multi-agent rollout engine: Q questions x K rollouts of the whole system, in lock-step batches.

Each iteration of the loop
  1. samples one turn for every top-level episode (main or single agent) that is not waiting on a
     delegation, in one batch through that agent's sampler;
  2. runs the tools those turns call; a `delegate` call starts a sub-agent episode and parks its parent;
  3. samples one turn for every live sub-agent episode, in one batch through the sub-agent's sampler,
     runs their tools, and hands each finished sub-agent's answer back to its parent as the tool response.
So every pending main turn shares one sampler call and every pending sub turn shares another, and the
samplers see a handful of shape buckets rather than one shape per episode.

Delegations can also be served elsewhere (decoupled mode): a `sub_executor` callable receives each
iteration's newly spawned sub-agent episodes and returns them finished (answer and end reason filled in),
instead of step 3 running them in this process. The sub-agent job runs them with `start_sub` / `run_subs`.

Limits end an episode cleanly and are recorded as its `end_reason`: a turn that breaks the protocol
(`format_error`), the agent's turn limit (`max_turns`), its context budget (`context`), a turn longer
than the per-turn token limit (`turn_too_long`). The per-rollout cap on delegations answers further
`delegate` calls with an error the main agent reads. Model outputs that break the protocol are data for
the reward, never exceptions.

Nothing a model writes can crash a run. The grammars' parsers are total, the tokenizer decodes any ids, and the
tools answer bad arguments with an error message. As a last line of defence, a tool (or the `delegate` argument
reader) that still raises on the arguments a model wrote is answered with `Error: <tool> failed on its
arguments: <ExceptionType>: <message>` (the grammar's `render_tool_error(tool, error)` instead, where it has
one: the compact grammar's `error`), logged once per tool and exception type, and counted in the episode's
`tool_calls` under `error/<tool>` (`RolloutBatch.stats()`: `<agent>/tool_errors`). Only that call is guarded;
an exception anywhere else in the engine is a bug and raises. Every text the engine renders (tool responses,
delegated tasks, sub-agent answers) is made valid Unicode first (`protocol.valid_unicode`).

Each agent may have its own tokenizer (`AgentRuntime.tokenizer`, e.g. its pretrained checkpoint's): an episode is
rendered, sampled and decoded with its agent's, and the text that crosses between agents (a delegated task, a
sub-agent's answer) crosses as text, tokenized by the agent that reads it.
"""

from __future__ import annotations

import logging
import time
import zlib
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from mgrpo_jax.env.grammar import CHAT, Grammar, delegation
from mgrpo_jax.env.prompts import ASSISTANT, SYSTEM, TOOL, USER
from mgrpo_jax.env.protocol import FinalAnswer, FormatError, ToolCall, valid_unicode
from mgrpo_jax.rollout.episode import (
    ANSWERED,
    CONTEXT_FULL,
    FORMAT_ERROR,
    MAX_TURNS,
    TOOL_ERROR_PREFIX,
    TURN_TOO_LONG,
    Episode,
    RolloutBatch,
)

DELEGATE = "delegate"
MAX_ERROR_CHARS = 200  # of an exception's message in the error response

log = logging.getLogger(__name__)


@dataclass
class AgentRuntime:
    """What the engine needs to run one agent: its sampler, its tools and its limits."""

    name: str  # "main", "sub" or "single"
    sampler: object  # `.sample(prompts, max_new=, rng=, temperature=, stop_tokens=, budgets=)`
    system_prompt: str
    # Run in-process as `tool(arguments, session)`; `session` is the episode's own dict (compact `open r2` reads the
    # episode's last search from it). `delegate` is handled by the engine.
    tools: Mapping[str, Callable[[Mapping, dict], str]]
    can_delegate: bool = False
    max_turns: int = 8
    context_tokens: int = 2048
    tokenizer: Any = None  # its own ChatTokenizer (None: the engine's); it renders and reads all of its episodes

    @property
    def tool_names(self) -> tuple[str, ...]:
        return tuple(self.tools) + ((DELEGATE,) if self.can_delegate else ())


@dataclass(frozen=True)
class RolloutLimits:
    max_turn_tokens: int = 128  # new tokens per assistant turn (the sampler's static max_new)
    max_sub_calls: int = 16  # delegations per rollout; further calls get an error response
    min_turn_tokens: int = 8  # a turn needs at least this much context left, else the episode ends
    max_answer_chars: int = 400  # a sub-agent's answer as the main agent sees it
    temperature: float = 1.0


class RolloutEngine:
    def __init__(self, tokenizer, top: AgentRuntime, sub: AgentRuntime | None = None,
                 limits: RolloutLimits | None = None,
                 sub_executor: Callable[[list[Episode], Sequence], list[Episode]] | None = None,
                 grammar: Grammar = CHAT):
        if top.can_delegate and sub is None:
            raise ValueError(f"agent {top.name!r} can delegate but no sub-agent runtime was given")
        self.tokenizer = tokenizer
        self.top = top
        self.sub = sub
        self.limits = limits or RolloutLimits()
        self.grammar = grammar  # how turns parse and how prompts and tool responses are written
        # None: sub-agent turns run here, in lock-step with the top-level turns. Else called as
        # `sub_executor(spawned, questions)` once per iteration; returns the spawned episodes finished.
        self.sub_executor = sub_executor
        self._runtimes = {agent.name: agent for agent in (top, sub) if agent is not None}
        for agent in self._runtimes.values():
            agent.tokenizer = agent.tokenizer or tokenizer
        self._logged_failures: set[tuple[str, str]] = set()

    # -- episode construction ------------------------------------------------------------------------

    def _start(self, agent: AgentRuntime, user_text: str, **fields) -> Episode:
        episode = Episode(agent=agent.name, **fields)
        ids, _ = agent.tokenizer.render_chat([(SYSTEM, agent.system_prompt), (USER, valid_unicode(user_text))])
        episode.extend(ids)
        return episode

    def _respond(self, episode: Episode, output: str) -> None:
        """A tool response (or a sub-agent's answer) to `episode`, tokenized by the episode's own agent."""
        response = self.grammar.render_tool_response(valid_unicode(output))
        episode.extend(self._runtimes[episode.agent].tokenizer.render_message(TOOL, response))

    # -- the loop ------------------------------------------------------------------------------------

    def run(self, questions: Sequence, rollouts: int, seed: int = 0, temperature: float | None = None) -> RolloutBatch:
        """Run `rollouts` whole-system episodes of every question; returns them with timings. `temperature`
        overrides the limits' for this call (0: greedy, e.g. the warm start's format check)."""
        timings = {"sampling_s": 0.0, "tools_s": 0.0}
        temperature = self.limits.temperature if temperature is None else float(temperature)
        top = [
            [self._start(self.top, self.grammar.question_prompt(q.text), question_index=qi, rollout=k)
             for k in range(rollouts)]
            for qi, q in enumerate(questions)
        ]
        live_subs: list[Episode] = []
        iteration = 0
        while True:
            ready = [e for row in top for e in row if not e.done and e.waiting_on is None]
            if not ready and not live_subs:
                break
            if ready:
                spawned = self._turn(self.top, ready, _seed(seed, iteration, "top"), timings, temperature)
                if self.sub_executor is not None and spawned:
                    start = time.perf_counter()
                    for sub in self.sub_executor(spawned, questions):
                        self._return_to_parent(sub, top)
                    timings["remote_subs_s"] = timings.get("remote_subs_s", 0.0) + time.perf_counter() - start
                else:
                    live_subs.extend(spawned)
            if live_subs:
                self._turn(self.sub, live_subs, _seed(seed, iteration, "sub"), timings, temperature)
                for sub in [s for s in live_subs if s.done]:
                    live_subs.remove(sub)
                    self._return_to_parent(sub, top)
            iteration += 1
        return RolloutBatch(list(questions), top, timings)

    def start_sub(self, task: str, context: str = "", **fields) -> Episode:
        """A new sub-agent episode for `delegate(task, context)` (fields: question_index, rollout, invocation)."""
        task, context = valid_unicode(task), valid_unicode(context)
        return self._start(self.sub, self.grammar.sub_agent_prompt(task, context),
                           call={"task": task, "context": context},
                           task=task if not context.strip() else f"{task}\n{context}", **fields)

    def run_subs(self, subs: list[Episode], seed: int = 0, timings: dict | None = None,
                 temperature: float | None = None) -> dict:
        """Runs sub-agent episodes to the end in lock-step batches (the sub-agent job's side); returns timings.
        `temperature` overrides the limits' for this call, as in `run`."""
        timings = {"sampling_s": 0.0, "tools_s": 0.0} if timings is None else timings
        temperature = self.limits.temperature if temperature is None else float(temperature)
        live, iteration = list(subs), 0
        while live:
            self._turn(self.sub, live, _seed(seed, iteration, "sub"), timings, temperature)
            live = [s for s in live if not s.done]
            iteration += 1
        return timings

    def _turn(self, agent: AgentRuntime, episodes: list[Episode], rng: int, timings: dict,
              temperature: float) -> list[Episode]:
        """One sampled turn for each episode; returns the sub-agent episodes the turns started."""
        limits, tokenizer = self.limits, agent.tokenizer
        assistant_prefix = tokenizer.render_turn_prefix(ASSISTANT)
        prompts, budgets, active = [], [], []
        for episode in episodes:
            room = agent.context_tokens - len(episode.tokens) - len(assistant_prefix)
            if room < limits.min_turn_tokens:
                episode.end_reason = CONTEXT_FULL
                continue
            prompts.append(episode.tokens + assistant_prefix)
            budgets.append(min(limits.max_turn_tokens, room))
            active.append(episode)
        if not active:
            return []
        start = time.perf_counter()
        out = agent.sampler.sample(prompts, max_new=limits.max_turn_tokens, rng=rng,
                                   temperature=temperature,
                                   stop_tokens=(tokenizer.end_of_turn_id,),
                                   budgets=budgets)
        timings["sampling_s"] += time.perf_counter() - start

        start = time.perf_counter()
        spawned = []
        top_k, top_p = int(getattr(agent.sampler, "top_k", 0)), float(getattr(agent.sampler, "top_p", 1.0))
        for row, episode in enumerate(active):
            episode.temperature, episode.top_k, episode.top_p = float(temperature), top_k, top_p
            n = int(out.lengths[row])
            ids = out.tokens[row, :n]
            episode.extend(assistant_prefix)
            episode.extend(ids, trained=True, logprobs=out.logprobs[row, :n])
            if not bool(out.stopped[row]):
                episode.turns.append(tokenizer.decode(ids))
                # Cut short by the context budget, or by the per-turn token limit.
                episode.end_reason = CONTEXT_FULL if budgets[row] < limits.max_turn_tokens else TURN_TOO_LONG
                continue
            episode.extend(tokenizer.turn_separator_ids)
            text = tokenizer.decode(ids[:-1])
            episode.turns.append(text)
            spawned.extend(self._act(agent, episode, text))
        timings["tools_s"] += time.perf_counter() - start
        return spawned

    def _act(self, agent: AgentRuntime, episode: Episode, text: str) -> list[Episode]:
        parsed = self.grammar.parse_turn(text, allowed_tools=agent.tool_names)
        if isinstance(parsed, FormatError):
            episode.end_reason = FORMAT_ERROR
            episode.format_error = parsed.reason
            return []
        if isinstance(parsed, FinalAnswer):
            episode.answer = parsed.text
            episode.end_reason = ANSWERED
            return []
        episode.tool_calls[parsed.name] += 1
        spawned = []
        if parsed.name == DELEGATE:
            if len(episode.subs) >= self.limits.max_sub_calls:
                self._respond(episode, f"Error: at most {self.limits.max_sub_calls} delegations per question.")
            else:
                arguments, error = self._guarded(episode, parsed, lambda: delegation(parsed.arguments))
                if error is not None:
                    self._respond(episode, error)
                else:
                    sub = self.start_sub(*arguments, question_index=episode.question_index,
                                         rollout=episode.rollout, invocation=len(episode.subs))
                    episode.subs.append(sub)
                    episode.waiting_on = sub
                    spawned.append(sub)
        else:
            tool = agent.tools[parsed.name]
            output, error = self._guarded(episode, parsed, lambda: tool(parsed.arguments, episode.tool_session))
            self._respond(episode, output if error is None else error)
        if not episode.waiting_on and len(episode.turns) >= agent.max_turns:
            episode.end_reason = MAX_TURNS
        return spawned

    def _guarded(self, episode: Episode, call: ToolCall, run: Callable[[], Any]) -> tuple[Any, str | None]:
        """`(run(), None)`, where `run` is the tool call on a model's parsed arguments; if it raises, `(None, the
        error response the agent reads)`, counted under `error/<tool>` in the episode's `tool_calls`."""
        try:
            return run(), None
        except Exception as error:  # whatever a model wrote, the run goes on (module docstring)
            episode.tool_calls[TOOL_ERROR_PREFIX + call.name] += 1
            kind = type(error).__name__
            if (call.name, kind) not in self._logged_failures:
                self._logged_failures.add((call.name, kind))
                log.warning("tool %s raised on model-written arguments %.200r (answered with an error; logged "
                            "once per tool and exception type)", call.name, call.arguments, exc_info=True)
            render = getattr(self.grammar, "render_tool_error", None)
            if render is not None:
                return None, render(call.name, error)
            message = " ".join(str(error).split())[:MAX_ERROR_CHARS]
            return None, f"Error: {call.name} failed on its arguments: {kind}: {message}"

    def _return_to_parent(self, sub: Episode, top: list[list[Episode]]) -> None:
        parent = top[sub.question_index][sub.rollout]
        parent.waiting_on = None
        if sub.answer is not None:
            report = sub.answer[: self.limits.max_answer_chars]
        else:
            report = self.grammar.no_answer_report(sub.end_reason)
        self._respond(parent, report)
        if len(parent.turns) >= self.top.max_turns:
            parent.end_reason = MAX_TURNS


def _seed(seed: int, iteration: int, role: str) -> int:
    return zlib.crc32(f"{seed}/{iteration}/{role}".encode()) & 0x7FFFFFFF
