"""The decode-slot engine against the lock-step oracle, on real (random-weights) agents of both worlds: greedy runs
give token-identical episodes, the same seed gives the same episodes whatever the slot count, and a turn prefills
only what its episode gained since its last turn (unless the episode had to leave its slot)."""

from __future__ import annotations

import dataclasses
import zlib

import numpy as np
import pytest

from mgrpo_jax.agent.build import build_agents
from mgrpo_jax.bench.rollout import ScriptedLockstepEngine, ScriptedRolloutEngine
from mgrpo_jax.config import get_config
from mgrpo_jax.env.build import build_environment
from mgrpo_jax.env.prompts import MAIN, SUB
from mgrpo_jax.env.protocol import FinalAnswer, ToolCall
from mgrpo_jax.rl import system
from mgrpo_jax.rollout.lockstep import LockstepRolloutEngine


def _h(*parts) -> int:
    return zlib.crc32("/".join(map(str, parts)).encode())


@dataclasses.dataclass
class Script:
    """Multi-turn episodes from random-weights models: turns of 3-10 tokens, then a tool call chosen by the sampled
    text (the main agent delegates every other turn, with the text as the task), an answer after 2-4 turns. What an
    episode does next depends on the tokens it sampled, so an engine that sampled differently diverges."""

    tools: tuple[str, ...]
    delegate: bool

    def budget(self, episode) -> int:
        return 3 + _h(episode.question_index, episode.rollout, episode.invocation, len(episode.turns)) % 8

    def parse(self, episode, text):
        turns = len(episode.turns)
        if turns >= 2 + _h(episode.question_index, episode.rollout, episode.invocation) % 3:
            return FinalAnswer(text[:30])
        if self.delegate and turns % 2 == 1:
            return ToolCall("delegate", {"task": text[:20], "context": ""})
        return ToolCall(self.tools[_h(text) % len(self.tools)], {"query": text[:20], "id": text[:4]})


@dataclasses.dataclass
class World:
    config: object
    env: object
    tokenizer: object
    agents: dict


def _world(preset: str) -> World:
    config = get_config("xbench", preset)
    config.rollout.max_turn_tokens = 12
    env = build_environment(config)
    tokenizer = system.build_tokenizer(config, env, None)
    return World(config, env, tokenizer, build_agents(config, tokenizer))


@pytest.fixture(scope="module", params=["local", "smoke"], ids=["compact", "chat"])
def world(request):
    return _world(request.param)


def _engines(world: World, scripted: bool = True, **slots):
    """The slot engine and the lock-step oracle on the same runtimes (`slots`: per-agent slot counts), each agent
    following a `Script` unless not `scripted`."""
    engine = system.build_engine(world.config, world.tokenizer, world.env, world.agents)
    for runtime in (engine.top, engine.sub):
        runtime.slots = slots.get(runtime.name, 0)
    parts = (engine.tokenizer, engine.top, engine.sub, engine.limits)
    if not scripted:
        return engine, LockstepRolloutEngine(*parts, grammar=engine.grammar)
    scripts = {runtime.name: Script(tuple(runtime.tools), runtime.can_delegate) for runtime in (engine.top, engine.sub)}
    return (ScriptedRolloutEngine(*parts, grammar=engine.grammar, scripts=scripts),
            ScriptedLockstepEngine(*parts, grammar=engine.grammar, scripts=scripts))


def questions_of(world: World, n: int = 3) -> list:
    return list(world.env.questions.split(world.config.stage))[:n]


def _trajectories(batch):
    return [(e.agent, e.question_index, e.rollout, e.invocation, e.tokens, e.loss_mask, e.end_reason, e.answer)
            for e in batch.episodes()]


def test_greedy_slots_give_the_lockstep_episodes(world):
    engine, oracle = _engines(world)
    questions = questions_of(world)
    got = engine.run(questions, 2, seed=1, temperature=0.0)
    want = oracle.run(questions, 2, seed=1, temperature=0.0)
    assert _trajectories(got) == _trajectories(want)
    subs = list(got.episodes(SUB))
    assert subs and max(len(e.turns) for e in got.episodes()) >= 3  # delegations and several turns: the test has teeth
    for a, b in zip(got.episodes(), want.episodes(), strict=True):
        np.testing.assert_allclose(a.logprobs, b.logprobs, atol=2e-4)


def test_greedy_slots_match_without_a_script(world):
    """The grammar's own parse (random models mostly break the format at once: one turn each)."""
    engine, oracle = _engines(world, scripted=False)
    questions = questions_of(world)
    assert _trajectories(engine.run(questions, 2, seed=0, temperature=0.0)) == \
        _trajectories(oracle.run(questions, 2, seed=0, temperature=0.0))


def _fewest(world: World, agent: str) -> int:
    """The fewest slots an agent's pool can have: one per device of its data axes."""
    return world.agents[agent].sampler.batch_multiple


def test_the_same_seed_gives_the_same_episodes_whatever_the_slot_count(world):
    questions = questions_of(world, 4)  # 8 rollouts
    runs = []
    for slots in ({}, {MAIN: _fewest(world, MAIN), SUB: 1}):
        engine, _ = _engines(world, **slots)
        runs.append(engine.run(questions, 2, seed=7))
        stats = engine.slot_stats
    assert _trajectories(runs[0]) == _trajectories(runs[1])
    for a, b in zip(runs[0].episodes(), runs[1].episodes(), strict=True):
        np.testing.assert_allclose(a.logprobs, b.logprobs, atol=2e-4)
    assert stats[MAIN]["slots"] < 8 and stats[MAIN]["evictions"] > 0  # parked main episodes left their slots


def _cache_writes(episode) -> int:
    """Tokens an episode's slot cache holds at its end: all up to its last sampled id (which is never fed back)."""
    return int(np.flatnonzero(np.asarray(episode.loss_mask))[-1])


def test_a_turn_prefills_only_what_its_episode_gained(world):
    engine, _ = _engines(world)
    batch = engine.run(questions_of(world), 2, seed=3)
    for agent in (MAIN, SUB):
        stats = engine.slot_stats[agent]
        episodes = [e for e in batch.episodes(agent) if any(e.loss_mask)]
        assert stats["evictions"] == 0
        # Every cache write is a token of its episode, written once: no turn re-prefilled earlier context.
        assert stats["prefill_tokens"] + stats["fed_tokens"] == sum(_cache_writes(e) for e in episodes)
        assert stats["sampled_tokens"] == sum(e.generated_tokens for e in episodes)
    # With one main slot the parked episodes leave it and prefill their context again, once per return.
    engine, _ = _engines(world, **{MAIN: _fewest(world, MAIN)})
    batch = engine.run(questions_of(world, 4), 2, seed=3)
    stats = engine.slot_stats[MAIN]
    written = sum(_cache_writes(e) for e in batch.episodes(MAIN) if any(e.loss_mask))
    assert stats["evictions"] > 0 and stats["prefill_tokens"] + stats["fed_tokens"] > written


def test_each_agent_gets_the_slots_its_config_sets(world):
    config = world.config.copy_and_resolve_references()
    config.main.rollout_slots, config.sub.rollout_slots = 4, 8
    engine = system.build_engine(config, world.tokenizer, world.env, world.agents)
    engine.run(questions_of(world, 1), 1, seed=0)
    assert (engine.top.slots, engine.sub.slots) == (4, 8)
    assert engine.slot_stats[MAIN]["slots"] == 4
