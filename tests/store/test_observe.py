"""The store's I/O observation API (``mgrpo_jax.store.observe``) and the store benchmark's Meter built on it."""

import numpy as np

from mgrpo_jax.bench.store import Meter, metered
from mgrpo_jax.store import StoreObserver, observe, open_store
from mgrpo_jax.store import arrays as store_arrays
from mgrpo_jax.store import kv as store_kv


class _Log(StoreObserver):
    def __init__(self):
        self.events = []

    def on_read(self, key, value):
        self.events.append(("read", key, value))

    def on_write(self, key, value):
        self.events.append(("write", key, value))

    def on_list(self, lo, hi):
        self.events.append(("list", lo, hi))

    def on_array_write(self, key, nbytes):
        self.events.append(("array_write", key, nbytes))

    def on_array_read(self, key, nbytes):
        self.events.append(("array_read", key, nbytes))


def _exercise(kv, arr):
    kv.write("a", b"hello")  # 5 bytes
    kv.write("b", b"abc")  # 3 bytes
    kv.delete("a")
    assert kv.read("missing") == (None, store_kv.NO_VALUE)
    assert kv.read("b")[0] == b"abc"  # 3 bytes
    assert kv.list_prefix("b") == ["b"]
    store_arrays.write_array(kv, "arr", arr)
    back = store_arrays.read_array(kv, "arr", store_arrays.array_meta(arr))
    np.testing.assert_array_equal(back, arr)


def test_observer_and_meter_count_each_operation(tmp_path):
    kv = open_store((tmp_path / "store").as_uri()).kv
    arr = np.arange(6, dtype=np.int32)  # 24 bytes
    meter, log = Meter(), _Log()
    with metered(meter), observe(log) as registered:
        assert registered is log
        _exercise(kv, arr)
    # records: 2 writes + 1 read of a present key + the array written and read back = 5;
    # bytes: 5 + 3 (writes) + 3 (read) + 24 + 24 (array) = 59; 1 delete, 1 listing, 1 missing read.
    assert meter.snapshot() == (5, 59, 1, 1, 1)
    assert log.events == [
        ("write", "a", b"hello"),
        ("write", "b", b"abc"),
        ("write", "a", None),
        ("read", "missing", None),
        ("read", "b", b"abc"),
        ("list", "b", "c"),
        ("array_write", "arr", 24),
        ("array_read", "arr", 24),
    ]

    # After the blocks exit nothing is counted or told, and no observer stays registered.
    assert store_kv._OBSERVERS == []
    _exercise(open_store((tmp_path / "again").as_uri()).kv, arr)
    assert meter.snapshot() == (5, 59, 1, 1, 1)
    assert len(log.events) == 8


def test_concurrent_reads_are_observed(tmp_path):
    kv = open_store((tmp_path / "store").as_uri()).kv
    kv.write_many([("x", b"12"), ("y", b"3456")])
    meter = Meter()
    with metered(meter):
        assert kv.read_many(["x", "nope", "y"]) == [b"12", None, b"3456"]
        assert kv.create_many([("x", b"0"), ("z", b"789")]) == [False, True]
    # 2 reads present (6 bytes) + 2 writes issued (4 bytes), 1 missing read.
    assert meter.snapshot() == (4, 10, 0, 0, 1)
