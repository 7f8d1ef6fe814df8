"""A checkpoint written before the run loop was restructured into learners, exchanges and `core/mgrpo.py`
restores after it: the layout (`checkpoints/<step>/<agent>/`, `host_state`) and the state trees are unchanged.

The fixture is the step-1 checkpoint (and tokenizer) of a `smoke` run (warm start 0, one RL step, store
`memory://v0`) made by commit bebebc2."""

import itertools
import shutil
from pathlib import Path

import jax
import numpy as np
import optax
import pytest

from mgrpo_jax.config import get_config
from mgrpo_jax.rl.trainer import Trainer

FIXTURE = Path(__file__).parent / "data" / "checkpoint_before_issue15"
PARAM_NORM_AT_STEP_1 = 37.21232604980469  # that run's `main/train/param_norm`, logged at step 1
_stores = itertools.count()


@pytest.mark.slow
def test_checkpoint_from_before_the_restructuring_restores_and_trains_on(tmp_path):
    workdir = tmp_path / "run"
    shutil.copytree(FIXTURE, workdir)
    config = get_config("xbench", "smoke")
    config.warmstart.steps = 0
    config.train.steps = 2
    config.train.eval_every = 0
    config.store = f"memory://compat-{next(_stores)}"
    trainer = Trainer(config, str(workdir))
    fresh = jax.device_get(trainer.agents["main"].state.params)
    assert trainer.restore()
    assert (trainer.step, trainer.warm_started, trainer.feed.iterator.get_state()) == (1, True, {"next_index": 1})
    restored = {name: jax.device_get(agent.state) for name, agent in trainer.agents.items()}
    assert int(restored["main"].step) == 1 and int(restored["sub"].step) == 0  # one update of main, none of sub
    assert float(optax.tree.norm(restored["main"].params)) == pytest.approx(PARAM_NORM_AT_STEP_1, rel=1e-5)
    changed = jax.tree.map(lambda a, b: not np.array_equal(a, b), fresh, restored["main"].params)
    assert any(jax.tree.leaves(changed))  # the checkpoint's weights, not the new run's initialisation
    metrics = trainer.rl_step()
    assert np.isfinite(metrics["main/train/loss"]) and int(trainer.agents["main"].state.step) == 2
