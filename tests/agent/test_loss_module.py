"""`launch/tpu_run.py --loss_module=...`: a loss defined in the user's own file, used from the command line run in
a folder outside the repository (where importing it from a copied config file failed with ModuleNotFoundError);
every way the module can fail is one `error:` line and exit status 2."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
LAUNCH = REPO / "launch" / "tpu_run.py"

MY_LOSS = '''
from mgrpo_jax.core import register_loss
from my_helpers import SCALE  # a neighbour of the loss file


@register_loss("reinforce_mine")
def reinforce(inputs, **_):
    token = -SCALE * inputs.advantages[:, None] * inputs.logprobs
    return (token * inputs.mask).sum(), inputs.mask.sum(), {"reinforce_mine_used": inputs.mask.sum() * 0 + 1}
'''


def _launch(cwd, *args):
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}
    env.pop("PYTHONPATH", None)  # as a user runs it: the package found from the launcher's checkout only
    return subprocess.run([sys.executable, str(LAUNCH), "--config=experiments/xbench.py:smoke", *args], cwd=cwd,
                          env=env, capture_output=True, text=True, timeout=600)


@pytest.fixture
def user_folder(tmp_path):
    folder = tmp_path / "mine"
    folder.mkdir()
    (folder / "my_loss.py").write_text(MY_LOSS)
    (folder / "my_helpers.py").write_text("SCALE = 1.0\n")
    (folder / "empty_loss.py").write_text("X = 1\n")
    (folder / "broken_loss.py").write_text("def f(:\n")
    (folder / "failing_loss.py").write_text("raise RuntimeError('no GPU here')\n")
    (folder / "a_file").write_text("x")
    return folder


def test_a_loss_from_the_users_file_trains(user_folder):
    result = _launch(user_folder, "--loss_module=my_loss.py", "--config.main.loss=reinforce_mine",
                     "--workdir=run", "--config.train.steps=1", "--config.train.eval_every=0",
                     "--config.warmstart.steps=0")
    assert result.returncode == 0, result.stderr[-4000:]
    steps = [json.loads(line) for line in (user_folder / "run" / "metrics.jsonl").read_text().splitlines()]
    rl = [r for r in steps if "main/train/reinforce_mine_used" in r]
    assert rl and rl[-1]["main/train/reinforce_mine_used"] > 0  # the step ran the user's loss


@pytest.mark.parametrize("case", ["missing_file", "missing_module", "syntax", "raises", "registers_none",
                                  "other_name", "no_flag"])
def test_each_failure_is_one_error_line_and_exit_2(user_folder, case):
    # The workdir is a file: a run whose loss is accepted stops there, before anything is built.
    flag, loss, expected = {
        "missing_file": ("nope.py", "reinforce_mine", "--loss_module=nope.py: no such file (looked in "),
        "missing_module": ("nope_mod", "reinforce_mine", "--loss_module=nope_mod: no module named 'nope_mod'"),
        "syntax": ("broken_loss.py", "reinforce_mine", "importing it failed: SyntaxError: "),
        "raises": ("failing_loss.py", "reinforce_mine", "importing it failed: RuntimeError: no GPU here"),
        "registers_none": ("empty_loss.py", "reinforce_mine", "it registered no loss (decorate"),
        "other_name": ("my_loss.py", "reinforce_mnie", "main.loss='reinforce_mnie': no loss of that name; did you "
                       "mean 'reinforce_mine'? (the --loss_module files registered reinforce_mine;"),
        "no_flag": (None, "reinforce_mine", "main.loss='reinforce_mine': not one of"),
    }[case]
    args = ([f"--loss_module={flag}"] if flag else []) + [f"--config.main.loss={loss}", "--workdir=a_file"]
    result = _launch(user_folder, *args)
    assert result.returncode == 2, result.stderr[-2000:]
    errors = [line for line in result.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and expected in result.stderr, result.stderr[-2000:]
    if case == "no_flag":  # the error says how a loss from the user's own file gets registered
        assert "registered by --loss_module=FILE" in result.stderr
    assert "Traceback" not in result.stderr


def test_a_module_name_importable_from_the_current_folder(user_folder):
    result = _launch(user_folder, "--loss_module=my_loss", "--config.main.loss=reinforce_mine", "--workdir=a_file")
    assert result.returncode == 2 and "workdir a_file: is a file" in result.stderr, result.stderr[-2000:]
