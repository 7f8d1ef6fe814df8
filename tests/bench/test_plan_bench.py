"""The compiled-plan benchmark at its small size, with the TPU compiler (libtpu; skipped where it is not installed,
CI installs requirements-tpu.txt): abstract TPU v5e devices, the train step and the sampler's prefill and decode
compiled for them with no arrays allocated, per-chip memory read from the compiled plans."""

import dataclasses

import jax
import numpy as np
import pytest

pytest.importorskip("libtpu")

from mgrpo_jax.agent.optim import make_optimizer  # noqa: E402
from mgrpo_jax.agent.state import abstract_agent_state  # noqa: E402
from mgrpo_jax.bench import plan as bench  # noqa: E402


def test_small_plans_compile_for_a_tpu_topology_and_account_the_sharded_state():
    assert jax.default_backend() == "cpu"  # the TPU topology is requested explicitly; JAX itself stays on CPU
    plan = bench.small_plan()
    rows = bench.plan_topology(plan, "v5e-4", bench.SMALL_TOPOLOGIES["v5e-4"])
    assert [r["program"] for r in rows] == list(bench.PROGRAMS)
    assert all(r["chips"] == 4 and r["mesh"] == {"data": 1, "fsdp": 2, "tensor": 2} for r in rows)
    devices = bench.topology_devices("v5e:2x2")
    assert {d.platform for d in devices} == {"tpu"}

    # The train step's arguments are the agent state (params + Adam moments, float32) and the batch, sharded
    # over the 4 chips: at least a quarter of the state per chip, and less than all of it.
    _, abs_state, _ = abstract_agent_state(plan.model, make_optimizer(plan.optim),
                                           bench.build_mesh(plan.mesh, devices))
    state_bytes = sum(np.prod(x.shape) * x.dtype.itemsize for x in jax.tree.leaves(abs_state))
    train = rows[0]["bytes"]
    assert state_bytes / 4 <= train["arguments"] < state_bytes
    assert train["aliased"] > 0  # the state is donated
    assert rows[0]["micro"] == 2 and all(r["fits"] and 0 < r["gib"] < 1 for r in rows)
    # The KV cache ([layers, rows, kv_heads, slots, head_dim] bf16, k and v) is an argument of prefill and decode.
    cache_bytes = 2 * plan.model.n_layers * plan.sample_rows * plan.model.n_kv_heads * plan.seq_len * \
        plan.model.head_dim * 2
    for r in rows[1:]:
        assert r["bytes"]["arguments"] >= cache_bytes / 4


def test_an_out_of_memory_refusal_reads_as_a_lower_bound():
    message = ("RESOURCE_EXHAUSTED: Ran out of memory on HBM, the total memory required for HLO temporaries "
               "(20.92G) exceeds available HBM (15.75G).")
    assert bench.refused_gib(message) == pytest.approx(20.92)
    assert bench.refused_gib(message.replace("20.92G", "512.00M")) == pytest.approx(0.5)
    assert bench.refused_gib("INVALID_ARGUMENT: something else") is None


def test_small_moe_plan_puts_the_experts_on_the_expert_axis():
    figures = bench.main(["--size=small_moe", "--programs=decode"])
    assert figures["small_moe_fits_v5e4"] is True and figures["small_moe_decode_gib_per_chip_v5e4"] > 0
    plan = bench.small_moe_plan()
    mesh = bench.build_mesh(plan.mesh, bench.topology_devices("v5e:2x2"))
    _, abs_state, _ = abstract_agent_state(plan.model, make_optimizer(plan.optim), mesh)
    assert abs_state.params["layers"]["expert_gate"].sharding.spec[1] == "expert"


def test_a_kl_reference_is_planned_beside_the_state():
    """With kl_coef > 0 the train program also holds the frozen reference (one more copy of the parameters per
    chip) and runs its forward; with kl_coef 0 it holds none."""
    plan = bench.small_plan()
    with_kl = dataclasses.replace(plan, loss_hparams={**plan.loss_hparams, "kl_coef": 0.01})
    devices = bench.topology_devices("v5e:2x2")
    _, abs_state, _ = abstract_agent_state(plan.model, make_optimizer(plan.optim),
                                           bench.build_mesh(plan.mesh, devices))
    param_bytes = sum(np.prod(x.shape) * x.dtype.itemsize for x in jax.tree.leaves(abs_state.params))
    plain, kl = (bench.plan_topology(p, "v5e-4", bench.SMALL_TOPOLOGIES["v5e-4"], programs=("train",))[0]["bytes"]
                 for p in (plan, with_kl))
    assert kl["arguments"] - plain["arguments"] >= param_bytes / 4 * 0.99  # the reference, sharded over 4 chips


def test_row_shards_beyond_the_rows_go_to_the_tensor_axis():
    moe_mesh = {"data": 1, "fsdp": -1, "tensor": 1, "expert": 8}
    assert bench.mesh_for_rows(moe_mesh, 32, 128) == {"data": 1, "fsdp": 4, "tensor": 1, "expert": 8}
    assert bench.mesh_for_rows(moe_mesh, 256, 128) == {"data": 1, "fsdp": 16, "tensor": 2, "expert": 8}
    assert bench.mesh_for_rows({"data": 1, "fsdp": -1, "tensor": 4}, 256, 128) == {"data": 1, "fsdp": 64, "tensor": 4}


def test_a_topology_of_another_size_is_refused_before_anything_compiles(capsys):
    # The default plans the small size (minutes); the paper preset's topologies need --size=paper or --full.
    with pytest.raises(SystemExit) as info:
        bench.main(["--topologies=v5p-64"])
    assert info.value.code == 2
    assert "--topologies v5p-64: not a topology of the small plan (its topologies: v5e-4)" in capsys.readouterr().err
