"""Checkpoints: both agents and the host state round-trip, sharded, also onto other meshes; SIGTERM."""

import logging
import os
import signal
import sys
import time

import jax
import numpy as np
import pytest

from mgrpo_jax.agent.optim import default_optim_config
from mgrpo_jax.agent.state import abstract_agent_state, create_agent_state
from mgrpo_jax.model import make_mesh
from mgrpo_jax.runtime.checkpoint import Checkpointer, PreemptionGuard, key_from_json, key_to_json

OPTIM = default_optim_config(lr=1e-3, weight_decay=0.1)


def _equal(a, b):
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


def _bump(state, k):
    """A state that differs from the init everywhere (so a restore of the wrong step would show)."""
    return jax.tree.map(lambda x: x + k if x.dtype != bool else x, state)


def test_round_trip_both_agents_and_other_meshes(tmp_path, tiny_cfg, mesh8):
    devs = jax.devices()
    main_mesh = make_mesh({"data": 1, "fsdp": 2, "tensor": 2}, devs[:4])  # disjoint halves, as colocated
    sub_mesh = make_mesh({"data": 2, "fsdp": 1, "tensor": 2}, devs[4:])
    _, main, _ = create_agent_state(tiny_cfg, OPTIM, main_mesh, seed=1)
    _, sub, _ = create_agent_state(tiny_cfg, OPTIM, sub_mesh, seed=2)
    key = jax.random.key(42)
    host = {"step": 7, "rng": key_to_json(key), "data": {"next_index": 3, "epoch": np.int64(1)},
            "fifo": [0, 12], "history": np.arange(3)}

    with Checkpointer(tmp_path, keep=2, save_every=5) as ckpt:
        assert ckpt.latest_step() is None
        assert not ckpt.save(7, {"main": main, "sub": sub}, host)  # not due: 7 % 5 != 0
        assert ckpt.save(7, {"main": main, "sub": sub}, host, force=True)  # e.g. on preemption
        assert ckpt.save(10, {"main": _bump(main, 1), "sub": _bump(sub, 1)}, dict(host, step=10))
        assert ckpt.save(15, {"main": _bump(main, 2), "sub": _bump(sub, 2)}, dict(host, step=15))
        ckpt.wait()
        assert ckpt.all_steps() == [10, 15]  # keep=2
        assert ckpt.latest_step() == 15

    # A fresh manager (a restarted job) restores onto the same meshes...
    ckpt = Checkpointer(tmp_path, keep=2, save_every=5)
    _, abs_main, _ = abstract_agent_state(tiny_cfg, OPTIM, main_mesh)
    _, abs_sub, _ = abstract_agent_state(tiny_cfg, OPTIM, sub_mesh)
    states, got_host = ckpt.restore({"main": abs_main, "sub": abs_sub})
    _equal(states["main"], _bump(main, 2))
    _equal(states["sub"], _bump(sub, 2))
    for leaf, want in zip(jax.tree.leaves(states["sub"]), jax.tree.leaves(abs_sub), strict=True):
        assert leaf.sharding == want.sharding
    assert got_host["step"] == 15 and got_host["fifo"] == [0, 12] and got_host["history"] == [0, 1, 2]
    assert got_host["data"] == {"next_index": 3, "epoch": 1}
    assert (jax.random.key_data(key_from_json(got_host["rng"])) == jax.random.key_data(key)).all()

    # ...and onto a different mesh shape (all 8 devices; tensor 2 -> data 2 x fsdp 2 x tensor 2), or one
    # device; an older step; one agent only.
    _, abs8, _ = abstract_agent_state(tiny_cfg, OPTIM, mesh8)
    states, got_host = ckpt.restore({"main": abs8}, step=10)
    assert set(states) == {"main"} and got_host["step"] == 10
    _equal(states["main"], _bump(main, 1))
    q = states["main"].params["layers"]["q"][...]
    assert q.sharding.mesh.shape == mesh8.shape
    assert q.sharding == jax.tree.leaves(abs8.params["layers"]["q"])[0].sharding
    mesh1 = make_mesh({"data": 1, "fsdp": 1, "tensor": 1}, devs[7:])
    _, abs1, _ = abstract_agent_state(tiny_cfg, OPTIM, mesh1)
    states, _ = ckpt.restore({"sub": abs1})
    _equal(states["sub"], _bump(sub, 2))
    ckpt.close()


def test_restore_without_checkpoint_raises(tmp_path):
    with Checkpointer(tmp_path) as ckpt, pytest.raises(FileNotFoundError):
        ckpt.restore({"main": {"x": jax.ShapeDtypeStruct((2,), np.float32)}})


def test_host_state_name_is_reserved(tmp_path):
    with Checkpointer(tmp_path) as ckpt, pytest.raises(ValueError):
        ckpt.save(1, {"host_state": {"x": np.zeros(2)}}, force=True)


def test_sigterm_sets_the_flag_and_handlers_are_restored():
    before = signal.getsignal(signal.SIGTERM)
    with PreemptionGuard() as guard:
        assert guard.installed and not guard.should_stop()
        os.kill(os.getpid(), signal.SIGTERM)  # the process survives: the handler only sets a flag
        assert guard.requested and guard.should_stop() and guard.triggered
        assert guard.received == [signal.SIGTERM]
    assert signal.getsignal(signal.SIGTERM) == before


def test_sigint_stops_like_sigterm_and_a_second_one_interrupts():
    before = signal.getsignal(signal.SIGINT)
    with PreemptionGuard() as guard:
        os.kill(os.getpid(), signal.SIGINT)  # Ctrl-C: checkpoint and stop at the end of the step
        assert guard.should_stop() and guard.received == [signal.SIGINT]
        with pytest.raises(KeyboardInterrupt):
            os.kill(os.getpid(), signal.SIGINT)  # Ctrl-C again: now
    assert signal.getsignal(signal.SIGINT) == before


def test_after_a_second_ctrl_c_the_cut_off_work_goes_to_the_debug_log_not_the_screen(monkeypatch, caplog, capsys):
    """What the second Ctrl-C cuts off (an asyncio loop half built in Orbax's run_sync, its unawaited coroutines)
    fails when collected; that is logged at debug level, not printed as a traceback or a warning."""
    import gc
    import warnings

    monkeypatch.setattr(sys, "unraisablehook", sys.unraisablehook)

    class HalfBuiltLoop:
        def __del__(self):
            raise AttributeError("'_UnixSelectorEventLoop' object has no attribute '_ssock'")

    async def save():
        pass

    caplog.set_level(logging.DEBUG, logger="mgrpo_jax.runtime.checkpoint")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with PreemptionGuard():
            os.kill(os.getpid(), signal.SIGINT)
            with pytest.raises(KeyboardInterrupt):
                os.kill(os.getpid(), signal.SIGINT)
        HalfBuiltLoop()
        save()
        gc.collect()
    assert not [w for w in caught if "never awaited" in str(w.message)]
    assert "Traceback" not in capsys.readouterr().err
    assert "after the second Ctrl-C" in caplog.text and "_ssock" in caplog.text


class _Writes(logging.Handler):
    """A log handler that notes a record arriving while it is still writing the one before (re-entered)."""

    def __init__(self):
        super().__init__()
        self.writing, self.reentered, self.messages = False, False, []

    def emit(self, record):
        self.reentered |= self.writing
        self.writing = True
        try:
            if record.getMessage() == "a line being written":
                os.kill(os.getpid(), signal.SIGINT)  # Ctrl-C mid-write: Python runs the handler inside this sleep
                time.sleep(0.05)
            self.messages.append(record.getMessage())
        finally:
            self.writing = False


def test_a_ctrl_c_during_a_log_write_is_logged_after_the_write_not_inside_it():
    """Logging from the signal handler would re-enter the write in progress (the run.log file's buffered writer
    then raises "reentrant call"); the notice is logged by another thread once the write is done."""
    handler, logger = _Writes(), logging.getLogger("mgrpo_jax")
    logger.addHandler(handler)
    try:
        with PreemptionGuard() as guard:
            logging.getLogger("mgrpo_jax.test").warning("a line being written")
            assert guard.requested
    finally:
        logger.removeHandler(handler)
    assert not handler.reentered
    assert handler.messages[0] == "a line being written" and handler.messages[1].startswith("Ctrl-C: stopping")


def _damage(directory, what: str) -> None:
    files = sorted(p for p in directory.rglob("*") if p.is_file() and what in str(p.relative_to(directory)))
    assert files, what
    for path in files:
        path.write_bytes(path.read_bytes()[: len(path.read_bytes()) // 2])  # cut short, as by a full disk


@pytest.mark.parametrize("what", ["main", "host_state"])
def test_restore_falls_back_to_the_newest_intact_checkpoint(tmp_path, caplog, what):
    tree = {"w": np.arange(6, dtype=np.float32).reshape(2, 3)}
    target = {"main": {"w": jax.ShapeDtypeStruct((2, 3), np.float32)}}
    with Checkpointer(tmp_path, keep=None) as ckpt:
        for step in (1, 2, 3):
            ckpt.save(step, {"main": {"w": tree["w"] + step}}, {"step": step}, force=True)
    _damage(tmp_path / "checkpoints" / "3", what)
    with Checkpointer(tmp_path, keep=None) as ckpt:
        step, states, host = ckpt.restore_latest(target)
    assert (step, host["step"]) == (2, 2)
    np.testing.assert_array_equal(states["main"]["w"], tree["w"] + 2)
    warnings = [r.getMessage() for r in caplog.records if "damaged" in r.getMessage()]
    assert len(warnings) == 1 and "checkpoints/3" in warnings[0]


def test_restore_latest_without_checkpoints_is_none_and_all_damaged_raises(tmp_path):
    target = {"main": {"w": jax.ShapeDtypeStruct((2,), np.float32)}}
    with Checkpointer(tmp_path) as ckpt:
        assert ckpt.restore_latest(target) is None
        ckpt.save(1, {"main": {"w": np.ones(2, np.float32)}}, {"step": 1}, force=True)
    _damage(tmp_path / "checkpoints" / "1", "main")
    with Checkpointer(tmp_path) as ckpt, pytest.raises(ValueError, match="no checkpoint in .* restores"):
        ckpt.restore_latest(target)


def test_discard_partial_outlasts_a_writer_still_adding_files(tmp_path, monkeypatch):
    """A writer thread the second Ctrl-C cut off may still add a file to an unfinished save while it is removed
    ("Directory not empty"); removal retries until the writer stops, and the complete checkpoints stay."""
    import errno

    from etils import epath

    from mgrpo_jax.runtime.checkpoint import TMP_MARK, discard_partial

    (tmp_path / "3").mkdir()
    (tmp_path / f"4{TMP_MARK}" / f"sub{TMP_MARK}").mkdir(parents=True)
    path_type = type(epath.Path(tmp_path))
    rmtree, calls = path_type.rmtree, []

    def busy_twice(self, *args, **kwargs):
        calls.append(self.name)
        if len(calls) <= 2:
            raise OSError(errno.ENOTEMPTY, "Directory not empty", f"sub{TMP_MARK}")
        return rmtree(self, *args, **kwargs)

    monkeypatch.setattr(path_type, "rmtree", busy_twice)
    assert discard_partial(tmp_path) == [f"4{TMP_MARK}"]
    assert len(calls) == 3 and sorted(os.listdir(tmp_path)) == ["3"]


def test_discard_partial_leaves_what_it_cannot_remove_for_the_next_run(tmp_path, monkeypatch, caplog):
    import errno

    from etils import epath

    from mgrpo_jax.runtime.checkpoint import TMP_MARK, discard_partial

    (tmp_path / f"4{TMP_MARK}").mkdir()

    def always_busy(self, *args, **kwargs):
        raise OSError(errno.ENOTEMPTY, "Directory not empty")

    monkeypatch.setattr(type(epath.Path(tmp_path)), "rmtree", always_busy)
    assert discard_partial(tmp_path, timeout_s=0.2) == []
    assert "next run removes it" in caplog.text


def test_settle_waits_for_a_finalising_thread_the_manager_lost_track_of(tmp_path):
    """A second Ctrl-C can land inside Orbax's save between the start of its finalising thread and the manager's
    record of it; that thread then writes the step and prunes the one before after `wait()` returned. `settle`
    joins it too, so the resume point read afterwards is the newest checkpoint on disk at exit."""
    import time

    from mgrpo_jax.runtime.checkpoint import complete_steps, orbax_threads, settle

    with Checkpointer(tmp_path, keep=1) as ckpt:
        ckpt.save(1, {"main": {"w": np.ones(4, np.float32)}}, {"step": 1}, force=True)
        ckpt.wait()
        finalize = ckpt._manager._finalize

        def slow_finalize(*args, **kwargs):
            time.sleep(1.0)  # the step's writes are done; its rename and the pruning of step 1 are still to come
            return finalize(*args, **kwargs)

        ckpt._manager._finalize = slow_finalize
        ckpt.save(2, {"main": {"w": np.full(4, 2.0, np.float32)}}, {"step": 2}, force=True)
        ckpt._manager._finalize_thread.set(None)  # the interrupted `set_from`: the thread runs, unrecorded
        assert orbax_threads(), "the save's finalising thread should still be running"
        assert settle(timeout_s=60)
        assert complete_steps(tmp_path / "checkpoints") == [2] and not orbax_threads()
