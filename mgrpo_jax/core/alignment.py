"""Trajectory alignment: a variable number d_k of sub-agent calls per rollout -> exactly D slots.

For rollout (q, k) with d_k calls and target D (`d_max`):
  * d_k <= D: slot j < d_k holds call j, so every real call appears once, in call order; the remaining
    D - d_k slots hold calls drawn uniformly *with* replacement from the rollout's own d_k calls
    (`mode="duplicate"`, the paper's rule) or are padding of weight 0 (`mode="mask"`, for ablations);
  * d_k > D: the slots hold D distinct calls drawn uniformly *without* replacement (Floyd's algorithm,
    vectorised over rollouts), kept in call order;
  * d_k = 0: all D slots have weight 0, so the rollout is excluded from the sub-agent's group statistics
    and loss (the paper is silent on this case).

`align` is pure and jittable (`d_max` and `mode` are static); the same key gives the same slots.
`gather_aligned` is the host-side step that turns ragged per-call arrays into fixed [Q*K*D, T] batches.
"""

import functools
from collections.abc import Mapping, Sequence

import jax
import jax.numpy as jnp
import numpy as np

MODES = ("duplicate", "mask")


@functools.partial(jax.jit, static_argnames=("d_max", "mode"))
def align(counts, d_max: int, key, mode: str = "duplicate"):
    """Return `(index, weight)`, both [Q, K, D]: which own call fills each slot, and the slot's weight."""
    if mode not in MODES:
        raise ValueError(f"mode={mode!r} is not one of {MODES}")
    if int(d_max) < 1:
        raise ValueError(f"d_max must be >= 1, got {d_max}")
    counts = jnp.asarray(counts, jnp.int32)
    if counts.ndim != 2:
        raise ValueError(f"counts must be [Q, K] sub-call counts, got shape {counts.shape}")
    d = int(d_max)
    dup_key, drop_key = jax.random.split(key)
    slot = jnp.arange(d, dtype=jnp.int32)
    n = counts[..., None]

    # d_k <= D: identity for the first d_k slots, uniform draws with replacement after that.
    draws = jax.random.randint(dup_key, counts.shape + (d,), 0, jnp.iinfo(jnp.int32).max)
    duplicate = draws % jnp.maximum(n, 1)
    fill = jnp.where(slot < n, slot, duplicate if mode == "duplicate" else 0)

    # d_k > D: Floyd's sampling of D distinct values from [0, d_k); step j draws from [0, d_k - D + j].
    uniform = jax.random.uniform(drop_key, counts.shape + (d,))
    chosen = jnp.full(counts.shape + (d,), -1, jnp.int32)
    for j in range(d):
        upper = counts - d + j  # inclusive upper bound of this step's draw
        t = jnp.minimum((uniform[..., j] * (upper + 1).astype(jnp.float32)).astype(jnp.int32), upper)
        taken = (chosen == t[..., None]).any(-1)
        chosen = chosen.at[..., j].set(jnp.where(taken, upper, t))
    kept = jnp.sort(chosen, axis=-1)

    over = n > d
    index = jnp.where(over, kept, fill).astype(jnp.int32)
    real = (slot < n) | (mode == "duplicate")
    weight = jnp.where((n > 0) & real, 1.0, 0.0).astype(jnp.float32)
    index = jnp.where(weight > 0, index, 0)
    return index, weight


def suggest_d_max(counts, quantile: float = 0.99) -> int:
    """Smallest D with P(d_k <= D) >= quantile over the observed counts (at least 1)."""
    if not 0.0 < quantile <= 1.0:
        raise ValueError(f"quantile must be in (0, 1], got {quantile}")
    flat = np.sort(np.asarray(counts).reshape(-1))
    if flat.size == 0:
        raise ValueError("suggest_d_max needs at least one observed sub-call count")
    position = int(np.ceil(quantile * flat.size)) - 1
    return max(1, int(flat[max(position, 0)]))


def d_histogram(counts, max_bin: int | None = None) -> np.ndarray:
    """Histogram of d_k: entry i counts rollouts with exactly i sub-calls (last bin is `>= max_bin`)."""
    flat = np.asarray(counts).reshape(-1).astype(np.int64)
    top = int(flat.max(initial=0)) if max_bin is None else int(max_bin)
    return np.bincount(np.minimum(flat, top), minlength=top + 1)


def gather_aligned(
    calls: Sequence[Sequence[Sequence[Mapping[str, np.ndarray]]]],
    index,
    weight,
    seq_len: int,
    pad_values: Mapping[str, float | int] | None = None,
) -> dict[str, np.ndarray]:
    """Gather ragged per-call arrays into fixed [Q*K*D, seq_len] batches through `index`.

    `calls[q][k][i]` is a mapping of 1-D arrays (e.g. tokens, loss mask, behaviour log-probs) for call i of
    rollout (q, k); every field of one call has the same length <= seq_len. Slots of weight 0 are padding.
    Returns each field as [Q*K*D, seq_len] plus `weight` [Q*K*D] and `source` [Q*K*D, 3] = (q, k, i), with
    i = -1 for padding slots.
    """
    index = np.asarray(index)
    weight = np.asarray(weight, np.float32)
    if index.shape != weight.shape or index.ndim != 3:
        raise ValueError(f"index and weight must both be [Q, K, D]; got {index.shape} and {weight.shape}")
    q_count, k_count, d = index.shape
    if len(calls) != q_count or any(len(row) != k_count for row in calls):
        raise ValueError(f"calls must be nested [Q={q_count}][K={k_count}][d_k]; got a different nesting")
    pad_values = dict(pad_values or {})
    fields = _field_dtypes(calls)
    rows = q_count * k_count * d
    out = {name: np.full((rows, seq_len), pad_values.get(name, 0), dtype) for name, dtype in fields.items()}
    source = np.full((rows, 3), -1, np.int32)
    for q in range(q_count):
        for k in range(k_count):
            for j in range(d):
                row = (q * k_count + k) * d + j
                source[row, :2] = (q, k)
                if weight[q, k, j] <= 0:
                    continue
                i = int(index[q, k, j])
                if not 0 <= i < len(calls[q][k]):
                    raise ValueError(f"index[{q},{k},{j}]={i} but rollout ({q},{k}) has {len(calls[q][k])} calls")
                source[row, 2] = i
                for name, values in calls[q][k][i].items():
                    values = np.asarray(values)
                    if values.shape[0] > seq_len:
                        raise ValueError(
                            f"call ({q},{k},{i}) field {name!r} has length {values.shape[0]} > seq_len={seq_len}"
                        )
                    out[name][row, : values.shape[0]] = values
    out["weight"] = weight.reshape(rows)
    out["source"] = source
    return out


def _field_dtypes(calls) -> dict[str, np.dtype]:
    for rollouts in calls:
        for rollout in rollouts:
            for call in rollout:
                return {name: np.asarray(values).dtype for name, values in call.items()}
    return {}
