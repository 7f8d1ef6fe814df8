"""The warm start: supervised cloning of the scripted experts' transcripts until the agents keep the protocol.

RL needs agents that keep the format: otherwise every reward is 0 and the groups carry no signal. Each agent
trains for up to its `warmstart_steps` (or `warmstart.steps`). With `warmstart.check_every` > 0 the agents train
in rounds of that many steps, and after each round greedy decoding runs on `warmstart.format_questions` training
questions: an agent that has trained `warmstart.min_steps` and keeps the protocol on at least
`warmstart.format_target` of its episodes stops (logged as `warmstart/<agent>/format_ok`, with the system's
greedy `warmstart/<agent>/correct`). The format comes long before the content (copying names and values), hence
the minimum. Then every agent gets a fresh RL optimizer.
"""

from __future__ import annotations

import dataclasses
import logging
import time
import types

import jax
import numpy as np
from etils import epath

from mgrpo_jax.agent.build import distinct_learners
from mgrpo_jax.env.build import noise_config
from mgrpo_jax.env.compact.world import TWINS
from mgrpo_jax.env.prompts import MAIN, SINGLE, SUB
from mgrpo_jax.env.scoring import world_answer_correct
from mgrpo_jax.rollout import batches
from mgrpo_jax.rollout.judging import episode_format_ok
from mgrpo_jax.runtime.checkpoint import Checkpointer, PreemptionGuard
from mgrpo_jax.runtime.seeds import derive_seed

log = logging.getLogger(__name__)

CHECKPOINTS = "warmstart_checkpoints"
LOG_EVERY = 25  # warm-start steps between log lines (and metric-log entries)


@dataclasses.dataclass
class WarmStart:
    """The warm start of the `learners` this process holds (`run` does it), with what it reads: the world's
    experts and questions, the rollout engine for the greedy format check (run only where `check_format`: the
    check runs the whole system), and where it writes (its metric log, its checkpoints under `workdir`)."""

    config: object
    learners: dict  # {agent: Learner}; a shared-policy mode's two agents are one learner, cloned on both agents' demos
    env: object
    engine: object
    writer: object  # MetricWriter
    workdir: str
    check_format: bool = True

    def __post_init__(self):
        self.models = distinct_learners(self.learners)  # {learner name: Learner}: what trains
        self.agents_of = {name: [agent for agent, learner in self.learners.items() if learner is model]
                      for name, model in self.models.items()}

    def demonstrations(self, agent: str, count: int, seed: int) -> list:
        """Rendered (ids, mask) expert episodes for one agent, from stage-1 and stage-2 training questions; a
        `warmstart.counterfactual_share` of them in counterfactual twins of the world (its entities and
        questions, its facts drawn again), one of its `TWINS` per demonstration."""
        noise = noise_config(self.config)
        share = float(self.config.warmstart.counterfactual_share)
        twins = {}

        def experts_for(draw: float, twin: int):
            key = 1 + twin % TWINS if draw < share else 0
            if key not in twins:
                twins[key] = self.env.experts(noise, counterfactual=key) if key else self.env.experts(noise)
            return twins[key]

        pool = list(self.env.questions.stage1) + list(self.env.questions.stage2)
        rng = np.random.default_rng(seed)
        order = rng.permutation(len(pool))
        draws, twin_ids = rng.random(len(pool)), rng.integers(0, TWINS, len(pool))
        examples = []
        for n, i in enumerate(order):
            question = pool[int(i)]
            experts = experts_for(draws[n], int(twin_ids[n]))
            if agent == SINGLE:
                episodes = [experts.single_agent(question).top]
            else:
                transcript = experts.main_agent(question)
                episodes = [transcript.top] if agent == MAIN else list(transcript.subs)
            examples.extend(self.learners[agent].tokenizer.render_chat(episode.as_chat()) for episode in episodes)
            if len(examples) >= count:
                break
        return examples[:count]

    def greedy_format(self) -> tuple[dict[str, float], float]:
        """({agent: share of its greedy episodes that keep the protocol}, share of correct final answers) on
        `warmstart.format_questions` training questions (the first ones of stage 1 and of stage 2, half each)."""
        count, engine = self.config.warmstart.format_questions, self.engine
        pool = list(self.env.questions.stage1[: count - count // 2]) + list(self.env.questions.stage2[: count // 2])
        result = engine.run(pool, 1, seed=derive_seed(self.config.seed, "format"), temperature=0.0)
        shares = {}
        for name in self.learners:
            episodes = list(result.episodes(name))
            tools = engine.sub.tool_names if name == SUB else engine.top.tool_names
            ok = [episode_format_ok(e.turns, tools, engine.grammar) for e in episodes]
            shares[name] = float(np.mean(ok)) if ok else 0.0
        correct = [float(e.answer is not None and world_answer_correct(e.answer, pool[e.question_index].answer))
                   for row in result.top for e in row]
        return shares, float(np.mean(correct))

    def _clone(self, name: str, agent) -> types.SimpleNamespace:
        """A learner's warm-start progress, fresh: the SFT optimizer, its agents' demonstrations (`warmstart.examples`
        per agent) and its batch order."""
        cfg = self.config
        steps = agent.config.warmstart_steps or cfg.warmstart.steps
        sft_cfg = agent.config.sft.copy_and_resolve_references()
        sft_cfg.total_steps = sft_cfg.total_steps or steps  # decay over the whole warm start
        agent.start_sft(sft_cfg)
        examples = [example for shown in self.agents_of[name]
                    for example in self.demonstrations(shown, cfg.warmstart.examples,
                                                       derive_seed(cfg.seed, "demos", shown))]
        return types.SimpleNamespace(steps=steps, done=0, losses=[], finished=False, examples=examples,
                                     rng=np.random.default_rng(derive_seed(cfg.seed, "sft", name)))

    def _resume(self, clones: dict, checkpointer: Checkpointer) -> int:
        """The agents' states and progress from the newest warm-start checkpoint, if any; returns the rounds done."""
        restored = checkpointer.restore_latest({name: agent.state for name, agent in self.models.items()})
        if restored is None:
            return 0
        total, states, host = restored
        for name, agent in self.models.items():
            clone, saved = clones[name], host["agents"][name]
            agent.restore_state(states[name])
            clone.done, clone.finished = int(saved["done"]), bool(saved["finished"])
            clone.losses = list(saved["losses"])
            clone.rng.bit_generator.state = saved["rng"]
        log.info("warm start resumed after %d steps (%s)", total,
                 ", ".join(f"{name} {c.done}/{c.steps}" for name, c in clones.items()))
        return int(host["rounds"])

    def run(self, progress, guard: PreemptionGuard | None = None) -> bool:
        """Clones every learner (see the module docstring). Every `warmstart.checkpoint_every` steps (counted over
        all agents), and when preempted, the agents' states and progress are checkpointed in
        `<workdir>/warmstart_checkpoints`; a resumed run continues from there. Returns False when preempted."""
        cfg = self.config.warmstart
        clones = {name: self._clone(name, agent) for name, agent in self.models.items()}
        checkpointer = Checkpointer(self.workdir, keep=1, save_every=cfg.checkpoint_every, subdir=CHECKPOINTS)
        rounds = self._resume(clones, checkpointer)
        if not rounds and not any(c.done for c in clones.values()):
            log.info("warm start from step 1 (no warm-start checkpoint in %s)", checkpointer.directory)
        # what the steps from here write again: a stop after the last checkpoint logged them once already
        self.writer.drop(lambda rec: _redone(rec, clones))
        bars = {name: progress.phase(f"warm start {name}", c.steps, c.done) for name, c in clones.items()}
        start = time.perf_counter()

        def save(force: bool) -> None:
            total = sum(c.done for c in clones.values())
            if force or checkpointer.should_save(total):
                states = {name: agent.state for name, agent in self.models.items()}
                checkpointer.save(total, states, _host_state(clones, rounds), force=True)

        active = [name for name, c in clones.items() if c.done < c.steps and not c.finished]
        while active:
            round_end = (rounds + 1) * cfg.check_every if cfg.check_every else None
            for name in active:
                clone, agent, bar = clones[name], self.models[name], bars[name]
                while clone.done < min(round_end or clone.steps, clone.steps):
                    if guard is not None and guard.should_stop():
                        save(force=True)
                        checkpointer.close()
                        log.warning("stopped during the warm start of %s at step %d: checkpointed, it continues "
                                    "from there when the run resumes", name, clone.done)
                        return False
                    rows = [clone.examples[j] for j in clone.rng.choice(len(clone.examples), cfg.batch_size,
                                                                        replace=False)]
                    length = batches.bucket_length([len(ids) for ids, _ in rows], agent.config.context_tokens)
                    metrics = agent.sft_update(batches.sft_rows(rows, length, agent.tokenizer.pad_id))
                    clone.losses.append(float(metrics["loss"]))
                    bar.update(clone.done + 1, loss=clone.losses[-1])
                    if clone.done % LOG_EVERY == 0 or clone.done == clone.steps - 1:
                        self.writer.write(clone.done, {f"warmstart/{name}/loss": clone.losses[-1]},
                                          prefix_step="warmstart")
                        log.info("warm start %s %s", name, bar.line(loss=clone.losses[-1]))
                    clone.done += 1
                    save(force=False)
                bar.pause()  # the other agents' rounds and the format check run before its next step
                agent.publish()
            for name in active:
                clones[name].finished = clones[name].done >= clones[name].steps
            if cfg.check_every and self.check_format:
                rates, correct = self.greedy_format()
                for name in active:
                    served = self.agents_of[name]
                    rate = min(rates[a] for a in served)  # a shared model keeps the protocol as both agents
                    record = {f"warmstart/{name}/format_ok": rate, f"warmstart/{name}/correct": correct}
                    if len(served) > 1:
                        record.update({f"warmstart/{name}/{a}/format_ok": rates[a] for a in served})
                    self.writer.write(clones[name].done, record, prefix_step="warmstart")
                    log.info("warm start %s: step %d, loss %.3f, greedy format %.2f (system correct %.2f)", name,
                             clones[name].done, clones[name].losses[-1], rate, correct)
                    clones[name].finished |= rate >= cfg.format_target and clones[name].done >= cfg.min_steps
            rounds += 1
            active = [name for name in active if not clones[name].finished]
        checkpointer.close()
        for name, agent in self.models.items():
            clone = clones[name]
            bars[name].close()
            agent.reset_optimizer(agent.config.optim)
            first, last = (clone.losses[0], clone.losses[-1]) if clone.losses else (float("nan"), float("nan"))
            log.info("warm start %s: %d steps, loss %.3f -> %.3f (%.1f s in this process)", name, clone.done, first,
                     last, time.perf_counter() - start)
        return True


def _redone(record: dict, clones: dict) -> bool:
    """`record` is a warm-start record of an agent that will redo its step (the resume point and after)."""
    if "warmstart_step" not in record:
        return False
    return any(key.startswith(f"warmstart/{name}/") and not clone.finished and record["warmstart_step"] >= clone.done
               for name, clone in clones.items() for key in record)


def _host_state(clones: dict, rounds: int) -> dict:
    return {"rounds": rounds, "agents": {name: {"done": c.done, "finished": c.finished, "losses": c.losses,
                                                "rng": c.rng.bit_generator.state} for name, c in clones.items()}}


def discard_checkpoints(workdir: str) -> None:
    """Drops the warm-start checkpoints once the run's first RL checkpoint is written (they hold the SFT
    optimizer's state too, as large as the model twice); call it after that checkpoint is on disk."""
    path = epath.Path(workdir) / CHECKPOINTS
    if jax.process_index() == 0 and path.exists():
        path.rmtree()
