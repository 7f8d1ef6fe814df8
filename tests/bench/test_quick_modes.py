"""Every benchmark's quick mode, as CI runs them: `python -m mgrpo_jax.bench.NAME --quick` in its own process.

The benchmarks are discovered from the files in mgrpo_jax/bench/, so a new one without a quick mode (or without
an entry in MAIN_KEYS saying what its JSON must hold) fails here. Each must end its stdout with one JSON object
holding its main keys. No timing is asserted: the figures of tiny sizes mean nothing.
"""

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
BENCH = REPO / "mgrpo_jax" / "bench"
HELPERS = {"__init__", "common"}  # modules of the package that are not benchmarks

MAIN_KEYS = {
    "checkpoint": ("load_s", "load_min_s", "load_cpu_s", "load_gb_per_s", "save_s", "params_m"),
    "env": ("worldgen_s_2000", "index_s", "search_ms", "visit_ms", "expert_success", "compact"),
    "kernels": ("kernel_ms", "kernel_gb_per_s", "copy_gb_per_s", "bytes_moved_mb", "fraction_of_copy",
                "reuse_freed_memory", "hlo_row_by_t_buffers", "targets_ms", "loss_grad_ms", "compile_ms"),
    "lora": ("merge_s", "merged_sample_s", "merged_per_update_s", "unmerged_sample_s", "choice",
             "same_tokens_frac"),
    "model": ("decode_tokens_per_s", "hf_decode_tokens_per_s", "train_mfu", "peak_memory_gb",
              "hf_train_tokens_per_s", "train_tokens_per_s", "prefill_tokens_per_s", "matmul_peak_gflops"),
    "overlap": ("sync_step_s", "async_step_s", "wall_ratio", "sync_sampler_busy_share", "async_sampler_busy_share",
                "sync_learner_busy_share", "async_learner_busy_share", "paper_v5p64_wall_ratio"),
    "peer": ("engine_tokens_per_s", "engine_episodes_per_s", "generated_tokens", "context_tokens", "episodes", "turns",
             "threads", "model", "vllm", "tokens_ratio"),
    "plan": ("small_decode_gib_per_chip_v5e4", "small_decode_fits_v5e4", "small_fits_v5e4"),
    "rollout": ("episodes_per_s", "tokens_per_s", "step_s", "compute_share", "compile_s", "warmup_steps_run",
                "generated_tokens_per_episode", "peak_memory_gb", "grpo_step_s", "grpo_sampling_s",
                "grpo_update_s"),
    "store": ("records_per_s", "mb_per_s", "exchange_share", "step_s", "headline_store", "file"),
    "rollout_long": ("prefill_tokens_per_context_token", "slot_utilisation", "episodes_per_s",
                     "lockstep_episodes_per_s", "engine_speedup", "local_episodes_per_s",
                     "local_lockstep_episodes_per_s", "local_engine_speedup"),
}
# Further modes of a benchmark: name -> (its module, the flags beside --quick).
MODES = {"rollout_long": ("rollout", ("--workload=long",))}
NEEDS = {"model": ("torch", "transformers"), "plan": ("libtpu",)}  # CI installs requirements-tpu.txt for plan


def check_checkpoint(figures, lines):
    assert figures["preset"] == "llama-tiny" and figures["repeats"] == len(figures["load_samples_s"]) == 2
    assert 0 < figures["load_min_s"] <= figures["load_s"] and figures["file_mb"] > 0


def check_kernels(figures, lines):
    assert figures["shape"] == {"Q": 2, "K": 2, "D": 2, "T": 64, "main_rows": 4, "sub_rows": 8, "calls": 4}
    # 3 token arrays per agent read + 1 gradient per agent written, f32: (3 + 1) * 4 B * (4 + 8) rows * 64.
    assert figures["bytes_moved_mb"] * 1e6 == pytest.approx(4 * 4 * (4 + 8) * 64)
    assert figures["loss"] == {"main": "grpo", "sub": "grpo"} and figures["kernel_gb_per_s"] > 0
    assert figures["compile_ms"] == pytest.approx(figures["targets_compile_ms"] + figures["loss_grad_compile_ms"])


def check_lora(figures, lines):
    assert figures["choice"] in ("merged", "unmerged") and figures["rank"] == 2
    assert figures["merged_per_update_s"] == figures["merge_s"] + figures["merged_sample_s"]
    # Same policy either way: sampling with the same keys draws the same tokens (up to rounding ties).
    assert figures["same_tokens_frac"] > 0.9


def check_model(figures, lines):
    for key in MAIN_KEYS["model"]:
        assert figures[key] > 0, key
    assert figures["decode_out_major"] is True and figures["decode_devices"] >= 1


def check_overlap(figures, lines):
    assert figures["devices"] == 8 and figures["rollout_devices"] == 2 and figures["steps"] == 1
    for kind in ("sync", "async"):
        for role in ("sampler", "learner"):
            assert 0 <= figures[f"{kind}_{role}_busy_share"] <= 1.001, (kind, role)
    assert figures["wall_ratio"] == pytest.approx(figures["sync_step_s"] / figures["async_step_s"])
    assert figures["paper_v5p64_wall_ratio"] >= 1.0


def check_plan(figures, lines):
    assert any(line.startswith("v5e-4") and "decode" in line for line in lines)  # its table
    assert figures["size"] == "small" and figures["small_fits_v5e4"] is True
    assert figures["small_decode_gib_per_chip_v5e4"] > 0


def check_rollout(figures, lines):
    assert figures["preset"] == "smoke" and figures["rl_steps"] == 1
    assert 1 <= figures["warmup_steps_run"] <= 2 and figures["warmstart_steps"] == 2
    assert 0 < figures["compute_share"] <= 1 and figures["compile_s"] >= 0
    phases = sum(figures[f"phase_{p}"] for p in ("sampling_s", "tools_s", "rewards_s", "training_s", "other_s"))
    assert phases == pytest.approx(figures["step_s"], rel=1e-6)
    assert figures["grpo_shape"]["rows"] == 4 and figures["grpo_shape"]["seq"] == 16


def check_store(figures, lines):
    assert figures["headline_store"] == "file" and figures["exchange_share"] > 0
    assert figures["preset"] == "local" and figures["preset_sizes"] == [16, 8, 2]
    result = figures["file"]
    assert result["sizes"]["tasks_per_step"] == 4 * 2 * 2 and result["preset_exchange_s"] > 0
    assert result["fifo_measured"] and result["mb_per_step_unsync"] > result["mb_per_step"]


def check_rollout_long(figures, lines):
    # The engines' workloads: the slot engine ran every episode, prefilling each context at most once (no slot was
    # given up), and compiled nothing in its timed runs.
    assert figures["episodes"] == 4 and figures["long_shape"]["slots"] == 2 and figures["evictions"] == 0
    assert figures["prefill_tokens_per_context_token"] == 1.0  # every token a turn saw, written once
    assert figures["lockstep_prefill_tokens_per_context_token"] > 1.0
    assert 0 < figures["slot_utilisation"] <= 1 and figures["compiles_in_timed_runs"] == 0
    assert figures["local_preset"] == "local" and figures["local_episodes"] >= 128


CHECKS = {"checkpoint": check_checkpoint, "kernels": check_kernels, "lora": check_lora, "model": check_model,
          "overlap": check_overlap, "plan": check_plan, "rollout": check_rollout, "rollout_long": check_rollout_long,
          "store": check_store}


def bench_names() -> list[str]:
    return sorted(path.stem for path in BENCH.glob("*.py") if path.stem not in HELPERS)


def test_every_benchmark_says_what_its_quick_mode_prints():
    assert set(bench_names()) == set(MAIN_KEYS) - set(MODES), "add the new benchmark's main JSON keys to MAIN_KEYS"


@pytest.mark.parametrize("name", bench_names() + sorted(MODES))
def test_quick_mode_prints_its_figures_as_the_last_line(name):
    for module in NEEDS.get(name, ()):
        if importlib.util.find_spec(module) is None:
            pytest.skip(f"bench.{name} needs {module}")
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}
    env["PYTHONPATH"] = str(REPO) + os.pathsep + env.get("PYTHONPATH", "")
    module, flags = MODES.get(name, (name, ()))
    proc = subprocess.run([sys.executable, "-m", f"mgrpo_jax.bench.{module}", "--quick", *flags], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-4000:]
    lines = proc.stdout.strip().splitlines()
    assert lines, proc.stderr[-4000:]
    figures = json.loads(lines[-1])
    assert isinstance(figures, dict)
    missing = [key for key in MAIN_KEYS.get(name, ()) if key not in figures]
    assert not missing, f"bench.{name} --quick printed no {missing}"
    CHECKS.get(name, lambda *_: None)(figures, lines)
