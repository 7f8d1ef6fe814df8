"""Config presets, experiment files and `validate`: every preset and mode resolves and validates, bad names are
rejected by name, and every problem of a config is reported at once with its field."""

import importlib.util
import os
import pathlib
import re
import sys

import pytest
from absl import flags
from ml_collections import config_flags

from mgrpo_jax import config as config_lib
from mgrpo_jax.config import BENCHMARKS, MODES, PRESETS, get_config, rl_batch_rows, validate
from mgrpo_jax.core.losses import loss_defaults

ROOT = pathlib.Path(__file__).resolve().parents[1]


def _experiment(benchmark):
    spec = importlib.util.spec_from_file_location(benchmark, ROOT / "experiments" / f"{benchmark}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _problems(config, job=None) -> list[str]:
    with pytest.raises(ValueError, match=r"invalid config \(\d+ problems?\)") as info:
        validate(config, job)
    return [line.strip() for line in str(info.value).splitlines()[1:]]


@pytest.mark.parametrize("preset", PRESETS)
def test_every_preset_and_mode_resolves(preset):
    for mode in MODES:
        config = get_config("xbench", f"{preset},{mode}")
        assert config.preset == preset and config.mode == mode
        # Aligned sub batches must split over micro-batches.
        assert config.rollout.queries * config.rollout.samples % config.main.micro_batches == 0


@pytest.mark.parametrize("benchmark", BENCHMARKS)
def test_every_preset_mode_and_benchmark_validates(benchmark):
    for preset in PRESETS:
        for mode in MODES:
            config = get_config(benchmark, f"{preset},{mode}")
            validate(config)
            validate(config, "colocated")


def test_paper_preset_carries_the_paper_settings():
    c = get_config("xbench", "paper")
    assert (c.rollout.samples, c.rollout.d_max) == (8, 8)
    assert tuple(c.rewards.alpha) == (0.1, 0.9) and tuple(c.rewards.beta) == (0.1, 0.4, 0.5)
    assert c.main.loss == "grpo" and c.main.loss_hparams.eps_low is None and c.main.loss_hparams.kl_coef is None
    assert (loss_defaults("grpo")["eps_low"], loss_defaults("grpo")["eps_high"]) == (0.2, 0.28)  # the paper's clip
    assert loss_defaults("grpo")["kl_coef"] == 0  # no KL
    # The losses' registrations hold the defaults; the config only overrides them.
    for agent in (c.main, c.sub, c.single):
        assert all(value is None for value in agent.loss_hparams.values()), agent.loss_hparams
    assert c.main.model == "qwen3-30b-a3b" and c.sub.model == "qwen3-30b-a3b"  # the paper's model (issue 18)
    assert c.main.mesh.expert == c.sub.mesh.expert == 8
    dense = get_config("xbench", "paper_dense")
    assert dense.main.model == "qwen3-8b" and dense.sub.model == "qwen3-8b"


def test_new_fields_have_their_defaults():
    c = get_config("xbench", "local")
    assert c.advantages.estimator == "grpo"
    assert c.main.sharding_rules == c.sub.sharding_rules == c.single.sharding_rules == "default"
    assert c.decoupled.keep_steps == 4 and c.decoupled.keep_steps >= c.decoupled.max_lag + 1


def test_bad_names_are_rejected_by_name():
    with pytest.raises(ValueError, match="unknown preset 'huge'"):
        get_config("xbench", "huge")
    with pytest.raises(ValueError, match="unknown mode 'solo'"):
        get_config("xbench", "local,solo")
    with pytest.raises(ValueError, match="benchmark='mmlu'"):
        get_config("mmlu", "local")
    with pytest.raises(ValueError, match="benchmark='mmlu'"):
        config_lib.base_config("mmlu")


@pytest.mark.parametrize("benchmark", BENCHMARKS)
def test_experiment_files_load_with_and_without_a_preset(benchmark):
    module = _experiment(benchmark)
    assert module.get_config().preset == "local"  # no accelerator here
    assert module.get_config("smoke,single_agent").mode == "single_agent"
    assert module.get_config("smoke").benchmark == benchmark
    assert set(PRESETS) <= set(module.PRESETS)  # every benchmark has the shared presets


@pytest.mark.parametrize("benchmark", BENCHMARKS)
def test_package_get_config_is_the_experiment_files(benchmark):
    module = _experiment(benchmark)
    for preset in PRESETS:
        for arg in (preset, f"{preset},frozen_sub"):
            assert get_config(benchmark, arg).to_dict() == module.get_config(arg).to_dict()
    assert get_config(benchmark).to_dict() == module.get_config("local").to_dict()


@pytest.mark.parametrize("benchmark", BENCHMARKS)
def test_experiment_files_load_through_config_flags(benchmark):
    """As launch/tpu_run.py loads them: --config=FILE:preset,mode plus --config.FIELD overrides."""
    path = os.path.join(ROOT, "experiments", f"{benchmark}.py")
    argv = [sys.argv[0], f"--config={path}:local,frozen_sub", "--config.main.loss=gspo", "--config.seed=3",
            "--config.main.loss_hparams.eps_high=0.3"]  # an unset (None) hyper-parameter takes a value
    values = flags.FlagValues()
    config_flags.DEFINE_config_file("config", flag_values=values, sys_argv=argv)
    values(argv)
    config = values.config
    assert (config.benchmark, config.preset, config.mode, config.main.loss, config.seed) == (
        benchmark, "local", "frozen_sub", "gspo", 3)
    assert (config.main.loss_hparams.eps_high, config.main.loss_hparams.eps_low) == (0.3, None)
    validate(config)
    argv = [sys.argv[0], f"--config={path}"]  # no preset: default_preset()
    values = flags.FlagValues()
    config_flags.DEFINE_config_file("config", flag_values=values, sys_argv=argv)
    values(argv)
    assert values.config.preset == "local" and values.config.mode == "mgrpo"


def test_each_kind_of_problem_is_reported_with_its_field():
    cases = {
        "mode": ("mode", "solo"),
        "benchmark": ("benchmark", "mmlu"),
        "stage": ("stage", "stage3"),
        "env.grammar": ("env.grammar", "json"),
        "rollout.align_mode": ("rollout.align_mode", "drop"),
        "advantages.scale": ("advantages.scale", "std"),
        "advantages.baseline": ("advantages.baseline", "median"),
        "advantages.estimator": ("advantages.estimator", "ppo"),
        "main.loss": ("main.loss", "ppo"),
        "sub.sharding_rules": ("sub.sharding_rules", "zero3"),
        "main.model": ("main.model", "llama-70b"),
        "main.optim.decay": ("main.optim.decay", "step"),
        "main.loss_hparams.aggregation": ("main.loss_hparams.aggregation", "sum"),
        "main.loss_hparams.kl_estimator": ("main.loss_hparams.kl_estimator", "k2"),
        "main.loss_hparams.dual_clip": ("main.loss_hparams.dual_clip", 0.5),
        "rollout.queries": ("rollout.queries", 0),
        "rollout.samples": ("rollout.samples", -1),
        "rollout.d_max": ("rollout.d_max", 0),
        "train.steps": ("train.steps", -1),
        "main.context_tokens": ("main.context_tokens", 0),
        "warmstart.format_target": ("warmstart.format_target", 1.5),
        "decoupled.max_lag": ("decoupled.max_lag", -1),
        "store": ("store", "s3://bucket/runs"),
    }
    for field, (path, value) in cases.items():
        c = get_config("xbench", "smoke")
        *parents, leaf = path.split(".")
        node = c
        for part in parents:
            node = node[part]
        with node.ignore_type():
            node[leaf] = value
        problems = _problems(c)
        assert any(p.startswith(f"{field}={value!r}: ") for p in problems), (field, problems)
    c = get_config("xbench", "smoke")
    c.rewards.alpha, c.rewards.beta = (1.0,), (0.5, 0.5)
    problems = _problems(c)
    assert any(p.startswith("rewards.alpha=(1.0,): must be 2 weights") for p in problems), problems
    assert any(p.startswith("rewards.beta=(0.5, 0.5): must be 3 weights") for p in problems), problems


def test_micro_batches_that_do_not_split_a_batch_are_reported():
    c = get_config("xbench", "local")  # warm-start batches of 64, Q*K = 128, Q*K*D = 256
    c.main.micro_batches = 3
    c.warmstart.batch_size = 16
    assert ("main.micro_batches=3: a batch of 16 rows (warmstart.batch_size) does not split into 3 micro-batches"
            in _problems(c))
    c = get_config("xbench", "local,mgrpo_unsync")
    c.sub.micro_batches = 32
    c.rollout.unsync_chunk = 48
    (problem,) = _problems(c)
    assert problem == ("sub.micro_batches=32: a batch of 48 rows (rollout.unsync_chunk) does not split into 32 "
                       "micro-batches")
    c.mode = "mgrpo"  # aligned sub batches: Q*K*D = 256 rows, which 32 micro-batches split
    validate(c)
    c.rollout.queries = 3  # 3 x 8 x 2 = 48 rows
    (problem,) = _problems(c)
    assert problem.startswith("sub.micro_batches=32: a batch of 48 rows "
                              "(rollout.queries x rollout.samples x rollout.d_max)")


def test_rl_batch_rows_per_agent_and_mode():
    c = get_config("xbench", "local")  # Q = 16, K = 8, D = 2, unsync_chunk = 128
    assert (rl_batch_rows(c, "main"), rl_batch_rows(c, "sub"), rl_batch_rows(c, "single")) == (128, 256, 128)
    c.mode = "mgrpo_unsync"
    assert (rl_batch_rows(c, "main"), rl_batch_rows(c, "sub")) == (128, 128)


def test_several_problems_are_reported_together():
    c = get_config("gaia", "smoke")
    c.mode = "mgrp"
    c.env.grammar = "compakt"
    c.rollout.d_max = 0
    c.main.loss = "gsp"
    c.decoupled.keep_steps = 1
    with pytest.raises(ValueError, match=r"invalid config \(5 problems\)") as info:
        validate(c)
    text = str(info.value)
    for field in ("mode='mgrp'", "env.grammar='compakt'", "rollout.d_max=0", "main.loss='gsp'",
                  "decoupled.keep_steps=1"):
        assert f"\n  {field}: " in text, text
    assert "decoupled.keep_steps=1: must be >= decoupled.max_lag + 1 = 2" in text


def test_misspelled_names_get_a_suggestion():
    c = get_config("xbench", "smoke")
    c.mode = "frozen-sub"
    c.sub.loss = "gsop"
    c.main.sharding_rules = "defualt"
    c.main.model_overrides.d_modle = 64
    c.main.los = "gspo"  # a new field, set in code by mistake
    problems = _problems(c)
    assert any(p.startswith("mode='frozen-sub': ") and p.endswith("did you mean 'frozen_sub'?") for p in problems)
    assert any(p.startswith("sub.loss='gsop': ") and p.endswith("did you mean 'gspo'?") for p in problems)
    assert any(p.startswith("main.sharding_rules='defualt': ") and p.endswith("did you mean 'default'?")
               for p in problems)
    assert "main.model_overrides.d_modle: not a field of ModelConfig; did you mean 'd_model'?" in problems
    assert "main.los: unknown field; did you mean 'main.loss'?" in problems


def test_only_the_agents_of_the_mode_are_checked():
    c = get_config("xbench", "smoke,single_agent")
    c.main.loss = "nope"  # the main agent does not run in single_agent mode
    validate(c)
    c.single.loss = "nope"
    assert [p for p in _problems(c) if p.startswith("single.loss='nope'")]


def test_decoupled_roles_need_two_agents_and_a_shared_store():
    c = get_config("xbench", "smoke,single_agent")
    validate(c)
    validate(c, "colocated")
    problems = _problems(c, "main")
    assert any(re.match(r"mode='single_agent': --role=main needs a two-agent mode", p) for p in problems)
    assert any(p.startswith("store='memory://mgrpo': --role=main") for p in problems)
    c = get_config("xbench", "smoke,frozen_sub")
    c.store = "file:///tmp/shared/store"
    validate(c, "main")
    validate(c, "sub")
    (problem,) = _problems(c, "mian")
    assert problem.startswith("role='mian': not one of colocated, main, sub; did you mean 'main'?")


def test_paper_lora_is_paper_dense_with_lora_on_every_agent():
    paper, lora = get_config("xbench", "paper_dense"), get_config("xbench", "paper_lora")
    for name in ("main", "sub", "single"):
        assert (lora[name].lora.rank, lora[name].lora.target) == (64, ".") and paper[name].lora.rank == 0
        assert lora[name].model == paper[name].model and lora[name].mesh.to_dict() == paper[name].mesh.to_dict()
        assert lora[name].model_overrides.param_dtype == "bfloat16"
    assert lora.rollout.to_dict() == paper.rollout.to_dict() and lora.rewards.to_dict() == paper.rewards.to_dict()


def test_evaluation_sets_and_counterfactual_share_are_validated():
    c = get_config("xbench", "figures")
    c.train.eval_sets = "eval_gaia,fresh,validaton"
    c.warmstart.counterfactual_share = 1.5
    problems = _problems(c)
    assert any(p.startswith("train.eval_sets=") and "'validaton' is not one of" in p and "'validation'" in p
               for p in problems)
    assert any(p.startswith("warmstart.counterfactual_share=1.5") for p in problems)
    c = get_config("xbench", "smoke")  # the chat world has no counterfactual twins
    c.warmstart.counterfactual_share = 0.5
    assert any("compact world only" in p for p in _problems(c))


def test_rl_in_counterfactual_twins_runs_colocated_only():
    c = get_config("xbench", "figures")
    c.rollout.counterfactual_share = 1.0
    validate(c)
    assert any(p.startswith("rollout.counterfactual_share=1.0: not with --role=main") for p in _problems(c, "main"))
