"""The M-GRPO run: warm start, then RL steps of the whole system, with evaluation, checkpoints and logs.
`Trainer(config, workdir).run()` resumes from the workdir's latest checkpoint if there is one.

One RL step (`rl_step`), the same for every mode and for both jobs of the decoupled mode:
  collect   the main side's Q questions -> Q*K whole-system rollouts -> the judges' arrays (format, correctness,
            expert scores);
  hand off  through the exchange (mgrpo_jax/rl/exchange.py) to the sub side: by reference in this process, or
            through the shared store between the two jobs of the decoupled mode (mgrpo_jax/rl/decoupled.py);
  targets   the credit assignment (`config.credit`, mgrpo_jax/core/credit.py; by default `mgrpo_targets`,
            mgrpo_jax/core/mgrpo.py): rewards, alignment and advantages of both agents in one jitted call;
  update    each side (mgrpo_jax/rl/sides.py) builds its rows and trains: the main agent on its Q*K rows; the
            sub-agent on its Q*K*D aligned rows (`mgrpo`), on FIFO chunks (`mgrpo_unsync`) or not at all
            (`frozen_sub`); new weights to the samplers.
Modes: `mgrpo`, `frozen_sub`, `single_agent` (one agent with the sub-agent's tools), `mgrpo_unsync`, and the
shared-policy modes `matpo` (MATPO: one model serves the planner and worker roles, credit `matpo`, one update on both
roles' rows pooled) and `shared_mgrpo` (the same model with M-GRPO's credit). Roles: a `colocated` job holds both
sides; the decoupled mode's `main` and `sub` jobs hold one each (`NoSide` the other); a shared-policy mode runs
colocated only.
"""

from __future__ import annotations

import logging
import os
import time

import jax

from mgrpo_jax.agent.build import build_agents, distinct_learners
from mgrpo_jax.config import agent_names, credit_name
from mgrpo_jax.core import credit_config_type, get_credit
from mgrpo_jax.env.build import build_environment
from mgrpo_jax.env.pipeline import question_iterator
from mgrpo_jax.env.prompts import MAIN, SUB
from mgrpo_jax.rl import curriculum, decoupled, evaluation, sides, system, warmstart
from mgrpo_jax.rl.exchange import InProcessExchange
from mgrpo_jax.runtime import checkpoint, files
from mgrpo_jax.runtime.checkpoint import Checkpointer, PreemptionGuard, init_from_checkpoint
from mgrpo_jax.runtime.metrics import MetricWriter, read_summary, write_summary
from mgrpo_jax.runtime.progress import RunProgress
from mgrpo_jax.runtime.seeds import derive_seed
from mgrpo_jax.store import open_store

log = logging.getLogger(__name__)

ROLES = {"colocated": None, "main": (MAIN,), "sub": (SUB,)}  # role -> the agents its job holds (None: all)


class Trainer:
    """One job of a run: `role` colocated (both sides here) or one side of the decoupled mode, `main` or `sub`,
    which keeps its files in `workdir/main` or `workdir/sub`."""

    def __init__(self, config, workdir: str, role: str = "colocated"):
        if role not in ROLES:
            raise ValueError(f"unknown role {role!r}: expected one of {tuple(ROLES)}")
        workdir = workdir if role == "colocated" else os.path.join(workdir, role)
        self.config, self.role, self.step, self.warm_started = config, role, 0, config.warmstart.steps == 0
        self.workdir = workdir if "://" in workdir else os.path.abspath(workdir)  # Orbax needs absolute paths
        self.is_main_process, self.top_name = jax.process_index() == 0, agent_names(config.mode)[0]
        files.as_path(self.workdir).mkdir(parents=True, exist_ok=True)
        start = time.perf_counter()
        self.env = build_environment(config)
        self.store = open_store(config.store)
        published = decoupled.main_tokenizer(self.store, self.workdir, config) if role == "sub" else None
        self.tokenizer = system.build_tokenizer(config, self.env, self.workdir)
        if published is not None:
            decoupled.check_tokenizer(self.tokenizer, published, config, self.workdir)
        self.agents = build_agents(config, self.tokenizer, only=ROLES[role])  # {role: Learner}
        self.learners = distinct_learners(self.agents)  # each model once: what checkpoints hold
        self.holds_every_agent = role == "colocated"
        self.engine = system.build_engine(config, self.tokenizer, self.env, self.agents)
        self.writer, self.progress = MetricWriter(self.workdir, self.is_main_process, console=False), RunProgress(False)
        self.checkpointer = Checkpointer(self.workdir, save_every=config.train.checkpoint_every)
        self.credit = get_credit(credit_name(config))
        self.targets_config = credit_config_type(credit_name(config)).from_config(config)
        self.questions = curriculum.training_questions(config, self.env, self.workdir)
        self.iterator = question_iterator(self.questions, batch_size=config.rollout.queries, seed=config.seed)
        self.main, self.sub = sides.build_sides(config, self.agents, self.engine, self.env, self.store, self.workdir,
                                                self.is_main_process)
        self.exchange = self._exchange()
        self.engine.sub_executor = self.exchange.delegate
        log.info("built %s run (%s preset, mode %s) in %.1f s", config.benchmark, config.preset, config.mode,
                 time.perf_counter() - start)

    def _exchange(self):
        if self.role == "main":
            return decoupled.MainExchange(self.store, self.config, self.tokenizer, self.workdir,
                                          resuming=self.checkpointer.latest_step() is not None,
                                          policy_version=lambda: self.main.version)
        if self.role == "sub":
            return decoupled.SubExchange(self.store, self.config, self.workdir, self.env, self.engine)
        return InProcessExchange()

    def warm_start(self, guard: PreemptionGuard | None = None) -> bool:
        self.warm_started = warmstart.WarmStart(self.config, self.agents, self.env, self.engine, self.writer,
                                                self.workdir, check_format=self.holds_every_agent).run(self.progress,
                                                                                                       guard)
        return self.warm_started

    def filter_curriculum(self) -> dict:
        self.questions, summary = curriculum.filter_curriculum(self.config, self.env, self.engine, self.workdir,
                                                               write=self.is_main_process)
        self.iterator = question_iterator(self.questions, batch_size=self.config.rollout.queries, seed=self.config.seed)
        return summary

    def init_from_checkpoint(self, path: str) -> int:
        """Every agent here from another run's latest checkpoint (stage 2 from stage 1); returns its step."""
        self.warm_started = True
        return init_from_checkpoint(path, self.learners)

    def evaluate(self) -> dict:  # the held-out sets run the whole system
        if not self.holds_every_agent:
            return {}
        blind = system.build_engine(self.config, self.tokenizer, self.env, self.agents, blind=True) \
            if self.config.train.eval_blind else None
        return evaluation.evaluate(self.config, self.env, self.engine, self.step, self.progress, blind)

    # -- one RL step ------------------------------------------------------------------------------------

    def rl_step(self) -> dict | None:
        """One step of the sides this job holds; None when the main job finished without this step."""
        t0 = time.perf_counter()
        metrics = self.exchange.before_step(self.step)
        collected = self.main.collect(self.step, next(self.iterator))
        sub_version = self.sub.version  # the policy that serves this step's calls
        data = self.exchange.hand_off(self.step, collected, sub_version)
        if data is None:
            return None
        metrics.update(data.metrics)
        t1 = time.perf_counter()
        key = jax.random.key(derive_seed(self.config.seed, "align", self.step))
        targets = jax.device_get(self.credit(data.arrays, key, self.targets_config))  # one jitted call, both agents
        self.exchange.publish(self.step, data.arrays, targets)
        stats = {k: float(v) for k, v in targets.stats.items()}
        main_figures, main_rows = self.main.rows(collected, targets, stats, self.step)
        sub_figures, sub_rows = self.sub.rows(data, targets, stats, self.step)
        metrics.update({**main_figures, **sub_figures})
        t2 = time.perf_counter()
        metrics.update(sides.update(self.main, main_rows, self.sub, sub_rows, self.config))
        self.exchange.commit(self.step, sub_version, int(metrics.get("sub/served", 0)))
        self.exchange.end_step(self.step)
        t3 = time.perf_counter()
        metrics.update(self.main.throughput(collected, t3 - t0))
        return sides.step_timings(metrics, t0, t1, t2, t3)

    # -- state and the run ------------------------------------------------------------------------------

    def host_state(self) -> dict:
        return {"step": self.step, "iterator": self.iterator.get_state(), "warm_started": self.warm_started,
                "fifo_offset": 0, **self.sub.host_state()}

    def save(self, force: bool = False) -> None:
        items = {k: v for agent in self.learners.values() for k, v in agent.checkpoint_items().items()}
        self.checkpointer.save(self.step, items, self.host_state(), force=force)

    def restore(self) -> bool:
        # The current states are the restore targets: their shapes and shardings place the restored arrays.
        restored = self.checkpointer.restore_latest(
            {k: v for agent in self.learners.values() for k, v in agent.checkpoint_items().items()})
        if restored is None:
            return False
        _, states, host = restored
        for agent in self.learners.values():
            agent.load_checkpoint_items(states)
        self.step, self.warm_started = int(host["step"]), bool(host["warm_started"])
        self.iterator.set_state(host["iterator"])
        self.sub.load_host_state(host)
        self.writer.truncate_after(self.step)
        log.info("resumed from step %d", self.step)
        return True

    def run(self) -> dict:
        """Warm start (or resume), RL steps, evaluations and checkpoints; returns the last step's metrics. A run
        that already finished is left as it is. `self.status` ends as finished, interrupted (Ctrl-C), preempted
        (SIGTERM) or stopped (the main job finished first); every stop writes `summary.json`. A second Ctrl-C
        stops at once: the checkpoint being written is dropped, so the newest complete one is the resume point,
        and `self.at_once` is set (the launcher then exits without waiting for Orbax's threads)."""
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
                    summary = self.rl_steps(guard)
            self.checkpointer.wait()
        except KeyboardInterrupt:
            self.status, self.at_once = "interrupted", True
            logging.getLogger("absl").setLevel(logging.CRITICAL + 1)  # Orbax's errors about the save cut off
            checkpoint.settle()
            for folder in (checkpoint.CHECKPOINTS, warmstart.CHECKPOINTS):
                checkpoint.discard_partial(files.as_path(self.workdir) / folder)
        if self.step >= cfg.train.steps and self.warm_started:  # a warm-start-only run (steps 0) cut short is not
            self.status = "finished"
        resume = {"checkpoint": _newest(self.workdir, checkpoint.CHECKPOINTS),
                  "warmstart_checkpoint": _newest(self.workdir, warmstart.CHECKPOINTS)}
        if self.is_main_process:  # the sub job has no figure: the main job's has its rewards
            curves = [f"{self.top_name}/reward", "sub/reward"] if self.top_name in self.agents else []
            write_summary(self.workdir, summary, curves, {"status": self.status, "step": self.step, "mode": cfg.mode,
                                                          "resume_from": resume, "wall_time_s": time.time() - start,
                                                          "config": cfg},
                          title=f"{cfg.benchmark}, {cfg.preset} preset, {cfg.mode} ({self.status} at step {self.step})")
        if self.status == "finished":
            self.exchange.finish(self.step)
        elif self.status in ("interrupted", "preempted"):
            log.warning("%s: %s; run the same command to resume", self.status, _resume_point(resume, self.at_once))
        return summary

    def first_checkpoint(self) -> None:
        """After the warm start: the curriculum, the evaluation at step 0 and the first RL checkpoint."""
        cfg = self.config
        if self.top_name in self.agents and cfg.stage == "stage2" and cfg.env.stage2_max_success < 1:
            self.filter_curriculum()
        if cfg.train.eval_at_start and self.holds_every_agent:
            self.writer.write(0, self.evaluate())  # the starting point of the accuracy curves
        self.save(force=True)
        self.checkpointer.wait()
        warmstart.discard_checkpoints(self.workdir)

    def rl_steps(self, guard: PreemptionGuard) -> dict:
        """RL steps until `train.steps` or a stop signal; returns the last step's metrics."""
        cfg, summary = self.config, {}
        bar = self.progress.phase("RL" if self.top_name in self.agents else "sub RL", cfg.train.steps, self.step)
        while self.step < cfg.train.steps:
            metrics = self.rl_step()
            if metrics is None:
                log.info("the main job finished before step %d: stopping", self.step + 1)
                break
            self.step += 1
            if cfg.train.eval_every and self.step % cfg.train.eval_every == 0:
                metrics.update(self.evaluate())
            self.writer.write(self.step, metrics)
            summary, shown = metrics, sides.shown(metrics, self.top_name)
            bar.update(self.step, **shown)
            log.info("%sstep %s", "" if self.top_name in self.agents else "sub ", bar.line(**shown))
            stop = guard.should_stop()
            self.save(force=stop or self.step == cfg.train.steps)
            self.exchange.after_save(self.checkpointer.all_steps())
            if stop:
                self.status = guard.reason
                break
        return summary


def _newest(workdir: str, folder: str) -> int | None:
    steps = checkpoint.complete_steps(files.as_path(workdir) / folder)
    return steps[-1] if steps else None


def _resume_point(resume: dict, at_once: bool) -> str:
    """Where a rerun continues, in words."""
    how = "stopped at once" if at_once else "checkpoint written"
    if resume["checkpoint"] is not None:
        return f"{how}; the rerun resumes from RL step {resume['checkpoint']}"
    if resume["warmstart_checkpoint"] is not None:
        return f"{how}; the rerun resumes the warm start after {resume['warmstart_checkpoint']} steps"
    return f"{how}; no checkpoint was complete yet, so the rerun starts over"
