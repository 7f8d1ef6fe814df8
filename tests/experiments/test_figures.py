"""The figure pipeline: run lineage, log reading, the statistics of the claims, and drawing from committed logs."""

import io
import json
import math
import os
import sys

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from experiments.figures import (
    ablations,
    dk_histogram,
    fig5_stage1_reward,
    fig7_stage2_reward,
    run_all,
    runs,
    shared_policy,
    stats,
)
from experiments.figures import table as table_module


@pytest.fixture(autouse=True)
def _restore_registry():
    """Figure mains set the seed count and D flags module-wide; every test starts from the defaults."""
    yield
    runs.set_stage2_steps(None)
    runs.set_seeds(runs.N_SEEDS)
    runs.DMAX_FLAGS.update(low=None, high=None)


# -- statistics ---------------------------------------------------------------------------------------------


def test_bootstrap_of_a_degenerate_case_is_the_observed_difference():
    # Every seed equal within each arm: every resample gives 0.75 - 0.25.
    diff, ci = stats.bootstrap_diff([0.75] * 5, [0.25] * 4)
    assert diff == pytest.approx(0.5) and ci == pytest.approx((0.5, 0.5))
    assert stats.interval_verdict(ci) == stats.REPRODUCED
    diff, ci = stats.bootstrap_diff([3.0], [1.0])  # one seed each
    assert diff == 2.0 and ci == (2.0, 2.0)
    # Identical arms of different sizes: the means differ in the last bit (0.1 * 3 / 3 != 0.1), not in fact.
    for n in (2, 3, 5, 7):
        assert stats.bootstrap_diff([0.1] * n, [0.1] * 4) == (0.0, (0.0, 0.0))
        assert stats.bootstrap_diff([0.7] * n, [0.7] * 4, paired=False)[1] == (0.0, 0.0)
    assert stats.interval_verdict(stats.bootstrap_diff([0.7] * 3, [0.7] * 4)[1]) == stats.INCONCLUSIVE


def test_bootstrap_of_a_small_case_by_hand():
    # a = (0, 1), b = (0): a's resampled mean is 0, 0.5 or 1 with probability 1/4, 1/2, 1/4, so the 2.5th and
    # 97.5th percentiles of 10,000 resamples are 0 and 1, and the interval touches 0: inconclusive.
    diff, ci = stats.bootstrap_diff([0.0, 1.0], [0.0])
    assert diff == 0.5 and ci == (0.0, 1.0)
    assert stats.interval_verdict(ci) == stats.INCONCLUSIVE
    # The opposite claim on the same data is the mirror image.
    diff, ci = stats.bootstrap_diff([0.0], [0.0, 1.0])
    assert diff == -0.5 and ci == (-1.0, 0.0) and stats.interval_verdict(ci) == stats.INCONCLUSIVE


def test_bootstrap_with_a_known_ordering_and_the_opposite_one():
    a, b = [0.52, 0.55, 0.50, 0.58, 0.54], [0.30, 0.35, 0.33, 0.31, 0.36]
    diff, ci = stats.bootstrap_diff(a, b)
    assert diff == pytest.approx(np.mean(a) - np.mean(b))
    assert 0.15 < ci[0] < diff < ci[1] < 0.26  # means 0.538 and 0.33 (diff 0.208), standard error ~0.016
    assert stats.interval_verdict(ci) == stats.REPRODUCED
    assert stats.interval_verdict(stats.bootstrap_diff(b, a)[1]) == stats.NOT_REPRODUCED
    assert stats.which_higher(stats.interval_verdict(ci), "x", "y") == "x > y"
    assert stats.which_higher(stats.interval_verdict(stats.bootstrap_diff(b, a)[1]), "x", "y") == "y > x"
    # Overlapping arms: inconclusive.
    assert stats.interval_verdict(stats.bootstrap_diff([0.1, 0.5, 0.3], [0.2, 0.4, 0.35])[1]) == stats.INCONCLUSIVE


def test_bootstrap_is_seeded_and_paired_resamples_seeds_together():
    x, y = [0.11, 0.27, 0.35, 0.52, 0.93], [0.05, 0.21, 0.44, 0.6]
    assert stats.bootstrap_diff(x, y) == stats.bootstrap_diff(x, y)  # seeded: the same interval every time
    assert stats.bootstrap_diff(x, y, seed=1)[1] != stats.bootstrap_diff(x, y)[1]
    a, b = [1.0, 2.0, 3.0, 5.0], [0.0, 1.0, 2.0, 4.0]
    # Each seed's own difference is exactly 1, so the paired interval is [1, 1]; the unpaired one is wide.
    assert stats.bootstrap_diff(a, b, paired=True) == (1.0, (1.0, 1.0))
    lo, hi = stats.bootstrap_diff(a, b)[1]
    assert lo < 0 < 1 < hi
    with pytest.raises(ValueError, match="paired arms need one value per seed"):
        stats.bootstrap_diff([1.0, 2.0], [1.0], paired=True)
    with pytest.raises(ValueError, match="non-empty"):
        stats.bootstrap_diff([], [1.0])
    with pytest.raises(ValueError, match="finite"):
        stats.bootstrap_diff([float("nan")], [1.0])


def test_verdict_boundaries():
    assert stats.interval_verdict((1e-12, 1.0)) == stats.REPRODUCED
    assert stats.interval_verdict((0.0, 1.0)) == stats.INCONCLUSIVE  # an end at 0 contains 0
    assert stats.interval_verdict((0.0, 0.0)) == stats.INCONCLUSIVE  # identical arms
    assert stats.interval_verdict((-1.0, 0.0)) == stats.INCONCLUSIVE
    assert stats.interval_verdict((-1.0, -1e-12)) == stats.NOT_REPRODUCED
    assert stats.interval_verdict((-0.2, 0.3)) == stats.INCONCLUSIVE
    with pytest.raises(ValueError, match="reversed"):
        stats.interval_verdict((1.0, 0.0))


def test_windows_and_compare_entry():
    assert [stats.window_size(n) for n in (1, 2, 3, 4, 6, 12, 16, 40)] == [1, 1, 1, 1, 2, 4, 5, 13]
    with pytest.raises(ValueError):
        stats.window_size(0)
    steps = np.arange(1, 13)
    values = np.stack([steps * 0.1, steps * 0.2])
    last, at = stats.last_window(steps, values)
    np.testing.assert_allclose(last, [1.05, 2.1])  # steps 9..12
    assert at == {"window": 4, "window_steps": [9, 12]}
    first, at = stats.first_window(steps, values)
    np.testing.assert_allclose(first, [0.25, 0.5])
    assert at == {"window": 4, "window_steps": [1, 4]}
    entry = stats.compare([0.3, 0.5], [0.1], ("A", "B"))
    assert entry["arms"]["A"] == {"mean": 0.4, "std": pytest.approx(np.sqrt(0.02)), "n": 2, "per_seed": [0.3, 0.5]}
    assert entry["arms"]["B"]["std"] == 0.0 and entry["n_seeds"] == 1
    assert entry["diff"] == pytest.approx(0.3) and entry["bootstrap_verdict"] == stats.REPRODUCED
    # One seed in B: Welch's interval is undefined, so the rule cannot order the arms.
    assert entry["verdict"] == stats.INCONCLUSIVE and math.isnan(entry["t_dof"])
    assert stats.compare([0.3, 0.5], [0.1], ("A", "B"), claimed=False)["bootstrap_verdict"] == "A > B"


_seeds = st.lists(st.floats(-1.0, 1.0, allow_nan=False, allow_subnormal=False), min_size=1, max_size=6)


@settings(max_examples=60, deadline=None)
@given(a=_seeds, b=_seeds, paired=st.booleans(), shift=st.floats(-1.0, 1.0, allow_subnormal=False))
def test_bootstrap_interval_properties(a, b, paired, shift):
    if paired:
        b = (b * len(a))[: len(a)]
    diff, (lo, hi) = stats.bootstrap_diff(a, b, paired=paired, resamples=500)
    tol = 1e-9
    # Every resampled difference of means lies within what any choice of seeds can give.
    if paired:
        d = np.subtract(a, b)
        assert d.min() - tol <= lo <= hi <= d.max() + tol
    else:
        assert min(a) - max(b) - tol <= lo <= hi <= max(a) - min(b) + tol
    assert min(a) - max(b) - tol <= diff <= max(a) - min(b) + tol
    # Arms that do not overlap (by more than rounding, 1e-12 here) are ordered whatever the resamples.
    if not paired and min(a) > max(b) + tol:
        assert stats.interval_verdict((lo, hi)) == stats.REPRODUCED
    if not paired and max(a) < min(b) - tol:
        assert stats.interval_verdict((lo, hi)) == stats.NOT_REPRODUCED
    # Shifting one arm shifts the interval by the same amount (same seeded resamples).
    _, (lo2, hi2) = stats.bootstrap_diff(np.add(a, shift), b, paired=paired, resamples=500)
    assert lo2 == pytest.approx(lo + shift, abs=1e-9) and hi2 == pytest.approx(hi + shift, abs=1e-9)


# -- the runs ----------------------------------------------------------------------------------------------


def test_each_seed_is_its_own_world_warm_start_and_stage1_checkpoint():
    assert runs.SEEDS == tuple(range(8))  # the eight worlds, chosen once
    for s in runs.SEEDS:
        # Every run of seed s trains on world s, from seed s's own warm start and stage-1 checkpoint.
        lineage = [n for n in runs.RUNS if n.endswith(f"_s{s}")]
        assert {runs.RUNS[n].world for n in lineage} == {s}
        assert runs.RUNS[f"stage1_mgrpo_s{s}"].init == f"warm_mgrpo_s{s}"
        assert runs.RUNS[f"stage1_single_s{s}"].init == f"warm_single_s{s}"
        for mode in ("mgrpo", "frozen_sub", "mgrpo_unsync", "distinct_matpo"):
            assert runs.RUNS[f"stage2_{mode}_s{s}"].init == f"stage1_mgrpo_s{s}"
        assert runs.RUNS[f"stage2_single_agent_s{s}"].init == f"stage1_single_s{s}"
        assert runs.RUNS[f"curriculum_s{s}"].init == f"stage1_mgrpo_s{s}"
    for mode in runs.STAGE2_MODES:
        assert runs.worlds(runs.stage2(mode)) == list(range(8))  # distinct worlds, one per seed
    for ablation in runs.ABLATIONS:
        assert sorted(runs.RUNS[n].seed for n in runs.ablation(ablation)) == list(range(8))
    # Per world: 4 warm-start/stage-1 runs and the pool's filter, 4 stage-2 modes, 4 ablations, and the shared-policy
    # comparison's 9 (its 2 x 2's fourth cell included).
    assert len(runs.RUNS) == 8 * (5 + 4 + 4 + 9)
    assert runs.lineage(["stage2_mgrpo_s2", "stage2_frozen_sub_s1"]) == [
        "warm_mgrpo_s2", "stage1_mgrpo_s2", "curriculum_s2", "stage2_mgrpo_s2", "warm_mgrpo_s1", "stage1_mgrpo_s1",
        "curriculum_s1", "stage2_frozen_sub_s1"]
    # The D ablation waits for the default stage-2 runs of the first N_DMAX_WORLDS worlds (its D comes from their
    # d_k histogram), not for every world's.
    dmax_lineage = runs.lineage(["abl_dmax_high_s5"])
    assert dmax_lineage[-1] == "abl_dmax_high_s5"
    assert {"stage2_mgrpo_s0", "stage2_mgrpo_s1"} < set(dmax_lineage)
    assert not {"stage2_mgrpo_s2", "stage2_mgrpo_s5"} & set(dmax_lineage)
    assert runs.lineage(["abl_align_mask_s1"]) == ["warm_mgrpo_s1", "stage1_mgrpo_s1", "curriculum_s1",
                                                   "abl_align_mask_s1"]
    assert runs.descendants("stage1_mgrpo_s0") > runs.descendants("stage2_mgrpo_s0") > 0
    with pytest.raises(KeyError, match="unknown run 'nope'"):
        runs.lineage(["nope"])


def test_every_stage2_run_of_a_world_trains_on_its_one_question_pool(tmp_path, fake_logs):
    stage2 = [run for run in runs.RUNS.values() if run.stage == "stage2" and not run.name.startswith("curriculum_")]
    assert len(stage2) == 8 * 13
    for run in stage2:
        assert f"curriculum_s{run.seed}" in run.after, run.name
        assert (runs.CURRICULUM_KEY, f"curriculum:{run.seed}") in run.overrides, run.name
    # The pool's file: the filter run's own when it finished here, else its collected copy (with the ids kept).
    cmd = runs.RUNS["stage2_single_agent_s3"].command(str(tmp_path))
    assert f"--config.env.curriculum_file={fake_logs}/curriculum_s3.curriculum.json" in cmd
    work = tmp_path / "curriculum_s3"
    work.mkdir()
    (work / "metrics.jsonl").write_text("")
    (work / "summary.json").write_text(json.dumps({"run": {"status": "finished"}}))
    (work / "curriculum.json").write_text(json.dumps({"kept": ["stage2-4", "stage2-9"], "world_seed": 3}))
    cmd = runs.RUNS["stage2_single_agent_s3"].command(str(tmp_path))
    assert f"--config.env.curriculum_file={work}/curriculum.json" in cmd
    runs.collect_log(str(tmp_path), "curriculum_s3")
    assert json.loads((fake_logs / "curriculum_s3.curriculum.json").read_text())["kept"] == ["stage2-4", "stage2-9"]
    # Every cell of the 2 x 2 and the parameter-matched control train with one loss configuration.
    for stem in ("shared_mgrpo", "matpo", "distinct_matpo", "shared2x"):
        assert set(runs.LOSS_2X2) <= set(runs.RUNS[f"stage2_{stem}_s0"].overrides), stem
    assert ("credit", "matpo") in runs.RUNS["stage2_distinct_matpo_s0"].overrides
    assert runs.RUNS["stage2_distinct_matpo_s0"].mode == "mgrpo"


def test_seed_count_is_a_flag():
    runs.parse_args("", ["--seeds", "2"])
    assert runs.SEEDS == (0, 1) and runs.stage2("frozen_sub") == ["stage2_frozen_sub_s0", "stage2_frozen_sub_s1"]
    assert "stage2_mgrpo_s2" not in runs.RUNS and "abl_beta_noexpert_s1" in runs.RUNS
    assert fig5_stage1_reward.names() == ["stage1_mgrpo_s0", "stage1_mgrpo_s1"]
    with pytest.raises(ValueError, match="at least 1"):
        runs.set_seeds(0)


def test_stage2_length_is_a_flag_and_a_design_of_its_own(fake_logs, tmp_path):
    base = runs.DESIGN
    runs.parse_args("", ["--stage2-steps", "80", "--seeds", "2"])
    assert runs.DESIGN == f"{base}+stage2-80" and runs.SEEDS == (0, 1)
    cmd = runs.RUNS["stage2_mgrpo_s1"].command(str(tmp_path))  # evaluated at steps 0, 40 and 80
    assert "--config.train.steps=80" in cmd and "--config.train.eval_every=40" in cmd
    cmd = runs.RUNS["abl_align_mask_s0"].command(str(tmp_path))  # as long, never evaluated
    assert "--config.train.steps=80" in cmd and "--config.train.eval_every=0" in cmd
    assert not any(".train.steps=" in c for c in runs.RUNS["stage1_mgrpo_s0"].command(str(tmp_path)))
    # A log of the preset's length is another design's: it trains again and is not drawn.
    _write_logs(fake_logs, "stage2_mgrpo_s0", [{"step": 1, "main/reward": 0.5}])
    (fake_logs / "stage2_mgrpo_s0.run.json").write_text(json.dumps({"design": base, "world": 0}))
    assert not runs.has_current_log("stage2_mgrpo_s0")
    assert "stage2_mgrpo_s0" in runs.to_train(["stage2_mgrpo_s0"], str(tmp_path))
    runs.parse_args("", [])
    assert runs.DESIGN == base and runs.STAGE2_STEPS is None and runs.has_current_log("stage2_mgrpo_s0")
    with pytest.raises(ValueError, match="--stage2-steps must be at least 2"):
        runs.set_stage2_steps(1)


def test_run_command_names_the_preset_mode_seed_parent_and_ablation(tmp_path):
    cmd = runs.RUNS["stage2_frozen_sub_s1"].command(str(tmp_path))
    assert any(c.endswith("xbench.py:figures,frozen_sub") for c in cmd)
    assert f"--workdir={tmp_path}/stage2_frozen_sub_s1" in cmd
    assert "--config.seed=1" in cmd and "--config.env.seed=1" in cmd and "--config.stage=stage2" in cmd
    assert f"--config.init_checkpoint={tmp_path}/stage1_mgrpo_s1" in cmd
    assert not any(".train.eval_every=" in c or ".train.steps=" in c for c in cmd)  # the preset's, evaluated
    cmd = runs.RUNS["abl_align_mask_s2"].command(str(tmp_path))
    assert "--config.rollout.align_mode=mask" in cmd and "--config.seed=2" in cmd
    assert "--config.train.eval_every=0" in cmd and "--config.train.eval_at_start=False" in cmd  # no evaluations
    assert not any(".train.steps=" in c for c in cmd)  # the preset's length, as the default runs
    assert f"--config.init_checkpoint={tmp_path}/stage1_mgrpo_s2" in cmd
    assert "--config.rewards.beta=(0.1,0.9,0.0)" in runs.RUNS["abl_beta_noexpert_s0"].command(str(tmp_path))
    (tmp_path / "dmax.json").write_text(json.dumps({"p99": 3, "low": 2, "high": 5, "design": runs.DESIGN}))
    assert "--config.rollout.d_max=2" in runs.RUNS["abl_dmax_low_s0"].command(str(tmp_path))
    assert "--config.rollout.d_max=5" in runs.RUNS["abl_dmax_high_s2"].command(str(tmp_path))


def test_the_beta_override_parses_as_a_tuple_on_the_command_line():
    from absl import flags
    from ml_collections import config_flags

    beta = next(c for c in runs.RUNS["abl_beta_noexpert_s0"].command("/tmp") if ".beta=" in c)
    argv = [sys.argv[0], f"--config={os.path.join(runs.REPO, 'experiments', 'xbench.py')}:smoke", beta,
            "--config.rollout.align_mode=mask", "--config.rollout.d_max=5"]
    values = flags.FlagValues()
    config_flags.DEFINE_config_file("config", flag_values=values, sys_argv=argv)
    values(argv)
    assert tuple(values.config.rewards.beta) == (0.1, 0.9, 0.0)
    assert values.config.rollout.align_mode == "mask" and values.config.rollout.d_max == 5


def _fake_workdir(root, name, hist_rows):
    path = root / name
    path.mkdir(parents=True)
    with open(path / "metrics.jsonl", "w") as f:
        f.write(json.dumps({"step": 0, "eval/eval_gaia/accuracy": 0.0}) + "\n")
        for step, counts in enumerate(hist_rows, 1):
            f.write(json.dumps({"step": step, **{f"d_k/hist/{i}": c for i, c in enumerate(counts)}}) + "\n")
    (path / "summary.json").write_text(json.dumps({"run": {"status": "finished"}}))


def test_dmax_is_chosen_from_the_stage2_histogram_and_pinned(tmp_path, fake_logs):
    runs.set_seeds(3)  # the first N_DMAX_WORLDS = 2 worlds' runs choose D
    with pytest.raises(RuntimeError, match="not finished"):
        runs.dmax_choice(str(tmp_path))
    # 200 rollouts over two runs: d_k = 0/1/2/3/4 in 100/60/38/2/0; the 99th percentile is 2 (198 of 200 <= 2).
    _fake_workdir(tmp_path, "stage2_mgrpo_s0", [[50, 30, 19, 1, 0], [20, 10, 9, 1, 0]])
    _fake_workdir(tmp_path, "stage2_mgrpo_s1", [[30, 20, 10, 0, 0]])
    choice = runs.dmax_choice(str(tmp_path))
    assert (choice["p99"], choice["low"], choice["high"]) == (2, 1, 6)  # the preset's D is 4
    assert choice["counts"] == [100, 60, 38, 2, 0] and choice["source"] == "data"
    assert not choice["p99_open_ended"]
    assert json.loads((tmp_path / "dmax.json").read_text()) == choice
    # Pinned: later data does not move it; a flag does until a run has used the old value.
    _fake_workdir(tmp_path, "stage2_mgrpo_s9", [[0, 0, 0, 0, 9]])
    assert runs.dmax_choice(str(tmp_path))["high"] == 6
    runs.DMAX_FLAGS["high"] = 7
    assert runs.dmax_choice(str(tmp_path))["high"] == 7
    assert json.loads((tmp_path / "dmax.json").read_text())["source"] == "flags"
    (tmp_path / "abl_dmax_low_s0").mkdir()
    runs.DMAX_FLAGS.update(low=2, high=None)
    with pytest.raises(RuntimeError, match=r"already ran with D = 1"):
        runs.dmax_choice(str(tmp_path))
    assert runs.dmax_from_counts([0, 0, 1], preset=4)["p99_open_ended"]
    assert runs.dmax_from_counts([10, 0, 0], preset=4)["low"] == 1  # p99 = 0: D cannot go below 1
    # p99 5 above the preset's 4 (3-hop chains): neither arm repeats the default runs' D.
    choice = runs.dmax_from_counts([0, 0, 90, 5, 3, 2], preset=4)
    assert (choice["p99"], choice["low"], choice["high"]) == (5, 3, 7)
    # A choice kept from another design of the set (the five-world one) is not used: recomputed from this one's.
    runs.DMAX_FLAGS.update(low=None, high=None)
    (tmp_path / "dmax.json").write_text(json.dumps({"p99": 4, "low": 3, "high": 6, "from_runs": ["stage2_mgrpo_s4"]}))
    assert runs.dmax_choice(str(tmp_path))["high"] == 6 and runs.dmax_choice(str(tmp_path))["from_runs"] == [
        "stage2_mgrpo_s0", "stage2_mgrpo_s1"]


_FAKE_RUN = """
import json, os, sys
workdir, d_max = sys.argv[1], sys.argv[2]
os.makedirs(workdir, exist_ok=True)
with open(os.path.join(workdir, "metrics.jsonl"), "w") as f:
    f.write(json.dumps({"warmstart_step": 0, "realisation": os.urandom(8).hex()}) + "\\n")  # no two runs alike
    for step in (1, 2):
        f.write(json.dumps({"step": step, "d_k/hist/0": 90, "d_k/hist/1": 5, "d_k/hist/2": 4, "d_k/hist/3": 1,
                            "main/reward": 0.1, "d_max": d_max}) + "\\n")
open(os.path.join(workdir, "summary.json"), "w").write('{"run": {"status": "finished"}}')
"""


def test_ensure_runs_parents_first_and_the_dmax_ablation_after_the_stage2_runs(tmp_path, fake_logs, monkeypatch,
                                                                            capsys):
    runs.set_seeds(1)

    def command(self, root):
        d_max = next((runs.resolve(root, v) for k, v in self.overrides if k == "rollout.d_max"), "preset")
        return [sys.executable, "-c", _FAKE_RUN, runs.workdir(root, self.name), str(d_max)]

    monkeypatch.setattr(runs.Run, "command", command)
    monkeypatch.setattr(runs.time, "sleep", lambda s: None)
    root = tmp_path / "root"
    runs.ensure(list(runs.RUNS), str(root), jobs=2)
    started = [line.split()[-1] for line in capsys.readouterr().out.splitlines() if "starting" in line]
    assert sorted(started) == sorted(runs.RUNS)
    for name in started:
        for parent in runs.RUNS[name].needs:
            assert started.index(parent) < started.index(name)
    # 200 rollouts: 180/10/8/2 at d_k = 0..3, so p99 = 2; the preset's D is 4: D = min(2, 4) - 1 and max(2, 4) + 2.
    choice = json.loads((fake_logs / "dmax.json").read_text())
    assert choice["p99"] == 2 and choice["preset"] == 4 and choice["design"] == runs.DESIGN
    assert runs.rl_rows("abl_dmax_low_s0")[0]["d_max"] == "1"
    assert runs.rl_rows("abl_dmax_high_s0")[0]["d_max"] == "6"
    assert runs.rl_rows("stage2_mgrpo_s0")[0]["d_max"] == "preset"
    assert not list(root.glob("*.pid"))
    # On another machine (a new root) the collected logs are the set: nothing trains again.
    runs.ensure(list(runs.RUNS), str(tmp_path / "elsewhere"), jobs=1)
    assert "starting" not in capsys.readouterr().out
    # A leaf without its log trains again, and so does the chain whose checkpoint it starts from. That chain is
    # then another realisation, so everything that starts from it or waits for its pool trains again too (the
    # collected logs would otherwise be paired with runs of a stage-1 checkpoint they never started from): the
    # world's new pool reaches every stage-2 run, and those need their own lineages' checkpoints, which this
    # machine does not hold. Only the leaf's own chain would train before.
    (fake_logs / "abl_align_mask_s0.jsonl").unlink()
    assert runs.to_train(["stage2_mgrpo_s0"], str(tmp_path / "elsewhere")) == []
    again = runs.to_train(list(runs.RUNS), str(tmp_path / "elsewhere"))
    assert set(again) == set(runs.RUNS)
    for name in again:
        assert all(again.index(parent) < again.index(name) for parent in runs.RUNS[name].needs)
    runs.ensure(list(runs.RUNS), str(tmp_path / "elsewhere"), jobs=2)
    said = capsys.readouterr().out
    assert f"{len(again) - 1} collected runs train again, of a lineage trained again here" in said
    assert "stage2_mgrpo x1" in said and "another design" not in said
    # One at a time, the order is the priority: the runs that most others need first.
    for log in fake_logs.glob("*.jsonl"):
        log.unlink()
    runs.ensure(list(runs.RUNS), str(tmp_path / "serial"), jobs=1)
    started = [line.split()[-1] for line in capsys.readouterr().out.splitlines() if "starting" in line]
    assert started[:3] == ["warm_mgrpo_s0", "stage1_mgrpo_s0", "curriculum_s0"]  # the runs most others need


def test_logs_of_an_earlier_design_train_again_and_are_never_drawn_beside_this_one(fake_logs, tmp_path):
    for name in ("stage2_mgrpo_s0", "stage2_mgrpo_s1"):
        _write_logs(fake_logs, name, [{"step": 1, "main/reward": 0.5}])
    # Without records they are the earlier set's: trained again here, drawn together only with each other.
    assert runs.design("stage2_mgrpo_s0") == runs.EARLIER_DESIGN and not runs.has_current_log("stage2_mgrpo_s0")
    assert "stage2_mgrpo_s0" in runs.to_train(["stage2_mgrpo_s0"], str(tmp_path))
    assert runs.series(["stage2_mgrpo_s0", "stage2_mgrpo_s1"], "main/reward")[1].tolist() == [[0.5], [0.5]]
    work = tmp_path / "stage2_mgrpo_s1"
    work.mkdir()
    (work / "metrics.jsonl").write_text(json.dumps({"step": 1, "main/reward": 0.7}) + "\n")
    (work / "summary.json").write_text(json.dumps({"run": {"status": "finished", "wall_time_s": 120.0},
                                                   "env/pool_hash": "abc"}))
    runs.collect_log(str(tmp_path), "stage2_mgrpo_s1")
    record = json.loads((fake_logs / "stage2_mgrpo_s1.run.json").read_text())
    assert record == {"design": runs.DESIGN, "world": 1, "wall_time_s": 120.0, "pool_hash": "abc",
                      "log_hash": runs.file_hash(str(fake_logs / "stage2_mgrpo_s1.jsonl")),
                      "parents": {"stage1_mgrpo_s1": None, "curriculum_s1": None}}
    with pytest.raises(ValueError, match="different designs"):
        runs.series(["stage2_mgrpo_s0", "stage2_mgrpo_s1"], "main/reward")
    assert runs.wall_times(["stage2_mgrpo_s0", "stage2_mgrpo_s1"]) == {
        "stage2_mgrpo": {"runs": 1, "mean_s": 120.0, "max_s": 120.0, "total_s": 120.0}}


def test_a_log_whose_parent_was_trained_again_is_not_current_and_is_never_drawn(fake_logs, tmp_path):
    """Each collected record names the realisation of every run it started from or waited for; once one of those is
    collected anew (trained again elsewhere), the child's log is stale: it trains again and `series` refuses it."""

    def finish(name, reward, pool=None):
        work = tmp_path / name
        work.mkdir(exist_ok=True)
        rows = "" if pool else json.dumps({"step": 1, "main/reward": reward}) + "\n"  # a filter logs no metrics
        (work / "metrics.jsonl").write_text(rows)
        if pool:
            (work / "curriculum.json").write_text(json.dumps({"kept": pool}))
        (work / "summary.json").write_text(json.dumps({"run": {"status": "finished"}}))
        runs.collect_log(str(tmp_path), name)

    finish("warm_mgrpo_s0", 0.4)
    finish("stage1_mgrpo_s0", 0.5)
    finish("curriculum_s0", None, pool=["q1", "q2"])
    finish("stage2_mgrpo_s0", 0.5)
    finish("stage2_frozen_sub_s0", 0.5)
    record = runs.record_of("stage2_mgrpo_s0")
    assert record["parents"] == {"stage1_mgrpo_s0": runs.record_of("stage1_mgrpo_s0")["log_hash"],
                                 "curriculum_s0": runs.record_of("curriculum_s0")["log_hash"]}
    assert runs.has_current_log("stage2_mgrpo_s0") and runs.stale_parents("stage2_mgrpo_s0") == []
    finish("curriculum_s0", None, pool=["q1", "q3"])  # a filter run again: an empty log, another pool
    assert runs.stale_parents("stage2_mgrpo_s0") == ["curriculum_s0"]
    finish("curriculum_s0", None, pool=["q1", "q2"])
    assert runs.has_current_log("stage2_mgrpo_s0")
    finish("warm_mgrpo_s0", 0.45)  # a grandparent trained again: the child is stale through its parent
    assert runs.stale_parents("stage2_mgrpo_s0") == [] and runs.stale_parents("stage1_mgrpo_s0") == ["warm_mgrpo_s0"]
    assert not runs.has_current_log("stage2_mgrpo_s0")
    assert runs.stale_ancestry("stage2_mgrpo_s0") == {"stage1_mgrpo_s0": ["warm_mgrpo_s0"]}
    with pytest.raises(ValueError, match="stage2_mgrpo_s0.*trained again"):
        runs.series(["stage2_mgrpo_s0"], "main/reward")
    finish("warm_mgrpo_s0", 0.4)
    pair = ["stage2_mgrpo_s0", "stage2_frozen_sub_s0"]
    assert runs.series(pair, "main/reward")[1].tolist() == [[0.5], [0.5]]
    finish("stage1_mgrpo_s0", 0.6)  # another realisation of the stage-1 checkpoint
    assert runs.stale_parents("stage2_mgrpo_s0") == ["stage1_mgrpo_s0"]
    assert not runs.has_current_log("stage2_mgrpo_s0") and not runs.has_current_log("curriculum_s0")
    elsewhere = str(tmp_path / "elsewhere")
    assert {"curriculum_s0", "stage2_mgrpo_s0"} <= set(runs.to_train(["stage2_mgrpo_s0"], elsewhere))
    with pytest.raises(ValueError, match=r"stage2_frozen_sub_s0.*stage2_mgrpo_s0.*trained again"):
        runs.series(pair, "main/reward")
    # A record collected before the hashes were kept cannot tell, and stays current.
    (fake_logs / f"stage2_frozen_sub_s0{runs.RUN_SUFFIX}").write_text(json.dumps({"design": runs.DESIGN}))
    assert runs.stale_parents("stage2_frozen_sub_s0") == [] and runs.has_current_log("stage2_frozen_sub_s0")


def test_runs_another_invocation_trains_count_against_jobs(tmp_path, fake_logs, monkeypatch, capsys):
    """Two figure scripts side by side share `--jobs`: a live run of the other one takes a slot, a finished run's
    leftover pid file does not, and the waiting run starts once the other run is done."""
    import subprocess

    runs.set_seeds(1)
    root = tmp_path / "root"
    root.mkdir()
    other = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)",
                              f"--workdir={runs.workdir(str(root), 'warm_single_s0')}"])
    try:
        (root / "warm_single_s0.pid").write_text(str(other.pid))  # being trained by another invocation
        (root / "warm_shared2x_s0.pid").write_text(str(os.getpid()))  # a live pid, of another program
        assert runs._owner(str(root), "warm_single_s0") == other.pid  # at once: its arguments may not be set yet
        assert runs._owner(str(root), "warm_shared2x_s0") is None
        (root / "warm_shared_s0.pid").write_text(str(os.getpid()))  # a live pid, but that run is finished:
        (root / "warm_shared_s0").mkdir()  # its owner was killed before removing the file
        (root / "warm_shared_s0" / "summary.json").write_text(json.dumps({"run": {"status": "finished"}}))
        assert runs.trained_elsewhere(str(root), {}) == 1
        assert runs.trained_elsewhere(str(root), {"warm_single_s0": None}) == 0
        started = []

        class Started(Exception):
            pass

        def fake_popen(command, **kwargs):
            started.append((command, runs.trained_elsewhere(str(root), {})))
            raise Started

        monkeypatch.setattr(runs.subprocess, "Popen", fake_popen)
        with pytest.raises(Started):
            runs.ensure(["warm_mgrpo_s0"], str(root), jobs=2)  # one slot left: starts
        with pytest.raises(Started):
            runs.ensure(["warm_mgrpo_s0", "warm_single_s0"], str(root), jobs=2)
        assert len(started) == 2 and all(elsewhere == 1 for _, elsewhere in started)
        sleeps = []

        def sleep(seconds):  # jobs=1: no slot while the other run lives; it then ends
            sleeps.append(seconds)
            other.kill()
            other.wait()

        monkeypatch.setattr(runs.time, "sleep", sleep)
        with pytest.raises(Started):
            runs.ensure(["warm_mgrpo_s0"], str(root), jobs=1)
        assert len(sleeps) == 1 and len(started) == 3
    finally:
        other.kill()
        other.wait()


def test_runs_an_owner_read_before_its_exec_set_the_arguments_is_read_again(tmp_path, monkeypatch):
    """A process that has just started reads an empty command line for a moment: it is read again, not taken for
    another program (which would let a second figure script start the same run)."""
    root = tmp_path / "root"
    root.mkdir()
    (root / "warm_single_s0.pid").write_text(str(os.getpid()))
    real_open, reads = open, []

    def opening(path, *args, **kwargs):
        if str(path).endswith("/cmdline"):
            reads.append(path)
            if len(reads) < 3:
                return io.BytesIO(b"")
            return io.BytesIO(f"python\0--workdir={runs.workdir(str(root), 'warm_single_s0')}\0".encode())
        return real_open(path, *args, **kwargs)

    monkeypatch.setattr("builtins.open", opening)
    assert runs._owner(str(root), "warm_single_s0") == os.getpid()
    assert len(reads) == 3
    # A command line that stays empty (a kernel thread's) is no owner.
    monkeypatch.setattr("builtins.open", lambda path, *a, **k: io.BytesIO(b"") if str(path).endswith("/cmdline")
                        else real_open(path, *a, **k))
    assert runs._owner(str(root), "warm_single_s0") is None


def test_the_set_runs_world_by_world(tmp_path, fake_logs, monkeypatch, capsys):
    runs.set_seeds(3)
    monkeypatch.setattr(runs.Run, "command", lambda self, root: [sys.executable, "-c", _FAKE_RUN,
                                                                 runs.workdir(root, self.name), "preset"])
    monkeypatch.setattr(runs.time, "sleep", lambda s: None)
    runs.ensure(list(runs.RUNS), str(tmp_path / "root"), jobs=1)
    started = [line.split()[-1] for line in capsys.readouterr().out.splitlines() if "starting" in line]
    world = [runs.RUNS[name].world for name in started]
    # World 2 starts after every run of worlds 0 and 1: an interrupted set leaves whole worlds collected (world 0's
    # D ablations wait for world 1's stage 2, so worlds 0 and 1 interleave at their end).
    assert world.index(2) == sum(w < 2 for w in world)
    assert world[:world.index(1)] == [0] * world.index(1)


# -- reading logs and drawing -------------------------------------------------------------------------------


def _write_logs(logs, name, rows):
    with open(logs / f"{name}.jsonl", "w") as f:
        f.write(json.dumps({"warmstart_step": 0, "warmstart/main/loss": 5.0}) + "\n")
        for row in rows:
            f.write(json.dumps(row) + "\n")


@pytest.fixture
def fake_logs(tmp_path, monkeypatch):
    logs = tmp_path / "logs"
    logs.mkdir()
    monkeypatch.setattr(runs, "LOGS", str(logs))
    monkeypatch.setattr(runs, "HERE", str(tmp_path))
    return logs


def test_series_aligns_runs_on_shared_steps_and_final_averages_per_run(fake_logs):
    _write_logs(fake_logs, "a", [{"step": s, "main/reward": 0.1 * s} for s in (1, 2, 3)])
    _write_logs(fake_logs, "b", [{"step": s, "main/reward": 0.2 * s} for s in (1, 2, 3, 4)])
    steps, values = runs.series(["a", "b"], "main/reward")
    assert steps.tolist() == [1, 2, 3]
    np.testing.assert_allclose(values, [[0.1, 0.2, 0.3], [0.2, 0.4, 0.6]])
    mean, std = runs.final(values, last=2)  # per run: 0.25 and 0.5; std over seeds with ddof 1
    assert mean == pytest.approx(0.375) and std == pytest.approx(0.125 * np.sqrt(2))
    mean, std = runs.mean_std(values)
    np.testing.assert_allclose(std, np.std(values, axis=0, ddof=1))
    assert runs.mean_std(values[:1])[1].tolist() == [0.0, 0.0, 0.0]
    with pytest.raises(ValueError, match="share no step"):
        runs.series(["a"], "sub/reward")
    with pytest.raises(FileNotFoundError, match="run c has no collected log"):
        runs.rl_rows("c")


def test_dk_percentile_and_histogram_sum_over_runs_and_steps(fake_logs):
    assert stats.count_percentile(np.array([50, 40, 9, 1]), 0.99) == 2
    assert stats.count_percentile(np.array([50, 40, 9, 2]), 0.99) == 3
    _write_logs(fake_logs, "x", [{"step": 1, "d_k/hist/0": 3, "d_k/hist/1": 1, "d_k/hist/2": 0},
                                 {"step": 2, "d_k/hist/0": 1, "d_k/hist/1": 2, "d_k/hist/2": 1}])
    _write_logs(fake_logs, "y", [{"step": 1, "d_k/hist/0": 0, "d_k/hist/1": 4, "d_k/hist/2": 0}])
    assert dk_histogram.histogram(["x", "y"]).tolist() == [4, 7, 1]
    assert dk_histogram.histogram(["x"], slice(1, None)).tolist() == [1, 2, 1]
    with pytest.raises(ValueError, match=r"runs \['y'\] logged no d_k/hist/\* histogram"):
        dk_histogram.histogram(["y"], slice(1, None))


EVAL_SETS = ("eval_gaia", "eval_xbench", "eval_webwalker", "validation", "fresh")


def _reward_logs(logs, names, top, level, rng, steps=12, extra=None):
    """Logs whose reward is `level` plus noise of std 0.01 at every step (and eval rows every 6 steps: `fresh` at
    `level` + 0.05, the others at `level`, each blind at 0.01)."""
    def evals(noise):
        out = {f"eval/{x}/accuracy": level + (0.05 if x == "fresh" else 0.0) + noise() for x in EVAL_SETS}
        return {**out, **{f"eval_blind/{x}/accuracy": 0.01 for x in EVAL_SETS}}

    for name in names:
        rows = [{"step": 0, **evals(lambda: 0.0)}]
        for s in range(1, steps + 1):
            row = {"step": s, f"{top}/reward": level + float(rng.normal(0, 0.01)), f"{top}/correct": level / 2,
                   f"{top}/format_ok": 0.5, "sub/reward": level / 3, "d_k/hist/0": 5, "d_k/hist/1": 3, "d_k/hist/2": 0,
                   f"{top}/end/context": 0.02, f"{top}/end/max_turns": 0.0, "sub/end/context": 0.01,
                   "sub/end/max_turns": 0.0, "sub/episodes": 300.0, "sub/unsync_chunks": 1.0,
                   "sub/fifo_popped": 290.0}
            if s % 6 == 0:
                row.update(evals(lambda: float(rng.normal(0, 0.01))))
            row.update((extra or {}).get(s, {}))
            rows.append(row)
        _write_logs(logs, name, rows)


def test_figure_draws_from_logs_only_with_the_claims_statistics(fake_logs):
    runs.set_seeds(8)  # 8 worlds: the exact sign-flip test can reach 1/256 < 0.025
    worlds = list(range(8))
    rng = np.random.default_rng(0)
    for mode, level in (("mgrpo", 0.5), ("frozen_sub", 0.3), ("single_agent", 0.3)):
        _reward_logs(fake_logs, runs.stage2(mode), runs.top_name(mode), level, rng)
    results = fig7_stage2_reward.main(["--plot-only", "--seeds", "8"])
    png = fake_logs.parent / "fig7_stage2_reward.png"
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    saved = json.loads((fake_logs.parent / "results" / "fig7_stage2_reward.json").read_text())
    assert set(saved) == {"claims", "runs", "limit_shares"} | {
        f"{m}/{k}" for m in (*fig7_stage2_reward.MODES, "identical") for k in ("reward", "correct")}
    assert saved["runs"]["mgrpo"] == {"names": runs.stage2("mgrpo"), "world_seeds": worlds}
    assert saved["limit_shares"]["single_agent"] == pytest.approx({"single/end/context": 0.02,
                                                                   "single/end/max_turns": 0.0})
    assert saved["limit_shares"]["mgrpo"]["sub/end/context"] == pytest.approx(0.01)
    assert saved["identical/reward"] == []  # independent noisy curves
    assert saved["identical/correct"] == [["frozen_sub", "single_agent"]]  # both constant 0.15
    assert saved["mgrpo/reward"]["last"] == pytest.approx(results["mgrpo/reward"]["last"])
    assert saved["mgrpo/reward"]["n_seeds"] == 8 and saved["mgrpo/reward"]["last_window_steps"] == [9, 12]
    first, second = saved["claims"]
    assert first["claim"] == "stage-2 reward: mgrpo > frozen_sub" and first["verdict"] == "reproduced"
    # 0.2 apart on every world: only "every sign kept" of the 256 patterns reaches the observed sum.
    assert first["p_value"] == 1 / 256 and first["t_interval"][0] > 0.19 and first["t_dof"] == 7
    assert second["claim"] == "stage-2 reward: frozen_sub > single_agent" and second["verdict"] == "inconclusive"
    assert second["p_value"] > 0.025 and second["t_interval"][0] < 0 < second["t_interval"][1]
    for claim in saved["claims"]:
        assert claim["n_seeds"] == 8 and claim["window"] == 4 and claim["window_steps"] == [9, 12]
        assert claim["paired"]  # the modes of a seed share its world, warm start and stage-1 checkpoint
        assert claim["world_seeds"] == {label: worlds for label in claim["order"]}
        assert claim["verdict_rule"] == stats.VERDICT_RULE and claim["p_method"].startswith("exact sign-flip")
        lo, hi = claim["ci95"]
        assert lo <= hi
        a, b = (claim["arms"][label] for label in claim["order"])
        assert claim["diff"] == pytest.approx(a["mean"] - b["mean"])
        assert len(a["per_seed"]) == 8 and a["std"] == pytest.approx(np.std(a["per_seed"], ddof=1))
    # Each seed's value is its mean over steps 9..12 of the logged reward.
    rows = runs.rl_rows("stage2_mgrpo_s3")
    assert first["arms"]["mgrpo"]["per_seed"][3] == pytest.approx(np.mean([r["main/reward"] for r in rows[-4:]]))
    assert first["metric"] == {"mgrpo": "main/reward", "frozen_sub": "main/reward"}
    assert second["metric"]["single_agent"] == "single/reward"


def test_fig5_claim_is_paired_over_seeds(fake_logs):
    runs.set_seeds(3)
    rng = np.random.default_rng(1)
    for s in range(3):  # each seed rises by 0.2 from its own level; the levels differ a lot between seeds
        rows = [{"step": t, "main/reward": 0.3 * s + (0.2 if t > 8 else 0.0) + float(rng.normal(0, 0.001)),
                 "main/format_ok": 0.5} for t in range(1, 17)]
        _write_logs(fake_logs, f"stage1_mgrpo_s{s}", rows)
    results = fig5_stage1_reward.main(["--plot-only", "--seeds", "3"])
    (claim,) = results["claims"]
    assert claim["paired"] and claim["n_seeds"] == 3 and claim["window"] == 5
    assert claim["window_steps"] == [12, 16] and claim["first_window_steps"] == [1, 5]
    assert claim["diff"] == pytest.approx(0.2, abs=0.005) and claim["bootstrap_verdict"] == "reproduced"
    assert claim["ci95"][0] > 0.19  # unpaired, the seeds' spread (0.3 apart) would swamp the rise
    assert claim["t_interval"][0] > 0.19 and claim["t_dof"] == 2
    # Three worlds cannot pass the rule: the smallest one-sided sign-flip p is 1/8.
    assert claim["p_value"] == 1 / 8 and claim["verdict"] == "inconclusive"


def _all_logs(logs, rng, seeds):
    levels = {"mgrpo": 0.5, "frozen_sub": 0.3, "single_agent": 0.1, "mgrpo_unsync": 0.5}
    for mode, level in levels.items():
        _reward_logs(logs, runs.stage2(mode), runs.top_name(mode), level, rng)
    for ablation, level in (("align_mask", 0.2), ("beta_noexpert", 0.5), ("dmax_low", 0.5), ("dmax_high", 0.7)):
        _reward_logs(logs, runs.ablation(ablation), "main", level, rng)
    for s in seeds:
        _reward_logs(logs, [f"stage1_mgrpo_s{s}"], "main", 0.2, rng, steps=16,
                     extra={t: {"main/reward": 0.4 + 0.01 * s} for t in range(11, 17)})
    for mode, level in (("shared_mgrpo", 0.4), ("matpo", 0.4), ("shared2x", 0.45)):
        _reward_logs(logs, runs.stage2(mode), "main", level, rng)
    _reward_logs(logs, shared_policy.eval_runs("single_agent"), "single", 0.1, rng, steps=0)
    (logs / "dmax.json").write_text(json.dumps({"p99": 2, "low": 1, "high": 4, "counts": [5, 3, 0]}))


def test_run_all_plot_only_draws_everything_and_renders_the_table(fake_logs, capsys, monkeypatch):
    runs.set_seeds(3)
    preset = {"rollout.d_max": 2, "rewards.beta": (0.1, 0.4, 0.5)}  # what the logged default runs used
    monkeypatch.setattr(runs, "preset_value", preset.__getitem__)
    _all_logs(fake_logs, np.random.default_rng(2), range(3))
    run_all.main(["--plot-only", "--seeds", "3"])
    out = fake_logs.parent
    figures = ("fig5_stage1_reward", "fig6_accuracy", "fig7_stage2_reward", "fig8_sync", "dk_histogram",
               *ablations.FIGURES)
    for figure in figures:
        assert (out / f"{figure}.png").read_bytes()[:4] == b"\x89PNG"
        assert (out / "results" / f"{figure}.json").exists()
    results = {f: json.loads((out / "results" / f"{f}.json").read_text()) for f in figures}
    # Three worlds: no claim passes the rule (smallest one-sided p 1/8), whatever the interval says.
    assert {c["verdict"] for f in figures for c in results[f].get("claims", []) + results[f].get("comparisons", [])
            } == {"inconclusive"}
    verdicts = {c["claim"]: c["bootstrap_verdict"] for f in figures for c in results[f].get("claims", [])}
    assert verdicts == {
        "stage-1 reward rises (last vs first window)": "reproduced",
        "held-out accuracy (GAIA-style): mgrpo > frozen_sub": "reproduced",
        "held-out accuracy (XBench-style): mgrpo > frozen_sub": "reproduced",
        "held-out accuracy (WebWalker-style): mgrpo > frozen_sub": "reproduced",
        "stage-2 reward: mgrpo > frozen_sub": "reproduced",
        "stage-2 reward: frozen_sub > single_agent": "reproduced",
        "main reward: synchronised > unsynchronised": "inconclusive",
    }
    for f in figures:
        for entry in results[f].get("claims", []) + results[f].get("comparisons", []):
            assert {"n_seeds", "window", "window_steps", "arms", "diff", "ci95", "t_interval", "t_dof", "p_value",
                    "p_method", "verdict", "verdict_rule", "mdd", "world_seeds"} <= set(entry)
            assert entry["n_seeds"] == 3 and all({"mean", "std"} <= set(a) for a in entry["arms"].values())
    # Fig. 6 is tested on the last evaluation (step 12) only: 3 evaluations, the last third is one.
    assert results["fig6_accuracy"]["claims"][0]["window_steps"] == [12, 12]
    controls = results["fig6_accuracy"]["controls"]
    assert controls["transfer_gap"]["diff"] == pytest.approx(0.05, abs=0.02)  # fresh logged 0.05 above validation
    assert controls["transfer_gap"]["paired"] and controls["transfer_gap"]["n_seeds"] == 3
    assert controls["transfer_gap"]["world_seeds"] == [0, 1, 2] and len(controls["transfer_gap"]["per_world"]) == 3
    assert controls["transfer_gap"]["p_alternative"] == "two-sided" and "t_interval" in controls["transfer_gap"]
    assert controls["blind"]["validation"]["mean"] == pytest.approx(0.01)
    assert results["fig8_sync"]["work_per_step"] == {"synchronised": {"updates": 1.0, "trajectories": 300.0},
                                                     "unsynchronised": {"updates": 1.0, "trajectories": 290.0}}
    ablation = {c["claim"]: c["bootstrap_verdict"] for f in ablations.FIGURES for c in results[f]["comparisons"]}
    # An ablation run and its default run share the world, warm start and stage-1 checkpoint: paired by world.
    assert all(c["paired"] for f in ablations.FIGURES for c in results[f]["comparisons"])
    assert ablation["main/reward: mask vs duplicate"] == "duplicate > mask"
    assert ablation["main/reward: D = 4 (high) vs D = 2 (preset)"] == "D = 4 (high) > D = 2 (preset)"
    assert ablation["main/reward: D = 1 (low) vs D = 2 (preset)"] == "inconclusive"
    assert results["ablation_dmax"]["dmax"]["p99"] == 2 and results["ablation_dmax"]["preset_d_max"] == 2
    assert len(results["ablation_beta"]["comparisons"]) == 2
    assert (out / "shared_policy.png").read_bytes()[:4] == b"\x89PNG"
    shared = json.loads((out / "results" / "shared_policy.json").read_text())
    assert len(shared["claims"]) == 4 and len(shared["comparisons"]) == 6
    # The fourth 2 x 2 cell has no logs here: pending, with its two pairs, and nothing else is held up.
    assert shared["pending"] == {"distinct_matpo": "stage2_distinct_matpo_s{0,1,2}"}
    assert shared["pending_pairs"] == ["mgrpo vs distinct_matpo (credit on distinct models)",
                                       "distinct_matpo vs matpo (distinct vs shared models, MATPO credit)"]
    assert shared["systems"]["mgrpo"]["params"]["total"] is None  # no params.json among these logs
    printed = capsys.readouterr().out
    assert "[figures] shared_policy: no parameter count for stage2_mgrpo_s{0,1,2}, " in printed
    text = table_module.render(str(out / "results"))
    assert text in printed  # run_all prints the table at the end
    lines = text.splitlines()
    assert sum(line.startswith("| [Fig.") for line in lines) == 7
    assert "| [Fig. 7](experiments/figures/fig7_stage2_reward.png) | stage-2 reward: mgrpo > frozen_sub | " in text
    fig8 = next(line for line in lines if "synchronised > unsynchronised" in line)
    assert fig8.endswith("| 3 | **inconclusive** |") and "`synchronised` 0.5" in fig8
    assert " (2 dof) | " in fig8  # the paired t-interval over 3 worlds
    assert lines[0].startswith("| figure | paper's claim | here: ") and lines[0].count("|") == 10
    assert "| 95 % t-interval (dof) | exact permutation p (one-sided) |" in lines[0]
    assert table_module.RULE_LINE in lines and stats.VERDICT_RULE in table_module.RULE_LINE
    assert "steps 9–12" in fig8
    assert sum(line.startswith("| [alignment]") for line in lines) == 2
    assert "99th percentile 1 over 3 seeds" in text  # 5/3/0 per step: p99 is d = 1
    assert sum(line.startswith("| [shared policy]") for line in lines) == 10
    assert "Parameters (all learners of a system): `mgrpo` ?; " in text
    assert "No results yet" not in text
    capsys.readouterr()
    run_all.main(["--table"])
    assert capsys.readouterr().out == text


def test_table_lists_figures_without_results(tmp_path):
    text = table_module.render(str(tmp_path))
    assert "No results yet for: fig5_stage1_reward, fig6_accuracy, fig7_stage2_reward, fig8_sync, ablation_" in text


def test_dk_histogram_skips_evaluation_only_rows(fake_logs):
    _write_logs(fake_logs, "z", [{"step": 0, "eval/eval_gaia/accuracy": 0.0},
                                 {"step": 1, "d_k/hist/0": 2, "d_k/hist/1": 2}])
    assert dk_histogram.histogram(["z"]).tolist() == [2, 2]
    assert len(dk_histogram.dk_rows("z")) == 1


def test_the_positive_control_gate_names_what_would_make_the_runs_pointless():
    from experiments.figures import positive_control

    warm = [{"warmstart_step": 250, "warmstart/main/format_ok": 0.9, "warmstart/sub/format_ok": 1.0},
            {"warmstart_step": 500, "warmstart/main/format_ok": 0.98, "warmstart/sub/format_ok": 1.0}]
    moving = [{"step": s, "main/reward": 0.5 + 0.01 * s, "main/zero_std_groups": 3.0, "main/train/grad_norm": 0.2,
               "main/train/approx_kl": 1e-3} for s in range(1, 5)]
    assert positive_control.gate(warm, moving, 0.95) == []
    assert positive_control.gate(warm[:1], moving, 0.95) == ["warmstart/main/format_ok = 0.90 < 0.95"]
    assert positive_control.gate([], moving, 0.95) == ["the warm start logged no greedy format check"]
    flat = [{**row, "main/reward": 0.5, "main/zero_std_groups": 16.0} for row in moving]
    assert positive_control.gate(warm, flat, 0.95) == [
        "stage 1: every group's rewards are equal at every step (no learning signal)",
        "stage 1: main/reward is 0.5 at every step"]
    frozen = [{**row, "main/train/approx_kl": 0.0} for row in moving]
    assert positive_control.gate(warm, frozen, 0.95) == [
        "stage 1: no update moved the main agent (grad_norm or approx_kl 0 at every step)"]
    assert positive_control.gate(warm, [], 0.95) == ["stage 1 logged no RL step"]


def test_run_all_status_counts_the_set_by_kind_and_estimates_the_time_left(tmp_path, fake_logs, capsys):
    runs.set_seeds(1)
    root = tmp_path / "root"
    for name, seconds in (("warm_mgrpo_s0", 700.0), ("stage1_mgrpo_s0", 200.0)):
        (root / name).mkdir(parents=True)
        (root / name / "metrics.jsonl").write_text(json.dumps({"step": 1, "main/reward": 0.1}) + "\n")
        (root / name / "summary.json").write_text(json.dumps({"run": {"status": "finished", "wall_time_s": seconds}}))
        runs.collect_log(str(root), name)
    # Another design's warm_single: trains again here, and its recorded wall time is the kind's estimate.
    _write_logs(fake_logs, "warm_single_s0", [])
    (fake_logs / f"warm_single_s0{runs.RUN_SUFFIX}").write_text(json.dumps({"design": "x", "wall_time_s": 3600.0}))
    kinds = runs.progress(str(root))
    assert kinds["warm_mgrpo"] == {"runs": 1, "collected": 1, "running": 0, "to_train": 0, "mean_s": 700.0}
    assert kinds["warm_single"] == {"runs": 1, "collected": 0, "running": 0, "to_train": 1, "mean_s": 3600.0}
    assert sum(k["to_train"] for k in kinds.values()) == len(runs.RUNS) - 2
    run_all.main(["--status", "--root", str(root), "--seeds", "1", "--jobs", "2"])
    out = capsys.readouterr().out
    assert f"2 of {len(runs.RUNS)} runs collected, 0 running, {len(runs.RUNS) - 2} to train" in out
    assert "about 0.5 h of training left at --jobs 2, besides [" in out and "'warm_shared'" in out
    assert not (root / "curriculum_s0").exists()  # nothing trained


def test_run_all_stops_on_a_failed_positive_control_before_the_other_runs(tmp_path, monkeypatch):
    ensured = []
    monkeypatch.setattr(runs, "ensure", lambda names, root, jobs: ensured.append(list(names)))
    for name, rows in (("warm_mgrpo_s0", [{"warmstart_step": 500, "warmstart/main/format_ok": 0.5}]),
                       ("stage1_mgrpo_s0", [{"step": 1, "main/reward": 0.3}, {"step": 2, "main/reward": 0.3}])):
        (tmp_path / name).mkdir()
        (tmp_path / name / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
        (tmp_path / name / "summary.json").write_text(json.dumps({"run": {"status": "finished"}}))
    with pytest.raises(SystemExit, match="positive control failed") as info:
        run_all.main(["--root", str(tmp_path)])
    message = str(info.value)
    assert "warmstart/main/format_ok = 0.50" in message and "main/reward is 0.3 at every step" in message
    assert ensured == [["stage1_mgrpo_s0"]]  # nothing else was trained


def test_run_all_reads_the_positive_control_from_collected_logs_on_a_machine_without_their_runs(
        tmp_path, fake_logs, monkeypatch, capsys):
    # The set resumed on another machine: seed 0's warm start and stage 1 are collected, their workdirs are not here.
    monkeypatch.setattr(runs, "ensure", lambda names, root, jobs: None)
    warm = [{"warmstart_step": 500, "warmstart/main/format_ok": 0.99, "warmstart/sub/format_ok": 1.0}]
    stage1 = [{"step": s, "main/reward": 0.2 * s, "main/zero_std_groups": 1.0, "main/train/grad_norm": 0.3,
               "main/train/approx_kl": 1e-3} for s in (1, 2)]
    _write_logs(fake_logs, "warm_mgrpo_s0", warm)
    _write_logs(fake_logs, "stage1_mgrpo_s0", stage1)
    root = tmp_path / "root"
    run_all.control(str(root), 2)
    assert "positive control passed (warm_mgrpo_s0, stage1_mgrpo_s0)" in capsys.readouterr().out
    # A run finished here is read from its workdir, not from the log collected before.
    (root / "warm_mgrpo_s0").mkdir(parents=True)
    (root / "warm_mgrpo_s0" / "metrics.jsonl").write_text(
        json.dumps({"warmstart_step": 500, "warmstart/main/format_ok": 0.4}) + "\n")
    (root / "warm_mgrpo_s0" / "summary.json").write_text(json.dumps({"run": {"status": "finished"}}))
    with pytest.raises(SystemExit, match="warmstart/main/format_ok = 0.40"):
        run_all.control(str(root), 2)


def test_run_all_worlds_trains_only_those_worlds_after_their_own_control_and_draws_nothing(
        tmp_path, fake_logs, monkeypatch, capsys):
    ensured = []
    monkeypatch.setattr(runs, "ensure", lambda names, root, jobs: ensured.append(list(names)))
    monkeypatch.setattr(run_all, "FIGURES", ())  # drawing would fail loudly below: nothing is collected
    monkeypatch.setattr(run_all.case_studies, "main", lambda argv: pytest.fail("case studies drawn"))
    _write_logs(fake_logs, "warm_mgrpo_s1", [{"warmstart_step": 500, "warmstart/main/format_ok": 1.0}])
    _write_logs(fake_logs, "stage1_mgrpo_s1", [{"step": s, "main/reward": 0.1 * s, "main/zero_std_groups": 0.0,
                                                "main/train/grad_norm": 0.5, "main/train/approx_kl": 1e-3}
                                               for s in (1, 2)])
    run_all.main(["--root", str(tmp_path / "root"), "--seeds", "3", "--worlds", "2,1"])
    assert ensured[0] == ["stage1_mgrpo_s1"]  # the control on the share's first world
    assert sorted(ensured[1]) == sorted(n for n, run in runs.RUNS.items() if run.world in (1, 2))
    assert {runs.RUNS[n].world for n in ensured[1]} == {1, 2} and len(ensured) == 2
    out = capsys.readouterr().out
    assert "positive control passed (warm_mgrpo_s1, stage1_mgrpo_s1)" in out and "worlds [1, 2] trained" in out
    assert f"of {len(runs.RUNS)} runs collected" in out  # the status follows
    for bad, message in (("3", "--worlds [3] are not among the set's worlds [0, 1, 2]"),
                         ("1,x", "expected comma-separated world numbers")):
        with pytest.raises(SystemExit):
            run_all.main(["--root", str(tmp_path / "root"), "--seeds", "3", "--worlds", bad])
        assert message in capsys.readouterr().err
    assert len(ensured) == 2  # a bad --worlds trains nothing


def test_a_run_is_done_only_when_its_summary_says_finished(tmp_path, monkeypatch):
    """Every stop writes summary.json; an interrupted warm start must be resumed, not taken as finished."""
    assert not runs.is_done(str(tmp_path), "warm_mgrpo_s0")
    path = tmp_path / "warm_mgrpo_s0"
    path.mkdir()
    for status, done in (("interrupted", False), ("preempted", False), ("finished", True)):
        (path / "summary.json").write_text(json.dumps({"run": {"status": status, "step": 0}}))
        assert runs.is_done(str(tmp_path), "warm_mgrpo_s0") is done


# -- the shared-policy comparison (issue 29) -----------------------------------------------------------------

SHARED_NEW = ("warm_shared", "stage1_shared", "stage2_shared_mgrpo", "stage2_matpo", "stage2_distinct_matpo",
              "warm_shared2x", "stage1_shared2x", "stage2_shared2x", "eval_single_agent")


def _compact_agent() -> dict:
    from mgrpo_jax.config import get_config

    return get_config("xbench", "figures").main.model_overrides.to_dict()


def test_the_registry_has_the_shared_policy_runs_and_keeps_the_others():
    warm = (("train.steps", 0), ("train.eval_at_start", False))
    x2, loss = runs.SHARED2X_OVERRIDES, runs.LOSS_2X2
    for s in runs.SEEDS:
        pool = ((runs.CURRICULUM_KEY, f"curriculum:{s}"),)
        expected = {  # name: (mode, stage, init, overrides, after)
            f"warm_mgrpo_s{s}": ("mgrpo", "stage1", None, warm, ()),
            f"warm_single_s{s}": ("single_agent", "stage1", None, warm, ()),
            f"stage1_mgrpo_s{s}": ("mgrpo", "stage1", f"warm_mgrpo_s{s}", runs.NO_EVAL, ()),
            f"stage1_single_s{s}": ("single_agent", "stage1", f"warm_single_s{s}", runs.NO_EVAL, ()),
            f"curriculum_s{s}": ("mgrpo", "stage2", f"stage1_mgrpo_s{s}", runs.FILTER_ONLY, ()),
            f"stage2_mgrpo_s{s}": ("mgrpo", "stage2", f"stage1_mgrpo_s{s}", pool, (f"curriculum_s{s}",)),
            f"stage2_frozen_sub_s{s}": ("frozen_sub", "stage2", f"stage1_mgrpo_s{s}", pool, (f"curriculum_s{s}",)),
            f"stage2_mgrpo_unsync_s{s}": ("mgrpo_unsync", "stage2", f"stage1_mgrpo_s{s}", runs.NO_EVAL + pool,
                                          (f"curriculum_s{s}",)),
            f"stage2_single_agent_s{s}": ("single_agent", "stage2", f"stage1_single_s{s}", runs.NO_EVAL + pool,
                                          (f"curriculum_s{s}",)),
            # the shared-policy comparison
            f"warm_shared_s{s}": ("shared_mgrpo", "stage1", None, warm, ()),
            f"stage1_shared_s{s}": ("shared_mgrpo", "stage1", f"warm_shared_s{s}", runs.NO_EVAL, ()),
            f"stage2_shared_mgrpo_s{s}": ("shared_mgrpo", "stage2", f"stage1_shared_s{s}", loss + pool,
                                          (f"curriculum_s{s}",)),
            f"stage2_matpo_s{s}": ("matpo", "stage2", f"stage1_shared_s{s}", loss + pool, (f"curriculum_s{s}",)),
            f"stage2_distinct_matpo_s{s}": ("mgrpo", "stage2", f"stage1_mgrpo_s{s}",
                                            loss + (("credit", "matpo"),) + pool, (f"curriculum_s{s}",)),
            f"warm_shared2x_s{s}": ("shared_mgrpo", "stage1", None, warm + x2, ()),
            f"stage1_shared2x_s{s}": ("shared_mgrpo", "stage1", f"warm_shared2x_s{s}", runs.NO_EVAL + x2, ()),
            f"stage2_shared2x_s{s}": ("shared_mgrpo", "stage2", f"stage1_shared2x_s{s}", loss + x2 + pool,
                                      (f"curriculum_s{s}",)),
            f"eval_single_agent_s{s}": ("single_agent", "stage2", f"stage2_single_agent_s{s}",
                                        (("train.steps", 0), ("train.eval_at_start", True),
                                         ("env.stage2_max_success", 1.0)) + pool, (f"curriculum_s{s}",)),
        }
        for name, (mode, stage, init, overrides, after) in expected.items():
            run = runs.RUNS[name]
            assert (run.mode, run.stage, run.init, run.overrides, run.seed, run.after) == (
                mode, stage, init, overrides, s, after), name
        for ablation, changes in runs.ABLATIONS.items():
            if s < runs.N_ABLATION_SEEDS:
                run = runs.RUNS[f"abl_{ablation}_s{s}"]
                assert (run.mode, run.init, run.overrides) == ("mgrpo", f"stage1_mgrpo_s{s}",
                                                               runs.NO_EVAL + changes + pool)
    assert sorted(n for n in runs.RUNS if n.rsplit("_s", 1)[0] in SHARED_NEW) == sorted(
        f"{stem}_s{s}" for stem in SHARED_NEW for s in runs.SEEDS)
    assert runs.lineage(["stage2_matpo_s1"]) == ["warm_shared_s1", "stage1_shared_s1", "warm_mgrpo_s1",
                                                 "stage1_mgrpo_s1", "curriculum_s1", "stage2_matpo_s1"]
    assert runs.lineage(["eval_single_agent_s0"]) == ["warm_single_s0", "stage1_single_s0", "warm_mgrpo_s0",
                                                      "stage1_mgrpo_s0", "curriculum_s0", "stage2_single_agent_s0",
                                                      "eval_single_agent_s0"]


def test_the_parameter_matched_model_has_about_the_two_agents_parameters():
    from mgrpo_jax.model.shapes import get_model_config

    agent = _compact_agent()
    assert agent == {"d_model": 64, "n_layers": 2, "n_heads": 4, "n_kv_heads": 4, "head_dim": 16, "mlp_dim": 256}
    wide = {**agent, **{key.rsplit(".", 1)[1]: value for key, value in runs.SHARED2X_OVERRIDES}}
    assert all(key.startswith("main.model_overrides.") for key, _ in runs.SHARED2X_OVERRIDES)
    for vocab, (one, shared) in {589: (169_152, 352_000), 600: (169_856, 353_056), 1200: (208_256, 410_656)}.items():
        assert get_model_config("tiny", vocab_size=vocab, **agent).num_params() == one  # the counts in runs.py
        assert get_model_config("tiny", vocab_size=vocab, **wide).num_params() == shared
        assert 0.9 < shared / (2 * one) < 1.1
    # Doubling the depth alone is not enough: the (tied) embeddings stay.
    deep = get_model_config("tiny", vocab_size=600, **{**agent, "n_layers": 4}).num_params()
    assert deep / (2 * 169_856) < 0.9


def test_the_shared_policy_runs_parse_and_pass_the_config_checks():
    from absl import flags
    from ml_collections import config_flags

    from mgrpo_jax.config import validate

    for name in ("stage2_matpo_s0", "stage2_shared2x_s0", "eval_single_agent_s0", "stage2_distinct_matpo_s0",
                 "curriculum_s0"):
        argv = [sys.argv[0], *(c for c in runs.RUNS[name].command("/tmp")[2:] if not c.startswith("--workdir"))]
        values = flags.FlagValues()
        config_flags.DEFINE_config_file("config", flag_values=values, sys_argv=argv)
        values(argv)
        config = values.config
        validate(config)
        assert config.mode == runs.RUNS[name].mode and config.stage == "stage2"
        if name == "stage2_shared2x_s0":
            assert (config.main.model_overrides.d_model, config.main.model_overrides.mlp_dim) == (96, 384)
        if name == "eval_single_agent_s0":
            assert config.train.steps == 0 and config.train.eval_at_start and config.env.stage2_max_success == 1.0
        if name != "curriculum_s0":  # every stage-2 run trains on its world's one pool, the 2 x 2 on one loss
            assert config.env.curriculum_file.endswith("curriculum_s0.curriculum.json")
            assert config.loss_recipe == "default" or name == "eval_single_agent_s0"


def _model_config_json(path, **fields):
    import dataclasses

    from mgrpo_jax.model.shapes import get_model_config

    path.mkdir(parents=True)
    config = dataclasses.asdict(get_model_config("tiny", **{**_compact_agent(), **fields}))
    (path / "model_config.json").write_text(json.dumps(config, indent=1))  # tuples become lists, as a run writes


def test_collecting_a_run_writes_its_learners_parameter_counts(tmp_path, fake_logs):
    root = tmp_path / "root"
    for name in ("stage2_mgrpo_s0", "warm_mgrpo_s0"):
        (root / name).mkdir(parents=True)
        (root / name / "metrics.jsonl").write_text(json.dumps({"step": 1, "main/reward": 0.5}) + "\n")
    _model_config_json(root / "stage2_mgrpo_s0" / "agents" / "main", vocab_size=600)
    _model_config_json(root / "stage2_mgrpo_s0" / "agents" / "sub", vocab_size=600, n_layers=1)
    runs.collect_log(str(root), "stage2_mgrpo_s0")
    # By hand, d 64, 4 heads of 16 (4 kv), mlp 256, vocab 600, tied, qk-norm: attention 4 * 64 * 64 + 2 * 16 =
    # 16,416 and two norms 128 per layer, mlp 3 * 64 * 256 = 49,152 per layer, embeddings 38,400, final norm 64.
    main = 38_400 + 2 * (16_416 + 128 + 49_152) + 64
    sub = 38_400 + (16_416 + 128 + 49_152) + 64
    assert (main, sub) == (169_856, 104_160)
    assert json.loads((fake_logs / "stage2_mgrpo_s0.params.json").read_text()) == {"main": main, "sub": sub}
    assert runs.params("stage2_mgrpo_s0") == {"main": main, "sub": sub}
    runs.collect_log(str(root), "warm_mgrpo_s0")  # no agents/ folder: no params file, no error
    assert not (fake_logs / "warm_mgrpo_s0.params.json").exists() and runs.params("warm_mgrpo_s0") is None
    assert (fake_logs / "warm_mgrpo_s0.jsonl").exists()


# Per system: the training correctness over steps 9-12 (the last window of 12 steps) is TOP + 0.01 * seed (BASE
# before), and the held-out sets at the last evaluation (step 12) are h, h + 0.06 and h + 0.03 with h per seed,
# so the held-out accuracy is h + 0.03.
SHARED_TOP = {"mgrpo": 0.6, "shared_mgrpo": 0.5, "matpo": 0.45, "distinct_matpo": 0.52, "shared2x": 0.55,
              "single_agent": 0.3}
SHARED_HELDOUT = {"mgrpo": (0.4, 0.5, 0.6), "shared_mgrpo": (0.3, 0.4, 0.5), "matpo": (0.2, 0.3, 0.4),
                  "distinct_matpo": (0.35, 0.45, 0.55),
                  "shared2x": (0.5, 0.4, 0.6), "single_agent": (0.3, 0.4, 0.5)}
SHARED_PARAMS = {"mgrpo": {"main": 169_856, "sub": 169_856}, "distinct_matpo": {"main": 169_856, "sub": 169_856},
                 "shared_mgrpo": {"shared": 169_856},
                 "matpo": {"shared": 169_856}, "shared2x": {"shared": 353_056}, "single_agent": {"single": 169_856}}


def _heldout_row(step, h):
    sets = {"eval_gaia": h, "eval_xbench": h + 0.06, "eval_webwalker": h + 0.03, "validation": 0.99, "fresh": 0.99}
    return {"step": step, **{f"eval/{k}/accuracy": v for k, v in sets.items()},
            **{f"eval_blind/{k}/accuracy": 0.0 for k in sets}}


def _loss_row(system):
    """The loss settings a training row logs per learner: MATPO's recipe in the `matpo` logs (clip 0.2 / 0.2, token
    mean: the denominator is the token count), as the five-world logs have it; the `grpo` defaults elsewhere."""
    matpo = system == "matpo"
    out = {}
    for learner in SHARED_PARAMS[system]:
        out.update({f"{learner}/loss/eps_low": 0.2, f"{learner}/loss/eps_high": 0.2 if matpo else 0.28,
                    f"{learner}/loss/kl_coef": 0.0, f"{learner}/train/tokens": 100.0,
                    f"{learner}/train/loss_denominator": 100.0 if matpo else 40.0})
    return out


def _shared_logs(logs, seeds=range(3), skip=()):
    for system, top in SHARED_TOP.items():
        key = shared_policy.correct_key(system)
        for s in seeds:
            h, name = SHARED_HELDOUT[system][s], f"stage2_{system}_s{s}"
            rows = [{"step": t, key: (top if t > 8 else 0.1) + 0.01 * s, **_loss_row(system)} for t in range(1, 13)]
            if system == "single_agent":  # trained without evaluations; its evaluation run has one, at step 0
                _write_logs(logs, f"eval_single_agent_s{s}", [_heldout_row(0, h)])
            else:
                rows = [_heldout_row(0, 0.9)] + rows
                rows[6].update(_heldout_row(6, 0.9))
                rows[12].update(_heldout_row(12, h))
            if name in skip:
                continue
            _write_logs(logs, name, rows)
            (logs / f"{name}.params.json").write_text(json.dumps(SHARED_PARAMS[system]))


def test_shared_policy_claims_and_parameter_counts_from_logs(fake_logs, capsys):
    runs.set_seeds(3)
    _shared_logs(fake_logs)
    results = shared_policy.main(["--plot-only", "--seeds", "3"])
    out = fake_logs.parent
    assert (out / "shared_policy.png").read_bytes()[:4] == b"\x89PNG"
    saved = json.loads((out / "results" / "shared_policy.json").read_text())
    assert saved["claims"] == json.loads(json.dumps(results["claims"]))
    systems = saved["systems"]
    assert {s: systems[s]["params"]["total"] for s in SHARED_TOP} == {
        "mgrpo": 339_712, "shared_mgrpo": 169_856, "matpo": 169_856, "distinct_matpo": 339_712, "shared2x": 353_056,
        "single_agent": 169_856}
    assert saved["system_order"] == list(shared_policy.SYSTEMS) and saved["pending"] == {}
    assert saved["pending_pairs"] == []
    assert systems["mgrpo"]["params"]["learners"] == {"main": 169_856, "sub": 169_856}
    assert systems["mgrpo"]["params"]["per_seed"] == [339_712] * 3 and not systems["mgrpo"]["params"]["missing"]
    assert saved["params_ratio_shared2x_to_mgrpo"] == pytest.approx(353_056 / 339_712)
    for system, top in SHARED_TOP.items():
        train = systems[system]["train_correct"]
        assert train["window_steps"] == [9, 12] and train["window"] == 4
        assert train["metric"] == ("single/correct" if system == "single_agent" else "main/correct")
        assert train["per_seed"] == pytest.approx([top, top + 0.01, top + 0.02])
        held = systems[system]["heldout_accuracy"]
        assert held["per_seed"] == pytest.approx([h + 0.03 for h in SHARED_HELDOUT[system]])
        assert held["evaluated_at_step"] == [12, 12, 12]  # the single agent's: its stage-2 run's last step
    assert systems["single_agent"]["eval_runs"] == ["eval_single_agent_s0", "eval_single_agent_s1",
                                                    "eval_single_agent_s2"]
    assert [e["claim"] for e in saved["comparisons"]][:2] == [
        "training correct: mgrpo vs shared_mgrpo (distinct vs shared models, M-GRPO credit)",
        "held-out accuracy: mgrpo vs shared_mgrpo (distinct vs shared models, M-GRPO credit)"]
    assert [e["claim"] for e in saved["claims"]][:2] == ["training correct: matpo > single_agent (MATPO's claim)",
                                                         "held-out accuracy: matpo > single_agent (MATPO's claim)"]
    entries = {(e["claim"].split(":")[0], *e["order"]): e for e in saved["claims"] + saved["comparisons"]}
    # (metric, A, B): (diff, bootstrap verdict). The training differences are the same at every seed, so the
    # bootstrap interval is that point; held-out, mgrpo - shared2x is -0.1, +0.1 and 0 over the seeds. Under the
    # rule every one is inconclusive: over 3 worlds the smallest one-sided sign-flip p is 1/8.
    train, held = "training correct", "held-out accuracy"
    expected = {
        (train, "mgrpo", "shared_mgrpo"): (0.1, "mgrpo > shared_mgrpo"),
        (held, "mgrpo", "shared_mgrpo"): (0.1, "mgrpo > shared_mgrpo"),
        (train, "shared_mgrpo", "matpo"): (0.05, "shared_mgrpo > matpo"),
        (held, "shared_mgrpo", "matpo"): (0.1, "shared_mgrpo > matpo"),
        (train, "mgrpo", "distinct_matpo"): (0.08, "mgrpo > distinct_matpo"),
        (held, "mgrpo", "distinct_matpo"): (0.05, "mgrpo > distinct_matpo"),
        (train, "distinct_matpo", "matpo"): (0.07, "distinct_matpo > matpo"),
        (held, "distinct_matpo", "matpo"): (0.15, "distinct_matpo > matpo"),
        (train, "mgrpo", "shared2x"): (0.05, "mgrpo > shared2x"),
        (held, "mgrpo", "shared2x"): (0.0, "inconclusive"),
        (train, "matpo", "single_agent"): (0.15, "reproduced"),
        (held, "matpo", "single_agent"): (-0.1, "not reproduced"),
        (train, "mgrpo", "single_agent"): (0.3, "reproduced"),
        (held, "mgrpo", "single_agent"): (0.1, "reproduced"),
    }
    assert set(entries) == set(expected)
    for key, (diff, verdict) in expected.items():
        entry = entries[key]
        assert entry["diff"] == pytest.approx(diff, abs=1e-9) and entry["bootstrap_verdict"] == verdict, key
        assert entry["verdict"] == "inconclusive" and entry["n_seeds"] == 3 and entry["paired"]
        assert entry["world_seeds"] == {label: [0, 1, 2] for label in entry["order"]}
        assert entry["differs"].startswith(shared_policy.DIFFERS[key[1:]])
        if verdict != "inconclusive":
            assert entry["ci95"] == pytest.approx([diff, diff], abs=1e-9)
            assert entry["t_interval"] == pytest.approx([diff, diff], abs=1e-9) and entry["t_dof"] == 2
            # All three worlds one way: 1 of the 8 sign patterns reaches the observed sum (2 of 8 two-sided).
            a, b = entry["order"]
            assert entry["p_one_sided"] == ({f"{a} > {b}": 1 / 8, f"{b} > {a}": 1.0} if diff > 0 else
                                            {f"{a} > {b}": 1.0, f"{b} > {a}": 1 / 8})
            claimed = entry["p_alternative"] != "two-sided"
            assert entry["p_value"] == (entry["p_one_sided"][f"{a} > {b}"] if claimed else 2 / 8)
        assert entry["window_steps"] == ([9, 12] if key[0] == train else [12, 12])
    # Each pair states what differs; the matpo logs' loss settings (MATPO's recipe) differ from the others', which
    # the entries say beside the registry's design.
    assert entries[(train, "mgrpo", "shared_mgrpo")]["differs"] == (
        "model count (2 vs 1; parameters 338,304 vs 169,152 at vocab 589)")
    assert entries[(train, "mgrpo", "distinct_matpo")]["differs"] == "credit"
    assert entries[(held, "distinct_matpo", "matpo")]["differs"] == (
        "model count; in these logs also the loss configuration (`loss_in_logs`)")
    assert entries[(train, "shared_mgrpo", "matpo")]["loss_in_logs"] == {
        "shared_mgrpo": {"aggregation": ["row-mean"], "eps_high": [0.28], "eps_low": [0.2], "kl_coef": [0.0]},
        "matpo": {"aggregation": ["token-mean"], "eps_high": [0.2], "eps_low": [0.2], "kl_coef": [0.0]}}
    assert entries[(held, "mgrpo", "shared2x")]["p_value"] == 1.0  # differences -0.1, +0.1, 0: the observed 0
    lo, hi = entries[(held, "mgrpo", "shared2x")]["ci95"]
    assert lo < 0 < hi
    assert entries[(train, "mgrpo", "single_agent")]["metric"] == {"mgrpo": "main/correct",
                                                                   "single_agent": "single/correct"}
    assert saved["runs"]["matpo"] == {"names": runs.stage2("matpo"), "world_seeds": [0, 1, 2]}
    text = "\n".join(table_module.shared_policy_table(saved))
    assert text.count("| [shared policy](experiments/figures/shared_policy.png) |") == 14
    assert ("| training correct: matpo > single_agent (MATPO's claim) | architecture (one model delegating to itself "
            "in separate contexts vs one agent in one context) and credit (MATPO's vs the single agent's GRPO); in "
            "these logs also the loss configuration (`loss_in_logs`) | `matpo` 0.460 ± 0.010; `single_agent` 0.310 "
            "± 0.010 (steps 9–12) | +0.150 [+0.150, +0.150] | [+0.150, +0.150] (2 dof) | 0.125 | 0.000 | 3 | "
            "**inconclusive** |") in text
    assert "`mgrpo` vs `shared2x`" not in text and "(step 12) |" in text
    assert ("Parameters (all learners of a system): `mgrpo` 339,712 (main 169,856 + sub 169,856); `shared_mgrpo` "
            "169,856; `matpo` 169,856; `distinct_matpo` 339,712 (main 169,856 + sub 169,856); `shared2x` 353,056; "
            "`single_agent` 169,856. `shared2x` / `mgrpo` = 1.039.") in text


def test_shared_policy_draws_the_ready_systems_and_names_the_pending_ones(fake_logs, capsys):
    runs.set_seeds(3)
    _shared_logs(fake_logs, skip=("stage2_matpo_s1", "stage2_matpo_s2", "stage2_single_agent_s0"))
    (fake_logs / "eval_single_agent_s2.jsonl").unlink()
    results = shared_policy.main(["--plot-only", "--seeds", "3"])
    assert capsys.readouterr().out.startswith(
        "[figures] shared_policy: drawn without matpo, single_agent (no collected log yet for stage2_matpo_s{1,2}, "
        "stage2_single_agent_s0, eval_single_agent_s2)")
    assert results["system_order"] == ["mgrpo", "shared_mgrpo", "distinct_matpo", "shared2x"]
    assert results["pending"] == {"matpo": "stage2_matpo_s{1,2}",
                                  "single_agent": "stage2_single_agent_s0, eval_single_agent_s2"}
    # Only the pairs of ready systems: no claim (both claims compare with single_agent), three comparisons x 2.
    assert results["claims"] == []
    assert {tuple(e["order"]) for e in results["comparisons"]} == {
        ("mgrpo", "shared_mgrpo"), ("mgrpo", "distinct_matpo"), ("mgrpo", "shared2x")}
    assert results["pending_pairs"] == [
        "shared_mgrpo vs matpo (credit on one shared model)",
        "distinct_matpo vs matpo (distinct vs shared models, MATPO credit)",
        "matpo > single_agent (MATPO's claim)", "mgrpo > single_agent (M-GRPO's claim)"]
    assert set(results["runs"]) == {"mgrpo", "shared_mgrpo", "distinct_matpo", "shared2x"}
    saved = json.loads((fake_logs.parent / "results" / "shared_policy.json").read_text())
    text = "\n".join(table_module.shared_policy_table(saved))
    assert ("Not yet in the comparison (no collected log yet): `matpo` (stage2_matpo_s{1,2}); `single_agent` "
            "(stage2_single_agent_s0, eval_single_agent_s2). Pairs waiting for them: shared_mgrpo vs matpo (credit "
            "on one shared model); ") in text


def test_shared_policy_skips_the_figure_with_fewer_than_two_systems_ready(fake_logs, capsys):
    runs.set_seeds(2)
    _shared_logs(fake_logs, seeds=range(2), skip=("stage2_shared_mgrpo_s0", "stage2_matpo_s1",
                                                   "stage2_distinct_matpo_s0", "stage2_shared2x_s0",
                                                   "stage2_single_agent_s1"))
    assert shared_policy.main(["--plot-only", "--seeds", "2"]) is None
    assert capsys.readouterr().out.strip() == (
        "[figures] shared_policy: skipped, no collected log yet for stage2_shared_mgrpo_s0, stage2_matpo_s1, "
        "stage2_distinct_matpo_s0, stage2_shared2x_s0, stage2_single_agent_s1")
    assert not (fake_logs.parent / "shared_policy.png").exists()
    assert not (fake_logs.parent / "results").exists()
    assert table_module.render(str(fake_logs.parent / "results")).rstrip().endswith("shared_policy.")


def test_shared_policy_params_missing_for_some_runs_are_reported(fake_logs, capsys):
    runs.set_seeds(2)
    _shared_logs(fake_logs, seeds=range(2))
    (fake_logs / "stage2_matpo_s1.params.json").unlink()
    results = shared_policy.main(["--plot-only", "--seeds", "2"])
    params = results["systems"]["matpo"]["params"]
    assert params["per_seed"] == [169_856, None] and params["total"] == 169_856
    assert params["missing"] == ["stage2_matpo_s1"]
    assert "[figures] shared_policy: no parameter count for stage2_matpo_s1\n" in capsys.readouterr().out
