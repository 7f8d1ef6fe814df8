"""Outcome rewards of the main agent and the sub-agent (paper Eqs. 4-5), with the hard format gate.

Inputs are arrays of any (matching, broadcastable) shape; outputs are float32 of the broadcast shape.
`format_ok` is boolean; correctness and expert scores may be binary or graded in [0, 1].
"""

from collections.abc import Sequence

import jax.numpy as jnp

MAIN_ALPHA = (0.1, 0.9)
SUB_BETA = (0.1, 0.4, 0.5)


def _weights(values: Sequence[float], count: int, name: str) -> tuple[float, ...]:
    values = tuple(float(v) for v in values)
    if len(values) != count:
        raise ValueError(f"{name} must have {count} weights, got {len(values)}: {values}")
    return values


def main_reward(format_ok, correct, alpha: Sequence[float] = MAIN_ALPHA) -> jnp.ndarray:
    """R_M = alpha_1 * r_format + alpha_2 * r_correct, and 0 whenever the trajectory breaks the format."""
    a_format, a_correct = _weights(alpha, 2, "alpha")
    correct = jnp.asarray(correct, jnp.float32)
    return jnp.where(jnp.asarray(format_ok, bool), a_format + a_correct * correct, 0.0).astype(jnp.float32)


def sub_reward(
    format_ok, main_correct, expert_score, beta: Sequence[float] = SUB_BETA
) -> jnp.ndarray:
    """R_S = beta_1 * r_format + beta_2 * r_correct^main + beta_3 * r_expert, gated on S's own format.

    `main_correct` is the main agent's correctness for the rollout, broadcast to each of its sub-calls.
    """
    b_format, b_main, b_expert = _weights(beta, 3, "beta")
    main_correct = jnp.asarray(main_correct, jnp.float32)
    expert_score = jnp.asarray(expert_score, jnp.float32)
    value = b_format + b_main * main_correct + b_expert * expert_score
    return jnp.where(jnp.asarray(format_ok, bool), value, 0.0).astype(jnp.float32)
