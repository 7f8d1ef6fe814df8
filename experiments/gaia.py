"""M-GRPO on the offline world, evaluated gaia-style. Presets: smoke, local, figures, paper.

Run (the preset after the colon, optionally a mode after a comma):

    python launch/tpu_run.py --config=experiments/gaia.py:local --workdir=runs/gaia-local
    python launch/tpu_run.py --config=experiments/gaia.py:local,frozen_sub --workdir=runs/gaia-frozen
    python launch/tpu_run.py --config=experiments/gaia.py:paper --workdir=gs://BUCKET/runs/gaia

With no argument the preset is `local` on a machine without accelerators and `paper` on a TPU.
"""

from mgrpo_jax.config import default_preset
from mgrpo_jax.config import get_config as _get_config


def get_config(arg: str | None = None):
    return _get_config("gaia", arg or default_preset())
