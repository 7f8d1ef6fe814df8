"""M-GRPO on the offline world, evaluated gaia-style. Presets: smoke, local, figures, paper, paper_dense, paper_lora.

Run (the preset after the colon, optionally a mode after a comma):

    python launch/tpu_run.py --config=experiments/gaia.py:local --workdir=runs/gaia-local
    python launch/tpu_run.py --config=experiments/gaia.py:local,frozen_sub --workdir=runs/gaia-frozen
    python launch/tpu_run.py --config=experiments/gaia.py:paper --workdir=gs://BUCKET/runs/gaia

With no argument the preset is `local` on a machine without accelerators and `paper` on a TPU. The presets are
in experiments/presets.py; one for this benchmark only goes into the table below.
"""

from experiments import presets

# name -> a function editing the defaults (mgrpo_jax.config.base_config) in place.
PRESETS = {"smoke": presets.smoke, "local": presets.local, "figures": presets.figures, "paper": presets.paper,
           "paper_dense": presets.paper_dense,
           "paper_lora": presets.paper_lora}


def get_config(arg: str | None = None):
    return presets.resolve("gaia", PRESETS, arg)
