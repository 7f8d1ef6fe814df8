"""KV caches of a sampler: the pool that keeps them between calls, and the pure functions that resize a cache and move
rows in and out of it (under ``jax.jit``).

A cache is the model's ``init_cache`` pytree, ``{"k": (per layer), "v": (per layer), "mask": [rows, slots]}``; where
the rows and the slots lie in each entry is :data:`mgrpo_jax.model.CACHE_AXES`'s business, and only this module
reads it.

:class:`CachePool` holds one cache per shape ``(rows, slots)``. A compiled call is donated a cache and returns it,
so a cache has one holder at a time: :meth:`CachePool.take` hands the pool's cache of a shape out (a new one when the
pool has none), and :meth:`CachePool.give_back` returns the one the call gave back, whose memory serves the next call
of that shape. :class:`~mgrpo_jax.sampling.Sampler` takes one per call; a
:class:`~mgrpo_jax.sampling.slots.DecodeSlots` pool holds one for its whole run.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import jax
import jax.numpy as jnp

from mgrpo_jax.model import CACHE_AXES


class CachePool:
    """One model's KV caches, at most one per shape ``(rows, slots)`` (module docstring).

    >>> pool = CachePool(lambda rows, slots: model.init_cache(rows, slots))
    >>> cache = pool.take(8, 256)          # the pool's [8, 256] cache, or a new one
    >>> out, cache = program(cache, ...)   # donated and returned
    >>> pool.give_back(cache)              # serves the next take(8, 256)
    """

    def __init__(self, init: Callable[[int, int], dict]):
        self._init = init  # a new, empty cache of (rows, slots)
        self._free: dict[tuple[int, int], dict] = {}

    def take(self, rows: int, slots: int) -> dict:
        """The pool's cache of ``rows x slots`` (no longer in the pool until given back), else a new empty one. Its
        slots hold what its last holder wrote: a call must write every slot it reads."""
        cache = self._free.pop((int(rows), int(slots)), None)
        return self._init(int(rows), int(slots)) if cache is None else cache

    def give_back(self, cache: dict) -> None:
        """Keeps ``cache`` for the next :meth:`take` of its shape (replacing one the pool may hold)."""
        self._free[shape(cache)] = cache

    def peek(self, rows: int, slots: int) -> dict | None:
        """The pool's cache of that shape, left in the pool (None if it holds none): what the last call wrote."""
        return self._free.get((int(rows), int(slots)))

    def shapes(self) -> list[tuple[int, int]]:
        """The shapes of the caches the pool holds."""
        return list(self._free)


def shape(cache: dict) -> tuple[int, int]:
    """``(rows, slots)`` of a cache."""
    rows, slots = cache["mask"].shape
    return int(rows), int(slots)


def resize_slots(cache: dict, w: int) -> dict:
    """A copy of the cache with ``w`` slots: its first ``w``, or all of them followed by empty ones (zeros,
    masked out)."""

    def resize(x, name):
        axis = CACHE_AXES[name].index("cache_slots")
        n = x.shape[axis]
        if w <= n:
            return jax.lax.slice_in_dim(x, 0, w, axis=axis)
        return jnp.pad(x, [(0, w - n) if a == axis else (0, 0) for a in range(x.ndim)])

    return {name: jax.tree.map(lambda x, name=name: resize(x, name), part) for name, part in cache.items()}


def write_slots(full: dict, part: dict) -> dict:
    """``full`` with its first slots replaced by the smaller cache ``part`` (in place when donated)."""
    put = lambda f, x: jax.lax.dynamic_update_slice(f, x.astype(f.dtype), (0,) * f.ndim)
    return jax.tree.map(put, full, part)


def take_rows(cache: dict, rows: jax.Array) -> dict:
    """A copy of the cache's rows ``rows [R]`` (ids past the last row read the last one: padding)."""
    return jax.tree.map(lambda x: jnp.take(x, rows, axis=0, mode="clip"), cache)


def put_rows(cache: dict, rows: jax.Array, part: dict, window: int) -> dict:
    """``cache`` with the first ``window`` slots of rows ``rows [R]`` replaced by ``part`` (``R`` rows of ``window``
    slots); row ids past the last row are dropped (padding)."""

    def put_back(name, full, new):
        axis = CACHE_AXES[name].index("cache_slots")
        index = tuple(rows if a == 0 else slice(0, window) if a == axis else slice(None) for a in range(full.ndim))
        return full.at[index].set(new, mode="drop")

    return {name: jax.tree.map(functools.partial(put_back, name), cache[name], part[name]) for name in cache}


__all__ = ["CachePool", "put_rows", "resize_slots", "shape", "take_rows", "write_slots"]
