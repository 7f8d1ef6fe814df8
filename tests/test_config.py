"""Config presets and experiment files: every preset and mode resolves, bad names are rejected by name."""

import importlib.util
import pathlib

import pytest

from mgrpo_jax.config import BENCHMARKS, MODES, PRESETS, get_config

ROOT = pathlib.Path(__file__).resolve().parents[1]


@pytest.mark.parametrize("preset", PRESETS)
def test_every_preset_and_mode_resolves(preset):
    for mode in MODES:
        config = get_config("xbench", f"{preset},{mode}")
        assert config.preset == preset and config.mode == mode
        # Aligned sub batches must split over micro-batches.
        assert config.rollout.queries * config.rollout.samples % config.main.micro_batches == 0


def test_paper_preset_carries_the_paper_settings():
    c = get_config("xbench", "paper")
    assert (c.rollout.samples, c.rollout.d_max) == (8, 8)
    assert tuple(c.rewards.alpha) == (0.1, 0.9) and tuple(c.rewards.beta) == (0.1, 0.4, 0.5)
    assert (c.main.loss_hparams.eps_low, c.main.loss_hparams.eps_high, c.main.loss_hparams.kl_coef) == (0.2, 0.28, 0)
    assert c.main.model == "qwen3-8b" and c.sub.model == "qwen3-8b"


def test_bad_names_are_rejected_by_name():
    with pytest.raises(ValueError, match="unknown preset 'huge'"):
        get_config("xbench", "huge")
    with pytest.raises(ValueError, match="unknown mode 'solo'"):
        get_config("xbench", "local,solo")
    with pytest.raises(ValueError, match="benchmark='mmlu'"):
        get_config("mmlu", "local")


@pytest.mark.parametrize("benchmark", BENCHMARKS)
def test_experiment_files_load_with_and_without_a_preset(benchmark):
    spec = importlib.util.spec_from_file_location(benchmark, ROOT / "experiments" / f"{benchmark}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    assert module.get_config().preset == "local"  # no accelerator here
    assert module.get_config("smoke,single_agent").mode == "single_agent"
    assert module.get_config("smoke").benchmark == benchmark
