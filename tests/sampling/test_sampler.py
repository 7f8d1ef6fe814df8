"""Sampler: log-probs vs teacher forcing, greedy vs argmax, padding independence, stops, filters, sharding.

All end-to-end tests share one tiny model and a handful of shapes (each new shape is one XLA compile).
Log-prob tolerance: 1e-5 absolute in float32 (cached single-token decode vs. the full causal forward).
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from hypothesis import given
from hypothesis import strategies as st

from mgrpo_jax.model import CACHE_AXES, Transformer, get_model_config, make_mesh, shard_model, token_logprobs
from mgrpo_jax.sampling import NO_STOP, Sampler, decode_windows, pad_prompts
from mgrpo_jax.sampling import sampler as sampler_mod

LOGPROB_TOL = 1e-5
MAX_NEW = 12
P = 16
LENGTHS = (3, 9, 16, 5)


def _tiny(seed):
    """The tiny model, initialised in one jitted call (op-by-op eager init is slow to dispatch)."""
    cfg = get_model_config("tiny")
    graphdef = nnx.graphdef(nnx.eval_shape(lambda: Transformer(cfg, rngs=nnx.Rngs(0))))
    state = jax.jit(lambda k: nnx.state(Transformer(cfg, rngs=nnx.Rngs(k))))(jax.random.key(seed))
    return nnx.merge(graphdef, state)


@pytest.fixture(scope="module")
def model():
    return _tiny(0)


@pytest.fixture(scope="module")
def prompts():
    rng = np.random.default_rng(0)
    return [list(rng.integers(4, 1000, size=n)) for n in LENGTHS]


@pytest.fixture(scope="module")
def sampler(model):
    return Sampler(model, batch_buckets=(4,), length_buckets=(P,))


@jax.jit(static_argnums=0)
def _forward(graphdef, state, seq):
    model = nnx.merge(graphdef, state)
    pos = jnp.broadcast_to(jnp.arange(seq.shape[1], dtype=jnp.int32)[None], seq.shape)
    return token_logprobs(model, seq, pos), model(seq, pos)[0]


def _reference(model, prompts, new_tokens):
    """Teacher-forced log-probs and full-forward logits of prompt + new tokens for every row at once.

    Rows are right-padded to one length; causal attention makes the padding after a row irrelevant.
    Returns per-row arrays aligned with ``new_tokens``: log-probs [n], logits predicting them [n, V].
    """
    n = new_tokens.shape[1]
    seq = np.zeros((len(prompts), P + n), np.int32)
    for b, p in enumerate(prompts):
        seq[b, : len(p) + n] = [*p, *new_tokens[b]]
    lp, logits = jax.device_get(_forward(*nnx.split(model), jnp.asarray(seq)))
    return ([lp[b, len(p): len(p) + n] for b, p in enumerate(prompts)],
            [logits[b, len(p) - 1: len(p) - 1 + n] for b, p in enumerate(prompts)])


def test_logprobs_equal_teacher_forced(model, sampler, prompts):
    out = sampler.sample(prompts, max_new=MAX_NEW, rng=1, temperature=1.0)
    assert out.tokens.shape == (4, MAX_NEW) and out.logprobs.dtype == np.float32
    assert (out.lengths == MAX_NEW).all() and not out.stopped.any()
    ref, _ = _reference(model, prompts, out.tokens)
    for b in range(len(prompts)):
        np.testing.assert_allclose(out.logprobs[b], ref[b], atol=LOGPROB_TOL, rtol=0)
    # Sampling actually samples (not greedy) at temperature 1.
    greedy = sampler.sample(prompts, max_new=MAX_NEW, rng=1, temperature=0.0)
    assert (greedy.tokens != out.tokens).any()


def test_greedy_is_argmax_of_full_forward(model, sampler, prompts):
    out = sampler.sample(prompts, max_new=MAX_NEW, rng=3, temperature=0.0)
    ref_lp, ref_logits = _reference(model, prompts, out.tokens)
    for b in range(len(prompts)):
        np.testing.assert_array_equal(out.tokens[b], ref_logits[b].argmax(-1))
        # Greedy rows record the model's own log-prob of the argmax token.
        np.testing.assert_allclose(out.logprobs[b], ref_lp[b], atol=LOGPROB_TOL, rtol=0)


def test_rows_independent_of_batch_and_padding(model, sampler, prompts):
    keys = jax.random.split(jax.random.key(7), 4)
    tokens, lengths = pad_prompts(prompts, batch_buckets=(4,), length_buckets=(P,))
    ref = sampler.generate(tokens, lengths, max_new=MAX_NEW, rng=keys)
    # Same rows in another order: each row keeps its result.
    perm = np.array([2, 0, 3, 1])
    out = sampler.generate(tokens[perm], lengths[perm], max_new=MAX_NEW, rng=keys[perm])
    np.testing.assert_array_equal(np.asarray(out.tokens), np.asarray(ref.tokens)[perm])
    np.testing.assert_allclose(np.asarray(out.logprobs), np.asarray(ref.logprobs)[perm], atol=LOGPROB_TOL)
    # The shortest prompt alone, unpadded, in a batch of one.
    b = int(np.argmin(LENGTHS))
    alone = Sampler(model).generate(np.array([prompts[b]]), [LENGTHS[b]], max_new=MAX_NEW, rng=keys[b:b + 1])
    np.testing.assert_array_equal(np.asarray(alone.tokens)[0], np.asarray(ref.tokens)[b])
    np.testing.assert_allclose(np.asarray(alone.logprobs)[0], np.asarray(ref.logprobs)[b], atol=LOGPROB_TOL)


def test_stop_tokens_and_budgets(sampler, prompts):
    free = sampler.sample(prompts, max_new=MAX_NEW, rng=0, temperature=0.0)
    # Row 0 stops on its 4th greedy token; row 1 has a budget of 6; row 2 stops at once on its first
    # token; row 3 has a stop set that never fires and a budget of 0.
    stops = [[int(free.tokens[0, 3]), 999_999], [], [int(free.tokens[2, 0])], [NO_STOP]]
    first_hit = int(np.flatnonzero(free.tokens[0] == free.tokens[0, 3])[0])
    out = sampler.sample(prompts, max_new=MAX_NEW, rng=0, temperature=0.0, stop_tokens=stops,
                         budgets=[MAX_NEW, 6, MAX_NEW, 0])
    np.testing.assert_array_equal(out.lengths, [first_hit + 1, 6, 1, 0])
    np.testing.assert_array_equal(out.stopped, [True, False, True, False])
    for b, n in enumerate(out.lengths):
        np.testing.assert_array_equal(out.tokens[b, :n], free.tokens[b, :n])
        assert (out.tokens[b, n:] == sampler.pad_id).all()
        assert (out.logprobs[b, n:] == 0).all()
    # A shared stop set; early exit when every row is done.
    shared = sampler.sample(prompts, max_new=MAX_NEW, rng=0, temperature=0.0,
                            stop_tokens=[int(t) for t in free.tokens[:, 0]])
    np.testing.assert_array_equal(shared.lengths, [1, 1, 1, 1])
    assert shared.stopped.all()


def test_top_k_one_and_tiny_top_p_equal_greedy(model, sampler, prompts):
    greedy = sampler.sample(prompts, max_new=MAX_NEW, rng=0, temperature=0.0)
    for kw in (dict(top_k=1), dict(top_p=1e-6)):
        s = Sampler(model, batch_buckets=(4,), length_buckets=(P,), **kw)
        out = s.sample(prompts, max_new=MAX_NEW, rng=11, temperature=1.0)
        np.testing.assert_array_equal(out.tokens, greedy.tokens)
        # The sampling distribution is a point mass: log q = 0.
        np.testing.assert_allclose(out.logprobs, 0.0, atol=1e-6)


def test_weights_swap_without_recompiling(model, prompts):
    s = Sampler(model, batch_buckets=(4,), length_buckets=(P,))
    a = s.sample(prompts, max_new=MAX_NEW, rng=0, temperature=0.0)
    compiled = sampler_mod.compiled_programs()
    other = _tiny(42)
    s.update_weights(other)
    b = s.sample(prompts, max_new=MAX_NEW, rng=0, temperature=0.0)
    assert sampler_mod.compiled_programs() == compiled
    assert (a.tokens != b.tokens).any()
    s.update_weights(nnx.state(model))
    c = s.sample(prompts, max_new=MAX_NEW, rng=0, temperature=0.0)
    np.testing.assert_array_equal(a.tokens, c.tokens)
    assert sampler_mod.compiled_programs() == compiled


def test_cache_is_donated_and_reused(sampler, prompts):
    sampler.sample(prompts, max_new=MAX_NEW, rng=0)
    assert (4, P + MAX_NEW) in sampler.caches.shapes()
    old = sampler.caches.peek(4, P + MAX_NEW)
    sampler.sample(prompts, max_new=MAX_NEW, rng=0)
    assert all(a.is_deleted() for a in jax.tree.leaves(old))
    assert not any(a.is_deleted() for a in jax.tree.leaves(sampler.caches.peek(4, P + MAX_NEW)))


def test_sharded_matches_single_device(model, sampler, prompts):
    assert len(jax.devices()) == 8
    mesh = make_mesh({"data": 4, "fsdp": 1, "tensor": 2})
    sharded = shard_model(model, mesh)
    keys = jax.random.split(jax.random.key(5), 4)
    tokens, lengths = pad_prompts(prompts, batch_buckets=(4,), length_buckets=(P,))
    for phases in (1, 3):
        s = Sampler(sharded, batch_buckets=(4,), length_buckets=(P,), decode_phases=phases)
        for temp in (1.0, 0.0):
            ref = sampler.generate(tokens, lengths, max_new=MAX_NEW, rng=keys, temperature=temp)
            out = s.generate(tokens, lengths, max_new=MAX_NEW, rng=keys, temperature=temp)
            assert len(out.tokens.sharding.device_set) == 8
            assert out.tokens.sharding.spec[0] == "data"
            np.testing.assert_array_equal(np.asarray(out.tokens), np.asarray(ref.tokens))
            np.testing.assert_allclose(np.asarray(out.logprobs), np.asarray(ref.logprobs), atol=LOGPROB_TOL)
        cache = s.caches.peek(4, P + MAX_NEW)
        axes = CACHE_AXES["k"]  # the model's per-layer cache layout, by logical name
        spec = tuple(cache["k"][-1].sharding.spec) + (None,) * len(axes)
        assert spec[axes.index("cache_batch")] == "data"
        assert spec[axes.index("cache_kv_heads")] == "tensor"


def test_decode_windows_by_hand():
    # 11 decode steps write slots 16..26 of a 28-slot cache: thirds end at slots 20 and 24.
    assert decode_windows(16, 28, 12, 3) == [20, 24, 28]
    assert decode_windows(16, 28, 12, 1) == [28]
    assert decode_windows(16, 28, 1, 4) == [28]  # no decode step
    assert decode_windows(16, 28, 3, 10) == [17, 28]  # at most one phase per step


@given(st.integers(1, 64), st.integers(1, 64), st.integers(0, 8), st.integers(1, 12))
def test_decode_windows_cover_every_step(prompt_len, max_new, spare, phases):
    n_slots = prompt_len + max_new + spare
    windows = decode_windows(prompt_len, n_slots, max_new, phases)
    assert windows[-1] == n_slots and windows == sorted(set(windows))
    assert len(windows) <= max(1, min(phases, max_new - 1))
    # Decode step i (1 <= i < max_new) writes slot P + i - 1 and runs in the first phase whose window
    # holds that slot; every phase but the last gets at least one step.
    first = [next(w for w in windows if prompt_len + i - 1 < w) for i in range(1, max_new)]
    assert set(windows[:-1]) <= set(first)


@pytest.mark.parametrize("phases", [3, 5])
def test_decode_phases_match_one_loop(model, sampler, prompts, phases):
    phased = Sampler(model, batch_buckets=(4,), length_buckets=(P,), decode_phases=phases)
    free = sampler.sample(prompts, max_new=MAX_NEW, rng=0, temperature=0.0)
    # Temperature 1, greedy, and stops + budgets that end rows inside the second phase (early exit).
    calls = [dict(rng=3, temperature=1.0), dict(rng=0, temperature=0.0),
             dict(rng=0, temperature=0.0, stop_tokens=[[int(free.tokens[0, 5])], [], [], []],
                  budgets=[MAX_NEW, 6, 5, 0])]
    for i, kw in enumerate(calls):
        ref = sampler.sample(prompts, max_new=MAX_NEW, **kw)
        out = phased.sample(prompts, max_new=MAX_NEW, **kw)
        np.testing.assert_array_equal(out.tokens, ref.tokens)
        np.testing.assert_array_equal(out.lengths, ref.lengths)
        np.testing.assert_array_equal(out.stopped, ref.stopped)
        np.testing.assert_allclose(out.logprobs, ref.logprobs, atol=LOGPROB_TOL, rtol=0)
        if i == 0:  # every row ran all steps: the whole donated cache comes back with what one loop wrote
            _assert_same_filled_slots(phased.caches.peek(4, P + MAX_NEW), sampler.caches.peek(4, P + MAX_NEW))


def test_out_major_weights_sample_the_same_tokens(model, prompts):
    # The default on CPU devices: the MLP matrices and the LM head transposed once per call.
    out_major = Sampler(model, batch_buckets=(4,), length_buckets=(P,))
    plain = Sampler(model, batch_buckets=(4,), length_buckets=(P,), out_major=False)
    assert (out_major.out_major, plain.out_major) == (True, False)
    for kw in (dict(rng=3, temperature=1.0), dict(rng=0, temperature=0.0)):
        ref = plain.sample(prompts, max_new=MAX_NEW, **kw)
        out = out_major.sample(prompts, max_new=MAX_NEW, **kw)
        np.testing.assert_array_equal(out.tokens, ref.tokens)
        np.testing.assert_array_equal(out.lengths, ref.lengths)
        np.testing.assert_allclose(out.logprobs, ref.logprobs, atol=LOGPROB_TOL, rtol=0)


def _assert_same_filled_slots(a: dict, b: dict):
    """Slots [0, P + MAX_NEW - 1) of two caches agree (the last sampled token is never fed back)."""
    for name, axis in (("k", 3), ("v", 2)):
        for x, y in zip(a[name], b[name], strict=True):
            assert x.shape == y.shape
            filled = tuple(slice(0, P + MAX_NEW - 1) if d == axis else slice(None) for d in range(x.ndim))
            np.testing.assert_allclose(np.asarray(x)[filled], np.asarray(y)[filled], atol=1e-5)


def test_input_validation(model, sampler):
    with pytest.raises(ValueError):
        sampler.generate(np.zeros((4, P), np.int32), [0, 1, 1, 1], max_new=MAX_NEW)
    with pytest.raises(ValueError):
        sampler.sample([[]], max_new=MAX_NEW)
    with pytest.raises(ValueError, match="decode_phases"):
        Sampler(model, decode_phases=0)
