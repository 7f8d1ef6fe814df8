"""The M-GRPO run: warm start, then RL steps of the whole system, with hooks (mgrpo_jax/rl/hooks.py) for
evaluation, logs and checkpoints. `Trainer(config, workdir).run()` resumes from the workdir's latest checkpoint.

One RL step (`rl_step`), the same in every mode and job, over two sides (mgrpo_jax/rl/sides.py) and an exchange
(mgrpo_jax/rl/exchange.py): collect (the main side's Q*K whole-system rollouts and the judges' arrays; the sub side's
view of them) -> credit (`config.credit`, mgrpo_jax/core/credit.py: both agents' advantages in one jitted call) ->
rows (each side's batches) -> update (each side's learner, or one pooled update of a shared model). Modes and jobs:
mgrpo_jax/config.py and mgrpo_jax/rl/decoupled.py.
"""

from __future__ import annotations

import logging
import os
import time

import jax

from mgrpo_jax.config import credit_name
from mgrpo_jax.core import credit_config_type, get_credit
from mgrpo_jax.rl import curriculum, decoupled, evaluation, sides, warmstart
from mgrpo_jax.rl.asynchronous import AsyncRollouts
from mgrpo_jax.rl.hooks import EVALUATE, SAVE, WRITE, Hooks, StepInfo
from mgrpo_jax.rl.run_state import RunState, report_stop
from mgrpo_jax.rl.system import JOBS
from mgrpo_jax.runtime import files
from mgrpo_jax.runtime.checkpoint import CHECKPOINTS, Checkpointer, PreemptionGuard, abandon_saves, init_from_checkpoint
from mgrpo_jax.runtime.metrics import MetricWriter, read_summary
from mgrpo_jax.runtime.progress import RunProgress
from mgrpo_jax.runtime.seeds import derive_seed
from mgrpo_jax.store import open_store

log = logging.getLogger(__name__)


class StampedWriter(MetricWriter):
    """The run's metrics writer: every row (warm start, evaluation, RL step) also records `stamp()`, the run's world
    seed and the hash of the questions it serves (`curriculum.QuestionFeed.identity`)."""

    def __init__(self, *args, stamp, **kwargs):
        super().__init__(*args, **kwargs)
        self.stamp = stamp

    def write(self, step: int, metrics, **kwargs) -> dict:
        return super().write(step, {**self.stamp(), **metrics}, **kwargs)


class Trainer:
    """One job of a run (`job`, the launcher's --role): colocated, or the decoupled mode's `main` / `sub`."""

    def __init__(self, config, workdir: str, job: str = "colocated"):
        if job not in JOBS:
            raise ValueError(f"unknown job (--role) {job!r}: expected one of {tuple(JOBS)}")
        workdir = workdir if job == "colocated" else os.path.join(workdir, job)
        self.config, self.job, self.step, self.warm_started = config, job, 0, config.warmstart.steps == 0
        self.workdir = workdir if "://" in workdir else os.path.abspath(workdir)  # Orbax needs absolute paths
        self.is_main_process, self.status, self.at_once = jax.process_index() == 0, "stopped", False
        files.as_path(self.workdir).mkdir(parents=True, exist_ok=True)
        start, store = time.perf_counter(), open_store(config.store)
        self.checkpointer = Checkpointer(self.workdir, save_every=config.train.checkpoint_every)
        self.exchange, self.system = decoupled.job_system(config, job, self.workdir, store,
                                                          resuming=self.checkpointer.latest_step() is not None)
        self.writer = StampedWriter(self.workdir, self.is_main_process, console=False,
                                    stamp=lambda: self.feed.identity())
        self.progress = RunProgress(False)
        self.credit = get_credit(credit_name(config))
        self.targets_config = credit_config_type(credit_name(config)).from_config(config)
        self.feed = curriculum.QuestionFeed(config, self.env, self.workdir)
        serving = decoupled.serving(self.exchange, config, self.workdir, self.system) if job == "sub" else None
        pair = sides.build_sides(config, self.agents, self.engine, self.env, store, self.workdir,
                                 self.is_main_process, serving)
        self.sides, self.main, self.sub, self.hooks = pair, pair.main, pair.sub, Hooks()
        self.state = RunState(self.checkpointer, self.learners, self.feed, self.sub)
        self.rollouts = None  # asynchronous runs: the sampler thread (mgrpo_jax/rl/asynchronous.py)
        if config.get("async_rl") is not None and config.async_rl.enabled:
            if job == "sub":
                self.rollouts = decoupled.AsyncServing(config, self.system, self.feed, self.workdir, self.sub)
            else:
                self.rollouts = AsyncRollouts(config, self.system, self.feed, self.workdir,
                                              config.train.log_transcripts if self.is_main_process else 0,
                                              sub_executor=self.exchange.delegation())
            self.state.iterator_state = self.rollouts.iterator_state
        if config.train.eval_every:
            self.hooks.add(lambda info: self.evaluate(), every=config.train.eval_every, order=EVALUATE)
        self.hooks.add(lambda info: self.writer.write(info.step, info.metrics), order=WRITE)
        self.hooks.add(self._save_hook, order=SAVE)
        log.info("built %s run (%s preset, mode %s) in %.1f s", config.benchmark, config.preset, config.mode,
                 time.perf_counter() - start)

    env, engine = property(lambda self: self.system.env), property(lambda self: self.system.engine)
    agents, learners = property(lambda self: self.system.agents), property(lambda self: self.system.learners)
    tokenizer, top_name = property(lambda self: self.system.tokenizer), property(lambda self: self.system.top_name)

    def warm_start(self, guard: PreemptionGuard | None = None) -> bool:
        self.warm_started = warmstart.WarmStart(self.config, self.agents, self.env, self.engine, self.writer,
                                                self.workdir, check_format=self.job == "colocated").run(
            self.progress, guard)
        return self.warm_started

    def prepare_curriculum(self) -> dict | None:
        """Stage 2's questions: `env.curriculum_file`'s, or the filter's (mgrpo_jax/rl/curriculum.py)."""
        return self.feed.prepare(self.engine, write=self.is_main_process)

    def init_from_checkpoint(self, path: str) -> int:
        """Every agent here from another run's latest checkpoint (stage 2 from stage 1); returns its step."""
        self.warm_started = True
        return init_from_checkpoint(path, self.learners)

    def evaluate(self) -> dict:  # the held-out sets run the whole system
        if self.job != "colocated":
            return {}
        blind = self.system.blind_engine() if self.config.train.eval_blind else None
        return evaluation.evaluate(self.config, self.env, self.engine, self.step, self.progress, blind)

    def rl_step(self, update: bool = True) -> dict | None:
        """One step of the sides this job holds, then `step` + 1; None (not advanced) when the main job finished
        first. `update=False`: no update, the rows kept in `self.dry_rows` (main, sub) for a diagnosis."""
        t0, step, main, sub = time.perf_counter(), self.step, self.main, self.sub
        metrics = self.exchange.before_step(step, main.version)
        if self.rollouts is not None:
            self.rollouts.start(step)
            collected, figures = self.rollouts.take(step)
            metrics.update(figures)
        else:
            collected = main.collect(step, next(self.feed.iterator))
        sub_version = sub.version  # the policy that serves this step's calls
        data = sub.collect(step, collected)
        if data is None:
            return None
        metrics.update(data.metrics)
        t1 = time.perf_counter()
        key = jax.random.key(derive_seed(self.config.seed, "align", step))
        targets = jax.device_get(self.credit(data.arrays, key, self.targets_config))  # one jitted call, both agents
        self.exchange.publish(step, data.arrays, targets)
        stats = {k: float(v) for k, v in targets.stats.items()}
        main_figures, main_rows = main.rows(collected, targets, stats, step)
        sub_figures, sub_rows = sub.rows(data, targets, stats, step)
        metrics.update({**main_figures, **sub_figures})
        if self.rollouts is not None:
            main_rows, sub_rows = self._corrected(main_rows, sub_rows, metrics)
        t2 = time.perf_counter()
        if update:
            metrics.update(self.sides.update(main_rows, sub_rows))
            if self.rollouts is not None:
                self.rollouts.push(step + 1)
        else:
            self.dry_rows = (main_rows, sub_rows)
        self.exchange.commit(step, sub_version, int(metrics.get("sub/served", 0)))
        self.exchange.end_step(step)
        t3 = time.perf_counter()
        metrics.update(main.throughput(collected, t3 - t0))
        self.step += 1
        return sides.step_timings(metrics, t0, t1, t2, t3)

    def _corrected(self, main_rows, sub_rows, metrics: dict):
        """Both sides' rows with their stale tokens corrected (`AsyncRollouts.correct`), trained at version `step`:
        the RL updates this run has made."""
        if main_rows is not None:  # the decoupled sub job holds no main agent
            main_rows, figures = self.rollouts.correct(self.main.learner, main_rows, self.step)
            metrics.update(figures)
        corrected = []
        for part in sub_rows or []:
            part, figures = self.rollouts.correct(self.sub.learner, part, self.step)
            metrics.update(figures)
            corrected.append(part)
        return main_rows, corrected if sub_rows is not None else sub_rows

    def stop_rollouts(self) -> None:
        """An asynchronous run's sampler thread stopped, the question feed back at the next step to train."""
        if self.rollouts is not None:
            self.rollouts.close(self.step)

    def save(self, force: bool = False) -> None:
        self.state.save(self.step, self.warm_started, force=force)

    def _save_hook(self, info: StepInfo) -> None:
        self.save(force=info.last)
        self.sub.after_save(self.checkpointer.all_steps())

    def restore(self) -> bool:
        restored = self.state.restore()
        if restored is not None:
            self.step, self.warm_started = restored
            self.writer.truncate_after(self.step)
        return restored is not None

    def run(self) -> dict:
        """Warm start (or resume), RL steps and their hooks; returns the last step's metrics. `self.status` ends as
        finished, interrupted (Ctrl-C; a second one stops at once, dropping the save in flight, and sets
        `self.at_once`), preempted (SIGTERM) or stopped (the main job finished first)."""
        cfg, summary, start, self.status, self.at_once = self.config, {}, time.time(), "stopped", False
        try:
            with PreemptionGuard() as guard, RunProgress(self.is_main_process) as self.progress:
                if self.restore():
                    if self.step >= cfg.train.steps:
                        log.info("already finished at step %d (train.steps=%d)", self.step, cfg.train.steps)
                        self.status = "finished"
                        return read_summary(self.workdir)
                else:
                    self.writer.truncate_after(-1)  # RL records of an attempt stopped before its first checkpoint
                    if cfg.init_checkpoint:
                        self.init_from_checkpoint(cfg.init_checkpoint)
                    elif not self.warm_started and not self.warm_start(guard):
                        self.status = guard.reason
                    if self.status == "stopped":
                        self.first_checkpoint()
                if self.status == "stopped":
                    try:
                        summary = self.rl_steps(guard)
                    finally:
                        self.stop_rollouts()
            self.checkpointer.wait()
        except KeyboardInterrupt:
            self.status, self.at_once = "interrupted", True
            abandon_saves(self.workdir, (CHECKPOINTS, warmstart.CHECKPOINTS))
        if self.step >= cfg.train.steps and self.warm_started:  # a warm-start-only run (steps 0) cut short is not
            self.status = "finished"
        curves = [f"{self.top_name}/reward", "sub/reward"] if self.top_name in self.agents else []
        summary = {**self.feed.identity(), **summary}  # also a run with no RL step records its world and pool
        report_stop(cfg, self.workdir, summary, self.status, self.step, at_once=self.at_once, started=start,
                    curves=curves, write=self.is_main_process)
        if self.status == "finished":
            self.exchange.finish(self.step)
        return summary

    def first_checkpoint(self) -> None:
        """After the warm start: the curriculum, the evaluation at step 0 and the first RL checkpoint."""
        cfg = self.config
        if self.top_name in self.agents and cfg.stage == "stage2":
            self.prepare_curriculum()
        if cfg.train.eval_at_start and self.job == "colocated":
            self.writer.write(0, self.evaluate())  # the starting point of the accuracy curves
        self.save(force=True)
        self.checkpointer.wait()
        warmstart.discard_checkpoints(self.workdir)

    def rl_steps(self, guard: PreemptionGuard) -> dict:
        """RL steps and their hooks until `train.steps` or a stop signal; returns the last step's metrics."""
        summary, label = {}, "" if self.top_name in self.agents else "sub "
        bar = self.progress.phase(f"{label}RL" if label else "RL", self.config.train.steps, self.step)
        while self.step < self.config.train.steps:
            metrics = self.rl_step()
            if metrics is None:
                log.info("the main job finished before step %d: stopping", self.step + 1)
                break
            stop = guard.should_stop()
            summary = self.hooks.run(StepInfo(self.step, metrics, last=stop or self.step == self.config.train.steps))
            shown = sides.shown(summary, self.top_name)
            bar.update(self.step, **shown)
            log.info("%sstep %s", label, bar.line(**shown))
            if stop:
                self.status = guard.reason
                break
        return summary

