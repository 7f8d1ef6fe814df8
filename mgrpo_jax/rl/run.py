"""What `launch/tpu_run.py` calls after flags and process setup: check the inputs, pick the job (--role), build, run.

`check(config, workdir, job)` finds every problem of the user's inputs that shows before anything is built
(the config, via `mgrpo_jax.config.validate`; a workdir that cannot be written; missing or malformed benchmark
files) and raises it as a `UsageError`; `run` calls it first, and `launch/tpu_run.py` turns a `UsageError` into
one `error:` message and exit status 2.
"""

from __future__ import annotations

import json
import logging
import os
import socket
import sys
import uuid

from mgrpo_jax.agent.build import agent_mesh_devices
from mgrpo_jax.config import agent_names, validate
from mgrpo_jax.runtime import files

# Imported from here by launch/tpu_run.py and the tests; they live in backend so that export, which launch imports,
# can use them without a cycle.
from mgrpo_jax.runtime.backend import ACCELERATOR_DEVICES, TPU_ENV, choose_platform  # noqa: F401

log = logging.getLogger("mgrpo_jax")

COMPILATION_CACHE = ".jax_cache"
LOG_FILE = "run.log"  # every log record of the run, one line each (launch/tpu_run.py adds the handler)


class UsageError(ValueError):
    """A problem with what the user passed (config, workdir, benchmark files), found before anything is built.
    The message is complete on its own: it names the input and says what is wrong."""


def not_a_second_ctrl_c(record: logging.LogRecord) -> bool:
    """Drops a record that logs a KeyboardInterrupt as a failure: a second Ctrl-C is the user's stop, which the
    run reports itself ("stopped at once"). It can arrive while a library waits (Orbax's save finalisation), and the
    library logs it with a traceback before passing it on."""
    return not (record.exc_info and isinstance(record.exc_info[1], KeyboardInterrupt))


def log_to_screen(level: int) -> logging.Handler:
    """One handler on stderr, in run.log's format, in place of absl's (app.run installs it, with another
    format): the screen shows one format, and the progress bars print records above them in it. Libraries'
    DEBUG records (bm25s logs at DEBUG whatever the root's level) stay off the screen."""
    from absl import logging as absl_logging

    root = logging.getLogger()
    for handler in list(root.handlers):
        if isinstance(handler, absl_logging.ABSLHandler) or type(handler) is logging.StreamHandler:
            root.removeHandler(handler)
    handler = logging.StreamHandler(sys.stderr)
    handler.setLevel(level)
    handler.setFormatter(logging.Formatter(files.LOG_FORMAT))
    handler.addFilter(not_a_second_ctrl_c)
    root.addHandler(handler)
    root.setLevel(level)
    return handler


def check_workdir(workdir: str) -> None:
    """Creates `workdir` and writes (then removes) a probe file in it: an unwritable workdir fails here, not after
    the world and the models are built. Remote workdirs (`gs://...`) are not probed."""
    if "://" in workdir:
        return
    if not workdir:
        raise UsageError("--workdir is empty")
    probe = os.path.join(workdir, f".write_probe.{socket.gethostname()}.{os.getpid()}.{uuid.uuid4().hex[:8]}")
    try:
        os.makedirs(workdir, exist_ok=True)
        with open(probe, "w") as f:
            f.write("probe\n")
        os.remove(probe)
    except FileExistsError:
        raise UsageError(f"workdir {workdir}: is a file, not a folder") from None
    except NotADirectoryError:
        raise UsageError(f"workdir {workdir}: cannot create it: part of the path is a file, not a folder") from None
    except OSError as e:  # permission denied, a read-only file system, a full disk, ...
        raise UsageError(f"workdir {workdir}: cannot write there ({e.strerror or e})") from None


def check_benchmark_files(config) -> int:
    """Loads `config.env.benchmark_path` (if set) with `config.benchmark`'s loader, as evaluation will: a missing,
    empty or malformed file, or one without a single gold answer, fails here. Returns the number of records."""
    path = config.env.benchmark_path
    if not path:
        return 0
    from mgrpo_jax.env.benchmarks import LOADERS, BenchmarkFormatError, load_benchmark

    if config.benchmark not in LOADERS:  # validate reports the benchmark name itself
        return 0
    if not os.path.exists(path):
        raise UsageError(f"env.benchmark_path={path}: no such file or folder")
    try:
        records = load_benchmark(config.benchmark, path)
    except BenchmarkFormatError as e:  # "<file>: <line or row>: <problem>"
        raise UsageError(f"env.benchmark_path: {e}") from None
    if all(r.answer is None for r in records):
        raise UsageError(f"env.benchmark_path={path}: none of its {len(records)} records has a gold answer (a test "
                         "split?); evaluation needs them")
    return len(records)


def job_agents(config, job: str) -> tuple[str, ...]:
    """The agents a job of `job` holds: all of the mode's (colocated), or its own side of the decoupled mode."""


    names = agent_names(config.mode)
    return {"main": names[:1], "sub": names[1:]}.get(job, names)


def check_init_from(config, job: str = "colocated") -> None:
    """Each agent's `init_from` (if set) is a Hugging Face checkpoint folder the model code can represent: its
    config.json, safetensors and tokenizer files are there, and `config_from_hf` accepts the config."""
    from etils import epath

    from mgrpo_jax.model.checkpoint_hf import config_from_hf

    for name in job_agents(config, job):
        source = config[name].get("init_from")
        if not source:
            continue
        path, field = epath.Path(source), f"{name}.init_from={source!r}"
        if not path.is_dir():
            raise UsageError(f"{field}: no such folder")
        for what, patterns in (("config.json", ["config.json"]), ("safetensors weights", ["*.safetensors"]),
                               ("tokenizer.json or tokenizer.model", ["tokenizer.json", "tokenizer.model"])):
            if not any(list(path.glob(pattern)) for pattern in patterns):
                raise UsageError(f"{field}: no {what} there")
        try:
            config_from_hf(json.loads((path / "config.json").read_text()))
        except (NotImplementedError, KeyError, TypeError, ValueError) as e:
            raise UsageError(f"{field}: its config.json is not a model this code can build "
                             f"({type(e).__name__}: {e})") from None


def check_meshes(config, job: str = "colocated") -> None:
    """Each agent's mesh fits the devices it gets (needs JAX's backend: run after `jax.distributed`)."""


    try:
        agent_mesh_devices(config, job_agents(config, job))
    except ValueError as e:
        raise UsageError(str(e)) from None


def check(config, workdir: str, job: str = "colocated") -> None:
    """Every problem of the inputs that shows before anything is built, as a `UsageError`: the config's
    (`validate`, all listed in one message), then the workdir's, the benchmark files' and the `init_from`
    checkpoints'. `execute` adds the meshes' (they need the devices)."""
    try:
        validate(config, job)
    except ValueError as e:
        raise UsageError(str(e)) from None
    check_workdir(workdir)
    check_benchmark_files(config)
    check_init_from(config, job)


def log_to_file(workdir: str, job: str = "colocated") -> str | None:
    """Every log record from here on also goes to `<workdir>/run.log` (`<workdir>/<job>/run.log` for a job of the
    decoupled mode), appended to across resumes, one line each: the progress bars' figures without the bars.
    Returns its path."""
    folder = files.as_path(workdir) / job if job in ("main", "sub") else files.as_path(workdir)
    handler = files.LogFileHandler(folder / LOG_FILE, level=logging.INFO)  # not the libraries' DEBUG records
    handler.addFilter(not_a_second_ctrl_c)
    logging.getLogger().addHandler(handler)
    return handler.baseFilename


def enable_compilation_cache(workdir: str) -> str | None:
    """JAX's persistent compilation cache in the workdir's parent (`<parent>/.jax_cache`): the many short processes
    of an experiment (warm start, stage 1, stage 2, seeds, modes) compile the same shapes, and each reuses what
    an earlier one compiled. Local workdirs only; returns the cache folder."""
    if "://" in workdir:
        return None
    import jax

    path = os.path.join(os.path.dirname(os.path.abspath(workdir)), COMPILATION_CACHE)
    jax.config.update("jax_compilation_cache_dir", path)
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.2)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)
    return path


AT_ONCE = "interrupted at once"  # execute's status after a second Ctrl-C (summary.json says interrupted)


def execute(config, workdir: str, job: str = "colocated") -> tuple[dict, str]:
    """(the last step's metrics, the run's status: finished, interrupted, preempted, stopped, or `AT_ONCE`).
    `colocated`: both agents in this job. `main` / `sub`: one side of the decoupled mode (decoupled.py)."""
    check(config, workdir, job)  # bad inputs fail here, before anything is built
    check_meshes(config, job)
    enable_compilation_cache(workdir)
    from mgrpo_jax.rl.trainer import Trainer

    trainer = Trainer(config, workdir, job)  # an unknown job is a ValueError naming the three
    from mgrpo_jax.agent import export  # each agent as an HF checkpoint: recorded now, exported when finished
    from mgrpo_jax.runtime.metrics import update_summary_files

    export.record_agents(trainer.workdir, trainer.learners)
    summary = trainer.run()
    if trainer.status == "finished":
        export.export_agents(trainer)
        if trainer.is_main_process:
            update_summary_files(trainer.workdir)
    log.info("%s (%s): %s", trainer.status, job,
             {k: round(v, 4) for k, v in summary.items() if k.endswith(("/reward", "/accuracy")) and v is not None})
    if trainer.is_main_process:
        log.info("outputs:\n%s", "\n".join(f"  {label:<12} {path}" for label, path in outputs(trainer.workdir)))
    return summary, AT_ONCE if trainer.at_once else trainer.status


OUTPUTS = (("metrics", "metrics.jsonl"), ("tensorboard", "tb"), ("plot", "rewards.png"), ("checkpoints", "checkpoints"),
           ("summary", "summary.json"), ("log", LOG_FILE), ("transcripts", "transcripts.jsonl"),
           ("export", "export"))  # the agents as Hugging Face checkpoints (mgrpo_jax/agent/export.py)


def outputs(workdir: str) -> list[tuple[str, str]]:
    """(what, path) of each output the run in `workdir` has written, in the order a user looks at them."""
    paths = [(label, files.as_path(workdir) / name) for label, name in OUTPUTS]
    return [(label, str(path)) for label, path in paths if path.exists()]


def run(config, workdir: str, job: str = "colocated") -> dict:
    """`execute`'s metrics."""
    return execute(config, workdir, job)[0]
