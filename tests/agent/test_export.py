"""`python -m mgrpo_jax.agent.export` as a command: user-facing help, one `error:` line and exit status 2 on each bad
input, quiet output, and an export whose tokenizer has exactly the model's vocabulary in `transformers`."""

import json
import os
import subprocess
import sys

import jax
import pytest
import torch
import transformers

from mgrpo_jax.agent import export
from mgrpo_jax.agent.build import build_agent
from mgrpo_jax.config import get_config
from mgrpo_jax.runtime.checkpoint import Checkpointer
from mgrpo_jax.tokenizer import Tokenizer
from tests.model.tiny_hf import smoke_corpus

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
STEPS = (2, 4)


@pytest.fixture(scope="module")
def workdir(tmp_path_factory):
    """A run's workdir as a run leaves it: the smoke preset's main agent recorded, checkpoints at STEPS."""
    config = get_config("xbench", "smoke")
    tokenizer = Tokenizer.train(smoke_corpus(limit_questions=10), config.tokenizer.vocab_size)
    agent = build_agent("main", config.main, tokenizer, jax.devices()[:1], seed=0)
    path = tmp_path_factory.mktemp("run")
    export.record_agents(str(path), {"main": agent})
    with Checkpointer(str(path)) as checkpointer:
        for step in STEPS:
            checkpointer.save(step, {"main": agent.state}, {"step": step}, force=True)
    return path


def _export(*args, cwd=None):
    env = {**os.environ, "PYTHONPATH": ROOT}
    for name in ("XLA_FLAGS", "JAX_PLATFORMS"):  # the command chooses the platform, as for a user
        env.pop(name, None)
    return subprocess.run([sys.executable, "-m", "mgrpo_jax.agent.export", *args], capture_output=True, text=True,
                          env=env, cwd=cwd or ROOT, timeout=300)


def test_help_is_for_users_and_exits_0():
    result = _export("--help")
    assert result.returncode == 0, result.stderr
    assert "--workdir" in result.stdout and "--agent" in result.stdout and "--step" in result.stdout
    assert "examples:" in result.stdout and "transformers" in result.stdout
    assert "record_agents" not in result.stdout  # not the module's developer docstring


@pytest.mark.parametrize("case", ["agent", "step", "out", "workdir", "not_a_run", "out_is_file"])
def test_each_bad_input_is_one_error_line_and_exit_2(workdir, tmp_path, case):
    (tmp_path / "file").write_text("x")
    args = {"agent": [f"--workdir={workdir}", "--agent=mian", f"--out={tmp_path}/o"],
            "step": [f"--workdir={workdir}", "--step=99", f"--out={tmp_path}/o"],
            "out": [f"--workdir={workdir}"],
            "workdir": [f"--workdir={tmp_path}/nowhere", f"--out={tmp_path}/o"],
            "not_a_run": [f"--workdir={tmp_path}", f"--out={tmp_path}/o"],
            "out_is_file": [f"--workdir={workdir}", f"--out={tmp_path}/file"]}[case]
    result = _export(*args)
    assert result.returncode == 2, result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), result.stderr
    expected = {"agent": "did you mean 'main'?", "step": "(steps: 2, 4)", "out": "--out",
                "workdir": "no such folder", "not_a_run": "not a run's workdir", "out_is_file": "is a file"}[case]
    assert expected in lines[0]
    assert not (tmp_path / "o").exists() and not (tmp_path / "nowhere").exists()  # nothing created on a bad input


def test_export_is_quiet_and_its_tokenizer_matches_the_model_vocabulary(workdir, tmp_path):
    out = tmp_path / "hf"
    result = _export(f"--workdir={workdir}", "--step=2", f"--out={out}")
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == str(out)
    assert result.stderr == "", result.stderr  # no Orbax INFO lines, no libtpu probe where there is no TPU
    model = transformers.AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32)
    tokenizer = transformers.AutoTokenizer.from_pretrained(out)
    vocab = json.loads((workdir / "agents" / "main" / "model_config.json").read_text())["vocab_size"]
    assert model.config.vocab_size == vocab == 1024
    assert len(tokenizer) == model.config.vocab_size  # transformers' GemmaTokenizer would add <mask> at 1024


def test_the_function_raises_the_error_the_command_prints(workdir, tmp_path):
    with pytest.raises(export.ExportError, match=r"--agent=sbu: no such agent in .* \(agents: main\)"):
        export.export_checkpoint(str(workdir), "sbu", str(tmp_path / "out"))
    assert export.check_export(str(workdir), "main") == max(STEPS)
