"""Model benchmark: our sampler and train step vs. Hugging Face ``transformers`` on PyTorch CPU.

    python -m mgrpo_jax.bench.model            # the fixed 'bench' shape (issue 3 part 6)
    python -m mgrpo_jax.bench.model --quick    # tiny sizes, seconds (what the test runs)

Shape: Qwen-3 style, vocab 2048, d_model 256, 4 layers, 4 query / 2 KV heads, head_dim 64, MLP 1024, f32.

What is timed (each figure is the median of ``--repeats`` timed calls after a warm-up/compile call):

* ``decode``: ``Sampler.generate`` at batch 32 and 64, prompt 128 random ids, 256 new tokens, temperature
  1, no top-k/top-p, no stop tokens (every row generates all 256). tokens/s = batch * 256 / wall time of
  the whole call (prefill included, as in HF ``generate()``); ``decode_tokens_per_s`` is batch 32.
* ``prefill``: one cached forward over batch 32 x 128 prompt tokens; tokens/s = 32 * 128 / time.
* ``train``: one jitted AdamW step (next-token cross-entropy, forward + backward + update, parameters and
  optimizer state donated) at batch 32 x 384 tokens; tokens/s = 32 * 384 / time. MFU = model FLOPs per
  step / time / matmul peak, where model FLOPs = 6 * (matmul parameters) * tokens + the attention score and
  value matmuls (3 * 4 * T * H * head_dim per token per layer, counted over the full T x T square as
  computed), and the peak is the best of three timings (start, just before and just after the train
  step) of a jitted 2048^2 float32 matmul in this run; taking the best keeps the ratio conservative
  when other work on the machine slows some of the timings.
* the peer: ``transformers`` ``Qwen3ForCausalLM`` of the same shape, float32, ``torch.set_num_threads(2)``:
  ``generate()`` at batch 32 (same prompt length, ``do_sample=True``, temperature 1, ``top_k=0``,
  ``min_new_tokens=max_new_tokens=256``) and a ``torch.optim.AdamW`` step at batch 32 x 384.
* ``peak_memory_gb``: the process's peak resident memory (``ru_maxrss``) after the JAX parts, before the
  peer runs (it includes the Python/JAX runtime itself).

The last stdout line is one JSON object (see ``emit``).
"""

from __future__ import annotations

import argparse
import dataclasses
import platform
import resource
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

from mgrpo_jax.bench.common import emit, time_call
from mgrpo_jax.model import Transformer, get_model_config
from mgrpo_jax.sampling import NO_STOP, Sampler


@dataclasses.dataclass(frozen=True)
class BenchSizes:
    preset: str = "bench"
    decode_batches: tuple[int, ...] = (32, 64)
    prompt_len: int = 128
    new_tokens: int = 256
    train_batch: int = 32
    train_seq: int = 384
    hf_decode_batch: int = 32
    matmul_n: int = 2048
    repeats: int = 3
    overrides: tuple[tuple[str, object], ...] = ()


QUICK = BenchSizes(preset="tiny", decode_batches=(2,), prompt_len=8, new_tokens=8, train_batch=2,
                   train_seq=16, hf_decode_batch=2, matmul_n=256, repeats=1,
                   overrides=(("n_layers", 1), ("vocab_size", 256)))


# --------------------------------------------------------------------------------------------- peak


def matmul_peak_flops(n: int = 2048, repeats: int = 5) -> float:
    """Best observed float32 FLOP/s of one jitted n x n @ n x n matmul."""
    a = jax.random.normal(jax.random.key(0), (n, n), jnp.float32)
    b = jax.random.normal(jax.random.key(1), (n, n), jnp.float32)
    f = jax.jit(jnp.matmul)
    t = time_call(lambda: f(a, b), warmup=2, repeats=repeats)
    return 2.0 * n**3 / t["min_s"]


# ------------------------------------------------------------------------------------------- model


def build_model(cfg, seed: int = 0) -> Transformer:
    """The model with its parameters created in one jitted call (eager init dispatches op by op)."""
    graphdef = nnx.graphdef(nnx.eval_shape(lambda: Transformer(cfg, rngs=nnx.Rngs(0))))
    state = jax.jit(lambda k: nnx.state(Transformer(cfg, rngs=nnx.Rngs(k))))(jax.random.key(seed))
    return nnx.merge(graphdef, state)


def train_flops_per_token(cfg, seq: int) -> float:
    """Model FLOPs of forward + backward per token (see module docstring)."""
    d, h, kv, dh, f = cfg.d_model, cfg.n_heads, cfg.n_kv_heads, cfg.head_dim, cfg.mlp_dim
    per_layer = d * h * dh * 2 + d * kv * dh * 2 + 3 * d * f
    matmul_params = cfg.n_layers * per_layer + d * cfg.vocab_size
    attention = cfg.n_layers * 4 * seq * h * dh  # QK^T and PV, forward, per token
    return 6.0 * matmul_params + 3.0 * attention


def make_train_step(graphdef, tx):
    def loss_fn(params, tokens):
        model = nnx.merge(graphdef, params)
        B, T = tokens.shape
        pos = jnp.broadcast_to(jnp.arange(T, dtype=jnp.int32)[None], (B, T))
        logits, _ = model(tokens, pos)
        losses = optax.softmax_cross_entropy_with_integer_labels(logits[:, :-1], tokens[:, 1:])
        return jnp.mean(losses)

    def step(params, opt_state, tokens):
        loss, grads = jax.value_and_grad(loss_fn)(params, tokens)
        updates, opt_state = tx.update(grads, opt_state, params)
        params = optax.apply_updates(params, updates)
        return params, opt_state, loss

    return jax.jit(step, donate_argnums=(0, 1))


def bench_ours(cfg, sizes: BenchSizes, peaks: list[float]) -> dict:
    """Our decode, prefill and train figures. Appends fresh matmul-peak measurements to ``peaks``
    (before and after the train step) so the MFU divides by the best peak seen in the run."""
    out: dict = {}
    model = build_model(cfg)
    rng = np.random.default_rng(0)
    sampler = Sampler(model, pad_id=0)
    P, N = sizes.prompt_len, sizes.new_tokens
    for B in sizes.decode_batches:
        prompts = rng.integers(0, cfg.vocab_size, size=(B, P)).astype(np.int32)
        lengths = np.full((B,), P, np.int32)
        stops = np.full((B, 4), NO_STOP, np.int32)
        calls = iter(range(1 << 30))

        def run(prompts=prompts, lengths=lengths, stops=stops, calls=calls):
            return sampler.generate(prompts, lengths, max_new=N, rng=next(calls), temperature=1.0,
                                    stop_tokens=stops)

        t0 = time.perf_counter()
        res = jax.block_until_ready(run())
        out[f"decode_compile_s_b{B}"] = time.perf_counter() - t0
        assert int(np.asarray(res.lengths).min()) == N, "bench rows must not stop early"
        t = time_call(run, warmup=0, repeats=sizes.repeats)
        out[f"decode_tokens_per_s_b{B}"] = B * N / t["median_s"]
        out[f"decode_s_b{B}"] = t["median_s"]

    # Prefill alone: one cached forward over the prompts.
    B = sizes.decode_batches[0]
    graphdef, state = nnx.split(model)
    prompts = jnp.asarray(rng.integers(0, cfg.vocab_size, size=(B, P)), jnp.int32)
    pos = jnp.broadcast_to(jnp.arange(P, dtype=jnp.int32)[None], (B, P))

    @jax.jit
    def prefill(state, cache, tokens):
        m = nnx.merge(graphdef, state)
        logits, cache = m(tokens, pos, cache=cache, cache_index=jnp.int32(0))
        return logits[:, -1], cache

    cache = model.init_cache(B, P + N)
    t = time_call(lambda: prefill(state, cache, prompts), warmup=1, repeats=sizes.repeats)
    out["prefill_tokens_per_s"] = B * P / t["median_s"]

    # Train step.
    Bt, T = sizes.train_batch, sizes.train_seq
    tx = optax.adamw(1e-4, weight_decay=0.01)
    params = nnx.state(build_model(cfg, seed=1), nnx.Param)
    graphdef = nnx.graphdef(model)
    opt_state = jax.jit(tx.init)(params)
    step = make_train_step(graphdef, tx)
    tokens = jnp.asarray(rng.integers(0, cfg.vocab_size, size=(Bt, T)), jnp.int32)
    t0 = time.perf_counter()
    compiled = step.lower(params, opt_state, tokens).compile()
    out["train_compile_s"] = time.perf_counter() - t0
    mem = compiled.memory_analysis()
    if mem is not None:
        out["train_step_temp_gb"] = getattr(mem, "temp_size_in_bytes", 0) / 2**30
    state_box = [params, opt_state]

    def train():
        p, o, loss = compiled(state_box[0], state_box[1], tokens)
        state_box[0], state_box[1] = p, o
        return loss

    peaks.append(matmul_peak_flops(sizes.matmul_n))
    t = time_call(train, warmup=1, repeats=sizes.repeats)
    peaks.append(matmul_peak_flops(sizes.matmul_n))
    peak = max(peaks)
    out["matmul_peak_gflops"] = peak / 1e9
    out["matmul_peak_samples_gflops"] = [p / 1e9 for p in peaks]
    out["train_step_s"] = t["median_s"]
    out["train_tokens_per_s"] = Bt * T / t["median_s"]
    flops = train_flops_per_token(cfg, T) * Bt * T
    out["train_tflops_per_step"] = flops / 1e12
    out["train_mfu"] = flops / t["median_s"] / peak
    out["train_loss"] = float(train())
    out["peak_memory_gb"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20
    return out


# -------------------------------------------------------------------------------------------- peer


def hf_config(cfg):
    from transformers import Qwen3Config

    return Qwen3Config(
        vocab_size=cfg.vocab_size, hidden_size=cfg.d_model, intermediate_size=cfg.mlp_dim,
        num_hidden_layers=cfg.n_layers, num_attention_heads=cfg.n_heads,
        num_key_value_heads=cfg.n_kv_heads, head_dim=cfg.head_dim, rms_norm_eps=cfg.norm_eps,
        rope_parameters={"rope_theta": cfg.rope_theta, "rope_type": "default"},
        tie_word_embeddings=cfg.tie_embeddings, max_position_embeddings=8192, pad_token_id=0,
        bos_token_id=None, eos_token_id=None)


def bench_hf(cfg, sizes: BenchSizes, threads: int = 2) -> dict:
    import torch
    from transformers import Qwen3ForCausalLM

    torch.set_num_threads(threads)
    torch.manual_seed(0)
    out: dict = {"hf_threads": threads, "torch_version": torch.__version__}
    model = Qwen3ForCausalLM(hf_config(cfg)).float().eval()
    rng = np.random.default_rng(0)
    B, P, N = sizes.hf_decode_batch, sizes.prompt_len, sizes.new_tokens
    prompts = torch.tensor(rng.integers(0, cfg.vocab_size, size=(B, P)), dtype=torch.long)
    mask = torch.ones_like(prompts)

    def gen(n):
        with torch.no_grad():
            return model.generate(input_ids=prompts, attention_mask=mask, do_sample=True, temperature=1.0,
                                  top_k=0, top_p=1.0, max_new_tokens=n, min_new_tokens=n, pad_token_id=0)

    gen(4)  # warm-up
    times = []
    for _ in range(sizes.repeats):
        t0 = time.perf_counter()
        seq = gen(N)
        times.append(time.perf_counter() - t0)
    assert seq.shape == (B, P + N)
    out["hf_decode_s"] = float(np.median(times))
    out["hf_decode_tokens_per_s"] = B * N / out["hf_decode_s"]

    Bt, T = sizes.train_batch, sizes.train_seq
    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, weight_decay=0.01)
    tokens = torch.tensor(rng.integers(0, cfg.vocab_size, size=(Bt, T)), dtype=torch.long)

    def step():
        loss = model(input_ids=tokens, labels=tokens).loss
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss

    step()  # warm-up
    times = []
    for _ in range(sizes.repeats):
        t0 = time.perf_counter()
        step()
        times.append(time.perf_counter() - t0)
    out["hf_train_step_s"] = float(np.median(times))
    out["hf_train_tokens_per_s"] = Bt * T / out["hf_train_step_s"]
    return out


# -------------------------------------------------------------------------------------------- main


def run(sizes: BenchSizes, *, hf: bool = True) -> dict:
    cfg = get_model_config(sizes.preset, **dict(sizes.overrides))
    peaks = [matmul_peak_flops(sizes.matmul_n)]
    figures = {
        "preset": sizes.preset,
        "backend": jax.default_backend(),
        "cpu": platform.processor() or platform.machine(),
        "jax_version": jax.__version__,
        "decode_batch": sizes.decode_batches[0],
        "prompt_len": sizes.prompt_len,
        "new_tokens": sizes.new_tokens,
        "train_batch": [sizes.train_batch, sizes.train_seq],
        "params": cfg.num_params(),
    }
    figures.update(bench_ours(cfg, sizes, peaks))
    figures["decode_tokens_per_s"] = figures[f"decode_tokens_per_s_b{sizes.decode_batches[0]}"]
    if hf:
        figures.update(bench_hf(cfg, sizes))
        figures["decode_vs_hf"] = figures["decode_tokens_per_s"] / figures["hf_decode_tokens_per_s"]
        figures["train_vs_hf"] = figures["train_tokens_per_s"] / figures["hf_train_tokens_per_s"]
    else:
        figures["hf_decode_tokens_per_s"] = None
        figures["hf_train_tokens_per_s"] = None
    return figures


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="tiny sizes (seconds); for tests")
    parser.add_argument("--no-hf", action="store_true", help="skip the transformers peer")
    parser.add_argument("--repeats", type=int, default=None)
    args = parser.parse_args(argv)
    sizes = QUICK if args.quick else BenchSizes()
    if args.repeats:
        sizes = dataclasses.replace(sizes, repeats=args.repeats)
    figures = run(sizes, hf=not args.no_hf)
    for k, v in figures.items():
        if isinstance(v, float):
            print(f"{k:>28s}: {v:,.4g}")
    emit(figures)
    return figures


if __name__ == "__main__":
    main()
