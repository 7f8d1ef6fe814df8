"""Pure, jittable M-GRPO kernels: rewards, alignment, advantages, policy losses, and `mgrpo_targets`, which
chains the first three into one step's targets (no I/O, no state); `matpo_targets` is MATPO's credit beside it, and
the credit registry picks either by name."""

from mgrpo_jax.core.advantages import (
    available_advantages,
    degenerate_groups,
    get_advantage,
    group_advantages,
    main_advantages,
    register_advantage,
    sub_advantages,
)
from mgrpo_jax.core.alignment import align, d_histogram, gather_aligned, suggest_d_max
from mgrpo_jax.core.credit import available_credits, credit_config_type, get_credit, register_credit
from mgrpo_jax.core.losses import (
    PolicyLossInputs,
    aggregate,
    available_losses,
    get_loss,
    kl_penalty,
    loss_defaults,
    ppo_clip_loss,
    register_loss,
    resolve_loss_hparams,
)
from mgrpo_jax.core.matpo import MatpoConfig, matpo_targets
from mgrpo_jax.core.mgrpo import RolloutArrays, Targets, TargetsConfig, mgrpo_targets
from mgrpo_jax.core.rewards import main_reward, sub_reward

__all__ = [
    "MatpoConfig",
    "PolicyLossInputs",
    "RolloutArrays",
    "Targets",
    "TargetsConfig",
    "available_advantages",
    "available_credits",
    "credit_config_type",
    "get_credit",
    "matpo_targets",
    "register_credit",
    "get_advantage",
    "mgrpo_targets",
    "register_advantage",
    "aggregate",
    "align",
    "available_losses",
    "d_histogram",
    "degenerate_groups",
    "gather_aligned",
    "get_loss",
    "loss_defaults",
    "group_advantages",
    "kl_penalty",
    "main_advantages",
    "main_reward",
    "ppo_clip_loss",
    "register_loss",
    "resolve_loss_hparams",
    "sub_advantages",
    "sub_reward",
    "suggest_d_max",
]
