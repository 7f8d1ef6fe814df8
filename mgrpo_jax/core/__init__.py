"""Pure, jittable M-GRPO kernels: rewards, alignment, advantages and policy losses (no I/O, no state)."""

from mgrpo_jax.core.advantages import degenerate_groups, group_advantages, main_advantages, sub_advantages
from mgrpo_jax.core.alignment import align, d_histogram, gather_aligned, suggest_d_max
from mgrpo_jax.core.losses import (
    PolicyLossInputs,
    aggregate,
    available_losses,
    get_loss,
    kl_penalty,
    ppo_clip_loss,
    register_loss,
)
from mgrpo_jax.core.rewards import main_reward, sub_reward

__all__ = [
    "PolicyLossInputs",
    "aggregate",
    "align",
    "available_losses",
    "d_histogram",
    "degenerate_groups",
    "gather_aligned",
    "get_loss",
    "group_advantages",
    "kl_penalty",
    "main_advantages",
    "main_reward",
    "ppo_clip_loss",
    "register_loss",
    "sub_advantages",
    "sub_reward",
    "suggest_d_max",
]
