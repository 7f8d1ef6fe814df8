"""One agent's episode in token-in/token-out form, and the result of a batch of whole-system rollouts.

An episode's `tokens` are exactly the ids the model saw and produced: the rendered system and user
messages, then for every turn the assistant header, the sampled ids (ending with the end-of-turn token),
and the rendered tool response. `loss_mask` is 1 exactly on sampled ids, and `logprobs` holds the
sampler's behaviour log-prob of each sampled id (0 elsewhere), so the trainer's importance ratios start
at 1 and nothing is ever re-tokenised from text.

An `Episode` is the trajectory record only: what is judged, trained on, logged and sent between jobs
(`to_json` / `from_json`). What the rollout engine keeps of an episode while it runs it (the delegation it waits
on, its tools' scratch space) is the engine's own (`mgrpo_jax.rollout.engine.EpisodeState`).
"""

from __future__ import annotations

import collections
from dataclasses import dataclass, field

import numpy as np

# Why an episode ended.
ANSWERED = "answer"
FORMAT_ERROR = "format_error"
MAX_TURNS = "max_turns"
CONTEXT_FULL = "context"
TURN_TOO_LONG = "turn_too_long"
END_REASONS = (ANSWERED, FORMAT_ERROR, MAX_TURNS, CONTEXT_FULL, TURN_TOO_LONG)
# `tool_calls[TOOL_ERROR_PREFIX + tool]` counts the calls of `tool` that raised on their model-written arguments
# and were answered with an error by the rollout engine (kept in `tool_calls` so it crosses job boundaries with it).
TOOL_ERROR_PREFIX = "error/"


@dataclass
class Episode:
    """One agent's episode: its tokens, the sampled ids' mask and log-probs, its turns and how it ended."""

    agent: str  # "main", "sub" or "single"
    question_index: int
    rollout: int
    invocation: int = -1  # sub-agent episodes: which delegation of the parent rollout (call order)
    task: str = ""  # sub-agent episodes: the delegated task (and context) text
    call: dict = field(default_factory=dict)  # sub-agent episodes: the delegate call's {"task", "context"}
    tokens: list[int] = field(default_factory=list)
    loss_mask: list[float] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    # The policy version each token was sampled under (0 on tokens not sampled; asynchronous runs, docs/async.md).
    versions: list[int] = field(default_factory=list)
    turns: list[str] = field(default_factory=list)  # decoded assistant turns, for the format gate
    tool_calls: collections.Counter = field(default_factory=collections.Counter)  # tool -> calls; error/<tool>
    answer: str | None = None
    end_reason: str | None = None
    format_error: str | None = None
    subs: list[Episode] = field(default_factory=list)  # main episodes: delegations in call order
    # The distribution its sampled ids were drawn from (set by the rollout engine at each turn): the train step
    # recomputes their log-probs under the same temperature and filters, so these travel with the episode.
    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0

    @property
    def done(self) -> bool:
        return self.end_reason is not None

    @property
    def generated_tokens(self) -> int:
        return int(sum(self.loss_mask))

    def extend(self, ids, *, trained: bool = False, logprobs=None, version: int = 0) -> None:
        ids = [int(i) for i in ids]
        if len(self.versions) < len(self.tokens):  # tokens set directly (e.g. from JSON): version 0 before them
            self.versions.extend([0] * (len(self.tokens) - len(self.versions)))
        self.versions.extend([int(version)] * len(ids))
        self.tokens.extend(ids)
        self.loss_mask.extend([1.0 if trained else 0.0] * len(ids))
        self.logprobs.extend([0.0] * len(ids) if logprobs is None else [float(x) for x in logprobs])

    def to_json(self) -> dict:
        """A sub-agent episode as a JSON object (what crosses a job boundary; `from_json` reads it back). Nested
        `subs` are not kept; `versions` only where one is not 0 (a synchronous run's records stay as they were)."""
        versions = {"versions": self.versions} if any(self.versions) else {}
        return {**versions,"agent": self.agent, "q": self.question_index, "r": self.rollout, "i": self.invocation,
                "task": self.task, "call": self.call, "tokens": self.tokens, "loss_mask": self.loss_mask,
                "logprobs": self.logprobs, "turns": self.turns, "tool_calls": dict(self.tool_calls),
                "answer": self.answer, "end_reason": self.end_reason, "format_error": self.format_error,
                "temperature": self.temperature, "top_k": self.top_k, "top_p": self.top_p}

    @classmethod
    def from_json(cls, entry: dict) -> Episode:
        return cls(agent=entry.get("agent", "sub"), question_index=entry["q"], rollout=entry["r"],
                   invocation=entry["i"], task=entry["task"], call=entry["call"], tokens=entry["tokens"],
                   loss_mask=entry["loss_mask"], logprobs=entry["logprobs"],
                   versions=list(entry.get("versions") or [0] * len(entry["tokens"])), turns=entry["turns"],
                   tool_calls=collections.Counter(entry["tool_calls"]), answer=entry["answer"],
                   end_reason=entry["end_reason"], format_error=entry["format_error"],
                   temperature=float(entry.get("temperature", 1.0)), top_k=int(entry.get("top_k", 0)),
                   top_p=float(entry.get("top_p", 1.0)))

    def arrays(self) -> dict[str, np.ndarray]:
        """The episode as 1-D arrays: tokens, loss_mask, old_logprobs, versions (0 where none were recorded)."""
        versions = np.zeros(len(self.tokens), np.float32)
        versions[:len(self.versions)] = self.versions[:len(self.tokens)]
        return {
            "tokens": np.asarray(self.tokens, np.int32),
            "loss_mask": np.asarray(self.loss_mask, np.float32),
            "old_logprobs": np.asarray(self.logprobs, np.float32),
            "versions": versions,
        }


@dataclass
class RolloutBatch:
    """Q questions x K rollouts of the whole system. `top[q][k]` is the main (or single) agent's episode;
    its delegations are `top[q][k].subs`."""

    questions: list
    top: list[list[Episode]]
    timings: dict[str, float] = field(default_factory=dict)

    @property
    def shape(self) -> tuple[int, int]:
        return len(self.top), len(self.top[0]) if self.top else 0

    def sub_counts(self) -> np.ndarray:
        """d_k for every rollout, [Q, K]."""
        return np.asarray([[len(e.subs) for e in row] for row in self.top], np.int32)

    def episodes(self, agent: str | None = None):
        for row in self.top:
            for episode in row:
                if agent in (None, episode.agent):
                    yield episode
                for sub in episode.subs:
                    if agent in (None, sub.agent):
                        yield sub

    def stats(self) -> dict[str, float]:
        """Counts for the logs: turns, tool calls, end reasons, generated tokens, d_k. Per agent, per episode:

        `<agent>/tool_calls/<tool>`  calls of each tool
        `<agent>/tool_errors`        tool calls that raised on their model-written arguments, which the rollout engine
                                     answered with an error message (always reported; 0 in a healthy run, anything
                                     else is a tool to fix at the source), and `<agent>/tool_errors/<tool>` per tool
        `<agent>/end/<reason>`       the fraction of episodes that ended for each reason
        """
        out: dict[str, float] = {}
        for agent in ("main", "sub", "single"):
            episodes = list(self.episodes(agent))
            if not episodes:
                continue
            out[f"{agent}/episodes"] = len(episodes)
            out[f"{agent}/turns_mean"] = float(np.mean([len(e.turns) for e in episodes]))
            out[f"{agent}/generated_tokens"] = float(sum(e.generated_tokens for e in episodes))
            out[f"{agent}/length_mean"] = float(np.mean([len(e.tokens) for e in episodes]))
            tools = collections.Counter()
            for e in episodes:
                tools.update(e.tool_calls)
            errors = {name[len(TOOL_ERROR_PREFIX):]: count for name, count in tools.items()
                      if name.startswith(TOOL_ERROR_PREFIX)}
            for name, count in sorted(tools.items()):
                if not name.startswith(TOOL_ERROR_PREFIX):
                    out[f"{agent}/tool_calls/{name}"] = count / len(episodes)
            out[f"{agent}/tool_errors"] = sum(errors.values()) / len(episodes)
            for name, count in sorted(errors.items()):
                out[f"{agent}/tool_errors/{name}"] = count / len(episodes)
            reasons = collections.Counter(e.end_reason for e in episodes)
            for reason in END_REASONS:
                out[f"{agent}/end/{reason}"] = reasons.get(reason, 0) / len(episodes)
        counts = self.sub_counts()
        if counts.size and counts.max() > 0:
            out["d_k/mean"] = float(counts.mean())
            out["d_k/max"] = float(counts.max())
        return out
