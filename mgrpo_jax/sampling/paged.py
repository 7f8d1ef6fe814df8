"""Paged KV for the decode slots: an episode's keys and values in fixed-size blocks, allocated as it grows and freed
when it ends, full blocks of a common prefix stored once.

:class:`PagedSlots` is a :class:`~mgrpo_jax.sampling.slots.DecodeSlots` pool (same interface, same turns, same random
numbers) whose KV lives in a store of ``blocks`` blocks of ``block_size`` tokens instead of one row of the whole
context budget per slot. A slot is a decode row and a **block table**: the list of blocks that hold its episode's
positions ``[0, block_size)``, ``[block_size, 2 block_size)``, ... A turn reserves the blocks of its context and of
its budget when it starts (:meth:`PagedSlots.fits` says whether the store has them) and gives back the ones it did
not fill when it ends, so an episode holds ``ceil(tokens / block_size)`` blocks between turns; a released or
evicted episode frees all of its own.

**Shared prefixes** (automatic, vLLM-style prefix caching). A full block is known by a hash chain: the hash of the
block before it and its own tokens (exact tokens, compared on a hit). When a turn starts, the full blocks of its
context that another episode already holds (or held: a freed block keeps its content until it is reallocated, least
recently freed first) join its table read-only with a reference count, and only the rest is prefilled: the K rollouts
of a query share their system prompt and question, every sub-agent call its system prompt, an evicted episode its own
earlier blocks, without the engine saying so. Only blocks that lie wholly before the turn's first decode position are
shared, so a block that is written is never shared: the last, partial block of a context is always the episode's
own (no copy on write is needed). Two episodes that start together share too: the first one's prefill writes the
blocks, the second's runs after it (prefills run in waves).

**Two attention paths** (``attention``):

- ``"gather"`` (the reference, any backend): a call gathers its rows' blocks into the contiguous ``[rows, window]``
  cache layout the model's forward reads (:func:`gather_window`; the window buckets of :mod:`~.slots`), runs the
  slot programs' own maths on it (:func:`~mgrpo_jax.sampling.slots.slot_prefill`,
  :func:`~mgrpo_jax.sampling.slots.slot_decode`) and scatters back only the positions it wrote
  (:func:`scatter_positions`). A chunk decodes only the slots in a turn. Same tokens and log-probs as the contiguous
  slots.
- ``"pallas"`` (TPU): each decode step writes its new keys and values into their blocks and attends over the block
  tables with JAX's Pallas paged-attention kernel (``jax.experimental.pallas.ops.tpu.paged_attention``), under
  ``shard_map`` where the model is sharded (each shard's rows use the blocks of its own shard: the store is split
  into ``shards`` parts); prefills take the gather path. Elsewhere the kernel runs in Pallas's TPU interpreter
  (tests), whose matmuls round like the TPU's default precision. ``mgrpo_jax.bench.plan`` compiles this program for
  the paper's pods.

Store layout: per layer, keys and values ``[kv_heads, blocks, block_size, head_dim]`` (the kernel's), blocks split
over the cache rows' mesh axes as the contiguous cache's rows are.
"""

from __future__ import annotations

import collections
import contextlib
import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from mgrpo_jax.model import CACHE_AXES, forward
from mgrpo_jax.sampling.buckets import DEFAULT_LENGTH_BUCKETS, bucket, pow2_buckets
from mgrpo_jax.sampling.layout import decode_layout
from mgrpo_jax.sampling.observe import observed
from mgrpo_jax.sampling.sampler import Sampler
from mgrpo_jax.sampling.slots import (
    DECODE_WINDOW_BUCKETS,
    SLOT_CHUNK,
    WINDOW_BUCKETS,
    DecodeSlots,
    decode_chunk,
    slot_decode,
    slot_prefill,
)

ATTENTIONS = ("gather", "pallas")
STORE_AXES = ("cache_kv_heads", "cache_batch", "cache_slots", "cache_head_dim")  # a layer's keys or values
ROOT = 0  # the chain hash before an episode's first block
PAGES_PER_COMPUTE_BLOCK = 8  # the Pallas kernel's blocks per flash-attention step (at most the table's width)


class BlockPool:
    """Host bookkeeping of ``n_blocks`` KV blocks in ``shards`` equal parts: reference counts, free blocks, and the
    index of full blocks by ``(parent chain hash, tokens)``. A block whose count falls to 0 keeps its content, and its
    place in the index, until it is reallocated (the least recently freed first)."""

    def __init__(self, n_blocks: int, block_size: int, shards: int = 1):
        if n_blocks % shards:
            raise ValueError(f"{n_blocks} KV blocks do not split into {shards} shards")
        self.n_blocks, self.block_size, self.shards = int(n_blocks), int(block_size), int(shards)
        self.per_shard = self.n_blocks // self.shards
        self.refs = np.zeros(self.n_blocks, np.int64)
        per = self.per_shard
        self._free = [collections.deque(range(s * per, (s + 1) * per)) for s in range(self.shards)]
        self._kept = [collections.OrderedDict() for _ in range(self.shards)]  # count 0, indexed: reusable content
        self._index: list[dict] = [{} for _ in range(self.shards)]
        self._key_of: dict[int, tuple] = {}
        self.peak = 0

    def shard_of(self, block: int) -> int:
        return block // self.per_shard

    def available(self, shard: int) -> int:
        """Blocks of ``shard`` that can be allocated (free, or kept for a hit that has not come)."""
        return len(self._free[shard]) + len(self._kept[shard])

    def find(self, shard: int, key: tuple) -> int | None:
        return self._index[shard].get(key)

    def kept(self, block: int) -> bool:
        """Whether ``block`` is held by no one (kept for its content): a hit on it uses an available block."""
        return self.refs[block] == 0

    def share(self, block: int) -> None:
        """One more holder of an indexed block (a hit of :meth:`find`)."""
        if self.refs[block] == 0:
            del self._kept[self.shard_of(block)][block]
        self.refs[block] += 1
        self.peak = max(self.peak, self.held())

    def allocate(self, shard: int) -> int:
        """A block of ``shard`` for one holder: a free one, else the least recently freed kept one (its content
        leaves the index). Raises where the shard has none (callers check :meth:`available`)."""
        if self._free[shard]:
            block = self._free[shard].popleft()
        elif self._kept[shard]:
            block, _ = self._kept[shard].popitem(last=False)
            del self._index[shard][self._key_of.pop(block)]
        else:
            raise RuntimeError(f"no KV block left in shard {shard} (check available() first)")
        self.refs[block] = 1
        self.peak = max(self.peak, self.held())
        return block

    def register(self, block: int, key: tuple) -> None:
        """Indexes a full block by its key, unless another block holds that content already."""
        index = self._index[self.shard_of(block)]
        if key not in index:
            index[key] = block
            self._key_of[block] = key

    def release(self, block: int) -> None:
        self.refs[block] -= 1
        if self.refs[block] == 0:
            shard = self.shard_of(block)
            if block in self._key_of:
                self._kept[shard][block] = None
            else:
                self._free[shard].append(block)

    def held(self) -> int:
        """Blocks with at least one holder."""
        return int(np.count_nonzero(self.refs))

    def forget(self) -> None:
        """Drops the content of the blocks no one holds (the next run's weights may differ): all free, none indexed."""
        for shard in range(self.shards):
            self._free[shard].extend(self._kept[shard])
            self._kept[shard].clear()
            for key, block in list(self._index[shard].items()):
                if self.refs[block] == 0:
                    del self._index[shard][key], self._key_of[block]


# ---------------------------------------------------------------------------------------------------
# Pure functions (under jit)


def new_store(cfg, n_blocks: int, block_size: int, dtype=None, mesh_rules=None) -> dict:
    """An empty block store: per layer, keys and values ``[kv_heads, n_blocks, block_size, head_dim]``."""
    dt = jnp.dtype(dtype) if dtype is not None else cfg.compute_dtype
    shape = (cfg.n_kv_heads, n_blocks, block_size, cfg.head_dim)

    def make():
        return {name: tuple(jnp.zeros(shape, dt) for _ in range(cfg.n_layers)) for name in ("k", "v")}

    if mesh_rules is None:
        return make()
    return jax.jit(make, out_shardings=mesh_rules.sharding(STORE_AXES, shape))()


def store_shape(cfg, n_blocks: int, block_size: int, dtype=None) -> dict:
    """``jax.ShapeDtypeStruct`` pytree of a block store (no allocation)."""
    dt = jnp.dtype(dtype) if dtype is not None else cfg.compute_dtype
    one = jax.ShapeDtypeStruct((cfg.n_kv_heads, n_blocks, block_size, cfg.head_dim), dt)
    return {name: (one,) * cfg.n_layers for name in ("k", "v")}


def gather_window(store: dict, table: jax.Array, lengths: jax.Array, mesh_rules=None) -> dict:
    """The contiguous cache (``init_cache`` layout, ``[rows, blocks x block_size]`` slots) of block tables
    ``table [rows, blocks]``; positions ``< lengths [rows]`` are valid. Table ids past the store read zeros."""
    rows, width = table.shape

    def keys(x):  # [K, N, bs, Dh] -> [rows, K, Dh, width * bs]
        g = jnp.take(x, table, axis=1, mode="fill", fill_value=0)
        return jnp.transpose(g, (1, 0, 4, 2, 3)).reshape(rows, x.shape[0], x.shape[3], width * x.shape[2])

    def values(x):  # [K, N, bs, Dh] -> [rows, K, width * bs, Dh]
        g = jnp.take(x, table, axis=1, mode="fill", fill_value=0)
        return jnp.transpose(g, (1, 0, 2, 3, 4)).reshape(rows, x.shape[0], width * x.shape[2], x.shape[3])

    block_size = store["k"][0].shape[2]
    mask = jnp.arange(width * block_size, dtype=jnp.int32)[None] < lengths[:, None]
    cache = {"k": tuple(map(keys, store["k"])), "v": tuple(map(values, store["v"])), "mask": mask}
    if mesh_rules is None:
        return cache
    return {name: jax.tree.map(lambda x, name=name: mesh_rules.constrain(x, CACHE_AXES[name]), part)
            for name, part in cache.items()}


def scatter_positions(store: dict, table: jax.Array, part: dict, starts: jax.Array, counts: jax.Array,
                      width: int) -> dict:
    """``store`` with positions ``starts[r] ... starts[r] + counts[r] - 1`` (``counts <= width``) of each row of the
    contiguous cache ``part`` (gathered by :func:`gather_window` with ``table``) written back to their blocks."""
    n_blocks, block_size = store["k"][0].shape[1:3]
    slots = part["mask"].shape[1]
    pos = jnp.minimum(starts[:, None] + jnp.arange(width, dtype=jnp.int32)[None], slots - 1)  # [rows, width]
    valid = jnp.arange(width, dtype=jnp.int32)[None] < counts[:, None]
    block = jnp.where(valid, jnp.take_along_axis(table, pos // block_size, axis=1), n_blocks)  # past: dropped
    offset = pos % block_size

    def put_keys(x, c):  # c [rows, K, Dh, slots]
        new = jnp.take_along_axis(c, pos[:, None, None, :], axis=3)
        return x.at[:, block, offset, :].set(jnp.transpose(new, (1, 0, 3, 2)).astype(x.dtype), mode="drop")

    def put_values(x, c):  # c [rows, K, slots, Dh]
        new = jnp.take_along_axis(c, pos[:, None, :, None], axis=2)
        return x.at[:, block, offset, :].set(jnp.swapaxes(new, 0, 1).astype(x.dtype), mode="drop")

    return {"k": tuple(map(put_keys, store["k"], part["k"])), "v": tuple(map(put_values, store["v"], part["v"]))}


def paged_prefill(model, store: dict, table: jax.Array, tokens: jax.Array, starts: jax.Array,
                  counts: jax.Array) -> dict:
    """:func:`~mgrpo_jax.sampling.slots.slot_prefill` of ``tokens [R, T]`` on the rows' gathered blocks
    (``table [R, blocks]``; each row's positions below ``starts`` are valid), its writes scattered back."""
    part = gather_window(store, table, starts, model.mesh_rules)
    rows = jnp.arange(table.shape[0], dtype=jnp.int32)
    part = slot_prefill(model, part, rows, tokens, starts, counts)
    return scatter_positions(store, table, part, starts, counts, tokens.shape[1])


def paged_decode(model, store: dict, table: jax.Array, lengths: jax.Array, prev, positions, live, budgets, seeds,
                 offsets, temperature, stop_tokens, *, steps: int, top_k: int = 0, top_p: float = 1.0,
                 pad_id: int = 0, out_major: bool = False):
    """The gather path's chunk: :func:`~mgrpo_jax.sampling.slots.slot_decode` on the rows' gathered blocks
    (``lengths``: the positions each row holds), the positions it wrote scattered back. Returns slot_decode's
    ``(tokens, logprobs, counts, stopped, steps_run)`` and the store."""
    part = gather_window(store, table, lengths, model.mesh_rules)
    *out, part = slot_decode(model, part, prev, positions, live, budgets, seeds, offsets, temperature, stop_tokens,
                             steps=steps, top_k=top_k, top_p=top_p, pad_id=pad_id, out_major=out_major)
    return (*out, scatter_positions(store, table, part, positions, out[2], steps))


def pallas_attend(cfg, mesh_rules=None, *, interpret: bool = False):
    """One layer's decode attention over the block tables with the Pallas paged-attention kernel:
    ``attend(q [B, 1, H, Dh], k, v [B, 1, K, Dh], keys, values [K, N, bs, Dh], table [B, blocks], pos [B], live [B])
    -> (o [B, 1, H, Dh], (keys, values))``: each live row's new key and value are written at ``pos`` in its block,
    then it attends to its positions ``[0, pos]``. With ``mesh_rules`` the kernel runs per shard (``shard_map``):
    the table holds each shard's own block ids."""
    from jax.experimental.pallas import tpu as pltpu
    from jax.experimental.pallas.ops.tpu.paged_attention import paged_attention

    def local(q, k, v, keys, values, table, pos, live):
        n_blocks, block_size = keys.shape[1:3]
        block = jnp.take_along_axis(table, (pos // block_size)[:, None], axis=1)[:, 0]
        block = jnp.where(live, block, n_blocks)  # rows not in a turn write nothing
        offset = pos % block_size
        keys = keys.at[:, block, offset, :].set(jnp.swapaxes(k, 0, 1).astype(keys.dtype), mode="drop")
        values = values.at[:, block, offset, :].set(jnp.swapaxes(v, 0, 1).astype(values.dtype), mode="drop")
        lengths = jnp.where(live, pos + 1, 1).astype(jnp.int32)  # a row not in a turn reads one (finite) position
        per_step = math.gcd(table.shape[1], PAGES_PER_COMPUTE_BLOCK)
        with pltpu.force_tpu_interpret_mode() if interpret else contextlib.nullcontext():
            o = paged_attention((q * cfg.attn_scale).astype(q.dtype), keys, values, lengths, table,
                                pages_per_compute_block=per_step, attn_logits_soft_cap=cfg.attn_logit_softcap)
        return o, keys, values

    def attend(q, k, v, keys, values, table, pos, live):
        args = (q[:, 0], k[:, 0], v[:, 0], keys, values, table, pos, live)
        if mesh_rules is None:
            o, keys, values = local(*args)
        else:
            o, keys, values = jax.shard_map(local, mesh=mesh_rules.mesh, in_specs=_pallas_specs(mesh_rules, args),
                                            out_specs=_pallas_specs(mesh_rules, args, out=True), check_vma=False)(*args)
        return o[:, None].astype(q.dtype), (keys, values)

    return attend


def _pallas_specs(mesh_rules, args, out: bool = False):
    """shard_map's specs of :func:`pallas_attend`'s arguments (or, ``out``, its results): rows and blocks over the
    cache rows' axes, heads over the KV heads' (query heads split only where the KV heads are, keeping groups)."""
    from jax.sharding import PartitionSpec as P

    q, _, _, keys, *_ = args
    rows = _entry(mesh_rules.spec(("cache_batch",), (q.shape[0],)))
    kv = _entry(mesh_rules.spec(("cache_kv_heads",), (keys.shape[0],)))
    if kv != _entry(mesh_rules.spec(("act_heads",), (q.shape[1],))):
        kv = None  # query heads split like the KV heads or not at all: each shard keeps whole groups
    store = P(kv, rows)
    if out:
        return P(rows, kv), store, store
    return P(rows, kv), P(rows, kv), P(rows, kv), store, store, P(rows), P(rows), P(rows)


def _entry(spec):
    return spec[0] if len(spec) else None


def pallas_decode(model, store: dict, table: jax.Array, prev, positions, live, budgets, seeds, offsets, temperature,
                  stop_tokens, *, steps: int, top_k: int = 0, top_p: float = 1.0, pad_id: int = 0,
                  out_major: bool = False, interpret: bool = False):
    """The Pallas path's chunk: :func:`~mgrpo_jax.sampling.slots.decode_chunk` whose steps attend over the block
    tables ``table [n, blocks]`` (every slot's, in its shard's ids) with :func:`pallas_attend`. Same arguments and
    results as :func:`paged_decode` but ``lengths`` (each step's position is the row's length)."""
    cfg = model.cfg
    layout = decode_layout(model.arrays(), out_major=out_major, moe_layers=cfg.moe_layers)
    attend_layer = pallas_attend(cfg, model.mesh_rules, interpret=interpret)

    def step(prev, pos, live, store):
        def attend(i, q, k, v):
            return attend_layer(q, k, v, store["k"][i], store["v"][i], table, pos, live)

        logits, layers = forward(cfg, model.mesh_rules, layout, prev[:, None], pos[:, None],
                                 attention_mask=live[:, None], attend=attend)
        return logits[:, 0], {"k": tuple(kv[0] for kv in layers), "v": tuple(kv[1] for kv in layers)}

    return decode_chunk(step, store, prev, positions, live, budgets, seeds, offsets, temperature, stop_tokens,
                        steps=steps, top_k=top_k, top_p=top_p, pad_id=pad_id)


@functools.partial(jax.jit, static_argnums=(0,), donate_argnames=("store",))
def _prefill_jit(graphdef, state, store, table, tokens, starts, counts):
    return paged_prefill(nnx.merge(graphdef, state), store, table, tokens, starts, counts)


@functools.partial(jax.jit, static_argnums=(0,), static_argnames=("steps", "top_k", "top_p", "pad_id", "out_major"),
                   donate_argnames=("store",))
def _decode_jit(graphdef, state, store, table, lengths, *args, steps, top_k, top_p, pad_id, out_major):
    return paged_decode(nnx.merge(graphdef, state), store, table, lengths, *args, steps=steps, top_k=top_k,
                        top_p=top_p, pad_id=pad_id, out_major=out_major)


@functools.partial(jax.jit, static_argnums=(0,),
                   static_argnames=("steps", "top_k", "top_p", "pad_id", "out_major", "interpret"),
                   donate_argnames=("store",))
def _pallas_jit(graphdef, state, store, table, *args, steps, top_k, top_p, pad_id, out_major, interpret):
    return pallas_decode(nnx.merge(graphdef, state), store, table, *args, steps=steps, top_k=top_k, top_p=top_p,
                         pad_id=pad_id, out_major=out_major, interpret=interpret)


def compiled_programs() -> int:
    """How many paged programs this process has compiled (benchmarks' warm-up)."""
    return sum(int(f._cache_size()) for f in (_prefill_jit, _decode_jit, _pallas_jit))


def blocks_for(tokens: int, block_size: int) -> int:
    return -(-int(tokens) // int(block_size))


class PagedSlots(DecodeSlots):
    """Decode slots whose KV lives in blocks (module docstring): :class:`DecodeSlots`' interface, plus
    :meth:`fits` (whether a turn's blocks are there; the engine evicts idle episodes until they are).

    >>> pool = PagedSlots(sampler, n_slots=64, max_len=agent.context_tokens, block_size=16, blocks=2048)

    ``n_slots``: decode rows (episodes that hold a table at once); ``blocks``: the store's blocks (0: as many as the
    contiguous slots would hold, ``n_slots x ceil(max_len / block_size)``); every shard must hold one whole context.
    Counters beside :class:`DecodeSlots`': ``shared_tokens`` (context tokens found in shared blocks, not prefilled),
    ``blocks_peak`` (most blocks held at once).
    """

    def __init__(self, sampler: Sampler, n_slots: int, max_len: int, *, block_size: int, blocks: int = 0,
                 attention: str = "gather", chunk: int = SLOT_CHUNK):
        super().__init__(sampler, n_slots, max_len, chunk=chunk)
        if int(block_size) < 1:
            raise ValueError(f"block_size must be >= 1, got {block_size}")
        if attention not in ATTENTIONS:
            raise ValueError(f"attention must be one of {ATTENTIONS}, got {attention!r}")
        self.block_size, self.attention = int(block_size), attention
        self.context_blocks = blocks_for(self.max_len, self.block_size)
        multiple = sampler.batch_multiple
        blocks = int(blocks) or self.n * self.context_blocks
        blocks = -(-blocks // multiple) * multiple  # the store's blocks split over the cache rows' devices
        # The Pallas kernel reads each shard's own blocks; the gather path reads any block from any row.
        self.pool = BlockPool(blocks, self.block_size, multiple if attention == "pallas" else 1)
        if self.pool.per_shard < self.context_blocks:
            raise ValueError(f"kv_blocks={blocks} ({self.pool.per_shard} per shard of {self.pool.shards}) cannot hold "
                             f"one context of {self.max_len} tokens ({self.context_blocks} blocks of {block_size})")
        self.interpret = attention == "pallas" and jax.default_backend() != "tpu"
        n = self.n
        self._blocks: list[list[int]] = [[] for _ in range(n)]  # each slot's block table
        self._hashes: list[list[int]] = [[] for _ in range(n)]  # the chain hash of each of its full blocks
        self._tokens: list[list[int]] = [[] for _ in range(n)]  # its episode's tokens (those of its cache and more)
        self._waves: dict[int, int] = {}  # slot -> prefill wave of this launch (after the waves it reads from)
        self._writing: dict[int, int] = {}  # block -> wave of the pending prefill that fills it
        self.store = None
        self.shared_tokens = 0

    # -- blocks ------------------------------------------------------------------------------------------------------
    def _shard(self, slot: int) -> int:
        return slot // (self.n // self.pool.shards)

    def blocks_of(self, owner) -> list[int]:
        """The owner's block table (a copy)."""
        return list(self._blocks[self._slot_of[id(owner)]])

    def _matches(self, slot: int, context) -> list[tuple[int, int]]:
        """``(block, chain hash)`` of the indexed blocks that continue the slot's cache with ``context``'s next full
        blocks, those that lie before its last token (the first position the turn decodes)."""
        size, cached = self.block_size, int(self.cached[slot])
        if cached % size:
            return []
        hashes = self._hashes[slot]
        assert len(hashes) == cached // size
        parent, out = hashes[-1] if hashes else ROOT, []
        for j in range(cached // size, (len(context) - 1) // size):
            key = (parent, tuple(context[j * size:(j + 1) * size]))
            block = self.pool.find(self._shard(slot), key)
            if block is None:
                break
            parent = hash(key)
            out.append((block, parent))
        return out

    def _index_full_blocks(self, slot: int, upto: int, tokens, wave: int | None = None) -> None:
        """Indexes the slot's blocks that ``upto`` written positions fill (``tokens``: the episode's), marking them
        as written by prefill ``wave`` of this launch where one fills them."""
        size, hashes, blocks = self.block_size, self._hashes[slot], self._blocks[slot]
        for j in range(len(hashes), upto // size):
            key = (hashes[-1] if hashes else ROOT, tuple(tokens[j * size:(j + 1) * size]))
            self.pool.register(blocks[j], key)
            if wave is not None:
                self._writing[blocks[j]] = wave
            hashes.append(hash(key))

    def _drop_blocks(self, slot: int, keep: int = 0) -> None:
        """Gives back the slot's blocks past its first ``keep``."""
        for block in self._blocks[slot][keep:]:
            self.pool.release(block)
        del self._blocks[slot][keep:]
        del self._hashes[slot][keep:]

    def fits(self, owner, context, budget: int) -> bool:
        """Whether the store has the blocks a turn of ``budget`` tokens after ``context`` needs (those the owner's
        slot does not hold or find shared)."""
        slot = self._slot_of[id(owner)]
        found = self._matches(slot, context)
        need = blocks_for(len(context) + budget - 1, self.block_size) - len(self._blocks[slot]) - len(found)
        # A hit on a block nobody holds takes it off the available ones.
        return need <= self.pool.available(self._shard(slot)) - sum(self.pool.kept(b) for b, _ in found)

    # -- slots and turns ---------------------------------------------------------------------------------------------
    def release(self, owner, evicted: bool = False) -> None:
        slot = self._slot_of[id(owner)]
        self._drop_blocks(slot)
        self._tokens[slot] = []
        super().release(owner, evicted)

    def start(self, owner, context: list[int], *, budget: int, seed: int, temperature: float,
              stop_tokens=()) -> None:
        """As :meth:`DecodeSlots.start`; the turn's context and budget get their blocks (shared ones where the
        store holds them: that much less is prefilled). Call :meth:`fits` first."""
        slot = self._slot_of[id(owner)]
        found = self._matches(slot, context)
        wave = 1 + max((self._writing.get(b, -1) for b, _ in found), default=-1)
        for block, chain in found:
            self.pool.share(block)
            self._blocks[slot].append(block)
            self._hashes[slot].append(chain)
        self.cached[slot] += len(found) * self.block_size
        self.shared_tokens += len(found) * self.block_size
        super().start(owner, context, budget=budget, seed=seed, temperature=temperature, stop_tokens=stop_tokens)
        need = blocks_for(len(context) + budget - 1, self.block_size) - len(self._blocks[slot])
        if need > self.pool.available(self._shard(slot)):
            raise RuntimeError(f"a turn needs {need} more KV blocks than the store has free: call fits() first")
        self._blocks[slot].extend(self.pool.allocate(self._shard(slot)) for _ in range(need))
        self._tokens[slot] = list(context)
        self._index_full_blocks(slot, len(context) - 1, context, wave)
        self._waves[slot] = wave

    # -- compiled calls ----------------------------------------------------------------------------------------------
    def _table(self, slots, width: int, pad: int) -> np.ndarray:
        """Block tables of ``slots`` (ids ``>= n``: padding rows), ``width`` blocks each, ``pad`` past their ends."""
        table = np.full((len(slots), width), pad, np.int32)
        for r, slot in enumerate(slots):
            if slot < self.n:
                blocks = self._blocks[slot][:width]
                table[r, :len(blocks)] = blocks
        return table

    def _window(self, reach: int, buckets=WINDOW_BUCKETS) -> int:
        """:meth:`DecodeSlots._window` in whole blocks."""
        return blocks_for(super()._window(reach, buckets), self.block_size) * self.block_size

    def _launch(self) -> None:
        if self._pending is not None or not self.live.any():
            return
        s, put = self.sampler, self.sampler.place
        if self.store is None:
            self.store = new_store(s.cfg, self.pool.n_blocks, self.block_size, s.cache_dtype, s.mesh_rules)
        for group in self._prefill_groups():
            R = len(group)
            Rb = bucket(R, pow2_buckets(1, self.n), s.batch_multiple)
            T = bucket(max(len(ids) for _, ids, _ in group), DEFAULT_LENGTH_BUCKETS)
            window = self._window(max(start + len(ids) for _, ids, start in group))
            table = self._table([slot for slot, _, _ in group] + [self.n] * (Rb - R), window // self.block_size,
                                self.pool.n_blocks)
            tokens = np.full((Rb, T), s.pad_id, np.int32)
            starts, counts = np.zeros((Rb,), np.int32), np.zeros((Rb,), np.int32)
            for r, (_, ids, start) in enumerate(group):
                starts[r], counts[r] = start, len(ids)
                tokens[r, :len(ids)] = ids
                self.prefill_tokens += len(ids)
            self.store = _prefill_jit(s.graphdef, s.state, self.store, put(table, ("act_batch", None)),
                                      put(tokens, ("act_batch", None)), put(starts, ("act_batch",)),
                                      put(counts, ("act_batch",)))
        self._prefills, self._waves, self._writing = [], {}, {}
        budgets = np.where(self.live, self.remaining, 0).astype(np.int32)
        static = dict(steps=self.chunk, top_k=s.top_k, top_p=s.top_p, pad_id=s.pad_id, out_major=s.out_major)
        if self.attention == "pallas":  # every slot, each in its shard, with its shard's block ids
            rows = None
            table = self._table(range(self.n), self.context_blocks, 0)
            table -= (np.arange(self.n) // (self.n // self.pool.shards))[:, None] * self.pool.per_shard
            table = np.maximum(table, 0)
            args = (self.prev, self.pos, self.live, budgets, self.seeds, self.offsets, self.temperature, self.stops)
            args = [put(x, ("act_batch",) + (None,) * (x.ndim - 1)) for x in (table, *args)]
            *out, self.store = _pallas_jit(s.graphdef, s.state, self.store, *args, interpret=self.interpret, **static)
        else:  # the slots in a turn, padded (id n, not live) to a power-of-two batch smaller than the pool
            live = np.flatnonzero(self.live)
            size = bucket(len(live), pow2_buckets(1, self.n), s.batch_multiple)
            if size < self.n:
                rows = np.full((size,), self.n, np.int32)
                rows[:len(live)] = live
            else:  # every slot, in order
                rows = np.arange(self.n, dtype=np.int32)
            window = self._window(int(np.max(self.pos[live] + np.minimum(budgets[live], self.chunk))),
                                  DECODE_WINDOW_BUCKETS)
            taken = np.minimum(rows, self.n - 1)
            # Rows not in a turn read nothing (their table is padding): they neither attend nor write.
            table = self._table(np.where(self.live[taken] & (rows < self.n), rows, self.n),
                                window // self.block_size, self.pool.n_blocks)
            per_row = [x[taken] for x in (self.cached, self.prev, self.pos, self.live, budgets, self.seeds,
                                           self.offsets, self.temperature, self.stops)]
            per_row[3] = per_row[3] & (rows < self.n)
            per_row[0] = per_row[0].astype(np.int32)
            args = [put(x, ("act_batch",) + (None,) * (x.ndim - 1)) for x in (table, *per_row)]
            *out, self.store = _decode_jit(s.graphdef, s.state, self.store, *args, **static)
        self._pending = (out, rows)

    def _prefill_groups(self):
        """The pending prefills by wave (a prefill that reads blocks another one writes runs after it), then by
        length bucket."""
        groups: dict[tuple[int, int], list] = {}
        for item in self._prefills:
            key = (self._waves.get(item[0], 0), bucket(len(item[1]), DEFAULT_LENGTH_BUCKETS))
            groups.setdefault(key, []).append(item)
        return [groups[k] for k in sorted(groups)]

    def launch(self) -> None:
        observed("slots_launch", compiled_programs, self._launch)

    def collect(self) -> list[tuple[object, np.ndarray, np.ndarray, bool]]:
        return observed("slots_collect", compiled_programs, self._collect)

    def _collect(self) -> list[tuple[object, np.ndarray, np.ndarray, bool]]:
        before, was_live = self.cached.copy(), self.live.copy()
        finished = super()._collect()
        for slot in np.flatnonzero(was_live):
            gained = int(self.cached[slot] - before[slot])
            if gained:
                self._tokens[slot].extend(self._turn_ids[slot][-gained:])
            self._index_full_blocks(slot, int(self.cached[slot]), self._tokens[slot])
            if not self.live[slot]:  # the turn ended: the blocks of its budget it did not fill go back
                self._drop_blocks(slot, blocks_for(int(self.cached[slot]), self.block_size))
        return finished

    def close(self) -> None:
        """Forgets every owner and block (the next run starts with an empty store: its weights may differ)."""
        if self._pending is not None:
            self.collect()
        for slot in range(self.n):
            self._drop_blocks(slot)
            self._tokens[slot] = []
        self.pool.forget()
        self.store = None
        super().close()

    def stats(self) -> dict[str, int]:
        return {**super().stats(), "block_size": self.block_size, "blocks": self.pool.n_blocks,
                "blocks_held": self.pool.held(), "blocks_peak": self.pool.peak, "shared_tokens": self.shared_tokens}


__all__ = ["ATTENTIONS", "BlockPool", "PagedSlots", "blocks_for", "compiled_programs", "gather_window", "new_store",
           "paged_decode", "paged_prefill", "pallas_attend", "pallas_decode", "scatter_positions", "store_shape"]
