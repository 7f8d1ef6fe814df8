"""Per-episode reward inputs (format gate, correctness, expert score) gathered into [Q, K] / [Q, K, D]
arrays, and the rewards themselves through the pure `core` kernels."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from mgrpo_jax.core import main_reward, sub_reward
from mgrpo_jax.env.grammar import CHAT, Grammar, trajectory_format_ok
from mgrpo_jax.rollout.episode import RolloutBatch

Scorer = Callable[[str, str], bool]  # (prediction, gold) -> correct
ExpertScorer = Callable[[str, str, object], float]  # (task, answer, question) -> [0, 1]


@dataclass
class RewardInputs:
    format_ok: np.ndarray  # [Q, K] bool, the top-level agent's whole trajectory follows the grammar
    correct: np.ndarray  # [Q, K] float, the final answer's correctness
    sub_format_ok: list  # [Q][K][d_k] bool
    sub_expert: list  # [Q][K][d_k] float in [0, 1]


def episode_format_ok(turns, allowed_tools, grammar: Grammar = CHAT) -> bool:
    return trajectory_format_ok(grammar, turns, allowed_tools=allowed_tools)


def reward_inputs(batch: RolloutBatch, scorer: Scorer, expert: ExpertScorer | None,
                  top_tools, sub_tools=None, grammar: Grammar = CHAT) -> RewardInputs:
    q_count, k_count = batch.shape
    format_ok = np.zeros((q_count, k_count), bool)
    correct = np.zeros((q_count, k_count), np.float32)
    sub_format, sub_expert = [], []
    for qi, row in enumerate(batch.top):
        question = batch.questions[qi]
        sub_format.append([])
        sub_expert.append([])
        for ki, episode in enumerate(row):
            format_ok[qi, ki] = episode_format_ok(episode.turns, top_tools, grammar)
            correct[qi, ki] = float(episode.answer is not None and scorer(episode.answer, question.answer))
            sub_format[qi].append([episode_format_ok(s.turns, sub_tools, grammar) for s in episode.subs])
            sub_expert[qi].append([
                float(expert(s.task, s.answer, question)) if (expert and s.answer is not None) else 0.0
                for s in episode.subs
            ])
    return RewardInputs(format_ok, correct, sub_format, sub_expert)


def main_rewards(inputs: RewardInputs, alpha) -> np.ndarray:
    return np.asarray(main_reward(inputs.format_ok, inputs.correct, alpha))


def aligned_sub_rewards(inputs: RewardInputs, main_correct, index, weight, beta) -> np.ndarray:
    """R_S for every aligned slot [Q, K, D]: each slot's own format gate and expert score, and the main
    agent's correctness of its rollout (read from the store in decoupled mode)."""
    index = np.asarray(index)
    weight = np.asarray(weight)
    q_count, k_count, d = index.shape
    fmt = np.zeros((q_count, k_count, d), bool)
    expert = np.zeros((q_count, k_count, d), np.float32)
    for qi in range(q_count):
        for ki in range(k_count):
            for j in range(d):
                if weight[qi, ki, j] > 0:
                    fmt[qi, ki, j] = inputs.sub_format_ok[qi][ki][index[qi, ki, j]]
                    expert[qi, ki, j] = inputs.sub_expert[qi][ki][index[qi, ki, j]]
    rewards = np.asarray(sub_reward(fmt, np.asarray(main_correct, np.float32)[..., None], expert, beta))
    return rewards * (weight > 0)
