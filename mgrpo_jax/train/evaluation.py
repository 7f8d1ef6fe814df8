"""Evaluation (avg@runs accuracy on held-out sets) and the transcripts a run logs for inspection."""

from __future__ import annotations

import functools
import json
import logging
import types

import numpy as np

from mgrpo_jax.env.benchmarks import load_benchmark
from mgrpo_jax.env.scoring import score_benchmark_answer, world_answer_correct
from mgrpo_jax.train import files
from mgrpo_jax.train.progress import RunProgress
from mgrpo_jax.train.seeds import derive_seed

log = logging.getLogger(__name__)

EVAL_SETS = ("eval_gaia", "eval_xbench", "eval_webwalker")


def _score_record(benchmark: str, prediction: str, gold: str) -> bool:
    # No LLM judge is configured offline: XBench / WebWalkerQA fall back to their exact-match paths.
    return score_benchmark_answer(benchmark, "", gold, prediction, judge=None)


def evaluation_sets(config, env) -> dict:
    """{name: (questions, scorer)}: the offline world's three held-out sets, plus the real benchmark's
    records when `config.env.benchmark_path` names its files (scored by that benchmark's own rule)."""
    limit = config.train.eval_questions or None
    sets = {name: (list(env.questions.split(name))[:limit], world_answer_correct) for name in EVAL_SETS}
    path = config.env.benchmark_path
    if path:
        benchmark = config.benchmark
        records = [r for r in load_benchmark(benchmark, path) if r.answer is not None][:limit]
        questions = [types.SimpleNamespace(text=r.question, answer=r.answer, id=r.id) for r in records]
        sets[f"{benchmark}_file"] = (questions, functools.partial(_score_record, benchmark))
    return sets


def evaluate(config, env, engine, step: int, progress: RunProgress | None = None) -> dict:
    """`eval/<set>/accuracy`: avg@`train.eval_runs` accuracy on each evaluation set, sampled at the rollout
    temperature by the whole system. With `progress`, a bar over the sets' questions and a log line per set."""
    out, sets = {}, evaluation_sets(config, env)
    bar = (progress or RunProgress(enabled=False)).phase(f"eval at step {step}", sum(len(q) for q, _ in sets.values()))
    for name, (questions, scorer) in sets.items():
        if not questions:  # a world too small to draw this set
            log.warning("evaluation set %s is empty; skipped", name)
            continue
        result = engine.run(questions, config.train.eval_runs, seed=derive_seed(config.seed, "eval", step, name))
        correct = [float(e.answer is not None and scorer(e.answer, questions[e.question_index].answer))
                   for row in result.top for e in row]
        out[f"eval/{name}/accuracy"] = float(np.mean(correct))
        bar.update(bar.done + len(questions), accuracy=out[f"eval/{name}/accuracy"])
        log.info("eval at step %d: %s accuracy %.3f (avg@%d over %d questions) | %s", step, name,
                 out[f"eval/{name}/accuracy"], config.train.eval_runs, len(questions), bar.line())
    bar.close()
    return out


def log_transcripts(path: str, rollout, step: int, count: int) -> None:
    """A few whole-system rollouts as text (main turns, delegated tasks, sub-agent answers), appended to `path`."""
    if not count:
        return
    with files.AppendFile(path) as f:
        for episode in [e for row in rollout.top for e in row][:count]:
            question = rollout.questions[episode.question_index]
            record = {"step": step, "question": question.text, "gold": question.answer, "answer": episode.answer,
                      "end_reason": episode.end_reason, "turns": episode.turns,
                      "delegations": [{"task": s.task, "answer": s.answer, "end_reason": s.end_reason,
                                       "turns": s.turns} for s in episode.subs]}
            f.write(json.dumps(record) + "\n")


def transcripts_path(workdir: str) -> str:
    return str(files.as_path(workdir) / "transcripts.jsonl")
