"""M-GRPO on the offline world, evaluated webwalker-style. Presets: smoke, local, figures, paper, paper_dense,
paper_lora.

Run (the preset after the colon, optionally a mode after a comma):

    python launch/tpu_run.py --config=experiments/webwalker.py:local --workdir=runs/webwalker-local
    python launch/tpu_run.py --config=experiments/webwalker.py:local,frozen_sub --workdir=runs/webwalker-frozen
    python launch/tpu_run.py --config=experiments/webwalker.py:paper --workdir=gs://BUCKET/runs/webwalker

With no argument the preset is `local` on a machine without accelerators and `paper` on a TPU. The presets every
benchmark shares are in mgrpo_jax/presets.py (`mgrpo_jax.config.get_config` resolves the same ones); one for this
experiment only goes into the table below.
"""

from mgrpo_jax import presets
from mgrpo_jax.config import resolve

# name -> a function editing the defaults (mgrpo_jax.config.base_config) in place.
PRESETS = dict(presets.PRESETS)


def get_config(arg: str | None = None):
    return resolve("webwalker", PRESETS, arg)
