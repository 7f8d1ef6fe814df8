"""The figure pipeline: run lineage, log reading, the summary numbers, and drawing from committed logs."""

import json

import numpy as np
import pytest

from experiments.figures import dk_histogram, fig7_stage2_reward, runs


def test_every_stage2_run_of_a_system_starts_from_one_stage1_checkpoint():
    main_set = [r for r in runs.RUNS.values() if r.name.startswith("stage2_") and r.mode != "single_agent"]
    assert {run.init for run in main_set} == {"stage1_mgrpo_s0"} and len(main_set) == 9
    assert runs.lineage(["sub600_stage2_frozen_sub_s2"]) == ["warm_mgrpo_sub600", "sub600_stage2_frozen_sub_s2"]
    assert {runs.RUNS[n].init for n in runs.stage2("single_agent")} == {"stage1_single_s0"}
    for mode in runs.STAGE2_MODES:
        assert sorted(runs.RUNS[n].seed for n in runs.stage2(mode)) == [0, 1, 2]
    assert runs.lineage(["stage2_mgrpo_s2", "stage2_frozen_sub_s1"]) == [
        "warm_mgrpo", "stage1_mgrpo_s0", "stage2_mgrpo_s2", "stage2_frozen_sub_s1"]
    with pytest.raises(KeyError, match="unknown run 'nope'"):
        runs.lineage(["nope"])


def test_run_command_names_the_preset_mode_seed_and_parent(tmp_path):
    cmd = runs.RUNS["stage2_frozen_sub_s1"].command(str(tmp_path))
    assert any(c.endswith("xbench.py:figures,frozen_sub") for c in cmd)
    assert f"--workdir={tmp_path}/stage2_frozen_sub_s1" in cmd
    assert "--config.seed=1" in cmd and "--config.stage=stage2" in cmd
    assert f"--config.init_checkpoint={tmp_path}/stage1_mgrpo_s0" in cmd


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
    mean, std = runs.final(values, last=2)  # per run: 0.25 and 0.5
    assert mean == pytest.approx(0.375) and std == pytest.approx(0.125)
    with pytest.raises(ValueError, match="share no step"):
        runs.series(["a"], "sub/reward")
    with pytest.raises(FileNotFoundError, match="run c has no collected log"):
        runs.rl_rows("c")


def test_dk_percentile_and_histogram_sum_over_runs_and_steps(fake_logs):
    assert dk_histogram.percentile(np.array([50, 40, 9, 1]), 0.99) == 2
    assert dk_histogram.percentile(np.array([50, 40, 9, 2]), 0.99) == 3
    _write_logs(fake_logs, "x", [{"step": 1, "d_k/hist/0": 3, "d_k/hist/1": 1, "d_k/hist/2": 0},
                                 {"step": 2, "d_k/hist/0": 1, "d_k/hist/1": 2, "d_k/hist/2": 1}])
    _write_logs(fake_logs, "y", [{"step": 1, "d_k/hist/0": 0, "d_k/hist/1": 4, "d_k/hist/2": 0}])
    assert dk_histogram.histogram(["x", "y"]).tolist() == [4, 7, 1]
    assert dk_histogram.histogram(["x"], slice(1, None)).tolist() == [1, 2, 1]


def test_figure_draws_from_logs_only(fake_logs):
    rng = np.random.default_rng(0)
    for mode in fig7_stage2_reward.MODES:
        top = runs.top_name(mode)
        for name in runs.stage2(mode):
            _write_logs(fake_logs, name, [{"step": s, f"{top}/reward": float(rng.uniform()),
                                           f"{top}/correct": float(rng.uniform())} for s in range(1, 13)])
    results = fig7_stage2_reward.main(["--plot-only"])
    png = fake_logs.parent / "fig7_stage2_reward.png"
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    saved = json.loads((fake_logs.parent / "results" / "fig7_stage2_reward.json").read_text())
    assert saved["mgrpo/reward"]["last6"] == pytest.approx(list(results["mgrpo/reward"]["last6"]))
    assert set(saved) == {f"{m}/{k}" for m in (*fig7_stage2_reward.MODES, "identical") for k in ("reward", "correct")}
    assert saved["identical/reward"] == []  # independent random curves


def test_dk_histogram_skips_evaluation_only_rows(fake_logs):
    _write_logs(fake_logs, "z", [{"step": 0, "eval/eval_gaia/accuracy": 0.0},
                                 {"step": 1, "d_k/hist/0": 2, "d_k/hist/1": 2}])
    assert dk_histogram.histogram(["z"]).tolist() == [2, 2]
    assert len(dk_histogram.dk_rows("z")) == 1
