"""M-GRPO on the offline world, evaluated xbench-style. Presets: smoke, local, figures, paper, paper_dense, paper_lora.

Run (the preset after the colon, optionally a mode after a comma):

    python launch/tpu_run.py --config=experiments/xbench.py:local --workdir=runs/xbench-local
    python launch/tpu_run.py --config=experiments/xbench.py:local,frozen_sub --workdir=runs/xbench-frozen
    python launch/tpu_run.py --config=experiments/xbench.py:paper --workdir=gs://BUCKET/runs/xbench

With no argument the preset is `local` on a machine without accelerators and `paper` on a TPU. The presets every
benchmark shares are in mgrpo_jax/presets.py (`mgrpo_jax.config.get_config` resolves the same ones); one for this
experiment only goes into the table below.
"""

from mgrpo_jax import presets
from mgrpo_jax.config import resolve

# name -> a function editing the defaults (mgrpo_jax.config.base_config) in place.
PRESETS = dict(presets.PRESETS)


def get_config(arg: str | None = None):
    return resolve("xbench", PRESETS, arg)
