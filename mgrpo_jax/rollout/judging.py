"""What the judges say about a rollout, as the padded arrays `mgrpo_jax.core.mgrpo.mgrpo_targets` takes.

This is the host side of the rewards: reading model text (the grammar's format gate, the reward judge of
`mgrpo_jax/env/judges.py`) is not jittable; everything after it is (`mgrpo_jax/core/mgrpo.py`).
"""

from __future__ import annotations

import numpy as np

from mgrpo_jax.core.mgrpo import RolloutArrays
from mgrpo_jax.env.grammar import CHAT, Grammar, trajectory_format_ok
from mgrpo_jax.env.judges import AnswerCase, RewardJudge, SubTaskCase
from mgrpo_jax.rollout.episode import RolloutBatch


def episode_format_ok(turns, allowed_tools, grammar: Grammar = CHAT) -> bool:
    return trajectory_format_ok(grammar, turns, allowed_tools=allowed_tools)


def rollout_arrays(batch: RolloutBatch, judge: RewardJudge, top_tools, sub_tools=None, grammar: Grammar = CHAT,
                   calls: int = 1) -> RolloutArrays:
    """The [Q, K] and [Q, K, C] judge arrays of a rollout; C is `calls`, or the largest d_k when that is larger
    (pass the engine's `max_sub_calls` so every step has one shape). A top-level episode without an answer is
    incorrect; a sub-call without an answer gets expert score 0. Every answer goes to `judge` in one of two batches
    (correctness, expert scores), so a remote judge can run them concurrently."""
    q_count, k_count = batch.shape
    counts = batch.sub_counts().astype(np.int32)
    width = max(int(calls), int(counts.max(initial=0)), 1)
    format_ok = np.zeros((q_count, k_count), bool)
    correct = np.zeros((q_count, k_count), np.float32)
    sub_format = np.zeros((q_count, k_count, width), bool)
    sub_expert = np.zeros((q_count, k_count, width), np.float32)
    answers, answer_at, sub_tasks, sub_task_at = [], [], [], []
    for qi, row in enumerate(batch.top):
        question = batch.questions[qi]
        name = getattr(question, "id", f"q{qi}")
        for ki, episode in enumerate(row):
            format_ok[qi, ki] = episode_format_ok(episode.turns, top_tools, grammar)
            if episode.answer is not None:
                answers.append(AnswerCase(f"{name}/rollout{ki}", question, episode.answer))
                answer_at.append((qi, ki))
            for i, sub in enumerate(episode.subs):
                sub_format[qi, ki, i] = episode_format_ok(sub.turns, sub_tools, grammar)
                if sub.answer is not None:
                    sub_tasks.append(SubTaskCase(f"{name}/rollout{ki}/call{i}", question, sub.task, sub.answer))
                    sub_task_at.append((qi, ki, i))
    for index, score in zip(answer_at, judge.correct(answers), strict=True):
        correct[index] = score
    for index, score in zip(sub_task_at, judge.expert(sub_tasks), strict=True):
        sub_expert[index] = score
    return RolloutArrays(format_ok, correct, sub_format, sub_expert, counts)
