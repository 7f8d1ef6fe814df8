"""The training runs behind the paper's figures (`figures` preset), how to start them, and their logs.

Every run is `launch/tpu_run.py` in a subprocess with its own workdir under `--root` (default
`runs/figures`), so each is resumable (a restarted run continues from its latest checkpoint) and a finished
one is never run twice. The lineage is the paper's curriculum:

    warm_mgrpo  -> stage1_mgrpo_s{0,1,2}           (Fig. 5)
                   stage1_mgrpo_s0 -> stage2_{mgrpo,frozen_sub,mgrpo_unsync}_s{0,1,2}   (Figs. 6-8, d_k)
    warm_single -> stage1_single_s0 -> stage2_single_agent_s{0,1,2}                    (Fig. 7)

Warm starts are shared (supervised cloning of the scripted experts, run once per architecture); every stage-2
run of the multi-agent system starts from the same stage-1 checkpoint, and seeds change only the RL sampling,
the question order and the alignment draws. A finished run's `metrics.jsonl` is copied to
`experiments/figures/logs/<run>.jsonl`; the figure scripts plot from those copies, so the committed logs
redraw every figure without re-training (`--plot-only`).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import shutil
import subprocess
import sys
import time

import numpy as np

from mgrpo_jax.train.metrics import ema_curve, read_jsonl

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
HERE = os.path.join(REPO, "experiments", "figures")
LOGS = os.path.join(HERE, "logs")
SEEDS = (0, 1, 2)
STAGE2_MODES = ("mgrpo", "frozen_sub", "single_agent", "mgrpo_unsync")
NO_EVAL = (("train.eval_every", 0), ("train.eval_at_start", False))
# Stage 2 runs 12 steps (evaluations at 0, 6 and 12) to keep the whole set near 2 hours; stage 1 the preset's 16.
STAGE2 = (("train.steps", 12), ("train.eval_every", 6))


@dataclasses.dataclass(frozen=True)
class Run:
    name: str
    mode: str
    stage: str
    seed: int = 0
    init: str | None = None  # the run whose final checkpoint starts this one
    overrides: tuple = ()  # (config key, value) pairs on top of the `figures` preset

    def command(self, root: str) -> list[str]:
        cmd = [sys.executable, os.path.join(REPO, "launch", "tpu_run.py"),
               f"--config={os.path.join(REPO, 'experiments', 'xbench.py')}:figures,{self.mode}",
               f"--workdir={workdir(root, self.name)}", f"--config.seed={self.seed}", f"--config.stage={self.stage}"]
        if self.init:
            cmd.append(f"--config.init_checkpoint={workdir(root, self.init)}")
        cmd += [f"--config.{key}={value}" for key, value in self.overrides]
        return cmd


def _registry() -> dict[str, Run]:
    warm = (("train.steps", 0), ("train.eval_at_start", False))
    runs = [Run("warm_mgrpo", "mgrpo", "stage1", overrides=warm),
            Run("warm_single", "single_agent", "stage1", overrides=warm),
            Run("stage1_single_s0", "single_agent", "stage1", 0, "warm_single", NO_EVAL)]
    runs += [Run(f"stage1_mgrpo_s{s}", "mgrpo", "stage1", s, "warm_mgrpo", NO_EVAL) for s in SEEDS]
    for mode in STAGE2_MODES:
        init = "stage1_single_s0" if mode == "single_agent" else "stage1_mgrpo_s0"
        # Fig. 6 compares mgrpo with frozen_sub only; the other modes skip the (costly) avg@3 evaluations.
        overrides = STAGE2 if mode in ("mgrpo", "frozen_sub") else STAGE2[:1] + NO_EVAL
        runs += [Run(f"stage2_{mode}_s{s}", mode, "stage2", s, init, overrides) for s in SEEDS]
    # Follow-up (experiments/figures/longer_warmstart.py): the sub-agent's 200-step warm start never yields a
    # protocol-valid episode, so R_S = 0 and co-training has nothing to learn from. A 600-step one does; stage 2
    # runs straight from it (no stage 1), co-trained vs frozen sub-agent.
    runs.append(Run("warm_mgrpo_sub600", "mgrpo", "stage1", overrides=warm + (("warmstart.steps", 600),)))
    for mode in ("mgrpo", "frozen_sub"):
        runs += [Run(f"sub600_stage2_{mode}_s{s}", mode, "stage2", s, "warm_mgrpo_sub600", STAGE2[:1] + NO_EVAL)
                 for s in SEEDS]
    return {run.name: run for run in runs}


RUNS = _registry()


def workdir(root: str, name: str) -> str:
    return os.path.abspath(os.path.join(root, name))


def is_done(root: str, name: str) -> bool:
    return os.path.exists(os.path.join(workdir(root, name), "summary.json"))


def lineage(names) -> list[str]:
    """`names` and every run they start from, parents first."""
    order: list[str] = []

    def visit(name):
        if name not in RUNS:
            raise KeyError(f"unknown run {name!r}; runs are {sorted(RUNS)}")
        if RUNS[name].init:
            visit(RUNS[name].init)
        if name not in order:
            order.append(name)

    for name in names:
        visit(name)
    return order


def collect_log(root: str, name: str) -> str:
    """Copies a finished run's metrics (and its stage-2 curriculum, if any) next to the figures."""
    os.makedirs(LOGS, exist_ok=True)
    src = os.path.join(workdir(root, name), "metrics.jsonl")
    dst = os.path.join(LOGS, f"{name}.jsonl")
    shutil.copyfile(src, dst)
    curriculum = os.path.join(workdir(root, name), "curriculum.json")
    if os.path.exists(curriculum):
        with open(curriculum) as f:
            kept = json.load(f)
        kept["kept"] = len(kept["kept"])  # the count; the ids are regenerated from the seed
        with open(os.path.join(LOGS, f"{name}.curriculum.json"), "w") as f:
            json.dump(kept, f, indent=1, sort_keys=True)
    return dst


def _owner(root: str, name: str) -> int | None:
    """The pid of a live process training `name` (its `<root>/<name>.pid`), or None."""
    try:
        with open(os.path.join(root, f"{name}.pid")) as f:
            pid = int(f.read().strip())
        os.kill(pid, 0)
    except (FileNotFoundError, ValueError, ProcessLookupError):
        return None
    return pid


def ensure(names, root: str, jobs: int = 2) -> None:
    """Runs every missing run of `names` (and their parents), up to `jobs` at a time, then collects logs.

    A run already being trained by another invocation (a live pid in `<root>/<run>.pid`) is waited for, not
    started twice, so figure scripts can be started side by side.
    """
    todo = [n for n in lineage(names) if not is_done(root, n)]
    running: dict[str, tuple[subprocess.Popen, float]] = {}
    os.makedirs(root, exist_ok=True)
    while todo or running:
        for name, (proc, start) in list(running.items()):
            code = proc.poll()
            if code is None:
                continue
            del running[name]
            os.remove(os.path.join(root, f"{name}.pid"))
            if code != 0 or not is_done(root, name):
                raise RuntimeError(f"run {name} failed (exit {code}); see {os.path.join(root, name + '.log')}")
            print(f"[figures] {name} done in {time.monotonic() - start:.0f} s", flush=True)
        todo = [n for n in todo if not is_done(root, n)]  # some may have been finished by another invocation
        ready = [n for n in todo if (RUNS[n].init is None or is_done(root, RUNS[n].init)) and not _owner(root, n)]
        while ready and len(running) < jobs:
            name = ready.pop(0)
            todo.remove(name)
            print(f"[figures] starting {name}", flush=True)
            log = open(os.path.join(root, f"{name}.log"), "a")
            proc = subprocess.Popen(RUNS[name].command(root), stdout=log, stderr=subprocess.STDOUT, cwd=REPO)
            with open(os.path.join(root, f"{name}.pid"), "w") as f:
                f.write(str(proc.pid))
            running[name] = (proc, time.monotonic())
        waiting = [n for n in todo if _owner(root, n) or (RUNS[n].init and not is_done(root, RUNS[n].init))]
        if not running and todo and not any(_owner(root, n) for n in lineage(todo) if not is_done(root, n)):
            raise RuntimeError(f"runs {todo} cannot start: a run they start from is neither finished nor running")
        if running or waiting:
            time.sleep(2)
    for name in lineage(names):
        collect_log(root, name)


def parse_args(description: str, argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--root", default=os.path.join(REPO, "runs", "figures"), help="where the runs live")
    parser.add_argument("--jobs", type=int, default=2, help="runs trained at the same time")
    parser.add_argument("--plot-only", action="store_true", help="draw from experiments/figures/logs only")
    return parser.parse_args(argv)


# -- reading logs -------------------------------------------------------------------------------------------


def rl_rows(name: str) -> list[dict]:
    """The RL-step rows of a run's committed log (warm-start rows dropped)."""
    path = os.path.join(LOGS, f"{name}.jsonl")
    if not os.path.exists(path):
        raise FileNotFoundError(f"{path}: run {name} has no collected log; run the figure without --plot-only")
    return [row for row in read_jsonl(path) if "step" in row]


def series(names, key: str) -> tuple[np.ndarray, np.ndarray]:
    """(steps, values [len(names), steps]) of `key` over the steps every run logged it."""
    per_run = [{row["step"]: row[key] for row in rl_rows(n) if key in row} for n in names]
    steps = sorted(set.intersection(*(set(d) for d in per_run)))
    if not steps:
        raise ValueError(f"runs {list(names)} share no step logging {key!r}")
    return np.asarray(steps), np.asarray([[d[s] for s in steps] for d in per_run], np.float64)


def mean_std(values: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    return values.mean(axis=0), values.std(axis=0)


def final(values: np.ndarray, last: int = 1) -> tuple[float, float]:
    """Mean and std over runs of each run's mean over its `last` logged points."""
    per_run = values[:, -last:].mean(axis=1)
    return float(per_run.mean()), float(per_run.std())


def band(ax, steps, values, label: str, color=None, ema: float | None = None, raw_alpha: float = 0.25) -> None:
    """Mean over seeds with a +-1 std band; with `ema`, the raw mean thin and its EMA thick."""
    mean, std = mean_std(values)
    if ema is None:
        line = ax.plot(steps, mean, label=label, color=color, marker="o" if len(steps) < 8 else None)[0]
    else:
        line = ax.plot(steps, mean, color=color, alpha=raw_alpha, linewidth=1)[0]
        ax.plot(steps, ema_curve(mean, ema), color=line.get_color(), linewidth=2, label=f"{label} (EMA {ema})")
    ax.fill_between(steps, mean - std, mean + std, color=line.get_color(), alpha=0.15, linewidth=0)


def note_identical(ax, curves: dict) -> list[list[str]]:
    """Says on the plot which curves coincide exactly (the later one hides the earlier); returns those groups."""
    groups: list[list[str]] = []
    for label, values in curves.items():
        for group in groups:
            first = curves[group[0]]
            if first.shape == values.shape and np.array_equal(first, values):
                group.append(label)
                break
        else:
            groups.append([label])
    same = [g for g in groups if len(g) > 1]
    if same:
        text = "\n".join(" = ".join(g) + " at every step" for g in same)
        ax.text(0.02, 0.02, text, transform=ax.transAxes, fontsize=8, va="bottom")
    return same


def compare(ax, groups: dict, ema: float = 0.8, window: int = 6) -> dict:
    """Plots each labelled group of runs, `{label: (run names, metric key)}`, as a mean band with its EMA.

    Returns `{label: {"first<window>": (mean, std), "last<window>": (mean, std)}, "identical": [[labels]]}`.
    """
    out, curves = {}, {}
    for label, (names, key) in groups.items():
        steps, values = series(names, key)
        band(ax, steps, values, label, ema=ema)
        out[label] = {f"first{window}": final(values[:, :window], window), f"last{window}": final(values, window)}
        curves[label] = values
    out["identical"] = note_identical(ax, curves)
    ax.legend(fontsize=8)
    return out


def compare_panels(axes, keys, groups) -> dict:
    """One `compare` panel per metric key. `groups(key)` gives `{mode: (label, run names, metric key)}`.

    Returns `{"<mode>/<key>": first/last window figures, "identical/<key>": [[labels]]}` over all panels.
    """
    results = {}
    for ax, key in zip(axes, keys, strict=True):
        panel = groups(key)
        out = compare(ax, {label: (names, metric) for label, names, metric in panel.values()})
        results.update({f"{mode}/{key}": out[label] for mode, (label, _, _) in panel.items()})
        results[f"identical/{key}"] = out["identical"]
    return results


def new_figure(ncols: int = 1, width: float = 5.5, height: float = 4.0):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, ncols, figsize=(width * ncols, height), squeeze=False)
    return fig, list(axes[0])


def save_png(fig, figure: str) -> str:
    path = os.path.join(HERE, f"{figure}.png")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    print(f"[figures] wrote {os.path.relpath(path, REPO)}")
    return path


def save_results(figure: str, results: dict) -> str:
    """Writes a figure's numbers to experiments/figures/results/<figure>.json (the README quotes them)."""
    out_dir = os.path.join(HERE, "results")
    os.makedirs(out_dir, exist_ok=True)
    path = os.path.join(out_dir, f"{figure}.json")
    with open(path, "w") as f:
        json.dump(results, f, indent=1, sort_keys=True)
    print(json.dumps({"figure": figure, **results}, sort_keys=True))
    return path


def stage2(mode: str) -> list[str]:
    return [f"stage2_{mode}_s{s}" for s in SEEDS]


def top_name(mode: str) -> str:
    return "single" if mode == "single_agent" else "main"
