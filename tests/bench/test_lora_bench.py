"""The LoRA sampling benchmark's code path at a tiny shape (figures are not checked: no timing assertions)."""

import json

from mgrpo_jax.bench import lora as bench


def test_tiny_benchmark_emits_one_json_line_and_both_paths_sample_the_same_tokens(capsys):
    bench.main(["--model", "tiny", "--rank", "2", "--prompts", "2", "--prompt-len", "8", "--new-tokens", "4",
                "--repeats", "1"])
    parsed = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert parsed["choice"] in ("merged", "unmerged") and parsed["rank"] == 2
    assert parsed["merged_per_update_s"] == parsed["merge_s"] + parsed["merged_sample_s"]
    # Same policy either way: greedy-free sampling with the same keys draws the same tokens (up to rounding ties).
    assert parsed["same_tokens_frac"] > 0.9
