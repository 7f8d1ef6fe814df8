"""Group-relative advantages at the two levels of M-GRPO (paper Eqs. 9-13).

Main agent: a group is the K rollouts of one query. Sub-agent: a group is the pooled K*D aligned slots of
one query; a duplicated slot counts once per copy, exactly as the paper's aligned set does, and a slot of
weight 0 (masked) is excluded from the statistics and gets advantage 0.

Statistics are weighted by the per-slot weights, so a weight acts as a multiplicity. The standard
deviation is the population one (1/N) by default; `ddof=1` gives the sample one (1/(N - 1), as `torch.std`
computes it: MATPO's normalisation, mgrpo_jax/core/matpo.py). A group whose weighted std is below `eps` is
degenerate (all its rewards are equal) and gets advantage 0 under every option, so it contributes no gradient.

Options:
  scale="group"  divide by the group's std (GRPO);
  scale="batch"  divide by the std of the centred rewards over every valid slot of the batch;
  scale="none"   no division (Dr. GRPO).
  baseline="mean"           subtract the group's weighted mean;
  baseline="leave_one_out"  subtract the weighted mean of the *other* members (RLOO); a member that is
                            alone in its group gets advantage 0.

Estimators are registered by name, like the losses (`config.advantages.estimator`; `mgrpo_jax.core.mgrpo`
calls the chosen one for both levels). An estimator maps one reward matrix of groups to advantages:
`fn(rewards [G, N], weights [G, N], **hparams) -> [G, N]`, jittable, with the hparams the config's other
`advantages.*` fields. "grpo" is `group_advantages`, whose options cover GRPO, Dr. GRPO and RLOO. A new one:

    @register_advantage("median")
    def median_advantages(rewards, weights, eps=1e-6, **unused): ...
"""

from collections.abc import Callable

import jax
import jax.numpy as jnp

from mgrpo_jax.core.registry import Registry

SCALES = ("group", "batch", "none")
BASELINES = ("mean", "leave_one_out")


def _check_options(scale: str, baseline: str) -> None:
    if scale not in SCALES:
        raise ValueError(f"scale={scale!r} is not one of {SCALES}")
    if baseline not in BASELINES:
        raise ValueError(f"baseline={baseline!r} is not one of {BASELINES}")


def _shifted(rewards, weights):
    """Rewards minus each group's first valid reward: the moments do not change, and float32 keeps the small
    differences that a sum of many nearly equal rewards would round away (e.g. 23 of 24 slots at 0.6)."""
    first = jnp.argmax(weights > 0, axis=-1)
    return rewards - jnp.take_along_axis(rewards, first[:, None], axis=-1)


def group_moments(rewards, weights, ddof: int = 0):
    """Weighted count, mean and std of each row of `rewards` [G, N]: the population std, or with `ddof=1` the
    sample std (the squared deviations divided by count - 1; 0 for a group of one)."""
    rewards = jnp.asarray(rewards, jnp.float32)
    weights = jnp.asarray(weights, jnp.float32)
    shifted = _shifted(rewards, weights)
    count = weights.sum(-1)
    safe_count = jnp.maximum(count, 1e-12)
    shifted_mean = (weights * shifted).sum(-1) / safe_count
    squares = (weights * jnp.square(shifted - shifted_mean[:, None])).sum(-1)
    # ddof 0 keeps the population std's program exactly as it was (no subtraction of a zero).
    var = squares / (jnp.maximum(count - ddof, 1e-12) if ddof else safe_count)
    return count, (rewards - shifted).mean(-1) + shifted_mean, jnp.sqrt(var)


def degenerate_groups(rewards, weights, eps: float = 1e-6):
    """True for each group [G] whose valid rewards are all equal (std < eps) or that has no valid slot."""
    count, _, std = group_moments(rewards, weights)
    return (std < eps) | (count <= 0)


def group_advantages(rewards, weights, *, scale="group", baseline="mean", eps=1e-6, ddof=0):
    """Advantages for rows of a [G, N] reward matrix, each row one group; `weights` [G, N] >= 0. `ddof`: the
    group std's delta degrees of freedom (0: population, 1: sample), for `scale="group"` and the degenerate test."""
    _check_options(scale, baseline)
    if ddof not in (0, 1):
        raise ValueError(f"ddof={ddof!r} is not 0 (population std) or 1 (sample std)")
    rewards = jnp.asarray(rewards, jnp.float32)
    weights = jnp.asarray(weights, jnp.float32)
    valid = weights > 0
    count, mean, std = group_moments(rewards, weights, ddof)
    if baseline == "mean":
        shifted = _shifted(rewards, weights)
        centred = shifted - (weights * shifted).sum(-1, keepdims=True) / jnp.maximum(count, 1e-12)[:, None]
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


def main_advantages(rewards, valid=None, *, estimator: str = "grpo", **hparams):
    """Main-agent advantages: each query's K rollouts form one group (z-scored under "grpo"). [Q, K] -> [Q, K]."""
    rewards = jnp.asarray(rewards, jnp.float32)
    if rewards.ndim != 2:
        raise ValueError(f"main rewards must be [Q, K], got shape {rewards.shape}")
    weights = jnp.ones_like(rewards) if valid is None else jnp.asarray(valid, jnp.float32)
    return get_advantage(estimator)(rewards, weights, **hparams)


def sub_advantages(rewards, weights, *, estimator: str = "grpo", **hparams):
    """Sub-agent advantages pooled per query over the K*D aligned slots. [Q, K, D] -> [Q, K, D]."""
    rewards = jnp.asarray(rewards, jnp.float32)
    if rewards.ndim != 3:
        raise ValueError(f"sub rewards must be aligned [Q, K, D], got shape {rewards.shape}")
    weights = jnp.broadcast_to(jnp.asarray(weights, jnp.float32), rewards.shape)
    q, k, d = rewards.shape
    flat = get_advantage(estimator)(rewards.reshape(q, k * d), weights.reshape(q, k * d), **hparams)
    return flat.reshape(q, k, d)

AdvantageFn = Callable[..., jax.Array]
_ESTIMATORS = Registry("advantage estimator")


def register_advantage(name: str, *, overwrite: bool = False):
    """Decorator registering `fn(rewards [G, N], weights [G, N], **hparams) -> advantages [G, N]` under `name`."""
    return _ESTIMATORS.register(name, overwrite=overwrite)


def get_advantage(name: str) -> AdvantageFn:
    return _ESTIMATORS.get(name)


def available_advantages() -> list[str]:
    return _ESTIMATORS.names()


register_advantage("grpo")(group_advantages)
