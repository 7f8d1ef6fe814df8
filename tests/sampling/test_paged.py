"""Paged KV (mgrpo_jax/sampling/paged.py) against the contiguous decode slots: the same tokens and log-probs over
multi-turn episodes (turns of several chunks, stops inside a chunk, evictions), shared prefix blocks prefilled once,
memory that follows each episode's length, and block tables that never let two episodes write one block."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from hypothesis import given
from hypothesis import strategies as st

from mgrpo_jax.model import Transformer
from mgrpo_jax.sampling import Sampler
from mgrpo_jax.sampling.paged import BlockPool, PagedSlots, blocks_for, gather_window, pallas_attend
from mgrpo_jax.sampling.slots import DecodeSlots

HEADER = [5, 6]  # the assistant header every turn starts with
STOPS = (7, 8, 9, 10)  # stop ids: a random tiny model hits one every ~16 tokens
CHUNK = 8
MAX_LEN = 256
BLOCK = 16


@pytest.fixture(scope="module")
def sampler(tiny_cfg):
    graphdef = nnx.graphdef(nnx.eval_shape(lambda: Transformer(tiny_cfg, rngs=nnx.Rngs(0))))
    state = jax.jit(lambda k: nnx.state(Transformer(tiny_cfg, rngs=nnx.Rngs(k))))(jax.random.key(1))
    return Sampler(nnx.merge(graphdef, state))


@pytest.fixture(scope="module")
def episodes():
    """Six episodes of three turns: a 40-token prompt they share and 3 tokens of their own, turn budgets of 5-40
    tokens (up to 5 chunks), tool responses of 1-29 tokens after each turn."""
    rng = np.random.default_rng(0)
    prompt = list(rng.integers(11, 64, size=40))
    return [{"tokens": prompt + list(rng.integers(11, 64, size=3)),
             "budgets": [int(b) for b in rng.integers(5, 41, size=3)],
             "responses": [list(rng.integers(11, 64, size=int(n))) for n in rng.integers(1, 30, size=3)]}
            for _ in range(6)]


def drive(pool, episodes, temperature: float, idle_rounds: int = 1, check=None) -> list[list[tuple]]:
    """Runs the episodes' turns on `pool` as the engine does: a ready episode takes its slot, a free one or an idle
    episode's (evicted: it prefills again), and idle episodes leave until the pool `fits` its turn; after a turn an
    episode waits `idle_rounds` rounds (its tool) before the next. Returns each episode's turns as (ids, logprobs,
    stopped); `check(pool, owners)` runs after every collect."""
    owners = [object() for _ in episodes]
    index = {id(o): i for i, o in enumerate(owners)}
    turns = [[] for _ in episodes]
    tokens = [list(e["tokens"]) for e in episodes]
    wait = [0] * len(episodes)
    while True:
        ready = [i for i, e in enumerate(episodes) if len(turns[i]) < len(e["budgets"]) and not wait[i]
                 and not (pool.slot_of(owners[i]) is not None and pool.in_turn(pool.slot_of(owners[i])))]
        wait = [max(0, w - 1) for w in wait]

        def idle(me, ready=ready):
            return [s for s, o in enumerate(pool.owners)
                    if o is not None and o is not me and not pool.in_turn(s) and index[id(o)] not in ready]

        for i in ready:
            me, context, budget = owners[i], tokens[i] + HEADER, episodes[i]["budgets"][len(turns[i])]
            if pool.slot_of(me) is None:
                slot = pool.free_slot()
                if slot is None:
                    if not idle(me):
                        continue
                    slot = idle(me)[0]
                    pool.release(pool.owners[slot], evicted=True)
                pool.assign(me, slot)
            while not pool.fits(me, context, budget) and idle(me):
                pool.release(pool.owners[idle(me)[0]], evicted=True)
            if pool.fits(me, context, budget):
                pool.start(me, context, budget=budget, seed=100 * i + len(turns[i]), temperature=temperature,
                           stop_tokens=STOPS)
        if not pool.busy:
            if all(len(t) == len(e["budgets"]) for t, e in zip(turns, episodes, strict=True)):
                return turns
            continue
        pool.launch()
        for owner, ids, logprobs, stopped in pool.collect():
            i = index[id(owner)]
            tokens[i] += HEADER + ids.tolist() + episodes[i]["responses"][len(turns[i])]
            turns[i].append((ids.tolist(), logprobs, stopped))
            wait[i] = idle_rounds
            if len(turns[i]) == len(episodes[i]["budgets"]):
                pool.release(owner)
        if check is not None:
            check(pool, owners)


@pytest.fixture(scope="module")
def contiguous(sampler, episodes):
    """The contiguous slots' turns (one slot per episode), greedy and at T = 0.7."""
    return {t: drive(DecodeSlots(sampler, 6, MAX_LEN, chunk=CHUNK), episodes, t) for t in (0.0, 0.7)}


def assert_same_turns(got, want, atol=1e-5):
    for mine, theirs in zip(got, want, strict=True):
        assert [t[0] for t in mine] == [t[0] for t in theirs]
        assert [t[2] for t in mine] == [t[2] for t in theirs]
        for a, b in zip(mine, theirs, strict=True):
            np.testing.assert_allclose(a[1], b[1], atol=atol, rtol=0)


def held_blocks_follow_lengths(pool, owners):
    """Between turns an episode holds ceil(tokens / block) blocks; the store holds each shared block once."""
    tables = [pool.blocks_of(o) for o in owners if pool.slot_of(o) is not None]
    for o in owners:
        slot = pool.slot_of(o)
        if slot is not None and not pool.in_turn(slot):
            assert len(pool.blocks_of(o)) == blocks_for(pool.cached[slot], BLOCK)
    assert pool.pool.held() == len({b for table in tables for b in table})


@pytest.mark.parametrize("temperature", [0.0, 0.7], ids=["greedy", "sampled"])
def test_paged_slots_give_the_contiguous_slots_turns(sampler, episodes, contiguous, temperature):
    pool = PagedSlots(sampler, 6, MAX_LEN, chunk=CHUNK, block_size=BLOCK)
    turns = drive(pool, episodes, temperature, check=held_blocks_follow_lengths)
    assert_same_turns(turns, contiguous[temperature])
    every = [t for episode in turns for t in episode]
    assert any(len(ids) > 2 * CHUNK for ids, _, _ in every)  # turns span several chunks
    assert any(stopped and len(ids) % CHUNK for ids, _, stopped in every)  # a stop inside a chunk
    stats = pool.stats()
    # The five later episodes found the prompt's two full blocks (of the 44 tokens before the first decode) shared.
    assert stats["shared_tokens"] >= 5 * 2 * BLOCK and stats["evictions"] == 0
    assert stats["blocks_held"] == 0 and pool.pool.available(0) == pool.pool.n_blocks  # all freed at close


def test_a_store_too_small_for_every_episode_evicts_and_gives_the_same_turns(sampler, episodes, contiguous):
    """20 blocks (one context is 16): idle episodes leave and prefill again (from blocks still kept, where they
    are), and every turn is the one the contiguous slots sampled."""
    pool = PagedSlots(sampler, 6, MAX_LEN, chunk=CHUNK, block_size=BLOCK, blocks=20)
    turns = drive(pool, episodes, 0.7, check=held_blocks_follow_lengths)
    assert_same_turns(turns, contiguous[0.7])
    stats = pool.stats()
    assert stats["evictions"] > 0 and stats["blocks_peak"] <= 20
    assert stats["prefill_tokens"] + stats["fed_tokens"] > sum(len(t[0]) for e in turns for t in e)


def test_k_rollouts_of_one_prompt_prefill_its_full_blocks_once(sampler):
    """K = 8 episodes of one 50-token prompt: the first prefills its 51 tokens before the first decode, each other
    one only the 3 past the prompt's 3 full blocks (48 tokens): 51 + 7 x 3 = 72 prefilled tokens, against 8 x 51."""
    K, prompt = 8, list(np.random.default_rng(3).integers(11, 64, size=50))
    pool = PagedSlots(sampler, K, MAX_LEN, chunk=CHUNK, block_size=BLOCK)
    owners = [object() for _ in range(K)]
    for k, owner in enumerate(owners):
        pool.assign(owner, k)
        pool.start(owner, prompt + HEADER, budget=12, seed=k, temperature=1.0)
    assert pool.pool.held() == blocks_for(51 + 12, BLOCK) + (K - 1) * (blocks_for(51 + 12, BLOCK) - 3)
    pool.launch()
    while pool.busy:
        pool.collect()
        pool.launch()
    pool.collect()
    stats = pool.stats()
    assert stats["prefill_tokens"] == 51 + (K - 1) * 3 and stats["shared_tokens"] == (K - 1) * 48
    lengths = [pool.cached[pool.slot_of(o)] for o in owners]  # 51 + the 12 sampled (the last one is not fed)
    assert lengths == [63] * K
    # Memory follows the length: each holds ceil(63 / 16) = 4 blocks, 3 of them the shared prompt's.
    assert pool.pool.held() == 3 + K * (blocks_for(63, BLOCK) - 3)
    pool.close()
    assert pool.pool.held() == 0


@st.composite
def contexts(draw):
    """Up to 6 contexts, each a prefix of one of two 80-token stems plus tokens of its own, and turn budgets."""
    stems = [list(range(11, 91)), list(range(11, 40)) + list(range(100, 151))]
    out = []
    for _ in range(draw(st.integers(1, 6))):
        stem = stems[draw(st.integers(0, 1))][:draw(st.integers(0, 80))]
        own = draw(st.lists(st.integers(200, 260), min_size=1, max_size=40))
        out.append((stem + own, draw(st.integers(0, 60))))
    return out


def _shared_blocks(a, b, size):
    """Full blocks at the start of both contexts' prefills (before their last token) with the same tokens."""
    n = 0
    while (n + 1) * size <= min(len(a), len(b)) - 1 and a[n * size:(n + 1) * size] == b[n * size:(n + 1) * size]:
        n += 1
    return n


@given(contexts(), st.sampled_from([4, 16]))
def test_block_tables_never_share_a_block_that_is_written(sampler, turns, size):
    """Host bookkeeping only (nothing is launched): each turn's table has the blocks of its context and budget; the
    shared ones are the full blocks before its first decode that an earlier episode holds with the same tokens (and
    the same tokens before them); every block a turn writes is its own, with one reference."""
    pool = PagedSlots(sampler, 8, 400, block_size=size)
    owners = [object() for _ in turns]
    for k, ((context, budget), owner) in enumerate(zip(turns, owners, strict=True)):
        pool.assign(owner, k)
        assert pool.fits(owner, context, budget)
        pool.start(owner, context, budget=budget, seed=0, temperature=1.0)
        shared = max((_shared_blocks(context, other, size) for other, _ in turns[:k]), default=0)
        table = pool.blocks_of(owner)
        assert len(table) == blocks_for(len(context) + budget - 1, size)
        assert pool.cached[k] == len(context) - 1
        written = table[shared:]  # its prefill and decode write from block `shared` on
        assert all(pool.pool.refs[b] == 1 for b in written)
        assert not set(written) & {b for o in owners[:k] for b in pool.blocks_of(o)}
        assert set(table[:shared]) <= {b for o in owners[:k] for b in pool.blocks_of(o)}
    tables = [pool.blocks_of(o) for o in owners]
    assert pool.pool.held() == len({b for t in tables for b in t})
    pool.close()
    assert pool.pool.held() == 0 and pool.pool.available(0) == pool.pool.n_blocks


def test_a_freed_block_keeps_its_content_until_it_is_reallocated():
    pool = BlockPool(4, block_size=2)
    a, b = pool.allocate(0), pool.allocate(0)
    pool.register(a, (0, (1, 2)))
    pool.release(a)
    pool.release(b)
    assert pool.find(0, (0, (1, 2))) == a and pool.kept(a) and pool.available(0) == 4
    pool.share(a)  # a hit takes it back
    assert pool.refs[a] == 1 and pool.available(0) == 3
    pool.release(a)
    taken = [pool.allocate(0) for _ in range(4)]  # the unindexed ones first, the kept one last
    assert taken[-1] == a and pool.find(0, (0, (1, 2))) is None
    with pytest.raises(RuntimeError, match="no KV block"):
        pool.allocate(0)


def test_a_store_that_cannot_hold_one_context_is_refused(sampler):
    with pytest.raises(ValueError, match="kv_blocks=8"):
        PagedSlots(sampler, 4, MAX_LEN, block_size=BLOCK, blocks=8)


def test_the_pallas_kernel_attends_over_the_block_tables(tiny_cfg):
    """One layer's decode attention through JAX's Pallas paged-attention kernel (its TPU interpreter here) against
    the gathered blocks and the model's dense attention: the new key and value land at their position, rows not in a
    turn write nothing. The interpreter rounds matmul inputs as the TPU's default precision does: 2e-2."""
    from mgrpo_jax.model.transformer import attention

    rng = np.random.default_rng(0)
    B, H, K, Dh, N, size = 3, tiny_cfg.n_heads, tiny_cfg.n_kv_heads, tiny_cfg.head_dim, 12, 4
    keys, values = (jnp.asarray(rng.normal(size=(K, N, size, Dh)), jnp.float32) for _ in range(2))
    table = jnp.asarray([[3, 7, 1, 0], [2, 5, 0, 0], [9, 0, 0, 0]], jnp.int32)
    pos, live = jnp.asarray([9, 4, 2], jnp.int32), jnp.asarray([True, True, False])
    q = jnp.asarray(rng.normal(size=(B, 1, H, Dh)), jnp.float32)
    k, v = (jnp.asarray(rng.normal(size=(B, 1, K, Dh)), jnp.float32) for _ in range(2))
    o, (new_keys, new_values) = jax.jit(pallas_attend(tiny_cfg, interpret=True))(q, k, v, keys, values, table, pos,
                                                                                 live)
    np.testing.assert_array_equal(new_keys[:, 1, 1], k[0, 0])  # position 9 of row 0: its third block (1), offset 1
    np.testing.assert_array_equal(new_values[:, 5, 0], v[1, 0])  # position 4 of row 1: its block 5, offset 0
    np.testing.assert_array_equal(new_keys[:, 9], keys[:, 9])  # row 2 is not in a turn
    cache = gather_window({"k": (new_keys,), "v": (new_values,)}, table, pos + 1)
    mask = cache["mask"][:, None, :]
    want = attention(q, cache["k"][0], cache["v"][0], mask, tiny_cfg)
    np.testing.assert_allclose(o[:2], want[:2], atol=2e-2)
