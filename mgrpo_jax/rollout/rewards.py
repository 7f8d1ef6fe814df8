"""What the judges say about a rollout, as the padded arrays `mgrpo_jax.core.mgrpo.mgrpo_targets` takes.

This is the host side of the rewards: reading model text (the grammar's format gate, the answer scorer, the
expert judge) is not jittable; everything after it is (`mgrpo_jax/core/mgrpo.py`).
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from mgrpo_jax.core.mgrpo import RolloutArrays
from mgrpo_jax.env.grammar import CHAT, Grammar, trajectory_format_ok
from mgrpo_jax.rollout.episode import RolloutBatch

Scorer = Callable[[str, str], bool]  # (prediction, gold) -> correct
ExpertScorer = Callable[[str, str, object], float]  # (task, answer, question) -> [0, 1]


def episode_format_ok(turns, allowed_tools, grammar: Grammar = CHAT) -> bool:
    return trajectory_format_ok(grammar, turns, allowed_tools=allowed_tools)


def rollout_arrays(batch: RolloutBatch, scorer: Scorer, expert: ExpertScorer | None, top_tools, sub_tools=None,
                   grammar: Grammar = CHAT, calls: int = 1) -> RolloutArrays:
    """The [Q, K] and [Q, K, C] judge arrays of a rollout; C is `calls`, or the largest d_k when that is larger
    (pass the engine's `max_sub_calls` so every step has one shape). A top-level episode without an answer is
    incorrect; a sub-call without an answer gets expert score 0."""
    q_count, k_count = batch.shape
    counts = batch.sub_counts().astype(np.int32)
    width = max(int(calls), int(counts.max(initial=0)), 1)
    format_ok = np.zeros((q_count, k_count), bool)
    correct = np.zeros((q_count, k_count), np.float32)
    sub_format = np.zeros((q_count, k_count, width), bool)
    sub_expert = np.zeros((q_count, k_count, width), np.float32)
    for qi, row in enumerate(batch.top):
        question = batch.questions[qi]
        for ki, episode in enumerate(row):
            format_ok[qi, ki] = episode_format_ok(episode.turns, top_tools, grammar)
            correct[qi, ki] = float(episode.answer is not None and scorer(episode.answer, question.answer))
            for i, sub in enumerate(episode.subs):
                sub_format[qi, ki, i] = episode_format_ok(sub.turns, sub_tools, grammar)
                if expert is not None and sub.answer is not None:
                    sub_expert[qi, ki, i] = float(expert(sub.task, sub.answer, question))
    return RolloutArrays(format_ok, correct, sub_format, sub_expert, counts)
