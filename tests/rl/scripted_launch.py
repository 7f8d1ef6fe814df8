"""`launch/tpu_run.py` with the main agent's first turn scripted as a delegation (test-only).

    python tests/rl/scripted_launch.py --config=experiments/xbench.py:smoke --role=main ...

A `smoke` main agent after a one-step warm start never delegates on its own, so the decoupled-mode tests would
not exchange a single task. This wrapper replaces the first sampled turn of every main episode with a
`delegate` call (the sampled turns after it, and every sub-agent turn, stay the model's own), then runs the
real entry point with the given flags. It changes nothing for the sub role, whose main runtime has no sampler.
Importing it also registers the test-only advantage estimator `alternating`.
"""

from __future__ import annotations

import os
import runpy
import sys

import numpy as np

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, REPO)

import jax.numpy as jnp  # noqa: E402

from mgrpo_jax.core.advantages import available_advantages, register_advantage  # noqa: E402
from mgrpo_jax.env import protocol  # noqa: E402
from mgrpo_jax.env.prompts import SYSTEM, USER  # noqa: E402
from mgrpo_jax.rl.trainer import Trainer  # noqa: E402

TASK = "Find the year the entity in the question was founded."


if "alternating" not in available_advantages():
    @register_advantage("alternating")
    def alternating_advantages(rewards, weights, **unused):
        """+1 / -1 on alternate rollouts whatever the rewards (`--config.advantages.estimator=alternating`): an
        untrained smoke policy (reward 0) still gets updates, so each step's sampling depends on the weights the
        previous steps trained."""
        sign = jnp.where(jnp.arange(rewards.shape[-1]) % 2 == 0, 1.0, -1.0)
        return sign[None, :] * weights


class DelegateFirst:
    """A sampler whose first turn of an episode (a prompt with only the system and user messages) is a
    delegate call; every other row is sampled by the wrapped sampler."""

    def __init__(self, sampler, tokenizer):
        self.sampler = sampler
        self.top_k, self.top_p = sampler.top_k, sampler.top_p  # the filters its sampled rows are drawn with
        self.eot = tokenizer.end_of_turn_id
        self.first_turn_eots = tokenizer.render_chat([(SYSTEM, "s"), (USER, "u")])[0].count(self.eot)
        self.call = tokenizer.encode(protocol.render_tool_call("delegate", {"task": TASK, "context": ""})) + [self.eot]

    def sample(self, prompts, *, max_new, **kwargs):
        out = self.sampler.sample(prompts, max_new=max_new, **kwargs)
        tokens, logprobs, lengths, stopped = (np.array(x) for x in out[:4])
        for row, prompt in enumerate(prompts):
            if list(prompt).count(self.eot) == self.first_turn_eots and len(self.call) <= max_new:
                tokens[row] = 0
                tokens[row, : len(self.call)] = self.call
                logprobs[row] = 0.0
                lengths[row], stopped[row] = len(self.call), True
        return type(out)(tokens, logprobs, lengths, stopped, *out[4:])

    @property
    def version(self):  # the policy version an asynchronous run tags the sampled turns with
        return getattr(self.sampler, "version", 0)

    def update_weights(self, params):
        self.sampler.update_weights(params)


_init = Trainer.__init__


def _scripted_init(self, config, workdir, job="colocated"):
    _init(self, config, workdir, job)
    engines = [self.engine]
    if self.rollouts is not None and self.rollouts.collector is not None:  # an asynchronous run's sampler thread
        engines.append(self.rollouts.engine)
    for engine in engines:
        if engine.top.sampler is not None and engine.top.can_delegate:
            engine.top.sampler = DelegateFirst(engine.top.sampler, self.tokenizer)


if __name__ == "__main__":  # importing the module (for `DelegateFirst`) patches nothing
    Trainer.__init__ = _scripted_init
    entry = os.path.join(REPO, "launch", "tpu_run.py")
    sys.argv = [entry, *sys.argv[1:]]
    runpy.run_path(entry, run_name="__main__")
