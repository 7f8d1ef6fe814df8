"""bench.plan's paged program (issue 37): the episode lengths it counts, and the paged decode chunk compiled for a TPU
topology with the Pallas paged-attention kernel (libtpu; skipped where it is not installed), or the gather path with
the kernel's error where the kernel does not compile."""

import dataclasses

import numpy as np
import pytest

from mgrpo_jax.bench import plan as bench


def test_the_paper_lengths_are_the_stated_shape():
    lengths = bench.PAPER_LENGTHS.sample(20_000, seed=1)
    # A 1,024-token prompt, 10-15 turns of 16-1,024 tokens and 9-14 responses of 100-1,000, with headers.
    assert lengths.min() >= 1024 + 10 * 20 + 9 * 104 and lengths.max() <= 32_768
    assert 8_300 < lengths.mean() < 9_000
    small = bench.PAPER_LENGTHS.scaled(512, 64)
    assert small.context == 512 and small.turn_tokens == (1, 64) and small.response_tokens == (1, 15)
    plan = dataclasses.replace(bench.small_plan(), seq_len=32_768, max_new=1024)
    held = bench.episode_blocks(plan, 32, n=20_000)
    # Each episode holds its final length plus one turn's budget, in whole blocks: a few more than tokens / 32.
    assert (held["mean_tokens"] + 1024) / 32 <= held["blocks"] <= (held["mean_tokens"] + 1024) / 32 + 1
    assert held["at_context"] == 0.0


def test_the_paged_decode_compiles_for_a_tpu_with_the_pallas_kernel():
    pytest.importorskip("libtpu")
    plan = bench.small_plan()
    plan = dataclasses.replace(plan, model=dataclasses.replace(plan.model, head_dim=128))  # the kernel's lanes
    mesh = bench.build_mesh(plan.mesh, bench.topology_devices("v5e:2x2"))
    rows, shards = bench.slot_rows(plan, mesh)
    blocks = shards * bench.blocks_for(plan.seq_len, bench.PAGED_BLOCK)
    lowered = bench.lower_paged(plan, mesh, rows, blocks, attention="pallas")
    assert "paged_flash_attention" in lowered.as_text()  # the kernel, not a gather
    memory = bench.per_chip_bytes(lowered.compile())
    # The store (k and v per layer, bf16) is an argument, its blocks over the 2 row shards, heads over tensor 2.
    store = 2 * plan.model.n_layers * blocks * bench.PAGED_BLOCK * plan.model.n_kv_heads * 128 * 2
    assert store / 4 <= memory["arguments"] and memory["aliased"] >= store / 4  # donated


def test_where_the_kernel_does_not_compile_the_gather_path_is_planned_and_the_error_kept():
    """The small plan's head_dim of 64 is not a multiple of the kernel's 128 lanes."""
    pytest.importorskip("libtpu")
    rows = bench.plan_topology(bench.small_plan(), "v5e-4", "v5e:2x2", programs=("paged",))
    (row,) = rows
    assert row["paged_attention"] == "gather" and "divisible by 8 and 128" in row["paged_pallas_error"]
    assert row["fits"] and row["paged_episodes_fit"] > 0
    assert np.isclose(row["paged_blocks_per_episode"], bench.episode_blocks(bench.small_plan(), 32)["blocks"])
