"""The store benchmark at tiny sizes on the GCS emulator, its step time from a run's metrics (no timing targets
asserted; file:// at the local sizes is its quick mode, in test_quick_modes.py).

It runs as a subprocess: the benchmark points the GCS settings of its process at its own emulator.
"""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


def test_tiny_store_benchmark_emits_figures(tmp_path):
    metrics = tmp_path / "metrics.jsonl"
    # A run's metrics: the first two steps compile and are left out (--skip-steps 2): median of 2.0, 3.0, 4.0.
    metrics.write_text("".join(json.dumps({"step": i + 1, "time/step_s": s}) + "\n"
                               for i, s in enumerate([30.0, 20.0, 4.0, 2.0, 3.0])))
    env = dict(os.environ)
    env["PYTHONPATH"] = str(REPO) + os.pathsep + env.get("PYTHONPATH", "")
    args = ["--sizes", "2,2,3", "--backends", "gs", "--fifo-backends", "gs", "--payload-preset", "smoke",
            "--preset", "smoke", "--gs-steps", "2", "--share-steps", "1", "--metrics", str(metrics)]
    proc = subprocess.run([sys.executable, "-m", "mgrpo_jax.bench.store", *args], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-4000:]
    figures = json.loads(proc.stdout.strip().splitlines()[-1])
    for key in ("records_per_s", "mb_per_s", "exchange_share"):
        assert figures[key] > 0, key
    result = figures["gcs_emulator"]
    assert figures["exchange_share"] == result["exchange_share"] and figures["headline_store"] == "gcs_emulator"
    assert figures["step_s"] == 3.0 and figures["step_s_samples"] == [4.0, 2.0, 3.0]
    # 2 queries x 2 rollouts x 3 delegation rounds: 12 tasks, each round's posted as one batch, claimed (one lease),
    # read, answered (one object) and its answers read back; then the arrays and the commit markers.
    assert result["sizes"]["tasks_per_step"] == 12 and result["exchange"] == figures["exchange"] == "batched"
    assert 3 * 5 <= result["records_per_step"] < 12 * 5
    assert result["records_per_s"] == pytest.approx(result["records_per_step"] / result["step_exchange_s"])
    assert 0 < result["mb_per_step"] < 10
    assert result["record_bytes_task"] > 50 and result["record_bytes_answer"] > result["record_bytes_task"]
    assert 0 < result["exchange_share"] < 10 and result["preset_exchange_s"] > 0
    assert set(result["phases_s"]) >= {"tasks", "serve", "answers", "main_commit", "sub_read", "sub_commit",
                                       "lag_wait", "gc"}
    assert result["fifo_measured"] and result["mb_per_step_unsync"] > result["mb_per_step"]
    assert result["deletes_per_step"] > 0  # gc of the previous step, key by key on GCS


def test_the_default_is_file_only_and_full_adds_the_emulator_and_the_presets_warm_start():
    from mgrpo_jax.bench import store

    default, full = store.parse_args([]), store.parse_args(["--full"])
    assert (default.backends, default.warmstart_steps, default.rl_steps, default.quiet_steps) == ("file", 100, 2, 1)
    assert (full.backends, full.warmstart_steps, full.rl_steps, full.max_warmup_steps) == ("file,gs", None, 3, 8)
    assert store.parse_args(["--full", "--backends", "file"]).backends == "file"
