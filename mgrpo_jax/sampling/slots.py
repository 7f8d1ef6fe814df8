"""Decode slots: a fixed set of KV-cache rows, each holding one episode across its turns, decoded in chunks.

A :class:`DecodeSlots` pool belongs to one agent's :class:`~mgrpo_jax.sampling.Sampler` (same weights, same
mesh, same log-prob convention). It holds one cache of ``[n_slots, max_len]`` (``max_len``: the agent's context
budget), taken from the sampler's cache pool (:class:`~mgrpo_jax.sampling.cache.CachePool`) for the whole run,
donated to every call and given back at :meth:`DecodeSlots.close`, and runs two jitted programs over it:

- :func:`slot_prefill` writes the tokens an episode gained since its last turn (a tool response, a sub-agent's
  answer, the assistant header) into its slot at the slot's own offset. Only the slots that have something to
  add take part (their cache rows are gathered, extended and scattered back), so a turn never re-prefills the
  context the slot already holds.
- :func:`slot_decode` runs up to ``chunk`` decode steps over every slot at once, each slot at its own position,
  and stops early once no slot is live (when at most half the pool is in a turn, :func:`slot_decode_rows` runs
  it over half the pool, those slots' cache rows gathered and scattered back, so idle slots cost fewer decode
  steps; a call reads the cache positions its slots have reached, ``WINDOW_BUCKETS``). A slot's row ends at
  its stop token or its budget; between chunks the host (:mod:`mgrpo_jax.rollout.engine`) takes the finished
  rows, runs their tools and starts the next turn of any episode in any free slot. Rows never share keys: a query
  attends to its own slot only, to the positions its own episode wrote.

Where a slot's cache stands: after a turn of ``n`` sampled ids, the slot holds every token of its episode but the
last sampled one (a stop token is not fed back until the next turn needs it). The next turn's first decode step
feeds the last token of its prompt (the assistant header's), so the prefill covers the rest of what was appended.

**Random numbers.** Each turn has its own key, from an integer the caller derives from the episode and the turn
(not from the slot or the batch), and token ``i`` of the turn is drawn with ``fold_in(key, i)``: an episode samples
the same tokens whichever slot it holds, whatever else runs beside it, and however many slots there are.

The recorded log-probs are those of :func:`~mgrpo_jax.sampling.sampler.sample_logits`: the distribution each
token was drawn from, per-row temperature, the sampler's top-k / top-p.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from mgrpo_jax.model import forward
from mgrpo_jax.sampling.buckets import DEFAULT_LENGTH_BUCKETS, bucket, pow2_buckets
from mgrpo_jax.sampling.cache import put_rows, resize_slots, take_rows, write_slots
from mgrpo_jax.sampling.layout import decode_layout
from mgrpo_jax.sampling.observe import observed
from mgrpo_jax.sampling.sampler import NO_STOP, Sampler, sample_logits, to_host

SLOT_CHUNK = 16  # decode steps per host round-trip (a stopped row idles at most this many steps)
STOP_WIDTH = 4  # per-slot stop-token table width
WINDOW_BUCKETS = (128, 256, 512, 1024, 2048, 4096, 8192, 16384, 32768)  # cache positions a call reads
DECODE_WINDOW_BUCKETS = WINDOW_BUCKETS  # a decode chunk's (the same; a name of its own for pools that differ)
# A chunk with at most half the pool's slots in a turn decodes half the pool: those slots' cache rows gathered,
# decoded and scattered back (two passes over them, less than a chunk's steps over the idle half). One gathered
# size, so one more compiled program per window. On the `local` preset's rollouts (128 slots per agent, agents
# warm-started 500 steps; docs/benchmarks.md) the slot engine went from 1.22x to 1.40x the lock-step engine's speed;
# a quarter-pool size as well gave 1.47x, and windows from 32 positions 1.51x, at 2 and 11 more compiled programs
# (about 1.4 s of CPU each, in every run's first steps).
GATHER_FRACTION = 2


def slot_prefill(model, cache: dict, rows: jax.Array, tokens: jax.Array, starts: jax.Array, counts: jax.Array, *,
                 window: int | None = None) -> dict:
    """Writes ``tokens [R, T]`` (the first ``counts[r]`` of each row) into slots ``rows [R]`` at positions
    ``starts[r] ...`` (pure; call under jit). Row ids ``>= n_slots`` are padding: read clipped, never written back.

    ``window``: the rows' first ``window`` cache positions hold all they have and all they add (the caller's
    bound), so only those are gathered and attended to: a turn early in an episode does not pay for the whole
    context budget."""
    R, T = tokens.shape
    window = window or cache["mask"].shape[1]
    part = resize_slots(take_rows(cache, rows), window)
    positions = starts[:, None] + jnp.arange(T, dtype=jnp.int32)[None]
    mask = jnp.arange(T, dtype=jnp.int32)[None] < counts[:, None]
    _, part = forward(model.cfg, model.mesh_rules, model.arrays(), tokens, positions, attention_mask=mask, cache=part,
                      cache_index=starts, logits_at=jnp.zeros((R,), jnp.int32))
    return put_rows(cache, rows, part, window)


def slot_decode(model, cache: dict, prev: jax.Array, positions: jax.Array, live: jax.Array, budgets: jax.Array,
                seeds: jax.Array, offsets: jax.Array, temperature: jax.Array, stop_tokens: jax.Array, *, steps: int,
                top_k: int = 0, top_p: float = 1.0, pad_id: int = 0, out_major: bool = False,
                window: int | None = None):
    """Up to ``steps`` decode steps over all slots (pure; call under jit).

    Per slot ``[n]``: ``prev`` the token to feed at ``positions``; ``live`` whether the slot samples; ``budgets``
    tokens it may still sample this turn; ``seeds`` its turn's key seed and ``offsets`` the turn's tokens sampled
    before this chunk (token ``i`` of a turn is drawn with ``fold_in(key(seed), i)``); ``temperature``;
    ``stop_tokens [n, W]``. Returns ``(tokens [n, steps], logprobs [n, steps], counts [n], stopped [n],
    steps_run, cache)``; a slot that is not live feeds and writes nothing.

    ``window``: every live slot's positions, this chunk's writes included, lie below it (the caller's bound); the
    chunk runs on a copy of the cache's first ``window`` positions, written back at its end, so a step reads
    the part of the cache the episodes have reached instead of the whole context budget."""
    full = cache
    window = window or full["mask"].shape[1]
    if window < full["mask"].shape[1]:
        cache = resize_slots(full, window)
    step_forward = functools.partial(forward, model.cfg, model.mesh_rules,
                                     decode_layout(model.arrays(), out_major=out_major,
                                                   moe_layers=model.cfg.moe_layers))

    def step(prev, pos, live, cache):
        logits, cache = step_forward(prev[:, None], pos[:, None], attention_mask=live[:, None], cache=cache,
                                     cache_index=pos)
        return logits[:, 0], cache

    *out, cache = decode_chunk(step, cache, prev, positions, live, budgets, seeds, offsets, temperature, stop_tokens,
                               steps=steps, top_k=top_k, top_p=top_p, pad_id=pad_id)
    if cache is not full and window < full["mask"].shape[1]:
        cache = write_slots(full, cache)
    return (*out, cache)


def decode_chunk(step, cache, prev: jax.Array, positions: jax.Array, live: jax.Array, budgets: jax.Array,
                 seeds: jax.Array, offsets: jax.Array, temperature: jax.Array, stop_tokens: jax.Array, *, steps: int,
                 top_k: int = 0, top_p: float = 1.0, pad_id: int = 0):
    """:func:`slot_decode`'s loop over any KV store ``cache``: ``step(prev [n], positions [n], live [n], cache) ->
    (logits [n, V], cache)`` feeds one token per slot (the contiguous cache here; the paged blocks of
    :mod:`mgrpo_jax.sampling.paged`). Same arguments and results as :func:`slot_decode`."""
    n = prev.shape[0]
    keys = jax.vmap(jax.random.key)(seeds)
    temperature = temperature.astype(jnp.float32)

    def cond(carry):
        return (carry[0] < steps) & jnp.any(carry[3])

    def body(carry):
        i, prev, pos, live, count, stopped, out_tok, out_lp, cache = carry
        logits, cache = step(prev, pos, live, cache)
        step_keys = jax.vmap(jax.random.fold_in)(keys, offsets + count)
        tok, lp = sample_logits(logits, step_keys, temperature, top_k, top_p)
        tok = jnp.where(live, tok, pad_id)
        lp = jnp.where(live, lp, 0.0)
        out_tok = jax.lax.dynamic_update_slice(out_tok, tok[:, None], (0, i))
        out_lp = jax.lax.dynamic_update_slice(out_lp, lp[:, None], (0, i))
        hit = live & jnp.any(tok[:, None] == stop_tokens, axis=-1)
        count = count + live.astype(jnp.int32)
        prev = jnp.where(live, tok, prev)
        pos = pos + live.astype(jnp.int32)
        return (i + 1, prev, pos, live & ~hit & (count < budgets), count, stopped | hit, out_tok, out_lp, cache)

    init = (jnp.int32(0), prev, positions, live & (budgets > 0), jnp.zeros((n,), jnp.int32), jnp.zeros((n,), jnp.bool_),
            jnp.full((n, steps), pad_id, jnp.int32), jnp.zeros((n, steps), jnp.float32), cache)
    i, _, _, _, count, stopped, out_tok, out_lp, cache = jax.lax.while_loop(cond, body, init)
    return out_tok, out_lp, count, stopped, i, cache


def slot_decode_rows(model, cache: dict, rows: jax.Array, *args, window: int, **kwargs):
    """:func:`slot_decode` over the slots ``rows [R]`` only (pure; call under jit): their first ``window`` cache
    positions are gathered, decoded and scattered back; the other slots are neither read nor written. ``args`` are
    :func:`slot_decode`'s per-slot arrays for those rows; row ids ``>= n_slots`` are padding (not live)."""
    part = resize_slots(take_rows(cache, rows), window)
    *out, part = slot_decode(model, part, *args, window=window, **kwargs)
    return (*out, put_rows(cache, rows, part, window))


@functools.partial(jax.jit, static_argnums=(0,), static_argnames=("window",), donate_argnames=("cache",))
def _prefill_jit(graphdef, state, cache, rows, tokens, starts, counts, *, window):
    return slot_prefill(nnx.merge(graphdef, state), cache, rows, tokens, starts, counts, window=window)


@functools.partial(jax.jit, static_argnums=(0,),
                   static_argnames=("steps", "top_k", "top_p", "pad_id", "out_major", "window"),
                   donate_argnames=("cache",))
def _decode_jit(graphdef, state, cache, prev, positions, live, budgets, seeds, offsets, temperature, stop_tokens, *,
                steps, top_k, top_p, pad_id, out_major, window):
    return slot_decode(nnx.merge(graphdef, state), cache, prev, positions, live, budgets, seeds, offsets, temperature,
                       stop_tokens, steps=steps, top_k=top_k, top_p=top_p, pad_id=pad_id, out_major=out_major,
                       window=window)


@functools.partial(jax.jit, static_argnums=(0,),
                   static_argnames=("steps", "top_k", "top_p", "pad_id", "out_major", "window"),
                   donate_argnames=("cache",))
def _decode_rows_jit(graphdef, state, cache, rows, prev, positions, live, budgets, seeds, offsets, temperature,
                     stop_tokens, *, steps, top_k, top_p, pad_id, out_major, window):
    return slot_decode_rows(nnx.merge(graphdef, state), cache, rows, prev, positions, live, budgets, seeds, offsets,
                            temperature, stop_tokens, steps=steps, top_k=top_k, top_p=top_p, pad_id=pad_id,
                            out_major=out_major, window=window)


def compiled_programs() -> int:
    """How many slot programs (prefill and decode shapes) this process has compiled (benchmarks' warm-up)."""
    return sum(int(f._cache_size()) for f in (_prefill_jit, _decode_jit, _decode_rows_jit))


class DecodeSlots:
    """One agent's decode slots (module docstring). The caller assigns owners (episodes) to slots, starts turns,
    and calls :meth:`launch` then :meth:`collect` until no slot is live.

    >>> pool = DecodeSlots(sampler, n_slots=8, max_len=agent.context_tokens)
    >>> pool.assign(episode, pool.free_slot()); pool.start(episode, ids, budget=64, seed=s, temperature=1.0,
    ...                                                    stop_tokens=(eot,))
    >>> while pool.busy: pool.launch(); finished = pool.collect()   # [(episode, ids, logprobs, stopped)]

    Counters for benchmarks: ``prefill_tokens`` (tokens written by prefills), ``fed_tokens`` (tokens fed by decode
    steps), ``sampled_tokens``, ``slot_steps`` (rows decoded x decode steps run), ``chunks``, ``evictions``.
    :meth:`launch` and :meth:`collect` report to the observers of :mod:`mgrpo_jax.sampling.observe`.
    """

    def __init__(self, sampler: Sampler, n_slots: int, max_len: int, *, chunk: int = SLOT_CHUNK):
        multiple = sampler.batch_multiple
        self.sampler = sampler
        self.n = -(-max(int(n_slots), 1) // multiple) * multiple  # the cache's rows split over the data axes
        self.max_len = int(max_len)
        self.chunk = int(chunk)
        n = self.n
        self.owners: list = [None] * n
        self._held = np.zeros(n, bool)  # slots with an owner (free_slot's search; `owners` compares episodes by value)
        self._slot_of: dict[int, int] = {}
        self.cached = np.zeros(n, np.int64)  # tokens of the owner's episode held in the slot's cache
        self.live = np.zeros(n, bool)
        self.prev = np.zeros(n, np.int32)
        self.pos = np.zeros(n, np.int32)
        self.remaining = np.zeros(n, np.int32)
        self.seeds = np.zeros(n, np.int32)
        self.offsets = np.zeros(n, np.int32)
        self.temperature = np.ones(n, np.float32)
        self.stops = np.full((n, STOP_WIDTH), NO_STOP, np.int32)
        self._turn_ids: list[list[int]] = [[] for _ in range(n)]
        self._turn_lps: list[list[float]] = [[] for _ in range(n)]
        self._prefills: list[tuple[int, list[int], int]] = []
        self._empty: list[int] = []  # turns started with a zero budget: finished at the next collect
        self._pending = None
        self.cache = None
        self.prefill_tokens = self.fed_tokens = self.sampled_tokens = self.slot_steps = 0
        self.chunks = self.evictions = 0

    # -- slots and owners -----------------------------------------------------------------------------------------
    def slot_of(self, owner) -> int | None:
        return self._slot_of.get(id(owner))

    def free_slot(self) -> int | None:
        free = np.flatnonzero(~self._held)
        return int(free[0]) if free.size else None

    def assign(self, owner, slot: int) -> None:
        """Gives ``slot`` (free) to ``owner``; its cache starts empty (the first turn prefills the whole context)."""
        assert self.owners[slot] is None
        self.owners[slot], self._slot_of[id(owner)] = owner, slot
        self._held[slot] = True
        self.cached[slot] = 0

    def release(self, owner, evicted: bool = False) -> None:
        """Frees the owner's slot (its episode ended, or ``evicted``: it will get a slot and re-prefill later)."""
        slot = self._slot_of.pop(id(owner))
        assert not self.live[slot]
        self.owners[slot] = None
        self._held[slot] = False
        self.cached[slot] = 0
        self.evictions += int(evicted)

    def in_turn(self, slot: int) -> bool:
        return bool(self.live[slot]) or slot in self._empty

    def fits(self, owner, context: list[int], budget: int) -> bool:
        """Whether the pool has room for a turn of ``owner`` (in its slot): always, a slot holds a whole context (a
        paged pool, :class:`~mgrpo_jax.sampling.paged.PagedSlots`, may have to free blocks first)."""
        return True

    # -- turns ------------------------------------------------------------------------------------------------------
    def start(self, owner, context: list[int], *, budget: int, seed: int, temperature: float,
              stop_tokens=()) -> None:
        """Starts a turn of ``owner`` (which holds a slot) continuing ``context`` (its whole token list, assistant
        header included) for at most ``budget`` tokens. Only ``context[cached:]`` is new to the slot."""
        slot = self._slot_of[id(owner)]
        start = int(self.cached[slot])
        pending = context[start:]
        if not pending:
            raise ValueError("a turn needs at least one new token (the assistant header)")
        if len(context) + budget - 1 > self.max_len:
            raise ValueError(f"a turn of {budget} tokens after {len(context)} does not fit {self.max_len} slots")
        if len(pending) > 1:
            self._prefills.append((slot, list(pending[:-1]), start))
        self.prev[slot], self.pos[slot] = pending[-1], len(context) - 1
        self.cached[slot] = len(context) - 1
        self.remaining[slot], self.offsets[slot] = budget, 0
        self.seeds[slot] = seed & 0x7FFFFFFF
        self.temperature[slot] = temperature
        self.stops[slot] = NO_STOP
        self.stops[slot, :len(stop_tokens)] = stop_tokens
        self._turn_ids[slot], self._turn_lps[slot] = [], []
        if budget > 0:
            self.live[slot] = True
        else:
            self._empty.append(slot)

    @property
    def busy(self) -> bool:
        return bool(self.live.any()) or bool(self._empty)

    def launch(self) -> None:
        """Dispatches the pending prefills and one decode chunk (asynchronously: :meth:`collect` waits)."""
        observed("slots_launch", compiled_programs, self._launch)

    def _launch(self) -> None:
        if self._pending is not None or not self.live.any():
            return
        s = self.sampler
        if self.cache is None:
            self.cache = s.caches.take(self.n, self.max_len)
        put = s.place
        for group in self._prefill_groups():
            R = len(group)
            Rb = bucket(R, pow2_buckets(1, self.n))
            T = bucket(max(len(ids) for _, ids, _ in group), DEFAULT_LENGTH_BUCKETS)
            rows = np.full((Rb,), self.n, np.int32)
            tokens = np.full((Rb, T), s.pad_id, np.int32)
            starts = np.zeros((Rb,), np.int32)
            counts = np.zeros((Rb,), np.int32)
            for r, (slot, ids, start) in enumerate(group):
                rows[r], starts[r], counts[r] = slot, start, len(ids)
                tokens[r, :len(ids)] = ids
                self.prefill_tokens += len(ids)
            window = self._window(max(start + len(ids) for _, ids, start in group))
            self.cache = _prefill_jit(s.graphdef, s.state, self.cache, put(rows, (None,)), put(tokens, (None, None)),
                                      put(starts, (None,)), put(counts, (None,)), window=window)
        self._prefills = []
        budgets = np.where(self.live, self.remaining, 0).astype(np.int32)
        window = self._window(int(np.max(np.where(self.live, self.pos + np.minimum(budgets, self.chunk), 0))),
                              DECODE_WINDOW_BUCKETS)
        per_slot = (self.prev, self.pos, self.live, budgets, self.seeds, self.offsets, self.temperature, self.stops)
        static = dict(steps=self.chunk, top_k=s.top_k, top_p=s.top_p, pad_id=s.pad_id, out_major=s.out_major,
                      window=window)
        rows = self._decode_rows()
        if rows is None:
            args = [put(x, ("act_batch",) + (None,) * (x.ndim - 1)) for x in per_slot]
            *out, self.cache = _decode_jit(s.graphdef, s.state, self.cache, *args, **static)
        else:
            # Padding rows (id n) take the last slot's values, not live: read clipped, never written back.
            taken = np.minimum(rows, self.n - 1)
            gathered = [x[taken] for x in per_slot]
            gathered[2] = gathered[2] & (rows < self.n)
            args = [put(x, ("act_batch",) + (None,) * (x.ndim - 1)) for x in (rows, *gathered)]
            *out, self.cache = _decode_rows_jit(s.graphdef, s.state, self.cache, *args, **static)
        self._pending = (out, rows)

    def _decode_rows(self) -> np.ndarray | None:
        """The slots the next chunk decodes (``GATHER_FRACTION``): where the slots in a turn fit in half the pool
        (a batch the data axes divide), those, padded with ``n``; None: every slot."""
        live = np.flatnonzero(self.live)
        size = self.n // GATHER_FRACTION
        if len(live) > size or size % self.sampler.batch_multiple:
            return None
        rows = np.full((size,), self.n, np.int32)
        rows[:len(live)] = live
        return rows

    def _window(self, reach: int, buckets=WINDOW_BUCKETS) -> int:
        """The cache positions a call must see for writes and reads below ``reach``: a length bucket (few
        compiled shapes), at most the whole cache."""
        return min(self.max_len, bucket(reach, buckets))

    def _prefill_groups(self):
        """The pending prefills, grouped by length bucket: one long tool response does not pad the short ones."""
        groups: dict[int, list] = {}
        for item in self._prefills:
            groups.setdefault(bucket(len(item[1]), DEFAULT_LENGTH_BUCKETS), []).append(item)
        return [groups[k] for k in sorted(groups)]

    def collect(self) -> list[tuple[object, np.ndarray, np.ndarray, bool]]:
        """Waits for the launched chunk; returns the turns that ended in it as ``(owner, ids, logprobs, stopped)``
        (``stopped``: ended on a stop token, else on its budget). Their slots stay with their owners."""
        return observed("slots_collect", compiled_programs, self._collect)

    def _collect(self) -> list[tuple[object, np.ndarray, np.ndarray, bool]]:
        finished = []
        for slot in self._empty:
            finished.append((self.owners[slot], np.zeros((0,), np.int32), np.zeros((0,), np.float32), False))
        self._empty = []
        if self._pending is None:
            return finished
        (pending, rows), self._pending = self._pending, None
        tokens, logprobs, counts, stopped, steps = (to_host(x) for x in pending)
        if rows is not None:  # a gathered chunk: its rows back in slot order
            tokens, logprobs, counts, stopped = (self._spread(x, rows) for x in (tokens, logprobs, counts, stopped))
        self.chunks += 1
        self.slot_steps += int(steps) * (self.n if rows is None else len(rows))
        for slot in np.flatnonzero(self.live):
            c = int(counts[slot])
            self._turn_ids[slot].extend(tokens[slot, :c].tolist())
            self._turn_lps[slot].extend(logprobs[slot, :c].tolist())
            self.fed_tokens += c
            self.sampled_tokens += c
            self.cached[slot] += c
            self.pos[slot] += c
            self.offsets[slot] += c
            self.remaining[slot] -= c
            if c:
                self.prev[slot] = tokens[slot, c - 1]
            if bool(stopped[slot]) or self.remaining[slot] <= 0:
                self.live[slot] = False
                finished.append((self.owners[slot], np.asarray(self._turn_ids[slot], np.int32),
                                 np.asarray(self._turn_lps[slot], np.float32), bool(stopped[slot])))
        return finished

    def _spread(self, x: np.ndarray, rows: np.ndarray) -> np.ndarray:
        """A gathered chunk's output ``x [R, ...]`` (rows ``rows``, padding ``n``) as the pool's ``[n, ...]``."""
        out = np.zeros((self.n, *x.shape[1:]), x.dtype)
        valid = rows < self.n
        out[rows[valid]] = x[valid]
        return out

    def close(self) -> None:
        """Hands the cache back to the sampler (its memory serves the next run) and forgets every owner."""
        if self._pending is not None:
            self.collect()
        if self.cache is not None:
            self.sampler.caches.give_back(self.cache)
            self.cache = None
        self.owners = [None] * self.n
        self._held[:] = False
        self._slot_of.clear()
        self.live[:] = False

    def stats(self) -> dict[str, int]:
        return {"slots": self.n, "prefill_tokens": self.prefill_tokens, "fed_tokens": self.fed_tokens,
                "sampled_tokens": self.sampled_tokens, "slot_steps": self.slot_steps, "chunks": self.chunks,
                "evictions": self.evictions}


__all__ = ["SLOT_CHUNK", "DecodeSlots", "compiled_programs", "decode_chunk", "slot_decode", "slot_decode_rows",
           "slot_prefill"]
