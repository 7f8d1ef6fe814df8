"""Evaluation (avg@runs accuracy on held-out sets) and the transcripts a run logs for inspection.

Each set is scored under the protocol of the benchmark it stands for (`SET_PROTOCOLS`). Without `env.judge_url`
that is exact match: the offline world's scorer, or a benchmark file's own rule without its judge. With it, the
XBench- and WebWalkerQA-style sets and such benchmark files are judged as their own scorers do, by the LLM with the
benchmark's prompt (`scoring.answer_prompt`), every answer concurrently through `HttpJudge`; an exact match stays
the fast path and needs no call. GAIA is exact match by its own protocol, judge or not. An endpoint that stays
unavailable fails the evaluation (`JudgeError`): an accuracy of 0 would be a silent lie.
"""

from __future__ import annotations

import functools
import json
import logging
import types

import numpy as np

from mgrpo_jax.env.benchmarks import load_benchmark
from mgrpo_jax.env.build import judge_endpoint
from mgrpo_jax.env.judges import AnswerCase, HttpJudge
from mgrpo_jax.env.scoring import answer_prompt, score_benchmark_answer, world_answer_correct
from mgrpo_jax.runtime import files
from mgrpo_jax.runtime.progress import RunProgress
from mgrpo_jax.runtime.seeds import derive_seed

log = logging.getLogger(__name__)

SET_PROTOCOLS = {"eval_gaia": "gaia", "eval_xbench": "xbench", "eval_webwalker": "webwalker"}  # others: "world"
JUDGELESS = ("gaia", "world")  # protocols whose own scorer is exact match


def _score_record(benchmark: str, prediction: str, gold: str) -> bool:
    # The benchmark's rule without its judge: the fast path, or all of it when no judge is configured.
    return score_benchmark_answer(benchmark, "", gold, prediction, judge=None)


def evaluation_sets(config, env) -> dict:
    """{name: (questions, exact-match scorer, protocol)}: the world's sets named by `train.eval_sets`, plus the real
    benchmark's records when `config.env.benchmark_path` names its files (scored by that benchmark's own rule)."""
    limit = config.train.eval_questions or None
    names = [name.strip() for name in str(config.train.eval_sets).split(",") if name.strip()]
    sets = {name: (list(env.questions.split(name))[:limit], world_answer_correct, SET_PROTOCOLS.get(name, "world"))
            for name in names}
    path = config.env.benchmark_path
    if path:
        benchmark = config.benchmark
        records = [r for r in load_benchmark(benchmark, path) if r.answer is not None][:limit]
        questions = [types.SimpleNamespace(text=r.question, answer=r.answer, id=r.id) for r in records]
        sets[f"{benchmark}_file"] = (questions, functools.partial(_score_record, benchmark), benchmark)
    return sets


def set_judge(config, protocol: str, scorer) -> HttpJudge | None:
    """The LLM judge of a set scored under `protocol`, `scorer` its fast path; None for exact match."""
    endpoint = judge_endpoint(config)
    if endpoint is None or protocol in JUDGELESS:
        return None
    return HttpJudge(endpoint, answer_prompt(protocol), concurrency=int(config.env.judge_concurrency),
                     fast_path=scorer)


def score_episodes(name: str, questions, episodes, scorer, judge: HttpJudge | None) -> list[float]:
    """1.0 / 0.0 per episode: no answer is wrong; `judge` (when given) decides every answer `scorer` does not
    accept."""
    if judge is None:
        return [float(e.answer is not None and scorer(e.answer, questions[e.question_index].answer))
                for e in episodes]
    answered = [i for i, e in enumerate(episodes) if e.answer is not None]
    cases = []
    for i in answered:
        question = questions[episodes[i].question_index]
        cases.append(AnswerCase(f"{name}/{question.id}/episode{i}", question, episodes[i].answer))
    scores = [0.0] * len(episodes)
    for i, score in zip(answered, judge.correct(cases), strict=True):
        scores[i] = float(score)
    return scores


def evaluate(config, env, engine, step: int, progress: RunProgress | None = None, blind_engine=None) -> dict:
    """`eval/<set>/accuracy`: avg@`train.eval_runs` accuracy on each evaluation set, sampled at the rollout
    temperature by the whole system; with `blind_engine` (the same agents, every tool answering "none") also
    `eval_blind/<set>/accuracy`. With `progress`, a bar over the sets' questions and a log line per set."""
    out, sets = {}, evaluation_sets(config, env)
    runs = [("eval", engine)] + ([("eval_blind", blind_engine)] if blind_engine is not None else [])
    total = len(runs) * sum(len(questions) for questions, _, _ in sets.values())
    bar = (progress or RunProgress(enabled=False)).phase(f"eval at step {step}", total)
    for prefix, system_engine in runs:
        for name, (questions, scorer, protocol) in sets.items():
            if not questions:  # a world too small to draw this set
                log.warning("evaluation set %s is empty; skipped", name)
                continue
            # The blind run draws the same samples as the seeing one until a tool answers.
            seed = derive_seed(config.seed, "eval", step, name)
            result = system_engine.run(questions, config.train.eval_runs, seed=seed)
            judge = set_judge(config, protocol, scorer)
            correct = score_episodes(name, questions, [e for row in result.top for e in row], scorer, judge)
            key = f"{prefix}/{name}/accuracy"
            out[key] = float(np.mean(correct))
            bar.update(bar.done + len(questions), accuracy=out[key])
            judged = "exact match" if judge is None else \
                f"{protocol} judge: {judge.counts['calls']} calls, {judge.counts['fast_path']} exact matches"
            log.info("%s at step %d: %s accuracy %.3f (avg@%d over %d questions, %s) | %s", prefix, step, name,
                     out[key], config.train.eval_runs, len(questions), judged, bar.line())
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
