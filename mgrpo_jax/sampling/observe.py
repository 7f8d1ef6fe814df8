"""Watching the compiled calls of this process (benchmarks): how long each took and whether it compiled.

An observer registered with :func:`observe` is told of every call made through :func:`observed` while its block
runs: ``observer.on_call(kind, seconds, compiled)``. The samplers report theirs so: ``"generate"``
(:meth:`mgrpo_jax.sampling.Sampler.generate`, which then waits for its outputs), ``"slots_launch"`` and
``"slots_collect"`` (:class:`mgrpo_jax.sampling.slots.DecodeSlots`: ``launch`` dispatches a round's prefills and
decode chunk, ``collect`` waits for it; host calls one after the other, so their times add up without overlap).
Any other layer's compiled calls can report through :func:`observed` the same way, under their own kind.

``compiled``: the call grew the count of compiled programs it may add to (the ``programs`` it was given), i.e. its
time was mostly compiling. With no observer registered, :func:`observed` only calls (and nothing waits).

    class Timer(CallObserver):
        def on_call(self, kind, seconds, compiled): ...

    with observe(Timer()):
        trainer.rl_step()
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterator
from typing import TypeVar

import jax

T = TypeVar("T")


class CallObserver:
    """Told of the compiled calls made while registered through :func:`observe`; override :meth:`on_call`."""

    def on_call(self, kind: str, seconds: float, compiled: bool) -> None:
        """A call of ``kind`` took ``seconds`` (wall time, its outputs waited for where the caller blocks) and
        compiled a program (``compiled``) or not."""


# The registered observers; `observed` tests this list's truthiness only, so without observers it adds nothing.
_OBSERVERS: list[CallObserver] = []


@contextlib.contextmanager
def observe(observer: CallObserver) -> Iterator[CallObserver]:
    """Registers ``observer`` for the compiled calls of this process while the block runs; yields it."""
    _OBSERVERS.append(observer)
    try:
        yield observer
    finally:
        _OBSERVERS.remove(observer)


def observed(kind: str, programs: Callable[[], int], call: Callable[[], T], *, block: bool = False) -> T:
    """``call()``, reported to the registered observers as a call of ``kind``: its wall time (after waiting for its
    outputs, with ``block``) and whether ``programs()`` (a count of compiled programs the call may add to) grew."""
    if not _OBSERVERS:
        return call()
    observers = tuple(_OBSERVERS)
    before, start = programs(), time.perf_counter()
    out = jax.block_until_ready(call()) if block else call()
    seconds, compiled = time.perf_counter() - start, programs() > before
    for observer in observers:
        observer.on_call(kind, seconds, compiled)
    return out


__all__ = ["CallObserver", "observe", "observed"]
