"""End to end: the `smoke` preset runs warm start, RL steps of both agents, evaluation and checkpoints;
an interrupted and resumed run continues with exactly the metrics of an uninterrupted one."""

import json
import os

import pytest

from mgrpo_jax.config import get_config
from mgrpo_jax.train.metrics import read_jsonl
from mgrpo_jax.train.trainer import Trainer

DETERMINISTIC_KEYS = ("main/reward", "main/correct", "main/format_ok", "main/generated_tokens", "sub/reward",
                      "main/train/loss", "sub/train/loss")


def _smoke(mode="mgrpo", steps=2):
    config = get_config("xbench", f"smoke,{mode}")
    config.train.steps = steps
    return config


def _rl_records(workdir):
    return [r for r in read_jsonl(os.path.join(workdir, "metrics.jsonl")) if "step" in r]


@pytest.mark.slow
def test_smoke_preset_runs_end_to_end(tmp_path):
    summary = Trainer(_smoke(), str(tmp_path)).run()
    records = _rl_records(tmp_path)
    assert [r["step"] for r in records] == [1, 2]
    for key in ("main/reward", "sub/reward", "main/train/loss", "time/sampling_s", "eval/eval_gaia/accuracy"):
        assert key in summary, key
    assert 0.0 <= summary["main/reward"] <= 1.0
    assert (tmp_path / "rewards.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert json.loads((tmp_path / "summary.json").read_text())["main/reward"] == summary["main/reward"]
    assert (tmp_path / "checkpoints").is_dir() and (tmp_path / "tokenizer.model").is_file()


@pytest.mark.slow
def test_resumed_run_reproduces_the_uninterrupted_metrics(tmp_path):
    straight = tmp_path / "straight"
    Trainer(_smoke(steps=3), str(straight)).run()
    interrupted = tmp_path / "interrupted"
    Trainer(_smoke(steps=1), str(interrupted)).run()  # stops after step 1 with a checkpoint
    Trainer(_smoke(steps=3), str(interrupted)).run()  # a new process would do the same: resume at step 1
    a, b = _rl_records(straight), _rl_records(interrupted)
    assert [r["step"] for r in b] == [1, 2, 3]
    for ra, rb in zip(a, b, strict=True):
        for key in DETERMINISTIC_KEYS:
            if key in ra:
                assert ra[key] == pytest.approx(rb[key], rel=1e-5, abs=1e-6), (ra["step"], key)


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["frozen_sub", "single_agent", "mgrpo_unsync"])
def test_other_training_modes_run(tmp_path, mode):
    config = _smoke(mode, steps=2)
    config.train.eval_every = 0
    summary = Trainer(config, str(tmp_path)).run()
    top = "single" if mode == "single_agent" else "main"
    assert f"{top}/reward" in summary
    if mode == "frozen_sub":
        assert "sub/train/loss" not in summary and "main/train/loss" in summary


@pytest.mark.slow
def test_real_benchmark_files_are_evaluated_and_transcripts_logged(tmp_path):
    # Two invented records in GAIA's metadata.jsonl schema (never real benchmark text).
    folder = tmp_path / "gaia" / "2023" / "validation"
    folder.mkdir(parents=True)
    records = [{"task_id": f"00000000-0000-0000-0000-00000000000{i}", "Question": f"What is {i} plus {i}?",
                "Level": 1, "Final answer": str(2 * i), "file_name": "",
                "Annotator Metadata": {"Steps": "add", "Number of steps": "1"}} for i in (1, 2)]
    (folder / "metadata.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    config = get_config("gaia", "smoke")
    config.env.benchmark_path = str(folder)
    trainer = Trainer(config, str(tmp_path / "run"))
    metrics = trainer.evaluate()
    assert 0.0 <= metrics["eval/gaia_file/accuracy"] <= 1.0
    assert {"eval/eval_gaia/accuracy", "eval/eval_xbench/accuracy", "eval/eval_webwalker/accuracy"} <= set(metrics)
    trainer.rl_step()
    lines = (tmp_path / "run" / "transcripts.jsonl").read_text().splitlines()
    assert len(lines) == config.train.log_transcripts
    assert {"question", "gold", "turns", "delegations", "end_reason"} <= set(json.loads(lines[0]))
