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

import logging
import time
import types

import numpy as np

from mgrpo_jax.env.prompts import MAIN, SINGLE, SUB
from mgrpo_jax.env.scoring import world_answer_correct
from mgrpo_jax.rollout import batches
from mgrpo_jax.rollout.rewards import episode_format_ok
from mgrpo_jax.train import system
from mgrpo_jax.train.checkpoint import PreemptionGuard
from mgrpo_jax.train.learner import SFT_KEYS
from mgrpo_jax.train.seeds import derive_seed

log = logging.getLogger(__name__)


def demonstrations(run, agent: str, count: int, seed: int) -> list:
    """Rendered (ids, mask) expert episodes for one agent, from stage-1 and stage-2 training questions."""
    experts = run.env.experts(system.noise_config(run.config))
    pool = list(run.env.questions.stage1) + list(run.env.questions.stage2)
    order = np.random.default_rng(seed).permutation(len(pool))
    examples = []
    for i in order:
        question = pool[int(i)]
        if agent == SINGLE:
            episodes = [experts.single_agent(question).top]
        else:
            transcript = experts.main_agent(question)
            episodes = [transcript.top] if agent == MAIN else list(transcript.subs)
        examples.extend(run.agents[agent].tokenizer.render_chat(episode.as_chat()) for episode in episodes)
        if len(examples) >= count:
            break
    return examples[:count]


def greedy_format(run) -> tuple[dict[str, float], float]:
    """({agent: share of its greedy episodes that keep the protocol}, share of correct final answers) on
    `warmstart.format_questions` training questions (the first ones of stage 1 and of stage 2, half each)."""
    count = run.config.warmstart.format_questions
    pool = list(run.env.questions.stage1[: count - count // 2]) + list(run.env.questions.stage2[: count // 2])
    result = run.engine.run(pool, 1, seed=derive_seed(run.config.seed, "format"), temperature=0.0)
    shares = {}
    for name in run.agents:
        episodes = list(result.episodes(name))
        tools = run.engine.sub.tool_names if name == SUB else run.engine.top.tool_names
        ok = [episode_format_ok(e.turns, tools, run.engine.grammar) for e in episodes]
        shares[name] = float(np.mean(ok)) if ok else 0.0
    correct = [float(e.answer is not None and world_answer_correct(e.answer, pool[e.question_index].answer))
               for row in result.top for e in row]
    return shares, float(np.mean(correct))


def warm_start(run, guard: PreemptionGuard | None = None) -> bool:
    """Clones every agent of `run` (see the module docstring). Returns False when preempted: the warm start is
    short, so a resumed run simply starts it again."""
    cfg = run.config.warmstart
    clones = {}
    for name, agent in run.agents.items():
        steps = agent.config.warmstart_steps or cfg.steps
        sft_cfg = agent.config.sft.copy_and_resolve_references()
        sft_cfg.total_steps = sft_cfg.total_steps or steps  # decay over the whole warm start
        agent.reset_optimizer(sft_cfg)
        clones[name] = types.SimpleNamespace(
            steps=steps, done=0, losses=[], start=time.perf_counter(), step=agent.sft_step(sft_cfg),
            examples=demonstrations(run, name, cfg.examples, derive_seed(run.config.seed, "demos", name)),
            rng=np.random.default_rng(derive_seed(run.config.seed, "sft", name)))
    active = [name for name in run.agents if clones[name].steps > 0]
    while active:
        for name in active:
            clone, agent = clones[name], run.agents[name]
            for _ in range(min(cfg.check_every or clone.steps, clone.steps - clone.done)):
                if guard is not None and guard.should_stop():
                    log.warning("preempted during the warm start of %s; it restarts when the run resumes", name)
                    return False
                rows = [clone.examples[j] for j in clone.rng.choice(len(clone.examples), cfg.batch_size,
                                                                    replace=False)]
                length = batches.bucket_length([len(ids) for ids, _ in rows], agent.config.context_tokens)
                batch = batches.sft_rows(rows, length, agent.tokenizer.pad_id)
                agent.state, metrics = clone.step(agent.state, {k: batch[k] for k in SFT_KEYS})
                clone.losses.append(float(metrics["loss"]))
                if clone.done % 25 == 0 or clone.done == clone.steps - 1:
                    run.writer.write(clone.done, {f"warmstart/{name}/loss": clone.losses[-1]},
                                     prefix_step="warmstart")
                clone.done += 1
            agent.publish()
        finished = [name for name in active if clones[name].done >= clones[name].steps]
        if cfg.check_every and run.holds_every_agent:  # the check runs the whole system
            rates, correct = greedy_format(run)
            for name in active:
                run.writer.write(clones[name].done, {f"warmstart/{name}/format_ok": rates[name],
                                                     f"warmstart/{name}/correct": correct},
                                 prefix_step="warmstart")
                log.info("warm start %s: step %d, loss %.3f, greedy format %.2f (system correct %.2f)", name,
                         clones[name].done, clones[name].losses[-1], rates[name], correct)
            finished += [name for name in active
                         if rates[name] >= cfg.format_target and clones[name].done >= cfg.min_steps]
        active = [name for name in active if name not in finished]
    for name, agent in run.agents.items():
        clone = clones[name]
        agent.reset_optimizer(agent.config.optim)
        first, last = (clone.losses[0], clone.losses[-1]) if clone.losses else (float("nan"), float("nan"))
        log.info("warm start %s: %d steps, loss %.3f -> %.3f (%.1f s)", name, clone.done, first, last,
                 time.perf_counter() - clone.start)
    return True
