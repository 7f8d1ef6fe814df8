"""The statistics every claim states beside its bootstrap interval (experiments/figures/stats.py): the minimum
detectable difference, the exact permutation p-value, the t-interval and the verdict rule fixed before the runs."""

import math
import os

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from experiments.figures import stats


def test_minimum_detectable_difference_by_hand():
    # Paired: differences 0.1, 0.2, 0.3 -> sd 0.1, se 0.1 / sqrt(3), 2 degrees of freedom;
    # t_0.975(2) = 4.302653, t_0.8(2) = 1.060660.
    mdd = stats.minimum_detectable_difference([0.5, 0.7, 0.9], [0.4, 0.5, 0.6], paired=True)
    assert mdd == pytest.approx((4.302653 + 1.060660) * 0.1 / math.sqrt(3), rel=1e-5)
    # Unpaired: Welch's se sqrt(0.01 / 2 + 0.04 / 2), na + nb - 2 = 2 degrees of freedom.
    mdd = stats.minimum_detectable_difference([0.1, 0.2], [0.0, 0.2 * math.sqrt(2)])
    se = math.sqrt(0.1 ** 2 / 2 / 2 + (0.2 * math.sqrt(2)) ** 2 / 2 / 2)
    assert mdd == pytest.approx((4.302653 + 1.060660) * se, rel=1e-5)


def test_more_seeds_or_less_spread_detect_smaller_differences():
    few = stats.minimum_detectable_difference([0.1, 0.3, 0.2], [0.0, 0.0, 0.0], paired=True)
    many = stats.minimum_detectable_difference([0.1, 0.3, 0.2] * 3, [0.0] * 9, paired=True)
    tight = stats.minimum_detectable_difference([0.19, 0.21, 0.2], [0.0, 0.0, 0.0], paired=True)
    assert many < few and tight < few
    assert math.isnan(stats.minimum_detectable_difference([0.1], [0.2], paired=True))  # no spread to estimate


def test_every_claim_states_its_minimum_detectable_difference():
    entry = stats.compare([0.5, 0.7, 0.9], [0.4, 0.5, 0.6], ("A", "B"), paired=True)
    assert entry["mdd"] == pytest.approx(stats.minimum_detectable_difference([0.5, 0.7, 0.9], [0.4, 0.5, 0.6],
                                                                             paired=True))


def test_an_ablation_without_its_logs_is_skipped_not_drawn(tmp_path, monkeypatch, capsys):
    from experiments.figures import ablations, runs

    monkeypatch.setattr(runs, "LOGS", str(tmp_path))
    assert ablations.draw("ablation_beta") is None
    assert "ablation_beta: skipped, no collected log yet for stage2_mgrpo_s0" in capsys.readouterr().out
    assert not list(tmp_path.iterdir())  # nothing written


# -- the exact permutation test, the t-interval and the verdict rule (issue 36) ---------------------------------


def test_sign_flip_p_values_by_hand():
    # [1, 2, 3, 4, 5]: of the 32 sign patterns only "all kept" reaches the observed sum 15.
    p = stats.permutation_p([1, 2, 3, 4, 5], [0] * 5, paired=True)
    assert (p["greater"], p["less"], p["two_sided"]) == (1 / 32, 1.0, 2 / 32)
    assert p["exact"] and p["permutations"] == 32 and p["method"].startswith("exact sign-flip: all 2^5 = 32")
    # [1, -1]: sums 0, 2, -2, 0 over the four patterns; observed 0, so 3 of 4 are >= and 3 of 4 are <= it.
    p = stats.permutation_p([1, -1], [0, 0], paired=True)
    assert (p["greater"], p["less"], p["two_sided"]) == (0.75, 0.75, 1.0)
    # [2, -1, 3]: sums 6, 0, 4, -2, 2, -4, 0, -6; observed 4 (a tie with itself only): >= 4 twice, <= 4 seven
    # times, |s| >= 4 four times.
    p = stats.permutation_p([2.5, 0.0, 3.5], [0.5, 1.0, 0.5], paired=True)
    assert (p["greater"], p["less"], p["two_sided"]) == (0.25, 0.875, 0.5)
    # Identical arms: every pattern ties, p = 1 in every direction.
    p = stats.permutation_p([0.3, 0.7], [0.3, 0.7], paired=True)
    assert (p["greater"], p["less"], p["two_sided"]) == (1.0, 1.0, 1.0)
    # The smallest one-sided p over n worlds is 1 / 2^n: 5 worlds cannot go below 0.025, 8 can.
    assert stats.permutation_p([1.0] * 5, [0.0] * 5, paired=True)["greater"] == 1 / 32 > stats.ALPHA
    assert stats.permutation_p([1.0] * 8, [0.0] * 8, paired=True)["greater"] == 1 / 256 < stats.ALPHA


def test_relabelling_p_values_by_hand():
    # [3, 4] vs [1, 2]: the C(4, 2) = 6 labellings give A's sums 7, 4, 5, 5, 6, 3, so mean(A) - mean(B) = sum - 5:
    # 2, -1, 0, 0, 1, -2; observed 2.
    p = stats.permutation_p([3, 4], [1, 2], paired=False)
    assert (p["greater"], p["less"], p["two_sided"]) == (1 / 6, 1.0, 2 / 6)
    assert p["method"] == "exact permutation: all C(4, 2) = 6 relabellings of the pooled values"
    # Identical values in arms of different sizes (their means differ in the last bit): no ordering.
    p = stats.permutation_p([0.1] * 3, [0.1] * 4, paired=False)
    assert (p["greater"], p["less"], p["two_sided"]) == (1.0, 1.0, 1.0)


@pytest.mark.parametrize("paired", [True, False])
def test_exact_p_values_match_scipy(paired):
    from scipy import stats as scipy_stats

    rng = np.random.default_rng(3)
    a, b = rng.normal(0.3, 1.0, size=7), rng.normal(0.0, 1.0, size=7 if paired else 5)
    ours = stats.permutation_p(a, b, paired=paired)
    for alternative, key in (("greater", "greater"), ("less", "less"), ("two-sided", "two_sided")):
        theirs = scipy_stats.permutation_test(
            (a, b), lambda x, y, axis: np.mean(x, axis=axis) - np.mean(y, axis=axis), vectorized=True,
            permutation_type="samples" if paired else "independent", alternative=alternative, n_resamples=np.inf)
        if key == "two_sided" and not paired:
            continue  # scipy doubles the smaller one-sided p; ours counts |mean(A) - mean(B)| >= |observed|
        assert ours[key] == pytest.approx(theirs.pvalue, abs=1e-12), alternative


def test_too_many_permutations_fall_back_to_seeded_draws():
    # 21 paired worlds (2^21 patterns) or C(24, 12) = 2,704,156 relabellings: seeded random draws, (b + 1) / (m + 1).
    p = stats.permutation_p([1.0] * 21, [0.0] * 21, paired=True, draws=999)
    assert not p["exact"] and p["permutations"] == 999 and "999 seeded draws (seed 0)" in p["method"]
    assert p["greater"] == 1 / 1000 and p["less"] == 1.0  # no draw of signs reaches all 21 kept
    low, high = list(range(12)), list(range(100, 112))
    p = stats.permutation_p(low, high, paired=False, draws=999)
    assert p["method"].startswith("Monte Carlo permutation: 999 seeded relabellings (seed 0) of the pooled 24")
    assert (p["greater"], p["less"]) == (1.0, 1 / 1000)
    assert stats.permutation_p(low, high[::-1], paired=False, draws=999)["less"] == 1 / 1000
    assert stats.permutation_p(np.arange(12.0) % 5, np.arange(12.0) % 7, paired=False, draws=999) == \
        stats.permutation_p(np.arange(12.0) % 5, np.arange(12.0) % 7, paired=False, draws=999)  # seeded


def test_t_interval_by_hand():
    # Paired d = [1, 2, 3, 4, 5]: mean 3, sd sqrt(2.5), t_0.975(4) = 2.776445.
    (lo, hi), dof = stats.t_interval([1, 2, 3, 4, 5], [0] * 5, paired=True)
    half = 2.776445 * math.sqrt(2.5) / math.sqrt(5)
    assert dof == 4 and (lo, hi) == pytest.approx((3 - half, 3 + half), rel=1e-6)
    # Welch: [1, 2, 3] vs [2, 4, 6, 8]: va / na = 1/3, vb / nb = 5/3, se^2 = 2, dof = 4 / ((1/3)^2 / 2 + (5/3)^2 / 3).
    (lo, hi), dof = stats.t_interval([1, 2, 3], [2, 4, 6, 8], paired=False)
    expected_dof = 4 / ((1 / 3) ** 2 / 2 + (5 / 3) ** 2 / 3)
    half = scipy_t_ppf(0.975, expected_dof) * math.sqrt(2)
    assert dof == pytest.approx(expected_dof) and (lo, hi) == pytest.approx((-3 - half, -3 + half))
    # No spread: the interval is the point; one seed (or one world paired): undefined.
    assert stats.t_interval([0.5, 0.7], [0.4, 0.6], paired=True) == ((pytest.approx(0.1), pytest.approx(0.1)), 1)
    (lo, hi), dof = stats.t_interval([0.5], [0.4], paired=True)
    assert math.isnan(lo) and math.isnan(hi) and math.isnan(dof)
    assert math.isnan(stats.t_interval([0.5, 0.6], [0.4], paired=False)[1])
    assert stats.t_interval([0.1] * 3, [0.1] * 4, paired=False)[0] == (0.0, 0.0)  # rounding is 0


def scipy_t_ppf(q, dof):
    from scipy import stats as scipy_stats

    return float(scipy_stats.t.ppf(q, dof))


@pytest.mark.parametrize("p_claimed, p_opposite, interval, expected", [
    (0.01, 1.0, (0.1, 0.3), stats.REPRODUCED),
    (0.01, 1.0, (0.0, 0.3), stats.INCONCLUSIVE),  # an end at 0 contains 0
    (0.01, 1.0, (-0.1, 0.3), stats.INCONCLUSIVE),  # the exact test alone is not enough
    (0.025, 1.0, (0.1, 0.3), stats.INCONCLUSIVE),  # p must be below 0.025, not at it
    (1 / 32, 1.0, (0.1, 0.3), stats.INCONCLUSIVE),  # 5 worlds: the smallest p
    (1 / 256, 1.0, (0.1, 0.3), stats.REPRODUCED),  # 8 worlds
    (1.0, 0.01, (-0.3, -0.1), stats.NOT_REPRODUCED),
    (1.0, 0.01, (-0.3, 0.0), stats.INCONCLUSIVE),
    (1.0, 0.05, (-0.3, -0.1), stats.INCONCLUSIVE),
    (0.5, 0.5, (-0.1, 0.1), stats.INCONCLUSIVE),
    (0.01, 1.0, (math.nan, math.nan), stats.INCONCLUSIVE),  # one world: no interval
])
def test_verdict_rule_truth_table(p_claimed, p_opposite, interval, expected):
    assert stats.rule_verdict(p_claimed, p_opposite, interval) == expected


def test_verdict_rule_rejects_a_reversed_interval():
    with pytest.raises(ValueError, match="reversed"):
        stats.rule_verdict(0.01, 1.0, (0.3, 0.1))


def test_compare_entries_state_the_tests_and_the_rule():
    five = stats.compare([0.5, 0.6, 0.7, 0.8, 0.9], [0.1] * 5, ("A", "B"), paired=True)
    assert five["p_value"] == 1 / 32 and five["p_alternative"] == "A > B"
    assert five["p_one_sided"] == {"A > B": 1 / 32, "B > A": 1.0}
    assert five["t_interval"][0] > 0 and five["t_dof"] == 4 and five["t_method"] == "paired t"
    assert five["ci95"][0] > 0 and five["bootstrap_verdict"] == stats.REPRODUCED
    assert five["verdict"] == stats.INCONCLUSIVE and five["verdict_rule"] == stats.VERDICT_RULE  # 1/32 > 0.025
    assert five["p_method"] == "exact sign-flip: all 2^5 = 32 sign patterns of the 5 paired differences"
    eight = stats.compare([0.5, 0.6, 0.7, 0.8, 0.9, 0.5, 0.6, 0.7], [0.1] * 8, ("A", "B"), paired=True)
    assert eight["p_value"] == 1 / 256 and eight["verdict"] == stats.REPRODUCED and eight["n_seeds"] == 8
    assert stats.compare([0.1] * 8, [0.5, 0.6, 0.7, 0.8, 0.9, 0.5, 0.6, 0.7], ("A", "B"),
                         paired=True)["verdict"] == stats.NOT_REPRODUCED
    # Without a claimed direction: the two-sided p, and which is higher under the same two parts.
    either = stats.compare([0.1] * 8, [0.5, 0.6, 0.7, 0.8, 0.9, 0.5, 0.6, 0.7], ("A", "B"), paired=True,
                           claimed=False)
    assert either["p_value"] == 2 / 256 and either["p_alternative"] == "two-sided"
    assert either["verdict"] == "B > A" and either["verdict_rule"] == stats.COMPARISON_RULE
    unpaired = stats.compare([0.3, 0.5, 0.4], [0.1, 0.2], ("A", "B"))
    assert unpaired["t_method"] == "Welch" and unpaired["p_method"].startswith("exact permutation: all C(5, 3) = 10")
    assert unpaired["p_value"] == 1 / 10  # only the observed labelling puts the three largest in A


_differences = st.lists(st.integers(-40, 40).map(lambda k: k / 16), min_size=1, max_size=10)


@settings(max_examples=80, deadline=None)
@given(d=_differences, power=st.integers(-6, 6))
def test_sign_flip_p_properties(d, power):
    zeros = [0.0] * len(d)
    p = stats.permutation_p(d, zeros, paired=True)
    for key in ("greater", "less", "two_sided"):
        assert 1 / 2 ** len(d) <= p[key] <= 1.0
    assert p["greater"] + p["less"] >= 1.0  # every pattern is at least or at most the observed sum
    assert p["two_sided"] >= min(p["greater"], p["less"])
    # Flipping every sign swaps the directions; scaling by a power of two (exact in floating point) changes nothing.
    mirrored = stats.permutation_p(np.negative(d), zeros, paired=True)
    assert (mirrored["greater"], mirrored["less"], mirrored["two_sided"]) == (p["less"], p["greater"], p["two_sided"])
    scaled = stats.permutation_p(np.multiply(d, 2.0 ** power), zeros, paired=True)
    assert {k: scaled[k] for k in ("greater", "less", "two_sided")} == {
        k: p[k] for k in ("greater", "less", "two_sided")}
    # Shifting both arms by the same amount does not change paired differences.
    assert stats.permutation_p(np.add(d, 3.0), [3.0] * len(d), paired=True)["greater"] == p["greater"]


def test_the_rule_is_stated_in_the_readme_and_the_docs_as_the_code_applies_it():
    from experiments.figures import runs, table

    with open(os.path.join(runs.REPO, "README.md")) as f:
        readme = f.read()
    with open(os.path.join(runs.REPO, "docs", "experiments.md")) as f:
        docs = f.read()
    assert table.RULE_LINE in readme and stats.VERDICT_RULE in table.RULE_LINE
    statistics = docs[docs.index("## Statistics"):docs.index("## The eight-world set")]
    assert "below 0.025" in statistics and "1/32 = 0.031 > 0.025" in statistics and "1/256" in statistics
