"""Hugging Face checkpoint benchmark: how long `load_hf_params` takes to put a safetensors checkpoint on a device.

    python -m mgrpo_jax.bench.checkpoint            # a 64M-parameter Llama (llama-small, vocab 32,000), float32
    python -m mgrpo_jax.bench.checkpoint --quick    # llama-tiny at vocab 512: seconds (what the test runs)

The checkpoint is written once by `save_hf` (random weights) to a temporary folder; then `--repeats` loads, each
`load_hf_params` onto the default device up to `jax.block_until_ready`, with the file in the page cache after the
first (a warm-up load not counted), so what is timed is the reader's own work: header, views, the transposes to our
layout, the copies into device buffers. `load_s` is the median, `load_min_s` the best; `load_cpu_s` the median
process CPU time, which other load on the machine inflates less than the wall time. `load_gb_per_s`: checkpoint
bytes over `load_min_s`. `save_s`: the one `save_hf`.

The last stdout line is one JSON object (see `emit`).
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time

import jax
from flax import nnx

from mgrpo_jax.bench.common import emit
from mgrpo_jax.model import Transformer, get_model_config
from mgrpo_jax.model.checkpoint_hf import load_hf_params, safetensors_files, save_hf

SHAPES = {"full": ("llama-small", {"vocab_size": 32_000, "tie_embeddings": False}),
          "quick": ("llama-tiny", {"vocab_size": 512, "tie_embeddings": False})}


def run(preset: str, overrides: dict, repeats: int) -> dict:
    cfg = get_model_config(preset, **overrides)
    graphdef = nnx.graphdef(nnx.eval_shape(lambda: Transformer(cfg, rngs=nnx.Rngs(0))))
    state = jax.jit(lambda key: nnx.state(Transformer(cfg, rngs=nnx.Rngs(key))))(jax.random.key(0))
    with tempfile.TemporaryDirectory(prefix="bench_ckpt_") as folder:
        start = time.perf_counter()
        save_hf(nnx.merge(graphdef, state), folder)
        save_s = time.perf_counter() - start
        size = sum(os.path.getsize(f) for f in safetensors_files(folder))
        jax.block_until_ready(load_hf_params(folder, cfg))  # warm-up: page cache, JAX's dispatch
        wall, cpu = [], []
        for _ in range(repeats):
            start, start_cpu = time.perf_counter(), time.process_time()
            jax.block_until_ready(load_hf_params(folder, cfg))
            wall.append(time.perf_counter() - start)
            cpu.append(time.process_time() - start_cpu)
    return {"preset": preset, "overrides": overrides, "params_m": cfg.num_params() / 1e6, "file_mb": size / 1e6,
            "repeats": repeats, "load_s": statistics.median(wall), "load_min_s": min(wall), "load_samples_s": wall,
            "load_cpu_s": statistics.median(cpu), "load_gb_per_s": size / 1e9 / min(wall), "save_s": save_s,
            "load_avg_1m": os.getloadavg()[0]}  # other processes on the machine skew the wall times


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="tiny shape, 2 loads: seconds")
    parser.add_argument("--repeats", type=int, default=None, help="timed loads (default 7; --quick: 2)")
    args = parser.parse_args()
    preset, overrides = SHAPES["quick" if args.quick else "full"]
    figures = run(preset, overrides, args.repeats or (2 if args.quick else 7))
    f = figures
    print(f"{preset} ({f['params_m']:.1f}M parameters, {f['file_mb']:.0f} MB): load {f['load_s']:.3f} s median, "
          f"{f['load_min_s']:.3f} s best ({f['load_gb_per_s']:.2f} GB/s), {f['load_cpu_s']:.3f} s CPU; save "
          f"{f['save_s']:.2f} s; load average {f['load_avg_1m']:.1f}")
    emit(figures)


if __name__ == "__main__":
    main()
