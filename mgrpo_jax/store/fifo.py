"""FIFOs for the unsynchronised ablation: append records, pop fixed-size chunks in order, once per consumer.

Items are numbered 0, 1, 2, … in append order; the key carries the number and the record's identity
(step and slot id), so a retried or repeated append of the same record is recognised and skipped. One
producer object appends to a given FIFO (it numbers items; a second concurrent producer is detected as
a corrupt FIFO). Any number of named consumers read it independently; each consumer's offset lives in
the store and is advanced with a conditional write, so a restarted consumer resumes where it stopped and
two live instances of one consumer cannot both pop the same chunk.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Sequence

from mgrpo_jax.store.errors import ConflictError, CorruptRecordError, StoreTimeout
from mgrpo_jax.store.records import Record, check_int, check_name, seal, unseal
from mgrpo_jax.store.retry import poll_until

_ITEM_RE = re.compile(r"^(\d{12})\.(\d{10})-([a-z][a-z0-9_]*)-(q\d{6}-r\d{4}-i\d{4})\.json$")


def _identity(rec: Record) -> str:
    return f"{rec.step:010d}-{rec.kind}-{rec.id}"


class Fifo:
    def __init__(self, store, name: str):
        self.store = store
        self.kv = store.kv
        self.name = check_name("fifo name", name)
        self._items = f"fifo/{name}/items/"
        self._known: set[str] | None = None
        self._next = 0

    def _item_key(self, seq: int, rec: Record) -> str:
        return f"{self._items}{seq:012d}.{_identity(rec)}.json"

    def _scan(self) -> None:
        seqs: dict[int, str] = {}
        known = set()
        for key in self.kv.list_prefix(self._items):
            m = _ITEM_RE.match(key[len(self._items) :])
            if not m:
                continue
            seq = int(m[1])
            if seq in seqs:
                raise CorruptRecordError(
                    f"FIFO {self.name!r} has two items numbered {seq} (two producers?)",
                    url=self.store.url,
                    key=key,
                )
            seqs[seq] = key
            known.add(f"{m[2]}-{m[3]}-{m[4]}")
        self._known = known
        self._next = max(seqs) + 1 if seqs else 0

    def append(self, records: Iterable[Record]) -> int:
        """Appends records in order, skipping any already in the FIFO; returns how many were added."""
        records = list(records)
        for rec in records:
            if not isinstance(rec, Record):
                raise ValueError(f"append expects Record objects, got {type(rec).__name__}")
        if self._known is None:
            self._scan()
        items, idents = [], set()
        for rec in records:
            ident = _identity(rec)
            if ident in self._known or ident in idents:
                continue
            items.append((self._item_key(self._next + len(items), rec), rec.encode()))
            idents.add(ident)
        try:
            # Issued concurrently; a False (not created) only means a lost reply hid our own earlier write.
            self.kv.create_many(items)
        except Exception:
            self._known = None  # some may have landed: rescan before the next append
            raise
        self._known |= idents
        self._next += len(items)
        return len(items)

    def restore(self, records: Sequence[Record]) -> None:
        """Writes ``records`` as the first items of an empty FIFO: the items a checkpoint kept of a FIFO whose store
        did not outlive its process (a ``memory://`` store); its consumers start again at offset 0."""
        if self.size():
            raise ValueError(f"FIFO {self.name!r} in {self.store.url} already holds {self._next} items; only an "
                             f"empty FIFO is restored")
        self.kv.create_many([(self._item_key(i, rec), rec.encode()) for i, rec in enumerate(records)])
        self._known = None  # rescan before the next append, which numbers on from len(records)

    def size(self) -> int:
        """Number of items ever appended (re-read from the store)."""
        self._scan()
        return self._next

    def consumer(self, name: str) -> FifoConsumer:
        return FifoConsumer(self, name)


class FifoConsumer:
    def __init__(self, fifo: Fifo, name: str):
        self.fifo = fifo
        self.store = fifo.store
        self.kv = fifo.kv
        self.name = check_name("consumer name", name)
        self._state_key = f"fifo/{fifo.name}/consumers/{name}.json"

    def _state(self) -> tuple[int, bytes]:
        raw, generation = self.kv.read(self._state_key)
        if raw is None:
            return 0, generation
        return int(unseal(raw, url=self.store.url, key=self._state_key)["next"]), generation

    @property
    def offset(self) -> int:
        """The number of items this consumer has popped (its persisted offset)."""
        return self._state()[0]

    def seek(self, offset: int) -> None:
        """Sets the persisted offset (e.g. to the value saved in the trainer's checkpoint)."""
        check_int("offset", offset, 10**12)
        self.kv.write(self._state_key, seal({"next": offset}))

    def backlog(self) -> int:
        """Items appended and not yet popped by this consumer (re-read from the store)."""
        return self.fifo.size() - self.offset

    def peek(self, n: int, timeout_s: float) -> list[Record]:
        """The next ``n`` items without consuming them (waits up to ``timeout_s`` for n to exist)."""
        return self._take(n, timeout_s, advance=False)

    def pop(self, n: int, timeout_s: float) -> list[Record]:
        """Waits for the next ``n`` items, advances the persisted offset past them, returns them in order.

        Raises StoreTimeout (offset unchanged) if fewer than ``n`` are available in time, and ConflictError
        if another instance of this consumer advanced the offset meanwhile.
        """
        return self._take(n, timeout_s, advance=True)

    def _take(self, n: int, timeout_s: float, *, advance: bool) -> list[Record]:
        if isinstance(n, bool) or not isinstance(n, int) or n < 1:
            raise ValueError(f"chunk size must be a positive int, got {n!r}")
        start, generation = self._state()
        items = self.fifo._items
        lo, hi = f"{items}{start:012d}", f"{items}{start + n:012d}"

        def check():
            keys = self.kv.list_range(lo, hi, prefix=items)
            return keys if len(keys) >= n else None

        keys = poll_until(check, timeout_s, self.store.poll)
        if keys is None:
            present = len(self.kv.list_range(lo, hi, prefix=items))
            raise StoreTimeout(
                f"timed out after {timeout_s:g}s: consumer {self.name!r} of FIFO {self.fifo.name!r} needs "
                f"items "
                f"{start}..{start + n - 1} but only {present} of them exist [{self.store.url}{items}]",
                url=self.store.url,
                missing=tuple(f"{items}{s:012d}.*" for s in range(start + present, start + n)),
            )
        seqs = [int(k[len(items) : len(items) + 12]) for k in keys]
        if seqs != list(range(start, start + n)):
            raise CorruptRecordError(
                f"FIFO {self.fifo.name!r} items out of sequence: {seqs}", url=self.store.url, key=items
            )
        records = [
            Record.decode(raw, url=self.store.url, key=key)
            if raw is not None
            else _missing(self.store.url, key)
            for key, raw in zip(keys, self.kv.read_many(keys), strict=True)
        ]
        if advance and not self.kv.write_if(self._state_key, seal({"next": start + n}), generation):
            raise ConflictError(
                f"offset of consumer {self.name!r} on FIFO {self.fifo.name!r} moved while popping items "
                f"{start}..{start + n - 1} (another instance of this consumer is running?)",
                url=self.store.url,
                key=self._state_key,
            )
        return records


def _missing(url: str, key: str):
    raise CorruptRecordError("listed FIFO item vanished before it could be read", url=url, key=key)
