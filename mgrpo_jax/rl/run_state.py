"""What a run's checkpoint holds and how a job returns to it: every learner's arrays (each model once), the step,
the question iterator's position, whether the warm start is done, and the sub side's own state (the FIFO offset
and the records waiting in it)."""

from __future__ import annotations

import logging
import time

from mgrpo_jax.rl.warmstart import CHECKPOINTS as WARMSTART_CHECKPOINTS
from mgrpo_jax.runtime.checkpoint import CHECKPOINTS, Checkpointer, describe_resume, resume_points
from mgrpo_jax.runtime.metrics import write_summary

log = logging.getLogger(__name__)


class RunState:
    """The checkpointed state of one job: `learners` {name: Learner}, the question `feed`'s order, the `sub` side."""

    def __init__(self, checkpointer: Checkpointer, learners: dict, feed, sub):
        self.checkpointer, self.learners, self.feed, self.sub = checkpointer, learners, feed, sub
        # step -> the feed's position before that step's questions, where they are drawn ahead of training (an
        # asynchronous run's sampler, mgrpo_jax/rl/asynchronous.py); None: the feed's own position.
        self.iterator_state = None

    def items(self) -> dict:
        return {k: v for agent in self.learners.values() for k, v in agent.checkpoint_items().items()}

    def host_state(self, step: int, warm_started: bool) -> dict:
        position = self.iterator_state(step) if self.iterator_state else self.feed.iterator.get_state()
        return {"step": step, "iterator": position, "warm_started": warm_started,
                "fifo_offset": 0, **self.sub.state()}

    def save(self, step: int, warm_started: bool, force: bool = False) -> None:
        self.checkpointer.save(step, self.items(), self.host_state(step, warm_started), force=force)

    def restore(self) -> tuple[int, bool] | None:
        """(step, warm started) of the newest complete checkpoint, loaded into the learners, the iterator and the
        sub side; None when there is none."""
        # The current states are the restore targets: their shapes and shardings place the restored arrays.
        restored = self.checkpointer.restore_latest(self.items())
        if restored is None:
            return None
        _, states, host = restored
        for agent in self.learners.values():
            agent.load_checkpoint_items(states)
        self.feed.iterator.set_state(host["iterator"])
        self.sub.load_state(host)
        log.info("resumed from step %d", int(host["step"]))
        return int(host["step"]), bool(host["warm_started"])


def report_stop(config, workdir: str, summary: dict, status: str, step: int, *, at_once: bool, started: float,
                curves: list[str], write: bool) -> dict:
    """At the end of a job, whatever stopped it: `summary.json` and its figure (with `write`: the first process;
    `curves`: the rewards drawn, none in the sub job: the main job's figure has them), and where a rerun resumes,
    in the log when it was cut short. Returns the resume points."""
    resume = resume_points(workdir, {"checkpoint": CHECKPOINTS, "warmstart_checkpoint": WARMSTART_CHECKPOINTS})
    if write:
        write_summary(workdir, summary, curves, {"status": status, "step": step, "mode": config.mode,
                                                 "resume_from": resume, "wall_time_s": time.time() - started,
                                                 "config": config},
                      title=f"{config.benchmark}, {config.preset} preset, {config.mode} ({status} at step {step})")
    if status in ("interrupted", "preempted"):
        log.warning("%s: %s; run the same command to resume", status, describe_resume(resume, at_once))
    return resume
