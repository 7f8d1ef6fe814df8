"""The off-policy correction of an asynchronous run's batches (docs/async.md): pure functions over a batch's masked
[B, T] token arrays, host or device alike.

A token sampled under policy version v and trained at version V > v is *stale*. Decoupled PPO (the default,
`async_rl.correction = "decoupled"`) trains it with the PPO clip centred on the proximal policy pi_prox (the
learner's weights before this update, version V) instead of the behaviour policy mu that sampled it, and weights it
by the truncated importance ratio min(pi_prox / mu, cap) (`is_cap`):

    loss_t = w_t * max(-A r_t, -A clip(r_t, 1 - eps_low, 1 + eps_high)),  r_t = pi_theta / pi_prox,
    w_t = min(exp(log pi_prox - log mu), cap) on stale tokens, exactly 1 on on-policy ones (there pi_prox is mu).

Since w_t >= 0 is a constant of the step, w_t * max(-A r, -A clip(r)) = max(-(w_t A) r, -(w_t A) clip(r)): the
correction is the batch's `old_logprobs` replaced by pi_prox's on stale tokens and its advantages made per token,
A * w_t, so every registered loss (mgrpo_jax/core/losses.py) runs it unchanged.
"""

from __future__ import annotations

import numpy as np


def stale_tokens(versions, trained, version: int) -> np.ndarray:
    """[B, T] bool: the trained tokens (`trained` > 0) sampled under a policy older than `version`."""
    return (np.asarray(trained) > 0) & (np.asarray(versions) < version)


def behaviour_weights(behaviour_logprobs, proximal_logprobs, stale, cap: float) -> np.ndarray:
    """[B, T] float32 truncated importance weights min(pi_prox / mu, cap) on `stale` tokens, exactly 1 elsewhere."""
    log_ratio = np.asarray(proximal_logprobs, np.float64) - np.asarray(behaviour_logprobs, np.float64)
    weights = np.exp(np.minimum(log_ratio, np.log(cap)))  # truncated in log space: no overflow
    return np.where(np.asarray(stale, bool), weights, 1.0).astype(np.float32)


def decoupled_rows(rows: dict, proximal_logprobs, stale, cap: float) -> dict:
    """`rows` (a policy batch: `old_logprobs` [B, T], `advantages` [B] or [B, T]) corrected by decoupled PPO:
    `old_logprobs` pi_prox's on `stale` tokens, `advantages` per token times `behaviour_weights`. A batch without
    stale tokens keeps its log-probs, and its advantages become per token unchanged."""
    out = dict(rows)
    behaviour = np.asarray(rows["old_logprobs"], np.float32)
    stale = np.asarray(stale, bool)
    weights = behaviour_weights(behaviour, proximal_logprobs, stale, cap)
    out["old_logprobs"] = np.where(stale, np.asarray(proximal_logprobs, np.float32), behaviour)
    advantages = np.asarray(rows["advantages"], np.float32)
    if advantages.ndim == 1:
        advantages = np.broadcast_to(advantages[:, None], behaviour.shape)
    out["advantages"] = (advantages * weights).astype(np.float32)
    return out


def per_token_advantages(rows: dict) -> dict:
    """`rows` with [B, T] advantages (a row's one advantage on each of its tokens): the shape every batch of an
    asynchronous run trains with, stale tokens or not, so its policy step compiles once per length."""
    out = dict(rows)
    advantages = np.asarray(rows["advantages"], np.float32)
    if advantages.ndim == 1:
        out["advantages"] = np.ascontiguousarray(np.broadcast_to(advantages[:, None], np.shape(rows["tokens"])))
    return out
