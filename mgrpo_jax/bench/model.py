"""Model benchmark: our sampler and train step vs. Hugging Face ``transformers`` on PyTorch CPU.

    python -m mgrpo_jax.bench.model            # the fixed 'bench' shape (issue 3 part 6)
    python -m mgrpo_jax.bench.model --quick    # tiny sizes, seconds (what the test runs)
    python -m mgrpo_jax.bench.model --shape=moe  # the mixture-of-experts shape 'bench-moe' vs HF Qwen3-MoE
    python -m mgrpo_jax.bench.model --full     # the long version: 3 rounds, decode at batch 64 too
    python -m mgrpo_jax.bench.model --shape=qwen3-0.6b  # random weights at Qwen3-0.6B's shape, sized for a GPU

The default runs in a few minutes on 2 cores (docs/benchmarks.md has the wall times): the workloads of the figures
of record at their sizes, in 2 rounds, decode at batch 32 only (``--shape=moe``: one round, 128 new tokens); ``--full``
(``FULL``, the default before issue 37) times 3 rounds, 256 new tokens, decode at batch 32 and 64, and with
``--shape=moe`` also our dense shape.

Shape: Qwen-3 style, vocab 2048, d_model 256, 4 layers, 4 query / 2 KV heads, head_dim 64, MLP 1024, f32.
``--shape=moe``: the same with every MLP a mixture of 8 SwiGLU experts of width 512, 2 per token (the preset
``bench-moe``: the active parameters of ``bench`` plus the router), against ``transformers``
``Qwen3MoeForCausalLM`` of that shape, then (with ``--full``) our dense ``bench`` shape (equal active parameters)
without the peer, in the same run. Its JSON names the MoE figures ``moe_*`` / ``hf_moe_*`` (``moe_train_tokens_per_s``,
``hf_moe_train_tokens_per_s``, ``moe_decode_tokens_per_s``, ``hf_moe_decode_tokens_per_s``,
``moe_train_vs_hf``, ``moe_decode_vs_hf``) and the dense ones ``dense_*``.

What is timed. Everything is built, compiled and warmed up first; then ``--repeats`` rounds each time
every workload once, back to back, in the order: matmul peak, our decode at batch 32, the peer's
``generate()``, our train step, the peer's train step, our decode at batch 64, prefill (and the peak once
more at the end). Figures are medians over rounds; ``decode_vs_hf`` / ``train_vs_hf`` are medians of the
per-round ratios, so load from other processes that drifts during the run hits both sides alike.

* ``decode``: ``Sampler.generate`` at batch 32 (and 64 with ``--full``), prompt 128 random ids, 256 new tokens (128
  in the MoE default), temperature 1, no top-k/top-p, no stop tokens (every row generates all of them).
  tokens/s = batch * new tokens / wall time of the whole call (prefill included, as in HF ``generate()``);
  ``decode_tokens_per_s`` is batch 32. The
  sampler runs with ``decode_phases`` (``--decode-phases``, default 8): the decode loop in that many
  phases, each attending only to the cache slots filled by its end (``mgrpo_jax.sampling.generate``). The
  batch is split over ``decode_devices`` CPU devices (``--decode-devices``, default one per core; one for the
  MoE shape, whose decode step is bound by reading the experts' weights, read in full by every device), the data
  axis of the model's mesh: each core runs its rows' whole decode loop, instead of one loop whose small
  matmuls XLA:CPU mostly runs on one core at a time. The sampler reads the MLP matrices and the LM head
  out-major (``Sampler.out_major``, on by default on CPU). The peer runs its 2 threads in one process.
* ``prefill``: one cached forward over batch 32 x 128 prompt tokens; tokens/s = 32 * 128 / time.
* ``train``: one AdamW update on batch 32 x 384 tokens (next-token cross-entropy) by the project's train
  step (``mgrpo_jax.agent.step.build_step``: jitted once, state donated, gradient norm and non-finite guard
  included), with the batch's gradient accumulated exactly over ``train_micro_batches`` micro-batches
  (``--train-micro-batches``, default 8: 4 rows each) under ``lax.scan``. The micro-batches keep the
  activations of a [1536, 1024] matmul inside the 32 MiB L3 and XLA's temporaries small enough to be
  reused instead of page-faulted in on every call; 1 gives the whole batch in one pass.
  tokens/s = 32 * 384 / time. MFU = model FLOPs per
  step / time / matmul peak, where model FLOPs = 6 * (matmul parameters) * tokens + the attention score and
  value matmuls (3 * 4 * T * H * head_dim per token per layer over the full T x T square, times the share
  the model computes: (n + 1) / 2n with ``causal_block`` splitting T into n blocks, else all of it), and
  the peak is the best of the per-round timings of a jitted 2048^2 float32 matmul in
  this run; taking the best keeps the ratio conservative when other work slows some of the timings.
* the peer: ``transformers`` ``Qwen3ForCausalLM`` of the same shape, float32, ``torch.set_num_threads(2)``:
  ``generate()`` at batch 32 (same prompt length, ``do_sample=True``, temperature 1, ``top_k=0``,
  ``min_new_tokens=max_new_tokens``) and a ``torch.optim.AdamW`` step at batch 32 x 384.
* ``peak_memory_gb``: the process's peak resident memory (``ru_maxrss``) once our workloads have been built,
  compiled and run once, before the peer is loaded (it includes the Python/JAX runtime itself).

``--shape=qwen3-0.6b`` (issue 37 item 5): the preset ``qwen3-0.6b`` (28 layers, d_model 1,024, 16 query / 8 KV
heads, head_dim 128, MLP 3,072, vocab 151,936, tied embeddings, bfloat16 compute over float32 parameters) with random
weights, sized for one GPU (``QWEN3_06B``): decode at batch 64, prompt 128, 128 new tokens; train 8 x 1,024 in one
micro-batch; 3 rounds; the matmul peak an 8,192^2 matmul in the model's compute dtype (bfloat16), so ``train_mfu``
is against the bf16 peak. On CPU it runs too, slowly: ``--quick`` keeps the shape's widths at 1 layer and vocab 256,
and ``--decode-batch`` / ``--new-tokens`` / ``--prompt-len`` / ``--train-batch`` / ``--train-seq`` shrink the sizes.
``launch/device_bench.sh`` runs it on a lent GPU.

Devices. JAX runs on its default backend; on a GPU (any backend but CPU) our decode uses one device unless
``--decode-devices`` says otherwise. The peer runs on CUDA when torch sees a GPU, else on the CPU with 2 threads;
the JSON states both (``device``: JAX's first device's kind, ``hf_device``) and the peer's precision
(``hf_dtype``: float32, or float32 parameters under bfloat16 autocast for a bfloat16 shape, as ours), and the
peak's (``matmul_dtype``).

The last stdout line is one JSON object (see ``emit``).
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import os
import platform
import resource
import time
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

from mgrpo_jax.agent.state import create_agent_state
from mgrpo_jax.agent.step import build_step
from mgrpo_jax.bench.common import emit, host_devices, time_call
from mgrpo_jax.model import Transformer, get_model_config, make_mesh, shard_model
from mgrpo_jax.sampling import NO_STOP, Sampler


@dataclasses.dataclass(frozen=True)
class BenchSizes:  # the defaults: --full's sizes (DEFAULT is a cut of them)
    preset: str = "bench"
    decode_batches: tuple[int, ...] = (32, 64)
    prompt_len: int = 128
    new_tokens: int = 256
    train_batch: int = 32
    train_seq: int = 384
    hf_decode_batch: int = 32
    matmul_n: int = 2048
    repeats: int = 3
    decode_phases: int = 8
    decode_devices: int = 0  # CPU devices the decode batch is split over (data axis); 0: one per core
    train_micro_batches: int = 8
    overrides: tuple[tuple[str, object], ...] = ()


# The default: the figures of record's sizes, 2 rounds, decode at batch 32 only (a few minutes here); --full:
# BenchSizes(). The MoE pair's default is one round of 128 new tokens: beside other work the peer's MoE generate()
# slows most (23x beside one training job: its 2 OpenMP threads wait on each other), 107 s a round at 256 tokens.
DEFAULT = BenchSizes(decode_batches=(32,), repeats=2)
MOE_DEFAULT = dataclasses.replace(DEFAULT, repeats=1, new_tokens=128)
# --shape=qwen3-0.6b: a realistic shape, sized for one GPU (issue 37 item 5); --full: decode at batch 256 too, 5 rounds.
QWEN3_06B = BenchSizes(preset="qwen3-0.6b", decode_batches=(64,), prompt_len=128, new_tokens=128, train_batch=8,
                       train_seq=1024, hf_decode_batch=64, matmul_n=8192, repeats=3, decode_phases=8,
                       decode_devices=0, train_micro_batches=1)
QWEN3_06B_FULL = dataclasses.replace(QWEN3_06B, decode_batches=(64, 256), repeats=5)
FULL = BenchSizes()
QUICK = BenchSizes(preset="tiny", decode_batches=(2,), prompt_len=8, new_tokens=8, train_batch=2,
                   train_seq=16, hf_decode_batch=2, matmul_n=256, repeats=1, decode_phases=2,
                   decode_devices=2, train_micro_batches=2, overrides=(("n_layers", 1), ("vocab_size", 256)))
# --shape=moe: the MoE preset, then the dense preset of equal active parameters (ours only).
SHAPES = {"dense": ("bench", None), "moe": ("bench-moe", "bench"), "qwen3-0.6b": ("qwen3-0.6b", None)}
# --quick: the qwen3-0.6b shape keeps its widths (heads, head_dim, MLP, tied embeddings, bf16) at QUICK's 1 layer and
# vocab 256.
QUICK_SHAPES = {"dense": ("tiny", None), "moe": ("qwen3-moe-tiny", "tiny"), "qwen3-0.6b": ("qwen3-0.6b", None)}
# The MoE run's figures under these names (the dense run's get "dense_" before theirs).
MOE_KEYS = {"train_tokens_per_s": "moe_train_tokens_per_s", "hf_train_tokens_per_s": "hf_moe_train_tokens_per_s",
            "decode_tokens_per_s": "moe_decode_tokens_per_s", "hf_decode_tokens_per_s": "hf_moe_decode_tokens_per_s",
            "train_vs_hf": "moe_train_vs_hf", "decode_vs_hf": "moe_decode_vs_hf"}


# --------------------------------------------------------------------------------------------- peak


def matmul_peak_fn(n: int = 2048, repeats: int = 5, dtype=jnp.float32) -> Callable[[], float]:
    """A function that measures the best FLOP/s of a jitted n x n @ n x n matmul in ``dtype`` (float32 unless the
    model computes in another; compiled once)."""
    a = jax.random.normal(jax.random.key(0), (n, n), dtype)
    b = jax.random.normal(jax.random.key(1), (n, n), dtype)
    f = jax.jit(jnp.matmul)
    jax.block_until_ready(f(a, b))

    def measure() -> float:
        t = time_call(lambda: f(a, b), warmup=1, repeats=repeats)
        return 2.0 * n**3 / t["min_s"]

    return measure


# ------------------------------------------------------------------------------------------- model


def build_model(cfg, seed: int = 0) -> Transformer:
    """The model with its parameters created in one jitted call (eager init dispatches op by op)."""
    graphdef = nnx.graphdef(nnx.eval_shape(lambda: Transformer(cfg, rngs=nnx.Rngs(0))))
    state = jax.jit(lambda k: nnx.state(Transformer(cfg, rngs=nnx.Rngs(k))))(jax.random.key(seed))
    return nnx.merge(graphdef, state)


def train_flops_per_token(cfg, seq: int) -> float:
    """Model FLOPs of forward + backward per token (see module docstring; an MoE layer counts its router and
    the ``num_experts_per_tok`` experts a token runs through)."""
    d, h, kv, dh, f = cfg.d_model, cfg.n_heads, cfg.n_kv_heads, cfg.head_dim, cfg.mlp_dim
    n_moe = sum(cfg.moe_layers)
    moe_mlp = d * cfg.num_experts + cfg.num_experts_per_tok * 3 * d * cfg.moe_intermediate_size
    matmul_params = (cfg.n_layers * (d * h * dh * 2 + d * kv * dh * 2) + (cfg.n_layers - n_moe) * 3 * d * f
                     + n_moe * moe_mlp + d * cfg.vocab_size)
    attention = cfg.n_layers * 4 * seq * h * dh  # QK^T and PV over the full square, forward, per token
    c = cfg.causal_block
    if c and seq > c and seq % c == 0:  # the blocks on and below the diagonal only (model.attention)
        attention *= (seq // c + 1) / (2 * (seq // c))
    return 6.0 * matmul_params + 3.0 * attention


def next_token_loss(graphdef):
    """``micro_loss(params, batch) -> (loss_sum, (denominator, metrics))`` for ``build_step``: next-token
    cross-entropy summed over every position but the last of each row."""

    def micro_loss(params, batch):
        model = nnx.merge(graphdef, params)
        tokens = batch["tokens"]
        B, T = tokens.shape
        pos = jnp.broadcast_to(jnp.arange(T, dtype=jnp.int32)[None], (B, T))
        logits, _ = model(tokens, pos)
        # Targets over all T positions with the last one weighted 0: the same loss as slicing
        # logits[:, :-1], without copying the [B, T, V] logits.
        targets = jnp.roll(tokens, -1, axis=1)
        weights = (jnp.arange(T) < T - 1).astype(jnp.float32)[None]
        losses = optax.softmax_cross_entropy_with_integer_labels(logits, targets)
        return jnp.sum(losses * weights), (jnp.asarray(B * (T - 1), jnp.float32), {})

    return micro_loss


@dataclasses.dataclass
class Case:
    """One timed workload: ``fn()`` runs it once (blocking); ``tokens`` it processes per call."""

    name: str
    fn: Callable[[], object]
    tokens: int


def setup_ours(cfg, sizes: BenchSizes) -> tuple[list[Case], dict]:
    """Build, compile and warm up our decode, prefill and train workloads."""
    info: dict = {}
    cases: list[Case] = []
    model = build_model(cfg)
    rng = np.random.default_rng(0)
    n = sizes.decode_devices
    if n > len(jax.devices()) or any(B % n for B in sizes.decode_batches):
        raise ValueError(f"decode_devices={n}: must divide the decode batches {sizes.decode_batches} and "
                         f"be at most the {len(jax.devices())} devices JAX has")
    mesh = make_mesh({"data": n, "fsdp": 1, "tensor": 1}, jax.devices()[:n])
    sampler = Sampler(shard_model(model, mesh), pad_id=0, decode_phases=sizes.decode_phases)
    info["decode_out_major"] = sampler.out_major
    P, N = sizes.prompt_len, sizes.new_tokens
    for B in sizes.decode_batches:
        prompts = rng.integers(0, cfg.vocab_size, size=(B, P)).astype(np.int32)
        lengths = np.full((B,), P, np.int32)
        stops = np.full((B, 4), NO_STOP, np.int32)  # no stop tokens: every row generates N tokens
        calls = iter(range(1 << 30))

        def decode(prompts=prompts, lengths=lengths, stops=stops, calls=calls):
            out = sampler.generate(prompts, lengths, max_new=N, rng=next(calls), temperature=1.0,
                                   stop_tokens=stops)
            return out.tokens

        t0 = time.perf_counter()
        res = sampler.generate(prompts, lengths, max_new=N, rng=0, temperature=1.0, stop_tokens=stops)
        jax.block_until_ready(res)
        info[f"decode_compile_s_b{B}"] = time.perf_counter() - t0
        assert int(np.asarray(res.lengths).min()) == N, "bench rows must not stop early"
        cases.append(Case(f"decode_b{B}", decode, B * N))

    # Prefill alone: one cached forward over the prompts (what the sampler does before decoding).
    B = sizes.decode_batches[0]
    graphdef, state = nnx.split(model)
    prompts = jnp.asarray(rng.integers(0, cfg.vocab_size, size=(B, P)), jnp.int32)
    pos = jnp.broadcast_to(jnp.arange(P, dtype=jnp.int32)[None], (B, P))

    @functools.partial(jax.jit, donate_argnums=1)
    def prefill(state, cache, tokens):
        m = nnx.merge(graphdef, state)
        logits, cache = m(tokens, pos, cache=cache, cache_index=0)
        return logits[:, -1], cache

    cache_box = [model.init_cache(B, P + N)]

    def run_prefill():
        last, cache_box[0] = prefill(state, cache_box[0], prompts)
        return last

    jax.block_until_ready(run_prefill())
    cases.append(Case("prefill", run_prefill, B * P))

    # Train step: the project's (AdamW, state donated, exact accumulation over micro-batches).
    Bt, T = sizes.train_batch, sizes.train_seq
    tx = optax.adamw(1e-4, weight_decay=0.01)
    mesh = make_mesh({"data": 1, "fsdp": 1, "tensor": 1}, jax.devices()[:1])
    train_graphdef, train_state, state_sharding = create_agent_state(cfg, tx, mesh, seed=1)
    step = build_step(train_graphdef, tx, next_token_loss(train_graphdef), state_sharding, mesh,
                      sizes.train_micro_batches)
    batch = {"tokens": jnp.asarray(rng.integers(0, cfg.vocab_size, size=(Bt, T)), jnp.int32)}
    t0 = time.perf_counter()
    compiled = step.jitted.lower(train_state, batch).compile()
    info["train_compile_s"] = time.perf_counter() - t0
    mem = compiled.memory_analysis()
    if mem is not None:
        info["train_step_temp_gb"] = getattr(mem, "temp_size_in_bytes", 0) / 2**30
    train_box = [train_state]

    def train():
        train_box[0], metrics = compiled(train_box[0], batch)
        return metrics["loss"]

    info["train_loss_first"] = float(train())
    cases.append(Case("train", train, Bt * T))
    info["train_flops_per_step"] = train_flops_per_token(cfg, T) * Bt * T
    return cases, info


# -------------------------------------------------------------------------------------------- peer


def hf_config(cfg):
    """The peer's config: ``Qwen3Config``, or ``Qwen3MoeConfig`` for an MoE shape."""
    from transformers import Qwen3Config, Qwen3MoeConfig

    common = dict(
        vocab_size=cfg.vocab_size, hidden_size=cfg.d_model, intermediate_size=cfg.mlp_dim,
        num_hidden_layers=cfg.n_layers, num_attention_heads=cfg.n_heads,
        num_key_value_heads=cfg.n_kv_heads, head_dim=cfg.head_dim, rms_norm_eps=cfg.norm_eps,
        rope_parameters={"rope_theta": cfg.rope_theta, "rope_type": "default"},
        tie_word_embeddings=cfg.tie_embeddings, max_position_embeddings=8192, pad_token_id=0,
        bos_token_id=None, eos_token_id=None)
    if not cfg.num_experts:
        return Qwen3Config(**common)
    return Qwen3MoeConfig(**common, num_experts=cfg.num_experts, num_experts_per_tok=cfg.num_experts_per_tok,
                          moe_intermediate_size=cfg.moe_intermediate_size, norm_topk_prob=cfg.norm_topk_prob,
                          decoder_sparse_step=cfg.decoder_sparse_step, mlp_only_layers=list(cfg.mlp_only_layers))


def hf_device() -> str:
    """The peer's device, chosen once: ``cuda`` when torch sees a GPU, else ``cpu``."""
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"


def hf_precision(cfg) -> str:
    """The peer's precision: float32, or float32 parameters under bfloat16 autocast when our model computes in
    bfloat16 (ours keeps float32 parameters and computes in bfloat16 too)."""
    return "float32" if cfg.dtype == "float32" else f"float32+autocast_{cfg.dtype}"


def setup_hf(cfg, sizes: BenchSizes, threads: int = 2) -> tuple[list[Case], dict]:
    """The peer: ``transformers`` Qwen3 (Qwen3-MoE for an MoE shape) of the same shape on PyTorch (CUDA when torch
    sees a GPU, else the CPU), warmed up."""
    import contextlib

    import torch
    from transformers import Qwen3ForCausalLM, Qwen3MoeForCausalLM

    device = hf_device()
    torch.set_num_threads(threads)
    torch.manual_seed(0)
    info: dict = {"hf_threads": threads, "torch_version": torch.__version__, "hf_device": device,
                  "hf_dtype": hf_precision(cfg)}
    if device == "cuda":
        info["hf_device"] = f"cuda ({torch.cuda.get_device_name(0)})"
    model = (Qwen3MoeForCausalLM if cfg.num_experts else Qwen3ForCausalLM)(hf_config(cfg)).float().to(device)
    autocast = (contextlib.nullcontext if cfg.dtype == "float32" else
                functools.partial(torch.autocast, device_type=device, dtype=getattr(torch, cfg.dtype)))
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    rng = np.random.default_rng(0)
    B, P, N = sizes.hf_decode_batch, sizes.prompt_len, sizes.new_tokens
    prompts = torch.tensor(rng.integers(0, cfg.vocab_size, size=(B, P)), dtype=torch.long, device=device)
    mask = torch.ones_like(prompts)

    def gen(n=N):
        model.eval()
        with torch.no_grad(), autocast():
            seq = model.generate(input_ids=prompts, attention_mask=mask, do_sample=True, temperature=1.0,
                                 top_k=0, top_p=1.0, max_new_tokens=n, min_new_tokens=n, pad_token_id=0)
        sync()
        assert seq.shape == (B, P + n)
        return seq

    gen(4)  # warm-up

    Bt, T = sizes.train_batch, sizes.train_seq
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, weight_decay=0.01)
    tokens = torch.tensor(rng.integers(0, cfg.vocab_size, size=(Bt, T)), dtype=torch.long, device=device)

    def step():
        model.train()
        with autocast():
            loss = model(input_ids=tokens, labels=tokens).loss
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss.item()

    info["hf_train_loss_first"] = step()  # warm-up
    return [Case("hf_decode", gen, B * N), Case("hf_train", step, Bt * T)], info


# -------------------------------------------------------------------------------------------- main


def run(sizes: BenchSizes, *, hf: bool = True) -> dict:
    """Set everything up, then time the workloads in interleaved rounds (see module docstring)."""
    cfg = get_model_config(sizes.preset, **dict(sizes.overrides))
    figures = {
        "preset": sizes.preset,
        "backend": jax.default_backend(),
        "cpu": platform.processor() or platform.machine(),
        "jax_version": jax.__version__,
        "device": jax.devices()[0].device_kind,
        "decode_batch": sizes.decode_batches[0],
        "prompt_len": sizes.prompt_len,
        "new_tokens": sizes.new_tokens,
        "train_batch": [sizes.train_batch, sizes.train_seq],
        "train_micro_batches": sizes.train_micro_batches,
        "decode_phases": sizes.decode_phases,
        "decode_devices": sizes.decode_devices,
        "params": cfg.num_params(),
        "rounds": sizes.repeats,
        "load_avg_1m_start": os.getloadavg()[0],  # other processes on the machine skew every figure
    }
    cases, info = setup_ours(cfg, sizes)
    figures.update(info)
    figures["peak_memory_gb"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20
    if hf:
        hf_cases, hf_info = setup_hf(cfg, sizes)
        figures.update(hf_info)
        # Interleave so that each of ours runs next to its peer: drifting load hits both alike.
        order = {c.name: c for c in cases + hf_cases}
        names = [f"decode_b{sizes.decode_batches[0]}", "hf_decode", "train", "hf_train"]
        names += [c.name for c in cases if c.name not in names]
        cases = [order[n] for n in names]

    peak_fn = matmul_peak_fn(sizes.matmul_n, dtype=cfg.compute_dtype)
    figures["matmul_dtype"] = str(cfg.compute_dtype)
    times: dict[str, list[float]] = {c.name: [] for c in cases}
    peaks: list[float] = []
    for _ in range(sizes.repeats):
        peaks.append(peak_fn())
        for c in cases:
            t0 = time.perf_counter()
            jax.block_until_ready(c.fn())
            times[c.name].append(time.perf_counter() - t0)
    peaks.append(peak_fn())
    figures["load_avg_1m_end"] = os.getloadavg()[0]
    peak = max(peaks)
    figures["matmul_peak_gflops"] = peak / 1e9
    figures["matmul_peak_samples_gflops"] = [p / 1e9 for p in peaks]

    tps = {c.name: c.tokens / float(np.median(times[c.name])) for c in cases}
    for B in sizes.decode_batches:
        figures[f"decode_tokens_per_s_b{B}"] = tps[f"decode_b{B}"]
        figures[f"decode_s_b{B}"] = float(np.median(times[f"decode_b{B}"]))
    figures["decode_tokens_per_s"] = tps[f"decode_b{sizes.decode_batches[0]}"]
    figures["prefill_tokens_per_s"] = tps["prefill"]
    figures["train_step_s"] = float(np.median(times["train"]))
    figures["train_step_samples_s"] = times["train"]
    figures["train_tokens_per_s"] = tps["train"]
    figures["train_tflops_per_step"] = figures.pop("train_flops_per_step") / 1e12
    figures["train_mfu"] = figures["train_tflops_per_step"] * 1e12 / figures["train_step_s"] / peak
    if hf:
        figures["hf_decode_s"] = float(np.median(times["hf_decode"]))
        figures["hf_decode_tokens_per_s"] = tps["hf_decode"]
        figures["hf_train_step_s"] = float(np.median(times["hf_train"]))
        figures["hf_train_step_samples_s"] = times["hf_train"]
        figures["hf_train_tokens_per_s"] = tps["hf_train"]
        # Ratios per round (ours and the peer timed back to back), then the median over rounds.
        dec = f"decode_b{sizes.decode_batches[0]}"
        ratio = lambda a, b, ta, tb: float(np.median(
            [(ta / x) / (tb / y) for x, y in zip(times[a], times[b], strict=True)]))
        figures["decode_vs_hf"] = ratio(dec, "hf_decode", figures["decode_batch"] * sizes.new_tokens,
                                        sizes.hf_decode_batch * sizes.new_tokens)
        figures["train_vs_hf"] = ratio("train", "hf_train", 1.0, 1.0)
    else:
        figures["hf_decode_tokens_per_s"] = None
        figures["hf_train_tokens_per_s"] = None
        figures["hf_device"] = None
    return figures


def choose_sizes(shape: str, *, quick: bool = False, full: bool = False) -> BenchSizes:
    """The sizes a command runs (before its flags' overrides): --quick's, --full's, or the default for the shape."""
    if quick:
        return QUICK
    if shape == "qwen3-0.6b":
        return QWEN3_06B_FULL if full else QWEN3_06B
    return FULL if full else MOE_DEFAULT if shape == "moe" else DEFAULT


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="tiny sizes (seconds); for tests")
    parser.add_argument("--full", action="store_true",
                        help="the long version: 3 rounds, decode at batch 32 and 64; with --shape=moe, our dense "
                             "shape after the MoE pair")
    parser.add_argument("--shape", choices=tuple(SHAPES), default="dense",
                        help="dense: the bench shape; moe: bench-moe against HF Qwen3-MoE, then dense bench; "
                             "qwen3-0.6b: random weights at Qwen3-0.6B's shape, sized for a GPU")
    parser.add_argument("--no-hf", action="store_true", help="skip the transformers peer")
    parser.add_argument("--repeats", type=int, default=None)
    parser.add_argument("--decode-phases", type=int, default=None,
                        help="phases of the sampler's decode loop (1: one loop over the whole cache)")
    parser.add_argument("--decode-devices", type=int, default=None,
                        help="CPU devices our decode batch is split over (default: one per core; 1: one "
                             "device, its matmuls threaded over the cores)")
    parser.add_argument("--train-micro-batches", type=int, default=None,
                        help="micro-batches the train step accumulates over (1: the whole batch at once)")
    parser.add_argument("--decode-batch", type=int, default=None, help="our decode batch and the peer's (one batch)")
    parser.add_argument("--prompt-len", type=int, default=None)
    parser.add_argument("--new-tokens", type=int, default=None)
    parser.add_argument("--train-batch", type=int, default=None, help="rows of the train step's batch")
    parser.add_argument("--train-seq", type=int, default=None, help="tokens per row of the train step's batch")
    args = parser.parse_args(argv)
    if args.quick and args.full:
        parser.error("--quick and --full: one or the other")
    sizes = choose_sizes(args.shape, quick=args.quick, full=args.full)
    if args.decode_batch is not None:
        if args.decode_batch < 1:
            parser.error(f"--decode-batch must be >= 1, got {args.decode_batch}")
        sizes = dataclasses.replace(sizes, decode_batches=(args.decode_batch,), hf_decode_batch=args.decode_batch)
    for field, value in (("repeats", args.repeats), ("decode_phases", args.decode_phases),
                         ("decode_devices", args.decode_devices),
                         ("train_micro_batches", args.train_micro_batches), ("prompt_len", args.prompt_len),
                         ("new_tokens", args.new_tokens), ("train_batch", args.train_batch),
                         ("train_seq", args.train_seq)):
        if value is not None:
            if value < 1:
                parser.error(f"--{field.replace('_', '-')} must be >= 1, got {value}")
            sizes = dataclasses.replace(sizes, **{field: value})
    cores = os.cpu_count() or 1
    host_devices(sizes.decode_devices or cores)  # before JAX runs anything
    preset, dense_preset = (QUICK_SHAPES if args.quick else SHAPES)[args.shape]
    # Default decode devices: one per core for the dense shapes; one for the MoE shape, whose decode step is bound by
    # reading the experts' weights, which every device of a split batch reads in full; one on a GPU.
    if jax.default_backend() != "cpu":
        cores = 1
        if args.decode_devices is None:  # --quick's 2 CPU devices: one GPU
            sizes = dataclasses.replace(sizes, decode_devices=0)
    shape_devices = 1 if args.shape == "moe" else cores
    figures = run(dataclasses.replace(sizes, preset=preset, decode_devices=sizes.decode_devices or shape_devices),
                  hf=not args.no_hf)
    if dense_preset is not None:
        figures = {MOE_KEYS.get(k, f"moe_{k}"): v for k, v in figures.items()}
        figures["shape"] = args.shape
    if dense_preset is not None and (args.full or args.quick):
        dense = run(dataclasses.replace(sizes, preset=dense_preset, decode_devices=sizes.decode_devices or cores),
                    hf=False)
        figures.update({f"dense_{k}": v for k, v in dense.items() if not k.startswith("hf_")})
    for k, v in figures.items():
        if isinstance(v, float):
            print(f"{k:>28s}: {v:,.4g}")
    emit(figures)
    return figures


if __name__ == "__main__":
    main()
