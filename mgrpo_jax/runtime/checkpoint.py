"""Checkpoints of several agents at once, plus the host state, and a clean exit on preemption.

::

    ckpt = Checkpointer(workdir, keep=3, save_every=100)
    start = 0
    if ckpt.latest_step() is not None:                       # resume
        states, host = ckpt.restore({"main": abstract_main, "sub": abstract_sub})
        start = host["step"]
    with PreemptionGuard() as guard:
        for step in range(start, total):
            ...train...
            stop = guard.should_stop()
            ckpt.save(step + 1, {"main": main_state, "sub": sub_state},
                      {"step": step + 1, "rng": key_to_json(key), "data": it.get_state()}, force=stop)
            if stop:
                break
    ckpt.wait(); ckpt.close()

- Layout: ``<workdir>/checkpoints/<step>/<agent>/`` (Orbax ``StandardSave`` of that agent's pytree, e.g. an
  ``AgentState``) and ``<workdir>/checkpoints/<step>/host_state/`` (a JSON blob: step, RNG key data,
  data-iterator state, queue / FIFO offsets — anything ``json`` can write). ``workdir`` may be ``gs://``.
- Saves are asynchronous (the arrays are copied off the devices, then written in the background); the
  next save, ``wait()`` and ``close()`` wait for the previous one. A step directory appears only once
  complete (Orbax's atomic rename / commit marker), so a crash mid-save leaves the previous checkpoint.
- ``restore`` takes *abstract* targets (``jax.ShapeDtypeStruct`` leaves carrying shardings, e.g. from
  ``state.abstract_agent_state`` on the mesh you want) and reads each array straight into that sharding —
  the mesh may differ from the one that saved it (other shape, other devices).
- Only the agents named in ``restore`` are read, so a stage-2 run can take just one agent of a stage-1
  checkpoint (e.g. ``restore({"main": abs_main}, step=s)``).
"""

from __future__ import annotations

import logging
import os
import queue
import signal
import sys
import threading
import time
import warnings
import weakref
from collections.abc import Mapping
from typing import Any

import jax
import numpy as np
import orbax.checkpoint as ocp
from etils import epath

HOST_ITEM = "host_state"
CHECKPOINTS = "checkpoints"  # the RL checkpoints' folder in the workdir
TMP_MARK = ".orbax-checkpoint-tmp"  # Orbax writes a step here, renamed to the step once complete
SETTLE_S = 60.0  # how long a second Ctrl-C waits for the checkpoint files already being written
log = logging.getLogger(__name__)
_open: weakref.WeakSet = weakref.WeakSet()  # every open Checkpointer, for `settle`


class Checkpointer:
    """Orbax ``CheckpointManager`` over several agents' states plus a JSON host state (module docstring).

    ``keep``: how many of the latest checkpoints to keep (None: all). ``save_every``: ``save`` writes only
    on steps that are multiples of it unless ``force=True`` (use force for the final / preemption save).
    """

    def __init__(self, workdir: str | epath.PathLike, keep: int | None = 3, save_every: int = 1, *,
                 subdir: str = CHECKPOINTS, async_save: bool = True):
        self.directory = epath.Path(workdir) / subdir
        self.save_every = max(int(save_every), 1)
        # Directories are created before the save returns: with orbax 0.12's background creation, the step's
        # temporary directory can appear (as the parent of an item's) before the step-level creator checks for
        # it, which then deletes it under the item's writer ("Directory not empty: 'd'", seen under load).
        # cleanup_tmp_directories: a save cut off by a kill or a second Ctrl-C leaves its temporary directory
        options = ocp.CheckpointManagerOptions(
            max_to_keep=keep, enable_async_checkpointing=async_save, create=True, cleanup_tmp_directories=True,
            async_options=ocp.AsyncOptions(create_directories_asynchronously=False))
        self._manager = ocp.CheckpointManager(self.directory, options=options)
        _open.add(self)

    # -- queries ------------------------------------------------------------------------------------

    def latest_step(self) -> int | None:
        """The newest complete checkpoint's step, or None."""
        return self._manager.latest_step()

    def all_steps(self) -> list[int]:
        return sorted(self._manager.all_steps())

    def should_save(self, step: int) -> bool:
        """``step`` is a multiple of ``save_every`` and newer than the latest checkpoint."""
        latest = self.latest_step()
        return step % self.save_every == 0 and (latest is None or step > latest)

    # -- save / restore -----------------------------------------------------------------------------

    def save(self, step: int, states: Mapping[str, Any], host_state: Mapping[str, Any] | None = None, *,
             force: bool = False) -> bool:
        """Save ``states`` ({agent name: pytree}) and ``host_state`` at ``step`` (asynchronously).

        Returns whether a save was started (False when ``step`` is not due and ``force`` is False, or when
        that step is already saved). Call on every process (multi-host saves are collective).
        """
        if HOST_ITEM in states:
            raise ValueError(f"{HOST_ITEM!r} is reserved for the host state")
        if not force and not self.should_save(step):
            return False
        if step in self._manager.all_steps():
            return False
        items = {name: ocp.args.StandardSave(tree) for name, tree in states.items()}
        items[HOST_ITEM] = ocp.args.JsonSave(_jsonable(dict(host_state or {})))
        return bool(self._manager.save(int(step), args=ocp.args.Composite(**items), force=True))

    def restore(self, abstract_states: Mapping[str, Any], step: int | None = None
                ) -> tuple[dict[str, Any], dict[str, Any]]:
        """``(states, host_state)`` of ``step`` (default: the latest) into the given abstract targets.

        ``abstract_states``: {agent name: pytree of ``jax.ShapeDtypeStruct`` with ``sharding``}, or of
        concrete arrays (their shardings are used). Raises ``FileNotFoundError`` when there is nothing to
        restore.
        """
        self.wait()
        if step is None:
            step = self.latest_step()
        if step is None:
            raise FileNotFoundError(f"no checkpoint in {self.directory}")
        items = {name: ocp.args.StandardRestore(_abstract(tree)) for name, tree in abstract_states.items()}
        items[HOST_ITEM] = ocp.args.JsonRestore()
        out = self._manager.restore(int(step), args=ocp.args.Composite(**items))
        return {name: out[name] for name in abstract_states}, dict(out[HOST_ITEM] or {})

    def restore_latest(self, abstract_states: Mapping[str, Any]) -> tuple[int, dict[str, Any], dict[str, Any]] | None:
        """``(step, states, host_state)`` of the newest checkpoint that restores, or None when there is none. A
        damaged checkpoint (a truncated array file, a cut-off host state) gets one warning line naming it and the
        one before it is tried; when none restores, the newest one's error is raised."""
        first_error = None
        for step in sorted(self.all_steps(), reverse=True):
            try:
                return (step, *self.restore(abstract_states, step=step))
            except Exception as e:  # noqa: BLE001 - Orbax and TensorStore fail on damaged files in many ways
                first_error = first_error or e
                log.warning("checkpoint %s is damaged and skipped (%s: %s)", self.directory / str(step),
                            type(e).__name__, str(e).splitlines()[0][:200] if str(e) else "")
        if first_error is not None:
            raise ValueError(f"no checkpoint in {self.directory} restores: {first_error}") from first_error
        return None

    def wait(self) -> None:
        """Block until the pending asynchronous save (if any) is on disk."""
        self._manager.wait_until_finished()

    def close(self) -> None:
        self._manager.wait_until_finished()
        self._manager.close()
        _open.discard(self)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


def complete_steps(directory: str | epath.PathLike) -> list[int]:
    """The steps of the complete checkpoints in `directory` (not those Orbax is still writing), without opening
    a manager: what a rerun resumes from."""
    path = epath.Path(directory)
    if not path.exists():
        return []
    return sorted(int(p.name) for p in path.iterdir() if p.name.isdigit() and p.is_dir())


def settle(timeout_s: float = SETTLE_S) -> bool:
    """After a second Ctrl-C: waits (at most `timeout_s`) for the saves that Orbax's threads are writing, so that
    nothing writes into the folders `discard_partial` then cleans and the resume point read afterwards is the
    one on disk at exit; a save the interrupt cut off before its writes began has nothing to wait for. Returns
    whether they all ended in time (else the launcher's exit stops them, and the next run's Checkpointer removes
    what they left).

    Besides each manager's pending save, every thread Orbax started is joined: the interrupt can land between
    the start of a save's finalising thread and the manager's record of it, and that thread then completes the
    step and prunes the one before after the manager says it has nothing to wait for (seen under load: a
    resume point of 20 reported while 24 was written and 20 deleted). Python's exit would wait for those
    threads anyway, so joining them here costs no time."""

    def wait_all():
        for checkpointer in list(_open):
            try:
                checkpointer.wait()
            except Exception:  # noqa: BLE001 - a save cut off midway may fail any way; discard_partial cleans up
                pass
        for thread in orbax_threads():
            thread.join()

    waiter = threading.Thread(target=wait_all, daemon=True, name="settle-checkpoints")
    waiter.start()
    waiter.join(timeout_s)
    return not waiter.is_alive()


def orbax_threads() -> list[threading.Thread]:
    """The live threads Orbax started (its save, finalise and commit-signalling threads), by their class's or
    target's module."""

    def from_orbax(thread: threading.Thread) -> bool:
        target = getattr(thread, "_target", None)  # threading.Thread keeps its target here
        modules = (type(thread).__module__, getattr(target, "__module__", None) or "")
        return any(m.startswith("orbax.") for m in modules)

    return [t for t in threading.enumerate() if t is not threading.current_thread() and t.is_alive()
            and from_orbax(t)]


def discard_partial(directory: str | epath.PathLike, timeout_s: float = 10.0) -> list[str]:
    """Removes the checkpoints Orbax had not finished writing in `directory` (a save cut off by a second Ctrl-C):
    the complete ones stay the resume point. Returns the names removed.

    A writer thread the interrupt cut off may still add a file while the folder is removed ("Directory not
    empty"), so removal is retried until `timeout_s`; what then remains is left for the next run's Checkpointer,
    which removes unfinished saves when it opens the folder."""
    path = epath.Path(directory)
    removed = []
    for partial in list(path.iterdir()) if path.exists() else []:
        if TMP_MARK in partial.name and _remove_until(partial, time.monotonic() + timeout_s):
            removed.append(partial.name)
    return removed


def _remove_until(partial: epath.Path, deadline: float) -> bool:
    while True:
        try:
            partial.rmtree(missing_ok=True) if partial.is_dir() else partial.unlink(missing_ok=True)
            return True
        except OSError:
            if time.monotonic() > deadline:
                logging.warning("could not remove the unfinished checkpoint %s; the next run removes it", partial)
                return False
            time.sleep(0.05)


def _abstract(tree):
    def f(x):
        if isinstance(x, jax.ShapeDtypeStruct):
            return x
        return jax.ShapeDtypeStruct(np.shape(x), x.dtype, sharding=getattr(x, "sharding", None))

    return jax.tree.map(f, tree)


def _jsonable(x):
    """numpy / jax scalars and arrays -> Python numbers and lists, recursively (JSON can then write it)."""
    if isinstance(x, Mapping):
        return {str(k): _jsonable(v) for k, v in x.items()}
    if isinstance(x, list | tuple):
        return [_jsonable(v) for v in x]
    if isinstance(x, jax.Array | np.ndarray | np.generic):
        return np.asarray(x).tolist()
    return x


def key_to_json(key: jax.Array) -> dict:
    """A JAX PRNG key (new-style typed or raw uint32) as JSON-able data for the host state."""
    if jax.dtypes.issubdtype(key.dtype, jax.dtypes.prng_key):
        return {"impl": str(jax.random.key_impl(key)), "data": np.asarray(jax.random.key_data(key)).tolist()}
    return {"impl": None, "data": np.asarray(key).tolist()}


def key_from_json(blob: Mapping) -> jax.Array:
    """Inverse of :func:`key_to_json`."""
    data = np.asarray(blob["data"], np.uint32)
    if blob.get("impl") is None:
        return jax.numpy.asarray(data)
    return jax.random.wrap_key_data(data, impl=blob["impl"])


class PreemptionGuard:
    """Context manager: SIGTERM (a TPU VM's preemption notice) or SIGINT (Ctrl-C) sets a flag instead of killing
    the process; a second Ctrl-C interrupts at once (KeyboardInterrupt). `reason` names the stop for the run's
    status: `interrupted` (Ctrl-C) or `preempted` (SIGTERM).

    The trainer polls ``should_stop()`` once per step, and on True saves a checkpoint (``force=True``) and
    exits cleanly. The previous handlers are restored on exit. Handlers can only be installed from the
    main thread; elsewhere the guard is inert (``installed`` False) but ``request_stop()`` still works.

    Multi-host: only some hosts may receive the signal, and every host must save at the same step, so
    ``should_stop()`` agrees across processes (an all-gather of the flags: call it at the same point of
    the loop on every process).
    """

    def __init__(self, signals: tuple[int, ...] = (signal.SIGTERM, signal.SIGINT)):
        self.signals = tuple(signals)
        self._event = threading.Event()
        self._previous: dict[int, Any] = {}
        self.installed = False
        self.received: list[int] = []
        # The handler runs between two bytecodes of the main thread, possibly inside a log handler's write: logging
        # there re-enters that write ("reentrant call inside BufferedWriter"). It hands its notice to this queue,
        # whose put is reentrant, and a thread logs it once the main thread's write is done.
        self._notices: queue.SimpleQueue = queue.SimpleQueue()
        self._notifier: threading.Thread | None = None

    def _handler(self, signum, frame):
        del frame
        if signum == signal.SIGINT and signal.SIGINT in self.received:
            quiet_cut_off_work()
            raise KeyboardInterrupt
        self.received.append(signum)
        if not self._event.is_set():
            if signum == signal.SIGINT:
                self._notices.put("Ctrl-C: stopping after this step with a checkpoint (run the same command to "
                                  "resume); Ctrl-C again stops at once, and the rerun resumes from the newest "
                                  "complete checkpoint")
            else:
                self._notices.put(f"{signal.Signals(signum).name} (a preemption notice): stopping after this step "
                                  "with a checkpoint")
        self._event.set()

    def _notify(self) -> None:
        while (notice := self._notices.get()) is not None:
            log.warning("%s", notice)

    @property
    def reason(self) -> str:
        return "interrupted" if signal.SIGINT in self.received else "preempted"

    def __enter__(self):
        if threading.current_thread() is threading.main_thread():
            self._notifier = threading.Thread(target=self._notify, name="stop-notices", daemon=True)
            self._notifier.start()
            for sig in self.signals:
                self._previous[sig] = signal.signal(sig, self._handler)
            self.installed = True
        return self

    def __exit__(self, *exc):
        for sig, prev in self._previous.items():
            signal.signal(sig, prev if prev is not None else signal.SIG_DFL)
        self._previous.clear()
        self.installed = False
        if self._notifier is not None:  # the notices logged before the run reports its stop
            self._notices.put(None)
            self._notifier.join(timeout=10)
            self._notifier = None
        return False

    @property
    def requested(self) -> bool:
        """This process received a stop signal (or ``request_stop`` was called)."""
        return self._event.is_set()

    @property
    def triggered(self) -> bool:
        """Same as ``should_stop()`` (agreed across processes: evaluate it at the same point on all)."""
        return self.should_stop()

    def request_stop(self) -> None:
        self._event.set()

    def should_stop(self) -> bool:
        """True once any process has been asked to stop (a collective when there are several processes)."""
        local = self._event.is_set()
        if jax.process_count() == 1:
            return local
        from jax.experimental import multihost_utils

        flags = multihost_utils.process_allgather(np.asarray([local], np.int32))
        return bool(np.asarray(flags).any())


def init_from_checkpoint(path: str, learners: Mapping[str, Any]) -> int:
    """Loads every learner's parameters from the latest checkpoint of the run in `path` (stage 2 from stage 1)
    and gives each a fresh optimizer. Returns the source step."""
    source_dir = path if "://" in path else os.path.abspath(path)
    source = Checkpointer(source_dir)
    step = source.latest_step()
    if step is None:
        raise FileNotFoundError(f"config.init_checkpoint={path!r}: no checkpoint under {source_dir}/checkpoints")
    try:
        states, _ = source.restore({name: learner.state for name, learner in learners.items()}, step=step)
    except (KeyError, ValueError, FileNotFoundError) as e:
        raise ValueError(f"config.init_checkpoint={path!r} (step {step}) does not hold agents "
                         f"{sorted(learners)} with this run's shapes: {e}") from e
    finally:
        source.close()
    for name, learner in learners.items():
        learner.state = states[name]
        learner.reset_optimizer(learner.config.optim)
    log.info("initialised %s from %s (step %d)", sorted(learners), path, step)
    return step


def quiet_cut_off_work() -> None:
    """A second Ctrl-C cuts work off mid-call: an asyncio loop half built inside Orbax's `run_sync` fails in its
    `__del__` when collected, and its coroutines are never awaited. Python prints those as tracebacks and warnings
    on stderr, where a user reads them as a crash. From here to the process's exit they go to the debug log."""
    warnings.filterwarnings("ignore", message=r"coroutine .* was never awaited", category=RuntimeWarning)

    def to_debug_log(unraisable) -> None:
        log.debug("after the second Ctrl-C: %r in %r", unraisable.exc_value, unraisable.object,
                  exc_info=(unraisable.exc_type, unraisable.exc_value, unraisable.exc_traceback))

    sys.unraisablehook = to_debug_log


def abandon_saves(workdir: str, folders: tuple[str, ...]) -> None:
    """After a second Ctrl-C: let Orbax's writer threads settle, then drop the unfinished saves in each of the
    workdir's `folders`, so the newest complete checkpoint is the resume point."""
    logging.getLogger("absl").setLevel(logging.CRITICAL + 1)  # Orbax's errors about the save cut off
    settle()
    for folder in folders:
        discard_partial(epath.Path(workdir) / folder)


def resume_points(workdir: str, folders: dict[str, str]) -> dict[str, int | None]:
    """{name: the newest complete checkpoint's step in the workdir's folder, or None} of `folders` {name: folder}."""
    return {name: (complete_steps(epath.Path(workdir) / folder) or [None])[-1] for name, folder in folders.items()}


def describe_resume(resume: dict, at_once: bool) -> str:
    """Where a rerun continues, in words, from `resume_points` of the RL and warm-start checkpoints."""
    how = "stopped at once" if at_once else "checkpoint written"
    if resume["checkpoint"] is not None:
        return f"{how}; the rerun resumes from RL step {resume['checkpoint']}"
    if resume["warmstart_checkpoint"] is not None:
        return f"{how}; the rerun resumes the warm start after {resume['warmstart_checkpoint']} steps"
    return f"{how}; no checkpoint was complete yet, so the rerun starts over"
