"""The rollout engine on paged KV (`rollout.kv_block_size` > 0, mgrpo_jax/sampling/paged.py): the slot engine's
tests with paging on (greedy episodes of the lock-step oracle, the same episodes whatever the pool's size, a turn
prefills only what its episode gained), and a query's K rollouts prefilling their shared prompt once."""

from __future__ import annotations

import types

import numpy as np
import pytest

from mgrpo_jax.bench.rollout import LengthTokenizer, LongScript, ScriptedRolloutEngine, _page, needed_context
from mgrpo_jax.env.prompts import MAIN, SUB
from mgrpo_jax.model import get_model_config
from mgrpo_jax.rl import system
from mgrpo_jax.rollout.engine import AgentRuntime, RolloutLimits
from mgrpo_jax.sampling import Sampler
from tests.rollout.test_slots import _cache_writes, _engines, _fewest, _trajectories, _world, questions_of

BLOCK = 16


@pytest.fixture(scope="module", params=["local", "smoke"], ids=["compact", "chat"])
def world(request):
    return _world(request.param)


def paged(engines, block_size: int = BLOCK, **blocks):
    """The engines' runtimes on paged KV (`blocks`: per-agent store sizes)."""
    for engine in engines:
        for runtime in (engine.top, engine.sub):
            runtime.kv_block_size, runtime.kv_blocks = block_size, blocks.get(runtime.name, 0)
    return engines


def test_greedy_paged_slots_give_the_lockstep_episodes(world):
    engine, oracle = paged(_engines(world))
    questions = questions_of(world)
    got = engine.run(questions, 2, seed=1, temperature=0.0)
    want = oracle.run(questions, 2, seed=1, temperature=0.0)
    assert _trajectories(got) == _trajectories(want)
    assert list(got.episodes(SUB)) and max(len(e.turns) for e in got.episodes()) >= 3
    for a, b in zip(got.episodes(), want.episodes(), strict=True):
        np.testing.assert_allclose(a.logprobs, b.logprobs, atol=2e-4)
    assert engine.slot_stats[MAIN]["block_size"] == BLOCK


def test_a_small_store_gives_the_same_episodes(world):
    """One context's blocks per shard for the main agent and few rows: parked main episodes leave the store and
    prefill again, and the sampled episodes are those of the contiguous slots (one per rollout)."""
    questions = questions_of(world, 4)  # 8 rollouts
    want = _engines(world)[0].run(questions, 2, seed=7)
    shards = _fewest(world, MAIN)
    context = world.config.main.context_tokens
    engine, _ = paged(_engines(world, **{MAIN: shards, SUB: 1}), **{MAIN: shards * -(-context // BLOCK)})
    got = engine.run(questions, 2, seed=7)
    assert _trajectories(got) == _trajectories(want)
    for a, b in zip(got.episodes(), want.episodes(), strict=True):
        np.testing.assert_allclose(a.logprobs, b.logprobs, atol=2e-4)
    assert engine.slot_stats[MAIN]["evictions"] > 0


def test_a_paged_turn_prefills_only_what_its_episode_gained(world):
    engine, _ = paged(_engines(world))
    batch = engine.run(questions_of(world), 2, seed=3)
    for agent in (MAIN, SUB):
        stats = engine.slot_stats[agent]
        episodes = [e for e in batch.episodes(agent) if any(e.loss_mask)]
        assert stats["evictions"] == 0 and stats["blocks_held"] == 0
        # Every cache position is written once, by a prefill or a decode step, or found in a shared block.
        assert stats["prefill_tokens"] + stats["fed_tokens"] + stats["shared_tokens"] == \
            sum(_cache_writes(e) for e in episodes)


def test_each_agent_gets_the_paged_store_its_config_sets(world):
    config = world.config.copy_and_resolve_references()
    blocks = 2 * -(-config.main.context_tokens // 8) * _fewest(world, MAIN)  # two contexts per shard
    config.rollout.kv_block_size, config.main.rollout_kv_blocks = 8, blocks
    engine = system.build_engine(config, world.tokenizer, world.env, world.agents)
    assert (engine.top.kv_block_size, engine.top.kv_blocks, engine.sub.kv_blocks) == (8, blocks, 0)
    engine.run(questions_of(world, 1), 1, seed=0)
    assert engine.slot_stats[MAIN]["blocks"] == blocks and engine.slot_stats[MAIN]["block_size"] == 8


@pytest.fixture(scope="module")
def shared_prompt_workload(tiny_cfg):
    """Q = 2 queries x K = 8 rollouts of a scripted agent whose 256-token system prompt every episode shares (and
    its question the K rollouts of a query): 2-3 tool turns of 16-48 tokens, tool responses of 16-64."""
    cfg = get_model_config("tiny", vocab_size=64, d_model=32, n_layers=1, n_heads=2, n_kv_heads=1, head_dim=16,
                           mlp_dim=64)
    from flax import nnx

    from mgrpo_jax.model import Transformer

    sampler = Sampler(Transformer(cfg, rngs=nnx.Rngs(0)))
    tokenizer = LengthTokenizer(cfg.vocab_size)
    script = LongScript((2, 3), 48, (16, 64))
    questions = [types.SimpleNamespace(text=f"what is the question number {q} about?" * 2) for q in range(2)]

    def run(block_size: int):
        runtime = AgentRuntime("single", sampler, "s" * 256, {"read": _page}, max_turns=8, context_tokens=1024,
                               tokenizer=tokenizer, kv_block_size=block_size)
        engine = ScriptedRolloutEngine(tokenizer, runtime, None, RolloutLimits(max_turn_tokens=48),
                                       scripts={"single": script})
        batch = engine.run(questions, 8, seed=0)
        return batch, engine.slot_stats["single"]

    return run


def test_k_rollouts_prefill_their_shared_prompt_once(shared_prompt_workload):
    """Prefill (and decode) tokens per context token: 1.00 on contiguous slots; paged, the prompt's full blocks are
    prefilled once per query (its first rollout) and once more for the system prompt's blocks per other query."""
    (contiguous, plain), (batch, stats) = shared_prompt_workload(0), shared_prompt_workload(BLOCK)
    assert _trajectories(batch) == _trajectories(contiguous)
    episodes = list(batch.episodes())
    context = needed_context(episodes)
    assert (plain["prefill_tokens"] + plain["fed_tokens"]) / context == 1.0
    ratio = (stats["prefill_tokens"] + stats["fed_tokens"]) / context
    # The first turn's context (system prompt, question, header) ends where its first sampled token starts.
    first = int(np.flatnonzero(episodes[0].loss_mask)[0])
    prompt_blocks = (first - 1) // BLOCK  # the full blocks before its first decode position
    prompt_share = len(episodes) * prompt_blocks * BLOCK / context
    # Each query's first rollout prefills the prompt's blocks (the second query finds the system prompt's too):
    # at most 1/K of the prompt's share, plus everything else once.
    assert ratio <= prompt_share / 8 + (1 - prompt_share) + 1e-9
    assert stats["shared_tokens"] >= 2 * 7 * prompt_blocks * BLOCK
    print(f"prefill per context token: contiguous 1.00, paged {ratio:.3f}; prompt share {prompt_share:.3f}")
