"""Jitted prefill + decode over a preallocated, donated KV cache.

One call samples a whole batch of continuations inside a single ``jax.jit``:

1. **Prefill**: the right-padded prompts ``[B, P]`` are written into cache slots ``[0, P)`` in one forward
   pass (padding slots are marked invalid in the cache mask); each row's first new token is sampled from the
   logits at its own last prompt position ``L_b - 1``.
2. **Decode**: a ``lax.while_loop`` feeds the previous token of every row at slot ``P + i - 1`` with its own
   position ``L_b + i - 1`` (rows advance in lockstep through the cache; per-row positions drive RoPE, so a
   short prompt gives exactly what it gives alone), samples token ``i``, and stops as soon as every row is
   done (stop token or budget). No host round-trip per token.

The cache is an argument of the jitted function and is donated, and the call returns it; ``Sampler`` keeps
one cache per shape bucket (its :class:`~mgrpo_jax.sampling.cache.CachePool`) and hands it back on the next call,
so its memory is reused, never reallocated.
The model's parameters are also an argument (``nnx.split`` state), so ``Sampler.update_weights`` after a
train step swaps weights without recompiling (as long as shapes, dtypes and shardings stay the same).

**Recorded log-probs.** ``logprobs[b, i]`` is ``log q(tokens[b, i])`` under the distribution the token was
actually drawn from: ``softmax(filter(logits / temperature))``, where ``filter`` applies top-k and then
top-p (nucleus) by setting the excluded logits to ``-inf``. This is the behaviour policy PPO needs: with
temperature 1 and no top-k/top-p it equals the model's own log-prob ``log_softmax(logits)`` (the value the
trainer recomputes teacher-forced, so importance ratios start at 1). Greedy rows (temperature 0) have a
degenerate sampling distribution; for them we record the unfiltered model log-prob ``log_softmax(logits)``
of the argmax token instead of 0, which is the more useful number for evaluation.

Compilation: one executable per (batch, prompt length, max_new, top_k, top_p, decode_phases) — use
:mod:`mgrpo_jax.sampling.buckets` to round shapes to a few buckets. Temperatures, stop-token sets,
per-row budgets and RNG keys are traced arrays, so changing them never recompiles.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Sequence
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import PartitionSpec

from mgrpo_jax.model import forward
from mgrpo_jax.sampling.buckets import DEFAULT_BATCH_BUCKETS, DEFAULT_LENGTH_BUCKETS, bucket, pad_prompts
from mgrpo_jax.sampling.cache import CachePool, resize_slots, write_slots
from mgrpo_jax.sampling.layout import decode_layout
from mgrpo_jax.sampling.observe import observed

NO_STOP = -1  # filler of the per-row stop-token table
STOP_WIDTH_BUCKETS = (4, 16, 64)


class SampleOutput(NamedTuple):
    """Result of one sampler call (rows in the order given; padding rows removed by ``Sampler.sample``).

    tokens:   [B, max_new] int32, ``pad_id`` after a row's end.
    logprobs: [B, max_new] float32, log-prob of each sampled token under the sampling distribution
              (see module docstring); 0 after a row's end.
    lengths:  [B] int32, number of new tokens (a stop token, if any, is included and counted).
    stopped:  [B] bool, True if the row ended on one of its stop tokens (False: budget ran out).
    """

    tokens: jax.Array
    logprobs: jax.Array
    lengths: jax.Array
    stopped: jax.Array


# ---------------------------------------------------------------------------------------------------
# Pure kernels


def filter_logits(logits: jax.Array, temperature: jax.Array, top_k: int = 0, top_p: float = 1.0) -> jax.Array:
    """``logits [..., V] / temperature [...]``, then top-k, then top-p; excluded entries become ``-inf``.

    ``temperature`` must be > 0 here (greedy rows are handled by the caller) and has the logits' leading
    shape (``[B]`` for the sampler's ``[B, V]``, ``[B, T]`` for the train step's teacher-forced logits). Ties
    at a cut-off value are kept, so a filter can keep slightly more than k tokens but never drops the argmax.
    """
    x = logits.astype(jnp.float32) / temperature.astype(jnp.float32)[..., None]
    V = x.shape[-1]
    if top_k and top_k < V:
        kth = jax.lax.top_k(x, top_k)[0][..., -1:]
        x = jnp.where(x >= kth, x, -jnp.inf)
    if top_p < 1.0:
        desc = -jnp.sort(-x, axis=-1)
        probs = jax.nn.softmax(desc, axis=-1)
        before = jnp.cumsum(probs, axis=-1) - probs  # mass strictly before each sorted entry
        keep = before < top_p  # always keeps the first (largest) entry
        cutoff = jnp.min(jnp.where(keep, desc, jnp.inf), axis=-1, keepdims=True)
        x = jnp.where(x >= cutoff, x, -jnp.inf)
    return x


def sampling_logits(logits: jax.Array, temperature: jax.Array, top_k: int = 0, top_p: float = 1.0) -> jax.Array:
    """The logits (up to a constant) of the distribution a token's recorded log-prob refers to: ``[..., V]``
    float32, ``temperature`` of the leading shape.

    Sampled rows (temperature > 0): ``filter_logits(logits, temperature, top_k, top_p)`` (excluded entries
    ``-inf``). Greedy rows (temperature <= 0): the unfiltered model logits (temperature 1), whose
    log-softmax is what the sampler records for them (module docstring). The sampler draws from these
    logits, and the train step recomputes its log-probs from them
    (:func:`mgrpo_jax.agent.step.policy_logits`), so on-policy importance ratios are 1.
    """
    logits = logits.astype(jnp.float32)
    greedy = temperature <= 0.0
    safe_t = jnp.where(greedy, 1.0, temperature)
    return jnp.where(greedy[..., None], logits, filter_logits(logits, safe_t, top_k, top_p))


def sample_logits(
    logits: jax.Array, keys: jax.Array, temperature: jax.Array, top_k: int = 0, top_p: float = 1.0
) -> tuple[jax.Array, jax.Array]:
    """Draw one token per row. ``keys``: [B] typed PRNG keys; ``temperature`` [B] (0 = greedy).

    Returns ``(tokens [B] int32, logprobs [B] f32)`` — log-probs under the sampling distribution, the
    unfiltered model log-prob for greedy rows (module docstring).

    Sampled rows invert the distribution's CDF with two uniforms per row (:func:`inverse_cdf`) instead of
    adding Gumbel noise to every logit: threefry bits for each of the V logits on every token cost about 4%
    of a decode call at the bench shape (62 against 9 ms per 256 steps of 16 rows). Greedy rows take the
    first maximum: the same search over the indicator of the maxima, at threshold 0.
    """
    greedy = temperature <= 0.0
    dist = sampling_logits(logits, temperature, top_k, top_p)
    top = jnp.max(dist, axis=-1, keepdims=True)
    p = jnp.exp(dist - top)  # unnormalised; 0 where the filters cut
    weights = jnp.where(greedy[:, None], (dist == top).astype(jnp.float32), p)
    u = jax.vmap(lambda key: jax.random.uniform(key, (2,)))(keys)
    tok = inverse_cdf(weights, jnp.where(greedy[:, None], 0.0, u))
    lse = top[:, 0] + jnp.log(jnp.sum(p, axis=-1))
    lp = jnp.take_along_axis(dist, tok[:, None], axis=-1)[:, 0] - lse
    return tok, lp


def inverse_cdf(weights: jax.Array, u: jax.Array) -> jax.Array:
    """The index ``i`` whose CDF interval holds each row's uniform draw: ``[B, V]`` non-negative weights
    (unnormalised), ``u`` ``[B, 2]`` in ``[0, 1)`` -> ``[B]`` int32.

    Two stages over blocks of the vocabulary: ``u[:, 0]`` picks a block by the blocks' masses, ``u[:, 1]``
    an index inside it by the block's own cumulative weights. Each stage scans about sqrt(V) sums, and a
    float32 uniform resolves 2^-24 of a block's mass rather than of the whole distribution, so small
    probabilities are drawn at their rate. ``u = 0`` gives the first index of positive weight; an index
    of zero weight is never returned while the row has a positive one (index 0 for a row without any).
    """
    B, V = weights.shape
    C = max(8, 1 << math.ceil(math.log2(math.sqrt(V))))
    nb = -(-V // C)
    w = jnp.pad(weights, ((0, 0), (0, nb * C - V))).reshape(B, nb, C)

    def search(w, cum, u):  # first position whose cumulative weight exceeds u * total, among positives
        below = jnp.sum(cum <= (u * cum[:, -1])[:, None], axis=-1)
        last_positive = jnp.max(jnp.where(w > 0, jnp.arange(w.shape[-1]), 0), axis=-1)
        return jnp.minimum(below, last_positive).astype(jnp.int32)

    mass = jnp.sum(w, axis=-1)
    j = search(mass, jnp.cumsum(mass, axis=-1), u[:, 0])
    inner = jnp.take_along_axis(w, j[:, None, None], axis=1)[:, 0]
    i = search(inner, jnp.cumsum(inner, axis=-1), u[:, 1])
    return j * C + i


def generate(
    model,
    cache: dict,
    prompts: jax.Array,
    prompt_lengths: jax.Array,
    keys: jax.Array,
    temperature: jax.Array,
    stop_tokens: jax.Array,
    budgets: jax.Array,
    *,
    max_new: int,
    top_k: int = 0,
    top_p: float = 1.0,
    pad_id: int = 0,
    decode_phases: int = 1,
    out_major: bool = False,
) -> tuple[SampleOutput, dict]:
    """Prefill + decode loop (pure; call it under ``jax.jit``). Returns ``(SampleOutput, cache)``.

    prompts [B, P] int32 right-padded; prompt_lengths [B] int32 (>= 1); keys [B] PRNG keys;
    temperature [B] f32 (0 = greedy); stop_tokens [B, S] int32 (``NO_STOP`` fills); budgets [B] int32
    (<= max_new; 0 = produce nothing). ``cache`` must have ``P + max_new`` slots (``model.init_cache``).

    ``decode_phases = n > 1`` splits the decode loop into ``n`` loops over growing copies of the cache
    (:func:`decode_windows`), so a step reads the filled slots only, up to the end of its phase, instead of
    all ``P + max_new``: the attention's cache reads shrink by up to half, for one cache copy per phase, a
    compiled loop body per phase (compile time grows with ``n``) and up to one more cache's worth of memory.
    Same tokens and log-probs as one loop, up to float summation order.

    The prefill and every decode step are :func:`mgrpo_jax.model.forward` (the model's one forward pass) on
    the model's weights laid out once per call, outside the loops (:func:`mgrpo_jax.sampling.layout.decode_layout`:
    per-layer slices; with ``out_major`` the layers' MLP matrices and the LM head transposed to ``[out, in]``,
    the layout XLA:CPU's matmul streams fastest). Same values as calling the model.
    """
    B, P = prompts.shape
    n_slots = cache["mask"].shape[1]
    if n_slots < P + max_new:
        raise ValueError(f"cache has {n_slots} slots, needs prompt {P} + max_new {max_new}")
    prompt_lengths = prompt_lengths.astype(jnp.int32)
    budgets = jnp.minimum(budgets.astype(jnp.int32), max_new)
    temperature = temperature.astype(jnp.float32)
    # Slots left over from an earlier call are never read: the query at slot s only attends to slots
    # <= s, and every one of those is (re)written by this call before it is read.

    # Each layer's weights sliced (and laid out) once, not once per token inside the decode loop.
    step_forward = functools.partial(forward, model.cfg, model.mesh_rules,
                                     decode_layout(model.arrays(), out_major=out_major,
                                                   moe_layers=model.cfg.moe_layers))
    # Prefill all prompt slots at once.
    pos = jnp.broadcast_to(jnp.arange(P, dtype=jnp.int32)[None], (B, P))
    pmask = pos < prompt_lengths[:, None]
    logits, cache = step_forward(prompts, pos, attention_mask=pmask, cache=cache, cache_index=0,
                                 logits_at=prompt_lengths - 1)
    last = logits[:, 0]

    def draw(step, logits_step, done):
        step_keys = jax.vmap(jax.random.fold_in, in_axes=(0, None))(keys, step)
        tok, lp = sample_logits(logits_step, step_keys, temperature, top_k, top_p)
        tok = jnp.where(done, pad_id, tok)
        lp = jnp.where(done, 0.0, lp)
        return tok, lp

    def record(state, step, tok, lp):
        out_tok, out_lp, done, lengths, stopped = state
        live = ~done
        out_tok = jax.lax.dynamic_update_slice(out_tok, tok[:, None], (0, step))
        out_lp = jax.lax.dynamic_update_slice(out_lp, lp[:, None], (0, step))
        hit_stop = live & jnp.any(tok[:, None] == stop_tokens, axis=-1)
        lengths = lengths + live.astype(jnp.int32)
        stopped = stopped | hit_stop
        done = done | hit_stop | (lengths >= budgets)
        return out_tok, out_lp, done, lengths, stopped

    done0 = budgets <= 0
    init = (
        jnp.full((B, max_new), pad_id, jnp.int32),
        jnp.zeros((B, max_new), jnp.float32),
        done0,
        jnp.zeros((B,), jnp.int32),
        jnp.zeros((B,), jnp.bool_),
    )
    tok0, lp0 = draw(jnp.int32(0), last, done0)
    rec = record(init, 0, tok0, lp0)

    def cond(carry):
        step, _, _, rec = carry
        return (step < max_new) & ~jnp.all(rec[2])

    def body(carry):
        step, prev_tok, cache, rec = carry
        slot = P + step - 1
        positions = (prompt_lengths + step - 1)[:, None]
        logits, cache = step_forward(prev_tok[:, None], positions, attention_mask=jnp.ones((B, 1), jnp.bool_),
                                     cache=cache, cache_index=slot)
        tok, lp = draw(step, logits[:, 0], rec[2])
        return step + 1, tok, cache, record(rec, step, tok, lp)

    carry = (jnp.int32(1), tok0, cache, rec)
    windows = decode_windows(P, n_slots, max_new, decode_phases)
    if len(windows) > 1:
        # Phase j runs on a cache of windows[j] slots (the slots its steps have filled by its end), so its
        # attention reads no empty slots; only the last phase runs on the whole (donated) cache.
        full = cache
        for w in windows:
            cache = write_slots(full, carry[2]) if w == n_slots else resize_slots(carry[2], w)

            last = min(max_new, w - P + 1)  # the phase's steps write slots P + step - 1 < w

            def cond_phase(carry, last=last):
                return cond(carry) & (carry[0] < last)

            carry = jax.lax.while_loop(cond_phase, body, carry[:2] + (cache,) + carry[3:])
    else:
        carry = jax.lax.while_loop(cond, body, carry)
    _, _, cache, rec = carry
    out_tok, out_lp, _, lengths, stopped = rec
    return SampleOutput(out_tok, out_lp, lengths, stopped), cache


def decode_windows(prompt_len: int, n_slots: int, max_new: int, phases: int) -> list[int]:
    """Cache sizes (slots) of the decode loop's phases: the decode steps write slots ``[P, P + max_new - 1)``;
    ``phases`` cuts them into that many near-equal runs, and phase ``j`` sees the first ``windows[j]`` slots.
    The last window is always the whole cache; ``[n_slots]`` means one loop over the whole cache."""
    steps = max_new - 1
    phases = max(1, min(int(phases), steps))
    ends = [prompt_len + -(-steps * (j + 1) // phases) for j in range(phases - 1)]
    return sorted(set(ends) - {n_slots}) + [n_slots]


@functools.partial(
    jax.jit, static_argnums=(0,),
    static_argnames=("max_new", "top_k", "top_p", "pad_id", "decode_phases", "out_major"),
    donate_argnames=("cache",),
)
def _generate_jit(graphdef, state, cache, prompts, prompt_lengths, keys, temperature, stop_tokens, budgets,
                  *, max_new, top_k, top_p, pad_id, decode_phases, out_major):
    model = nnx.merge(graphdef, state)
    return generate(model, cache, prompts, prompt_lengths, keys, temperature, stop_tokens, budgets,
                    max_new=max_new, top_k=top_k, top_p=top_p, pad_id=pad_id, decode_phases=decode_phases,
                    out_major=out_major)


def compiled_programs() -> int:
    """How many sampler programs (``generate`` shapes) this process has compiled (benchmarks' warm-up)."""
    return int(_generate_jit._cache_size())


# ---------------------------------------------------------------------------------------------------
# Stateful wrapper: weights, caches per bucket, host-side padding


def _row_keys(rng, batch: int) -> jax.Array:
    """[batch] typed keys from an int seed, one key (split per row) or already-per-row keys."""
    if isinstance(rng, int | np.integer):
        rng = jax.random.key(int(rng))
    rng = jnp.asarray(rng) if not isinstance(rng, jax.Array) else rng
    if not jnp.issubdtype(rng.dtype, jax.dtypes.prng_key):
        rng = jax.random.wrap_key_data(rng)
    if rng.ndim == 0:
        return jax.random.split(rng, batch)
    if rng.shape != (batch,):
        raise ValueError(f"per-row keys must have shape ({batch},), got {rng.shape}")
    return rng


def stop_table(stop_tokens, batch: int, width: int | None = None) -> np.ndarray:
    """[batch, width] int32 table of per-row stop ids from one set (shared) or one set per row."""
    sets = [tuple(stop_tokens)] * batch if _is_flat(stop_tokens) else [tuple(s) for s in stop_tokens]
    if len(sets) != batch:
        raise ValueError(f"{len(sets)} stop-token sets for {batch} rows")
    if width is None:  # a few widths only: the table's shape is part of the compiled shape
        width = bucket(max((len(s) for s in sets), default=1), STOP_WIDTH_BUCKETS)
    out = np.full((batch, width), NO_STOP, np.int32)
    for b, s in enumerate(sets):
        out[b, : len(s)] = s
    return out


def _is_flat(x) -> bool:
    return all(isinstance(v, int | np.integer) for v in x)


class Sampler:
    """Batched sampling for one model: holds its weights, one donated cache per shape, the executables.

    >>> sampler = Sampler(model, pad_id=tok.pad_id)
    >>> out = sampler.sample([ids_a, ids_b], max_new=64, rng=0, stop_tokens=tok.stop_ids)
    >>> sampler.update_weights(model)  # after a train step; no recompilation

    ``top_k`` / ``top_p`` are fixed per sampler (part of the compiled shape; 0 / 1.0 switch them off);
    temperature (per row, 0 = greedy), stop tokens, budgets and keys are per call. ``decode_phases``: see
    :func:`generate` (1, the default, decodes over the whole cache in one loop; more phases read less cache
    per token and compile longer). ``out_major``: see :func:`generate`; ``None`` (the default) turns it
    on when the weights live on CPU devices.

    ``caches``: the sampler's :class:`~mgrpo_jax.sampling.cache.CachePool`, one KV cache per shape, donated to each
    call and kept for the next one of that shape (the decode slots of :mod:`mgrpo_jax.sampling.slots` take theirs
    from it too). ``place(x, logical)`` puts a host array on the sampler's devices, laid out by logical axes;
    ``batch_multiple``: the rows a call's batch must be a multiple of (the mesh's data axes).

    Its compiled calls can be watched (benchmarks): :mod:`mgrpo_jax.sampling.observe`.
    """

    def __init__(self, model, *, pad_id: int = 0, top_k: int = 0, top_p: float = 1.0,
                 batch_buckets: Sequence[int] = DEFAULT_BATCH_BUCKETS,
                 length_buckets: Sequence[int] = DEFAULT_LENGTH_BUCKETS, cache_dtype=None,
                 decode_phases: int = 1, out_major: bool | None = None):
        self.graphdef, self.state = nnx.split(model)
        self.cfg = model.cfg
        self.mesh_rules = model.mesh_rules
        self.pad_id = int(pad_id)
        self.top_k = int(top_k)
        self.top_p = float(top_p)
        self.batch_buckets = tuple(batch_buckets)
        self.length_buckets = tuple(length_buckets)
        self.cache_dtype = cache_dtype
        if int(decode_phases) < 1:
            raise ValueError(f"decode_phases must be >= 1, got {decode_phases}")
        self.decode_phases = int(decode_phases)
        if out_major is None:  # a CPU layout preference (see generate); other backends pick their own
            platforms = {d.platform for leaf in jax.tree.leaves(self.state) for d in leaf.devices()}
            out_major = platforms == {"cpu"}
        self.out_major = bool(out_major)
        self.caches = CachePool(self._new_cache)
        # The policy version of the weights it holds: set by whoever pushes them (the asynchronous loop,
        # mgrpo_jax/rl/asynchronous.py) after `update_weights`; the rollout engine tags each turn with it.
        self.version = 0
        if self.mesh_rules is not None:
            data = self.mesh_rules.spec(("act_batch",))
            self.batch_multiple = int(np.prod([self.mesh_rules.mesh.shape[a] for a in _axes(data)]))
        else:
            self.batch_multiple = 1

    # -- weights ------------------------------------------------------------------------------------
    def update_weights(self, model_or_state) -> None:
        """Use new parameters (an ``nnx.Module`` of the same graph, or its ``nnx.State``).

        The sampler keeps a reference, not a copy: pass the post-step weights again after every train
        step (in particular when the train step donates its parameter buffers).
        """
        if isinstance(model_or_state, nnx.Module):
            graphdef, state = nnx.split(model_or_state)
            if graphdef != self.graphdef:
                raise ValueError("update_weights: model structure differs from the sampler's")
        else:
            state = model_or_state
        self.state = state

    # -- placement ----------------------------------------------------------------------------------
    def place(self, x, logical):
        """``x`` (a host array, or typed PRNG keys) on the sampler's devices, sharded by the logical axes
        ``logical`` (one per dimension); a plain device array without a mesh."""
        if self.mesh_rules is None:
            return jnp.asarray(x)
        sharding = self.mesh_rules.sharding(logical, np.shape(x))
        if jax.process_count() == 1:
            return jax.device_put(x, sharding)
        # Multi-process: `x` is the same on every process; each places the rows of its own devices.
        if isinstance(x, jax.Array) and jnp.issubdtype(x.dtype, jax.dtypes.prng_key):
            data = self.place(np.asarray(jax.random.key_data(x)), tuple(logical) + (None,))
            return jax.random.wrap_key_data(data, impl=jax.random.key_impl(x))
        host = np.asarray(x)
        return jax.make_array_from_callback(host.shape, sharding, lambda index: host[index])

    def _new_cache(self, batch: int, n_slots: int) -> dict:
        """An empty KV cache of ``batch`` rows and ``n_slots`` slots, laid out as the weights are (the pool's)."""
        return nnx.merge(self.graphdef, self.state).init_cache(batch, n_slots, dtype=self.cache_dtype)

    # -- sampling -----------------------------------------------------------------------------------
    def generate(self, prompts, prompt_lengths, *, max_new: int, rng=0, temperature=1.0, stop_tokens=(),
                 budgets=None) -> SampleOutput:
        """Sample from already padded prompts ``[B, P]`` (B divisible by the data axes); device arrays out.

        ``temperature``: scalar or [B]; ``stop_tokens``: ids shared by all rows, a list of per-row id sets,
        or a [B, S] table (``NO_STOP`` fills); ``budgets``: [B] max new tokens per row (default max_new).
        """
        return observed("generate", compiled_programs, lambda: self._generate(
            prompts, prompt_lengths, max_new=max_new, rng=rng, temperature=temperature, stop_tokens=stop_tokens,
            budgets=budgets), block=True)

    def _generate(self, prompts, prompt_lengths, *, max_new: int, rng, temperature, stop_tokens,
                  budgets) -> SampleOutput:
        prompts = np.asarray(prompts, np.int32)
        B, P = prompts.shape
        lengths = np.asarray(prompt_lengths, np.int32)
        if lengths.shape != (B,) or (lengths < 1).any() or (lengths > P).any():
            raise ValueError("prompt_lengths must be [B] with 1 <= length <= P")
        temp = np.broadcast_to(np.asarray(temperature, np.float32), (B,))
        if isinstance(stop_tokens, np.ndarray | jax.Array) and np.ndim(stop_tokens) == 2:
            stops = np.asarray(stop_tokens, np.int32)
        else:
            stops = stop_table(stop_tokens, B)
        bud = np.full((B,), max_new, np.int32) if budgets is None else np.asarray(budgets, np.int32)
        keys = _row_keys(rng, B)

        cache = self.caches.take(B, P + max_new)
        args = (
            self.place(prompts, ("act_batch", "act_seq")),
            self.place(lengths, ("act_batch",)),
            self.place(keys, ("act_batch",)),
            self.place(temp, ("act_batch",)),
            self.place(stops, ("act_batch", None)),
            self.place(bud, ("act_batch",)),
        )
        out, cache = _generate_jit(self.graphdef, self.state, cache, *args, max_new=int(max_new),
                                   top_k=self.top_k, top_p=self.top_p, pad_id=self.pad_id,
                                   decode_phases=self.decode_phases, out_major=self.out_major)
        self.caches.give_back(cache)
        return out

    def sample(self, prompts: Sequence[Sequence[int]], *, max_new: int, rng=0, temperature=1.0,
               stop_tokens=(), budgets=None) -> SampleOutput:
        """Sample continuations of variable-length prompts (lists of ids); numpy arrays out.

        The batch is padded to a batch bucket (extra rows get budget 0) and the prompts to a length
        bucket, so a handful of shapes cover every call. ``temperature`` / ``budgets`` may be per row;
        ``stop_tokens`` as in ``generate``. Per-row keys are drawn from ``rng`` for the padded batch, so
        results depend on the batch bucket, not on the other rows' contents.
        """
        n = len(prompts)
        tokens, lengths = pad_prompts(prompts, batch_buckets=self.batch_buckets,
                                      length_buckets=self.length_buckets, pad_id=self.pad_id,
                                      batch_multiple=self.batch_multiple)
        Bp = tokens.shape[0]
        temp = np.ones((Bp,), np.float32)
        temp[:n] = np.broadcast_to(np.asarray(temperature, np.float32), (n,))
        bud = np.zeros((Bp,), np.int32)
        bud[:n] = max_new if budgets is None else np.asarray(budgets, np.int32)
        if _is_flat(stop_tokens):
            stops = stop_table(stop_tokens, Bp)
        else:
            sets = [tuple(s) for s in stop_tokens]
            stops = stop_table(sets + [()] * (Bp - n), Bp)
        out = self.generate(tokens, lengths, max_new=max_new, rng=rng, temperature=temp, stop_tokens=stops,
                            budgets=bud)
        return SampleOutput(*(to_host(a)[:n] for a in out))


def to_host(x: jax.Array) -> np.ndarray:
    """A (possibly multi-process) global array as one numpy array on every process."""
    if x.is_fully_addressable or x.is_fully_replicated:
        return np.asarray(jax.device_get(x))
    from jax.experimental import multihost_utils

    return np.asarray(multihost_utils.process_allgather(x, tiled=True))


def _axes(spec_entry) -> tuple[str, ...]:
    if isinstance(spec_entry, PartitionSpec):
        spec_entry = spec_entry[0] if len(spec_entry) else None
    if spec_entry is None:
        return ()
    return (spec_entry,) if isinstance(spec_entry, str) else tuple(spec_entry)


__all__ = [
    "NO_STOP",
    "SampleOutput",
    "Sampler",
    "compiled_programs",
    "decode_windows",
    "filter_logits",
    "generate",
    "inverse_cdf",
    "sample_logits",
    "sampling_logits",
    "stop_table",
    "to_host",
]
