"""Sampling kernels (filters, log-probs of the sampling distribution) and shape buckets."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from mgrpo_jax.sampling import bucket, filter_logits, inverse_cdf, pad_prompts, pow2_buckets, sample_logits, stop_table


def _logits(b=6, v=50, seed=0):
    return jax.random.normal(jax.random.key(seed), (b, v)) * 3.0


def test_filter_top_k_keeps_k():
    x = _logits()
    f = filter_logits(x, jnp.ones(6), top_k=5)
    assert (np.isfinite(np.asarray(f)).sum(-1) == 5).all()
    top = np.argsort(-np.asarray(x), -1)[:, :5]
    assert np.isfinite(np.take_along_axis(np.asarray(f), top, -1)).all()


def test_filter_top_p_keeps_smallest_nucleus():
    x = _logits()
    for p in (0.3, 0.9):
        f = np.asarray(filter_logits(x, jnp.ones(6), top_p=p))
        probs = np.asarray(jax.nn.softmax(x))
        for b in range(6):
            kept = np.isfinite(f[b])
            order = np.argsort(-probs[b])
            n = kept.sum()
            assert set(np.flatnonzero(kept)) == set(order[:n])
            assert probs[b][order[: n - 1]].sum() < p <= probs[b][order[:n]].sum() + 1e-6


def test_sampling_logprob_matches_frequencies():
    """The recorded log-prob is log q(token) of the distribution the token was drawn from."""
    x = _logits(b=1, v=8, seed=3)
    n = 10000
    keys = jax.random.split(jax.random.key(0), n)
    x_rep = jnp.repeat(x, n, axis=0)
    for kw, temp in ((dict(), 1.0), (dict(top_k=3), 0.7), (dict(top_p=0.8), 1.3)):
        fn = jax.jit(lambda xs, k, t, kw=kw: sample_logits(xs, k, t, **kw))
        tok, lp = fn(x_rep, keys, jnp.full((n,), temp))
        tok, lp = np.asarray(tok), np.asarray(lp)
        freq = np.bincount(tok, minlength=8) / n
        ref = np.asarray(jax.nn.softmax(filter_logits(x, jnp.full((1,), temp), **kw)))[0]
        np.testing.assert_allclose(freq, ref, atol=0.02)  # ~4 binomial std at n=10k
        np.testing.assert_allclose(lp, np.log(ref[tok]), atol=1e-5)
        if kw:
            assert (ref == 0).sum() >= 3 and (freq[ref == 0] == 0).all()


def test_temperature_one_logprob_is_model_logprob():
    x = _logits()
    tok, lp = jax.jit(sample_logits)(x, jax.random.split(jax.random.key(1), 6), jnp.ones(6))
    ref = jnp.take_along_axis(jax.nn.log_softmax(x), tok[:, None], -1)[:, 0]
    np.testing.assert_allclose(lp, ref, atol=1e-6)


def test_greedy_rows_mixed_with_sampled_rows():
    x = _logits()
    temp = jnp.array([0.0, 1.0, 0.0, 2.0, 0.0, 0.5])
    tok, lp = jax.jit(sample_logits)(x, jax.random.split(jax.random.key(2), 6), temp)
    am = np.asarray(x).argmax(-1)
    np.testing.assert_array_equal(np.asarray(tok)[[0, 2, 4]], am[[0, 2, 4]])
    ref = np.asarray(jax.nn.log_softmax(x))[np.arange(6), am]
    np.testing.assert_allclose(np.asarray(lp)[[0, 2, 4]], ref[[0, 2, 4]], atol=1e-6)


@pytest.mark.parametrize(("top_k", "top_p"), [(0, 1.0), (7, 1.0), (0, 0.8)])
def test_greedy_takes_the_first_max_and_sampled_rows_stay_inside_the_filters(top_k, top_p):
    x = _logits(b=8).at[1, 3].set(50.0).at[1, 9].set(50.0)  # row 1: a tie at the top
    temp = jnp.asarray([0.7, 0.0, 1.0, 0.0, 1.3, 1.0, 0.0, 2.0])
    safe_t = jnp.where(temp <= 0, 1.0, temp)
    kept = np.isfinite(np.asarray(filter_logits(x, safe_t, top_k, top_p)))
    fn = jax.jit(sample_logits, static_argnums=(3, 4))
    for seed in range(20):
        tok = np.asarray(fn(x, jax.random.split(jax.random.key(seed), 8), temp, top_k, top_p)[0])
        greedy = np.asarray(temp) <= 0
        np.testing.assert_array_equal(tok[greedy], np.asarray(x).argmax(-1)[greedy])  # first max: 3 in row 1
        assert kept[np.arange(8), tok].all()


def test_inverse_cdf_by_hand():
    # V = 20 -> blocks of 8: [0 1 0 3 0 0 0 0 | 0 ... | 2 0 0 0]; masses 4, 0, 2 (total 6).
    w = np.zeros((1, 20), np.float32)
    w[0, [1, 3, 16]] = [1.0, 3.0, 2.0]
    cases = {  # (u0, u1) -> index
        (0.0, 0.0): 1,  # threshold 0: the first positive weight (how greedy rows use it)
        (0.5, 0.2): 1,  # 0.5 * 6 = 3 < 4: block 0; 0.2 * 4 = 0.8 < 1: index 1
        (0.5, 0.25): 3,  # 0.25 * 4 = 1 is not below index 1's cumulative weight 1: index 3
        (0.6, 0.99): 3,
        (4 / 6 + 1e-3, 0.0): 16,  # past block 0's mass, the empty block 1 is skipped
        (0.9999999, 0.9999999): 16,  # never a zero-weight index, even at the top of the range
    }
    for (u0, u1), want in cases.items():
        got = int(inverse_cdf(jnp.asarray(w), jnp.asarray([[u0, u1]], jnp.float32))[0])
        assert got == want, ((u0, u1), got, want)
    assert int(inverse_cdf(jnp.zeros((1, 20)), jnp.asarray([[0.3, 0.3]]))[0]) == 0  # no weight at all


def test_inverse_cdf_draws_a_large_vocabulary_at_its_rates():
    """Two-stage draws over V = 300 (blocks of 32, the last one padded) match the distribution, including
    its small probabilities (a chi-square statistic over the tokens expected 5+ times)."""
    x = jax.random.normal(jax.random.key(11), (1, 300)) * 2.0
    probs = np.asarray(jax.nn.softmax(x))[0].astype(np.float64)
    n = 60000
    u = jax.random.uniform(jax.random.key(12), (n, 2))
    tok = np.asarray(jax.jit(inverse_cdf)(jnp.repeat(jnp.exp(x - x.max()), n, axis=0), u))
    counts = np.bincount(tok, minlength=300)
    expected = probs * n
    big = expected >= 5
    chi2 = (((counts - expected) ** 2 / expected)[big]).sum()
    dof = big.sum() - 1
    assert chi2 < dof + 6 * np.sqrt(2 * dof), (chi2, dof)  # a 6-sigma bound on the statistic
    assert counts[~big].sum() < 3 * expected[~big].sum() + 30


def test_tiny_top_p_and_top_k_one_are_greedy():
    x = _logits(b=64, v=300, seed=4)
    keys = jax.random.split(jax.random.key(3), 64)
    am = np.asarray(x).argmax(-1)
    for kw in (dict(top_k=1), dict(top_p=1e-6)):
        tok, lp = jax.jit(lambda x, k, t, kw=kw: sample_logits(x, k, t, **kw))(x, keys, jnp.ones(64))
        np.testing.assert_array_equal(np.asarray(tok), am)
        np.testing.assert_allclose(lp, 0.0, atol=1e-6)


def test_buckets():
    assert pow2_buckets(5, 100) == (8, 16, 32, 64, 128)
    assert bucket(3, (4, 8)) == 4 and bucket(8, (4, 8)) == 8
    assert bucket(9, (4, 8)) == 16 and bucket(17, (4, 8)) == 24
    assert bucket(3, (1, 2, 4, 8), multiple=8) == 8
    assert bucket(0, (1, 2)) == 1
    with pytest.raises(ValueError):
        bucket(-1, (1,))


def test_pad_prompts():
    tokens, lengths = pad_prompts([[5, 6, 7], [8]], batch_buckets=(4,), length_buckets=(4, 8), pad_id=0)
    np.testing.assert_array_equal(tokens, [[5, 6, 7, 0], [8, 0, 0, 0], [0] * 4, [0] * 4])
    np.testing.assert_array_equal(lengths, [3, 1, 1, 1])
    assert tokens.dtype == np.int32


def test_stop_table():
    np.testing.assert_array_equal(stop_table((1, 2), 2), [[1, 2, -1, -1], [1, 2, -1, -1]])
    np.testing.assert_array_equal(stop_table([[1], [], [3, 4]], 3, width=2), [[1, -1], [-1, -1], [3, 4]])
    assert stop_table([list(range(5))], 1).shape == (1, 16)
