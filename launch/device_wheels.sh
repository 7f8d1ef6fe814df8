#!/usr/bin/env bash
# The wheels launch/device_bench.sh needs on the lent GPU machine, whose image lacks them (it has jax, flax, optax,
# orbax, tensorstore, torch, transformers, sentencepiece; nothing can be fetched there): into .whl/ (ignored by git),
# for its Python 3.12 on x86-64. Run here, then give the device tool carry [".whl"]. About 4.5 MB.
set -euo pipefail
cd "$(dirname "$0")/.."
PY="${PYTHON:-python3}"
"$PY" -m pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_24_x86_64 \
  --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 --platform manylinux1_x86_64 -d .whl \
  grain==0.2.18 array-record==0.8.6 portpicker==1.6.0 ml-collections==1.1.0
ls -la .whl
