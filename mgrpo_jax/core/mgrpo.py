"""One M-GRPO step's targets, from the rollout's padded arrays to what both train steps need, in one jitted call.

    arrays = RolloutArrays(format_ok, correct, sub_format_ok, sub_expert, counts)   # from the rollout, once
    targets = mgrpo_targets(arrays, key, TargetsConfig.from_config(config))

The maths, in order (paper Eqs. 4-5 and 9-13):

  1. main rewards   R_M[q, k] = alpha_1 * format + alpha_2 * correct, 0 when the main trajectory breaks the format;
  2. main advantages: the chosen estimator over each query's K rollouts;
  3. alignment: rollout (q, k)'s d_k sub-calls -> exactly D slots (`align`: duplicates, drops, d_k = 0 masked);
  4. sub rewards    R_S[q, k, i] = beta_1 * format_i + beta_2 * correct[q, k] + beta_3 * expert_i, 0 when call i
     breaks the format; computed for every raw call, then gathered into the aligned slots;
  5. sub advantages: the estimator over each query's pooled K * D aligned slots (a slot of weight 0 gets 0).

Raw per-call arrays are [Q, K, C] with C >= max d_k (the engine's `max_sub_calls`, so one shape compiles once);
entries at i >= counts[q, k] are padding and never read. `sub_call_reward` keeps step 4 before alignment: the
unsynchronised ablation trains on every real call once, with no slots (mgrpo_jax/rl/unsync.py).

Everything here is pure and jittable; `TargetsConfig` is static (hashable), the arrays and the key are traced.
In the decoupled mode each job calls the same function on what it holds: the main job with its own rewards and
empty sub-call arrays, the sub job with the main job's published `format_ok` / `correct` and its own calls.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp

from mgrpo_jax.core.advantages import degenerate_groups, get_advantage
from mgrpo_jax.core.alignment import align
from mgrpo_jax.core.rewards import main_reward, sub_reward


class RolloutArrays(NamedTuple):
    """What the rollout's judges said, as padded arrays (the only thing the targets read from a rollout)."""

    format_ok: jax.Array  # [Q, K] bool: the top-level agent's whole trajectory keeps the grammar
    correct: jax.Array  # [Q, K] float32: its final answer's correctness (binary or graded in [0, 1])
    sub_format_ok: jax.Array  # [Q, K, C] bool: sub-call i keeps the grammar
    sub_expert: jax.Array  # [Q, K, C] float32 in [0, 1]: the expert judge's score of sub-call i
    counts: jax.Array  # [Q, K] int32: d_k, the rollout's number of sub-calls (<= C)


class Targets(NamedTuple):
    """One step's targets for both roles. `mgrpo_targets` aligns the sub rows to D = d_max slots; MATPO's
    `matpo_targets` (mgrpo_jax/core/matpo.py) returns them per raw call, D = C with `sub_index[..., i] = i`."""

    main_reward: jax.Array  # [Q, K]
    main_advantages: jax.Array  # [Q, K]
    sub_index: jax.Array  # [Q, K, D] int32: which own call fills each aligned slot
    sub_weight: jax.Array  # [Q, K, D] float32: 1 for a real or duplicated call, 0 for a masked slot
    sub_reward: jax.Array  # [Q, K, D] R_S of each slot (0 where the weight is 0)
    sub_advantages: jax.Array  # [Q, K, D]
    sub_call_reward: jax.Array  # [Q, K, C] R_S of each raw call (0 past d_k)
    stats: dict  # scalar summaries: main/sub reward means, zero-std group counts


@dataclasses.dataclass(frozen=True)
class TargetsConfig:
    """The static half of the targets: reward weights, alignment and the advantage estimator with its options."""

    alpha: tuple[float, float] = (0.1, 0.9)
    beta: tuple[float, float, float] = (0.1, 0.4, 0.5)
    d_max: int = 8
    align_mode: str = "duplicate"
    estimator: str = "grpo"
    estimator_options: tuple[tuple[str, object], ...] = (("scale", "group"), ("baseline", "mean"), ("eps", 1e-6))

    @classmethod
    def from_config(cls, config) -> TargetsConfig:
        """From a run config: `rewards.alpha/beta`, `rollout.d_max/align_mode`, `advantages.*`."""
        options = {k: v for k, v in config.advantages.to_dict().items() if k != "estimator"}
        return cls(alpha=tuple(float(a) for a in config.rewards.alpha),
                   beta=tuple(float(b) for b in config.rewards.beta), d_max=int(config.rollout.d_max),
                   align_mode=str(config.rollout.align_mode),
                   estimator=str(config.advantages.get("estimator", "grpo")),
                   estimator_options=tuple(sorted(options.items())))

    def advantages(self, rewards, weights):
        """The estimator over groups [G, N]."""
        return get_advantage(self.estimator)(rewards, weights, **dict(self.estimator_options))


@functools.partial(jax.jit, static_argnames=("config",))
def mgrpo_targets(arrays: RolloutArrays, key: jax.Array, config: TargetsConfig) -> Targets:
    """Rewards, alignment and advantages of both agents for one step (see the module docstring)."""
    format_ok = jnp.asarray(arrays.format_ok, bool)
    correct = jnp.asarray(arrays.correct, jnp.float32)
    counts = jnp.asarray(arrays.counts, jnp.int32)
    q_count, k_count = correct.shape
    calls = arrays.sub_format_ok.shape[-1]

    main_r = main_reward(format_ok, correct, config.alpha)
    main_adv = config.advantages(main_r, jnp.ones_like(main_r))

    real_call = jnp.arange(calls)[None, None, :] < counts[..., None]
    call_r = sub_reward(arrays.sub_format_ok, correct[..., None], arrays.sub_expert, config.beta) * real_call
    index, weight = align(counts, config.d_max, key, mode=config.align_mode)
    sub_r = jnp.take_along_axis(call_r, index, axis=-1) * (weight > 0)
    pooled_r = sub_r.reshape(q_count, -1)
    pooled_w = weight.reshape(q_count, -1)
    sub_adv = config.advantages(pooled_r, pooled_w).reshape(sub_r.shape)

    valid = weight > 0
    n_calls = jnp.maximum(real_call.sum(), 1)
    stats = {
        "main_reward": main_r.mean(),
        "main_correct": correct.mean(),
        "main_format_ok": format_ok.mean(),
        "main_zero_std_groups": degenerate_groups(main_r, jnp.ones_like(main_r)).sum(),
        "sub_reward": jnp.where(valid.any(), (sub_r * valid).sum() / jnp.maximum(valid.sum(), 1), 0.0),
        "sub_expert": (arrays.sub_expert * real_call).sum() / n_calls,
        "sub_format_ok": (arrays.sub_format_ok * real_call).sum() / n_calls,
        "sub_zero_std_groups": degenerate_groups(pooled_r, pooled_w).sum(),
    }
    return Targets(main_r, main_adv, index, weight, sub_r, sub_adv, call_r, stats)
