"""`bench.plan --agent=shared`: one model serving both roles (issue 29). Its train program sees the pooled batch
(the main agent's rows + the sub-agent's), its slots program both roles' slots; the run plans the two-model setup
beside it. The shapes are checked from the config alone; the small size is compiled with the TPU compiler (skipped
without libtpu, as tests/bench/test_plan_bench.py)."""

import importlib.util

import pytest
from jax.sharding import AbstractMesh

from mgrpo_jax.bench import plan as bench
from mgrpo_jax.config import get_config, rl_batch_rows


def test_the_shared_paper_plan_pools_both_roles_rows_and_slots():
    paper = get_config("xbench", "paper")
    main_rows, sub_rows = rl_batch_rows(paper, "main"), rl_batch_rows(paper, "sub")
    assert (main_rows, sub_rows) == (16, 128)  # Q*K and Q*K*D
    shared = bench.paper_plan("shared", "paper")
    assert shared.train_rows == main_rows + sub_rows == 144
    assert shared.slots == 144 and shared.sample_rows == 128  # both roles' slots; the larger sampler call
    assert shared.model == bench.paper_plan("sub").model and shared.model.num_experts == 128  # one 30B-A3B
    # 144 rows do not split over v5p-64's 32 row shards (expert 8 x fsdp 4): fsdp hands a factor to tensor
    # (16 row shards), and the step takes one row per row shard per micro-batch: 9 micro-batches.
    sizes = bench.mesh_for_rows(shared.mesh, 32, shared.train_rows)
    assert sizes == {"data": 1, "expert": 8, "fsdp": 2, "tensor": 2}
    assert bench.micro_for(shared, AbstractMesh(tuple(sizes.values()), tuple(sizes))) == 9
    # The two-model plans are unchanged by it: the sub-agent keeps fsdp 4 and 4 micro-batches of 32 rows.
    sub = bench.paper_plan("sub")
    sub_sizes = bench.mesh_for_rows(sub.mesh, 32, sub.train_rows)
    assert sub_sizes == {"data": 1, "expert": 8, "fsdp": 4, "tensor": 1} and sub.slots == 0
    assert bench.micro_for(sub, AbstractMesh(tuple(sub_sizes.values()), tuple(sub_sizes))) == 4


@pytest.mark.skipif(importlib.util.find_spec("libtpu") is None, reason="needs libtpu (requirements-tpu.txt)")
def test_the_shared_small_plan_compiles_beside_the_two_models():
    figures = bench.main(["--size=small", "--agent=shared", "--programs=train"])
    assert figures["agent"] == "shared" and figures["train_rows"] == 10
    assert figures["small_shared_main_rows"] + figures["small_shared_sub_rows"] == figures["train_rows"]
    assert figures["small_shared_train_micro_batches_v5e4"] == 5  # 10 rows, 2 row shards: one row per shard
    assert figures["small_main_train_micro_batches_v5e4"] == 1 and figures["small_sub_train_micro_batches_v5e4"] == 2
    for who in ("shared", "main", "sub"):
        assert 0 < figures[f"small_{who}_train_gib_per_chip_v5e4"] < 1 and figures[f"small_{who}_fits_v5e4"]
    assert figures["small_shared_chips_v5e4"] == 4 and figures["small_two_models_chips_v5e4"] == 8
    assert figures["small_two_models_fits_v5e4"] is True
    assert figures["small_two_models_max_gib_per_chip_v5e4"] == max(figures["small_main_max_gib_per_chip_v5e4"],
                                                                    figures["small_sub_max_gib_per_chip_v5e4"])
    assert not any(k.startswith("small_train_") for k in figures)  # the shared plan's keys are its own
