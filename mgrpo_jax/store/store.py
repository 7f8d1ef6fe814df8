"""The shared store: per-step data behind commit markers, a task queue and FIFOs, addressed by URL.

Key layout under the store's root (``memory://name/``, ``file:///path/``, ``gs://bucket/prefix/``)::

    steps/<step:010d>/<producer>/commit.json                  commit marker = manifest of the step's data
    steps/<step:010d>/<producer>/arrays/<name>/...            zarr v2 array (.zarray + one chunk)
    steps/<step:010d>/<producer>/records/<kind>/<id>.json     record, id = q<query>-r<rollout>-i<invocation>
    tasks/<step:010d>/task/<id>.json                          delegation task posted by the main job
    tasks/<step:010d>/claim/<id>.json                         lease of a task by a sub worker
    tasks/<step:010d>/answer/<id>.json                        the sub-agent's answer (first writer wins)
    tasks/<step:010d>/closed.json                             the full list of the step's task ids
    tasks/<step:010d>/batch/<bid>.json                        a round of tasks posted as one object (decoupled jobs)
    tasks/<step:010d>/claim/<bid>.json                        lease of a batch by a sub worker
    tasks/<step:010d>/batch_answer/<bid>.json                 the answers to a batch's tasks (first writer wins)
    fifo/<name>/items/<seq:012d>.<id>.json                    FIFO item (unsynchronised ablation)
    fifo/<name>/consumers/<consumer>.json                     a consumer's persisted offset

The same API works in one process (colocated: both roles open the same ``memory://`` or ``file://`` URL)
and across processes or hosts (decoupled: ``file://`` or ``gs://``). ``memory://`` stores are shared by
every ``open_store`` of the same URL in one process, and by nothing outside it.
"""

from __future__ import annotations

import os
import re
import time
from collections.abc import Iterable, Mapping, Sequence

import numpy as np

from mgrpo_jax.store import arrays as _arrays
from mgrpo_jax.store.errors import StoreError, StoreTimeout
from mgrpo_jax.store.kv import KV
from mgrpo_jax.store.records import Record, check_int, check_name, seal, step_dir, unseal
from mgrpo_jax.store.retry import PollPolicy, RetryPolicy, poll_until
from mgrpo_jax.store.url import StoreLocation, parse_store_url

_STEP_RE = re.compile(r"^\d{10}$")
AREAS = ("steps", "tasks")


class Store:
    """A shared store at one URL. Create with :func:`open_store`."""

    def __init__(self, location: StoreLocation, *, retry: RetryPolicy, poll: PollPolicy):
        self.location = location
        self.url = location.url
        self.retry = retry
        self.poll = poll
        self.kv = KV(location, retry)
        from mgrpo_jax.store.tasks import TaskQueue

        self.tasks = TaskQueue(self)

    def __repr__(self) -> str:
        return f"Store({self.url!r})"

    # -- step data -------------------------------------------------------------------------------------
    @staticmethod
    def _step_base(step: int, producer: str) -> str:
        return f"steps/{step_dir(step)}/{check_name('producer', producer)}/"

    def _read_commit(self, step: int, producer: str) -> dict | None:
        key = self._step_base(step, producer) + "commit.json"
        raw, _ = self.kv.read(key)
        return None if raw is None else unseal(raw, url=self.url, key=key)

    def step_writer(self, step: int, producer: str, policy_version: int) -> StepWriter:
        """A writer for ``producer``'s data of ``step``; nothing is visible to readers until ``commit()``."""
        return StepWriter(self, step, producer, policy_version)

    def is_committed(self, step: int, producer: str) -> bool:
        return self._read_commit(step, producer) is not None

    def read_step(self, step: int, producer: str) -> StepView:
        """The committed data of ``step`` by ``producer``; StoreTimeout at once if not committed."""
        return self.wait_step(step, producer, timeout_s=0.0)

    def wait_step(self, step: int, producer: str, timeout_s: float) -> StepView:
        """Waits (polling with back-off) for the commit marker of ``step`` by ``producer``.

        Raises StoreTimeout naming the step, producer and marker key if it does not appear in time.
        """
        manifest = poll_until(lambda: self._read_commit(step, producer), timeout_s, self.poll)
        if manifest is None:
            key = self._step_base(step, producer) + "commit.json"
            raise StoreTimeout(
                f"timed out after {timeout_s:g}s waiting for step {step} of producer {producer!r} to be "
                f"committed: missing commit marker {self.url}{key}",
                url=self.url,
                missing=(key,),
            )
        return StepView(self, step, producer, manifest)

    def committed_steps(self, producer: str) -> list[int]:
        """Steps with a commit marker by ``producer``, ascending."""
        check_name("producer", producer)
        return [s for s in self.steps("steps") if self.is_committed(s, producer)]

    # -- listing and garbage collection ----------------------------------------------------------------
    def steps(self, area: str | None = None) -> list[int]:
        """Step numbers that have any data in ``area`` (``"steps"``, ``"tasks"``, or both when None)."""
        areas = AREAS if area is None else (area,)
        found: set[int] = set()
        for a in areas:
            if a not in AREAS:
                raise ValueError(f"unknown store area {a!r}; expected one of {AREAS}")
            for name in self._list_children(a + "/"):
                if _STEP_RE.match(name):
                    found.add(int(name))
        return sorted(found)

    def _list_children(self, prefix: str) -> list[str]:
        """Immediate child names under ``prefix``; on GCS a delimiter listing through gcsfs."""
        if self.location.scheme == "gs":
            return self.kv._retry(lambda: _gcs_children(self.location, prefix), "list", prefix)
        names = {key[len(prefix) :].split("/", 1)[0] for key in self.kv.list_prefix(prefix)}
        return sorted(n for n in names if n)

    def delete_step(self, step: int) -> int:
        """Deletes all of ``step`` (step data and tasks) under this store's root; returns keys deleted."""
        count = 0
        for area in AREAS:
            prefix = f"{area}/{step_dir(step)}/"
            count += self.kv.delete_prefix(prefix)
            if self.location.scheme == "file":
                _remove_empty_dirs(self.location.root + prefix)
        return count

    def gc(self, *, keep_last: int | None = None, before_step: int | None = None) -> list[int]:
        """Deletes old steps inside this store's prefix only; returns the deleted step numbers.

        ``keep_last=N`` keeps the N newest steps present; ``before_step=s`` deletes every step < s. With
        both, a step is deleted when either rule says so. Keys outside ``steps/`` and ``tasks/`` (FIFOs)
        and anything outside the store's root are never touched.
        """
        if keep_last is None and before_step is None:
            raise ValueError("gc needs keep_last and/or before_step")
        present = self.steps()
        doomed: set[int] = set()
        if keep_last is not None:
            check_int("keep_last", keep_last, 2**62)
            doomed.update(present[: max(0, len(present) - keep_last)])
        if before_step is not None:
            check_int("before_step", before_step, 2**62)
            doomed.update(s for s in present if s < before_step)
        for step in sorted(doomed):
            self.delete_step(step)
        return sorted(doomed)

    # -- FIFOs -----------------------------------------------------------------------------------------
    def fifo(self, name: str):
        """The FIFO called ``name`` (see :class:`mgrpo_jax.store.fifo.Fifo`)."""
        from mgrpo_jax.store.fifo import Fifo

        return Fifo(self, name)


class StepWriter:
    """Writes one producer's data for one step; ``commit()`` makes it visible atomically.

    Keys are deterministic, so re-writing (a retry, or a restarted producer redoing the step) overwrites
    the same objects rather than adding copies. Once the step is committed it is frozen: later puts are
    ignored (return False) and ``commit()`` returns the existing manifest.
    """

    def __init__(self, store: Store, step: int, producer: str, policy_version: int):
        self.store = store
        self.step = check_int("step", step, 10**10)
        self.producer = check_name("producer", producer)
        self.policy_version = check_int("policy_version", policy_version, 2**62)
        self._base = Store._step_base(step, producer)
        self._manifest = store._read_commit(step, producer)
        self._arrays: dict[str, dict] = {}
        self._records: dict[str, set[str]] = {}

    @property
    def committed(self) -> bool:
        return self._manifest is not None

    def put_array(self, name: str, value, *, shape: Sequence[int | None] | None = None, dtype=None) -> bool:
        """Writes a numeric array (checked against ``shape``/``dtype`` if given); False if committed."""
        check_name("array name", name)
        arr = _arrays.check_array(name, value, shape=shape, dtype=dtype)
        if self.committed:
            return False
        _arrays.write_array(self.store.kv, f"{self._base}arrays/{name}", arr)
        self._arrays[name] = _arrays.array_meta(arr)
        return True

    def put_records(self, records: Iterable[Record]) -> int:
        """Writes records of this step (concurrently); returns how many were written (0 if committed)."""
        records = list(records)
        for rec in records:
            if not isinstance(rec, Record):
                raise ValueError(f"put_records expects Record objects, got {type(rec).__name__}")
            if rec.step != self.step:
                raise ValueError(
                    f"record {rec.kind}/{rec.id} has step {rec.step}, writer is for step {self.step}"
                )
        if self.committed or not records:
            return 0
        items = {f"{self._base}records/{r.kind}/{r.id}.json": r.encode() for r in records}
        self.store.kv.write_many(items.items())
        for rec in records:
            self._records.setdefault(rec.kind, set()).add(rec.id)
        return len(items)

    def put_record(
        self,
        kind: str,
        query: int,
        rollout: int,
        invocation: int,
        payload: Mapping,
        *,
        policy_version: int | None = None,
    ) -> bool:
        """Writes one record of this step (``policy_version`` defaults to the writer's)."""
        version = self.policy_version if policy_version is None else policy_version
        rec = Record(kind, self.step, query, rollout, invocation, version, dict(payload))
        return self.put_records([rec]) == 1

    def commit(self, meta: Mapping | None = None) -> dict:
        """Writes the commit marker (the manifest of everything put); returns the manifest.

        The marker is created only if absent, so a retried commit is harmless and the first commit wins.
        """
        if self._manifest is not None:
            return self._manifest
        manifest = {
            "step": self.step,
            "producer": self.producer,
            "policy_version": self.policy_version,
            "arrays": self._arrays,
            "records": {kind: sorted(ids) for kind, ids in sorted(self._records.items())},
            "meta": dict(meta or {}),
            "time": time.time(),
        }
        key = self._base + "commit.json"
        sealed = seal(manifest)
        if not self.store.kv.create(key, sealed):
            existing, _ = self.store.kv.read(key)
            self._manifest = unseal(existing, url=self.store.url, key=key)
            return self._manifest
        self._manifest = unseal(sealed)
        return self._manifest


class StepView:
    """Read access to one committed step of one producer (what its commit manifest lists)."""

    def __init__(self, store: Store, step: int, producer: str, manifest: dict):
        self.store = store
        self.step = step
        self.producer = producer
        self.manifest = manifest
        self.policy_version: int = manifest["policy_version"]
        self.meta: dict = manifest.get("meta", {})
        self._base = Store._step_base(step, producer)

    @property
    def array_names(self) -> list[str]:
        return sorted(self.manifest["arrays"])

    def array(self, name: str, *, shape: Sequence[int | None] | None = None, dtype=None) -> np.ndarray:
        """Reads an array; checks it against the manifest (checksum) and the expected ``shape``/``dtype``."""
        if name not in self.manifest["arrays"]:
            raise KeyError(
                f"step {self.step} of producer {self.producer!r} has no array {name!r} "
                f"(has {self.array_names}) [{self.store.url}{self._base}]"
            )
        arr = _arrays.read_array(self.store.kv, f"{self._base}arrays/{name}", self.manifest["arrays"][name])
        return _arrays.check_array(name, arr, shape=shape, dtype=dtype)

    def record_ids(self, kind: str) -> list[str]:
        return list(self.manifest["records"].get(kind, []))

    def records(self, kind: str) -> list[Record]:
        """All records of ``kind`` in id order (query, rollout, invocation)."""
        ids = self.record_ids(kind)
        keys = [f"{self._base}records/{kind}/{rid}.json" for rid in ids]
        out = []
        for key, raw in zip(keys, self.store.kv.read_many(keys), strict=True):
            if raw is None:
                raise StoreError(
                    "record listed in the commit manifest is missing", url=self.store.url, key=key
                )
            out.append(Record.decode(raw, url=self.store.url, key=key))
        return out


def _gcs_children(location: StoreLocation, prefix: str) -> list[str]:
    import gcsfs  # imported late: emulator settings must be in the environment first

    token = "anon" if os.environ.get("STORAGE_EMULATOR_HOST") else None
    fs = gcsfs.GCSFileSystem(token=token, skip_instance_cache=True, use_listings_cache=False)
    base = f"{location.bucket}/{location.root}{prefix}".rstrip("/")
    try:
        entries = fs.ls(base, detail=False)
    except FileNotFoundError:
        return []
    return sorted({e.rstrip("/").rsplit("/", 1)[-1] for e in entries})


def _remove_empty_dirs(path: str) -> None:
    """Best effort: removes empty directories left under ``path`` after a file-store delete."""
    if not os.path.isdir(path):
        return
    for dirpath, _dirs, _files in sorted(os.walk(path, topdown=False), key=lambda t: -len(t[0])):
        try:
            os.rmdir(dirpath)
        except OSError:
            pass


def open_store(url: str, *, retry: RetryPolicy | None = None, poll: PollPolicy | None = None) -> Store:
    """Opens the store at ``url`` (``memory://name``, ``file:///abs/path`` or ``gs://bucket/prefix``).

    Raises ValueError naming the URL if it is malformed or has an unknown scheme.
    """
    return Store(parse_store_url(url), retry=retry or RetryPolicy(), poll=poll or PollPolicy())
