"""Policy losses over masked token arrays, and the registry that lets a config pick one by name.

Every loss has the signature

    loss_fn(inputs: PolicyLossInputs, **hparams) -> (loss_sum, denominator, metrics)

and the objective is `loss_sum / denominator` after summing both over micro-batches and devices, so
gradient accumulation and data parallelism add up exactly. `metrics` are means over this call's trained
tokens (plus `tokens`, the count to weight them by when combining calls; `ratio_min`/`ratio_max` combine
by min/max).

Register your own with

    @register_loss("my_loss")
    def my_loss(inputs, **hparams): ...

and select it with `config.main.loss = "my_loss"`. `register_loss("my_loss", eps_high=0.3)` gives the loss its own
defaults. A registration is the only place a loss's default values live (the functions here take every
hyper-parameter as a required keyword): the config's `loss_hparams` are unset (None) unless a run sets them, and
`resolve_loss_hparams(name, config_hparams)` puts the ones set over the registration's, for the train step and for
the learner's logged `<agent>/loss/*` alike.
"""

import functools
from collections.abc import Callable
from typing import NamedTuple

import jax
import jax.numpy as jnp

from mgrpo_jax.core.registry import Registry

AGGREGATIONS = ("seq-mean-token-mean", "token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm")
RATIO_LEVELS = ("token", "sequence", "sequence-mean")
KL_ESTIMATORS = ("k1", "k3")


class PolicyLossInputs(NamedTuple):
    """One batch of trajectories. B rows (trajectories), T tokens each."""

    logprobs: jax.Array  # [B, T] log pi_theta(token) under the policy being trained
    old_logprobs: jax.Array  # [B, T] behaviour log-probs recorded by the sampler
    advantages: jax.Array  # [B] per trajectory, or [B, T] per token
    mask: jax.Array  # [B, T] 1 on tokens the policy generated (tool responses and padding are 0)
    weights: jax.Array | None = None  # [B] row weights (alignment weights; 0 = padding row)
    ref_logprobs: jax.Array | None = None  # [B, T] frozen reference policy, for the KL term
    entropy: jax.Array | None = None  # [B, T] per-token entropy of the policy, reported only


def _masked_mean(values, mask):
    return (values * mask).sum() / jnp.maximum(mask.sum(), 1.0)


def aggregate(token_losses, mask, weights, mode: str, max_tokens: int | None):
    """Reduce [B, T] per-token losses to `(loss_sum, denominator)` according to `mode`.

    seq-mean-token-mean      mean over a row's tokens, then mean over rows (GRPO);
    token-mean               mean over every trained token of the batch (DAPO);
    seq-mean-token-sum       sum over a row's tokens, mean over rows;
    seq-mean-token-sum-norm  sum over a row's tokens / max_tokens (None: T), mean over rows (Dr. GRPO).
    """
    if mode not in AGGREGATIONS:
        raise ValueError(f"aggregation={mode!r} is not one of {AGGREGATIONS}")
    mask = mask.astype(jnp.float32)
    row_sum = (token_losses * mask).sum(-1)
    row_tokens = mask.sum(-1)
    if mode == "token-mean":
        return (weights * row_sum).sum(), (weights * row_tokens).sum()
    if mode == "seq-mean-token-mean":
        per_row = row_sum / jnp.maximum(row_tokens, 1.0)
        return (weights * per_row).sum(), (weights * (row_tokens > 0)).sum()
    if mode == "seq-mean-token-sum":
        return (weights * row_sum).sum(), weights.sum()
    norm = float(max_tokens if max_tokens is not None else token_losses.shape[-1])
    return (weights * row_sum / norm).sum(), weights.sum()


def role_denominators(mask, weights, roles, n_roles: int, aggregation: str):
    """[n_roles] each role's own denominator under `aggregation` (`aggregate`'s second value over that role's rows
    alone): its weighted rows for the row means, its weighted trained tokens for the token mean. `roles` [B] int
    holds each row's role in 0..n_roles-1; `mask` [B, T] the trained tokens; `weights` [B]."""
    mask = jnp.asarray(mask, jnp.float32)
    own = jax.nn.one_hot(jnp.asarray(roles), n_roles, axis=0) * jnp.asarray(weights, jnp.float32)[None]  # [R, B]
    zeros = jnp.zeros_like(mask)  # a denominator never depends on the losses
    return jax.vmap(lambda w: aggregate(zeros, mask, w, aggregation, None)[1])(own)


def balance_roles(mask, weights, roles, n_roles: int, aggregation: str):
    """[B] row weights under which one batch's `loss_sum / denominator` (any aggregation: both are linear in the
    row weights) is the mean, over the roles present, of each role's own normalised loss L_r / D_r: role r's
    weights are scaled by D / (n * D_r), with D_r its own denominator (`role_denominators`), D their sum and n the
    number of roles with D_r > 0. The batch's denominator stays D (the logged `loss_denominator` keeps its meaning),
    and its loss sum becomes (D / n) * sum_r L_r / D_r. Micro-batches and devices add sums and denominators, so the
    split changes nothing. A shared model's pooled batch (mgrpo_jax/rl/sides.py) weighs its roles so, as two
    models would."""
    weights = jnp.asarray(weights, jnp.float32)
    own = role_denominators(mask, weights, roles, n_roles, aggregation)
    present = own > 0
    scale = jnp.where(present, own.sum() / (jnp.maximum(present.sum(), 1) * jnp.where(present, own, 1.0)), 0.0)
    return weights * scale[jnp.asarray(roles)]


def kl_penalty(logprobs, ref_logprobs, estimator: str):
    """Per-token estimate of KL(pi_theta || pi_ref) from samples of pi_theta: k1 or the low-variance k3."""
    if estimator not in KL_ESTIMATORS:
        raise ValueError(f"kl_estimator={estimator!r} is not one of {KL_ESTIMATORS}")
    log_ratio = ref_logprobs - logprobs
    if estimator == "k1":
        return -log_ratio
    return jnp.exp(log_ratio) - log_ratio - 1.0


def ppo_clip_loss(
    inputs: PolicyLossInputs,
    *,
    eps_low: float,
    eps_high: float,
    dual_clip: float | None,
    ratio_level: str,
    aggregation: str,
    max_tokens: int | None,
    kl_coef: float,
    kl_estimator: str,
):
    """PPO-clipped surrogate with clip-higher, optional dual clip (None: off) and an optional KL to a reference
    (`kl_coef` times `kl_estimator`'s estimate, where the inputs carry `ref_logprobs`). No defaults here: the
    registered losses below hold them (`get_loss("grpo")` is this with grpo's).

    Per token, with ratio r and advantage A: loss = max(-A r, -A clip(r, 1 - eps_low, 1 + eps_high)), and with
    `dual_clip` = c (> 1) a token with A < 0 takes min(that, -c A): its loss is capped at c |A| however large r
    grows. That is verl's `compute_policy_loss` (verl.trainer.ppo.core_algos) with `clip_ratio_c` = c (MATPO
    runs it at 3.0); the metrics then add `dual_clip_frac`, the share of trained tokens the cap binds on (verl's
    `pg_clipfrac_lower`). With `dual_clip=None` the program is the plain clipped surrogate's.

    ratio_level: "token" (per-token ratio), "sequence" (the paper's trajectory ratio, the product of the
    token ratios, formed in log space) or "sequence-mean" (GSPO's length-normalised geometric mean).
    """
    if ratio_level not in RATIO_LEVELS:
        raise ValueError(f"ratio_level={ratio_level!r} is not one of {RATIO_LEVELS}")
    if dual_clip is not None and dual_clip <= 1.0:
        raise ValueError(f"dual_clip must be > 1 (or None), got {dual_clip}")
    mask = inputs.mask.astype(jnp.float32)
    batch = mask.shape[0]
    weights = jnp.ones((batch,), jnp.float32) if inputs.weights is None else inputs.weights.astype(jnp.float32)
    advantages = inputs.advantages.astype(jnp.float32)
    if advantages.ndim == 1:
        advantages = jnp.broadcast_to(advantages[:, None], mask.shape)

    log_ratio = (inputs.logprobs - inputs.old_logprobs) * mask
    if ratio_level != "token":
        seq_log_ratio = log_ratio.sum(-1)
        if ratio_level == "sequence-mean":
            seq_log_ratio = seq_log_ratio / jnp.maximum(mask.sum(-1), 1.0)
        log_ratio = jnp.broadcast_to(seq_log_ratio[:, None], mask.shape)
    ratio = jnp.exp(log_ratio)
    clipped_ratio = jnp.clip(ratio, 1.0 - eps_low, 1.0 + eps_high)
    surrogate = jnp.minimum(ratio * advantages, clipped_ratio * advantages)
    dual_clipped = None
    if dual_clip is not None:
        dual_clipped = (advantages < 0) & (surrogate < dual_clip * advantages)
        surrogate = jnp.where(advantages < 0, jnp.maximum(surrogate, dual_clip * advantages), surrogate)
    token_losses = -surrogate
    kl = None
    if inputs.ref_logprobs is not None:
        kl = kl_penalty(inputs.logprobs, inputs.ref_logprobs, kl_estimator)
        token_losses = token_losses + kl_coef * kl
    loss_sum, denominator = aggregate(token_losses, mask, weights, aggregation, max_tokens)

    trained = mask * (weights[:, None] > 0)
    clipped = (clipped_ratio * advantages < ratio * advantages).astype(jnp.float32)
    big = jnp.float32(jnp.finfo(jnp.float32).max)
    metrics = {
        "tokens": trained.sum(),
        "clip_frac": _masked_mean(clipped, trained),
        "ratio_mean": _masked_mean(ratio, trained),
        "ratio_min": jnp.where(trained > 0, ratio, big).min(),
        "ratio_max": jnp.where(trained > 0, ratio, -big).max(),
        # k3 estimate of KL(old || new) from the old policy's samples.
        "approx_kl": _masked_mean(kl_penalty(inputs.old_logprobs, inputs.logprobs, "k3"), trained),
    }
    if dual_clipped is not None:
        metrics["dual_clip_frac"] = _masked_mean(dual_clipped.astype(jnp.float32), trained)
    if kl is not None:
        metrics["kl_ref"] = _masked_mean(kl, trained)
    if inputs.entropy is not None:
        metrics["entropy"] = _masked_mean(inputs.entropy, trained)
    return loss_sum, denominator, metrics


LossFn = Callable[..., tuple[jax.Array, jax.Array, dict]]
_REGISTRY = Registry("loss", "registered losses")
_DEFAULTS: dict[str, dict] = {}


def register_loss(name: str, *, overwrite: bool = False, **defaults):
    """Decorator registering `fn(inputs, **hparams) -> (loss_sum, denominator, metrics)` under `name`, with the
    default values of the hyper-parameters it takes (`resolve_loss_hparams` puts a config's over them)."""
    register = _REGISTRY.register(name, overwrite=overwrite)

    def decorator(fn):
        register(fn)
        _DEFAULTS[name] = dict(defaults)
        return fn

    return decorator


def loss_defaults(name: str) -> dict:
    """The hyper-parameters loss `name` uses where the config leaves them unset."""
    _REGISTRY.get(name)  # an unknown name is a KeyError listing the registered ones
    return dict(_DEFAULTS.get(name, {}))


def resolve_loss_hparams(name: str, config_hparams=None) -> dict:
    """The keyword arguments loss `name` runs with: its registration's defaults under those `config_hparams` (a
    mapping, e.g. an agent's `loss_hparams.to_dict()`) sets; None means unset."""
    overrides = {k: v for k, v in dict(config_hparams or {}).items() if v is not None}
    return {**loss_defaults(name), **overrides}


def get_loss(name: str, config_hparams=None) -> LossFn:
    """Loss `name` bound to `resolve_loss_hparams(name, config_hparams)`; keyword arguments given to the result
    override those."""
    fn, hparams = _REGISTRY.get(name), resolve_loss_hparams(name, config_hparams)
    return functools.partial(fn, **hparams) if hparams else fn


def available_losses() -> list[str]:
    return _REGISTRY.names()


# kl_coef 0: no KL term, and no reference policy is built (mgrpo_jax/agent/learner.py).
GRPO_DEFAULTS = {"eps_low": 0.2, "eps_high": 0.28, "dual_clip": None, "ratio_level": "token",
                 "aggregation": "seq-mean-token-mean", "max_tokens": None, "kl_coef": 0.0, "kl_estimator": "k3"}
DR_GRPO_DEFAULTS = {**GRPO_DEFAULTS, "aggregation": "seq-mean-token-sum-norm"}
GSPO_DEFAULTS = {**GRPO_DEFAULTS, "ratio_level": "sequence-mean", "eps_low": 3e-4, "eps_high": 4e-4}


@register_loss("grpo", **GRPO_DEFAULTS)
def grpo_loss(inputs: PolicyLossInputs, **hparams):
    """GRPO / M-GRPO: token-level clipped ratio, clip-higher (0.2, 0.28), per-sequence token mean."""
    return ppo_clip_loss(inputs, **hparams)


@register_loss("dr_grpo", **DR_GRPO_DEFAULTS)
def dr_grpo_loss(inputs: PolicyLossInputs, **hparams):
    """Dr. GRPO: token sums normalised by a constant length, so long answers are not down-weighted.

    Pair it with `scale="none"` advantages, as the Dr. GRPO paper does.
    """
    return ppo_clip_loss(inputs, **hparams)


@register_loss("gspo", **GSPO_DEFAULTS)
def gspo_loss(inputs: PolicyLossInputs, **hparams):
    """GSPO: one length-normalised sequence ratio per trajectory, with GSPO's narrow clip range (3e-4, 4e-4)."""
    return ppo_clip_loss(inputs, **hparams)
