"""The M-GRPO run: warm start, then RL steps of the whole system, with evaluation, checkpoints and logs.
`Trainer(config, workdir).run()` resumes from the workdir's latest checkpoint if there is one.

One RL step (`rl_step`), for every mode and for both jobs of the decoupled mode (which differ only in their
exchange, mgrpo_jax/train/exchange.py):
  main side  Q questions -> Q*K whole-system rollouts -> the judges' arrays (format, correctness, expert scores)
             -> published to the sub side;
  both       `mgrpo_targets` (mgrpo_jax/core/mgrpo.py): rewards, alignment and advantages of both agents in one
             jitted call;
  updates    the main agent on its Q*K rows; the sub-agent on its Q*K*D aligned rows (`mgrpo`), on FIFO chunks
             (`mgrpo_unsync`, mgrpo_jax/train/unsync.py) or not at all (`frozen_sub`); new weights to the samplers.
Modes: `mgrpo`, `frozen_sub`, `single_agent` (one agent with the sub-agent's tools), `mgrpo_unsync`.
"""

from __future__ import annotations

import logging
import os
import time

import jax

from mgrpo_jax.core import TargetsConfig, mgrpo_targets
from mgrpo_jax.env.pipeline import question_iterator
from mgrpo_jax.env.prompts import SUB
from mgrpo_jax.store import open_store
from mgrpo_jax.train import curriculum, evaluation, files, sides, system, warmstart
from mgrpo_jax.train.checkpoint import Checkpointer, PreemptionGuard, init_from_checkpoint
from mgrpo_jax.train.exchange import Exchange, InProcessExchange
from mgrpo_jax.train.metrics import MetricWriter, read_summary, write_summary
from mgrpo_jax.train.progress import RunProgress
from mgrpo_jax.train.seeds import derive_seed

log = logging.getLogger(__name__)


class Trainer:
    agent_subset = None  # the agents this process holds (None: all); each job of the decoupled mode sets it

    def __init__(self, config, workdir: str):
        self.config, self.step, self.warm_started = config, 0, config.warmstart.steps == 0
        self.workdir = workdir if "://" in workdir else os.path.abspath(workdir)  # Orbax needs absolute paths
        self.is_main_process, self.top_name = jax.process_index() == 0, system.agent_names(config.mode)[0]
        files.as_path(self.workdir).mkdir(parents=True, exist_ok=True)
        start = time.perf_counter()
        self.env = system.build_environment(config)
        self.tokenizer = system.build_tokenizer(config, self.env, self.workdir)
        self.agents = system.build_agents(config, self.tokenizer, only=self.agent_subset)
        self.holds_every_agent = self.agent_subset is None
        self.engine = system.build_engine(config, self.tokenizer, self.env, self.agents)
        self.store = open_store(config.store)
        self.writer, self.progress = MetricWriter(self.workdir, self.is_main_process, console=False), RunProgress(False)
        self.checkpointer = Checkpointer(self.workdir, save_every=config.train.checkpoint_every)
        self.targets_config = TargetsConfig.from_config(config)
        self.questions = curriculum.training_questions(config, self.env, self.workdir)
        self.iterator = question_iterator(self.questions, batch_size=config.rollout.queries, seed=config.seed)
        self.fifo, self.fifo_consumer = sides.unsync_fifo(self)
        self.exchange = self.make_exchange()
        self.engine.sub_executor = self.exchange.delegate
        log.info("built %s run (%s preset, mode %s) in %.1f s", config.benchmark, config.preset, config.mode,
                 time.perf_counter() - start)

    def make_exchange(self) -> Exchange:
        return InProcessExchange()

    def warm_start(self, guard: PreemptionGuard | None = None) -> bool:
        self.warm_started = warmstart.warm_start(self, guard)
        return self.warm_started

    def filter_curriculum(self) -> dict:
        self.questions, summary = curriculum.filter_curriculum(self.config, self.env, self.engine, self.workdir,
                                                               write=self.is_main_process)
        self.iterator = question_iterator(self.questions, batch_size=self.config.rollout.queries, seed=self.config.seed)
        return summary

    def init_from_checkpoint(self, path: str) -> int:
        """Every agent here from another run's latest checkpoint (stage 2 from stage 1); returns its step."""
        self.warm_started = True
        return init_from_checkpoint(path, self.agents)

    def evaluate(self) -> dict:  # the held-out sets run the whole system
        return evaluation.evaluate(self.config, self.env, self.engine, self.step, self.progress) \
            if self.holds_every_agent else {}

    # -- one RL step ------------------------------------------------------------------------------------

    def rl_step(self) -> dict | None:
        """One step of whatever sides this process holds; None when the other job finished without it."""
        cfg, t0 = self.config, time.perf_counter()
        top, sub = self.agents.get(self.top_name), self.agents.get(SUB)
        metrics, rollout = {}, None
        if top is not None:
            rollout, arrays, metrics = sides.main_rollout(self)
        if sub is not None:
            sub_version = int(sub.state.step)  # the policy that served this step's calls
            received = self.exchange.receive(self.step, sub_version)
            if received is None:
                return None
            arrays = received.arrays
            metrics.update(received.metrics)
        t1 = time.perf_counter()
        key = jax.random.key(derive_seed(cfg.seed, "align", self.step))
        targets = jax.device_get(mgrpo_targets(arrays, key, self.targets_config))  # one jitted call, both agents
        stats = {k: float(v) for k, v in targets.stats.items()}
        if top is not None:
            top_metrics, top_rows = sides.main_rows(self, rollout, targets, stats)
            metrics.update(top_metrics)
        if sub is not None:
            sub_metrics, sub_rows = sides.sub_rows(self, received, targets, stats)
            metrics.update(sub_metrics)
        t2 = time.perf_counter()
        if top is not None:
            metrics.update(top.train(top_rows))
        if sub is not None:
            if sub.trainable:
                metrics.update(sub.train(sub_rows))
            self.exchange.commit(self.step, sub_version, int(metrics.get("sub/served", 0)))
        self.exchange.end_step(self.step)
        return sides.with_timings(metrics, rollout, t0, t1, t2, time.perf_counter())

    # -- state and the run ------------------------------------------------------------------------------

    def host_state(self) -> dict:
        return {"step": self.step, "iterator": self.iterator.get_state(), "warm_started": self.warm_started,
                "fifo_offset": self.fifo_consumer.offset if self.fifo_consumer else 0}

    def save(self, force: bool = False) -> None:
        items = {k: v for agent in self.agents.values() for k, v in agent.checkpoint_items().items()}
        self.checkpointer.save(self.step, items, self.host_state(), force=force)

    def restore(self) -> bool:
        # The current states are the restore targets: their shapes and shardings place the restored arrays.
        restored = self.checkpointer.restore_latest(
            {k: v for agent in self.agents.values() for k, v in agent.checkpoint_items().items()})
        if restored is None:
            return False
        _, states, host = restored
        for agent in self.agents.values():
            agent.load_checkpoint_items(states)
        self.step, self.warm_started = int(host["step"]), bool(host["warm_started"])
        self.iterator.set_state(host["iterator"])
        if self.fifo_consumer is not None:
            self.fifo_consumer.seek(int(host.get("fifo_offset", 0)))
        self.writer.truncate_after(self.step)
        log.info("resumed from step %d", self.step)
        return True

    def run(self) -> dict:
        """Warm start (or resume), RL steps, evaluations and checkpoints; returns the last step's metrics. A run
        that already finished is left as it is. `self.status` ends as finished, preempted or stopped."""
        cfg, summary, start, self.status = self.config, {}, time.time(), "stopped"
        with PreemptionGuard() as guard, RunProgress(self.is_main_process) as self.progress:
            if self.restore():
                if self.step >= cfg.train.steps:
                    log.info("already finished at step %d (train.steps=%d)", self.step, cfg.train.steps)
                    self.status = "finished"
                    return read_summary(self.workdir)
            else:
                if cfg.init_checkpoint:
                    self.init_from_checkpoint(cfg.init_checkpoint)
                elif not self.warm_started and not self.warm_start(guard):
                    self.status = "preempted"
                    return {}
                if self.top_name in self.agents and cfg.stage == "stage2" and cfg.env.stage2_max_success < 1:
                    self.filter_curriculum()
                if cfg.train.eval_at_start and self.holds_every_agent:
                    self.writer.write(0, self.evaluate())  # the starting point of the accuracy curves
                self.save(force=True)
                warmstart.discard_checkpoints(self)
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
                    log.warning("preempted at step %d: checkpoint written, exiting", self.step)
                    self.status = "preempted"
                    break
        self.checkpointer.wait()
        if self.step >= cfg.train.steps:
            self.status = "finished"
        if self.is_main_process:  # a warm-start-only run, or the sub job, has no reward curve
            curves = [f"{self.top_name}/reward", "sub/reward"] if self.step > 0 and self.top_name in self.agents else []
            write_summary(self.workdir, summary, curves, {"status": self.status, "step": self.step, "mode": cfg.mode,
                                                          "wall_time_s": time.time() - start, "config": cfg})
        if self.status == "finished":
            self.exchange.finish(self.step)
        return summary
