"""launch: the launcher's errors (one `error:` line, exit status 2, no traceback, before anything is built), the
checks of `launch.check` (workdir, benchmark files), and JAX's persistent cache in the workdir's parent."""

import json
import os
import subprocess
import sys
from pathlib import Path

import jax
import pytest

from mgrpo_jax.config import get_config
from mgrpo_jax.rl.run import (
    COMPILATION_CACHE,
    UsageError,
    check,
    check_benchmark_files,
    check_workdir,
    choose_platform,
    enable_compilation_cache,
)

REPO = Path(__file__).resolve().parents[2]
LAUNCH = REPO / "launch" / "tpu_run.py"
EXIT_USAGE = 2


def test_cache_goes_to_the_workdir_parent_and_not_to_remote_workdirs(tmp_path):
    before = jax.config.jax_compilation_cache_dir
    try:
        path = enable_compilation_cache(str(tmp_path / "runs" / "a"))
        assert path == os.path.join(str(tmp_path / "runs"), COMPILATION_CACHE)
        assert jax.config.jax_compilation_cache_dir == path
        assert enable_compilation_cache("gs://bucket/runs/a") is None
        assert jax.config.jax_compilation_cache_dir == path  # unchanged by the remote workdir
    finally:
        jax.config.update("jax_compilation_cache_dir", before)


def _launch(*args, cwd=REPO):
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    return subprocess.run([sys.executable, str(LAUNCH), *args], cwd=cwd, env=env, capture_output=True, text=True,
                          timeout=300)


# ---- bad inputs: each fails before any model is built ----

_WW_RECORD = {"question": "Where is the invented conference held?", "answer": "Zorbtown",
              "root_url": "https://conf.example.org", "info": {"type": "single_source", "lang": "en"}}


def _write(tmp_path, name, data: bytes) -> str:
    path = tmp_path / name
    path.write_bytes(data)
    return str(path)


# id -> (function of tmp_path giving (launcher arguments, strings the message must contain), cwd or None)
BAD_INPUTS = {
    "missing config file": lambda t: (["--config=experiments/nosuch.py:smoke"],
                                      ["--config=experiments/nosuch.py:smoke", "no config file", "did you mean"]),
    "config file found from another directory, bad field": lambda t: (
        ["--config=experiments/xbench.py:smoke", "--config.rollout.querys=1"],
        ["--config.rollout.querys=1", "unknown config field 'rollout.querys'", "did you mean 'rollout.queries'?"]),
    "unknown preset": lambda t: (["--config=experiments/xbench.py:smok"],
                                 ["unknown preset 'smok'", "did you mean 'smoke'?", "smoke, local, figures, paper"]),
    "unknown mode": lambda t: (["--config=experiments/xbench.py:smoke,frozen"],
                               ["unknown mode 'frozen'", "did you mean 'frozen_sub'?", "single_agent"]),
    "unknown override field": lambda t: (["--config=experiments/xbench.py:smoke", "--config.main.los=gspo"],
                                         ["--config.main.los=gspo", "did you mean 'main.loss'?"]),
    "unknown nested field": lambda t: (["--config=experiments/xbench.py:smoke", "--config.main.nosuch=1"],
                                       ["'main.nosuch'", "main has ", "micro_batches"]),
    "override value of the wrong type": lambda t: (["--config=experiments/xbench.py:smoke",
                                                    "--config.rollout.queries=abc"],
                                                   ["--config.rollout.queries=abc", "invalid literal for int()"]),
    "unknown flag": lambda t: (["--config=experiments/xbench.py:smoke", "--workdri=x"],
                               ["unknown flag --workdri", "did you mean --workdir?"]),
    "stray argument": lambda t: (["--config=experiments/xbench.py:smoke", "smoke"], ["unexpected argument", "smoke"]),
    "non-positive count": lambda t: (["--config=experiments/xbench.py:smoke", "--config.rollout.queries=0",
                                      f"--workdir={t / 'run'}"],
                                     ["invalid config (1 problem)", "rollout.queries=0: must be >= 1"]),
    "workdir under a file": lambda t: (
        ["--config=experiments/xbench.py:smoke", f"--workdir={_write(t, 'afile', b'x')}/sub"],
        [f"workdir {t / 'afile' / 'sub'}", "part of the path is a file, not a folder"]),
    "missing benchmark path": lambda t: (
        ["--config=experiments/gaia.py:smoke", f"--config.env.benchmark_path={t / 'nope'}", f"--workdir={t / 'run'}"],
        [f"env.benchmark_path={t / 'nope'}", "no such file or folder"]),
    "empty benchmark file": lambda t: (
        ["--config=experiments/webwalker.py:smoke",
         f"--config.env.benchmark_path={_write(t, 'empty.jsonl', b'')}", f"--workdir={t / 'run'}"],
        [str(t / "empty.jsonl"), "no records"]),
    "binary benchmark file": lambda t: (
        ["--config=experiments/gaia.py:smoke",
         "--config.env.benchmark_path=" + _write(t, "metadata.jsonl", b"\x89PNG\r\n\x1a\n" + bytes(range(256))),
         f"--workdir={t / 'run'}"],
        [str(t / "metadata.jsonl"), "line 1: not UTF-8 text (byte 0x89 at column 1; a binary file?)"]),
    "deeply nested benchmark JSON": lambda t: (
        ["--config=experiments/webwalker.py:smoke", "--config.env.benchmark_path=" + _write(
            t, "deep.jsonl", (json.dumps(_WW_RECORD) + "\n" + "[" * 50000 + "]" * 50000 + "\n").encode()),
         f"--workdir={t / 'run'}"],
        [str(t / "deep.jsonl"), "line 2", "nested too deeply"]),
    "benchmark record missing a field": lambda t: (
        ["--config=experiments/webwalker.py:smoke", "--config.env.benchmark_path=" + _write(
            t, "main.jsonl", (json.dumps(_WW_RECORD) + "\n" + json.dumps({"question": "q", "answer": "a"})).encode()),
         f"--workdir={t / 'run'}"],
        [str(t / "main.jsonl"), "line 2", "'root_url'"]),
    "init_from that does not exist": lambda t: (
        ["--config=experiments/xbench.py:smoke", f"--config.main.init_from={t / 'nope'}", f"--workdir={t / 'run'}"],
        [f"main.init_from='{t / 'nope'}'", "no such folder"]),
    "init_from without weights": lambda t: (
        ["--config=experiments/xbench.py:smoke", f"--config.sub.init_from={_hf_folder(t, weights=False)}",
         f"--workdir={t / 'run'}"],
        ["sub.init_from=", "no safetensors weights there"]),
    "init_from of a model the code cannot build": lambda t: (
        ["--config=experiments/xbench.py:smoke", f"--config.main.init_from={_hf_folder(t, model_type='bert')}",
         f"--workdir={t / 'run'}"],
        ["main.init_from=", "not a model this code can build", "model_type 'bert' is not supported"]),
    "mesh larger than the devices": lambda t: (
        ["--config=experiments/xbench.py:smoke", "--config.main.mesh.tensor=16", f"--workdir={t / 'run'}"],
        ["main.mesh=", "'tensor': 16", "does not fit the 4 devices this agent gets"]),
}


def _hf_folder(t, model_type: str = "qwen3", weights: bool = True) -> str:
    """A folder shaped like a Hugging Face checkpoint (the files' contents do not matter to these checks)."""
    folder = t / "hf"
    folder.mkdir(exist_ok=True)
    (folder / "config.json").write_text(json.dumps({"model_type": model_type}))
    (folder / "tokenizer.json").write_text("{}")
    if weights:
        (folder / "model.safetensors").write_bytes(b"")
    return str(folder)


@pytest.mark.parametrize("case", list(BAD_INPUTS))
def test_a_bad_input_is_one_error_line_and_exit_status_2(tmp_path, case):
    args, expected = BAD_INPUTS[case](tmp_path)
    cwd = tmp_path if "another directory" in case else REPO  # --config resolves from the repository
    result = _launch(*args, cwd=cwd)
    output = result.stdout + result.stderr
    assert result.returncode == EXIT_USAGE, output
    assert "Traceback" not in output
    first, *rest = result.stderr.rstrip("\n").split("\n")
    assert first.startswith("error: "), result.stderr
    assert all(line.startswith("  ") for line in rest), result.stderr  # only validate's list continues it
    for text in expected:
        assert text in result.stderr, (text, result.stderr)
    assert not (tmp_path / "run").exists() or not any((tmp_path / "run").iterdir())  # nothing was built


@pytest.mark.skipif(hasattr(os, "geteuid") and os.geteuid() == 0, reason="root writes to read-only folders")
def test_a_read_only_workdir_fails_before_anything_is_built(tmp_path):
    parent = tmp_path / "readonly"
    parent.mkdir()
    parent.chmod(0o500)
    try:
        result = _launch("--config=experiments/xbench.py:smoke", f"--workdir={parent / 'run'}")
    finally:
        parent.chmod(0o700)
    assert result.returncode == EXIT_USAGE and "Traceback" not in result.stderr
    assert result.stderr.startswith(f"error: workdir {parent / 'run'}: cannot write there (")


def test_config_flags_parse_from_another_directory(tmp_path):
    """The success path of parsing: the file found from the repository, overrides applied (absl's
    --only_check_args stops after the flags)."""
    result = _launch("--config=experiments/xbench.py:smoke,frozen_sub", "--config.seed=3",
                     "--noconfig.train.eval_at_start", "--config.rewards.alpha=(0.2, 0.8)", "--only_check_args",
                     cwd=tmp_path)
    assert result.returncode == 0, result.stderr


def test_help_lists_presets_modes_overrides_and_exit_status():
    result = _launch("--help")
    assert result.returncode == 0, result.stderr
    shown = " ".join(result.stdout.split())  # absl wraps flag help at 80 columns
    for text in ("smoke, local, figures, paper", "mgrpo, frozen_sub, single_agent, mgrpo_unsync",
                 "--config.FIELD=VALUE", "--noconfig.", "Exit status", "experiments/gaia.py", "--workdir"):
        assert text in shown, text


# ---- the platform and the first line ----


def test_choose_platform_runs_on_the_cpu_only_without_an_accelerator(tmp_path):
    dev = tmp_path / "dev"
    dev.mkdir()
    (dev / "tty0").write_text("")
    environ = {}
    assert choose_platform(environ, str(dev)) == "cpu" and environ["JAX_PLATFORMS"] == "cpu"
    assert jax.config.jax_platforms == "cpu"  # jax is imported here: its config follows (conftest chose cpu too)
    for given in ({"JAX_PLATFORMS": ""}, {"JAX_PLATFORMS": "tpu"}, {"TPU_ACCELERATOR_TYPE": "v5litepod-8"}):
        environ = dict(given)
        assert choose_platform(environ, str(dev)) is None and environ == given  # the user's or the VM's choice
    for device in ("accel0", "vfio/0"):  # a TPU VM: v4 / v5e, v5p / v6e
        (dev / device).parent.mkdir(exist_ok=True)
        (dev / device).write_text("")
        assert choose_platform({}, str(dev)) is None
        (dev / device).unlink()


@pytest.mark.slow
def test_the_first_line_names_the_preset_and_no_tpu_noise_without_a_tpu(tmp_path):
    """With libtpu installed (requirements-tpu.txt) and no TPU, JAX_PLATFORMS unset: no libtpu line on stderr,
    one log format, and the first line names the preset."""
    import importlib.util
    import re

    if importlib.util.find_spec("libtpu") is None or choose_platform({}, "/dev") is None:
        pytest.skip("needs libtpu installed on a machine without an accelerator")
    env = {k: v for k, v in os.environ.items() if k != "JAX_PLATFORMS"}
    result = subprocess.run([sys.executable, str(LAUNCH), "--config=experiments/xbench.py:smoke",
                             f"--workdir={tmp_path / 'run'}", "--config.train.steps=1", "--config.train.eval_every=0",
                             "--config.warmstart.steps=0"], cwd=REPO, env=env, capture_output=True, text=True,
                            timeout=300)
    assert result.returncode == 0, result.stderr[-4000:]
    lines = result.stderr.splitlines()
    assert not [line for line in lines if re.search(r"\btpu\b|libtpu|jellyfish|InitGoogle", line, re.I)], lines[:10]
    assert lines[0].split(": ", 1)[1].startswith("preset smoke ("), lines[0]
    assert "cpu backend: no accelerator found, set JAX_PLATFORMS to choose" in lines[0]
    records = [line for line in lines if not line.startswith(" ")]  # the outputs' list continues its record
    one_format = re.compile(r"\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3} (INFO|WARNING) \S+: ")
    assert all(one_format.match(line) for line in records), records
    assert "Building index" not in result.stderr  # bm25s's DEBUG records


# ---- launch.check in-process ----


def test_check_workdir(tmp_path):
    check_workdir(str(tmp_path / "a" / "b"))
    assert (tmp_path / "a" / "b").is_dir() and not list((tmp_path / "a" / "b").iterdir())  # no probe left
    check_workdir("gs://bucket/runs/a")  # remote: not probed
    (tmp_path / "file").write_text("x")
    with pytest.raises(UsageError, match="is a file, not a folder"):
        check_workdir(str(tmp_path / "file"))
    with pytest.raises(UsageError, match="part of the path is a file"):
        check_workdir(str(tmp_path / "file" / "run"))
    with pytest.raises(UsageError, match="--workdir is empty"):
        check_workdir("")


def test_check_benchmark_files(tmp_path):
    config = get_config("gaia", "smoke")
    assert check_benchmark_files(config) == 0  # no files: nothing to check
    rows = [{"task_id": f"t{i}", "Question": f"What is {i} plus {i}?", "Level": 1, "Final answer": answer,
             "file_name": ""} for i, answer in ((1, "2"), (2, "?"))]
    (tmp_path / "metadata.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    config.env.benchmark_path = str(tmp_path)
    assert check_benchmark_files(config) == 2
    (tmp_path / "metadata.jsonl").write_text(json.dumps(rows[1]) + "\n")
    with pytest.raises(UsageError, match="none of its 1 records has a gold answer"):
        check_benchmark_files(config)
    config.env.benchmark_path = str(tmp_path / "missing")
    with pytest.raises(UsageError, match="no such file or folder"):
        check(config, str(tmp_path / "run"))


def test_check_reports_validate_problems_as_a_usage_error(tmp_path):
    config = get_config("xbench", "smoke")
    config.rollout.queries = 0
    with pytest.raises(UsageError, match=r"rollout\.queries=0: must be >= 1"):
        check(config, str(tmp_path / "run"))
    assert not (tmp_path / "run").exists()  # the config is checked before the workdir is made


@pytest.mark.slow
def test_ctrl_c_checkpoints_and_exits_75_and_a_rerun_of_the_finished_run_changes_nothing(tmp_path):
    """Ctrl-C (SIGINT, handled like a TPU VM's SIGTERM): the step finishes, a checkpoint is written, the process
    exits with status 75 (rerun to resume) and no traceback; then a rerun with that many steps says the run is
    finished, exits 0 and leaves `summary.json` as it was."""
    import signal
    import time

    workdir = tmp_path / "run"
    args = ["--config=experiments/xbench.py:smoke", f"--workdir={workdir}", "--config.train.eval_every=0",
            "--config.warmstart.steps=0"]
    proc = subprocess.Popen([sys.executable, str(LAUNCH), *args, "--config.train.steps=50"], cwd=REPO,
                            env=dict(os.environ, JAX_PLATFORMS="cpu"), stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)
    lines, deadline = [], time.monotonic() + 300
    for line in proc.stdout:
        lines.append(line)
        if "step 1/50 |" in line:
            proc.send_signal(signal.SIGINT)
            break
        assert time.monotonic() < deadline, "".join(lines[-40:])
    lines.extend(proc.stdout)
    output = "".join(lines)
    assert proc.wait(timeout=300) == 75, output[-4000:]
    assert "Traceback" not in output and "checkpoint written" in output
    assert output.count("step 1/50 |") == 1 and "[step 1/" not in output  # each step is printed once
    record = json.loads((workdir / "summary.json").read_text())["run"]
    assert record["status"] == "interrupted"  # Ctrl-C; SIGTERM is "preempted"
    step = record["step"]
    assert record["resume_from"] == {"checkpoint": step, "warmstart_checkpoint": None}
    assert (f"interrupted: checkpoint written; the rerun resumes from RL step {step}; run the same command to "
            "resume") in output
    assert step >= 1 and str(step) in os.listdir(workdir / "checkpoints")
    assert not [n for n in os.listdir(workdir / "checkpoints") if "tmp" in n]  # no half-written checkpoint
    before = (workdir / "summary.json").read_text()
    again = _launch(*args, f"--config.train.steps={step}")
    assert again.returncode == 0, again.stderr[-4000:]
    assert f"already finished at step {step}" in again.stderr + again.stdout
    # Nothing trains again; the run is finished now, so its agents are exported and `files` lists the export.
    after, was = json.loads((workdir / "summary.json").read_text()), json.loads(before)
    assert "export" in after["run"].pop("files") and "export" not in was["run"].pop("files")
    assert after == was


@pytest.mark.slow
def test_a_library_logging_the_second_ctrl_c_as_its_failure_leaves_no_traceback_in_run_log(tmp_path):
    """A second Ctrl-C can land while Orbax waits for a save to finish; Orbax logs it with a traceback before
    passing it on. run.log keeps every other failure's traceback."""
    import logging

    from mgrpo_jax.rl.run import log_to_file

    path = log_to_file(str(tmp_path))
    handler = logging.getLogger().handlers[-1]
    library = logging.getLogger("absl")
    try:
        for error in (KeyboardInterrupt(), ValueError("a real failure")):
            try:
                raise error
            except BaseException:  # noqa: BLE001 -- as the library does
                library.exception("Save Finalize thread failed.")
        handler.flush()
    finally:
        logging.getLogger().removeHandler(handler)
        handler.close()
    text = open(path).read()
    assert text.count("Save Finalize thread failed.") == 1 and text.count("Traceback") == 1
    assert "ValueError: a real failure" in text and "KeyboardInterrupt" not in text


def test_a_second_ctrl_c_in_the_warm_start_stops_at_once_and_the_rerun_resumes_from_the_newest_checkpoint(tmp_path):
    """Ctrl-C, then Ctrl-C again during the warm start: exit 130 at once, no traceback on screen or in run.log,
    no half-written checkpoint, a summary.json that says interrupted and where the rerun resumes; the rerun
    resumes the warm start from there and metrics.jsonl holds each warm-start record once. A warm-start-only run
    (train.steps=0, as the figures' warm starts) cut short is interrupted, not finished."""
    import collections
    import re
    import signal
    import time

    workdir = tmp_path / "run"
    args = [str(LAUNCH), "--config=experiments/xbench.py:smoke", f"--workdir={workdir}", "--config.train.steps=0",
            "--config.train.eval_every=0", "--config.warmstart.steps=60", "--config.warmstart.checkpoint_every=4"]
    proc = subprocess.Popen([sys.executable, *args], cwd=REPO, env=dict(os.environ, JAX_PLATFORMS="cpu"),
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    lines, deadline = [], time.monotonic() + 300
    for line in proc.stdout:
        lines.append(line)
        if "warm start main 26/60" in line:
            proc.send_signal(signal.SIGINT)
        if "Ctrl-C: stopping after this step" in line:
            proc.send_signal(signal.SIGINT)  # within the step (a few hundred ms) or its checkpoint
            break
        assert time.monotonic() < deadline, "".join(lines[-40:])
    lines.extend(proc.stdout)
    output = "".join(lines)
    assert proc.wait(timeout=60) == 130, output[-4000:]
    assert "Traceback" not in output and "Traceback" not in (workdir / "run.log").read_text()
    assert "stopped at once" in output and "run the same command to resume" in output
    warm = workdir / "warmstart_checkpoints"
    assert not [name for name in os.listdir(warm) if "tmp" in name], os.listdir(warm)
    record = json.loads((workdir / "summary.json").read_text())["run"]
    assert record["status"] == "interrupted" and record["step"] == 0
    newest = record["resume_from"]["warmstart_checkpoint"]
    # The newest complete checkpoint: 24 on a quiet machine; 20 when step 24's save was still in flight (abandoned).
    saved = [int(name) for name in os.listdir(warm) if name.isdigit()]
    assert newest is not None and newest % 4 == 0 and newest >= 4 and newest == max(saved)
    assert f"the rerun resumes the warm start after {newest} steps" in output

    again = subprocess.run([sys.executable, *args], cwd=REPO, env=dict(os.environ, JAX_PLATFORMS="cpu"),
                           capture_output=True, text=True, timeout=300)
    assert again.returncode == 0, again.stderr[-4000:]
    assert re.search(rf"warm start resumed after {newest} steps \(main \d+/60, sub \d+/60\)", again.stderr)
    records = [json.loads(line) for line in (workdir / "metrics.jsonl").read_text().splitlines()]
    counts = collections.Counter((r["warmstart_step"], k) for r in records if "warmstart_step" in r
                                 for k in r if k.startswith("warmstart/"))
    assert counts and max(counts.values()) == 1, [key for key, n in counts.items() if n > 1]
    assert {k for _, k in counts} == {"warmstart/main/loss", "warmstart/sub/loss"}
    assert json.loads((workdir / "summary.json").read_text())["run"]["status"] == "finished"
