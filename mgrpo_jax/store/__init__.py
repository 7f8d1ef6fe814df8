"""The shared store: cross-agent records on TensorStore, addressed by URL (memory://, file://, gs://).

See :mod:`mgrpo_jax.store.store` for the key layout and :func:`open_store` to start.
"""

from mgrpo_jax.store.errors import (
    ConflictError,
    CorruptRecordError,
    StoreError,
    StoreTimeout,
    TransientStoreError,
)
from mgrpo_jax.store.fifo import Fifo, FifoConsumer
from mgrpo_jax.store.kv import StoreObserver, observe
from mgrpo_jax.store.records import Record, parse_record_id, record_id
from mgrpo_jax.store.retry import PollPolicy, RetryPolicy
from mgrpo_jax.store.store import StepView, StepWriter, Store, open_store
from mgrpo_jax.store.tasks import TaskQueue
from mgrpo_jax.store.url import StoreLocation, parse_store_url

__all__ = [
    "ConflictError",
    "CorruptRecordError",
    "Fifo",
    "FifoConsumer",
    "PollPolicy",
    "Record",
    "RetryPolicy",
    "StepView",
    "StepWriter",
    "Store",
    "StoreError",
    "StoreLocation",
    "StoreObserver",
    "StoreTimeout",
    "TaskQueue",
    "TransientStoreError",
    "observe",
    "open_store",
    "parse_record_id",
    "parse_store_url",
    "record_id",
]
