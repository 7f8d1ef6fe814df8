"""The kernel benchmark's helpers (figures are not checked: no timing assertions)."""

from mgrpo_jax.bench import kernels as bench

# The benchmark's run at tiny sizes is its quick mode (tests/bench/test_quick_modes.py).


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
