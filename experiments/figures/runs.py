"""The training runs behind the paper's figures (`figures` preset), how to start them, and their logs.

Every run is `launch/tpu_run.py` in a subprocess with its own workdir under `--root` (default
`runs/figures`), so each is resumable (a restarted run continues from its latest checkpoint) and a finished
one is never run twice. The lineage is the paper's curriculum, once per world s = 0..7 (`SEEDS`, chosen once):

    warm_mgrpo_s{s} -> stage1_mgrpo_s{s}                                       (Fig. 5)
                       stage1_mgrpo_s{s} -> curriculum_s{s}     (the world's stage-2 question pool, filtered once)
                       stage1_mgrpo_s{s} -> stage2_{mgrpo,frozen_sub,mgrpo_unsync}_s{s}   (Figs. 6-8, d_k)
                                         -> abl_{align_mask,beta_noexpert,dmax_low,dmax_high}_s{s} (ablations)
                                         -> stage2_distinct_matpo_s{s}   (two agents, MATPO's credit: the 2 x 2)
    warm_single_s{s} -> stage1_single_s{s} -> stage2_single_agent_s{s}                    (Fig. 7)
                                             -> eval_single_agent_s{s}          (its held-out accuracy)
    warm_shared_s{s} -> stage1_shared_s{s} -> stage2_{shared_mgrpo,matpo}_s{s}   (one shared model, issue 29)
    warm_shared2x_s{s} -> stage1_shared2x_s{s} -> stage2_shared2x_s{s}   (the same, one model of ~2x the parameters)

A seed varies everything a user would vary: seed s is its own world (`env.seed` = s, so its names, facts and
questions), its own supervised warm start (cloning that world's scripted experts) and its own stage-1
checkpoint, besides the RL sampling, the question order and the alignment draws. The modes of one seed share
its world, warm start and stage-1 checkpoint, so a claim's per-seed differences are paired by world, and its
interval over seeds says whether the ordering holds across worlds. Every stage-2 run of a world trains on one
question pool, `curriculum_s{s}`'s: the stage-1 mgrpo system of that world poses the pool's questions in
counterfactual twins (as the RL steps do) and keeps those it finds hard, once; so the comparisons across lineages
(frozen_sub vs single_agent, the shared-policy pairs) train on the same questions. The ablations are stage-2
`mgrpo` runs with one setting changed; the D ablation's two values are chosen from the d_k histogram of the
stage-2 `mgrpo` runs of the first `N_DMAX_WORLDS` worlds (below and above its 99th percentile and the preset's D,
`dmax_choice`), so
those runs wait for them. A finished run's `metrics.jsonl` is copied to `experiments/figures/logs/<run>.jsonl` (and
its learners' parameter counts to `<run>.params.json`); the figure scripts plot from those copies, so the committed
logs redraw every figure without re-training (`--plot-only`), and the set resumes from them on another machine:
a run whose log is collected trains again only when a run that must train starts from its checkpoint
(`to_train`). Runs start world by world, so an interrupted set leaves whole worlds collected.

The shared-policy runs (experiments/figures/shared_policy.py) train one model for both roles (modes
`shared_mgrpo` and `matpo`, learner `shared`, built from `config.main`) through the same curriculum: a warm start
and stage 1 of their own in mode `shared_mgrpo`, then stage 2 with M-GRPO's credit or MATPO's from the same
stage-1 checkpoint, evaluated as `stage2_mgrpo`. `stage2_distinct_matpo` is the 2 x 2's fourth cell: the two
distinct agents of `stage2_mgrpo` trained with MATPO's credit. Every cell and `shared2x` train with one loss
configuration (`LOSS_2X2`), so a pair differs only in what `shared_policy.DIFFERS` says. `shared2x` is the
parameter-matched control: the same lineage with one model about as large as the two compact agents together
(`SHARED2X_OVERRIDES`). `eval_single_agent_s{s}` evaluates the finished stage-2 single agent (whose run skips the
evaluations) at its step 0 and stops.
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import hashlib
import json
import os
import shutil
import subprocess
import sys
import threading
import time

import numpy as np

from experiments.figures import stats
from mgrpo_jax.runtime.metrics import ema_curve, read_jsonl

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
HERE = os.path.join(REPO, "experiments", "figures")
LOGS = os.path.join(HERE, "logs")
# The worlds of the set, chosen once before any of its runs (issue 36): worlds 0-7, each its own `env.seed`; every
# claim and comparison has these 8 per arm, so an exact sign-flip test can reach p = 1/256 (5 worlds: 1/32).
# `--seeds N` runs a quicker, weaker partial set.
N_SEEDS = 8
SEEDS = tuple(range(N_SEEDS))
# The ablations (beyond the paper) run the same worlds as the claims, against the default runs of those worlds.
N_ABLATION_SEEDS = N_SEEDS
# D for the d_max ablation comes from the d_k histogram of the stage-2 mgrpo runs of the first worlds only, so a
# world's ablations need not wait for every world's stage 2 (the set finishes world by world).
N_DMAX_WORLDS = 2
STAGE2_MODES = ("mgrpo", "frozen_sub", "single_agent", "mgrpo_unsync")
NO_EVAL = (("train.eval_every", 0), ("train.eval_at_start", False))
# Both stages run the preset's `train.steps` (and stage 2 evaluates every `train.eval_every`); `--stage2-steps N`
# (`set_stage2_steps`) gives stage 2 its own length, with evaluations at its start, middle and end.
STAGE2_STEPS: int | None = None
# The ablations (stage-2 mgrpo with one setting changed; no evaluations), compared with stage2_mgrpo_s*.
ABLATIONS = {
    "align_mask": (("rollout.align_mode", "mask"),),  # pad d_k < D with weight-0 slots, not copies
    "beta_noexpert": (("rewards.beta", "(0.1,0.9,0.0)"),),  # R_S without the expert term
    "dmax_low": (("rollout.d_max", "dmax:low"),),  # D below the 99th percentile of d_k
    "dmax_high": (("rollout.d_max", "dmax:high"),),  # D above it
}
# The parameter-matched control of the shared-policy comparison: one model (`config.main`, which builds the shared
# learner) with about the two compact agents' summed parameters. The `figures` preset's compact agent (d_model 64,
# 2 layers, 4 heads of 16, mlp 256, tied embeddings) has 169,152 parameters at the word vocabulary of the
# figures' worlds (589), so two have 338,304; this one has 352,000 (1.040x). At vocab 600: 169,856 each, 339,712
# for two, 353,056 here (1.039x); at vocab 1200: 208,256, 416,512 and 410,656 (0.986x). Doubling the depth alone
# falls short, since the embeddings stay: 4 layers have 300,544 at vocab 589 (0.888x of two agents).
SHARED2X_OVERRIDES = (("main.model_overrides.d_model", 96), ("main.model_overrides.n_heads", 6),
                      ("main.model_overrides.n_kv_heads", 6), ("main.model_overrides.mlp_dim", 384))
# `eval_single_agent_s{s}`: the finished stage-2 single agent evaluated once (step 0) and nothing else; a stage-2
# success bound of 1 keeps every question, so the curriculum filter's rollouts are skipped.
EVAL_ONLY = (("train.steps", 0), ("train.eval_at_start", True), ("env.stage2_max_success", 1.0))
# The world's stage-2 question pool: `curriculum_s{s}` filters it once (its stage-1 mgrpo system, posing the
# questions in twins as the RL steps do) and every stage-2 run of the world trains on it, so the claims across
# lineages (frozen_sub vs single_agent, the shared-policy pairs) train on the same questions.
CURRICULUM_KEY = "env.curriculum_file"
FILTER_ONLY = (("train.steps", 0), ("train.eval_at_start", False), ("train.eval_every", 0))
# One loss configuration for every cell of the shared-policy 2 x 2 and its parameter-matched control: the agents'
# own loss settings (the `grpo` defaults, as stage2_mgrpo trains), not MATPO's recipe that mode `matpo` defaults to.
LOSS_2X2 = (("loss_recipe", "default"),)
DMAX_FILE = "dmax.json"
DK_HIST = "d_k/hist/"  # a metrics row's d_k histogram: d_k/hist/<d> = rollouts with d sub-calls
PARAMS_SUFFIX = ".params.json"
RUN_SUFFIX = ".run.json"  # a collected run's record: design, world, pool, wall time, realisations descended from
# The set's design: bumped whenever what a run trains changes, so a log of an earlier design is trained again
# (`to_train`) and never drawn beside this design's (`series`). Logs collected before records existed are the
# five-world set of 2026-12-03.
# 2026-12-05: the warm start runs 1,500 steps; eight-worlds-2026-12-04, the same with 500 steps, stopped after
# worlds 0-2 (experiments/figures/archive/warm500).
DESIGN = "eight-worlds-2026-12-05"
BASE_DESIGN = DESIGN  # `--stage2-steps N` runs the set as a design of its own: f"{BASE_DESIGN}+stage2-{N}"
EARLIER_DESIGN = "five-worlds-2026-12-03"
DMAX_FLAGS: dict[str, int | None] = {"low": None, "high": None}  # --d-low / --d-high: set D by hand


@dataclasses.dataclass(frozen=True)
class Run:
    name: str
    mode: str
    stage: str
    seed: int = 0
    init: str | None = None  # the run whose final checkpoint starts this one
    overrides: tuple = ()  # (config key, value) pairs on top of the `figures` preset; "dmax:<arm>" resolved late
    after: tuple = ()  # runs that must finish before this one starts (besides `init`)

    @property
    def needs(self) -> tuple:
        return ((self.init,) if self.init else ()) + tuple(self.after)

    @property
    def world(self) -> int:
        """The world (`env.seed`) this run trains and is evaluated on: its seed's own."""
        return self.seed

    def command(self, root: str) -> list[str]:
        cmd = [sys.executable, os.path.join(REPO, "launch", "tpu_run.py"),
               f"--config={os.path.join(REPO, 'experiments', 'xbench.py')}:figures,{self.mode}",
               f"--workdir={workdir(root, self.name)}", f"--config.seed={self.seed}",
               f"--config.env.seed={self.world}", f"--config.stage={self.stage}"]
        if self.init:
            cmd.append(f"--config.init_checkpoint={workdir(root, self.init)}")
        cmd += [f"--config.{key}={resolve(root, value)}" for key, value in self.overrides]
        return cmd


def resolve(root: str, value):
    """An override's value; "dmax:low" / "dmax:high" become the D chosen from the stage-2 d_k histogram, and
    "curriculum:<s>" world s's question pool (`curriculum_file`)."""
    if isinstance(value, str) and value.startswith("dmax:"):
        return dmax_choice(root)[value.split(":", 1)[1]]
    if isinstance(value, str) and value.startswith("curriculum:"):
        return curriculum_file(root, int(value.split(":", 1)[1]))
    return value


def _stage2(evaluate: bool) -> tuple:
    """A stage-2 run's overrides: its length (`STAGE2_STEPS`), and no evaluations unless `evaluate`."""
    steps = (("train.steps", STAGE2_STEPS), ("train.eval_every", max(1, STAGE2_STEPS // 2))) if STAGE2_STEPS else ()
    return steps if evaluate else steps[:1] + NO_EVAL


def _registry(seeds=SEEDS) -> dict[str, Run]:
    warm = (("train.steps", 0), ("train.eval_at_start", False))
    runs = []
    for s in seeds:
        runs += [Run(f"warm_mgrpo_s{s}", "mgrpo", "stage1", s, overrides=warm),
                 Run(f"warm_single_s{s}", "single_agent", "stage1", s, overrides=warm),
                 Run(f"stage1_mgrpo_s{s}", "mgrpo", "stage1", s, f"warm_mgrpo_s{s}", NO_EVAL),
                 Run(f"stage1_single_s{s}", "single_agent", "stage1", s, f"warm_single_s{s}", NO_EVAL),
                 # The world's one stage-2 question pool: the mgrpo system's stage-1 checkpoint filters it, in twins.
                 Run(f"curriculum_s{s}", "mgrpo", "stage2", s, f"stage1_mgrpo_s{s}", FILTER_ONLY)]
    for mode in STAGE2_MODES:
        stage1 = "stage1_single" if mode == "single_agent" else "stage1_mgrpo"
        # Fig. 6 compares mgrpo with frozen_sub only; the other modes skip the (costly) avg@3 evaluations.
        overrides = _stage2(evaluate=mode in ("mgrpo", "frozen_sub"))
        runs += [_stage2_run(f"stage2_{mode}_s{s}", mode, s, f"{stage1}_s{s}", overrides) for s in seeds]
    dmax_worlds = tuple(f"stage2_mgrpo_s{s}" for s in SEEDS[:N_DMAX_WORLDS])
    for ablation, changes in ABLATIONS.items():
        after = dmax_worlds if ablation.startswith("dmax_") else ()  # D is chosen from their d_k histogram
        runs += [_stage2_run(f"abl_{ablation}_s{s}", "mgrpo", s, f"stage1_mgrpo_s{s}",
                             _stage2(evaluate=False) + changes, after) for s in seeds[:N_ABLATION_SEEDS]]
    evaluated = _stage2(evaluate=True)
    for s in seeds:  # one shared model for both roles (experiments/figures/shared_policy.py), and the 2 x 2's cells
        runs += [Run(f"warm_shared_s{s}", "shared_mgrpo", "stage1", s, overrides=warm),
                 Run(f"stage1_shared_s{s}", "shared_mgrpo", "stage1", s, f"warm_shared_s{s}", NO_EVAL),
                 _stage2_run(f"stage2_shared_mgrpo_s{s}", "shared_mgrpo", s, f"stage1_shared_s{s}",
                             evaluated + LOSS_2X2),
                 _stage2_run(f"stage2_matpo_s{s}", "matpo", s, f"stage1_shared_s{s}", evaluated + LOSS_2X2),
                 _stage2_run(f"stage2_distinct_matpo_s{s}", "mgrpo", s, f"stage1_mgrpo_s{s}",
                             evaluated + LOSS_2X2 + (("credit", "matpo"),)),
                 Run(f"warm_shared2x_s{s}", "shared_mgrpo", "stage1", s, overrides=warm + SHARED2X_OVERRIDES),
                 Run(f"stage1_shared2x_s{s}", "shared_mgrpo", "stage1", s, f"warm_shared2x_s{s}",
                     NO_EVAL + SHARED2X_OVERRIDES),
                 _stage2_run(f"stage2_shared2x_s{s}", "shared_mgrpo", s, f"stage1_shared2x_s{s}",
                             evaluated + LOSS_2X2 + SHARED2X_OVERRIDES),
                 _stage2_run(f"eval_single_agent_s{s}", "single_agent", s, f"stage2_single_agent_s{s}", EVAL_ONLY)]
    return {run.name: run for run in runs}


def _stage2_run(name: str, mode: str, s: int, init: str, overrides: tuple, after: tuple = ()) -> Run:
    """A stage-2 run of world `s` on the world's one question pool (`curriculum_s{s}`'s kept questions)."""
    return Run(name, mode, "stage2", s, init, overrides + ((CURRICULUM_KEY, f"curriculum:{s}"),),
               (f"curriculum_s{s}", *after))


RUNS = _registry()


def set_seeds(n: int) -> None:
    """Uses seeds 0..n-1 for every curve (the registry, `stage2()` and the figures follow)."""
    global SEEDS, RUNS
    if n < 1:
        raise ValueError(f"--seeds must be at least 1, got {n}")
    SEEDS = tuple(range(n))
    RUNS = _registry(SEEDS)


def set_stage2_steps(steps: int | None) -> None:
    """Gives every stage-2 run `steps` steps (None: the preset's `train.steps`), as a design of its own: runs of
    another length train again (`to_train`) and are never drawn beside these (`series`)."""
    global STAGE2_STEPS, DESIGN, RUNS
    if steps is not None and steps < 2:
        raise ValueError(f"--stage2-steps must be at least 2 (evaluations at its start, middle and end), got {steps}")
    STAGE2_STEPS = steps
    DESIGN = BASE_DESIGN if steps is None else f"{BASE_DESIGN}+stage2-{steps}"
    RUNS = _registry(SEEDS)


def workdir(root: str, name: str) -> str:
    return os.path.abspath(os.path.join(root, name))


def is_done(root: str, name: str) -> bool:
    """Whether the run finished (every stop writes summary.json; only a finished run's says so). A summary being
    written by a running job reads as not finished."""
    try:
        with open(os.path.join(workdir(root, name), "summary.json")) as f:
            return json.load(f).get("run", {}).get("status") == "finished"
    except (OSError, ValueError):
        return False


def metrics_log(root: str, name: str) -> str:
    """The run's metrics: its workdir's when it finished under `root`, else its collected log (a set resumed on
    another machine holds no workdir for the runs collected before)."""
    if is_done(root, name):
        return os.path.join(workdir(root, name), "metrics.jsonl")
    return os.path.join(LOGS, f"{name}.jsonl")


def lineage(names) -> list[str]:
    """`names` and every run they start from or wait for, those first."""
    order: list[str] = []

    def visit(name):
        if name not in RUNS:
            raise KeyError(f"unknown run {name!r}; runs are {sorted(RUNS)}")
        for parent in RUNS[name].needs:
            visit(parent)
        if name not in order:
            order.append(name)

    for name in names:
        visit(name)
    return order


def descendants(name: str) -> int:
    """How many runs need `name`, directly or not (the scheduler starts the most needed runs first)."""
    children = [r.name for r in RUNS.values() if name in r.needs]
    return len(children) + sum(descendants(c) for c in children)


# -- D for the d_max ablation ---------------------------------------------------------------------------------


def dmax_from_counts(counts, preset: int) -> dict:
    """D below and above both the 99th percentile of d_k and the `preset` D the default runs use, so that neither
    arm repeats them: low = max(1, min(p99, preset) - 1), high = max(p99, preset) + 2."""
    counts = np.asarray(counts, np.int64)
    p99 = stats.count_percentile(counts, 0.99)
    return {"p99": p99, "p99_open_ended": bool(p99 == len(counts) - 1), "low": max(1, min(p99, preset) - 1),
            "high": max(p99, preset) + 2, "preset": preset, "counts": counts.tolist()}


def preset_value(path: str):
    """A setting of the `figures` preset (what the default stage-2 runs used)."""
    from mgrpo_jax.config import get_config

    value = get_config("xbench", "figures")
    for part in path.split("."):
        value = value[part]
    return value


def dmax_choice(root: str) -> dict:
    """The D values of the d_max ablation, fixed once in `<root>/dmax.json` (so resumed runs keep them).

    Computed from the d_k histogram over every step of the `stage2_mgrpo_s*` runs of the first `N_DMAX_WORLDS`
    worlds (their workdirs, or their collected logs), unless `--d-low` /
    `--d-high` set them; a flag that disagrees with a choice already used by a started run is an error.
    """
    path = os.path.join(root, DMAX_FILE)
    collected = os.path.join(LOGS, DMAX_FILE)
    choice = None
    for kept in (path, collected):
        if choice is None and os.path.exists(kept):
            with open(kept) as f:
                choice = json.load(f)
            if choice.get("design") != DESIGN:  # another design's runs chose it (the five-world set: from s0-s4)
                print(f"[figures] ignoring {kept}: chosen for the set's design {choice.get('design')!r}, not "
                      f"{DESIGN!r}", flush=True)
                choice = None
    if choice is None:
        names = [f"stage2_mgrpo_s{s}" for s in SEEDS[:N_DMAX_WORLDS]]
        missing = [n for n in names if not (is_done(root, n) or has_current_log(n))]
        if missing:
            raise RuntimeError(f"D for the d_max ablation comes from runs {missing}, which are not finished")
        rows = {n: [r for r in read_jsonl(metrics_log(root, n)) if f"{DK_HIST}0" in r] for n in names}
        choice = {**dmax_from_counts(stats.summed_counts(rows, DK_HIST), preset_value("rollout.d_max")),
                  "from_runs": names, "source": "data", "design": DESIGN}
    for arm, value in DMAX_FLAGS.items():
        if value is None or value == choice[arm]:
            continue
        started = [n for n in RUNS if n.startswith(f"abl_dmax_{arm}_") and os.path.exists(workdir(root, n))]
        if started:
            raise RuntimeError(f"--d-{arm}={value}, but {started} already ran with D = {choice[arm]}; "
                               f"remove those workdirs and {path} to change it")
        choice[arm] = value
        choice["source"] = "flags"
    os.makedirs(root, exist_ok=True)
    with open(path, "w") as f:
        json.dump(choice, f, indent=1, sort_keys=True)
    return choice


# -- running ----------------------------------------------------------------------------------------------------


def curriculum_file(root: str, s: int) -> str:
    """World s's question pool: the filter run's curriculum.json, or its collected copy (`logs/`)."""
    name = f"curriculum_s{s}"
    if is_done(root, name):
        return os.path.join(workdir(root, name), "curriculum.json")
    return os.path.join(LOGS, f"{name}.curriculum.json")


def collect_log(root: str, name: str) -> str:
    """Copies a finished run's metrics (and its stage-2 curriculum, if any) next to the figures."""
    os.makedirs(LOGS, exist_ok=True)
    src = os.path.join(workdir(root, name), "metrics.jsonl")
    dst = os.path.join(LOGS, f"{name}.jsonl")
    shutil.copyfile(src, dst)
    curriculum = os.path.join(workdir(root, name), "curriculum.json")
    kept_pool, collected = os.path.join(LOGS, f"{name}.curriculum.json"), [dst]
    if os.path.exists(curriculum):
        with open(curriculum) as f:
            kept = json.load(f)
        if not name.startswith("curriculum_s"):  # a world's pool keeps its ids: later runs train on them
            kept["kept"] = len(kept["kept"])  # the count; the ids are regenerated from the seed
        with open(kept_pool, "w") as f:
            json.dump(kept, f, indent=1, sort_keys=True)
        collected.append(kept_pool)
    if name.startswith("abl_dmax_") and os.path.exists(os.path.join(root, DMAX_FILE)):
        shutil.copyfile(os.path.join(root, DMAX_FILE), os.path.join(LOGS, DMAX_FILE))
    summary_path = os.path.join(workdir(root, name), "summary.json")
    summary = json.load(open(summary_path)) if os.path.exists(summary_path) else {}
    record = {"design": DESIGN, "world": RUNS[name].world if name in RUNS else None,
              "wall_time_s": summary.get("run", {}).get("wall_time_s"), "pool_hash": summary.get("env/pool_hash"),
              "log_hash": file_hash(*collected),
              "parents": {p: record_of(p).get("log_hash") for p in (RUNS[name].needs if name in RUNS else ())}}
    with open(os.path.join(LOGS, f"{name}{RUN_SUFFIX}"), "w") as f:
        json.dump(record, f, indent=1, sort_keys=True)
    counts = param_counts(workdir(root, name))
    if counts:
        with open(os.path.join(LOGS, f"{name}{PARAMS_SUFFIX}"), "w") as f:
            json.dump(counts, f, indent=1, sort_keys=True)
    return dst


def param_counts(run_dir: str) -> dict[str, int]:
    """{learner: parameter count} from a workdir's `agents/<learner>/model_config.json` ({} when it has none)."""
    from mgrpo_jax.model.shapes import ModelConfig

    fields = {f.name for f in dataclasses.fields(ModelConfig)}
    agents, counts = os.path.join(run_dir, "agents"), {}
    for learner in sorted(os.listdir(agents)) if os.path.isdir(agents) else ():
        path = os.path.join(agents, learner, "model_config.json")
        if not os.path.exists(path):
            continue
        with open(path) as f:
            saved = json.load(f)
        config = {k: tuple(v) if isinstance(v, list) else v for k, v in saved.items() if k in fields}
        counts[learner] = int(ModelConfig(**config).num_params())
    return counts


def _owner(root: str, name: str) -> int | None:
    """The pid of a live process training `name` (its `<root>/<name>.pid`), or None. Where the system shows command
    lines (/proc), a live pid whose command does not name the run's workdir is no owner: the file outlived its
    process (an invocation killed before removing it) and the system gave the pid to another program."""
    try:
        with open(os.path.join(root, f"{name}.pid")) as f:
            pid = int(f.read().strip())
        os.kill(pid, 0)
        if os.path.isdir("/proc") and workdir(root, name).encode() not in _command_line(pid):
            return None
    except (FileNotFoundError, ValueError, ProcessLookupError):
        return None
    return pid


def _command_line(pid: int, settle_s: float = 1.0) -> bytes:
    """`/proc/<pid>/cmdline` (FileNotFoundError once the process is gone). Popen returns when the child's exec closes
    its close-on-exec pipe, a moment before the kernel records the new arguments: a process that has just started
    reads empty for a while, so an empty line is read again (a kernel thread, never given one, stays empty)."""
    deadline = time.monotonic() + settle_s
    while True:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            line = f.read()
        if line or time.monotonic() > deadline:
            return line
        threading.Event().wait(0.01)  # not time.sleep, which tests of the scheduler replace


def trained_elsewhere(root: str, mine) -> int:
    """How many unfinished runs under `root` another live process is training (not those of `mine`)."""
    names = [f[:-len(".pid")] for f in os.listdir(root) if f.endswith(".pid")] if os.path.isdir(root) else []
    return sum(1 for n in names if n not in mine and not is_done(root, n) and _owner(root, n))


def to_train(names, root: str) -> list[str]:
    """The runs of `lineage(names)` that must train here, parents first.

    A run trains unless it finished under `root` or its log is collected for this `DESIGN` (`logs/<run>.jsonl` and
    its record, committed): the whole set resumes from the committed logs on another machine. A run that is
    collected but not finished here still trains when a run that trains starts from its checkpoint (`init`), which
    only a finished workdir holds; the runs a run waits for (`after`) need only be finished or collected.

    A run trained again is another realisation (lineages are not bit-reproducible), so every run of the lineage
    that starts from it or waits for it, and is not finished here, trains again too: its collected log descends
    from a checkpoint (or a question pool) that no longer exists, and would be paired with runs that do not."""
    order = lineage(names)
    train = {n for n in order if not is_done(root, n) and not has_current_log(n)}
    while True:  # until nothing changes: each rule can bring in runs the other one then reaches
        grown = set(train)
        for name in reversed(order):  # children first: a checkpoint a trained run starts from must be here
            if not is_done(root, name) and any(RUNS[child].init == name for child in grown):
                grown.add(name)
        for name in order:  # parents first: a lineage trained again takes every generation below it along
            if not is_done(root, name) and any(parent in grown for parent in RUNS[name].needs):
                grown.add(name)
        if grown == train:
            return [n for n in order if n in train]
        train = grown


def ready(name: str, root: str, training) -> bool:
    """Whether `name` can start: its init run finished here, and every run it waits for finished or collected
    (and not about to train again)."""
    run = RUNS[name]
    if run.init and not is_done(root, run.init):
        return False
    return all(is_done(root, p) or (has_current_log(p) and p not in training) for p in run.after)


def ensure(names, root: str, jobs: int = 2) -> None:
    """Trains the runs of `names` (and those they need) that `to_train` names, up to `jobs` at a time, and
    collects each one's log as it finishes.

    World by world: of the runs ready to start, the lowest world goes first, and within it those that more runs
    need (the chain of warm start, stage 1 and stage 2 before the leaves), so an interrupted set leaves whole
    worlds collected. A run already being trained by another invocation (a live pid in `<root>/<run>.pid`) is
    waited for, not started twice, so figure scripts can be started side by side; `jobs` counts those runs too, so
    side by side they share one budget rather than each taking `jobs` cores' worth.
    """
    todo = to_train(names, root)
    again = [n for n in todo if has_log(n)]
    other_design = [n for n in again if design(n) != DESIGN]
    for names_, why in ((other_design, f"logged under another design than {DESIGN!r}"),
                        ([n for n in again if n not in other_design],
                         "of a lineage trained again here (a run that trains starts from them, or from their parent)")):
        if names_:
            print(f"[figures] {len(names_)} collected runs train again, {why}: {by_kind(names_)}", flush=True)
    training = set(todo)
    rank = {n: (RUNS[n].world, -descendants(n), i) for i, n in enumerate(todo)}
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
            collect_log(root, name)
            training.discard(name)
            print(f"[figures] {name} done in {time.monotonic() - start:.0f} s", flush=True)
        finished = [n for n in todo if is_done(root, n)]  # some may have been finished by another invocation
        for name in finished:
            collect_log(root, name)
            training.discard(name)
        todo = [n for n in todo if n not in finished]
        startable = sorted((n for n in todo if ready(n, root, training) and not _owner(root, n)),
                           key=rank.__getitem__)
        while startable and len(running) + trained_elsewhere(root, running) < jobs:
            name = startable.pop(0)
            todo.remove(name)
            command = RUNS[name].command(root)
            print(f"[figures] starting {name}", flush=True)
            log = open(os.path.join(root, f"{name}.log"), "a")
            proc = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, cwd=REPO)
            with open(os.path.join(root, f"{name}.pid"), "w") as f:
                f.write(str(proc.pid))
            running[name] = (proc, time.monotonic())
        waiting = [n for n in todo if _owner(root, n) or not ready(n, root, training)]
        if (not running and todo and not startable  # startable but not started: the budget is another's, for now
                and not any(_owner(root, n) for n in lineage(todo) if not is_done(root, n))):
            raise RuntimeError(f"runs {todo} cannot start: a run they need is neither finished nor running")
        if running or waiting or startable:
            time.sleep(2)
    for name in lineage(names):
        if is_done(root, name):
            collect_log(root, name)


def parse_args(description: str, argv=None, parser: argparse.ArgumentParser | None = None) -> argparse.Namespace:
    """The figure scripts' common flags; `--seeds`, `--stage2-steps`, `--d-low` and `--d-high` take effect here."""
    parser = parser or argparse.ArgumentParser(description=description,
                                               formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--root", default=os.path.join(REPO, "runs", "figures"), help="where the runs live")
    parser.add_argument("--jobs", type=int, default=2, help="runs trained at the same time")
    parser.add_argument("--plot-only", action="store_true", help="draw from experiments/figures/logs only")
    parser.add_argument("--seeds", type=int, default=N_SEEDS, help=f"seeds per curve (default {N_SEEDS})")
    parser.add_argument("--d-low", type=int, default=None, help="D below the 99th percentile (default: from data)")
    parser.add_argument("--d-high", type=int, default=None, help="D above the 99th percentile (default: from data)")
    parser.add_argument("--stage2-steps", type=int, default=None,
                        help="every stage-2 run's length (default: the preset's train.steps); a design of its own")
    args = parser.parse_args(argv)
    set_stage2_steps(args.stage2_steps)
    set_seeds(args.seeds)
    DMAX_FLAGS.update(low=args.d_low, high=args.d_high)
    return args


# -- reading logs -------------------------------------------------------------------------------------------


def params(name: str) -> dict[str, int] | None:
    """A run's collected {learner: parameter count} (`logs/<run>.params.json`), or None if it has none."""
    path = os.path.join(LOGS, f"{name}{PARAMS_SUFFIX}")
    if not os.path.exists(path):
        return None
    with open(path) as f:
        return json.load(f)


def has_log(name: str) -> bool:
    return os.path.exists(os.path.join(LOGS, f"{name}.jsonl"))


def file_hash(*paths: str) -> str:
    """A collected run's fingerprint (16 hex digits of the SHA-256 of its files, in order): which realisation of
    the run it is. A question-pool filter logs no metrics; its pool (`<run>.curriculum.json`) tells instead."""
    digest = hashlib.sha256()
    for path in paths:
        with open(path, "rb") as f:
            digest.update(f.read())
    return digest.hexdigest()[:16]


def record_of(name: str) -> dict:
    """A collected run's record (`logs/<run>.run.json`), {} without one."""
    path = os.path.join(LOGS, f"{name}{RUN_SUFFIX}")
    if not os.path.exists(path):
        return {}
    with open(path) as f:
        return json.load(f)


def design(name: str) -> str:
    """The set's design a collected log belongs to (`DESIGN` of its record; `EARLIER_DESIGN` without one)."""
    return record_of(name).get("design", EARLIER_DESIGN)


def stale_parents(name: str) -> list[str]:
    """The runs `name` started from or waited for whose collected log is no longer the realisation it descends
    from (its record's `parents` hashes against theirs now). Records without hashes (collected before they
    were kept) cannot tell and name none."""
    recorded = record_of(name).get("parents") or {}
    return [p for p, h in recorded.items() if h is not None and record_of(p).get("log_hash") not in (None, h)]


def stale_ancestry(name: str) -> dict[str, list[str]]:
    """{run: its stale parents} over `name` and the ancestors its records name, those with any: a log whose
    grandparent was trained again is no more current than its parent."""
    stale, seen, todo = {}, set(), [name]
    while todo:
        run = todo.pop()
        if run in seen:
            continue
        seen.add(run)
        parents = stale_parents(run)
        if parents:
            stale[run] = parents
        todo += [p for p in record_of(run).get("parents") or {} if has_log(p)]
    return stale


def has_current_log(name: str) -> bool:
    """A collected log of this `DESIGN` that descends from the collected realisations of its ancestors."""
    return has_log(name) and design(name) == DESIGN and not stale_ancestry(name)


def kind_of(name: str) -> str:
    """A run's kind: its name without its world ("stage2_mgrpo_s3" -> "stage2_mgrpo")."""
    return name.rsplit("_s", 1)[0]


def by_kind(names) -> str:
    """Run names in short, by kind: "stage2_mgrpo x8, curriculum x1"."""
    counts = collections.Counter(kind_of(name) for name in names)
    return ", ".join(f"{kind} x{n}" for kind, n in counts.items())


def progress(root: str) -> dict[str, dict]:
    """Where this design's set stands under `root`, by run kind: {kind: {"runs", "collected", "running", "to_train",
    "mean_s"}}, `mean_s` the kind's mean recorded wall time (this design's records, else any design's; None without
    one). Collected counts this design's current logs; a run finished here is collected as the set goes on."""
    todo = set(to_train(list(RUNS), root))
    kinds: dict[str, dict] = {}
    for name in RUNS:
        kind = kinds.setdefault(kind_of(name), {"runs": 0, "collected": 0, "running": 0, "to_train": 0})
        kind["runs"] += 1
        kind["collected"] += has_current_log(name)
        kind["running"] += bool(_owner(root, name)) and not is_done(root, name)
        kind["to_train"] += name in todo
    current = wall_times([n for n in RUNS if has_current_log(n)])
    every = wall_times(list(RUNS))
    for kind, row in kinds.items():
        row["mean_s"] = (current.get(kind) or every.get(kind) or {}).get("mean_s")
    return kinds


def wall_times(names) -> dict[str, dict]:
    """Wall time per run kind (the name without its world) over the collected runs of `names` that recorded it:
    {kind: {"runs", "mean_s", "max_s", "total_s"}}."""
    kinds: dict[str, list[float]] = {}
    for name in names:
        path = os.path.join(LOGS, f"{name}{RUN_SUFFIX}")
        if os.path.exists(path):
            with open(path) as f:
                seconds = json.load(f).get("wall_time_s")
            if seconds is not None:
                kinds.setdefault(kind_of(name), []).append(float(seconds))
    return {kind: {"runs": len(t), "mean_s": float(np.mean(t)), "max_s": float(np.max(t)), "total_s": float(sum(t))}
            for kind, t in sorted(kinds.items())}


def rl_rows(name: str) -> list[dict]:
    """The RL-step rows of a run's committed log (warm-start rows dropped)."""
    path = os.path.join(LOGS, f"{name}.jsonl")
    if not os.path.exists(path):
        raise FileNotFoundError(f"{path}: run {name} has no collected log; run the figure without --plot-only")
    return [row for row in read_jsonl(path) if "step" in row]


def series(names, key: str) -> tuple[np.ndarray, np.ndarray]:
    """(steps, values [len(names), steps]) of `key` over the steps every run logged it."""
    designs = {n: design(n) for n in names}
    if len(set(designs.values())) > 1:
        raise ValueError(f"runs {list(names)} were collected under different designs of the set ({designs}): "
                         f"finish this design's runs before drawing, or draw the earlier set from its own logs")
    stale = {n: ancestry for n in names if (ancestry := stale_ancestry(n))}
    if stale:
        raise ValueError(f"runs {sorted(stale)} descend from runs whose parents were trained again since ({stale}): "
                         f"train them again (the figure without --plot-only) before drawing them")
    per_run = [{row["step"]: row[key] for row in rl_rows(n) if key in row} for n in names]
    steps = sorted(set.intersection(*(set(d) for d in per_run)))
    if not steps:
        raise ValueError(f"runs {list(names)} share no step logging {key!r}")
    return np.asarray(steps), np.asarray([[d[s] for s in steps] for d in per_run], np.float64)


def mean_std(values: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Mean and standard deviation over runs (rows) at each point; the std with ddof = 1 (0 for one run)."""
    values = np.asarray(values, np.float64)
    std = values.std(axis=0, ddof=1) if len(values) > 1 else np.zeros(values.shape[1:])
    return values.mean(axis=0), std


def final(values: np.ndarray, last: int = 1) -> tuple[float, float]:
    """Mean and std (ddof = 1) over runs of each run's mean over its `last` logged points."""
    per_run = np.asarray(values, np.float64)[:, -last:].mean(axis=1)
    return float(per_run.mean()), stats.sample_std(per_run)


def band(ax, steps, values, label: str, color=None, ema: float | None = None, raw_alpha: float = 0.25) -> None:
    """Mean over seeds with a +-1 std band; with `ema`, the raw mean thin and its EMA thick."""
    mean, std = mean_std(values)
    if ema is None:
        line = ax.plot(steps, mean, label=label, color=color, marker="o" if len(steps) < 8 else None)[0]
    else:
        line = ax.plot(steps, mean, color=color, alpha=raw_alpha, linewidth=1)[0]
        ax.plot(steps, ema_curve(mean, ema), color=line.get_color(), linewidth=2, label=f"{label} (EMA {ema})")
    ax.fill_between(steps, mean - std, mean + std, color=line.get_color(), alpha=0.15, linewidth=0)


def shade_window(ax, window_steps, label: str = "last window (claims)", alpha: float = 0.08) -> None:
    """Greys the window the claims are measured over."""
    lo, hi = window_steps
    ax.axvspan(lo - 0.5, hi + 0.5, color="0.5", alpha=alpha, linewidth=0, label=label)


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


def summary(steps, values) -> dict:
    """A curve's numbers: mean and std over seeds of each seed's first- and last-window mean, and the window."""
    first, first_at = stats.first_window(steps, values)
    last, last_at = stats.last_window(steps, values)
    return {"n_seeds": int(len(values)), "window": last_at["window"], "first_window_steps": first_at["window_steps"],
            "last_window_steps": last_at["window_steps"], "first": [float(first.mean()), stats.sample_std(first)],
            "last": [float(last.mean()), stats.sample_std(last)], "steps": [int(s) for s in steps]}


def compare(ax, groups: dict, ema: float | None = 0.8) -> tuple[dict, dict]:
    """Plots each labelled group of runs, `{label: (run names, metric key)}`, as a mean +-1 std band (with its
    EMA unless `ema` is None) and greys the last window. Returns ({label: summary}, {label: (steps, values)}),
    the summaries with "identical": [[labels]] (curves that coincide at every step)."""
    out, curves = {}, {}
    for label, (names, key) in groups.items():
        steps, values = series(names, key)
        band(ax, steps, values, label, ema=ema)
        out[label] = summary(steps, values)
        curves[label] = (steps, values)
    shade_window(ax, next(iter(out.values()))["last_window_steps"])
    out["identical"] = note_identical(ax, {label: values for label, (_, values) in curves.items()})
    ax.legend(fontsize=8)
    return out, curves


def compare_panels(axes, keys, groups, ema: float | None = 0.8) -> tuple[dict, dict]:
    """One `compare` panel per metric key. `groups(key)` gives `{mode: (label, run names, metric key)}`.

    Returns ({"<mode>/<key>": summary, "identical/<key>": [[labels]]}, {"<mode>/<key>": (steps, values)}).
    """
    results, curves = {}, {}
    for ax, key in zip(axes, keys, strict=True):
        panel = groups(key)
        out, drawn = compare(ax, {label: (names, metric) for label, names, metric in panel.values()}, ema)
        for mode, (label, _, _) in panel.items():
            results[f"{mode}/{key}"] = out[label]
            curves[f"{mode}/{key}"] = drawn[label]
        results[f"identical/{key}"] = out["identical"]
    return results, curves


def worlds(names) -> list[int]:
    """The world (`env.seed`) of each run of `names`, in order: what a results entry records per arm."""
    return [RUNS[name].world for name in names]


def window_claim(text: str, a: tuple, b: tuple, *, claimed: bool = True, **kw) -> dict:
    """A claimed ordering A > B (or, `claimed=False`, an ablation's which-is-higher) over the last window.

    `a` and `b` are (label, steps, values [seeds, points], metric); each seed's mean over its arm's last window
    is one value, and `stats.compare` gives the difference of means, its bootstrap 95 % interval, the exact
    permutation p-value, the t-interval and the verdict under the pre-stated rule (`stats.VERDICT_RULE`).
    """
    (label_a, steps_a, values_a, metric_a), (label_b, steps_b, values_b, metric_b) = a, b
    per_a, at_a = stats.last_window(steps_a, values_a)
    per_b, at_b = stats.last_window(steps_b, values_b)
    if at_a != at_b:
        raise ValueError(f"{label_a} and {label_b} have different last windows: {at_a} vs {at_b}")
    result = stats.compare(per_a, per_b, (label_a, label_b), claimed=claimed, **kw)
    return {"claim": text, "metric": {label_a: metric_a, label_b: metric_b}, **at_a, **result}


def rise_claim(text: str, label: str, steps, values, metric: str, **kw) -> dict:
    """The claim "the curve rises": each seed's last-window mean against its own first-window mean (paired)."""
    first, at_first = stats.first_window(steps, values)
    last, at_last = stats.last_window(steps, values)
    result = stats.compare(last, first, ("last window", "first window"), paired=True, **kw)
    return {"claim": text, "metric": {"last window": metric, "first window": metric}, "curve": label,
            "window": at_last["window"], "window_steps": at_last["window_steps"],
            "first_window_steps": at_first["window_steps"], **result}


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
    import matplotlib.pyplot as plt

    plt.close(fig)
    print(f"[figures] wrote {os.path.relpath(path, REPO)}")
    return path


def save_results(figure: str, results: dict, arms: dict | None = None) -> str:
    """Writes a figure's numbers to experiments/figures/results/<figure>.json (the README quotes them).

    `arms` ({label: run names}): each arm's runs and their worlds, recorded under "runs" and, in every claim
    that compares that arm, under the claim's "world_seeds"."""
    if arms:
        results["runs"] = {label: {"names": list(names), "world_seeds": worlds(names)} for label, names in arms.items()}
        for claim in results.get("claims", []) + results.get("comparisons", []):
            matched = {label: worlds(arms[label]) for label in claim["order"] if label in arms}
            claim["world_seeds"] = matched or {label: worlds(names) for label, names in arms.items()}
    out_dir = os.path.join(HERE, "results")
    os.makedirs(out_dir, exist_ok=True)
    path = os.path.join(out_dir, f"{figure}.json")
    with open(path, "w") as f:
        json.dump(results, f, indent=1, sort_keys=True)
    for claim in results.get("claims", []) + results.get("comparisons", []):
        (lo, hi), (t_lo, t_hi) = claim["ci95"], claim["t_interval"]
        print(f"[figures] {figure}: {claim['claim']}: diff {claim['diff']:+.4f}, bootstrap [{lo:+.4f}, {hi:+.4f}], "
              f"t [{t_lo:+.4f}, {t_hi:+.4f}], p {claim['p_value']:.4f} ({claim['p_alternative']}) over "
              f"{claim['n_seeds']} seeds: {claim['verdict']}")
    print(f"[figures] wrote {os.path.relpath(path, REPO)}")
    return path


def stage2(mode: str) -> list[str]:
    return [f"stage2_{mode}_s{s}" for s in SEEDS]


def ablation(name: str) -> list[str]:
    return [f"abl_{name}_s{s}" for s in SEEDS[:N_ABLATION_SEEDS]]


def top_name(mode: str) -> str:
    return "single" if mode == "single_agent" else "main"
