"""FIFO of the unsynchronised ablation: ordered fixed-size chunks, exactly once per consumer, resumable."""

import pytest

from mgrpo_jax.store import ConflictError, Record, StoreTimeout, open_store


def _items(step, n, version=0):
    return [Record("sub_traj", step, q, 0, i, version, {"q": q, "i": i}) for q in range(n) for i in range(2)]


def test_fifo_exactly_once_and_resume(store_url, fast_poll):
    producer = open_store(store_url, poll=fast_poll).fifo("sub")
    first = _items(0, 5)  # 10 records
    assert producer.append(first) == 10
    assert producer.append(first[:4]) == 0  # a retried append adds nothing
    consumer = open_store(store_url, poll=fast_poll).fifo("sub").consumer("trainer")
    got = consumer.pop(4, timeout_s=1) + consumer.pop(4, timeout_s=1)
    assert got == first[:8] and consumer.offset == 8

    # Only 2 left: a chunk of 4 times out, naming the consumer and the item range, and consumes nothing.
    with pytest.raises(StoreTimeout) as info:
        consumer.pop(4, timeout_s=0.2)
    assert "'trainer'" in str(info.value) and "items 8..11" in str(info.value) and "only 2" in str(info.value)
    assert consumer.offset == 8

    # A restarted producer (new process: new object) skips what is there and continues numbering.
    second = _items(1, 3)
    restarted = open_store(store_url, poll=fast_poll).fifo("sub")
    assert restarted.append(first + second) == 6
    assert restarted.size() == 16

    # A restarted consumer resumes from its persisted offset; a second consumer reads everything itself.
    resumed = open_store(store_url, poll=fast_poll).fifo("sub").consumer("trainer")
    assert resumed.offset == 8
    rest = resumed.pop(4, timeout_s=1) + resumed.pop(4, timeout_s=1)
    assert rest == first[8:] + second
    assert got + rest == first + second  # exactly once, in order
    other = resumed.fifo.consumer("eval")
    assert other.pop(16, timeout_s=1) == first + second

    # peek does not consume; seek rewinds to a checkpointed offset.
    resumed.seek(12)
    assert resumed.peek(2, timeout_s=1) == second[2:4] and resumed.offset == 12
    assert resumed.pop(2, timeout_s=1) == second[2:4] and resumed.offset == 14


def test_fifo_concurrent_consumer_instances_conflict(store_url, fast_poll):
    store = open_store(store_url, poll=fast_poll)
    store.fifo("q").append(_items(0, 4))
    a = store.fifo("q").consumer("c")
    b = open_store(store_url).fifo("q").consumer("c")
    start, generation = a._state()
    assert b.pop(2, timeout_s=1)
    # ``a`` read the old offset, then ``b`` moved it: a's conditional update must fail, not double-pop.
    assert not store.kv.write_if(a._state_key, b"{}", generation)
    assert start == 0 and a.offset == 2


def test_fifo_pop_waits_for_items(store_url, fast_poll):
    import threading
    import time

    store = open_store(store_url, poll=fast_poll)
    consumer = store.fifo("late").consumer("c")
    thread = threading.Thread(target=lambda: (time.sleep(0.2), store.fifo("late").append(_items(0, 2))))
    thread.start()
    assert len(consumer.pop(4, timeout_s=10)) == 4
    thread.join()


def test_fifo_bad_inputs():
    fifo = open_store("memory://fifo-bad").fifo("f")
    with pytest.raises(ValueError, match="chunk size"):
        fifo.consumer("c").pop(0, timeout_s=0)
    with pytest.raises(ValueError, match="invalid fifo name"):
        open_store("memory://fifo-bad").fifo("F/x")
    with pytest.raises(ValueError, match="Record objects"):
        fifo.append([{"step": 0}])


def test_conflict_error_is_reported():
    store = open_store("memory://fifo-conflict")
    store.fifo("f").append(_items(0, 2))
    consumer = store.fifo("f").consumer("c")
    real_state = consumer._state

    def stale_state():
        value, generation = real_state()
        consumer.kv.write(consumer._state_key, b'{"format":"x"}')  # someone else moved it meanwhile
        return value, generation

    consumer._state = stale_state
    with pytest.raises(ConflictError, match="moved while popping"):
        consumer.pop(2, timeout_s=1)
