"""Per-step numeric tensors as zarr arrays through TensorStore (validated shape and dtype, sha256-checked)."""

from __future__ import annotations

import hashlib
from collections.abc import Sequence

import numpy as np
import tensorstore as ts

from mgrpo_jax.store import kv as _kv
from mgrpo_jax.store.errors import CorruptRecordError
from mgrpo_jax.store.kv import KV, shared_context

ALLOWED_DTYPES = tuple(
    np.dtype(name)
    for name in (
        "bool",
        "int8",
        "int16",
        "int32",
        "int64",
        "uint8",
        "uint16",
        "uint32",
        "uint64",
        "float16",
        "float32",
        "float64",
    )
)


def _shape_matches(shape: tuple[int, ...], expected: Sequence[int | None]) -> bool:
    return len(shape) == len(expected) and all(
        e is None or e == s for s, e in zip(shape, expected, strict=True)
    )


def check_array(name: str, value, *, shape: Sequence[int | None] | None = None, dtype=None) -> np.ndarray:
    """Validates a numeric array (``None`` in ``shape`` matches any size); returns it little-endian, C-order.

    Raises ValueError naming the array for a non-numeric dtype, a dtype other than ``dtype``, or a shape
    other than ``shape``.
    """
    arr = np.asarray(value)
    if arr.dtype not in ALLOWED_DTYPES:
        allowed = ", ".join(str(d) for d in ALLOWED_DTYPES)
        raise ValueError(f"array {name!r}: unsupported dtype {arr.dtype} (allowed: {allowed})")
    if dtype is not None and arr.dtype != np.dtype(dtype):
        raise ValueError(f"array {name!r}: dtype {arr.dtype}, expected {np.dtype(dtype)}")
    if shape is not None and not _shape_matches(arr.shape, tuple(shape)):
        raise ValueError(f"array {name!r}: shape {arr.shape}, expected {tuple(shape)}")
    return np.require(arr.astype(arr.dtype.newbyteorder("<"), copy=False), requirements="C")


def digest(arr: np.ndarray) -> str:
    return hashlib.sha256(np.require(arr, requirements="C").tobytes()).hexdigest()


def array_meta(arr: np.ndarray) -> dict:
    return {"shape": list(arr.shape), "dtype": arr.dtype.str, "sha256": digest(arr)}


def write_array(kv: KV, key: str, arr: np.ndarray) -> None:
    """Writes ``arr`` as a zarr v2 array under ``key/`` (one chunk), replacing a crashed writer's leftover."""
    spec = {
        "driver": "zarr",
        "kvstore": kv.location.kvstore_spec(key + "/"),
        "metadata": {
            "shape": list(arr.shape),
            "chunks": [max(1, d) for d in arr.shape],
            "dtype": arr.dtype.str,
            "compressor": None,
        },
    }

    def attempt():
        try:
            dst = ts.open(spec, create=True, context=shared_context()).result()
        except ValueError as exc:
            if "ALREADY_EXISTS" not in str(exc):
                raise
            # A previous attempt (crashed before its commit) left an array here: drop it, key by key.
            kv.delete_prefix(key + "/")
            dst = ts.open(spec, create=True, context=shared_context()).result()
        dst.write(arr).result()

    if _kv._OBSERVERS:
        for observer in tuple(_kv._OBSERVERS):
            observer.on_array_write(key, arr.nbytes)
    kv._retry(attempt, "array write", key + "/")


def read_array(kv: KV, key: str, meta: dict) -> np.ndarray:
    """Reads the zarr array under ``key/`` and checks it against its commit-manifest entry ``meta``."""
    spec = {"driver": "zarr", "kvstore": kv.location.kvstore_spec(key + "/")}
    try:
        arr = kv._retry(
            lambda: ts.open(spec, open=True, context=shared_context()).result().read().result(),
            "array read",
            key + "/",
        )
    except Exception as exc:
        if "NOT_FOUND" in str(exc) or "FAILED_PRECONDITION" in str(exc) or "DATA_LOSS" in str(exc):
            raise CorruptRecordError(
                f"committed array is missing or unreadable: {exc}", url=kv.url, key=key + "/"
            ) from exc
        raise
    arr = np.asarray(arr)
    if (
        list(arr.shape) != list(meta["shape"])
        or arr.dtype.str != meta["dtype"]
        or digest(arr) != meta["sha256"]
    ):
        raise CorruptRecordError(
            f"array does not match its commit manifest (shape {arr.shape} dtype {arr.dtype.str}, "
            f"manifest {meta})",
            url=kv.url,
            key=key + "/",
        )
    if _kv._OBSERVERS:
        for observer in tuple(_kv._OBSERVERS):
            observer.on_array_read(key, arr.nbytes)
    return arr
