"""Episodes -> the fixed-size, aligned arrays the jitted train steps take.

Main (or single) agent: exactly Q*K rows. Sub-agent: exactly Q*K*D rows, aligned by
`mgrpo_jax.core.align` (duplicates / drops / masked d_k = 0 rollouts), with an index map back to
(query, rollout, invocation). Every row is right-padded to the agent's `seq_len`.

Every policy batch carries its rows' sampling settings, taken from their episodes (`Episode.temperature`,
`top_k`, `top_p`: what the rollout engine drew them with, whatever the config says): a `temperature` column
[rows] float32, which the train step reads to recompute the behaviour log-probs under the same distribution
(mgrpo_jax/agent/step.py), and `top_k` / `top_p` columns, which the learner checks against its step's (static)
filters before training.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from mgrpo_jax.core import gather_aligned
from mgrpo_jax.rollout.episode import Episode

# `versions`: each token's policy version (float32, exact for versions below 2**24; docs/async.md).
PAD_VALUES = {"tokens": 0, "loss_mask": 0.0, "old_logprobs": 0.0, "versions": 0.0}
TIME_COLUMNS = ("tokens", "positions", "attention_mask", "loss_mask", "old_logprobs", "versions")  # [rows, seq_len]
TOKEN_OR_ROW_COLUMNS = ("advantages",)  # [rows] or, per token (an asynchronous run's corrected ones), [rows, seq_len]


def bucket_length(lengths, limit: int, multiple: int = 128) -> int:
    """Pad a batch to its longest row rounded up to `multiple`, capped at `limit` (the context budget): far
    less padding than always using `limit`, and only limit / multiple shapes for the train steps to compile."""
    longest = max([int(n) for n in lengths] or [1])
    return min(int(limit), -(-longest // multiple) * multiple)


def _clipped(episode: Episode, seq_len: int) -> dict[str, np.ndarray]:
    arrays = episode.arrays()
    if len(episode.tokens) > seq_len:
        if arrays["loss_mask"][seq_len:].any():
            raise ValueError(
                f"{episode.agent} episode (question {episode.question_index}, rollout {episode.rollout}) has "
                f"generated tokens beyond seq_len={seq_len}; raise seq_len to the agent's context budget"
            )
        # Only the untrained tail (a tool response after the context filled) is cut.
        arrays = {name: values[:seq_len] for name, values in arrays.items()}
    return arrays


def _finish(batch: dict[str, np.ndarray], pad_id: int) -> dict[str, np.ndarray]:
    rows, seq_len = batch["tokens"].shape
    lengths = np.asarray([_length(row_mask) for row_mask in batch.pop("_real")], np.int32)
    positions = np.broadcast_to(np.arange(seq_len, dtype=np.int32), (rows, seq_len)).copy()
    batch["attention_mask"] = positions < lengths[:, None]
    batch["positions"] = positions
    batch["tokens"] = np.where(batch["attention_mask"], batch["tokens"], pad_id).astype(np.int32)
    return batch


def _length(real: np.ndarray) -> int:
    return int(real.sum())


SAMPLING_COLUMNS = ("temperature", "top_k", "top_p")


def _sampling(episodes: Sequence[Episode | None]) -> dict[str, np.ndarray]:
    """Each row's sampling settings, from its episode (a padding row, None, gets temperature 1 and no filters)."""
    defaults = Episode("", 0, 0)
    rows = [e if e is not None else defaults for e in episodes]
    return {"temperature": np.asarray([e.temperature for e in rows], np.float32),
            "top_k": np.asarray([e.top_k for e in rows], np.int32),
            "top_p": np.asarray([e.top_p for e in rows], np.float32)}


def top_batch(top: Sequence[Sequence[Episode]], advantages, seq_len: int, pad_id: int = 0) -> dict[str, np.ndarray]:
    """[Q*K, seq_len] rows of the top-level episodes, with their [Q*K] advantages, unit weights and each row's
    sampling settings (`temperature`, `top_k`, `top_p`: what its episode was drawn with)."""
    rows = [e for row in top for e in row]
    out = {name: np.full((len(rows), seq_len), value, np.float32 if name != "tokens" else np.int32)
           for name, value in PAD_VALUES.items()}
    real = np.zeros((len(rows), seq_len), bool)
    for i, episode in enumerate(rows):
        for name, values in _clipped(episode, seq_len).items():
            out[name][i, : len(values)] = values
        real[i, : min(len(episode.tokens), seq_len)] = True
    out["_real"] = real
    out["advantages"] = np.asarray(advantages, np.float32).reshape(len(rows))
    out["weights"] = np.ones((len(rows),), np.float32)
    out.update(_sampling(rows))
    return _finish(out, pad_id)


def sub_batch(top: Sequence[Sequence[Episode]], index, weight, advantages, seq_len: int,
              pad_id: int = 0) -> dict[str, np.ndarray]:
    """[Q*K*D, seq_len] aligned sub-agent rows; `index`/`weight`/`advantages` are [Q, K, D]; each row's sampling
    settings come from the sub-episode its slot holds."""
    calls = [[[dict(_clipped(sub, seq_len), _real=np.ones(len(sub.tokens[:seq_len]), bool)) for sub in e.subs]
              for e in row] for row in top]
    out = gather_aligned(calls, index, weight, seq_len, pad_values={**PAD_VALUES, "_real": False})
    out["advantages"] = np.asarray(advantages, np.float32).reshape(-1) * (out["weight"] > 0)
    out["weights"] = out.pop("weight")
    out.update(_sampling([top[q][k].subs[i] if i >= 0 else None for q, k, i in out["source"]]))
    return _finish(out, pad_id)


def sft_rows(examples: Sequence[tuple[Sequence[int], Sequence[bool]]], seq_len: int,
             pad_id: int = 0) -> dict[str, np.ndarray]:
    """Rendered (ids, assistant_mask) demonstrations -> an SFT batch; over-long ones are truncated."""
    rows = len(examples)
    tokens = np.full((rows, seq_len), pad_id, np.int32)
    loss_mask = np.zeros((rows, seq_len), np.float32)
    lengths = np.zeros((rows,), np.int32)
    for i, (ids, mask) in enumerate(examples):
        n = min(len(ids), seq_len)
        tokens[i, :n] = ids[:n]
        loss_mask[i, :n] = np.asarray(mask[:n], np.float32)
        lengths[i] = n
    positions = np.broadcast_to(np.arange(seq_len, dtype=np.int32), (rows, seq_len)).copy()
    return {"tokens": tokens, "positions": positions, "attention_mask": positions < lengths[:, None],
            "loss_mask": loss_mask, "weights": np.ones((rows,), np.float32)}


def record_rows(payloads: Sequence[dict], advantages, seq_len: int, pad_id: int = 0) -> dict[str, np.ndarray]:
    """Policy rows from stored trajectories (the unsynchronised sub-agent's FIFO records): each payload has
    `tokens`, `loss_mask`, `old_logprobs` and the sampling settings (`temperature`, `top_k`, `top_p`; temperature
    1 without filters when absent); `advantages` is one per payload.
    Over-long trajectories are truncated to `seq_len`."""
    rows = sft_rows([(p["tokens"], p["loss_mask"]) for p in payloads], seq_len, pad_id)
    rows["old_logprobs"] = np.zeros_like(rows["loss_mask"])
    for i, p in enumerate(payloads):
        n = min(len(p["old_logprobs"]), seq_len)
        rows["old_logprobs"][i, :n] = p["old_logprobs"][:n]
    rows["advantages"] = np.asarray(advantages, np.float32).reshape(len(payloads))
    rows.update({"temperature": np.asarray([p.get("temperature", 1.0) for p in payloads], np.float32),
                 "top_k": np.asarray([p.get("top_k", 0) for p in payloads], np.int32),
                 "top_p": np.asarray([p.get("top_p", 1.0) for p in payloads], np.float32)})
    return rows


def concat_rows(parts: Sequence[dict[str, np.ndarray]], pad_id: int = 0) -> dict[str, np.ndarray]:
    """Policy batches of one model stacked into one (a shared-policy mode's main rows and sub rows): every row is
    right-padded to the longest part's length (the padding trains nothing: no loss mask, no attention), and only
    the columns every part has are kept."""
    length = max(part["tokens"].shape[1] for part in parts)
    keys = [key for key in parts[0] if all(key in part for part in parts)]

    def widened(key: str, values: np.ndarray) -> np.ndarray:
        per_token = key in TIME_COLUMNS or (key in TOKEN_OR_ROW_COLUMNS and values.ndim == 2)
        extra = length - values.shape[1] if per_token else 0
        if not extra:
            return values
        if key == "positions":
            tail = np.broadcast_to(np.arange(values.shape[1], length, dtype=values.dtype), (len(values), extra))
        else:
            tail = np.full((len(values), extra), pad_id if key == "tokens" else 0, values.dtype)
        return np.concatenate([values, tail], axis=1)

    return {key: np.concatenate([widened(key, part[key]) for part in parts]) for key in keys}


def pad_rows(rows: dict[str, np.ndarray], count: int, pad_id: int = 0) -> dict[str, np.ndarray]:
    """`rows` grown to `count` rows with padding rows that train nothing (weight 0, no trained token, advantage
    0, temperature 1): a batch of fewer records in a train step compiled for `count` rows."""
    n = len(rows["weights"])
    if n > count:
        raise ValueError(f"{n} rows do not fit a batch of {count}")
    fill = {"tokens": pad_id, "temperature": 1.0, "top_p": 1.0}
    return {key: np.concatenate([value, np.full((count - n, *value.shape[1:]), fill.get(key, 0), value.dtype)])
            for key, value in rows.items()}
