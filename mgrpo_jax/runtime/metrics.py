"""Metric logging: JSON lines, TensorBoard event files, a console progress line, PNG curves.

::

    writer = MetricWriter(workdir, resume_step=restored_step, total_steps=cfg.steps)
    writer.write(step, {"reward_main": 0.4, "loss": ..., "episodes": 64, "tokens": 51_200})
    writer.close()
    plot_curves(writer.jsonl_path, ["reward_main", "reward_sub"], workdir + "/rewards.png")

- ``<workdir>/metrics.jsonl``: one JSON object per ``write``: ``{"step": s, "time": unix_seconds, ...}``.
  Scalars become floats (non-finite ones ``null``, so every line is strict JSON), small arrays lists.
  The file is appended to, so a resumed run continues it; ``resume_step=s`` first drops every line with
  ``step > s`` (the steps the resumed run will redo) and any torn last line.
- ``<workdir>/tb/``: TensorBoard event files (``tensorboardX``; no TensorFlow needed). On resume the
  writer sets ``purge_step = s + 1``, so TensorBoard hides the old run's events past the checkpoint.
- Console: ``[step 12/100] reward_main=0.4100 loss=-0.0312 | 2.31 s/step 27.7 episodes/s 22165 tokens/s``.
  Rates are ``value / seconds since the previous write`` for the ``rate_keys`` present in the metrics.
- Only process 0 writes by default (``enabled=jax.process_index() == 0``); other processes get a no-op
  writer, so the trainer can call it unconditionally.
"""

from __future__ import annotations

import io
import json
import logging
import math
import os
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import jax
import numpy as np

from mgrpo_jax.runtime import files

log = logging.getLogger(__name__)

DEFAULT_RATE_KEYS = ("episodes", "tokens")


def _to_python(v) -> Any:
    """A metric value as JSON-able Python: float (None if not finite), list for small arrays, else None."""
    if isinstance(v, bool | int | float | np.generic | np.ndarray | jax.Array):
        arr = np.asarray(jax.device_get(v))
        if arr.dtype.kind not in "biuf":
            return None
        if arr.size == 1:
            x = float(arr.reshape(()))
            return x if math.isfinite(x) else None
        if arr.size <= 1024:
            return [x if math.isfinite(x) else None for x in arr.astype(np.float64).ravel().tolist()]
        return None
    if isinstance(v, str):
        return v
    if isinstance(v, Sequence):
        return [_to_python(x) for x in v]
    return None


def read_jsonl(path: str | os.PathLike) -> list[dict]:
    """Every complete JSON object of a JSON-lines file, local or remote (a torn last line is skipped)."""
    text = files.read_text(path)
    if text is None:
        raise FileNotFoundError(f"{path}: no such file")
    out = []
    for line in text.splitlines():
        try:
            out.append(json.loads(line)) if line.strip() else None
        except json.JSONDecodeError:
            continue
    return out


def truncate_jsonl(path: str | os.PathLike, last_step: int) -> int:
    """Keep only the lines with ``step <= last_step`` (atomic rewrite); returns how many were dropped."""
    return filter_jsonl(path, lambda rec: rec.get("step", -1) <= last_step)


def filter_jsonl(path: str | os.PathLike, keep: Callable[[dict], bool]) -> int:
    """Keep only the records for which ``keep`` is true, and no torn line (atomic rewrite); returns how many
    were dropped."""
    text = files.read_text(path)
    if text is None:
        return 0
    kept, dropped = [], 0
    for line in text.splitlines():
        if not line.strip():
            continue
        try:
            rec = json.loads(line)
        except json.JSONDecodeError:
            dropped += 1
            continue
        if keep(rec):
            kept.append(json.dumps(rec) + "\n")
        else:
            dropped += 1
    files.write_atomic(path, "".join(kept))
    return dropped


class MetricWriter:
    """JSONL + TensorBoard + console writer (see the module docstring). A context manager."""

    def __init__(self, workdir: str | os.PathLike, enabled: bool | None = None, *,
                 resume_step: int | None = None, total_steps: int | None = None, tensorboard: bool = True,
                 console: bool = True, console_keys: Sequence[str] | None = None,
                 rate_keys: Sequence[str] = DEFAULT_RATE_KEYS, stream=None):
        self.enabled = (jax.process_index() == 0) if enabled is None else bool(enabled)
        self.workdir = os.fspath(workdir)
        self.jsonl_path = str(files.as_path(self.workdir) / "metrics.jsonl")
        self.tb_dir = str(files.as_path(self.workdir) / "tb")
        self.total_steps = total_steps
        self.console = console
        self.console_keys = None if console_keys is None else tuple(console_keys)
        self.rate_keys = tuple(rate_keys)
        self.stream = stream
        self._last_time: float | None = None
        self._tb = None
        self._file = None
        if not self.enabled:
            return
        if resume_step is not None:
            truncate_jsonl(self.jsonl_path, resume_step)
        self._file = files.AppendFile(self.jsonl_path)
        if tensorboard:
            self._tb = files.tensorboard_writer(self.tb_dir, None if resume_step is None else int(resume_step) + 1)

    # -- writing ------------------------------------------------------------------------------------

    def write(self, step: int, metrics: Mapping[str, Any], *, console: bool | None = None,
              prefix_step: str | None = None) -> dict:
        """Log one step's metrics (device arrays are fetched here). Returns the JSON-able values.

        ``prefix_step="warmstart"`` logs on a separate step counter: the JSON line carries
        ``"warmstart_step": step`` instead of ``"step"`` (so resume truncation and the RL curves ignore
        it), the console line starts ``[warmstart step]``; TensorBoard uses ``step`` for those tags.
        """
        values = {str(k): _to_python(v) for k, v in metrics.items()}
        values = {k: v for k, v in values.items() if v is not None or _is_number(metrics[k])}
        if not self.enabled:
            return values
        now = time.time()
        step_key = "step" if prefix_step is None else f"{prefix_step}_step"
        self._file.write(json.dumps({step_key: int(step), "time": now, **values}) + "\n")
        self._file.flush()
        if self._tb is not None:
            for k, v in values.items():
                if isinstance(v, float):
                    self._tb.add_scalar(k, v, global_step=int(step))
            if prefix_step is None:  # each RL step's events reach the files (a remote one is rewritten whole)
                self._tb.flush()
        if self.console if console is None else console:
            line = self.progress_line(step, values, now, label=prefix_step or "step",
                                      total=None if prefix_step else self.total_steps)
            print(line, file=self.stream or sys.stdout, flush=True)
        if prefix_step is None:
            self._last_time = now
        return values

    def truncate_after(self, step: int) -> int:
        """Resume at ``step`` with an already open writer: drop JSONL lines with ``step > step`` and restart
        the TensorBoard writer with ``purge_step = step + 1``. Returns the number of lines dropped."""
        if not self.enabled:
            return 0
        dropped = self.drop(lambda rec: rec.get("step", -1) > step)
        if self._tb is not None:
            self._tb.close()
            self._tb = files.tensorboard_writer(self.tb_dir, int(step) + 1)
        return dropped

    def drop(self, stale: Callable[[dict], bool]) -> int:
        """Drops the JSONL records for which ``stale`` is true (those a resumed run writes again: one record per
        step, however often the run was stopped). Returns how many were dropped."""
        if not self.enabled:
            return 0
        self._file.close()
        dropped = filter_jsonl(self.jsonl_path, lambda rec: not stale(rec))
        self._file = files.AppendFile(self.jsonl_path)
        return dropped

    def progress_line(self, step: int, values: Mapping[str, Any], now: float | None = None, *,
                      label: str = "step", total: int | None = None) -> str:
        """``[step s/total] key=value ... | s/step and rates`` for the console."""
        now = time.time() if now is None else now
        total = self.total_steps if total is None and label == "step" else total
        head = f"[{label} {step}" + (f"/{total}" if total else "") + "]"
        if self.console_keys is not None:
            keys = [k for k in self.console_keys if k in values]
        else:
            keys = [k for k in values if "reward" in k or k.rsplit("/", 1)[-1] in ("loss", "accuracy")]
            keys = keys[:8]
        parts = [head] + [f"{k}={_fmt(values[k])}" for k in keys]
        if self._last_time is not None and label == "step":
            dt = max(now - self._last_time, 1e-9)
            rates = [f"{dt:.2f} s/step"]
            for k in self.rate_keys:
                if isinstance(values.get(k), float):
                    rates.append(f"{values[k] / dt:.1f} {k}/s")
            parts += ["|"] + rates
        return " ".join(parts)

    def write_text(self, step: int, tag: str, text: str) -> None:
        """A piece of text (e.g. a transcript) to TensorBoard's text tab and ``texts.jsonl``."""
        if not self.enabled:
            return
        files.append_text(files.as_path(self.workdir) / "texts.jsonl",
                          json.dumps({"step": int(step), "tag": tag, "text": text}) + "\n")
        if self._tb is not None:
            self._tb.add_text(tag, text, global_step=int(step))

    def flush(self) -> None:
        if self._file is not None:
            self._file.flush()
        if self._tb is not None:
            self._tb.flush()

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None
        if self._tb is not None:
            self._tb.close()
            self._tb = None

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


def _is_number(v) -> bool:
    try:
        return np.asarray(jax.device_get(v)).dtype.kind in "biuf" and np.size(v) == 1
    except Exception:  # noqa: BLE001 - anything unconvertible is simply not a number
        return False


def _fmt(v) -> str:
    if isinstance(v, float):
        return f"{v:.4g}" if abs(v) >= 1e4 or (v != 0 and abs(v) < 1e-3) else f"{v:.4f}"
    return str(v)


def ema_curve(values: Sequence[float], ema: float) -> np.ndarray:
    """Bias-corrected exponential moving average (TensorBoard's smoothing): starts at the first value."""
    out, acc, weight = [], 0.0, 0.0
    for v in values:
        acc = ema * acc + (1.0 - ema) * v
        weight = ema * weight + (1.0 - ema)
        out.append(acc / weight if weight > 0 else v)
    return np.asarray(out)


def plot_curves(jsonl_path: str | os.PathLike, keys: Sequence[str], png_path: str | os.PathLike,
                ema: float = 0.9, title: str | None = None) -> list[str]:
    """Raw (faint) and EMA-smoothed curves of ``keys`` against ``step`` from a metrics JSONL, one panel per
    key, saved as a PNG (matplotlib's Agg canvas; no display, no global backend change). Returns the keys
    drawn (those found in the file); raises ValueError when none is."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure
    from matplotlib.ticker import MaxNLocator

    records = read_jsonl(jsonl_path)
    series = {}
    for k in keys:
        pts = [(r["step"], r[k]) for r in records if isinstance(r.get(k), int | float) and "step" in r]
        if pts:
            series[k] = pts
    if not series:
        raise ValueError(f"none of {list(keys)} found in {jsonl_path}")
    n = len(series)
    cols = min(n, 3)
    rows = math.ceil(n / cols)
    fig = Figure(figsize=(4.5 * cols, 3.2 * rows), dpi=100)
    FigureCanvasAgg(fig)
    for i, (k, pts) in enumerate(series.items()):
        ax = fig.add_subplot(rows, cols, i + 1)
        steps = np.asarray([p[0] for p in pts], np.float64)
        vals = np.asarray([p[1] for p in pts], np.float64)
        ax.plot(steps, vals, color="tab:blue", alpha=0.3, linewidth=1.0, label="raw")
        ax.plot(steps, ema_curve(vals, ema), color="tab:blue", linewidth=2.0, label=f"EMA {ema:g}")
        ax.set_title(k)
        ax.set_xlabel("RL step")
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        ax.set_ylabel(k.rsplit("/", 1)[-1])
        ax.grid(alpha=0.3)
        if i == 0:
            ax.legend(fontsize="small")
    if title:
        fig.suptitle(title)
    fig.tight_layout()
    png = io.BytesIO()
    fig.savefig(png, format="png")
    files.write_atomic(png_path, png.getvalue())
    return list(series)


def _finite(value):
    """`value` with every non-finite float as None (strict JSON has no NaN)."""
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, Mapping):
        return {str(k): _finite(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_finite(v) for v in value]
    return value


BEST_SUFFIXES = ("/reward", "/correct", "/accuracy")


def best_metrics(jsonl_path: str | os.PathLike, suffixes: Sequence[str] = BEST_SUFFIXES) -> dict[str, dict]:
    """{key: {"value", "step"}}: the highest value of each reward / correctness / accuracy metric in the log."""
    best: dict[str, dict] = {}
    for record in read_jsonl(jsonl_path) if files.as_path(jsonl_path).exists() else []:
        for k, v in record.items():
            if k.endswith(tuple(suffixes)) and _is_number(v) and "step" in record and math.isfinite(v):
                if k not in best or v > best[k]["value"]:
                    best[k] = {"value": float(v), "step": int(record["step"])}
    return best


RUN_FIRST = ("status", "step", "best", "files", "resume_from")  # the run record's keys a reader looks for first
SUMMARY_FILES = ("metrics.jsonl", "tb", "rewards.png", "checkpoints", "transcripts.jsonl", "curriculum.json",
                 "tokenizer.model", "run.log", "summary.json", "agents", "export")


def run_panels(records: Sequence[Mapping], reward_keys: Sequence[str]) -> dict[str, dict[str, list]]:
    """{panel title: {key: [(x, value)]}} of a run's figure: the rewards (`reward_keys`), the system's
    correctness, the evaluations' accuracy (per RL step) and the warm-start losses (per warm-start step); a
    panel without data is left out."""
    def series(keep, step_key: str = "step") -> dict[str, list]:
        out: dict[str, list] = {}
        for r in records:
            for k, v in r.items():
                if step_key in r and keep(k) and isinstance(v, int | float) and not isinstance(v, bool):
                    out.setdefault(k, []).append((r[step_key], v))
        return out

    panels = {"reward": series(lambda k: k in reward_keys),
              "correctness (training episodes)": series(lambda k: k.endswith("/correct") and "/" not in k[:-8]),
              "evaluation accuracy": series(lambda k: k.startswith("eval/") and k.endswith("/accuracy")),
              "warm-start loss": series(lambda k: k.startswith("warmstart/") and k.endswith("/loss"),
                                        "warmstart_step")}
    return {title: found for title, found in panels.items() if found}


def plot_run(jsonl_path: str | os.PathLike, reward_keys: Sequence[str], png_path: str | os.PathLike,
             title: str | None = None, ema: float = 0.9) -> list[str]:
    """The run's figure (`run_figure`) as a PNG. Returns the panels drawn; raises ValueError when there is none."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg

    fig = run_figure(read_jsonl(jsonl_path), reward_keys, title, ema)
    if fig is None:
        raise ValueError(f"none of {list(reward_keys)}, correctness, accuracy or warm-start loss in {jsonl_path}")
    FigureCanvasAgg(fig)
    png = io.BytesIO()
    fig.savefig(png, format="png")
    files.write_atomic(png_path, png.getvalue())
    return [ax.get_title() for ax in fig.axes]


def run_figure(records: Sequence[Mapping], reward_keys: Sequence[str], title: str | None = None, ema: float = 0.9):
    """A matplotlib Figure of `run_panels`, side by side: raw (faint) and EMA-smoothed rewards, correctness and
    warm-start loss, the evaluations' accuracy as points; integer steps on the x axes (None without panels)."""
    from matplotlib.figure import Figure
    from matplotlib.ticker import MaxNLocator

    panels = run_panels(records, reward_keys)
    if not panels:
        return None
    fig = Figure(figsize=(4.2 * len(panels), 3.4), dpi=100)
    rl_axis = None  # the RL panels share their steps: an evaluation's points line up with the rewards
    for i, (panel, found) in enumerate(panels.items()):
        ax = fig.add_subplot(1, len(panels), i + 1, sharex=None if panel == "warm-start loss" else rl_axis)
        rl_axis = rl_axis or (ax if panel != "warm-start loss" else None)
        first, last = min(x for p in found.values() for x, _ in p), max(x for p in found.values() for x, _ in p)
        if last - first < 2:  # a point or two: a span the integer ticks can mark
            ax.set_xlim(first - 1, last + 1)
        for j, (key, points) in enumerate(found.items()):
            color = f"C{j}"
            steps, values = (np.asarray(column, np.float64) for column in zip(*points, strict=True))
            if panel == "evaluation accuracy":
                ax.plot(steps, values, "o-", color=color, markersize=4, label=key[len("eval/"):-len("/accuracy")])
                continue
            if panel == "warm-start loss":  # logged every 25 steps: too few points to smooth
                ax.plot(steps, values, color=color, linewidth=2.0, label=key.split("/")[-2])
                continue
            ax.plot(steps, values, color=color, alpha=0.3, linewidth=1.0)
            ax.plot(steps, ema_curve(values, ema), color=color, linewidth=2.0, label=key)
        if panel in ("correctness (training episodes)", "evaluation accuracy"):
            ax.set_ylim(-0.03, 1.03)  # shares: a flat 0 reads as 0, not as noise around it
        ax.set_title(panel)
        ax.set_xlabel("warm-start step" if panel == "warm-start loss" else "RL step")
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        ax.grid(alpha=0.3)
        ax.legend(fontsize="small")
    if title:
        fig.suptitle(title)
    fig.tight_layout()
    return fig


def write_summary(workdir: str, summary: Mapping[str, Any], curve_keys: Sequence[str] = (),
                  run: Mapping[str, Any] | None = None, title: str | None = None) -> list[str]:
    """`summary.json`: first the run-level record under `"run"` (`status`, `step`, `best` value of each reward /
    accuracy metric, the `files` the run wrote, then the rest of `run`), then the last step's metrics, sorted.
    With `curve_keys` (the rewards), also the run's figure as `rewards.png` (`plot_run`, titled `title`); a plot
    that fails is a warning, never a failed run. The JSON is strict (no NaN) and replaced atomically. Returns
    the files written, relative to `workdir`."""
    folder = files.as_path(workdir)
    jsonl = str(folder / "metrics.jsonl")
    if curve_keys:
        try:
            plot_run(jsonl, list(curve_keys), folder / "rewards.png", title=title)
        except (OSError, ValueError) as e:
            log.warning("rewards.png not written: %s", e)
    run = dict(run or {})
    if hasattr(run.get("config"), "to_json_best_effort"):  # an ml_collections config
        run["config"] = json.loads(run["config"].to_json_best_effort())
    run.update(best=best_metrics(jsonl), files=_written(folder))
    run = {**{k: run[k] for k in RUN_FIRST if k in run}, **run}
    record = {"run": run, **{k: summary[k] for k in sorted(summary)}}
    files.write_atomic(folder / "summary.json", json.dumps(_finite(record), indent=1, allow_nan=False))
    return run["files"]


def _written(folder) -> list[str]:
    return [n for n in SUMMARY_FILES if n == "summary.json" or (folder / n).exists()]


def update_summary_files(workdir: str) -> list[str]:
    """Lists again, in `summary.json`, the files of the run (e.g. `export`, written after the summary)."""
    folder = files.as_path(workdir)
    try:
        record = json.loads(files.read_text(folder / "summary.json") or "null")
    except (OSError, json.JSONDecodeError):
        record = None
    if not isinstance(record, dict) or not isinstance(record.get("run"), dict):
        return []
    written = _written(folder)
    if record["run"].get("files") != written:
        record["run"]["files"] = written
        files.write_atomic(folder / "summary.json", json.dumps(record, indent=1, allow_nan=False))
    return written


def read_summary(workdir: str) -> dict:
    """The last step's metrics recorded in `workdir/summary.json` ({} when there is none or it is unreadable)."""
    try:
        record = json.loads(files.read_text(files.as_path(workdir) / "summary.json") or "{}")
    except (OSError, json.JSONDecodeError):
        return {}
    return {k: v for k, v in record.items() if k != "run"} if isinstance(record, dict) else {}
