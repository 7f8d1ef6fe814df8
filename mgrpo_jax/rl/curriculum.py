"""Which training questions a run serves: its stage's split, and in stage 2 only those the starting system finds
hard (the paper filters stage-2 data by the stage-1 model's success). The kept ids go to `workdir/curriculum.json`,
so a resumed run serves the same questions."""

from __future__ import annotations

import json
import logging

import numpy as np

from mgrpo_jax.env.pipeline import question_iterator
from mgrpo_jax.env.questions import filter_low_success
from mgrpo_jax.env.scoring import world_answer_correct
from mgrpo_jax.runtime import files
from mgrpo_jax.runtime.seeds import derive_seed

log = logging.getLogger(__name__)


def curriculum_path(workdir: str) -> str:
    return str(files.as_path(workdir) / "curriculum.json")


def training_questions(config, env, workdir: str) -> list:
    """The stage's questions, or the kept ones when this workdir already filtered them."""
    questions = list(env.questions.split(config.stage))
    saved = files.read_text(curriculum_path(workdir))
    if saved is not None:
        kept = json.loads(saved)["kept"]
        by_id = {q.id: q for q in questions}
        questions = [by_id[i] for i in kept]
    return questions


def filter_curriculum(config, env, engine, workdir: str, write: bool = True) -> tuple[list, dict]:
    """(kept questions, summary): the questions the starting system solves at most `env.stage2_max_success` of
    the time, estimated from `env.stage2_filter_samples` rollouts of each of the first `env.stage2_filter_pool`."""
    env_cfg = config.env
    pool = list(env.questions.split(config.stage))[: env_cfg.stage2_filter_pool or None]
    samples = env_cfg.stage2_filter_samples
    result = engine.run(pool, samples, seed=derive_seed(config.seed, "curriculum"))
    rates = {q.id: 0.0 for q in pool}
    for row in result.top:
        for episode in row:
            question = pool[episode.question_index]
            solved = episode.answer is not None and world_answer_correct(episode.answer, question.answer)
            rates[question.id] += float(solved) / samples
    kept = filter_low_success(pool, lambda q: rates[q.id], env_cfg.stage2_max_success)
    if len(kept) < config.rollout.queries:
        raise ValueError(
            f"stage-2 curriculum: {len(kept)} of {len(pool)} questions have success <= "
            f"env.stage2_max_success={env_cfg.stage2_max_success}, fewer than rollout.queries="
            f"{config.rollout.queries}; raise the threshold or env.stage2_filter_pool")
    summary = {"pool": len(pool), "kept": [q.id for q in kept], "samples": samples,
               "max_success": env_cfg.stage2_max_success, "mean_success": float(np.mean(list(rates.values())))}
    if write:
        files.write_atomic(curriculum_path(workdir), json.dumps(summary))
    log.info("stage-2 curriculum: kept %d of %d questions (mean success %.3f)", len(kept), len(pool),
             summary["mean_success"])
    return kept, summary


class QuestionFeed:
    """The questions a run trains on (`questions`: its stage's, or the curriculum's kept ones) and the seeded,
    resumable order it serves them in, `rollout.queries` at a time (`iterator`: a Grain iterator with state)."""

    def __init__(self, config, env, workdir: str):
        self.config, self.env, self.workdir = config, env, workdir
        self._serve(training_questions(config, env, workdir))

    def _serve(self, questions: list) -> None:
        self.questions = questions
        self.iterator = question_iterator(questions, batch_size=self.config.rollout.queries, seed=self.config.seed)

    def filter(self, engine, write: bool) -> dict:
        """Keeps the questions `engine`'s system finds hard (`filter_curriculum`) and serves those from the start."""
        kept, summary = filter_curriculum(self.config, self.env, engine, self.workdir, write=write)
        self._serve(kept)
        return summary
