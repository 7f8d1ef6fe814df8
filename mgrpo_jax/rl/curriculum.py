"""Which training questions a run serves, and the record that says so.

A run trains on its stage's split; in stage 2, when `env.stage2_max_success` < 1, on the questions the starting
system finds hard (the paper filters stage-2 data by the stage-1 model's success):

- **The pool** the filter measures is the stage-2 questions whose texts no evaluation split holds (validation, the
  held-out sets, `fresh`), the first `env.stage2_filter_pool` of them. `fresh` is the transfer gap's yardstick
  (stage-2 texts the system trains on, asked in the world), so the stage-2 questions with a fresh text are always
  trained, never filtered: no outcome chooses which of them are trained, and every fresh text is a trained text.
- **Where** it measures: as the RL steps do. When the run poses its steps in counterfactual twins of the compact
  world (`rollout.counterfactual_share`), the filter poses its pool in seeded twins too, a batch of an RL step's
  rollouts at a time (batch i in the twin `sides.counterfactual_twin(config, i, "curriculum_twin")` draws), and a
  rollout succeeds when it gives the twin's answer; the world's answers never choose a trained question.
- **One pool per world**: `env.curriculum_file` names a `curriculum.json` another run's filter wrote (e.g. the
  mgrpo lineage's, from its stage-1 checkpoint); the run trains on exactly its ids and filters nothing, so every
  stage-2 lineage of a world trains on the same questions. A file of another world (`world_seed`, `pool_hash`) or
  naming ids this world lacks is an error.

`workdir/curriculum.json` records the served ids (`kept`: fresh texts and the pool's kept questions, in split
order), the world seed and the pool's hash (`pool_hash`), so a resumed run serves the same questions. Every run
logs `env/seed` and `env/pool_hash` (`QuestionFeed.identity`) with its metrics."""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging

import numpy as np

from mgrpo_jax.env.pipeline import question_iterator
from mgrpo_jax.env.questions import FRESH, HELD_OUT_SPLITS, filter_low_success
from mgrpo_jax.env.scoring import world_answer_correct
from mgrpo_jax.rl.sides import counterfactual_twin
from mgrpo_jax.runtime import files
from mgrpo_jax.runtime.seeds import derive_seed

log = logging.getLogger(__name__)

EVALUATION_SPLITS = (*HELD_OUT_SPLITS, FRESH)


def curriculum_path(workdir: str) -> str:
    return str(files.as_path(workdir) / "curriculum.json")


def pool_hash(questions) -> str:
    """A stable name of a question pool: the first 16 hex digits of the SHA-256 of its sorted (id, text) pairs
    (the same in every process: no Python `hash`)."""
    lines = sorted(f"{q.id}\t{q.text}" for q in questions)
    return hashlib.sha256("\n".join(lines).encode()).hexdigest()[:16]


def filter_parts(config, env) -> tuple[list, list]:
    """(always, pool) of a stage's questions: those with a fresh text (always trained) and the first
    `env.stage2_filter_pool` of those whose text no evaluation split holds (what the filter measures)."""
    questions = env.questions.split(config.stage)
    fresh = {q.text for q in env.questions.split(FRESH)}
    evaluated = {q.text for split in EVALUATION_SPLITS for q in env.questions.split(split)}
    always = [q for q in questions if q.text in fresh]
    pool = [q for q in questions if q.text not in evaluated][: config.env.stage2_filter_pool or None]
    return always, pool


def _posed(env, twin: int, questions):
    """`questions` as asked in twin `twin` (the world when 0), with that twin active for the tools and judge."""
    return env.posed_in_twin(twin, questions) if twin else contextlib.nullcontext(list(questions))


def success_rates(config, env, engine, pool: list, samples: int) -> tuple[dict, list[int]]:
    """({question id: share of `samples` rollouts that gave the right answer}, the twin of each batch): the pool
    posed as the RL steps pose theirs. With twins, batches of an RL step's rollouts (`rollout.queries` x
    `rollout.samples`), each in its seeded twin and judged by that twin's answers; without, one batch in the
    world."""
    cfg = config.rollout
    size = max(1, cfg.queries * cfg.samples // samples) if float(cfg.counterfactual_share) else max(len(pool), 1)
    rates, twins = {q.id: 0.0 for q in pool}, []
    for i, start in enumerate(range(0, len(pool), size)):
        twin = counterfactual_twin(config, i, "curriculum_twin")
        with _posed(env, twin, pool[start:start + size]) as posed:
            result = engine.run(posed, samples, seed=derive_seed(config.seed, "curriculum", i))
        for row in result.top:
            for episode in row:
                question = posed[episode.question_index]
                solved = episode.answer is not None and world_answer_correct(episode.answer, question.answer)
                rates[question.id] += float(solved) / samples
        twins.append(twin)
    return rates, twins


def _record(config, questions: list, extra: dict) -> dict:
    return {"world_seed": int(config.env.seed), "pool_hash": pool_hash(questions), "kept": [q.id for q in questions],
            **extra}


def filter_curriculum(config, env, engine, workdir: str, write: bool = True) -> tuple[list, dict]:
    """(served questions, curriculum record): the fresh texts' questions and those of the pool (`filter_parts`) the
    starting system solves at most `env.stage2_max_success` of the time, estimated from
    `env.stage2_filter_samples` rollouts of each (`success_rates`), in split order."""
    env_cfg = config.env
    always, pool = filter_parts(config, env)
    samples = env_cfg.stage2_filter_samples
    rates, twins = success_rates(config, env, engine, pool, samples)
    kept = {q.id for q in filter_low_success(pool, lambda q: rates[q.id], env_cfg.stage2_max_success)}
    trained = kept | {q.id for q in always}
    served = [q for q in env.questions.split(config.stage) if q.id in trained]
    if len(served) < config.rollout.queries:
        raise ValueError(
            f"stage-2 curriculum: {len(kept)} of {len(pool)} questions have success <= "
            f"env.stage2_max_success={env_cfg.stage2_max_success} (and {len(always)} fresh texts), fewer than "
            f"rollout.queries={config.rollout.queries}; raise the threshold or env.stage2_filter_pool")
    summary = _record(config, served, {
        "fresh": [q.id for q in always], "pool": len(pool), "pool_kept": len(kept), "samples": samples,
        "max_success": env_cfg.stage2_max_success, "mean_success": float(np.mean(list(rates.values()) or [0.0])),
        "counterfactual_share": float(config.rollout.counterfactual_share), "twins": twins})
    if write:
        files.write_atomic(curriculum_path(workdir), json.dumps(summary))
    log.info("stage-2 curriculum: kept %d of %d questions (mean success %.3f, twins %s) and %d fresh texts: "
             "pool %s", len(kept), len(pool), summary["mean_success"], sorted(set(twins)), len(always),
             summary["pool_hash"])
    return served, summary


def read_curriculum(path: str, name: str = "env.curriculum_file") -> dict:
    """The record of a `curriculum.json`, with a clear error naming `name` when it is missing or unreadable."""
    try:
        text = files.read_text(path)
    except OSError as e:
        raise ValueError(f"{name}={path!r}: cannot read it ({e})") from e
    if text is None:
        raise ValueError(f"{name}={path!r}: no such file (a curriculum.json a stage-2 filter wrote)")
    try:
        record = json.loads(text)
        ids = record["kept"]
    except (ValueError, KeyError, TypeError) as e:
        raise ValueError(f"{name}={path!r}: not a curriculum.json with a `kept` list of question ids ({e})") from e
    if not isinstance(ids, list) or not all(isinstance(i, str) for i in ids):
        raise ValueError(f"{name}={path!r}: `kept` must be a list of question ids")
    return record


def select(config, env, record: dict, path: str, name: str = "env.curriculum_file") -> list:
    """The stage's questions a curriculum record names, checked to be of this run's world: its `world_seed`, ids
    and `pool_hash` (the ids' texts) must match, else an error naming `name`."""
    seed = record.get("world_seed")
    if seed is not None and seed != config.env.seed:
        raise ValueError(f"{name}={path!r} was written for world env.seed={seed}, this run's is "
                         f"env.seed={config.env.seed}: a question pool belongs to one world")
    by_id = {q.id: q for q in env.questions.split(config.stage)}
    missing = [i for i in record["kept"] if i not in by_id]
    if missing:
        raise ValueError(f"{name}={path!r} names {len(missing)} question ids the {config.stage} split of world "
                         f"env.seed={config.env.seed} does not have (e.g. {missing[:3]}): another world or sizes?")
    questions = [by_id[i] for i in record["kept"]]
    if "pool_hash" in record and record["pool_hash"] != pool_hash(questions):
        raise ValueError(f"{name}={path!r}: pool_hash {record['pool_hash']} is not this world's "
                         f"{pool_hash(questions)} for the same ids (env.seed={config.env.seed}, env.sizes): the "
                         "texts differ, so it was written for another world")
    return questions


def training_questions(config, env, workdir: str) -> list:
    """The questions a run serves: `env.curriculum_file`'s, else those this workdir's filter kept (a resumed run),
    else the stage's split."""
    saved = curriculum_path(workdir)
    here = read_curriculum(saved, "curriculum.json") if files.read_text(saved) is not None else None
    source = config.env.curriculum_file
    if source:
        record = read_curriculum(source)
        if here is not None and here["kept"] != record["kept"]:
            raise ValueError(f"env.curriculum_file={source!r} no longer names the questions this run trained on "
                             f"({saved}): the shared pool changed under a started run")
        return select(config, env, record, source)
    if here is not None:
        return select(config, env, here, saved, "curriculum.json")
    return list(env.questions.split(config.stage))


class QuestionFeed:
    """The questions a run trains on (`questions`: its stage's, or the curriculum's kept ones) and the seeded,
    resumable order it serves them in, `rollout.queries` at a time (`iterator`: a Grain iterator with state)."""

    def __init__(self, config, env, workdir: str):
        self.config, self.env, self.workdir = config, env, workdir
        self._serve(training_questions(config, env, workdir))

    def _serve(self, questions: list) -> None:
        self.questions, self.pool_hash = questions, pool_hash(questions)
        self.iterator = question_iterator(questions, batch_size=self.config.rollout.queries, seed=self.config.seed)

    def identity(self) -> dict:
        """What every log of the run records of its questions: the world seed and the served pool's hash."""
        return {"env/seed": int(self.config.env.seed), "env/pool_hash": self.pool_hash}

    def filter(self, engine, write: bool) -> dict:
        """Keeps the questions `engine`'s system finds hard (`filter_curriculum`) and serves those from the start."""
        kept, summary = filter_curriculum(self.config, self.env, engine, self.workdir, write=write)
        self._serve(kept)
        return summary

    def prepare(self, engine, write: bool) -> dict | None:
        """At a stage-2 run's start: records `env.curriculum_file`'s pool in this workdir (what it serves already),
        or filters the stage's questions when `env.stage2_max_success` < 1; None when neither applies."""
        source = self.config.env.curriculum_file
        if source:
            record = {**read_curriculum(source), "source": source, "world_seed": int(self.config.env.seed),
                      "pool_hash": self.pool_hash}
            if write:
                files.write_atomic(curriculum_path(self.workdir), json.dumps(record))
            log.info("stage-2 curriculum: %d questions of %s (pool %s)", len(self.questions), source,
                     record["pool_hash"])
            return record
        if self.config.env.stage2_max_success < 1:
            return self.filter(engine, write)
        return None
