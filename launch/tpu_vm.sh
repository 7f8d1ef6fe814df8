#!/usr/bin/env bash
# Start M-GRPO runs on Cloud TPU VM slices with gcloud (README: "Running on a TPU pod", step by step).
#
#   launch/tpu_vm.sh create   NAME            # a TPU VM slice (every host of it)
#   launch/tpu_vm.sh setup    NAME            # copy this checkout to every host, install the pinned stack + libtpu
#   launch/tpu_vm.sh colocated NAME [FLAGS]   # both agents on this one slice
#   launch/tpu_vm.sh main     NAME [FLAGS]    # decoupled mode: the main agent's job on this slice
#   launch/tpu_vm.sh sub      NAME [FLAGS]    # decoupled mode: the sub-agent's job on another slice
#   launch/tpu_vm.sh logs     NAME            # follow host 0's log
#   launch/tpu_vm.sh delete   NAME
#
# Environment (defaults in brackets):
#   PROJECT      GCP project                         [gcloud's configured project]
#   ZONE         a zone with the accelerator          [us-east5-a]
#   ACCELERATOR  slice type, e.g. v5p-128, v6e-64     [v5p-128]
#   RUNTIME      TPU VM software version              [v2-alpha-tpuv5 for v5p, v2-alpha-tpuv5-lite for v5e,
#                                                      v2-alpha-tpuv6e for v6e]
#   BUCKET       gs://bucket/prefix for checkpoints, logs and the shared store (required by the run commands)
#   CONFIG       experiment config[:preset]          [experiments/xbench.py:paper]
#   RUN          run name under $BUCKET               [xbench-paper]
#   SPOT=1       create a Spot (preemptible) slice; the trainer checkpoints on SIGTERM and resumes
#
# Each run command starts `launch/tpu_run.py` on every host of the slice at once (`--worker=all`), in the
# background under nohup, logging to ~/mgrpo.log; jax.distributed finds the other hosts from the TPU
# environment, so no coordinator flag is needed. The decoupled roles share nothing but $BUCKET: the store at
# $BUCKET/$RUN/store, each role's workdir at $BUCKET/$RUN/{main,sub}.
#
# NOT EXERCISED HERE: this machine has no TPU and no GCP credentials, so this script has never run against
# real slices. What it starts was tested locally: the same tpu_run.py flags as N CPU processes
# (tests/rl/test_multiprocess.py), the two roles over a gs:// store on a GCS emulator
# (tests/rl/test_decoupled.py), and the paper preset's memory plan compiled for these topologies
# (python -m mgrpo_jax.bench.plan).
set -euo pipefail

cmd=${1:?usage: launch/tpu_vm.sh create|setup|colocated|main|sub|logs|delete NAME [FLAGS]}
name=${2:?TPU VM name}
shift 2

ZONE=${ZONE:-us-east5-a}
ACCELERATOR=${ACCELERATOR:-v5p-128}
CONFIG=${CONFIG:-experiments/xbench.py:paper}
RUN=${RUN:-xbench-paper}
case "$ACCELERATOR" in
  v5p-*) default_runtime=v2-alpha-tpuv5 ;;
  v5litepod-*|v5e-*) default_runtime=v2-alpha-tpuv5-lite ;;
  v6e-*) default_runtime=v2-alpha-tpuv6e ;;
  *) default_runtime=tpu-ubuntu2204-base ;;
esac
RUNTIME=${RUNTIME:-$default_runtime}
project_flag=()
[[ -n "${PROJECT:-}" ]] && project_flag=(--project="$PROJECT")
repo=$(cd "$(dirname "$0")/.." && pwd)

ssh_all() {
  gcloud compute tpus tpu-vm ssh "$name" --zone="$ZONE" "${project_flag[@]}" --worker=all --command="$1"
}

start_run() {  # $1: role, rest: extra flags for tpu_run.py
  local role=$1
  shift
  : "${BUCKET:?set BUCKET=gs://bucket/prefix}"
  local workdir="$BUCKET/$RUN"
  [[ "$role" != colocated ]] && workdir="$BUCKET/$RUN/$role"
  local flags="--config=$CONFIG --workdir=$workdir --role=$role --distributed --config.store=$BUCKET/$RUN/store $*"
  # JAX_PLATFORMS pins the TPU backend (a CPU fallback would silently run the paper preset on the host).
  ssh_all "cd ~/mgrpo_jax && JAX_PLATFORMS=tpu nohup .venv/bin/python launch/tpu_run.py $flags > ~/mgrpo.log 2>&1 &"
  echo "started --role=$role on every host of $name; workdir $workdir; follow: launch/tpu_vm.sh logs $name"
}

case "$cmd" in
  create)
    spot=()
    [[ "${SPOT:-0}" == 1 ]] && spot=(--spot)
    gcloud compute tpus tpu-vm create "$name" --zone="$ZONE" "${project_flag[@]}" \
      --accelerator-type="$ACCELERATOR" --version="$RUNTIME" "${spot[@]}"
    ;;
  setup)
    # The checkout as a tarball (no .git, no local venvs), unpacked on every host, then the pinned stack.
    tar -C "$repo" --exclude=.git --exclude=.venv --exclude=runs -czf /tmp/mgrpo_jax.tgz .
    gcloud compute tpus tpu-vm scp /tmp/mgrpo_jax.tgz "$name":~/mgrpo_jax.tgz --zone="$ZONE" "${project_flag[@]}" \
      --worker=all
    ssh_all "mkdir -p ~/mgrpo_jax && tar -C ~/mgrpo_jax -xzf ~/mgrpo_jax.tgz && cd ~/mgrpo_jax && \
      python3 -m venv .venv && .venv/bin/pip install -q -r requirements.txt -r requirements-tpu.txt && \
      .venv/bin/python -c 'import jax; print(jax.process_index(), jax.local_device_count(), jax.device_count())'"
    ;;
  colocated | main | sub)
    start_run "$cmd" "$@"
    ;;
  logs)
    gcloud compute tpus tpu-vm ssh "$name" --zone="$ZONE" "${project_flag[@]}" --worker=0 --command="tail -f ~/mgrpo.log"
    ;;
  delete)
    gcloud compute tpus tpu-vm delete "$name" --zone="$ZONE" "${project_flag[@]}" --quiet
    ;;
  *)
    echo "unknown command $cmd" >&2
    exit 2
    ;;
esac
