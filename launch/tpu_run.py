"""Entry point: `python launch/tpu_run.py --config=experiments/xbench.py[:preset[,mode]] --workdir=DIR`.

The same command runs the `local` preset on a laptop CPU and the `paper` preset on every host of a TPU pod
slice (where `jax.distributed` is initialised from the TPU environment). N processes on one machine (or on
hosts without a TPU environment) form one job with `--coordinator=HOST:PORT --num_processes=N --process_id=I`.
Logic lives in `mgrpo_jax.train.trainer`; this file parses flags, sets up processes and logging, and calls it.
"""

import logging
import os
import sys

from absl import app, flags
from ml_collections import config_flags

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # run from a checkout

from mgrpo_jax.config import BENCHMARKS, MODES, PRESETS  # noqa: E402

_CONFIG = config_flags.DEFINE_config_file(
    "config", "experiments/xbench.py",
    f"Experiment config file[:preset[,mode]], e.g. experiments/xbench.py:local,frozen_sub. Files: "
    f"{', '.join(f'experiments/{b}.py' for b in BENCHMARKS)}. Presets: {', '.join(PRESETS)} (default: local "
    f"without accelerators, paper on TPU; experiments/presets.py). Modes: {', '.join(MODES)} (default: "
    f"{MODES[0]}). Override any field with --config.FIELD=VALUE, e.g. --config.main.loss=gspo.")
_WORKDIR = flags.DEFINE_string("workdir", "runs/default", "Checkpoints, logs and plots go here; a run resumes from it.")
_ROLE = flags.DEFINE_enum("role", "colocated", ["colocated", "main", "sub"],
                          "colocated: both agents in this job. main / sub: one side of the decoupled mode.")
_DISTRIBUTED = flags.DEFINE_bool("distributed", None, "Initialise jax.distributed (default: on TPU pods, or when "
                                  "--coordinator is given).")
_COORDINATOR = flags.DEFINE_string("coordinator", None, "host:port of process 0's coordinator, for processes started "
                                   "by hand (e.g. 127.0.0.1:12345 for N CPU processes on one machine). TPU pods "
                                   "need none: jax.distributed reads the TPU environment.")
_NUM_PROCESSES = flags.DEFINE_integer("num_processes", None, "How many processes form the job (with --coordinator).")
_PROCESS_ID = flags.DEFINE_integer("process_id", None, "This process's index in [0, num_processes).")


def main(argv):
    del argv
    import jax

    explicit = _COORDINATOR.value is not None
    if _DISTRIBUTED.value or (_DISTRIBUTED.value is None and (
            explicit or os.environ.get("TPU_WORKER_HOSTNAMES", "").count(","))):
        if explicit:
            # CPU processes need a collectives backend to form one mesh (TPUs have their own interconnect).
            jax.config.update("jax_cpu_collectives_implementation", "gloo")
            jax.distributed.initialize(coordinator_address=_COORDINATOR.value, num_processes=_NUM_PROCESSES.value,
                                       process_id=_PROCESS_ID.value)
        else:
            jax.distributed.initialize()
    level = logging.INFO if jax.process_index() == 0 else logging.ERROR  # only process 0 logs progress
    logging.basicConfig(level=level, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    logging.getLogger().setLevel(level)  # absl's handler may already be installed, making basicConfig a no-op
    logging.getLogger("absl").setLevel(logging.WARNING)  # Orbax logs every checkpoint file at INFO
    config = _CONFIG.value
    logging.getLogger("mgrpo_jax").info(
        "preset %s (%s backend, %d devices, %d processes), mode %s, benchmark %s, workdir %s", config.preset,
        jax.default_backend(), jax.device_count(), jax.process_count(), config.mode, config.benchmark,
        _WORKDIR.value)

    from mgrpo_jax.train.launch import run

    run(config, _WORKDIR.value, role=_ROLE.value)


if __name__ == "__main__":
    app.run(main)
