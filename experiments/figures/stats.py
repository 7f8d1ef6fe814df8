"""The statistics behind the figures' claims: per-seed window means, and for every claim and comparison a
bootstrap interval, an exact permutation p-value, a t-interval and a verdict under one rule fixed in advance.

A claimed ordering "A > B" is tested on one number per seed and arm: that seed's mean of the metric over the
last window of logged points (`window_size`: the last third, fixed before any run was looked at). The effect is
the difference of the arms' means over seeds, `diff = mean(A) - mean(B)`. Every entry (`compare`) states:

- `ci95`: a percentile bootstrap interval over seeds: each of `RESAMPLES` resamples draws the seeds of A with
  replacement and, independently, the seeds of B (or, for a `paired` comparison, the same seeds for both), and
  takes the difference of the resampled means; the interval is the 2.5th and 97.5th percentile of those. The
  random generator is seeded, so a result is reproduced exactly from the same logs. With few seeds it is
  narrower than a nominal 95 % interval (it resamples only the seeds there are): descriptive, not the verdict.
- `p_value` (`permutation_p`): the permutation test of "no difference". Paired arms: the per-seed differences'
  signs are flipped in every one of the 2^n patterns (exact for n <= `EXACT_SIGN_FLIP_MAX_N`), and p is the share
  of patterns whose mean difference is at least the observed one. Unpaired arms: the pooled values are relabelled
  in every one of the C(na + nb, na) ways when that is at most `EXACT_RELABEL_MAX`, else in `PERMUTATION_DRAWS`
  seeded random relabellings with the (b + 1) / (m + 1) estimator; `p_method` says which ran. A claim's `p_value`
  is one-sided in the claimed direction; a comparison without one gets the two-sided p; `p_one_sided` gives both
  directions, which the verdict reads. The smallest one-sided sign-flip p over n seeds is 1 / 2^n: 1/32 = 0.031
  with 5, 1/256 = 0.0039 with 8.
- `t_interval`, `t_dof`: the 95 % two-sided t-interval of the difference: paired, mean(d) +- t_{0.975, n-1} sd(d)
  / sqrt(n) over the per-seed differences d; unpaired, Welch's, with the Welch-Satterthwaite degrees of freedom.
- `verdict` under `VERDICT_RULE` (`rule_verdict`), fixed before the eight-world runs: "reproduced" only when the
  one-sided exact permutation p in the claimed direction is below `ALPHA` = 0.025 AND the t-interval lies above 0;
  "not reproduced" when the mirror holds (the opposite direction's p below 0.025 and the t-interval below 0);
  otherwise "inconclusive". A comparison without a claimed direction gets "A > B" or "B > A" under the same two
  parts, else "inconclusive". With 5 seeds no claim can be "reproduced" (1/32 > 0.025), whatever its effect.
  `bootstrap_verdict` keeps the earlier rule (the bootstrap interval alone), for comparison only.

Differences within rounding of 0 (1e-12, relative to the values) count as 0, so identical arms are never ordered;
an interval end at exactly 0 counts as containing 0.

Every claim also states its minimum detectable difference (`minimum_detectable_difference`, `mdd`): the smallest
true difference these seeds would find with 80 % power in a two-sided t-test at 5 %, from the spread they showed,
(t_0.975 + t_0.8) x the standard error of the difference (over the per-seed differences when paired). An
"inconclusive" claim says that no difference that large is there, not that none is.
"""

from __future__ import annotations

import math
from itertools import combinations

import numpy as np
from scipy import stats as scipy_stats

RESAMPLES = 10_000
LEVEL = 0.95
SEED = 0
WINDOW_FRACTION = 1 / 3  # the last third of the logged points (12 steps: 4; 3 evaluations: the last one)
# The verdict rule's level: one-sided 2.5 %, the 95 % two-sided t-interval's own level on the claimed side.
ALPHA = 0.025
EXACT_SIGN_FLIP_MAX_N = 20  # paired: all 2^n sign patterns up to n = 20 (about a million), else seeded draws
EXACT_RELABEL_MAX = 200_000  # unpaired: all C(na + nb, na) relabellings up to this many, else seeded draws
PERMUTATION_DRAWS = 100_000  # the seeded Monte Carlo's draws when enumeration is too large
# Two permutations whose statistics differ by less than this share of the values' scale are tied (rounding).
TIE_RTOL = 1e-9

REPRODUCED, NOT_REPRODUCED, INCONCLUSIVE = "reproduced", "not reproduced", "inconclusive"
VERDICT_RULE = ("reproduced: one-sided exact permutation p (claimed direction) < 0.025 and the 95 % t-interval "
                "above 0; not reproduced: the opposite direction's p < 0.025 and the t-interval below 0; "
                "else inconclusive")
COMPARISON_RULE = ("A > B: one-sided exact permutation p (A > B) < 0.025 and the 95 % t-interval above 0; B > A: "
                   "the mirror; else inconclusive")


def window_size(points: int, fraction: float = WINDOW_FRACTION) -> int:
    """How many of the last `points` logged points form the window: round(fraction * points), at least 1."""
    if points < 1:
        raise ValueError("no logged points")
    return min(points, max(1, int(math.floor(fraction * points + 0.5))))


def sample_std(values) -> float:
    """The standard deviation over seeds with Bessel's correction (ddof = 1); 0 for a single seed."""
    values = np.asarray(values, np.float64)
    return float(values.std(ddof=1)) if values.size > 1 else 0.0


def _arms(a, b, paired: bool) -> tuple[np.ndarray, np.ndarray]:
    """The two arms' per-seed values as float arrays, checked: non-empty, 1-d, finite, equal sizes when paired."""
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    if a.ndim != 1 or b.ndim != 1 or not a.size or not b.size:
        raise ValueError(f"need two non-empty 1-d sets of per-seed values, got shapes {a.shape} and {b.shape}")
    if not (np.all(np.isfinite(a)) and np.all(np.isfinite(b))):
        raise ValueError("per-seed values must be finite")
    if paired and a.shape != b.shape:
        raise ValueError(f"paired arms need one value per seed in each, got {a.size} and {b.size}")
    return a, b


def _rounding(a: np.ndarray, b: np.ndarray) -> float:
    """How far from 0 a difference of these values may be and still be rounding (0.1 averaged over 3 seeds is not
    0.1 averaged over 4): 1e-12 relative to the values."""
    return 1e-12 * max(1.0, float(np.abs(a).max()), float(np.abs(b).max()))


def _zeroed(tol: float, *xs: float) -> tuple[float, ...]:
    return tuple(0.0 if abs(x) <= tol else float(x) for x in xs)


def paired_differences(a, b) -> np.ndarray:
    """The per-seed differences a[i] - b[i], those within rounding of 0 set to 0."""
    a, b = _arms(a, b, paired=True)
    d = a - b
    d[np.abs(d) <= _rounding(a, b)] = 0.0
    return d


def bootstrap_diff(a, b, *, paired: bool = False, resamples: int = RESAMPLES, level: float = LEVEL,
                   seed: int = SEED) -> tuple[float, tuple[float, float]]:
    """(mean(a) - mean(b), (lo, hi)): the difference of means and its percentile bootstrap interval over seeds.

    Independent arms resample each arm's seeds with replacement on their own; `paired` arms (the same seeds
    measured twice, `a[i]` with `b[i]`) resample seed indices once and take both values of each drawn seed.
    """
    a, b = _arms(a, b, paired)
    rng = np.random.default_rng(seed)
    if paired:
        d = a - b
        draws = d[rng.integers(0, d.size, size=(resamples, d.size))].mean(axis=1)
        diff = float(d.mean())
    else:
        draws = (a[rng.integers(0, a.size, size=(resamples, a.size))].mean(axis=1)
                 - b[rng.integers(0, b.size, size=(resamples, b.size))].mean(axis=1))
        diff = float(a.mean() - b.mean())
    tail = 100 * (1 - level) / 2
    lo, hi = np.percentile(draws, [tail, 100 - tail])
    # Differences within rounding of 0 are 0, so identical arms never get an ordering.
    diff, lo, hi = _zeroed(_rounding(a, b), diff, lo, hi)
    return diff, (lo, hi)


# -- the exact permutation test and the t-interval -------------------------------------------------------------


def _sign_flip_sums(d: np.ndarray) -> np.ndarray:
    """sum_i s_i d_i for every sign pattern s in {-1, +1}^n: 2^n sums, the first one all signs kept."""
    sums = np.zeros(1)
    for x in d:
        sums = np.concatenate([sums + x, sums - x])
    return sums


def _draw_sign_flip_sums(d: np.ndarray, draws: int, rng: np.random.Generator, chunk: int = 10_000) -> np.ndarray:
    out = []
    for start in range(0, draws, chunk):
        signs = rng.choice(np.array([-1.0, 1.0]), size=(min(chunk, draws - start), d.size))
        out.append(signs @ d)
    return np.concatenate(out)


def _relabelled_sums(pooled: np.ndarray, na: int, draws: int | None, rng: np.random.Generator,
                     chunk: int = 10_000) -> np.ndarray:
    """The sum of the values labelled A, for every way to label `na` of the pooled values A (`draws` None), or for
    `draws` uniformly random labellings."""
    if draws is None:
        chosen = np.fromiter((i for c in combinations(range(pooled.size), na) for i in c), np.int64)
        return pooled[chosen.reshape(-1, na)].sum(axis=1)
    out = []
    for start in range(0, draws, chunk):
        rows = np.tile(pooled, (min(chunk, draws - start), 1))
        out.append(rng.permuted(rows, axis=1)[:, :na].sum(axis=1))
    return np.concatenate(out)


def permutation_p(a, b, *, paired: bool, draws: int = PERMUTATION_DRAWS, seed: int = SEED) -> dict:
    """The permutation test of "A and B do not differ" on the difference of means.

    Paired (`a[i]` with `b[i]`): the signs of the per-seed differences are flipped, all 2^n patterns when n <=
    `EXACT_SIGN_FLIP_MAX_N`. Unpaired: the pooled values are relabelled, all C(na + nb, na) ways when that is at
    most `EXACT_RELABEL_MAX`. Otherwise `draws` seeded random flips or relabellings, p = (b + 1) / (m + 1) for b
    of m draws at least as extreme. Returns {"greater": P(A - B >= observed), "less": P(A - B <= observed),
    "two_sided": P(|A - B| >= |observed|), "exact": bool, "permutations": how many were counted, "method": text}.
    Statistics within `TIE_RTOL` of the observed one (relative to the values) count as ties, so at least as extreme.
    """
    a, b = _arms(a, b, paired)
    rng = np.random.default_rng(seed)
    if paired:
        d = paired_differences(a, b)
        n = d.size
        exact = n <= EXACT_SIGN_FLIP_MAX_N
        stats = _sign_flip_sums(d) if exact else _draw_sign_flip_sums(d, draws, rng)
        observed, tol = float(d.sum()), TIE_RTOL * float(np.abs(d).sum())
        what = (f"exact sign-flip: all 2^{n} = {2 ** n:,} sign patterns of the {n} paired differences" if exact else
                f"Monte Carlo sign-flip: {draws:,} seeded draws (seed {seed}) of signs for the {n} paired "
                "differences, p = (b + 1) / (m + 1)")
    else:
        pooled, na, nb = np.concatenate([a, b]), a.size, b.size
        relabellings = math.comb(na + nb, na)
        exact = relabellings <= EXACT_RELABEL_MAX
        total = float(pooled.sum())
        sums = _relabelled_sums(pooled, na, None if exact else draws, rng)
        stats = sums / na - (total - sums) / nb
        observed = float(a.sum()) / na - (total - float(a.sum())) / nb
        tol = TIE_RTOL * float(np.abs(pooled).sum()) / min(na, nb)
        what = (f"exact permutation: all C({na + nb}, {na}) = {relabellings:,} relabellings of the pooled values"
                if exact else f"Monte Carlo permutation: {draws:,} seeded relabellings (seed {seed}) of the pooled "
                f"{na + nb} values (of C({na + nb}, {na}) = {relabellings:,}), p = (b + 1) / (m + 1)")
    counts = {"greater": int(np.count_nonzero(stats >= observed - tol)),
              "less": int(np.count_nonzero(stats <= observed + tol)),
              "two_sided": int(np.count_nonzero(np.abs(stats) >= abs(observed) - tol))}
    if exact:
        p = {k: c / stats.size for k, c in counts.items()}
    else:
        p = {k: (c + 1) / (stats.size + 1) for k, c in counts.items()}
    return {**p, "exact": exact, "permutations": int(stats.size), "method": what}


def t_interval(a, b, *, paired: bool, level: float = LEVEL) -> tuple[tuple[float, float], float]:
    """((lo, hi), degrees of freedom): the `level` two-sided t-interval of mean(a) - mean(b).

    Paired: mean(d) +- t_{(1 + level) / 2, n - 1} sd(d) / sqrt(n) over the per-seed differences d (sd with ddof
    1). Unpaired: Welch's, se^2 = va / na + vb / nb with the Welch-Satterthwaite degrees of freedom
    se^4 / ((va / na)^2 / (na - 1) + (vb / nb)^2 / (nb - 1)) (na + nb - 2 when neither arm varies). NaN when
    an arm (paired: the differences) has a single seed, whose spread is unknown."""
    a, b = _arms(a, b, paired)
    if paired:
        d = paired_differences(a, b)
        if d.size < 2:
            return (math.nan, math.nan), math.nan
        diff, se, dof = float(d.mean()), sample_std(d) / math.sqrt(d.size), float(d.size - 1)
    else:
        if a.size < 2 or b.size < 2:
            return (math.nan, math.nan), math.nan
        va, vb = sample_std(a) ** 2 / a.size, sample_std(b) ** 2 / b.size
        diff, se = float(a.mean() - b.mean()), math.sqrt(va + vb)
        spread = va ** 2 / (a.size - 1) + vb ** 2 / (b.size - 1)
        dof = (va + vb) ** 2 / spread if spread > 0 else float(a.size + b.size - 2)
    half = float(scipy_stats.t.ppf((1 + level) / 2, dof)) * se
    lo, hi = _zeroed(_rounding(a, b), diff - half, diff + half)
    return (lo, hi), dof


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


# -- verdicts ------------------------------------------------------------------------------------------------


def rule_verdict(p_claimed: float, p_opposite: float, t_ci, alpha: float = ALPHA) -> str:
    """The claim "A > B" under `VERDICT_RULE`: reproduced when the one-sided permutation p for A > B is below
    `alpha` and the t-interval of A - B lies above 0; not reproduced when the p for B > A is below `alpha` and
    the t-interval lies below 0; else inconclusive (also when the t-interval is undefined, NaN)."""
    lo, hi = t_ci
    if lo > hi:
        raise ValueError(f"t-interval ({lo}, {hi}) is reversed")
    if p_claimed < alpha and lo > 0:
        return REPRODUCED
    if p_opposite < alpha and hi < 0:
        return NOT_REPRODUCED
    return INCONCLUSIVE


def interval_verdict(ci) -> str:
    """The rule before issue 36, kept for comparison (`bootstrap_verdict`): "A > B" from the bootstrap interval of
    A - B alone: reproduced (all > 0), not reproduced (all < 0), inconclusive."""
    lo, hi = ci
    if lo > hi:
        raise ValueError(f"interval ({lo}, {hi}) is reversed")
    if lo > 0:
        return REPRODUCED
    if hi < 0:
        return NOT_REPRODUCED
    return INCONCLUSIVE


def which_higher(outcome: str, a: str, b: str) -> str:
    """A comparison without a claimed direction: the verdict on "a > b" read as "a > b", "b > a" or inconclusive."""
    return {REPRODUCED: f"{a} > {b}", NOT_REPRODUCED: f"{b} > {a}", INCONCLUSIVE: INCONCLUSIVE}[outcome]


def arm(values) -> dict:
    values = np.asarray(values, np.float64)
    return {"mean": float(values.mean()), "std": sample_std(values), "n": int(values.size),
            "per_seed": [float(v) for v in values]}


def compare(a, b, labels: tuple[str, str], *, paired: bool = False, claimed: bool = True, **kw) -> dict:
    """Arms A (`labels[0]`) and B (`labels[1]`) as one results entry: per-arm mean, std (ddof 1), per-seed values;
    `order` [A, B], `n_seeds`, `diff` = mean(A) - mean(B), the bootstrap `ci95` (`kw`: `resamples`, `level`,
    `seed`), the t-interval (`t_interval`, `t_dof`), the permutation `p_value` (one-sided for a `claimed` A > B,
    else two-sided; `p_one_sided` both directions; `p_method`), the `verdict` under `verdict_rule` (on "A > B",
    or which is higher when not `claimed`), the earlier rule's `bootstrap_verdict`, and the minimum detectable
    difference `mdd`."""
    first, second = labels
    diff, ci = bootstrap_diff(a, b, paired=paired, **kw)
    p = permutation_p(a, b, paired=paired, seed=kw.get("seed", SEED))
    t_ci, dof = t_interval(a, b, paired=paired)
    outcome, by_interval = rule_verdict(p["greater"], p["less"], t_ci), interval_verdict(ci)
    arms = {first: arm(a), second: arm(b)}
    return {"arms": arms, "order": list(labels), "n_seeds": min(x["n"] for x in arms.values()), "paired": paired,
            "diff": diff, "ci95": list(ci), "resamples": kw.get("resamples", RESAMPLES),
            "t_interval": list(t_ci), "t_dof": dof, "t_method": "paired t" if paired else "Welch",
            "p_value": p["greater"] if claimed else p["two_sided"],
            "p_alternative": f"{first} > {second}" if claimed else "two-sided",
            "p_one_sided": {f"{first} > {second}": p["greater"], f"{second} > {first}": p["less"]},
            "p_method": p["method"],
            "verdict": outcome if claimed else which_higher(outcome, first, second),
            "verdict_rule": VERDICT_RULE if claimed else COMPARISON_RULE,
            "bootstrap_verdict": by_interval if claimed else which_higher(by_interval, first, second),
            "mdd": minimum_detectable_difference(a, b, paired=paired)}


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
