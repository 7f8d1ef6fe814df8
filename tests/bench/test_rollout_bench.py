"""The throughput benchmark's bookkeeping (no timing assertions; its quick mode runs in test_quick_modes.py)."""

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
