"""`bench.plan --lora` at the small size with the TPU compiler (skipped without libtpu, as tests/bench/
test_plan_bench.py): the LoRA train step's per-chip arguments are the frozen base, the adapters and their Adam
state, far less than full fine-tuning's parameters and moments."""

import jax
import numpy as np
import pytest

pytest.importorskip("libtpu")

from mgrpo_jax.agent.optim import make_optimizer  # noqa: E402
from mgrpo_jax.agent.state import abstract_agent_state  # noqa: E402
from mgrpo_jax.bench import plan as bench  # noqa: E402


def _bytes(tree):
    return sum(np.prod(x.shape) * x.dtype.itemsize for x in jax.tree.leaves(tree))


def test_the_lora_train_step_holds_the_base_and_the_adapters_state_only():
    plan = bench.small_plan()
    lora = bench.paper_plan(preset="paper_lora").lora
    assert (lora.rank, lora.targets) == (64, ("q", "k", "v", "o", "gate", "up", "down"))
    plan = bench.dataclasses.replace(plan, lora=lora)
    mesh = bench.build_mesh(plan.mesh, bench.topology_devices(bench.SMALL_TOPOLOGIES["v5e-4"]))
    optimizer = make_optimizer(plan.optim)
    _, adapters, _, base = bench.lora_train_state(plan, mesh, optimizer)
    full = _bytes(abstract_agent_state(plan.model, optimizer, mesh)[1])  # params + two Adam moments
    assert _bytes(base) == pytest.approx(full / 3, rel=1e-3) and _bytes(adapters) < _bytes(base)
    [row] = bench.plan_topology(plan, "v5e-4", bench.SMALL_TOPOLOGIES["v5e-4"], programs=("train",))
    arguments = row["bytes"]["arguments"]
    assert (_bytes(base) + _bytes(adapters)) / 4 <= arguments < full / 4 and row["fits"]
