"""Store benchmark (issue 6 part 5): the decoupled mode's per-step exchange through the shared store.

    python -m mgrpo_jax.bench.store                      # paper sizes on file://; share of a local-preset step
                                                         # (measured by a short local run): a few minutes
    python -m mgrpo_jax.bench.store --full               # also the GCS emulator; the step measured as
                                                         # bench.rollout --full measures it
    python -m mgrpo_jax.bench.store --metrics runs/xbench-local/metrics.jsonl   # step time from a run's metrics
    python -m mgrpo_jax.bench.store --step-s 3.2         # or a step time measured elsewhere
    python -m mgrpo_jax.bench.store --backends file --fifo-backends file   # file:// only (no emulator)
    python -m mgrpo_jax.bench.store --quick               # the code path in tens of seconds

**What one step moves.** The benchmark replays, through the real store API and in the decoupled mode's order,
what `mgrpo_jax/rl/decoupled.py` writes and reads per RL step, with the main job's and the sub job's
calls on two separate `Store` handles (run one after the other in this process, as the two jobs take turns):

1. ``tasks``: ``--rounds`` delegation rounds (default D: every rollout delegates D times), each sent in
   ``--split`` engine rounds (``--share-split`` at the preset's sizes, default 2: a `local` step's two delegation
   turns reach the store in 4 engine rounds, the slot engine sending each decode round's new delegations); in each
   engine round the main posts its share of the Q·K delegation tasks as one batch (``TaskQueue.post_batch``),
2. ``serve``: the sub job claims the batch (``TaskQueue.claim_batches``: two listings, one conditional lease, one
   read) and posts its answers as one object (``answer_batch``),
3. ``answers``: the main reads them back (``wait_batch``); with ``--per-task`` phases 1-3 replay the exchange
   before batching (one object per task, lease and answer: ``post``, ``claim``, ``post_answers``,
   ``wait_answers``);
4. ``main_commit``: the main commits ``main_format_ok`` and ``main_correct`` [Q, K] bool, ``main_reward`` [Q, K]
   f32 and ``sub_counts`` [Q, K] int32 behind its commit marker,
5. ``sub_read``: the sub sees the marker and reads ``sub_counts``, ``main_correct`` and ``main_format_ok``,
6. ``fifo`` (the unsynchronised ablation only): the sub appends the step's Q·K·D sub-trajectories (token
   ids, loss mask, behaviour log-probs, reward) to the FIFO and pops them in ``unsync_chunk`` chunks,
7. ``sub_commit``: the sub commits its step; ``lag_wait``: the main reads that marker (``max_lag``),
8. ``gc``: the main's garbage collection. The trainer keeps the last 4 steps; here ``keep_last=1`` so every
   step after the first deletes one step's keys, as every step of a long run does.

Payload text comes from the offline world's scripted experts (the embedded default): delegated tasks and
contexts of its main-agent transcripts, the answers, assistant turns and tool calls of its sub-agent episodes,
and trajectories as long as those episodes (token ids drawn at random, ~3.5 characters per token). Larger
models write longer turns; ``record_bytes_*`` in the output gives the sizes used.

**Figures.** ``records_per_s``: objects that carried data (records, batches, commit markers, claims, arrays; each
counted once per write and once per read) / exchange time; ``mb_per_s``: their bytes (10^6) / exchange time.
Batched, a round moves its tasks in one object each way, so ``records_per_s`` counts far fewer, larger objects
than the per-task exchange did (``exchange``: ``batched`` or ``per_task``).
The headline figures are the synchronised exchange (the paper's mode; phases 1-5, 7, 8) at Q=32, K=8, D=8
against the file store; ``gcs_emulator`` (``--backends file,gs``, as ``--full`` runs) repeats it against
`gcp-storage-emulator` (about 25 records/s: several minutes at these sizes) started through
``tests/store/emulator_launcher.py`` (a single-threaded Python server on 127.0.0.1: it measures the protocol
path, not GCS latency); ``*_unsync`` figures add the FIFO phase.

``exchange_share`` = the synchronised exchange's time at the ``local`` preset's sizes against the file store
(what two local jobs use) / the ``local`` preset's RL step time. The step time is, by default, measured as
``bench.rollout`` measures its RL steps: a ``Trainer`` of the preset is warm-started ``--warmstart-steps`` (100)
steps per agent (``preset``, as ``--full`` does: as far as the preset's own runs are, its ``warmstart.min_steps``,
500 per agent for ``local``; either way episodes have a real run's lengths), runs untimed RL steps until
``--quiet-steps`` (1; ``--full`` 2) in a row compile nothing new (at most ``--max-warmup-steps``, 4; ``--full``
8), then ``--rl-steps`` (2; ``--full`` 3) timed ones, and the median ``time/step_s`` is used. ``--metrics PATH``
takes the median ``time/step_s`` of a real run's ``metrics.jsonl`` instead (its first ``--skip-steps`` steps, which
compile, left out), and ``--step-s`` a given value (e.g. ``bench.rollout``'s ``step_s_excluding_compile``). The
target is a share under 5 %.

Token ids are drawn from the payload world's vocabulary: the chat world's configured size, or the compact
world's word model (whose size the world decides; ``local`` configures 0), which also counts the compact
episodes' tokens.

``--quick``: Q,K,D = 4,2,2 and the ``local`` sizes on file:// only, one timed step each, and the share against a
``smoke`` run's step (``--step-preset smoke``, 2-step warm start): every phase and the step measurement in
tens of seconds; its share compares different presets and means nothing.

The last stdout line is one JSON object (``mgrpo_jax.bench.common.emit``).
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path

import numpy as np

from mgrpo_jax.bench.common import WARMSTART_STEPS, emit, parse_sized, warmstart_arg
from mgrpo_jax.config import get_config
from mgrpo_jax.env.build import build_environment, noise_config
from mgrpo_jax.store import PollPolicy, Record, Store, StoreObserver, observe, open_store

log = logging.getLogger(__name__)

REPO = Path(__file__).resolve().parents[2]
LAUNCHER = REPO / "tests" / "store" / "emulator_launcher.py"
BUCKET = "mgrpo-bench"
PAPER_SIZES = (32, 8, 8)  # Q, K, D of the paper preset
SYNC_PHASES = ("tasks", "serve", "answers", "main_commit", "sub_read", "sub_commit", "lag_wait", "gc")
CHARS_PER_TOKEN = 3.5
TARGET_SHARE = 0.05
# Local sizes (the exchange share's) on file:// at a small --sizes, the share against a smoke run's step: every
# phase, the compact world's payloads and the step-time measurement, in tens of seconds.
QUICK = ["--sizes", "4,2,2", "--backends", "file", "--fifo-backends", "file", "--steps", "1", "--warmup", "1",
         "--share-steps", "1", "--step-preset", "smoke", "--warmstart-steps", "2", "--rl-steps", "1",
         "--max-warmup-steps", "1"]
# --full: the long version (the defaults before issue 37): the GCS emulator too, the step measured as the preset's
# runs are warm-started.
FULL = ["--backends", "file,gs", "--fifo-backends", "file,memory", "--warmstart-steps", "preset", "--rl-steps", "3",
        "--max-warmup-steps", "8", "--quiet-steps", "2"]


# ------------------------------------------------------------------------------------------ metering


class Meter:
    """Counts the objects and bytes that cross the store, at the KV seams and the array reads/writes."""

    def __init__(self):
        self.reset()

    def reset(self) -> None:
        self.records = 0
        self.bytes = 0
        self.deletes = 0
        self.lists = 0
        self.misses = 0

    def snapshot(self) -> tuple[int, int, int, int, int]:
        return self.records, self.bytes, self.deletes, self.lists, self.misses


class _MeterObserver(StoreObserver):
    """Feeds a Meter from the store's observation hooks (`mgrpo_jax.store.observe`)."""

    def __init__(self, meter: Meter):
        self.meter = meter

    def on_read(self, key, value):
        if value is None:
            self.meter.misses += 1
        else:
            self.meter.records += 1
            self.meter.bytes += len(value)

    def on_write(self, key, value):
        if value is None:
            self.meter.deletes += 1
        else:
            self.meter.records += 1
            self.meter.bytes += len(value)

    def on_list(self, lo, hi):
        self.meter.lists += 1

    def on_array_write(self, key, nbytes):
        self.meter.records += 1
        self.meter.bytes += nbytes

    def on_array_read(self, key, nbytes):
        self.meter.records += 1
        self.meter.bytes += nbytes


@contextlib.contextmanager
def metered(meter: Meter):
    """Counts the store's I/O into ``meter`` (through `mgrpo_jax.store.observe`) while the block runs."""
    with observe(_MeterObserver(meter)):
        yield meter


# ------------------------------------------------------------------------------------------ payloads


def payload_pool(preset: str, limit: int = 60) -> tuple[list[dict], int]:
    """Delegations and sub-agent episodes of the offline world's scripted experts (realistic text sizes), and the
    vocabulary size their token ids are drawn from.

    The compact world's tokenizer is a word model whose size the world decides (`tokenizer.vocab_size` 0): it is
    trained here (well under a second), and it counts the episodes' tokens; the chat world's BPE sizes are
    estimated from characters."""
    from mgrpo_jax.env.compact import CompactEnvironment
    from mgrpo_jax.rl import system

    config = get_config("xbench", preset)
    env = build_environment(config)
    tokenizer, vocab = None, int(config.tokenizer.vocab_size)
    if isinstance(env, CompactEnvironment):
        tokenizer = system.train_word_tokenizer(env, config)
        vocab = tokenizer.vocab_size
    if vocab <= 0:
        raise ValueError(f"the {preset} preset's tokenizer.vocab_size is {vocab}: no token ids to draw")
    experts = env.experts(noise_config(config))
    pool = []
    for question in list(env.questions.stage2)[:limit]:
        transcript = experts.main_agent(question)
        for j, sub in enumerate(transcript.subs):
            # The expert passes the previous finding on as context (its exact rule is in experts.main_agent).
            context = f"Found earlier: {transcript.subs[j - 1].answer}." if j else ""
            texts = [text for _, text in sub.as_chat()]
            if tokenizer is not None:
                tokens = sum(len(tokenizer.encode(text)) for text in texts)
            else:
                tokens = int(sum(len(text) for text in texts) / CHARS_PER_TOKEN)
            tool_calls = {}
            for turn in sub.assistant_turns:
                for name in ("search", "visit"):
                    if f'"name": "{name}"' in turn:
                        tool_calls[name] = tool_calls.get(name, 0) + 1
            pool.append({"task": sub.task, "context": context, "question_id": question.id, "answer": sub.answer,
                         "turns": list(sub.assistant_turns), "tool_calls": tool_calls, "tokens": max(1, tokens)})
    if not pool:
        raise RuntimeError(f"the {preset} world's experts delegated nothing: no payloads to benchmark")
    return pool, vocab


class StepData:
    """The records of one benchmark step (the same pool entries every step, so every step moves equal bytes)."""

    def __init__(self, pool: list[dict], q: int, k: int, d: int, vocab: int, seed: int = 0):
        rng = np.random.default_rng(seed)
        self.q, self.k, self.d = q, k, d
        picks = rng.integers(0, len(pool), size=(q, k, d))
        self.entries = {(qi, ki, i): pool[int(picks[qi, ki, i])]
                        for qi in range(q) for ki in range(k) for i in range(d)}
        self.trajectories = {}
        for slot, entry in self.entries.items():
            n = entry["tokens"]
            self.trajectories[slot] = {
                "tokens": rng.integers(0, vocab, size=n).tolist(),
                "loss_mask": (rng.random(n) < 0.4).astype(int).tolist(),
                "old_logprobs": (-rng.exponential(1.0, size=n)).tolist(),
            }
        self.correct = rng.random((q, k)) < 0.3
        self.format_ok = rng.random((q, k)) < 0.95
        self.reward = rng.random((q, k)).astype(np.float32)
        self.counts = np.full((q, k), d, np.int32)

    def tasks(self, step: int, invocation: int, version: int) -> list[Record]:
        return [Record("task", step, qi, ki, invocation, version,
                       {"task": e["task"], "context": e["context"], "question_id": e["question_id"]})
                for (qi, ki, i), e in self.entries.items() if i == invocation]

    def answer(self, task: Record, version: int) -> Record:
        e = self.entries[(task.query, task.rollout, task.invocation)]
        return Record("answer", task.step, task.query, task.rollout, task.invocation, version,
                      {"answer": e["answer"], "end_reason": "answered", "turns": e["turns"],
                       "tool_calls": e["tool_calls"]})

    def trajectory(self, step: int, slot: tuple[int, int, int], version: int) -> Record:
        return Record("sub_trajectory", step, *slot, version,
                      {**self.trajectories[slot], "reward": float(self.reward[slot[0], slot[1]])})


# ------------------------------------------------------------------------------------------ one step


def exchange_step(main: Store, sub: Store, step: int, data: StepData, *, rounds: int, chunk: int,
                  fifo: bool, meter: Meter, per_task: bool = False, split: int = 1) -> dict:
    """One RL step's exchange; returns {phase: {"s", "records", "bytes", "deletes", "lists"}}. Each of the
    ``rounds`` invocations' delegations go out in ``split`` engine rounds (as the slot engine sends them: the
    rollouts' turns end in different decode rounds)."""
    phases: dict[str, dict] = {}

    @contextlib.contextmanager
    def phase(name: str):
        before = meter.snapshot()
        start = time.perf_counter()
        yield
        seconds = time.perf_counter() - start
        after = meter.snapshot()
        entry = phases.setdefault(name, {"s": 0.0, "records": 0, "bytes": 0, "deletes": 0, "lists": 0})
        entry["s"] += seconds
        for i, key in enumerate(("records", "bytes", "deletes", "lists")):
            entry[key] += after[i] - before[i]

    main_version, sub_version = 2 * step, 2 * step + 1
    for invocation in range(rounds):
        tasks = data.tasks(step, invocation % data.d, main_version)
        if invocation >= data.d:  # more rounds than slots: fresh invocation ids beyond D
            tasks = [Record("task", step, t.query, t.rollout, invocation, main_version, t.payload) for t in tasks]
        for part in range(split):  # the invocation's delegations over `split` engine rounds
            if tasks[part::split]:
                _exchange_round(main, sub, step, data, tasks[part::split], sub_version, phase, per_task)
    with phase("main_commit"):
        writer = main.step_writer(step, "main", main_version)
        writer.put_array("main_format_ok", data.format_ok)
        writer.put_array("main_correct", data.correct)
        writer.put_array("main_reward", data.reward)
        writer.put_array("sub_counts", data.counts)
        writer.commit()
    with phase("sub_read"):
        # The sub job's poll: no task left, then the marker.
        assert not (sub.tasks.claim(step, "sub_0") if per_task else sub.tasks.claim_batches(step, "sub_0"))
        view = sub.read_step(step, "main")
        view.array("sub_counts")
        view.array("main_correct")
        view.array("main_format_ok")
    if fifo:
        with phase("fifo"):
            queue = sub.fifo("sub_trajectories")
            queue.append([data.trajectory(step, slot, sub_version) for slot in data.entries])
            consumer = queue.consumer("sub_trainer")
            while consumer.offset + chunk <= queue.size():
                consumer.pop(chunk, timeout_s=60)
    with phase("sub_commit"):
        sub.step_writer(step, "sub", sub_version).commit({"served": len(data.entries)})
    with phase("lag_wait"):
        main.wait_step(step, "sub", timeout_s=60)
    with phase("gc"):
        main.gc(keep_last=1)
    return phases


def _exchange_round(main: Store, sub: Store, step: int, data: StepData, tasks: list[Record], sub_version: int,
                    phase, per_task: bool) -> None:
    """One engine round's delegations: posted by the main, claimed and answered by the sub, read by the main."""
    if per_task:  # the exchange before batching: one object per task, claim and answer
        with phase("tasks"):
            ids = main.tasks.post(tasks)
        with phase("serve"):
            claimed = sub.tasks.claim(step, "sub_0")
            sub.tasks.post_answers([data.answer(t, sub_version) for t in claimed])
        with phase("answers"):
            main.tasks.wait_answers(step, ids, timeout_s=600)
    else:
        with phase("tasks"):
            bid = main.tasks.post_batch(tasks)
        with phase("serve"):
            batches = sub.tasks.claim_batches(step, "sub_0")
            claimed = [t for batch in batches for t in batch.records]
            for batch in batches:
                sub.tasks.answer_batch(batch, [data.answer(t, sub_version) for t in batch.records])
        with phase("answers"):
            main.tasks.wait_batch(step, bid, timeout_s=600)
    if len(claimed) != len(tasks):
        raise RuntimeError(f"step {step}: the sub side claimed {len(claimed)} of {len(tasks)} tasks")


def bench_exchange(url: str, sizes: tuple[int, int, int], pool: list[dict], *, steps: int, warmup: int,
                   rounds: int | None, chunk: int, vocab: int, fifo: bool = True, per_task: bool = False,
                   split: int = 1) -> dict:
    """Runs ``warmup + steps`` exchange steps on a fresh store at ``url``; figures over the timed steps."""
    q, k, d = sizes
    rounds = d if rounds is None else rounds
    data = StepData(pool, q, k, d, vocab)
    poll = PollPolicy(initial_s=0.002, max_s=0.05)
    main, sub = open_store(url, poll=poll), open_store(url, poll=poll)
    meter = Meter()
    totals: dict[str, dict] = {}
    per_step = []
    with metered(meter):
        for step in range(warmup + steps):
            phases = exchange_step(main, sub, step, data, rounds=rounds, chunk=chunk, fifo=fifo, meter=meter,
                                   per_task=per_task, split=split)
            print(f"  {url} step {step}{' (untimed)' if step < warmup else ''}: "
                  + ", ".join(f"{name} {entry['s'] * 1e3:.0f} ms" for name, entry in phases.items()), flush=True)
            if step < warmup:
                continue
            per_step.append(sum(phases[p]["s"] for p in SYNC_PHASES))
            for name, entry in phases.items():
                total = totals.setdefault(name, dict.fromkeys(entry, 0))
                for key, value in entry.items():
                    total[key] += value
    n = max(steps, 1)

    def figures(names) -> dict:
        seconds = sum(totals[p]["s"] for p in names if p in totals)
        records = sum(totals[p]["records"] for p in names if p in totals)
        nbytes = sum(totals[p]["bytes"] for p in names if p in totals)
        return {"records_per_s": records / seconds if seconds else 0.0,
                "mb_per_s": nbytes / 1e6 / seconds if seconds else 0.0,
                "step_exchange_s": seconds / n, "records_per_step": records / n, "mb_per_step": nbytes / 1e6 / n}

    out = figures(SYNC_PHASES)
    if fifo:
        out.update({f"{key}_unsync": value for key, value in figures((*SYNC_PHASES, "fifo")).items()})
    out["step_exchange_s_samples"] = per_step
    out["deletes_per_step"] = sum(t["deletes"] for t in totals.values()) / n
    out["lists_per_step"] = sum(t["lists"] for t in totals.values()) / n
    out["phases_s"] = {name: t["s"] / n for name, t in totals.items()}
    out["sizes"] = {"queries": q, "samples": k, "d_max": d, "rounds": rounds, "engine_rounds": rounds * split,
                    "tasks_per_step": q * k * rounds,
                    "fifo_chunk": chunk}
    task = data.tasks(0, 0, 0)[0]
    out["record_bytes_task"] = len(task.encode())
    out["record_bytes_answer"] = float(np.mean([len(data.answer(t, 0).encode()) for t in data.tasks(0, 0, 0)]))
    out["record_bytes_trajectory"] = float(np.mean([len(data.trajectory(0, s, 0).encode())
                                                    for s in list(data.entries)[:64]]))
    out["fifo_measured"] = fifo
    out["exchange"] = "per_task" if per_task else "batched"
    return out


# ------------------------------------------------------------------------------------------ the emulator


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def stop_emulator(proc: subprocess.Popen) -> None:
    """SIGTERM (the launcher stops between two requests), then SIGKILL if it lingers."""
    proc.terminate()
    try:
        proc.wait(timeout=30)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


@contextlib.contextmanager
def gcs_emulator():
    """Starts the patched `gcp-storage-emulator` (the store tests' launcher) and points the store at it."""
    if not LAUNCHER.exists():
        raise FileNotFoundError(f"{LAUNCHER} not found: the emulator benchmark runs from a repository checkout")
    port = _free_port()
    url = f"http://127.0.0.1:{port}"
    settings = {"TENSORSTORE_GCS_HTTP_URL": url, "GOOGLE_AUTH_TOKEN_FOR_TESTING": "dummy",
                "STORAGE_EMULATOR_HOST": url, "GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT": "false"}
    saved = {name: os.environ.get(name) for name in settings}
    os.environ.update(settings)
    env = dict(os.environ)
    env["PYTHONPATH"] = str(REPO) + os.pathsep + env.get("PYTHONPATH", "")
    proc = subprocess.Popen([sys.executable, str(LAUNCHER), "--port", str(port), "--bucket", BUCKET],
                            stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, env=env)
    try:
        line = proc.stdout.readline()
        if not line.startswith("READY"):
            raise RuntimeError(f"GCS emulator did not start (said {line!r}, exit code {proc.poll()})")
        yield f"gs://{BUCKET}/bench-{uuid.uuid4().hex[:8]}"
    finally:
        stop_emulator(proc)
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


# ------------------------------------------------------------------------------------------ step time


def step_time_from_metrics(path: str, skip: int) -> tuple[float, list[float]]:
    from mgrpo_jax.runtime.metrics import read_jsonl

    times = [float(r["time/step_s"]) for r in read_jsonl(path) if "time/step_s" in r]
    if len(times) <= skip:
        raise ValueError(f"{path}: {len(times)} steps with time/step_s, need more than --skip-steps={skip}")
    return statistics.median(times[skip:]), times[skip:]


def measure_step_time(preset: str, warmstart_steps: int | None, rl_steps: int, max_warmup_steps: int,
                      quiet_steps: int = 2) -> tuple[float, list[float], str]:
    """Median ``time/step_s`` of a short colocated run of ``preset``, set up as ``bench.rollout`` sets up its own:
    warm-started as far as the preset's runs are, RL steps untimed until one compiles nothing new."""
    from mgrpo_jax.bench.rollout import ComputeTimer, prepare_config, warm_up
    from mgrpo_jax.rl.trainer import Trainer
    from mgrpo_jax.sampling import observe

    config, warm = prepare_config("xbench", preset, warmstart_steps, max_warmup_steps + rl_steps, "bench-store")
    with tempfile.TemporaryDirectory(prefix="bench-store-") as workdir:
        trainer = Trainer(config, workdir)
        trainer.warm_start()
        with observe(ComputeTimer()) as timer:
            warmup = warm_up(trainer, timer, 1, max_warmup_steps, quiet_steps, label=f"{preset} untimed")
            times = []
            for _ in range(rl_steps):
                metrics = trainer.rl_step()
                times.append(float(metrics["time/step_s"]))
                print(f"{preset} rl step {trainer.step}: {metrics['time/step_s']:.2f} s", flush=True)
    source = (f"median time/step_s of {rl_steps} RL steps of a {preset} run warm-started {warm} steps per agent, "
              f"after {warmup['warmup_steps_run']} untimed steps"
              + ("" if warmup["warmup_settled"] else " (still compiling at the cap)"))
    return statistics.median(times), times, source


# ------------------------------------------------------------------------------------------ main


def _sizes(text: str) -> tuple[int, int, int]:
    parts = tuple(int(x) for x in text.split(","))
    if len(parts) != 3 or min(parts) < 1:
        raise argparse.ArgumentTypeError(f"expected Q,K,D (three positive ints), got {text!r}")
    return parts


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--sizes", type=_sizes, default=PAPER_SIZES, help="Q,K,D of the throughput figures (32,8,8)")
    p.add_argument("--rounds", type=int, default=None, help="delegation rounds per step (default D)")
    p.add_argument("--fifo-chunk", type=int, default=None, help="FIFO pop size (default: the paper preset's)")
    p.add_argument("--steps", type=int, default=2, help="timed exchange steps per store")
    p.add_argument("--split", type=int, default=1,
                   help="engine rounds each delegation round's tasks go out in, at --sizes (1)")
    p.add_argument("--share-split", type=int, default=2,
                   help="the same at the preset's sizes (2: a local step's 2 delegation turns reach the store in "
                        "4 engine rounds)")
    p.add_argument("--per-task", action="store_true",
                   help="replay the exchange as it was before batching: one object per task, claim and answer")
    p.add_argument("--warmup", type=int, default=1, help="untimed exchange steps first")
    p.add_argument("--backends", default="file", help="comma list of file, gs (the emulator), memory")
    p.add_argument("--gs-steps", type=int, default=1,
                   help="timed exchange steps at --sizes on the emulator (no warm-up: it is slow at these sizes)")
    p.add_argument("--fifo-backends", default="file",
                   help="stores whose --sizes figures include the FIFO phase (*_unsync figures)")
    p.add_argument("--preset", default="local", help="the preset whose step the exchange is compared to")
    p.add_argument("--payload-preset", default="local", help="the world whose experts' text fills the records")
    p.add_argument("--share-steps", type=int, default=3, help="timed exchange steps at the preset's sizes")
    p.add_argument("--step-preset", default=None,
                   help="the preset whose RL step is measured (default --preset; quick mode: smoke, to be quick)")
    p.add_argument("--step-s", type=float, default=None, help="the preset's RL step time, measured elsewhere")
    p.add_argument("--metrics", default=None, help="a run's metrics.jsonl to take the median time/step_s from")
    p.add_argument("--skip-steps", type=int, default=2, help="first steps of --metrics left out (compilation)")
    p.add_argument("--warmstart-steps", type=warmstart_arg, default=WARMSTART_STEPS,
                   help=f"warm start of the measuring run, per agent ({WARMSTART_STEPS}; 'preset': the preset's "
                        "warmstart.min_steps)")
    p.add_argument("--rl-steps", type=int, default=2, help="timed RL steps of the measuring run")
    p.add_argument("--max-warmup-steps", type=int, default=4, help="untimed RL steps of the measuring run at most")
    p.add_argument("--quiet-steps", type=int, default=1,
                   help="the measuring run's warm-up ends after this many steps in a row compiled nothing")
    return parse_sized(p, argv, QUICK, FULL)


def _store_url(backend: str, tmp: str, name: str, gs_base: str | None) -> str:
    if backend == "file":
        return Path(tmp, name).as_uri()
    if backend == "memory":
        return f"memory://bench-{name}-{uuid.uuid4().hex[:8]}"
    return f"{gs_base}/{name}"


def main(argv=None) -> dict:
    args = parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    backends = [b.strip() for b in args.backends.split(",") if b.strip()]
    unknown = set(backends) - {"file", "gs", "memory"}
    if unknown or not backends:
        raise SystemExit(f"--backends: unknown {sorted(unknown)}; use file, gs, memory")
    paper, local = get_config("xbench", "paper"), get_config("xbench", args.preset)
    local_sizes = (local.rollout.queries, local.rollout.samples, local.rollout.d_max)
    figures: dict = {"cpus": os.cpu_count(), "load_avg_1m_start": os.getloadavg()[0], "sizes": list(args.sizes),
                     "exchange": "per_task" if args.per_task else "batched",
                     "preset": args.preset, "preset_sizes": list(local_sizes)}
    pool, vocab = payload_pool(args.payload_preset)
    print(f"payloads: {len(pool)} expert delegations of the {args.payload_preset} world (vocabulary {vocab}, "
          f"{np.mean([p['tokens'] for p in pool]):.0f} tokens per sub-agent episode)", flush=True)

    with contextlib.ExitStack() as stack:
        tmp = stack.enter_context(tempfile.TemporaryDirectory(prefix="bench-store-"))
        gs_base = stack.enter_context(gcs_emulator()) if "gs" in backends else None
        for backend in backends:
            name = {"gs": "gcs_emulator"}.get(backend, backend)
            t0 = time.perf_counter()
            chunk = args.fifo_chunk or paper.rollout.unsync_chunk
            fifo = backend in args.fifo_backends.split(",")
            gs = backend == "gs"
            result = bench_exchange(_store_url(backend, tmp, "paper", gs_base), args.sizes, pool,
                                    steps=args.gs_steps if gs else args.steps, warmup=0 if gs else args.warmup,
                                    rounds=args.rounds, chunk=chunk, vocab=vocab, fifo=fifo, per_task=args.per_task,
                                    split=args.split)
            share = bench_exchange(_store_url(backend, tmp, "local", gs_base), local_sizes, pool,
                                   steps=args.share_steps, warmup=1, rounds=None, chunk=local.rollout.unsync_chunk,
                                   vocab=vocab, fifo=True, per_task=args.per_task, split=args.share_split)
            result["preset_exchange_s"] = share["step_exchange_s"]
            result["preset_exchange_s_unsync"] = share["step_exchange_s_unsync"]
            result["preset_exchange_phases_s"] = share["phases_s"]
            result["wall_s"] = time.perf_counter() - t0
            figures[name] = result
            print(f"{name}: {result['records_per_s']:.0f} records/s, {result['mb_per_s']:.1f} MB/s "
                  f"({result['records_per_step']:.0f} records, {result['mb_per_step']:.2f} MB per step of "
                  f"{args.sizes}: {result['step_exchange_s']:.3f} s); {args.preset} sizes "
                  f"{local_sizes}: {share['step_exchange_s'] * 1e3:.1f} ms per step", flush=True)

    if args.step_s is not None:
        step_s, samples, source = args.step_s, [args.step_s], "--step-s"
    elif args.metrics:
        step_s, samples = step_time_from_metrics(args.metrics, args.skip_steps)
        source = f"median time/step_s of {args.metrics} (first {args.skip_steps} steps left out)"
    else:
        step_s, samples, source = measure_step_time(args.step_preset or args.preset, args.warmstart_steps,
                                                    args.rl_steps, args.max_warmup_steps, args.quiet_steps)
    figures.update({"step_s": step_s, "step_s_samples": samples, "step_s_source": source,
                    "step_preset": args.step_preset or args.preset})

    head = "file" if "file" in figures else {"gs": "gcs_emulator"}.get(backends[0], backends[0])
    for name in ("file", "gcs_emulator", "memory"):
        if name in figures:
            f = figures[name]
            f["exchange_share"] = f["preset_exchange_s"] / step_s
            f["exchange_share_unsync"] = f["preset_exchange_s_unsync"] / step_s
            figures[f"{name}_records_per_s"] = f["records_per_s"]
            figures[f"{name}_mb_per_s"] = f["mb_per_s"]
            figures[f"{name}_exchange_share"] = f["exchange_share"]
    figures.update({"records_per_s": figures[head]["records_per_s"], "mb_per_s": figures[head]["mb_per_s"],
                    "exchange_share": figures[head]["exchange_share"], "headline_store": head,
                    "exchange_share_target": TARGET_SHARE,
                    "exchange_share_met": figures[head]["exchange_share"] < TARGET_SHARE})
    print(f"exchange share at the {args.preset} sizes of a {args.step_preset or args.preset} step ({step_s:.2f} s): "
          + ", ".join(f"{n} {figures[n]['exchange_share']:.2%}" for n in ("file", "gcs_emulator", "memory")
                      if n in figures), flush=True)
    figures["load_avg_1m_end"] = os.getloadavg()[0]
    emit(figures)
    return figures


if __name__ == "__main__":
    main()
