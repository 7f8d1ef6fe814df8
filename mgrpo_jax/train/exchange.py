"""What passes between the main side and the sub side of one RL step, and how.

The run loop (`mgrpo_jax/train/trainer.py`) is the same for every mode; an exchange decides where the two sides
live. Per step s:

    main side:  exchange.before_step(s)             # may wait for the sub side to catch up
                rollout (delegations: the local sub sampler, or `exchange.delegate`)
                exchange.publish(s, rollout, arrays)
    sub side:   exchange.receive(s, version)         # -> SubStep: the step's sub-trajectories and judge arrays
                ... targets, update ...
                exchange.commit(s, version, served)
    both:       exchange.end_step(s); after each checkpoint `after_save`; at the end `finish`.

`InProcessExchange` (colocated: both sides in this process) passes the rollout by reference. The store
exchanges of the decoupled mode (`mgrpo_jax/train/decoupled.py`) carry the same data through the shared store.
"""

from __future__ import annotations

import dataclasses

from mgrpo_jax.core.mgrpo import RolloutArrays
from mgrpo_jax.rollout.episode import RolloutBatch


@dataclasses.dataclass
class SubStep:
    """What the sub side of one step trains on."""

    rollout: RolloutBatch  # the step's sub-trajectories, in the [Q][K][d_k] layout of its rollouts
    arrays: RolloutArrays  # the judge arrays, with the main agent's own `format_ok` / `correct`
    versions: int | dict  # the sub policy version that sampled each (query, rollout, invocation), or one for all
    metrics: dict = dataclasses.field(default_factory=dict)  # the exchange's own (`time/serve_s`, `sub/served`...)


class Exchange:
    """The interface, with the no-op defaults of a side that needs nothing at that point."""

    delegate = None  # the engine's sub executor on the main side (None: the engine's own sub-agent)

    def before_step(self, step: int) -> dict:
        return {}

    def publish(self, step: int, rollout: RolloutBatch, arrays: RolloutArrays) -> None:
        raise NotImplementedError

    def receive(self, step: int, version: int) -> SubStep | None:
        """The sub side's data of `step`; None when the main side finished without it."""
        raise NotImplementedError

    def commit(self, step: int, version: int, served: int) -> None:
        pass

    def end_step(self, step: int) -> None:
        pass

    def after_save(self, checkpoint_steps: list[int]) -> None:
        pass

    def finish(self, steps: int) -> None:
        pass


class InProcessExchange(Exchange):
    """Both sides in this process: the main side's rollout is the sub side's data."""

    def __init__(self):
        self._published: dict[int, tuple[RolloutBatch, RolloutArrays]] = {}

    def publish(self, step, rollout, arrays):
        self._published[step] = (rollout, arrays)

    def receive(self, step, version):
        rollout, arrays = self._published.pop(step)
        return SubStep(rollout, arrays, version)
