"""The statistics behind the figures' claims: per-seed window means, a bootstrap interval over seeds, a verdict.

A claimed ordering "A > B" is tested on one number per seed and arm: that seed's mean of the metric over the
last window of logged points (`window_size`: the last third, fixed before any run was looked at). The effect is
the difference of the arms' means over seeds, `diff = mean(A) - mean(B)`, and its 95 % interval is a percentile
bootstrap over seeds: each of `RESAMPLES` resamples draws the seeds of A with replacement and, independently,
the seeds of B (or, for a `paired` comparison of two windows of the same runs, the same seeds for both), and
takes the difference of the resampled means; the interval is the 2.5th and 97.5th percentile of those
differences. The random generator is seeded, so a result is reproduced exactly from the same logs.

Verdict (`verdict`): "reproduced" when the whole interval lies above 0 (the claimed direction), "not reproduced"
when it lies entirely below 0 (the opposite ordering), "inconclusive" when it contains 0 (an end at exactly 0
counts as containing it; differences within 1e-12 of 0, relative to the values, are rounding and count as 0).
With 5 seeds a percentile bootstrap interval is narrower than a nominal 95 % one (it resamples only the seeds
there are), so a "reproduced" is weaker evidence than its 95 % suggests; an "inconclusive" means that even this
interval contains 0, not that there is no effect.

Every claim also states its minimum detectable difference (`minimum_detectable_difference`, `mdd`): the smallest
true difference these seeds would find with 80 % power in a two-sided t-test at 5 %, from the spread they showed,
(t_0.975 + t_0.8) x the standard error of the difference (over the per-seed differences when paired). An
"inconclusive" claim says that no difference that large is there, not that none is.
"""

from __future__ import annotations

import math

import numpy as np
from scipy import stats as scipy_stats

RESAMPLES = 10_000
LEVEL = 0.95
SEED = 0
WINDOW_FRACTION = 1 / 3  # the last third of the logged points (12 steps: 4; 3 evaluations: the last one)

REPRODUCED, NOT_REPRODUCED, INCONCLUSIVE = "reproduced", "not reproduced", "inconclusive"


def window_size(points: int, fraction: float = WINDOW_FRACTION) -> int:
    """How many of the last `points` logged points form the window: round(fraction * points), at least 1."""
    if points < 1:
        raise ValueError("no logged points")
    return min(points, max(1, int(math.floor(fraction * points + 0.5))))


def sample_std(values) -> float:
    """The standard deviation over seeds with Bessel's correction (ddof = 1); 0 for a single seed."""
    values = np.asarray(values, np.float64)
    return float(values.std(ddof=1)) if values.size > 1 else 0.0


def bootstrap_diff(a, b, *, paired: bool = False, resamples: int = RESAMPLES, level: float = LEVEL,
                   seed: int = SEED) -> tuple[float, tuple[float, float]]:
    """(mean(a) - mean(b), (lo, hi)): the difference of means and its percentile bootstrap interval over seeds.

    Independent arms resample each arm's seeds with replacement on their own; `paired` arms (the same seeds
    measured twice, `a[i]` with `b[i]`) resample seed indices once and take both values of each drawn seed.
    """
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    if a.ndim != 1 or b.ndim != 1 or not a.size or not b.size:
        raise ValueError(f"need two non-empty 1-d sets of per-seed values, got shapes {a.shape} and {b.shape}")
    if not (np.all(np.isfinite(a)) and np.all(np.isfinite(b))):
        raise ValueError("per-seed values must be finite")
    rng = np.random.default_rng(seed)
    if paired:
        if a.shape != b.shape:
            raise ValueError(f"paired arms need one value per seed in each, got {a.size} and {b.size}")
        d = a - b
        draws = d[rng.integers(0, d.size, size=(resamples, d.size))].mean(axis=1)
        diff = float(d.mean())
    else:
        draws = (a[rng.integers(0, a.size, size=(resamples, a.size))].mean(axis=1)
                 - b[rng.integers(0, b.size, size=(resamples, b.size))].mean(axis=1))
        diff = float(a.mean() - b.mean())
    tail = 100 * (1 - level) / 2
    lo, hi = np.percentile(draws, [tail, 100 - tail])
    # Means of equal values can differ in the last bit (0.1 averaged over 3 seeds is not 0.1 averaged over 4):
    # differences within rounding of 0 are 0, so identical arms never get an ordering.
    tol = 1e-12 * max(1.0, float(np.abs(a).max()), float(np.abs(b).max()))
    diff, lo, hi = (0.0 if abs(x) <= tol else float(x) for x in (diff, lo, hi))
    return diff, (lo, hi)


def minimum_detectable_difference(a, b, *, paired: bool = False, power: float = 0.8, alpha: float = 0.05) -> float:
    """The smallest |mean(a) - mean(b)| a two-sided t-test at `alpha` detects with `power`, given the per-seed
    spread: (t_{1 - alpha/2} + t_{power}) x the standard error of the difference (paired: of the per-seed
    differences, n - 1 degrees of freedom; else Welch's standard error with na + nb - 2). NaN without the seeds
    to estimate a spread (one seed per arm)."""
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    if paired:
        d = a - b
        se, dof = sample_std(d) / math.sqrt(d.size), d.size - 1
    else:
        se, dof = math.sqrt(sample_std(a) ** 2 / a.size + sample_std(b) ** 2 / b.size), a.size + b.size - 2
    if dof < 1:
        return float("nan")
    return float((scipy_stats.t.ppf(1 - alpha / 2, dof) + scipy_stats.t.ppf(power, dof)) * se)


def verdict(ci) -> str:
    """The claim "A > B" from the interval of A - B: reproduced (all > 0), not reproduced (all < 0), inconclusive."""
    lo, hi = ci
    if lo > hi:
        raise ValueError(f"interval ({lo}, {hi}) is reversed")
    if lo > 0:
        return REPRODUCED
    if hi < 0:
        return NOT_REPRODUCED
    return INCONCLUSIVE


def which_higher(ci, a: str, b: str) -> str:
    """For an ablation (no claimed direction): "a > b", "b > a", or "inconclusive" from the interval of a - b."""
    return {REPRODUCED: f"{a} > {b}", NOT_REPRODUCED: f"{b} > {a}", INCONCLUSIVE: INCONCLUSIVE}[verdict(ci)]


def arm(values) -> dict:
    values = np.asarray(values, np.float64)
    return {"mean": float(values.mean()), "std": sample_std(values), "n": int(values.size),
            "per_seed": [float(v) for v in values]}


def compare(a, b, labels: tuple[str, str], *, paired: bool = False, claimed: bool = True, **kw) -> dict:
    """Arms A (`labels[0]`) and B (`labels[1]`) as one results entry: per-arm mean, std (ddof 1), per-seed values;
    `order` [A, B], `n_seeds`, `diff` = mean(A) - mean(B), `ci95`, the `verdict` on "A > B" (`claimed`) or
    which is higher, and the minimum detectable difference `mdd`."""
    diff, ci = bootstrap_diff(a, b, paired=paired, **kw)
    arms = {labels[0]: arm(a), labels[1]: arm(b)}
    return {"arms": arms, "order": list(labels), "n_seeds": min(x["n"] for x in arms.values()), "paired": paired,
            "diff": diff, "ci95": list(ci), "verdict": verdict(ci) if claimed else which_higher(ci, *labels),
            "mdd": minimum_detectable_difference(a, b, paired=paired), "resamples": kw.get("resamples", RESAMPLES)}


def last_window(steps, values, fraction: float = WINDOW_FRACTION) -> tuple[np.ndarray, dict]:
    """Each run's (row of `values`, [runs, points]) mean over its last window: (per-seed values, window facts)."""
    steps, values = np.asarray(steps), np.asarray(values, np.float64)
    n = window_size(len(steps), fraction)
    return values[:, -n:].mean(axis=1), {"window": n, "window_steps": [int(steps[-n]), int(steps[-1])]}


def first_window(steps, values, fraction: float = WINDOW_FRACTION) -> tuple[np.ndarray, dict]:
    """As `last_window`, over the first window of logged points."""
    steps, values = np.asarray(steps), np.asarray(values, np.float64)
    n = window_size(len(steps), fraction)
    return values[:, :n].mean(axis=1), {"window": n, "window_steps": [int(steps[0]), int(steps[n - 1])]}


# -- logged histograms of counts (the d_k histogram, and D for the d_max ablation from it) -------------------------


def summed_counts(rows_by_run, prefix: str) -> np.ndarray:
    """The summed histogram that runs' metric rows logged as `<prefix><bin>` keys (entry i: bin i), over every row
    of every run in `rows_by_run` ({run name: its rows}, each row with the histogram)."""
    total = None
    for rows in rows_by_run.values():
        for row in rows:
            bins = sorted(int(k[len(prefix):]) for k in row if k.startswith(prefix))
            counts = np.asarray([row[f"{prefix}{i}"] for i in bins], np.int64)
            total = counts if total is None else total + counts
    if total is None:
        raise ValueError(f"runs {list(rows_by_run)} logged no {prefix}* histogram")
    return total


def count_percentile(counts, q: float) -> int:
    """The smallest bin d with at least a fraction q of the counts at or below it."""
    counts = np.asarray(counts)
    cdf = np.cumsum(counts) / max(counts.sum(), 1)
    return int(np.searchsorted(cdf, q - 1e-12))
