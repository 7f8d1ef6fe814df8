"""MATPO's credit assignment (arXiv 2510.04678, as its public code runs it), beside M-GRPO's `mgrpo_targets`.

    targets = matpo_targets(arrays, key, MatpoConfig())   # same RolloutArrays in, same Targets out

MATPO trains the planner and the worker roles inside one model, and credits the workers only through the planner:

  1. only the planner's final answer is judged: R[q, k] = w_correct * correct + w_format * format_term, where
     format_term = (planner format + the mean of its workers' formats over the real calls i < counts[q, k]) / 2,
     and a rollout that made no call averages the planner's format with 0: (planner + 0) / 2. Only when no
     rollout of the whole step called a worker is format_term the planner's format alone. There is no hard
     format gate (unlike M-GRPO's R_M) and no expert score in the reward;
  2. advantages: the estimator (GRPO by default) over each query's K planner rollouts only, with the sample
     standard deviation (ddof = 1; `MatpoConfig.std_ddof`); workers are not members of any normalisation group;
  3. every real worker call i < counts[q, k] gets its parent rollout's scalar advantage, with weight 1; entries past
     counts are padding: weight 0, advantage 0, and never read (a NaN there changes nothing).

Each choice follows a file of MATPO's public code (github.com/mzf666/MATPO, a verl fork; read at its commit
3c41d62):
  - the reward and its format term: `verl.workers.reward_manager.subagent_tool`
    (`SubagentToolRewardManager._call_include_subagent_tool`: `tool_format_reward = 0.5 * (main + mean(subagent
    formats) if any else 0.0)`; a batch with no sub-agent rollout at all goes to `_call_only_main_agent`, which
    adds the planner's format alone), with the weights 0.9 / 0.1 and `gate_tool_format_reward: False` of
    `examples/sglang_multiturn/config/simpleqa_multiturn_rm_batch_grpo_agent.yaml`;
  - the advantages: `verl.trainer.ppo.ray_trainer` computes them on the planner rollouts only
    (`extract_main_agent_rollouts`) and copies each to its workers (`broadcast_advantage_return_tensor_by_reqs_ids`);
    `verl.trainer.ppo.core_algos` (`compute_grpo_outcome_advantage`) divides by `torch.std`, the sample std;
  - the loss (the `matpo` mode's default, `mgrpo_jax.config.MATPO_LOSS_HPARAMS`, applied under
    `loss_recipe="mode"`): `core_algos.py` (`compute_policy_loss`: clip 0.2 / 0.2 and the dual clip at
    `clip_ratio_c` 3.0 on negative advantages, our grpo loss's `dual_clip`; `agg_loss`: token mean) with the values
    of `verl/trainer/config/ppo_trainer.yaml` (`clip_ratio_low/high` 0.2, `clip_ratio_c` 3.0, `loss_agg_mode:
    token-mean`), no KL.
Left as they are here (differences below float32 noise or outside what this world reaches): verl divides by
`std + 1e-6` where the estimator here divides by `max(std, 1e-6)` (a relative 1e-6); verl gives a group of one
rollout its raw score (K >= 2 in every preset); verl's dynamic micro-batches take a token mean per micro-batch
weighted by its rows (`verl.workers.actor.dp_actor`), where the step here takes one exact mean over the batch.

The shared model's recipe (docs/matpo.md): mode `matpo` runs MATPO's full recipe by default, this credit with
`MATPO_LOSS_HPARAMS` (`loss_recipe="mode"`); `loss_recipe="default"` keeps the agents' own loss settings (the grpo
defaults), so the 2 x 2 of {distinct, shared} x {M-GRPO, MATPO credit} changes one thing per pair. How the pooled
batch weighs the two roles is `rollout.shared_role_weighting`: "per_role" (the default: each role's loss normalised
by its own denominator, the two averaged, as two models would weigh them) or "pooled" (one mean over every row or
token, as MATPO's code does).

There is no alignment to a fixed D: the output is per raw call, [Q, K, C]. It is returned as the same `Targets` that
`mgrpo_targets` returns, with D = C and the identity slot map (`sub_index[q, k, i] = i`), so a train step gathers
worker rows exactly as it gathers aligned sub rows, and the padding rows arrive with weight 0 (the sides keep only
the real rows, padded to a bucketed size: mgrpo_jax/rl/sides.py). `sub_reward` is the parent's reward, the reward a
worker row is credited with; a worker has no reward of its own.

MATPO's loss pools planner and worker tokens into one token mean (one sum of per-token losses over every planner and
worker token, divided by their total count). `losses.aggregate(..., "token-mean", ...)` already returns that
`(sum, count)` pair for any set of rows, and pairs add: compute the planner rows' pair and the worker rows' pair
(e.g. from two `ppo_clip_loss(..., aggregation="token-mean")` calls) and divide the summed sums by the summed
counts. That equals the token mean over the two sets of rows concatenated.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp

from mgrpo_jax.core.advantages import degenerate_groups, get_advantage
from mgrpo_jax.core.mgrpo import RolloutArrays, Targets, TargetsConfig


@dataclasses.dataclass(frozen=True)
class MatpoConfig:
    """The static half of MATPO's targets: its reward weights (the paper's 0.9 / 0.1) and the advantage estimator
    over the planner group (the same estimators and options as `TargetsConfig`)."""

    correct_weight: float = 0.9
    format_weight: float = 0.1
    estimator: str = TargetsConfig.estimator
    estimator_options: tuple[tuple[str, object], ...] = TargetsConfig.estimator_options
    std_ddof: int = 1  # the group std of the "grpo" estimator: sample (1, as torch.std) or population (0)

    @classmethod
    def from_config(cls, config) -> MatpoConfig:
        """From a run config: the estimator from `advantages.*` (read as `TargetsConfig` reads it); the weights from
        `rewards.matpo_correct_weight` / `rewards.matpo_format_weight` where the config has them."""
        shared = TargetsConfig.from_config(config)
        rewards = config.rewards
        return cls(correct_weight=float(rewards.get("matpo_correct_weight", cls.correct_weight)),
                   format_weight=float(rewards.get("matpo_format_weight", cls.format_weight)),
                   estimator=shared.estimator, estimator_options=shared.estimator_options)

    def advantages(self, rewards, weights):
        """The estimator over groups [G, N]; the "grpo" estimator with MATPO's sample std (`std_ddof`)."""
        options = dict(self.estimator_options)
        if self.estimator == "grpo":
            options.setdefault("ddof", self.std_ddof)
        return get_advantage(self.estimator)(rewards, weights, **options)


def real_calls(counts, calls: int):
    """[Q, K, C] bool: True for the worker calls a rollout really made (i < counts[q, k]); the rest is padding."""
    return jnp.arange(calls)[None, None, :] < jnp.asarray(counts, jnp.int32)[..., None]


def masked_call_mean(values, real):
    """Mean of `values` [Q, K, C] over each rollout's real calls, [Q, K] (0 where there are none). Padding is
    selected away with `where`, not multiplied by 0, so NaN or garbage there never reaches the result."""
    total = jnp.where(real, jnp.asarray(values, jnp.float32), 0.0).sum(-1)
    return total / jnp.maximum(real.sum(-1), 1)


def matpo_format_term(format_ok, sub_format_ok, counts):
    """[Q, K] format score of a whole rollout, as MATPO's reward manager computes it: the planner's format averaged
    with its workers' mean format, 0 for the workers of a rollout that called none; the planner's alone only when
    no rollout of the step called a worker (the manager's planner-only path)."""
    planner = jnp.asarray(format_ok, jnp.float32)
    real = real_calls(counts, sub_format_ok.shape[-1])
    workers = masked_call_mean(sub_format_ok, real)  # 0 for a rollout without calls
    return jnp.where(real.any(), 0.5 * (planner + workers), planner)


def matpo_reward(correct, format_term, correct_weight=0.9, format_weight=0.1):
    """[Q, K] planner reward: w_correct * correct + w_format * format_term (no gate: MATPO's format is a bonus)."""
    return correct_weight * jnp.asarray(correct, jnp.float32) + format_weight * format_term


def broadcast_to_calls(per_rollout, real):
    """Each rollout's scalar [Q, K] copied to its real calls [Q, K, C]; 0 on padding."""
    return jnp.where(real, per_rollout[..., None], 0.0)


@functools.partial(jax.jit, static_argnames=("config",))
def matpo_targets(arrays: RolloutArrays, key: jax.Array, config: MatpoConfig) -> Targets:
    """MATPO's rewards and advantages for one step (see the module docstring). `key` is unused: MATPO draws
    nothing; it is taken so every registered credit assignment has the signature `fn(arrays, key, config)`."""
    del key
    correct = jnp.asarray(arrays.correct, jnp.float32)
    counts = jnp.asarray(arrays.counts, jnp.int32)
    calls = arrays.sub_format_ok.shape[-1]
    real = real_calls(counts, calls)

    format_term = matpo_format_term(arrays.format_ok, arrays.sub_format_ok, counts)
    main_r = matpo_reward(correct, format_term, config.correct_weight, config.format_weight)
    planner_weight = jnp.ones_like(main_r)
    main_adv = config.advantages(main_r, planner_weight)

    sub_weight = real.astype(jnp.float32)
    sub_r = broadcast_to_calls(main_r, real)
    sub_adv = broadcast_to_calls(main_adv, real)
    identity = jnp.broadcast_to(jnp.arange(calls, dtype=jnp.int32), real.shape)

    n_calls = jnp.maximum(real.sum(), 1)
    degenerate = degenerate_groups(main_r, planner_weight)
    stats = {
        "main_reward": main_r.mean(),
        "main_correct": correct.mean(),
        "main_format_ok": jnp.asarray(arrays.format_ok, jnp.float32).mean(),
        "main_format_term": format_term.mean(),
        "main_zero_std_groups": degenerate.sum(),
        "sub_calls": real.sum(),
        "sub_reward": (sub_r * sub_weight).sum() / n_calls,
        "sub_expert": jnp.where(real, jnp.asarray(arrays.sub_expert, jnp.float32), 0.0).sum() / n_calls,
        "sub_format_ok": jnp.where(real, jnp.asarray(arrays.sub_format_ok, jnp.float32), 0.0).sum() / n_calls,
        # A worker's group is its planner's: a degenerate planner group zeroes every call under it.
        "sub_zero_std_groups": (degenerate & real.any((-2, -1))).sum(),
    }
    return Targets(main_r, main_adv, identity, sub_weight, sub_r, sub_adv, sub_r, stats)
