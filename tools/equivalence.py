"""Behaviour equivalence across a restructuring (issue 35: mgrpo_jax/train/* -> mgrpo_jax/agent|runtime|rl/*).

Run from the repository root, before and after the change, then compare:

    python tools/equivalence.py hlo --out before_hlo.json
    python tools/equivalence.py metrics --out before_metrics.json [--workdir DIR]
    ... restructure ...
    python tools/equivalence.py hlo --out after_hlo.json
    python tools/equivalence.py metrics --out after_metrics.json
    python tools/equivalence.py compare before_hlo.json after_hlo.json          # exit 1 on any difference
    python tools/equivalence.py compare before_metrics.json after_metrics.json

Both layouts import through `_module`, which tries each module's new path (mgrpo_jax.agent / runtime / rl) and
then its old one (mgrpo_jax.train), so the same script measures the old and the new package.

`hlo`: {name: sha256 of the lowered StableHLO text} of the jitted programs the trainer runs, lowered (never
compiled) on 4 fake CPU devices (so the batch and parameter shardings appear in the text):
  - each learner's policy (RL) step and warm-start (SFT) step, built the way the trainer builds them
    (`build_agents`, then `Learner.start_sft`), for the `smoke` preset's variants `VARIANTS`; with KL also the
    frozen reference's log-prob function;
  - the credit kernels `mgrpo_targets` and `matpo_targets` (mgrpo_jax/core) on small [Q, K, C] inputs.
The text is `Lowered.as_text(debug_info=False)` with any remaining `loc(...)` location stripped, so it names no
file path or line number: moving a function to another file leaves its hash unchanged.

`metrics`: short `smoke` runs (seed 0; a 1-step warm start, 2 RL steps, the evaluation at step 2, a checkpoint per
step) of every mode and of the decoupled mode (a `--role=main` and a `--role=sub` process over a file:// store),
each started as its own process through `launch/tpu_run.py` (`RUNS`). A `smoke` agent never delegates and never
keeps the format on its own, so every reward would be 0, every advantage 0 and the sub-agent would never train:
the runs other than `mgrpo_plain` (the launcher as users run it) script some turns (`_Scripted`: the main agent's
first turn is a delegation, as tests/*/scripted_launch.py scripts it; every other turn of an even row is a final
answer), so rewards differ within each group and both agents train on non-zero advantages. For each run: its
`metrics.jsonl` records without the keys `_VOLATILE` matches, and the sha256 of those records. Every process gets
one CPU device (XLA_FLAGS removed). `--only NAME,...` runs a subset of `RUNS`.

Keys left out of the metrics records (`_VOLATILE`): those of wall-clock time, which differ between two identical
runs; nothing else does (two `metrics` runs on the baseline, commit c42f2b6, gave identical hashes for every run):
  time            the record's unix time stamp;
  time/*          seconds spent in each phase of a step (sampling, tools, rewards, training, step, other);
  throughput/*    episodes and generated tokens per wall-clock second.

`compare A B`: exit status 1 with the names whose hashes differ (for metrics the first differing record, key and
values) or that only one file has; 0 when everything is equal.
"""

from __future__ import annotations

import argparse
import hashlib
import importlib
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time


def _repo() -> str:
    """The checkout to measure: the current directory when it is one (so this file can measure another worktree,
    e.g. `cd /old/checkout && python /new/checkout/tools/equivalence.py ...`), else the one holding this file."""
    here = os.getcwd()
    if os.path.isfile(os.path.join(here, "launch", "tpu_run.py")) and os.path.isdir(os.path.join(here, "mgrpo_jax")):
        return here
    return os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


REPO = _repo()
sys.path.insert(0, REPO)

# ---- the two layouts ----

# short name -> the module paths that hold it, newest layout first (/work/layout-plan.md; `build`: build_agents,
# distinct_learners and SHARED, in agent/build.py since issue 35 step 1, in train/system.py before)
MODULES = {
    "step": ("mgrpo_jax.agent.step", "mgrpo_jax.train.step"),
    "build": ("mgrpo_jax.agent.build", "mgrpo_jax.rl.system", "mgrpo_jax.train.system"),
    "trainer": ("mgrpo_jax.rl.trainer", "mgrpo_jax.train.trainer"),
}


def _module(name: str):
    """The module `name` of whichever layout this checkout has: the first of its paths that exists (the new layout's
    first). A module that exists but fails to import (a missing dependency of it) raises, rather than silently
    falling back to an older path."""
    paths = MODULES[name]
    for path in paths:
        try:
            return importlib.import_module(path)
        except ModuleNotFoundError as e:
            if e.name is None or not path.startswith(e.name):  # the module exists; something it imports does not
                raise
    raise ModuleNotFoundError(f"none of {paths} can be imported from {REPO}")


def _layout() -> str:
    return "new" if _module("trainer").__name__.startswith("mgrpo_jax.rl.") else "old"


def _sha256(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()


def _write_json(path: str, data) -> None:
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w") as f:
        json.dump(data, f, indent=1, sort_keys=True)
        f.write("\n")


# ---- hlo ----

HLO_DEVICES = 4  # main and sub get 2 devices each; a shared or single learner all 4
PRESET = "smoke"
# name -> (mode, {config field: value}); the overrides apply to every agent section the mode trains.
VARIANTS = {
    "mgrpo": ("mgrpo", {}),
    "mgrpo_kl_micro": ("mgrpo", {"loss_hparams.kl_coef": 0.01, "micro_batches": 2}),
    "mgrpo_gspo": ("mgrpo", {"loss": "gspo"}),
    "mgrpo_unsync": ("mgrpo_unsync", {}),
    "matpo": ("matpo", {}),
    "shared_mgrpo": ("shared_mgrpo", {}),
    "single_agent": ("single_agent", {}),
}
_LOC = re.compile(r"\s*loc\((?:[^()]|\([^()]*\))*\)")  # `loc(...)`, one level of nested parentheses
_LOC_DEFS = re.compile(r"^#loc\d*\s*=.*$\n?", re.MULTILINE)  # `#loc1 = loc("file.py":12:3)` alias lines


def _hlo_text(lowered) -> str:
    try:
        text = lowered.as_text(debug_info=False)
    except TypeError:  # an older jax without the keyword
        text = lowered.as_text()
    return _LOC.sub("", _LOC_DEFS.sub("", text))


def _variant_config(mode: str, overrides: dict):
    from mgrpo_jax.config import SHARED_MODES, get_config, validate

    config = get_config("xbench", f"{PRESET},{mode}")
    sections = ("single",) if mode == "single_agent" else ("main",) if mode in SHARED_MODES else ("main", "sub")
    for section in sections:
        for field, value in overrides.items():
            node = config[section]
            *parents, last = field.split(".")
            for part in parents:
                node = node[part]
            node[last] = value
    validate(config)
    return config


def _abstract_batch(keys, rows: int, length: int) -> dict:
    import jax
    import numpy as np

    two_d = {"tokens": np.int32, "positions": np.int32, "attention_mask": np.bool_, "loss_mask": np.float32,
             "old_logprobs": np.float32, "ref_logprobs": np.float32}
    return {k: jax.ShapeDtypeStruct((rows, length) if k in two_d else (rows,), two_d.get(k, np.float32))
            for k in keys}


class _Tokenizer:
    """What `build_agents` reads of the run's tokenizer (its vocabulary size and padding id), without training one
    on the world: the lowered programs depend on nothing else of it."""

    def __init__(self, vocab_size: int):
        self.vocab_size, self.pad_id = vocab_size, 0


def _agent_programs(name: str, mode: str, overrides: dict) -> dict[str, str]:
    from mgrpo_jax.config import rl_batch_rows

    step, build = _module("step"), _module("build")
    config = _variant_config(mode, overrides)
    agents = build.build_agents(config, _Tokenizer(config.tokenizer.vocab_size))
    out = {}
    for learner_name, learner in build.distinct_learners(agents).items():
        section = "main" if learner_name == getattr(build, "SHARED", "shared") else learner_name
        rows, length = rl_batch_rows(config, section), int(learner.config.context_tokens)
        keys = tuple(step.POLICY_KEYS) + (("ref_logprobs",) if learner.kl_coef > 0 else ())
        prefix = f"{name}/{learner_name}"
        batch = _abstract_batch(keys, rows, length)
        out[f"{prefix}/policy_step"] = _hlo_text(learner.policy_step.jitted.lower(learner.state, batch))
        reference = getattr(learner, "_reference_logprobs", None)
        if reference is not None:
            b = _abstract_batch(("tokens", "positions", "attention_mask", "temperature"), rows, length)
            out[f"{prefix}/reference_logprobs"] = _hlo_text(reference.jitted.lower(
                learner.reference_params, b["tokens"], b["positions"], b["attention_mask"], b["temperature"]))
        learner.start_sft(learner.config.sft)  # the warm start's optimizer and step, as the trainer builds them
        sft_batch = _abstract_batch(step.SFT_KEYS, int(config.warmstart.batch_size), length)
        out[f"{prefix}/sft_step"] = _hlo_text(learner.sft_step.jitted.lower(learner.state, sft_batch))
    return out


def _credit_programs() -> dict[str, str]:
    import jax
    import numpy as np

    from mgrpo_jax.config import get_config
    from mgrpo_jax.core import MatpoConfig, RolloutArrays, TargetsConfig, matpo_targets, mgrpo_targets

    q, k, c = 2, 4, 3  # queries, samples, raw sub-calls per rollout
    arrays = RolloutArrays(
        format_ok=jax.ShapeDtypeStruct((q, k), np.bool_), correct=jax.ShapeDtypeStruct((q, k), np.float32),
        sub_format_ok=jax.ShapeDtypeStruct((q, k, c), np.bool_),
        sub_expert=jax.ShapeDtypeStruct((q, k, c), np.float32), counts=jax.ShapeDtypeStruct((q, k), np.int32))
    key = jax.random.key(0)
    config = get_config("xbench", PRESET)
    duplicate, masked = TargetsConfig.from_config(config), TargetsConfig(d_max=2, align_mode="mask")
    return {"credit/mgrpo_targets/smoke": _hlo_text(mgrpo_targets.lower(arrays, key, config=duplicate)),
            "credit/mgrpo_targets/mask_d2": _hlo_text(mgrpo_targets.lower(arrays, key, config=masked)),
            "credit/matpo_targets/smoke": _hlo_text(
                matpo_targets.lower(arrays, key, config=MatpoConfig.from_config(config)))}


def command_hlo(args) -> int:
    os.environ["JAX_PLATFORMS"] = "cpu"
    os.environ["XLA_FLAGS"] = f"--xla_force_host_platform_device_count={HLO_DEVICES}"
    import jax

    if jax.device_count() != HLO_DEVICES:
        raise SystemExit(f"hlo: jax was initialised with {jax.device_count()} devices, need {HLO_DEVICES}")
    start = time.perf_counter()
    texts = _credit_programs()
    for name, (mode, overrides) in VARIANTS.items():
        texts.update(_agent_programs(name, mode, overrides))
        print(f"  {name}: lowered ({time.perf_counter() - start:.0f} s)", file=sys.stderr)
    for name, text in texts.items():
        if re.search(r"\.py\"?:\d+|loc\(", text):
            raise SystemExit(f"hlo: {name}'s text still holds a source location")
    if args.dump:
        os.makedirs(args.dump, exist_ok=True)
        for name, text in texts.items():
            with open(os.path.join(args.dump, name.replace("/", "__") + ".mlir"), "w") as f:
                f.write(text)
    _write_json(args.out, {name: _sha256(text) for name, text in sorted(texts.items())})
    print(f"hlo ({_layout()} layout): {len(texts)} programs -> {args.out} in {time.perf_counter() - start:.0f} s",
          file=sys.stderr)
    return 0


# ---- metrics ----

# Not deterministic between two identical runs: wall-clock time stamps, durations and rates.
_VOLATILE = re.compile(r"^(time|time/.*|throughput/.*)$")
STEPS = 2
COMMON_FLAGS = ("--config.warmstart.steps=1", f"--config.train.steps={STEPS}")
RUN_TIMEOUT_S = 900
# name -> (mode, the agents whose turns `_Scripted` scripts, the processes' --role flags). The sub-agent is scripted
# where it trains on its own rows (mgrpo, mgrpo_unsync, decoupled): its rewards then differ within a group. It keeps
# its decode slots in frozen_sub and in the shared-policy modes (where MATPO's credit gives its rows their parent's
# advantages anyway), and mgrpo_plain is the launcher as users run it, nothing scripted (no delegation: the main
# agent alone trains, on zero advantages).
RUNS = {
    "mgrpo_plain": ("mgrpo", "", ("colocated",)),
    "mgrpo": ("mgrpo", "main,sub", ("colocated",)),
    "frozen_sub": ("frozen_sub", "main", ("colocated",)),
    "single_agent": ("single_agent", "main", ("colocated",)),
    "mgrpo_unsync": ("mgrpo_unsync", "main,sub", ("colocated",)),
    "matpo": ("matpo", "main", ("colocated",)),
    "shared_mgrpo": ("shared_mgrpo", "main", ("colocated",)),
    "decoupled": ("mgrpo", "main,sub", ("main", "sub")),
}


def clean_records(path: str) -> list[dict]:
    with open(path) as f:
        records = [json.loads(line) for line in f if line.strip()]
    return [{k: v for k, v in r.items() if not _VOLATILE.match(k)} for r in records]


def _records_entry(path: str) -> dict:
    records = clean_records(path)
    return {"sha256": _sha256(json.dumps(records, sort_keys=True)), "records": records}


def _env() -> dict:
    env = dict(os.environ)
    env.pop("XLA_FLAGS", None)  # one CPU device per process
    env["JAX_PLATFORMS"] = "cpu"
    env["PYTHONPATH"] = REPO + os.pathsep + env.get("PYTHONPATH", "")
    return env


def _start(name: str, argv: list[str], scripted: str, logs: str) -> subprocess.Popen:
    launcher = [os.path.join(REPO, "launch", "tpu_run.py")]
    entry = [os.path.abspath(__file__), "_launch", scripted] if scripted else launcher
    log = open(os.path.join(logs, f"{name}.log"), "w")  # closed by _wait
    proc = subprocess.Popen([sys.executable, *entry, *argv], cwd=REPO, env=_env(), stdout=log, stderr=subprocess.STDOUT)
    proc.log, proc.name = log, name
    return proc


def _wait(*procs: subprocess.Popen) -> None:
    deadline = time.monotonic() + RUN_TIMEOUT_S
    try:
        for proc in procs:
            try:
                code = proc.wait(timeout=max(1.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                code = "a timeout"
            if code != 0:
                proc.log.close()
                with open(proc.log.name) as f:
                    tail = f.read()[-4000:]
                raise SystemExit(f"metrics: run {proc.name} exited with {code}; its log ({proc.log.name}):\n{tail}")
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
            proc.log.close()


def command_metrics(args) -> int:
    workdir = os.path.abspath(args.workdir or tempfile.mkdtemp(prefix="equivalence-"))
    if os.path.exists(os.path.join(workdir, "runs")):
        shutil.rmtree(os.path.join(workdir, "runs"))  # a fresh start: a run resumes from what its workdir holds
    runs, logs = os.path.join(workdir, "runs"), os.path.join(workdir, "logs")
    os.makedirs(runs)
    os.makedirs(logs, exist_ok=True)
    names = args.only.split(",") if args.only else list(RUNS)
    unknown = [n for n in names if n not in RUNS]
    if unknown:
        raise SystemExit(f"metrics: unknown run(s) {unknown}; runs: {', '.join(RUNS)}")
    out, start = {}, time.perf_counter()
    for name in names:
        mode, scripted, roles = RUNS[name]
        t, run_dir = time.perf_counter(), os.path.join(runs, name)
        argv = [f"--config=experiments/xbench.py:{PRESET},{mode}", f"--workdir={run_dir}", *COMMON_FLAGS]
        if roles == ("colocated",):
            _wait(_start(name, argv, scripted, logs))
            out[name] = _records_entry(os.path.join(run_dir, "metrics.jsonl"))
        else:  # the decoupled mode: one process per role, sharing a file:// store
            argv += [f"--config.store=file://{run_dir}_store", "--config.decoupled.timeout_s=300"]
            _wait(*(_start(f"{name}_{role}", [*argv, f"--role={role}"], scripted, logs) for role in roles))
            for role in roles:
                out[f"{name}/{role}"] = _records_entry(os.path.join(run_dir, role, "metrics.jsonl"))
        print(f"  {name}: {time.perf_counter() - t:.0f} s", file=sys.stderr)
    _write_json(args.out, out)
    print(f"metrics ({_layout()} layout): {len(out)} runs -> {args.out} in {time.perf_counter() - start:.0f} s "
          f"(workdir {workdir})", file=sys.stderr)
    return 0


class _Scripted:
    """A sampler whose turns are partly scripted, so that a `smoke` run (whose barely trained agents never delegate
    and never keep the format) delegates and gets rewards that differ within a group (non-zero advantages):

      delegate  the main agent's first turn (a prompt with only the system and user messages) is a `delegate` call
                on every row (as tests/*/scripted_launch.py scripts it for the decoupled tests);
      answer    any other turn is a final answer on the even rows of each sampling call (K = 2 rollouts of a
                question sit side by side, so one of each pair keeps the format); odd rows are the model's own.

    Scripted tokens get the log-prob of a uniform policy, log(1 / vocabulary), close to what the barely trained
    model gives them, so the importance ratios stay near 1. A sampler wrapped here has no decode slots, so the
    engine runs its turns in lock-step (mgrpo_jax/rollout/engine.py); the unscripted agents keep their slots."""

    TASK = "Find the year the entity in the question was founded."

    def __init__(self, sampler, tokenizer, delegate: bool):
        import math

        from mgrpo_jax.env import protocol
        from mgrpo_jax.env.prompts import SYSTEM, USER

        self.sampler, self.delegate = sampler, delegate
        self.top_k, self.top_p = sampler.top_k, sampler.top_p  # the filters its sampled rows are drawn with
        self.eot = tokenizer.end_of_turn_id
        self.first_turn_eots = tokenizer.render_chat([(SYSTEM, "s"), (USER, "u")])[0].count(self.eot)
        call = protocol.render_tool_call("delegate", {"task": self.TASK, "context": ""})
        self.call = tokenizer.encode(call) + [self.eot]
        self.answer = tokenizer.encode(protocol.render_answer("unknown")) + [self.eot]
        self.logprob = -math.log(tokenizer.vocab_size)

    def _script(self, row: int, prompt) -> list[int] | None:
        if self.delegate and list(prompt).count(self.eot) == self.first_turn_eots:
            return self.call
        return self.answer if row % 2 == 0 else None

    def sample(self, prompts, *, max_new, budgets=None, **kwargs):
        import numpy as np

        out = self.sampler.sample(prompts, max_new=max_new, budgets=budgets, **kwargs)
        tokens, logprobs, lengths, stopped = (np.array(x) for x in out[:4])
        for row, prompt in enumerate(prompts):
            script = self._script(row, prompt)
            room = max_new if budgets is None else min(max_new, int(np.asarray(budgets).reshape(-1)[row]))
            if script is not None and len(script) <= room:
                tokens[row], logprobs[row] = 0, 0.0
                tokens[row, : len(script)] = script
                logprobs[row, : len(script)] = self.logprob
                lengths[row], stopped[row] = len(script), True
        return type(out)(tokens, logprobs, lengths, stopped, *out[4:])

    def update_weights(self, params):
        self.sampler.update_weights(params)


def command_launch(argv) -> int:
    """`launch/tpu_run.py` (the flags `argv[1:]`) with the turns of the agents `argv[0]` names (`main`, `sub`,
    comma-separated) scripted by `_Scripted`."""
    import runpy

    scripted = set(argv[0].split(","))
    trainer = _module("trainer").Trainer
    init = trainer.__init__

    def scripted_init(self, *args, **kwargs):
        init(self, *args, **kwargs)
        engine = getattr(self, "engine", None) or self.system.engine
        for name, runtime in (("main", engine.top), ("sub", engine.sub)):
            if name in scripted and runtime is not None and runtime.sampler is not None:
                tokenizer = getattr(runtime, "tokenizer", None) or self.tokenizer
                runtime.sampler = _Scripted(runtime.sampler, tokenizer, delegate=runtime.can_delegate)

    trainer.__init__ = scripted_init
    entry = os.path.join(REPO, "launch", "tpu_run.py")
    sys.argv = [entry, *argv[1:]]
    runpy.run_path(entry, run_name="__main__")
    return 0


# ---- compare ----


def _first_difference(before: list, after: list) -> str:
    for i, (a, b) in enumerate(zip(before, after, strict=False)):
        if a != b:
            where = f"record {i}" + (f" (step {a['step']})" if "step" in a else "")
            for key in sorted(set(a) | set(b)):
                if a.get(key, "<missing>") != b.get(key, "<missing>"):
                    return f"{where}: {key}: {a.get(key, '<missing>')!r} -> {b.get(key, '<missing>')!r}"
    return f"{len(before)} records -> {len(after)} records"


def command_compare(args) -> int:
    with open(args.before) as f:
        before = json.load(f)
    with open(args.after) as f:
        after = json.load(f)
    problems = []
    for name in sorted(set(before) | set(after)):
        if name not in after:
            problems.append(f"{name}: only in {args.before}")
        elif name not in before:
            problems.append(f"{name}: only in {args.after}")
        else:
            a, b = before[name], after[name]
            hash_a, hash_b = (a["sha256"], b["sha256"]) if isinstance(a, dict) else (a, b)
            if hash_a != hash_b:
                detail = f"{hash_a[:12]} -> {hash_b[:12]}"
                if isinstance(a, dict):
                    detail += f"; first difference: {_first_difference(a['records'], b['records'])}"
                problems.append(f"{name}: differs ({detail})")
    if problems:
        print(f"{len(problems)} of {len(set(before) | set(after))} differ:", *problems, sep="\n  ")
        return 1
    print(f"all {len(before)} equal")
    return 0


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["_launch"]:  # internal: one scripted run (command_metrics starts these)
        return command_launch(argv[1:])
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    commands = parser.add_subparsers(dest="command", required=True)
    hlo = commands.add_parser("hlo", help="sha256 of the lowered train steps and credit kernels")
    hlo.add_argument("--out", required=True)
    hlo.add_argument("--dump", help="also write each program's text to this folder (to diff two layouts)")
    metrics = commands.add_parser("metrics", help="short smoke runs of every mode; their cleaned metrics.jsonl")
    metrics.add_argument("--out", required=True)
    metrics.add_argument("--workdir", help="where the runs and their logs go (default: a new temporary folder)")
    metrics.add_argument("--only", help="comma-separated names of RUNS to run (default: all)")
    compare = commands.add_parser("compare", help="exit 1 if two result files differ")
    compare.add_argument("before")
    compare.add_argument("after")
    args = parser.parse_args(argv)
    return {"hlo": command_hlo, "metrics": command_metrics, "compare": command_compare}[args.command](args)


if __name__ == "__main__":
    sys.exit(main())
