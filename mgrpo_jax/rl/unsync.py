"""The unsynchronised ablation (`mode = "mgrpo_unsync"`): the sub-agent trains from a
FIFO of its trajectories, grouped by arrival rather than by query, as the authors' released code does.

One function, `unsync_step`, is the whole sub-agent side of an RL step in this mode; the run loop calls it from
`mgrpo_jax/rl/sides.py: UnsyncSubSide.rows`, colocated or in the decoupled sub job alike.

**Push.** Every real sub-trajectory of the step goes to the FIFO once: each (query, rollout, invocation)
with its own R_S, no alignment (no duplicates for d_k < D, nothing dropped for d_k > D: alignment is the
synchronised mode's device). Before `Fifo.append` the step's records are put in a seeded random order
(`arrival_order`), standing in for the order in which asynchronous workers finish them; without it they
would arrive query by query and the arrival groups below would still be query groups.

**Pop: fixed chunks, as many as are waiting.** The sub's train step is compiled for a fixed row count,
`rollout.unsync_chunk` (`batch_rows`), so a pop is always one chunk of that many records, and every
RL step pops *every* full chunk waiting (`floor(backlog / chunk)`) and runs one update (times `passes`) on
each, oldest first. Over any run the records popped equal the records pushed up to a residual below one
chunk: the backlog after a step is always `< chunk`, however the push counts vary (d_k changes from step to
step), so the sub-agent never falls ever further behind and staleness stays bounded. This is the released
code's rule too (train whenever a full batch is buffered). The alternatives were worse: a chunk count from a
running mean of pushes lags behind any trend in d_k and lets the backlog drift; an adaptive chunk padded
with weight-0 rows to the compiled size spends compute on padding and changes the update's batch size from
step to step.

**Pop: one step's records, at equal work (`rollout.unsync_pop = "step"`).** The chunk rule trains the FIFO's
sub-agent more often than the synchronised one (2.5 chunks per RL step in the figures' runs), so a comparison of
the two modes also compares amounts of training. Under "step", each RL step first pops every record waiting --
exactly the previous step's pushes -- and then pushes its own: one update (times `passes`) per step on the same
number of real sub-trajectories the synchronised mode trains on, in its compiled batch (Q*K*D rows, the rest
weight-0 padding; records beyond Q*K*D wait for the next step, as the synchronised mode drops calls beyond D).
Only the pairing differs: the sub-agent learns from the main agent's previous step, grouped by arrival.

**Groups by arrival.** Consecutive `group` (= `rollout.samples`) records of a chunk form one z-score group,
without regard to query (`arrival_advantages`); a trailing group shorter than `group` (a chunk that is not a
multiple of it) is scored over its own members, so no record is wasted.

**Staleness.** `sub/staleness` is the mean over the popped records of (the sub policy's version when the
record's chunk is trained) - (the version that sampled it); chunk i of a step is trained at version
`start_version + i * passes` (every train-step call advances the version by one). `sub/fifo_backlog` is
the number of records left waiting after the step's pops.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence

import numpy as np

from mgrpo_jax.core import group_advantages
from mgrpo_jax.rollout import batches
from mgrpo_jax.store import Record

RECORD_KIND = "sub_trajectory"


def step_records(rollout, call_reward, step: int, versions) -> list[Record]:
    """Every real sub-trajectory of the step as a FIFO record, in (query, rollout, invocation) order.

    `call_reward` [Q, K, C] is each raw call's R_S (`Targets.sub_call_reward`: no alignment, every call once).
    `versions` is the sub policy version that sampled each trajectory: one int for all, or a mapping
    (query, rollout, invocation) -> version. Payload: tokens, loss_mask, old_logprobs, the sampling settings the
    episode was drawn with (temperature, top_k, top_p), reward.
    """
    call_reward = np.asarray(call_reward)
    out = []
    for qi, row in enumerate(rollout.top):
        for ki, episode in enumerate(row):
            for j, sub in enumerate(episode.subs):
                version = versions if isinstance(versions, int | np.integer) else versions[(qi, ki, j)]
                out.append(Record(RECORD_KIND, int(step), qi, ki, j, int(version), {
                    "tokens": list(sub.tokens), "loss_mask": list(sub.loss_mask),
                    "old_logprobs": list(sub.logprobs), "temperature": float(sub.temperature),
                    "top_k": int(sub.top_k), "top_p": float(sub.top_p),
                    "reward": float(call_reward[qi, ki, j])}))
    return out


def arrival_order(n: int, seed: int) -> np.ndarray:
    """The seeded random order in which a step's `n` records enter the FIFO (a permutation of range(n))."""
    return np.random.default_rng(seed).permutation(n)


def push(fifo, records: Sequence[Record], seed: int) -> int:
    """Appends the step's records to the FIFO in `arrival_order`; returns how many were new."""
    return fifo.append([records[i] for i in arrival_order(len(records), seed)])


def chunks_to_pop(backlog: int, chunk: int) -> int:
    """Full chunks to pop now: every one waiting (keeps the backlog below one chunk)."""
    if chunk < 1:
        raise ValueError(f"unsync_chunk must be >= 1, got {chunk}")
    return max(int(backlog), 0) // int(chunk)


def pop_chunks(consumer, chunk: int, timeout_s: float = 5.0) -> tuple[list[list[Record]], int]:
    """Pops every full chunk waiting in one store transaction; returns (chunks oldest first, backlog left)."""
    backlog = consumer.backlog()
    n = chunks_to_pop(backlog, chunk)
    if n == 0:
        return [], backlog
    popped = consumer.pop(n * chunk, timeout_s=timeout_s)
    return [popped[i * chunk:(i + 1) * chunk] for i in range(n)], backlog - n * chunk


def arrival_advantages(rewards_, group: int, estimator=None, **adv_kw) -> np.ndarray:
    """Advantages of records in arrival order: consecutive runs of `group` records form one group of `estimator`
    (`fn(rewards [G, N], weights [G, N])`, e.g. `TargetsConfig.advantages`; default `core.group_advantages`
    with `adv_kw`); a shorter trailing run is scored over its own members."""
    r = np.asarray(rewards_, np.float32).reshape(-1)
    n = r.size
    if n == 0:
        return np.zeros(0, np.float32)
    group = int(group)
    if group < 1:
        raise ValueError(f"group size must be >= 1, got {group}")
    groups = -(-n // group)
    padded = np.zeros(groups * group, np.float32)
    padded[:n] = r
    valid = (np.arange(groups * group) < n).astype(np.float32)
    estimator = estimator or functools.partial(group_advantages, **adv_kw)
    adv = estimator(padded.reshape(groups, group), valid.reshape(groups, group))
    return np.asarray(adv).reshape(-1)[:n].astype(np.float32)


def staleness(chunks: Sequence[Sequence[Record]], start_version: int, passes: int = 1) -> float:
    """Mean policy-version gap of the popped records: chunk i is trained at `start_version + i * passes`."""
    gaps = [start_version + i * passes - r.policy_version for i, chunk in enumerate(chunks) for r in chunk]
    return float(np.mean(gaps)) if gaps else 0.0


def pop_step(consumer, rows: int, timeout_s: float = 5.0) -> tuple[list[list[Record]], int]:
    """Pops every record waiting, up to one batch of `rows` (the "step" rule); returns ([records] or [], backlog)."""
    backlog = consumer.backlog()
    n = min(int(backlog), int(rows))
    if n == 0:
        return [], backlog
    return [consumer.pop(n, timeout_s=timeout_s)], backlog - n


def unsync_step(fifo, consumer, records: Sequence[Record], *, chunk: int, group: int, seed: int,
                start_version: int, passes: int, seq_len_limit: int, pad_id: int, advantages=None,
                timeout_s: float = 5.0, pop: str = "chunks", rows: int = 0) -> tuple[list[dict], dict]:
    """Push the step's records (shuffled), pop every full chunk, score each chunk's arrival groups; with
    `pop="step"`, pop the previous step's records first (at most `rows`, padded to `rows` with weight-0 rows),
    then push.

    `advantages`: the estimator over [G, N] groups (default: `core.group_advantages`). Returns (one policy batch
    per chunk, oldest first, each with `chunk` rows and a `temperature` column; metrics: `sub/fifo_pushed`,
    `sub/fifo_popped`, `sub/fifo_backlog`, `sub/unsync_chunks`, and `sub/staleness` when something was popped).
    """
    if pop == "step":
        chunks, backlog = pop_step(consumer, rows, timeout_s)
        pushed = push(fifo, records, seed)
        backlog += pushed
    else:
        pushed = push(fifo, records, seed)
        chunks, backlog = pop_chunks(consumer, chunk, timeout_s)
    metrics = {"sub/fifo_pushed": float(pushed), "sub/fifo_popped": float(sum(len(c) for c in chunks)),
               "sub/fifo_backlog": float(backlog), "sub/unsync_chunks": float(len(chunks))}
    if not chunks:
        return [], metrics
    metrics["sub/staleness"] = staleness(chunks, start_version, passes)
    out = []
    for popped in chunks:
        payloads = [r.payload for r in popped]
        adv = arrival_advantages([p["reward"] for p in payloads], group, advantages)
        seq_len = batches.bucket_length([len(p["tokens"]) for p in payloads], seq_len_limit)
        batch = batches.record_rows(payloads, adv, seq_len, pad_id)
        out.append(batches.pad_rows(batch, rows, pad_id) if pop == "step" else batch)
    return out, metrics
