"""What passes between the main side and the sub side of one RL step, and how.

The run loop (`Trainer.rl_step`, mgrpo_jax/rl/trainer.py) is the same for every mode and job; an exchange
decides where the two sides live. Per step s:

    exchange.before_step(s)                        # the main job may wait here for the sub job to catch up
    main side collects a MainStep                  # rollouts (delegations: the local sub sampler, or
                                                   #   `exchange.delegate`) and the judges' arrays
    exchange.hand_off(s, main_step, sub_version)   # -> SubStep: the step's data for the targets and the sub side
    mgrpo_targets(sub_step.arrays)
    exchange.publish(s, arrays, targets)           # the main job's step record, for the sub job
    ... each side builds its rows and updates ...
    exchange.commit(s, sub_version, served); exchange.end_step(s)
    after each checkpoint `after_save`; at the end `finish`.

The base exchange (`InProcessExchange`) hands the main side's rollout to the sub side by reference: both sides
in this process, or the main job, whose targets read its own arrays. The store exchanges of the decoupled mode
(`mgrpo_jax/rl/decoupled.py`) carry the data through the shared store. An exchange holds the store and the
step counters it needs, never the trainer.
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
    """The interface, with the defaults of an exchange inside one process."""

    delegate = None  # the engine's sub executor on the main side (None: the engine's own sub-agent)

    def before_step(self, step: int) -> dict:
        return {}

    def hand_off(self, step: int, collected: MainStep | None, version: int) -> SubStep | None:
        """The step's data, from the main side's `collected` (None in the sub job: it arrives through the store);
        None when the main job finished without this step."""
        return SubStep(collected.rollout, collected.arrays, version, dict(collected.metrics))

    def publish(self, step: int, arrays: RolloutArrays, targets: Targets) -> None:
        pass

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
