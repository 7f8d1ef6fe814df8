"""What `launch/tpu_run.py` calls after flags and process setup: pick the role, build, run."""

from __future__ import annotations

import logging

log = logging.getLogger("mgrpo_jax")


def run(config, workdir: str, role: str = "colocated") -> dict:
    if role != "colocated":
        raise NotImplementedError(
            f"--role={role}: the decoupled two-job mode is not built yet; run --role=colocated (the default)")
    from mgrpo_jax.train.trainer import Trainer

    summary = Trainer(config, workdir).run()
    log.info("done: %s", {k: round(v, 4) for k, v in summary.items() if "reward" in k or "accuracy" in k})
    return summary
