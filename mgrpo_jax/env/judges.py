"""The reward judges: what decides `r_correct` (is the main agent's answer right?) and `r_expert` (how well did a
sub-agent carry out its delegated sub-task?), for all of a step's cases at once.

A `RewardJudge` gets the step's answered cases in two batches, `correct(answer_cases)` and `expert(sub_task_cases)`,
and returns one score per case; `metrics()` are its figures for the step's log. Two implementations:

  RuleJudge  the offline worlds' rule-based judges (the default): the world's exact-match scorer and its expert judge
             (`ExpertJudge`, `CompactJudge`), case by case, in process.
  HttpJudge  an LLM behind an OpenAI-compatible chat-completions endpoint (`env.judge_url`): the benchmark's own
             judging prompt for correctness (after the exact-match fast path, which needs no call) and the paper's
             sub-task expert score in [0, 1] (`EXPERT_PROMPT`). Calls run concurrently, at most `concurrency` at a
             time, each with the client's timeout and retries. A reply without a strict verdict scores 0 and is logged
             with its case id; an endpoint that stays unavailable raises `JudgeError`, failing the step: a reward of
             0 for every case would train on a silent lie.
"""

from __future__ import annotations

import logging
import time
from collections import Counter
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Protocol

from mgrpo_jax.env.scoring import EXPERT_PROMPT, JudgePrompt, world_answer_correct
from mgrpo_jax.env.services import ChatEndpoint, ServiceError

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class AnswerCase:
    """A top-level episode's final answer to judge against its question's gold answer."""

    id: str  # names the case in logs: "<question id>/rollout<k>"
    question: object  # a `Question` (its `text` and gold `answer`)
    prediction: str


@dataclass(frozen=True)
class SubTaskCase:
    """A sub-agent's answer to the task it was delegated."""

    id: str  # "<question id>/rollout<k>/call<i>"
    question: object  # the `Question` of the rollout (the rule-based judge narrows ambiguous names with it)
    task: str
    answer: str


class RewardJudge(Protocol):
    def correct(self, cases: Sequence[AnswerCase]) -> list[float]:
        """1.0 for a correct answer, else 0.0, per case."""
        ...

    def expert(self, cases: Sequence[SubTaskCase]) -> list[float]:
        """The expert score in [0, 1] per case."""
        ...

    def metrics(self) -> dict[str, float]:
        """Figures since construction (the trainer builds one judge per step), `judge/...` keys; may be empty."""
        ...


class JudgeError(RuntimeError):
    """The judge could not score a step (its endpoint stayed unavailable)."""


@dataclass
class RuleJudge:
    """The offline world's judges: `answer_scorer(prediction, gold)` and `expert_scorer(task, answer, question)`."""

    expert_scorer: Callable[[str, str, object], float]
    answer_scorer: Callable[[str, str], bool] = world_answer_correct

    def correct(self, cases: Sequence[AnswerCase]) -> list[float]:
        return [float(self.answer_scorer(case.prediction, case.question.answer)) for case in cases]

    def expert(self, cases: Sequence[SubTaskCase]) -> list[float]:
        return [float(self.expert_scorer(case.task, case.answer, case.question)) for case in cases]

    def metrics(self) -> dict[str, float]:
        return {}


@dataclass
class HttpJudge:
    """An LLM judge behind `endpoint` (see the module docstring). `fast_path(prediction, gold)` True means correct
    without a call (the benchmarks' exact-match path)."""

    endpoint: ChatEndpoint
    answer_prompt: JudgePrompt
    expert_prompt: JudgePrompt = EXPERT_PROMPT
    concurrency: int = 16
    fast_path: Callable[[str, str], bool] | None = world_answer_correct
    counts: Counter = field(default_factory=Counter)

    def __post_init__(self):
        if self.concurrency < 1:
            raise ValueError(f"concurrency={self.concurrency!r}: must be >= 1")

    def correct(self, cases: Sequence[AnswerCase]) -> list[float]:
        scores: list[float | None] = [
            1.0 if self.fast_path is not None and self.fast_path(case.prediction, case.question.answer) else None
            for case in cases]
        self.counts["fast_path"] += sum(score is not None for score in scores)
        pending = [i for i, score in enumerate(scores) if score is None]
        judged = self._judge("answer", self.answer_prompt, [
            (cases[i].id, {"question": cases[i].question.text, "gold": cases[i].question.answer,
                           "prediction": cases[i].prediction}) for i in pending])
        for i, score in zip(pending, judged, strict=True):
            scores[i] = score
        return scores

    def expert(self, cases: Sequence[SubTaskCase]) -> list[float]:
        return self._judge("sub-task", self.expert_prompt, [
            (case.id, {"question": case.question.text, "task": case.task, "answer": case.answer}) for case in cases])

    def metrics(self) -> dict[str, float]:
        client = self.endpoint.client
        out = {f"judge/{key}": float(self.counts[key]) for key in ("calls", "unparseable", "fast_path")}
        out.update({"judge/retries": float(client.retries), "judge/concurrency": float(self.concurrency),
                    "judge/calls_s": self.counts["seconds"]})
        return out

    def _judge(self, kind: str, prompt: JudgePrompt, requests: list[tuple[str, dict]]) -> list[float]:
        if not requests:
            return []
        start = time.perf_counter()
        with ThreadPoolExecutor(max_workers=min(self.concurrency, len(requests))) as pool:
            futures = [pool.submit(self._one, kind, prompt, case_id, fields) for case_id, fields in requests]
            try:
                replies = [future.result() for future in futures]
            except JudgeError:
                pool.shutdown(wait=True, cancel_futures=True)
                raise
        self.counts["calls"] += len(requests)
        self.counts["seconds"] += time.perf_counter() - start
        scores = []
        for (case_id, _), reply in zip(requests, replies, strict=True):
            verdict = prompt.parse_verdict(reply)
            if verdict is None:
                self.counts["unparseable"] += 1
                log.warning("judge: no %s verdict in the reply for %s %s (scored 0): %.300r", prompt.version, kind,
                            case_id, reply)
            scores.append(0.0 if verdict is None else verdict)
        return scores

    def _one(self, kind: str, prompt: JudgePrompt, case_id: str, fields: dict) -> str:
        try:
            return self.endpoint.complete(*prompt.render(**fields))
        except ServiceError as error:
            raise JudgeError(f"{error}, judging {kind} {case_id}: the step cannot be scored without its judge") \
                from None
