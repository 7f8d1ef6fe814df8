"""What passes between the main side and the sub side of one RL step, and the transport that carries it.

The run loop (`Trainer.rl_step`, mgrpo_jax/rl/trainer.py) is the same for every mode and job; the sides
(mgrpo_jax/rl/sides.py) collect, the exchange only moves data. Per step s:

    exchange.before_step(s, main version)          # the main job may wait here for the sub job to catch up
    main side collects a MainStep                  # rollouts (delegations: the local sub sampler, or
                                                   #   `exchange.delegate`) and the judges' arrays
    sub side collects a SubStep                    # the main side's data by reference, or (decoupled sub job)
                                                   #   the tasks it served, once the main job's record is in
    credit targets of sub_step.arrays
    exchange.publish(s, arrays, targets)           # the main job's step record, for the sub job
    ... each side builds its rows and updates ...
    exchange.commit(s, sub_version, served); exchange.end_step(s)
    at the end `finish`.

The base exchange (`Exchange`) carries nothing: both sides are in this process. The store exchanges of the
decoupled mode (`mgrpo_jax/rl/decoupled.py`) post tasks, wait for answers and publish and read step records in the
shared store. An exchange holds the store and the step counters it needs, never the trainer.
"""

from __future__ import annotations

import dataclasses

from mgrpo_jax.core.mgrpo import RolloutArrays, Targets
from mgrpo_jax.rollout.episode import RolloutBatch


@dataclasses.dataclass
class MainStep:
    """What the main side collected in one step."""

    rollout: RolloutBatch  # Q questions x K whole-system rollouts
    arrays: RolloutArrays  # what the judges said of them
    metrics: dict  # the rollout's and the judges' figures, with `time/*`


@dataclasses.dataclass
class SubStep:
    """The data of one step as the targets and the sub side see it."""

    rollout: RolloutBatch  # the step's sub-trajectories, in the [Q][K][d_k] layout of its rollouts
    arrays: RolloutArrays  # the judge arrays, with the main agent's own `format_ok` / `correct`
    versions: int | dict  # the sub policy version that sampled each (query, rollout, invocation), or one for all
    metrics: dict = dataclasses.field(default_factory=dict)  # the step's figures so far (`time/*`, `sub/served`...)


class Exchange:
    """The transport's interface, with the defaults of a job that holds both sides (nothing to carry)."""

    delegate = None  # the engine's sub executor on the main side (None: the engine's own sub-agent)

    def delegation(self):
        """A sub executor for an asynchronous sampler of its own (None: the engine's own sub-agent)."""
        return None

    def before_step(self, step: int, version: int) -> dict:
        """Step `step` starts, the main agent at policy `version`; returns the step's waiting figures."""
        return {}

    def publish(self, step: int, arrays: RolloutArrays, targets: Targets) -> None:
        pass

    def commit(self, step: int, version: int, served: int) -> None:
        pass

    def end_step(self, step: int) -> None:
        pass

    def finish(self, steps: int) -> None:
        pass
