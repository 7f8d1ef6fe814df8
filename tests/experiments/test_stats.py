"""The minimum detectable difference every claim states beside its interval (experiments/figures/stats.py)."""

import math

import pytest

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
