"""The throughput benchmark's code paths at the smoke preset and a tiny GRPO shape (no timing assertions)."""

import json

from mgrpo_jax.bench import rollout as bench

TINY = ["--preset", "smoke", "--steps", "1", "--warmup-steps", "1", "--warmstart-steps", "2",
        "--grpo-model", "tiny", "--grpo-overrides", "n_layers=1,vocab_size=256", "--grpo-prompts", "2",
        "--grpo-samples", "2", "--grpo-prompt-len", "8", "--grpo-new-tokens", "8", "--grpo-repeats", "1"]
REQUIRED = ("episodes_per_s", "tokens_per_s", "compute_share", "peak_memory_gb", "grpo_step_s",
            "grpo_sampling_s", "grpo_update_s")


def test_smoke_benchmark_emits_one_json_line(capsys):
    figures = bench.main(TINY)
    out = capsys.readouterr().out
    assert "barely warm-started" in out
    parsed = json.loads(out.strip().splitlines()[-1])
    for key in REQUIRED:
        assert key in parsed and parsed[key] > 0, key
    assert 0 < parsed["compute_share"] <= 1
    assert parsed["grpo_step_s"] == figures["grpo_step_s"]
    assert parsed["grpo_shape"]["rows"] == 4 and parsed["grpo_shape"]["seq"] == 16
    assert parsed["preset"] == "smoke" and parsed["rl_steps"] == 1
    phases = sum(parsed[f"phase_{p}"] for p in bench.PHASES)
    assert abs(phases - parsed["step_s"]) < 1e-6 * max(1.0, parsed["step_s"])


def test_compute_timer_keeps_compiling_calls_apart():
    timer = bench.ComputeTimer()
    timer.add("sampler", 2.0, compiled=True)
    timer.add("sampler", 0.5, compiled=False)
    timer.add("train_step", 0.25, compiled=False)
    assert (timer.compute_s, timer.compile_s, timer.calls, timer.compiles) == (0.75, 2.0, 3, 1)
    assert timer.by_kind == {"sampler": 0.5, "train_step": 0.25}
