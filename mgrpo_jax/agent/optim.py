"""Optimizer and learning-rate schedule from an ml_collections config.

The config (a ``ConfigDict`` or anything with attribute access and ``get``)::

    lr               peak learning rate
    warmup_steps     linear warm-up length (0 = none); step s < warmup uses lr * (s + 1) / warmup, so the
                     very first update is not wasted on a zero learning rate
    decay            'cosine' | 'linear' | 'constant' from the peak after warm-up down to
                     lr * end_lr_ratio at total_steps (constant afterwards)
    total_steps      schedule length in optimizer updates
    end_lr_ratio     final lr / peak lr (default 0.0)
    b1, b2, eps      Adam moments (defaults 0.9, 0.999, 1e-8)
    weight_decay     decoupled (AdamW) weight decay (default 0.0)
    decay_norms_and_biases   also decay norm scales and biases (default False)
    grad_clip_norm   global-norm clipping threshold; None or <= 0 disables it

``make_optimizer(cfg)`` returns an optax ``GradientTransformation``:
``clip_by_global_norm -> scale_by_adam -> add_decayed_weights -> scale_by_learning_rate``, where the last
stage is wrapped in ``optax.inject_hyperparams`` so the optimizer state carries the learning rate used by
the latest update (``current_lr(opt_state)``; the train step reports it as metric ``lr``). The schedule
is indexed by the number of *applied* updates (the optimizer's own counter).
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import ml_collections
import optax

from mgrpo_jax.config import DECAYS


def default_optim_config(**overrides) -> ml_collections.ConfigDict:
    """The optimizer config with every field at its default (edit or override fields)."""
    cfg = ml_collections.ConfigDict(dict(
        lr=1e-5, warmup_steps=0, decay="constant", total_steps=1000, end_lr_ratio=0.0,
        b1=0.9, b2=0.999, eps=1e-8, weight_decay=0.0, decay_norms_and_biases=False,
        grad_clip_norm=1.0,
    ))
    cfg.update(overrides)
    return cfg


def _get(cfg: Any, name: str, default):
    if hasattr(cfg, "get"):
        value = cfg.get(name, default)
    else:
        value = getattr(cfg, name, default)
    return default if value is None and default is not None else value


def lr_schedule(cfg) -> optax.Schedule:
    """``step -> learning rate`` (jittable): linear warm-up, then cosine / linear / constant decay."""
    peak = float(cfg.lr)
    warmup = int(_get(cfg, "warmup_steps", 0))
    total = int(_get(cfg, "total_steps", 0))
    decay = str(_get(cfg, "decay", "constant"))
    end = peak * float(_get(cfg, "end_lr_ratio", 0.0))
    if decay not in DECAYS:
        raise ValueError(f"decay={decay!r} is not one of {DECAYS}")
    decay_steps = max(total - warmup, 1)

    def schedule(step):
        step = jnp.asarray(step, jnp.float32)
        warm = peak * jnp.minimum((step + 1.0) / max(warmup, 1), 1.0) if warmup > 0 else peak
        frac = jnp.clip((step - warmup) / decay_steps, 0.0, 1.0)
        if decay == "cosine":
            after = end + (peak - end) * 0.5 * (1.0 + jnp.cos(jnp.pi * frac))
        elif decay == "linear":
            after = peak + (end - peak) * frac
        else:
            after = jnp.asarray(peak, jnp.float32)
        return jnp.where(step < warmup, warm, after).astype(jnp.float32)

    return schedule


def _decay_mask(params):
    """True for parameters that get weight decay: everything but norm scales and biases."""

    def keep(path, _):
        names = [str(getattr(k, "key", getattr(k, "name", k))) for k in path]
        return not any(n.endswith("norm") or n.endswith("bias") for n in names)

    return jax.tree_util.tree_map_with_path(keep, params)


def make_optimizer(cfg) -> optax.GradientTransformation:
    """AdamW with the schedule of :func:`lr_schedule` and global-norm clipping (see module docstring)."""
    parts = []
    clip = _get(cfg, "grad_clip_norm", None)
    if clip is not None and float(clip) > 0:
        parts.append(optax.clip_by_global_norm(float(clip)))
    parts.append(optax.scale_by_adam(b1=float(_get(cfg, "b1", 0.9)), b2=float(_get(cfg, "b2", 0.999)),
                                     eps=float(_get(cfg, "eps", 1e-8))))
    wd = float(_get(cfg, "weight_decay", 0.0))
    if wd > 0:
        mask = None if _get(cfg, "decay_norms_and_biases", False) else _decay_mask
        parts.append(optax.add_decayed_weights(wd, mask=mask))
    parts.append(optax.inject_hyperparams(optax.scale_by_learning_rate)(learning_rate=lr_schedule(cfg)))
    return optax.chain(*parts)


def current_lr(opt_state) -> jax.Array:
    """The learning rate of the latest update, from an optimizer made by :func:`make_optimizer`.

    NaN when the optimizer carries no injected ``learning_rate`` (e.g. a plain ``optax.sgd`` in tests).
    """
    found = []

    def is_injected(x):
        return hasattr(x, "hyperparams") and hasattr(x, "inner_state")

    def visit(x):
        if is_injected(x) and "learning_rate" in x.hyperparams:
            found.append(x.hyperparams["learning_rate"])
        return x

    jax.tree.map(visit, opt_state, is_leaf=is_injected)
    if not found:
        return jnp.asarray(jnp.nan, jnp.float32)
    return jnp.asarray(found[-1], jnp.float32)
