"""Shape buckets for the sampler: a few padded shapes cover every call, so each compiles once.

The sampler compiles one executable per (batch, prompt length, max_new). Rounding the batch size and the
longest prompt up to the next bucket bounds the number of compilations by
``len(batch_buckets) * len(length_buckets)`` per ``max_new``.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

DEFAULT_BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024)
DEFAULT_LENGTH_BUCKETS = (16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384, 32768)


def pow2_buckets(lo: int, hi: int) -> tuple[int, ...]:
    """Powers of two from ``lo`` up to at least ``hi`` (``lo`` rounded up to a power of two)."""
    b = 1 << max(0, int(lo - 1).bit_length())
    out = [b]
    while out[-1] < hi:
        out.append(out[-1] * 2)
    return tuple(out)


def bucket(n: int, buckets: Sequence[int], multiple: int = 1) -> int:
    """Smallest bucket ``>= n`` that is a multiple of ``multiple``; past the last bucket, ``n`` rounded up
    to a multiple of the last bucket (so shapes stay few even for outliers)."""
    if n < 0:
        raise ValueError("n must be >= 0")
    for b in sorted(buckets):
        if b >= n and b % multiple == 0:
            return b
    step = max(sorted(buckets)[-1], 1)
    step = step * multiple // np.gcd(step, multiple)
    return max(step, -(-n // step) * step)


def pad_prompts(
    prompts: Sequence[Sequence[int]],
    *,
    batch_buckets: Sequence[int] = DEFAULT_BATCH_BUCKETS,
    length_buckets: Sequence[int] = DEFAULT_LENGTH_BUCKETS,
    pad_id: int = 0,
    batch_multiple: int = 1,
) -> tuple[np.ndarray, np.ndarray]:
    """Right-pad variable-length prompts to ``[batch_bucket, length_bucket]``.

    Returns ``(tokens int32, lengths int32)``. Rows added to fill the batch bucket hold one ``pad_id`` and
    length 1 (give them a budget of 0). ``batch_multiple``: the batch bucket must divide evenly over the
    mesh's data axes.
    """
    if not len(prompts):
        raise ValueError("no prompts")
    lengths = [len(p) for p in prompts]
    if min(lengths) < 1:
        raise ValueError("every prompt needs at least one token (e.g. BOS)")
    B = bucket(len(prompts), batch_buckets, batch_multiple)
    P = bucket(max(lengths), length_buckets)
    tokens = np.full((B, P), pad_id, np.int32)
    out_len = np.ones((B,), np.int32)
    for i, p in enumerate(prompts):
        tokens[i, : len(p)] = np.asarray(p, np.int32)
        out_len[i] = len(p)
    return tokens, out_len
