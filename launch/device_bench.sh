#!/usr/bin/env bash
# The GPU benchmarks of issue 37 item 5, as ONE command for the `device` tool (a lent machine with one NVIDIA H200,
# JAX 0.11.2 with CUDA, PyTorch and transformers preinstalled, no internet):
#
#   bash launch/device_wheels.sh            # here, once: the wheels the device image lacks, into .whl/ (ignored)
#   device run:  command "bash launch/device_bench.sh"   carry [".whl"]   timeout_s 600
#
# What it runs, each step under its own `timeout`, each step's log and JSON line written to "$OUT" (./device_out when
# OUT is unset), the whole well inside 8 minutes:
#   0. env.txt: nvidia-smi, uname, the versions of python, jax/jaxlib, flax, optax, torch, transformers, and
#      jax.devices(); the wheels of .whl/ are installed (pip --no-index into /tmp/site, nothing fetched) only if
#      grain or ml_collections is missing there.
#   1. model.log / model.json: python -m mgrpo_jax.bench.model --shape=qwen3-0.6b   (MODEL_TIMEOUT, 270 s)
#      our decode (batch 64, prompt 128, 128 new tokens), prefill and train step (8 x 1024, AdamW, bf16 compute
#      over f32 parameters) against transformers' Qwen3ForCausalLM of the same shape on the same GPU (f32
#      parameters under bf16 autocast), tokens/s and MFU against a bf16 8192^2 matmul peak measured in the run.
#   2. rollout.log / rollout.json: python -m mgrpo_jax.bench.rollout --workload=long --skip-local
#      --long-model qwen3-0.6b --long-overrides ''   (ROLLOUT_TIMEOUT, 180 s)
#      the long scripted multi-turn workload on random weights at Qwen3-0.6B's shape: the decode-slot engine
#      against the lock-step engine, episodes/s, prefill tokens per context token.
#   3. (DEVICE_BENCH_PAGED=1 only) rollout_paged.log / .json: the same with --kv-block-size=16 (PAGED_TIMEOUT, 120 s).
#   summary.txt: each step's exit status. The script exits non-zero when any step failed, after running them all.
#
# DEVICE_BENCH_QUICK=1: every step at --quick sizes (the same shape's widths at 1 layer, tiny batches): the
#   rehearsal of the plumbing, on a CPU too (PYTHON=/path/to/venv/python bash launch/device_bench.sh).
# PYTHON: the interpreter (default python3, the device image's one with torch and JAX).
# XLA_PYTHON_CLIENT_MEM_FRACTION (default here 0.45): JAX's share of the GPU, leaving the rest to the torch peer.
#
# JAX versions. The repository pins jax 0.10.2 (requirements.txt); the device has JAX 0.11.2 and this script runs
# with it, reinstalling nothing. Compatibility with 0.11.2 is UNTESTED: its wheel needs Python >= 3.12 and this
# project's machine runs 3.11, so `pip install jax==0.11.2` finds nothing here. What may differ and matter:
#   - jax.make_mesh's default axis types (explicit since 0.10; mgrpo_jax.model.sharding builds its Mesh with
#     AxisType.Auto itself), jax.sharding.use_mesh gone in favour of jax.set_mesh;
#   - jax.shard_map at top level (mgrpo_jax.model.moe, mgrpo_jax.sampling.paged), the deprecated
#     jax.experimental.shard_map / pjit and jax.experimental.multihost_utils (sampler, checkpoint);
#   - the config option jax_num_cpu_devices (mgrpo_jax.bench.common.host_devices; ignored on GPU);
#   - compiled.memory_analysis() field names (bench.model reads temp_size_in_bytes with a default);
#   - flax nnx (the image's flax version unknown; tpu-inference pins flax 0.12.10 beside jax 0.11.2, we 0.12.8).
# A failure of that kind shows in model.log / rollout.log; fix it so both versions run (issue 37 item 5).
set -u
cd "$(dirname "$0")/.."
OUT="${OUT:-$PWD/device_out}"
mkdir -p "$OUT"
PY="${PYTHON:-python3}"
QUICK="${DEVICE_BENCH_QUICK:-0}"
export PYTHONUNBUFFERED=1
export XLA_PYTHON_CLIENT_MEM_FRACTION="${XLA_PYTHON_CLIENT_MEM_FRACTION:-0.45}"
status=0
: >"$OUT/summary.txt"

{
  echo "== date: $(date -u)"
  echo "== uname: $(uname -a)"
  echo "== nvidia-smi"
  nvidia-smi 2>&1 || echo "(no nvidia-smi)"
  echo "== python: $("$PY" --version 2>&1) at $(command -v "$PY")"
} >"$OUT/env.txt" 2>&1

# The packages the image lacks (grain, ml_collections and their needs), from carried wheels only.
if ! "$PY" -c "import grain, ml_collections" >/dev/null 2>&1; then
  if ls .whl/*.whl >/dev/null 2>&1; then
    echo "== installing .whl/ into /tmp/site (no index)" >>"$OUT/env.txt"
    "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
      >>"$OUT/env.txt" 2>&1 || echo "pip install of .whl failed" >>"$OUT/env.txt"
    export PYTHONPATH="/tmp/site${PYTHONPATH:+:$PYTHONPATH}"
  else
    echo "== grain / ml_collections missing and no .whl/: run launch/device_wheels.sh here and carry .whl" \
      >>"$OUT/env.txt"
  fi
fi

"$PY" - >>"$OUT/env.txt" 2>&1 <<'EOF'
import importlib
for name in ("jax", "jaxlib", "flax", "optax", "orbax.checkpoint", "grain", "ml_collections", "numpy", "torch",
             "transformers"):
    try:
        print(f"{name}: {getattr(importlib.import_module(name), '__version__', '?')}")
    except Exception as e:  # report, do not stop: the steps below say what fails
        print(f"{name}: NOT IMPORTABLE ({type(e).__name__}: {e})")
try:
    import jax
    print("jax backend:", jax.default_backend(), "devices:", jax.devices())
    import torch
    print("torch cuda:", torch.cuda.is_available(), torch.cuda.get_device_name(0) if torch.cuda.is_available() else "")
except Exception as e:
    print("device query failed:", type(e).__name__, e)
EOF
cat "$OUT/env.txt"

# step NAME TIMEOUT_S ARGS...: runs `python -m ARGS...` under `timeout`, its output in NAME.log, its last line (the
# benchmark's JSON object) in NAME.json when it is one; records the exit status and never stops the script.
step() {
  local name="$1" limit="$2"
  shift 2
  echo "== $name (timeout ${limit}s): $PY -m $(printf "%q " "$@")" | tee -a "$OUT/summary.txt"
  local start=$SECONDS
  timeout --kill-after=10 "$limit" "$PY" -m "$@" >"$OUT/$name.log" 2>&1
  local rc=$?
  tail -n 1 "$OUT/$name.log" | "$PY" -c "import json, sys; line = sys.stdin.read(); json.loads(line); print(line, end='')" \
    >"$OUT/$name.json" 2>/dev/null || rm -f "$OUT/$name.json"
  if [ "$rc" -eq 0 ] && [ ! -s "$OUT/$name.json" ]; then rc=3; fi  # finished without its JSON line
  echo "   $name: rc=$rc in $((SECONDS - start)) s$([ "$rc" -eq 124 ] && echo ' (timed out)')" | tee -a "$OUT/summary.txt"
  [ -s "$OUT/$name.json" ] && cat "$OUT/$name.json"
  [ "$rc" -ne 0 ] && { tail -n 20 "$OUT/$name.log"; status=1; }
  return 0
}

if [ "$QUICK" = "1" ]; then
  model_args=(--shape=qwen3-0.6b --quick)
  rollout_args=(--workload=long --quick --skip-local --long-model qwen3-0.6b)  # --quick's tiny overrides
else
  model_args=(--shape=qwen3-0.6b)
  rollout_args=(--workload=long --skip-local --long-model qwen3-0.6b --long-overrides "")
fi
step model "${MODEL_TIMEOUT:-270}" mgrpo_jax.bench.model "${model_args[@]}"
step rollout "${ROLLOUT_TIMEOUT:-180}" mgrpo_jax.bench.rollout "${rollout_args[@]}"
if [ "${DEVICE_BENCH_PAGED:-0}" = "1" ]; then
  step rollout_paged "${PAGED_TIMEOUT:-120}" mgrpo_jax.bench.rollout "${rollout_args[@]}" --kv-block-size=16
fi
echo "== exit $status" | tee -a "$OUT/summary.txt"
exit "$status"
