"""M-GRPO on the offline world, evaluated webwalker-style. Presets: smoke, local, figures, paper, paper_dense,
paper_lora.

Run (the preset after the colon, optionally a mode after a comma):

    python launch/tpu_run.py --config=experiments/webwalker.py:local --workdir=runs/webwalker-local
    python launch/tpu_run.py --config=experiments/webwalker.py:local,frozen_sub --workdir=runs/webwalker-frozen
    python launch/tpu_run.py --config=experiments/webwalker.py:paper --workdir=gs://BUCKET/runs/webwalker

With no argument the preset is `local` on a machine without accelerators and `paper` on a TPU. The presets are
in experiments/presets.py; one for this benchmark only goes into the table below.
"""

from experiments import presets

# name -> a function editing the defaults (mgrpo_jax.config.base_config) in place.
PRESETS = {"smoke": presets.smoke, "local": presets.local, "figures": presets.figures, "paper": presets.paper,
           "paper_dense": presets.paper_dense,
           "paper_lora": presets.paper_lora}


def get_config(arg: str | None = None):
    return presets.resolve("webwalker", PRESETS, arg)
