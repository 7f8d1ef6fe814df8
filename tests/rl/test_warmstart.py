"""A preempted warm start resumes mid-way: checkpointed on preemption and every `warmstart.checkpoint_every` steps,
it continues where it stopped (agents' weights, SFT optimizer, batch order, format-check rounds), ends with the
weights of an uninterrupted warm start, and its checkpoints are dropped once the first RL checkpoint exists."""

import jax
import numpy as np
import pytest

from mgrpo_jax.rl import warmstart
from mgrpo_jax.rl.trainer import Trainer
from mgrpo_jax.runtime.checkpoint import PreemptionGuard
from mgrpo_jax.runtime.metrics import read_jsonl
from tests.rl.test_trainer import _compact


class StopAfter(PreemptionGuard):
    """A guard that asks to stop at its `calls`-th poll, as a SIGTERM arriving then would."""

    def __init__(self, calls: int):
        super().__init__(signals=())
        self.calls = calls

    def should_stop(self) -> bool:
        self.calls -= 1
        if self.calls == 0:
            self.request_stop()
        return super().should_stop()


def _config():
    config = _compact(steps=1)
    config.warmstart.steps, config.warmstart.check_every, config.warmstart.checkpoint_every = 6, 4, 2
    config.warmstart.format_target = 1.01  # never reached: both agents run their 6 steps, in rounds of 4 and 2
    return config


def _params(trainer):
    return {name: jax.device_get(agent.state.params) for name, agent in trainer.agents.items()}


@pytest.mark.slow
def test_a_preempted_warm_start_continues_from_its_checkpoint(tmp_path):
    straight = Trainer(_config(), str(tmp_path / "straight"))
    assert straight.warm_start()
    expected = _params(straight)

    workdir = tmp_path / "preempted"
    first = Trainer(_config(), str(workdir))
    # main trains 4 steps (round 1), then sub is stopped before its 3rd step: 6 steps done over both agents.
    assert not first.warm_start(StopAfter(7))
    assert sorted(p.name for p in (workdir / warmstart.CHECKPOINTS).iterdir() if p.name.isdigit()) == ["6"]

    resumed = Trainer(_config(), str(workdir))
    assert resumed.warm_start()
    got = _params(resumed)
    for name in expected:
        jax.tree.map(np.testing.assert_array_equal, got[name], expected[name])
    losses = [r["warmstart/sub/loss"] for r in read_jsonl(workdir / "metrics.jsonl") if "warmstart/sub/loss" in r]
    straight_losses = [r["warmstart/sub/loss"] for r in read_jsonl(tmp_path / "straight" / "metrics.jsonl")
                       if "warmstart/sub/loss" in r]
    assert losses[-1] == straight_losses[-1]

    # The run goes on to RL; its first RL checkpoint replaces the warm-start ones.
    resumed.run()
    assert not (workdir / warmstart.CHECKPOINTS).exists()
    assert resumed.checkpointer.all_steps()[-1] == 1


def test_counterfactual_demonstrations_answer_with_the_twins_facts_not_the_worlds(tmp_path):
    config = _config()
    config.warmstart.counterfactual_share = 1.0
    trainer = Trainer(config, str(tmp_path / "run"))
    start = warmstart.WarmStart(config, trainer.agents, trainer.env, trainer.engine, trainer.writer, trainer.workdir)
    tokenizer = trainer.agents["sub"].tokenizer
    judge = trainer.env.judge
    demos = start.demonstrations("sub", 200, seed=0)
    # A sub-agent demonstration ends `[answer V ]`; in a twin, V is the twin's value, almost never the world's.
    right = []
    for ids, _ in demos:
        words = [tokenizer.id_to_piece(int(i)).lstrip("\u2581") for i in ids]
        task = words[words.index("?") + 1: words.index("?") + 3]
        answer = words[len(words) - 1 - words[::-1].index("[answer") + 1]
        right.append(judge.score(" ".join(task), answer))
    assert np.mean(right) < 0.2
    config.warmstart.counterfactual_share = 0.0
    real = warmstart.WarmStart(config, trainer.agents, trainer.env, trainer.engine, trainer.writer, trainer.workdir)
    assert real.demonstrations("sub", 200, seed=0) != demos
