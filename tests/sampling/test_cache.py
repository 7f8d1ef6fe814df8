"""The sampler's KV-cache pool and the cache functions the decode programs use; observing compiled calls."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from mgrpo_jax.model import Transformer, get_model_config
from mgrpo_jax.sampling import CachePool, CallObserver, Sampler, observe
from mgrpo_jax.sampling.cache import put_rows, resize_slots, shape, take_rows, write_slots
from mgrpo_jax.sampling.observe import observed
from mgrpo_jax.sampling.slots import DecodeSlots


def _cache(rows, slots, layers=2, fill=None):
    """A cache of the model's layout (CACHE_AXES): k [rows, heads, head_dim, slots], v [rows, heads, slots, head_dim],
    mask [rows, slots]; filled with distinct values (`fill`: a constant)."""
    def values(shape):
        x = jnp.arange(np.prod(shape), dtype=jnp.float32).reshape(shape)
        return x if fill is None else jnp.full(shape, fill, jnp.float32)

    return {"k": tuple(values((rows, 2, 3, slots)) + i for i in range(layers)),
            "v": tuple(values((rows, 2, slots, 3)) - i for i in range(layers)),
            "mask": jnp.arange(rows * slots).reshape(rows, slots) % 3 == 0 if fill is None
            else jnp.full((rows, slots), bool(fill))}


def test_the_pool_hands_out_one_cache_per_shape_and_keeps_what_is_given_back():
    made = []
    pool = CachePool(lambda rows, slots: made.append((rows, slots)) or _cache(rows, slots))
    a = pool.take(2, 8)
    assert made == [(2, 8)] and pool.shapes() == [] and pool.peek(2, 8) is None
    pool.give_back(a)
    assert pool.shapes() == [(2, 8)] and pool.peek(2, 8) is a and pool.peek(2, 8) is a  # peek leaves it there
    assert pool.take(2, 8) is a and made == [(2, 8)]  # reused, not made again
    b = pool.take(2, 8)  # the pool's one was taken: a new one
    assert b is not a and made == [(2, 8), (2, 8)]
    pool.give_back(b)
    pool.give_back(_cache(4, 16))
    assert sorted(pool.shapes()) == [(2, 8), (4, 16)] and shape(pool.peek(4, 16)) == (4, 16)


def test_resize_and_write_slots_keep_the_first_slots():
    full = _cache(2, 8)
    small = resize_slots(full, 5)
    assert shape(small) == (2, 5)
    np.testing.assert_array_equal(small["k"][1], full["k"][1][..., :5])
    np.testing.assert_array_equal(small["v"][0], full["v"][0][:, :, :5])
    grown = resize_slots(small, 8)  # padded with empty, masked-out slots
    np.testing.assert_array_equal(grown["k"][0][..., 5:], 0)
    assert not np.asarray(grown["mask"][:, 5:]).any()
    base = _cache(2, 8, fill=0.0)
    written = write_slots(base, small)
    np.testing.assert_array_equal(written["k"][1][..., :5], full["k"][1][..., :5])
    np.testing.assert_array_equal(written["k"][1][..., 5:], base["k"][1][..., 5:])
    np.testing.assert_array_equal(written["v"][0][:, :, :5], full["v"][0][:, :, :5])
    np.testing.assert_array_equal(written["mask"][:, :5], full["mask"][:, :5])


def test_rows_are_taken_and_put_back_in_a_window_and_padding_rows_are_dropped():
    cache = _cache(3, 8)
    rows = jnp.asarray([2, 0, 3], jnp.int32)  # 3 is padding: read clipped, never written
    part = take_rows(cache, rows)
    np.testing.assert_array_equal(part["k"][0][0], cache["k"][0][2])
    np.testing.assert_array_equal(part["k"][0][2], cache["k"][0][2])  # clipped to the last row
    part = jax.tree.map(lambda x: jnp.ones_like(x) if x.dtype == jnp.bool_ else -jnp.ones_like(x),
                        resize_slots(part, 4))
    out = put_rows(cache, rows, part, 4)
    for r in (0, 2):
        np.testing.assert_array_equal(out["k"][1][r][..., :4], -1)
        np.testing.assert_array_equal(out["k"][1][r][..., 4:], cache["k"][1][r][..., 4:])
        np.testing.assert_array_equal(out["v"][0][r][:, :4], -1)
        assert np.asarray(out["mask"][r, :4]).all()
    np.testing.assert_array_equal(out["k"][0][1], cache["k"][0][1])  # untouched row


@pytest.fixture(scope="module")
def sampler():
    cfg = get_model_config("tiny", n_layers=1, vocab_size=64)
    model = jax.jit(lambda k: nnx.state(Transformer(cfg, rngs=nnx.Rngs(k))))(jax.random.key(0))
    graphdef = nnx.graphdef(nnx.eval_shape(lambda: Transformer(cfg, rngs=nnx.Rngs(0))))
    return Sampler(nnx.merge(graphdef, model), batch_buckets=(2,), length_buckets=(8,))


class Calls(CallObserver):
    def __init__(self):
        self.calls = []

    def on_call(self, kind, seconds, compiled):
        self.calls.append((kind, seconds, compiled))


def test_observers_see_every_compiled_call_and_the_slots_use_the_samplers_pool(sampler):
    with observe(Calls()) as seen:
        out = sampler.sample([[1, 2, 3], [4]], max_new=4, rng=0)
        ((kind, seconds, compiled),) = seen.calls
        assert kind == "generate" and seconds >= 0 and isinstance(compiled, bool)
        assert (2, 12) in sampler.caches.shapes() and out.tokens.shape == (2, 4)
        slots = DecodeSlots(sampler, n_slots=2, max_len=32, chunk=4)
        owner = object()
        slots.assign(owner, slots.free_slot())
        slots.start(owner, [1, 2, 3], budget=6, seed=1, temperature=1.0)
        finished = []
        while slots.busy:
            slots.launch()
            finished += slots.collect()
        assert len(finished) == 1 and finished[0][0] is owner and len(finished[0][1]) == 6
        assert [k for k, _, _ in seen.calls[1:]] == ["slots_launch", "slots_collect"] * slots.chunks
        assert (2, 32) not in sampler.caches.shapes()  # held by the slots while they run
        cache = slots.cache
        slots.close()
        assert sampler.caches.peek(2, 32) is cache  # given back for the next run
    n = len(seen.calls)
    sampler.sample([[1, 2, 3]], max_new=4, rng=0)
    assert len(seen.calls) == n  # no longer registered


def test_a_call_that_grows_the_programs_counts_as_compiled():
    programs = [0]

    def call():
        programs[0] += 1
        return "out"

    with observe(Calls()) as seen, observe(Calls()) as other:
        assert observed("x", lambda: programs[0], call) == "out"
        assert observed("y", lambda: 0, lambda: "again") == "again"
    assert [(k, c) for k, _, c in seen.calls] == [(k, c) for k, _, c in other.calls] == [("x", True), ("y", False)]
    assert observed("z", lambda: 0, lambda: 1) == 1 and len(seen.calls) == 2


def test_a_chunk_over_few_slots_decodes_those_alone_and_samples_what_a_full_pool_would(sampler):
    """With 2 of 8 slots in a turn a chunk decodes half the pool, those 2 gathered (`slot_steps` counts 4 rows a step);
    their turns sample the same tokens and log-probs as beside 6 more (random numbers come from the turn), over two
    turns of several chunks, one ending inside a chunk."""
    turns = {"a": ([5, 1, 2, 3], 10, 11), "b": ([7, 4], 7, 12)}  # first context, budget, seed
    turns.update({f"other{i}": ([3, i + 1], 12, 100 + i) for i in range(6)})

    def run(slot_of: dict):
        slots = DecodeSlots(sampler, n_slots=8, max_len=64, chunk=4)
        owners = {name: object() for name in slot_of}
        for name, slot in slot_of.items():
            slots.assign(owners[name], slot)
        contexts = {name: list(turns[name][0]) for name in owners}
        sampled = {name: ([], []) for name in owners}
        for turn in range(2):
            for name, owner in owners.items():
                _, budget, seed = turns[name]
                slots.start(owner, contexts[name], budget=budget, seed=seed + turn, temperature=0.7)
            finished = []
            while slots.busy:
                slots.launch()
                finished += slots.collect()
            by_owner = {id(owner): (ids, lps) for owner, ids, lps, _ in finished}
            for name, owner in owners.items():
                ids, lps = by_owner[id(owner)]
                sampled[name][0].extend(ids.tolist())
                sampled[name][1].extend(lps.tolist())
                contexts[name] += ids.tolist() + [9, 10]  # a tool response after the turn
        slots.close()
        return sampled, slots

    alone, few = run({"a": 6, "b": 2})
    beside, full = run({"a": 0, "b": 1, **{f"other{i}": 2 + i for i in range(6)}})
    for name in ("a", "b"):
        assert len(alone[name][0]) == 2 * turns[name][1]
        assert alone[name][0] == beside[name][0]
        np.testing.assert_allclose(alone[name][1], beside[name][1], rtol=1e-5, atol=1e-6)
    # Alone, per turn: chunks of 4 steps over a and b, 4 more (b ends after 3), 2 over a: 4 rows each (a, b or a
    # alone, and padding rows).
    assert few.slot_steps == 2 * 4 * (4 + 4 + 2) and few.sampled_tokens == 2 * (10 + 7)
    # Beside 6 more: every chunk over all 8 (7 or 8 in a turn, more than half the pool), 3 chunks of the 12-token
    # turns per turn.
    assert full.slot_steps == 2 * 3 * 4 * 8
