"""M-GRPO on the offline world, evaluated xbench-style. Presets: smoke, local, figures, paper.

Run (the preset after the colon, optionally a mode after a comma):

    python launch/tpu_run.py --config=experiments/xbench.py:local --workdir=runs/xbench-local
    python launch/tpu_run.py --config=experiments/xbench.py:local,frozen_sub --workdir=runs/xbench-frozen
    python launch/tpu_run.py --config=experiments/xbench.py:paper --workdir=gs://BUCKET/runs/xbench

With no argument the preset is `local` on a machine without accelerators and `paper` on a TPU.
"""

from mgrpo_jax.config import default_preset
from mgrpo_jax.config import get_config as _get_config


def get_config(arg: str | None = None):
    return _get_config("xbench", arg or default_preset())
