"""Questions served through grain: shuffled per epoch, repeated, batched, with a checkpointable iterator.

The iterator's `get_state()` is a small dict (the position in the seeded stream) that goes into the
training checkpoint; `set_state()` on a fresh iterator over the same questions resumes exactly.
"""

from __future__ import annotations

from collections.abc import Sequence

import grain

from mgrpo_jax.env.questions import Question


def question_dataset(
    questions: Sequence[Question],
    *,
    batch_size: int,
    seed: int,
    shuffle: bool = True,
    num_epochs: int | None = None,
    drop_remainder: bool = True,
) -> grain.MapDataset:
    """Batches (tuples) of questions; `num_epochs=None` repeats forever, reshuffling every epoch."""
    if not questions:
        raise ValueError("no questions to serve")
    if batch_size < 1:
        raise ValueError(f"batch_size must be positive, got {batch_size}")
    dataset = grain.MapDataset.source(list(questions))
    if shuffle:
        dataset = dataset.shuffle(seed=seed)
    dataset = dataset.repeat(num_epochs)
    return dataset.batch(batch_size, drop_remainder=drop_remainder, batch_fn=tuple)


def question_iterator(
    questions: Sequence[Question], *, batch_size: int, seed: int, shuffle: bool = True,
    num_epochs: int | None = None, drop_remainder: bool = True,
) -> grain.DatasetIterator:
    """An iterator over `question_dataset(...)` with `get_state()` / `set_state()`.

    Batches are produced in the calling thread (no prefetch threads): questions are tiny, and a
    background reader would only compete with the rollout loop for CPU.
    """
    dataset = question_dataset(
        questions, batch_size=batch_size, seed=seed, shuffle=shuffle, num_epochs=num_epochs,
        drop_remainder=drop_remainder,
    )
    return iter(dataset.to_iter_dataset(grain.ReadOptions(num_threads=0, prefetch_buffer_size=0)))
