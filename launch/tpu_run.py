"""Entry point: `python launch/tpu_run.py --config=experiments/xbench.py[:preset[,mode]] --workdir=DIR`.

The same command runs the `local` preset on a laptop CPU and the `paper` preset on every host of a TPU pod
slice (where `jax.distributed` is initialised from the TPU environment). Logic lives in
`mgrpo_jax.train.trainer`; this file parses flags, sets up processes and logging, and calls it.
"""

import logging
import os
import sys

from absl import app, flags
from ml_collections import config_flags

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # run from a checkout

_CONFIG = config_flags.DEFINE_config_file("config", "experiments/xbench.py", "Experiment config file[:preset].")
_WORKDIR = flags.DEFINE_string("workdir", "runs/default", "Checkpoints, logs and plots go here; a run resumes from it.")
_ROLE = flags.DEFINE_enum("role", "colocated", ["colocated", "main", "sub"],
                          "colocated: both agents in this job. main / sub: one side of the decoupled mode.")
_DISTRIBUTED = flags.DEFINE_bool("distributed", None, "Initialise jax.distributed (default: on TPU pods).")


def main(argv):
    del argv
    import jax

    if _DISTRIBUTED.value or (_DISTRIBUTED.value is None and os.environ.get("TPU_WORKER_HOSTNAMES", "").count(",")):
        jax.distributed.initialize()
    logging.basicConfig(level=logging.INFO if jax.process_index() == 0 else logging.ERROR,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
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
