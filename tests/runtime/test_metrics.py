"""Metric files: JSONL parses and resumes, TensorBoard events read back, the PNG is a PNG."""

import io
import json
import math
import os
import struct

import jax.numpy as jnp
import numpy as np
import pytest
from tensorboardX.proto import event_pb2
from tensorboardX.record_writer import masked_crc32c

from mgrpo_jax.runtime.metrics import MetricWriter, ema_curve, plot_curves, read_jsonl, read_summary, write_summary


def _read_events(tb_dir):
    """Parse TFRecord framing (length, masked CRCs) of every event file in ``tb_dir`` ourselves."""
    events = []
    files = sorted(f for f in os.listdir(tb_dir) if "tfevents" in f)
    assert files
    for name in files:
        data = open(os.path.join(tb_dir, name), "rb").read()
        pos = 0
        while pos < len(data):
            header = data[pos:pos + 8]
            (length,) = struct.unpack("<Q", header)
            (len_crc,) = struct.unpack("<I", data[pos + 8:pos + 12])
            assert len_crc == masked_crc32c(header)
            payload = data[pos + 12:pos + 12 + length]
            (data_crc,) = struct.unpack("<I", data[pos + 12 + length:pos + 16 + length])
            assert data_crc == masked_crc32c(payload)
            events.append(event_pb2.Event.FromString(payload))
            pos += 16 + length
    return events


def _scalars(events):
    out = {}
    for e in events:
        for v in e.summary.value:
            out.setdefault(v.tag, []).append((e.step, v.simple_value))
    return out


def test_jsonl_tensorboard_console_and_resume(tmp_path):
    stream = io.StringIO()
    with MetricWriter(tmp_path, enabled=True, total_steps=10, stream=stream) as w:
        for step in range(1, 6):
            w.write(step, {"reward_main": jnp.float32(step / 10), "loss": np.float64(-step), "episodes": 8,
                           "tokens": 800, "grad_norm": float("nan") if step == 3 else 1.0,
                           "d_hist": np.array([1, 2, 3])})
    lines = [json.loads(x) for x in open(tmp_path / "metrics.jsonl")]
    assert [r["step"] for r in lines] == [1, 2, 3, 4, 5]
    assert lines[1]["reward_main"] == pytest.approx(0.2) and lines[1]["loss"] == -2.0
    assert lines[2]["grad_norm"] is None  # non-finite -> null: strict JSON
    assert lines[0]["d_hist"] == [1.0, 2.0, 3.0]
    out = stream.getvalue().splitlines()
    assert out[0].startswith("[step 1/10] reward_main=0.1000 loss=-1.0000")
    assert "s/step" in out[1] and "episodes/s" in out[1] and "tokens/s" in out[1]

    scalars = _scalars(_read_events(tmp_path / "tb"))
    assert [s for s, _ in scalars["reward_main"]] == [1, 2, 3, 4, 5]
    assert scalars["reward_main"][3][1] == pytest.approx(0.4)

    # A crash mid-write leaves a torn line; the run resumes from the step-3 checkpoint.
    with open(tmp_path / "metrics.jsonl", "a") as f:
        f.write('{"step": 6, "reward_ma')
    with MetricWriter(tmp_path, enabled=True, resume_step=3, console=False) as w:
        for step in range(4, 7):
            w.write(step, {"reward_main": 1.0 + step})
    steps = [r["step"] for r in read_jsonl(tmp_path / "metrics.jsonl")]
    assert steps == [1, 2, 3, 4, 5, 6]
    assert [r["reward_main"] for r in read_jsonl(tmp_path / "metrics.jsonl")][3:] == [5.0, 6.0, 7.0]
    events = _read_events(tmp_path / "tb")
    # The resumed writer tells TensorBoard to drop the old run's events from step 4 on.
    purges = [e.step for e in events if e.WhichOneof("what") == "session_log" and e.session_log.status == 1]
    assert purges == [4]


def test_disabled_writer_writes_nothing(tmp_path):
    with MetricWriter(tmp_path / "w", enabled=False) as w:
        assert w.write(1, {"loss": 1.0}) == {"loss": 1.0}
    assert not (tmp_path / "w").exists()


def test_plot_curves_png(tmp_path):
    with MetricWriter(tmp_path, enabled=True, console=False, tensorboard=False) as w:
        rng = np.random.default_rng(0)
        for step in range(50):
            w.write(step, {"reward_main": step / 50 + rng.normal(0, 0.1), "reward_sub": rng.random()})
    png = tmp_path / "plots" / "rewards.png"
    drawn = plot_curves(tmp_path / "metrics.jsonl", ["reward_main", "reward_sub", "missing"], png, ema=0.9)
    assert drawn == ["reward_main", "reward_sub"]
    data = png.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and data[12:16] == b"IHDR"
    width, height = struct.unpack(">II", data[16:24])
    assert width > 100 and height > 100
    with pytest.raises(ValueError):
        plot_curves(tmp_path / "metrics.jsonl", ["missing"], tmp_path / "x.png")


def test_ema_is_debiased():
    np.testing.assert_allclose(ema_curve([2.0, 2.0, 2.0], 0.9), [2.0, 2.0, 2.0])
    smoothed = ema_curve([0.0, 1.0], 0.5)
    assert smoothed[0] == 0.0 and math.isclose(smoothed[1], 0.5 / 0.75)


def test_truncate_after_on_an_open_writer_and_warmstart_steps(tmp_path):
    stream = io.StringIO()
    with MetricWriter(tmp_path, enabled=True, stream=stream) as w:
        for i in (0, 25, 50):
            w.write(i, {"warmstart/main/loss": 3.0 - i / 50}, prefix_step="warmstart")
        for step in range(1, 5):
            w.write(step, {"main/reward": step / 4})
    assert stream.getvalue().startswith("[warmstart 0] warmstart/main/loss=3.0000")
    # The trainer opens its writer first, then restores step 2 and truncates.
    with MetricWriter(tmp_path, enabled=True, console=False) as w:
        assert w.truncate_after(2) == 2
        w.write(3, {"main/reward": 0.0})
    recs = read_jsonl(tmp_path / "metrics.jsonl")
    assert [r.get("warmstart_step") for r in recs[:3]] == [0, 25, 50]  # warm-start lines survive
    assert [r["step"] for r in recs[3:]] == [1, 2, 3] and recs[-1]["main/reward"] == 0.0
    purges = [e.step for e in _read_events(tmp_path / "tb")
              if e.WhichOneof("what") == "session_log" and e.session_log.status == 1]
    assert purges == [3]
    assert plot_curves(tmp_path / "metrics.jsonl", ["main/reward"], tmp_path / "r.png") == ["main/reward"]


def test_a_deleted_log_is_continued_in_a_new_file(tmp_path, caplog):
    writer = MetricWriter(tmp_path, enabled=True, tensorboard=False, console=False)
    writer.write(1, {"loss": 1.0})
    os.remove(writer.jsonl_path)  # e.g. a user cleaning up while the job runs
    writer.write(2, {"loss": 0.5})
    writer.close()
    assert [r["step"] for r in read_jsonl(writer.jsonl_path)] == [2]
    assert "was deleted during the run" in caplog.text


def test_summary_is_strict_json_with_the_run_record_and_survives_a_failed_plot(tmp_path, caplog):
    writer = MetricWriter(tmp_path, enabled=True, tensorboard=False, console=False)
    for step, reward in ((1, 0.2), (2, 0.7), (3, 0.4)):
        writer.write(step, {"main/reward": reward, "main/train/loss": float("nan")})
    writer.close()
    files = write_summary(str(tmp_path), {"main/reward": 0.4, "main/train/loss": float("nan")},
                          curve_keys=["no/such/metric"], run={"status": "finished", "step": 3})
    text = (tmp_path / "summary.json").read_text()
    record = json.loads(text)  # strict: NaN became null
    assert "NaN" not in text and record["main/train/loss"] is None
    assert record["run"]["best"] == {"main/reward": {"value": 0.7, "step": 2}}
    assert record["run"]["status"] == "finished" and files == record["run"]["files"] == ["metrics.jsonl",
                                                                                          "summary.json"]
    assert "rewards.png not written" in caplog.text and not (tmp_path / "rewards.png").exists()
    assert read_summary(str(tmp_path)) == {"main/reward": 0.4, "main/train/loss": None}
    (tmp_path / "summary.json").write_text("{not json")
    assert read_summary(str(tmp_path)) == {}


def test_the_run_figure_and_the_summary_record_first(tmp_path):
    from mgrpo_jax.runtime.metrics import plot_run, run_figure, update_summary_files

    with MetricWriter(tmp_path, enabled=True, tensorboard=False, console=False) as writer:
        for step in (0, 1, 2):
            writer.write(step, {"warmstart/main/loss": 3.0 - step, "warmstart/sub/loss": 2.5 - step},
                         prefix_step="warmstart")
        for step in (1, 2, 3):
            writer.write(step, {"main/reward": step / 4, "sub/reward": step / 8, "main/correct": step / 3,
                                **({"eval/eval_xbench/accuracy": 0.5} if step % 2 == 0 else {})})
    records = read_jsonl(tmp_path / "metrics.jsonl")
    fig = run_figure(records, ["main/reward", "sub/reward"], title="xbench, smoke preset, mgrpo")
    assert [ax.get_title() for ax in fig.axes] == ["reward", "correctness (training episodes)",
                                                   "evaluation accuracy", "warm-start loss"]
    assert fig._suptitle.get_text() == "xbench, smoke preset, mgrpo"
    for ax in fig.axes:  # 3 RL steps: ticks 1, 2, 3, never 1.5
        assert all(float(t).is_integer() for t in ax.get_xticks()), ax.get_xticks()
    assert [line.get_label() for line in fig.axes[3].get_lines() if not line.get_label().startswith("_")] == \
        ["main", "sub"]
    assert plot_run(tmp_path / "metrics.jsonl", ["main/reward"], tmp_path / "rewards.png")[-1] == "warm-start loss"
    assert (tmp_path / "rewards.png").read_bytes()[:4] == b"\x89PNG"

    (tmp_path / "agents").mkdir()
    write_summary(str(tmp_path), {"sub/reward": 0.375, "main/reward": 0.75},
                  run={"mode": "mgrpo", "wall_time_s": 1.0, "status": "finished", "step": 3})
    record = json.loads((tmp_path / "summary.json").read_text())
    assert list(record) == ["run", "main/reward", "sub/reward"]
    assert list(record["run"])[:4] == ["status", "step", "best", "files"] and "agents" in record["run"]["files"]
    (tmp_path / "export").mkdir()  # written after the summary (launch.execute)
    assert "export" in update_summary_files(str(tmp_path))
    assert json.loads((tmp_path / "summary.json").read_text())["run"]["files"][-2:] == ["agents", "export"]
