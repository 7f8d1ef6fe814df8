"""What runs after each RL step besides the step itself, registered with a period (in the spirit of Levanter's
`TrainerHooks`): the held-out evaluation, metric writing, the progress line and checkpoints are hooks the trainer
registers, and a user's own callback is one more:

    trainer.hooks.add(lambda info: print(info.step, info.metrics["main/reward"]), every=5)

A hook is called as `fn(info)` with the step just finished (`StepInfo`: `step`, counted from 1; its `metrics`;
`last`, True on the run's last step or when the run is about to stop) when `step % every == 0` or `info.last`
(`at_last=True`). Hooks run in `order` (ties: in the order added); one that returns a dict adds its figures to the
step's metrics, which the hooks after it see: evaluation (`EVALUATE`) runs before the metrics are written
(`WRITE`), checkpoints (`SAVE`) last, a user's hook (`USER`) between evaluation and writing unless it says otherwise.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

EVALUATE, USER, WRITE, SAVE = 0, 10, 20, 30  # the built-in hooks' order


@dataclasses.dataclass
class StepInfo:
    step: int  # the RL step just finished, counted from 1
    metrics: dict  # its figures, with what the hooks before this one added
    last: bool = False  # the run's last step, or a stop was asked for: the run ends after these hooks


@dataclasses.dataclass
class Hook:
    fn: Callable[[StepInfo], dict | None]
    every: int
    order: int
    at_last: bool


class Hooks:
    """The hooks of one run, in their order."""

    def __init__(self):
        self._hooks: list[Hook] = []

    def add(self, fn: Callable[[StepInfo], dict | None], every: int = 1, *, order: int = USER,
            at_last: bool = False) -> Hook:
        """Calls `fn(info)` after every `every`-th step (and after the last one with `at_last`); returns the hook."""
        if int(every) < 1:
            raise ValueError(f"a hook's period must be a positive number of steps, got every={every!r}")
        hook = Hook(fn, int(every), order, at_last)
        self._hooks.append(hook)
        self._hooks.sort(key=lambda h: h.order)  # stable: ties keep the order they were added in
        return hook

    def remove(self, hook: Hook) -> None:
        self._hooks.remove(hook)

    def run(self, info: StepInfo) -> dict:
        """Runs the hooks due at `info.step`; returns `info.metrics` with their figures added."""
        for hook in list(self._hooks):
            if info.step % hook.every == 0 or (hook.at_last and info.last):
                added = hook.fn(info)
                if added:
                    info.metrics.update(added)
        return info.metrics
