"""The throughput benchmark's bookkeeping (no timing assertions; its quick mode runs in test_quick_modes.py)."""

from mgrpo_jax.bench import rollout as bench


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


class FakeStep:
    """A train step whose first call traces (compiles)."""

    trace_count = 0

    def __call__(self, state, batch):
        self.trace_count = 1
        return state


def test_a_compiling_call_of_a_timed_step_counts_as_compile_time():
    timer = bench.ComputeTimer()
    timed = bench.TimedStep(FakeStep(), timer, "train_step")
    timed(None, None)
    timed(None, None)
    assert (timer.compiles, timer.calls, timed.trace_count) == (1, 2, 1)
