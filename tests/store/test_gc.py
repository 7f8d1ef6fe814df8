"""Garbage collection stays inside the store's own prefix (the emulator's range-delete bug)."""

import numpy as np
import tensorstore as ts

from mgrpo_jax.store import Record, open_store

from .conftest import make_url


def _fill(store, steps):
    for step in steps:
        w = store.step_writer(step, "main", policy_version=step)
        w.put_array("rewards", np.full((2, 2), step, np.float32))
        w.put_records([Record("note", step, 0, 0, 0, step, {"s": step})])
        w.commit()
        store.tasks.post([Record("task", step, 0, 0, 0, step, {"task": "t"})])


class _NoRangeDelete:
    """Proxy for a TensorStore KvStore that fails any range delete (which the GCS path must not use)."""

    def __init__(self, kv):
        self._kv = kv

    def delete_range(self, *args, **kwargs):
        raise AssertionError("range delete issued on GCS")

    def __getattr__(self, name):
        return getattr(self._kv, name)


def test_gc_deletes_only_old_steps_of_own_prefix(backend, request, tmp_path):
    base = make_url(backend, request, tmp_path, name="run")
    a = open_store(base + "/a")
    sibling = open_store(base + "/a-sibling")  # shares the string prefix "…/a" but not the directory
    parent_other = open_store(base + "/b")
    _fill(a, range(5))
    _fill(sibling, range(3))
    _fill(parent_other, range(3))
    a.fifo("unsync").append([Record("traj", 0, 0, 0, 0, 0, {})])
    if backend == "gs":
        a.kv._kv = _NoRangeDelete(a.kv._kv)

    assert a.steps() == [0, 1, 2, 3, 4]
    assert a.gc(keep_last=2) == [0, 1, 2]
    assert a.steps() == [3, 4] and a.steps("tasks") == [3, 4]
    assert a.committed_steps("main") == [3, 4]
    np.testing.assert_array_equal(a.read_step(4, "main").array("rewards"), np.full((2, 2), 4, np.float32))
    assert a.gc(before_step=4) == [3] and a.steps() == [4]
    assert a.gc(keep_last=5) == []
    assert a.fifo("unsync").size() == 1  # FIFOs are not step data
    for other in (sibling, parent_other):
        assert other.steps() == [0, 1, 2]
        assert other.read_step(0, "main").records("note")[0].payload == {"s": 0}
        assert other.tasks.task_ids(2) == ["q000000-r0000-i0000"]


def test_emulator_range_delete_is_confined(request):
    """The fixture's patched emulator honours list offsets, so even a raw range delete stays in its prefix."""
    base = make_url("gs", request, None, name="raw")
    loc_a = open_store(base + "/a").location
    loc_b = open_store(base + "/b").location
    kv_a = ts.KvStore.open(loc_a.kvstore_spec()).result()
    kv_b = ts.KvStore.open(loc_b.kvstore_spec()).result()
    kv_a.write("x", b"1").result()
    kv_b.write("y", b"2").result()
    kv_a.delete_range(ts.KvStore.KeyRange("", "")).result()
    assert kv_a.list().result() == []
    assert kv_b.list().result() == [b"y"]
