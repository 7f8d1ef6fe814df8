"""The kernel benchmark's code path at a tiny shape (figures are not checked: no timing assertions)."""

import json

import pytest

from mgrpo_jax.bench import kernels as bench

TINY = ["--queries", "2", "--rollouts", "2", "--d_max", "2", "--seq_len", "64", "--repeats", "1"]
REQUIRED = ("kernel_gb_per_s", "copy_gb_per_s", "kernel_ms", "bytes_moved_mb", "fraction_of_copy",
            "reuse_freed_memory", "hlo_row_by_t_buffers")


def test_tiny_benchmark_emits_one_json_line(capsys, monkeypatch):
    # mallopt is process-wide: keep it out of the test process (the benchmark's own process sets it).
    monkeypatch.setattr(bench, "reuse_freed_memory", lambda: False)
    figures = bench.main(TINY)
    last = capsys.readouterr().out.strip().splitlines()[-1]
    parsed = json.loads(last)
    for key in REQUIRED:
        assert key in parsed, key
    assert parsed["kernel_gb_per_s"] > 0 and parsed["copy_gb_per_s"] > 0
    assert parsed["shape"] == {"Q": 2, "K": 2, "D": 2, "T": 64, "main_rows": 4, "sub_rows": 8}
    # 3 token arrays per agent read + 1 gradient per agent written, f32: (3 + 1) * 4 B * (4 + 8) rows * 64.
    assert parsed["bytes_moved_mb"] * 1e6 == pytest.approx(4 * 4 * (4 + 8) * 64)
    assert parsed["kernel_gb_per_s"] == figures["kernel_gb_per_s"]
    assert parsed["reuse_freed_memory"] is False


def test_row_by_t_buffers_counts_entry_arrays_only():
    hlo = """HloModule m
%fused (p: f32[8,64]) -> f32[8,64] {
  %x = f32[8,64]{1,0} exponential(%p)
}
ENTRY %main (a: f32[8,64]) -> f32[8,64] {
  %a = f32[8,64]{1,0} parameter(0)
  %f = f32[8,64]{1,0} fusion(%a), kind=kLoop, calls=%fused
  %r = f32[8]{0} fusion(%f), kind=kLoop, calls=%fused
  ROOT %g = f32[8,64]{1,0} fusion(%f, %r), kind=kLoop, calls=%fused
}
"""
    assert bench.row_by_t_buffers(hlo, 8, 64) == 2
