"""The throughput benchmark's bookkeeping (no timing assertions; its quick mode runs in test_quick_modes.py)."""

import statistics

import pytest

from mgrpo_jax.bench import rollout as bench
from mgrpo_jax.sampling import observe
from mgrpo_jax.sampling.observe import observed


def test_compute_timer_keeps_compiling_calls_apart():
    timer = bench.ComputeTimer()
    timer.add("sampler", 2.0, compiled=True)
    timer.add("sampler", 0.5, compiled=False)
    timer.add("train_step", 0.25, compiled=False)
    assert (timer.compute_s, timer.compile_s, timer.calls, timer.compiles) == (0.75, 2.0, 3, 1)
    assert timer.by_kind == {"sampler": 0.5, "train_step": 0.25}


class FakeTrainer:
    """RL steps that grow a jit cache (compile) for the first `compiling` steps."""

    def __init__(self, compiling: int):
        self.step, self.cache, self.compiling = 0, 0, compiling

    def rl_step(self):
        if self.step < self.compiling:
            self.cache += 1
        self.step += 1  # as Trainer.rl_step
        return {"time/step_s": 0.1}


def test_warm_up_runs_until_steps_in_a_row_compile_nothing(monkeypatch):
    monkeypatch.setattr(bench, "jit_cache_sizes", lambda trainer: (trainer.cache,))
    timer = bench.ComputeTimer()
    trainer = FakeTrainer(compiling=3)
    out = bench.warm_up(trainer, timer, least=1, most=8, quiet=2)
    assert (out["warmup_steps_run"], out["warmup_settled"], trainer.step) == (5, True, 5)
    assert bench.warm_up(FakeTrainer(compiling=3), timer, least=1, most=8, quiet=1)["warmup_steps_run"] == 4
    # At least `least` steps even when the first compiles nothing; never more than `most`.
    assert bench.warm_up(FakeTrainer(compiling=0), timer, least=3, most=8, quiet=1)["warmup_steps_run"] == 3
    capped = bench.warm_up(FakeTrainer(compiling=10), timer, least=1, most=3)
    assert (capped["warmup_steps_run"], capped["warmup_settled"]) == (3, False)


def test_the_timer_observes_compiled_calls_by_kind():
    programs = [0]

    def compiling():
        programs[0] += 1

    with observe(bench.ComputeTimer()) as timer:
        observed("generate", lambda: programs[0], compiling)  # compiled
        observed("slots_launch", lambda: programs[0], lambda: None)
        observed("slots_collect", lambda: programs[0], lambda: None)
        observed("train_step", lambda: programs[0], lambda: None)
    assert (timer.compiles, timer.calls) == (1, 4)
    assert set(timer.by_kind) == {"sampler", "train_step"}


def test_the_default_is_a_cut_of_the_full_run_and_flags_beside_a_mode_still_apply():
    default, full = bench.parse_args([]), bench.parse_args(["--full"])
    assert (default.warmstart_steps, default.steps, default.long_episodes, default.long_context) == (100, 2, 8, 2048)
    assert default.kv_block_size == 0 and bench.parse_args(["--kv-block-size=16"]).kv_block_size == 16  # paged: opt in
    # --full: the preset's own warm start (None) and the paper-shaped long workload, as before issue 37.
    assert (full.warmstart_steps, full.steps, full.max_warmup_steps, full.quiet_steps) == (None, 3, 8, 2)
    assert (full.long_episodes, full.long_turns_max, full.long_context) == (24, 14, 8192)
    assert full.local_warmstart_steps is None and full.local_repeats == 1
    assert bench.parse_args(["--full", "--steps", "5", "--warmstart-steps", "preset"]).steps == 5
    quick = bench.parse_args(["--quick", "--grpo-repeats", "2"])
    assert (quick.preset, quick.warmstart_steps, quick.grpo_repeats) == ("smoke", 2, 2)
    with pytest.raises(SystemExit):
        bench.parse_args(["--quick", "--full"])


def test_timed_runs_warm_up_until_nothing_compiles_then_take_the_median_of_the_timed_runs(monkeypatch):
    programs, calls = [3], []
    monkeypatch.setattr(bench, "compiled_programs", lambda: programs[0])

    def run():
        if not calls:  # the first warm-up compiles
            programs[0] += 1
        calls.append("run")
        return len(calls)

    seconds, result, info = bench.timed_runs(run, "test", reset=lambda: calls.append("reset"), repeats=3)
    assert (info["warmup_runs"], info["compiles_in_timed_run"], len(info["run_s_samples"])) == (2, 0, 3)
    assert seconds == statistics.median(info["run_s_samples"])
    # Each timed run after a reset; the result is the last run's.
    assert calls == ["run", "run", "reset", "run", "reset", "run", "reset", "run"] and result == len(calls)


def test_the_long_workload_takes_any_preset_and_empty_overrides():
    # The GPU command of launch/device_bench.sh: Qwen3-0.6B's own shape, no overrides.
    args = bench.parse_args(["--workload=long", "--skip-local", "--long-model", "qwen3-0.6b", "--long-overrides", ""])
    assert (args.long_model, args.long_overrides, args.skip_local) == ("qwen3-0.6b", "", True)
    assert bench._overrides(args.long_overrides) == {}
    cfg = bench.get_model_config(args.long_model, **bench._overrides(args.long_overrides))
    assert (cfg.n_layers, cfg.d_model, cfg.vocab_size, cfg.head_dim) == (28, 1024, 151_936, 128)
    # Its CPU rehearsal (DEVICE_BENCH_QUICK=1): --quick's tiny overrides on the same preset.
    quick = bench.parse_args(["--workload=long", "--quick", "--skip-local", "--long-model", "qwen3-0.6b"])
    assert bench._overrides(quick.long_overrides) == {"n_layers": 1, "vocab_size": 256, "d_model": 32}
