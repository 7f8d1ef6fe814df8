"""Group-relative advantages at the two levels of M-GRPO (paper Eqs. 9-13).

Main agent: a group is the K rollouts of one query. Sub-agent: a group is the pooled K*D aligned slots of
one query; a duplicated slot counts once per copy, exactly as the paper's aligned set does, and a slot of
weight 0 (masked) is excluded from the statistics and gets advantage 0.

Statistics are weighted by the per-slot weights, so a weight acts as a multiplicity. The standard
deviation is the population one (1/N). A group whose weighted std is below `eps` is degenerate (all its
rewards are equal) and gets advantage 0 under every option, so it contributes no gradient.

Options:
  scale="group"  divide by the group's std (GRPO);
  scale="batch"  divide by the std of the centred rewards over every valid slot of the batch;
  scale="none"   no division (Dr. GRPO).
  baseline="mean"           subtract the group's weighted mean;
  baseline="leave_one_out"  subtract the weighted mean of the *other* members (RLOO); a member that is
                            alone in its group gets advantage 0.
"""

import jax.numpy as jnp

SCALES = ("group", "batch", "none")
BASELINES = ("mean", "leave_one_out")


def _check_options(scale: str, baseline: str) -> None:
    if scale not in SCALES:
        raise ValueError(f"scale={scale!r} is not one of {SCALES}")
    if baseline not in BASELINES:
        raise ValueError(f"baseline={baseline!r} is not one of {BASELINES}")


def group_moments(rewards, weights):
    """Weighted count, mean and population std of each row of `rewards` [G, N]."""
    rewards = jnp.asarray(rewards, jnp.float32)
    weights = jnp.asarray(weights, jnp.float32)
    count = weights.sum(-1)
    safe_count = jnp.maximum(count, 1e-12)
    mean = (weights * rewards).sum(-1) / safe_count
    var = (weights * jnp.square(rewards - mean[:, None])).sum(-1) / safe_count
    return count, mean, jnp.sqrt(var)


def degenerate_groups(rewards, weights, eps: float = 1e-6):
    """True for each group [G] whose valid rewards are all equal (std < eps) or that has no valid slot."""
    count, _, std = group_moments(rewards, weights)
    return (std < eps) | (count <= 0)


def group_advantages(rewards, weights, *, scale="group", baseline="mean", eps=1e-6):
    """Advantages for rows of a [G, N] reward matrix, each row one group; `weights` [G, N] >= 0."""
    _check_options(scale, baseline)
    rewards = jnp.asarray(rewards, jnp.float32)
    weights = jnp.asarray(weights, jnp.float32)
    valid = weights > 0
    count, mean, std = group_moments(rewards, weights)
    if baseline == "mean":
        centred = rewards - mean[:, None]
    else:
        others = count[:, None] - weights
        others_sum = (weights * rewards).sum(-1, keepdims=True) - weights * rewards
        loo_mean = others_sum / jnp.maximum(others, 1e-12)
        centred = jnp.where(others > 0, rewards - loo_mean, 0.0)
    if scale == "group":
        centred = centred / jnp.maximum(std, eps)[:, None]
    elif scale == "batch":
        total = jnp.maximum(weights.sum(), 1e-12)
        batch_std = jnp.sqrt((weights * jnp.square(centred)).sum() / total)
        centred = centred / jnp.maximum(batch_std, eps)
    keep = valid & ~((std < eps) | (count <= 0))[:, None]
    return jnp.where(keep, centred, 0.0)


def main_advantages(rewards, valid=None, *, scale="group", baseline="mean", eps=1e-6):
    """Main-agent advantages: z-score of R_M over the K rollouts of each query. [Q, K] -> [Q, K]."""
    rewards = jnp.asarray(rewards, jnp.float32)
    if rewards.ndim != 2:
        raise ValueError(f"main rewards must be [Q, K], got shape {rewards.shape}")
    weights = jnp.ones_like(rewards) if valid is None else jnp.asarray(valid, jnp.float32)
    return group_advantages(rewards, weights, scale=scale, baseline=baseline, eps=eps)


def sub_advantages(rewards, weights, *, scale="group", baseline="mean", eps=1e-6):
    """Sub-agent advantages pooled per query over the K*D aligned slots. [Q, K, D] -> [Q, K, D]."""
    rewards = jnp.asarray(rewards, jnp.float32)
    if rewards.ndim != 3:
        raise ValueError(f"sub rewards must be aligned [Q, K, D], got shape {rewards.shape}")
    weights = jnp.broadcast_to(jnp.asarray(weights, jnp.float32), rewards.shape)
    q, k, d = rewards.shape
    flat = group_advantages(
        rewards.reshape(q, k * d), weights.reshape(q, k * d), scale=scale, baseline=baseline, eps=eps
    )
    return flat.reshape(q, k, d)
