"""What `launch/tpu_run.py` calls after flags and process setup: pick the role, build, run."""

from __future__ import annotations

import logging

log = logging.getLogger("mgrpo_jax")


def run(config, workdir: str, role: str = "colocated") -> dict:
    """`colocated`: both agents in this job. `main` / `sub`: one side of the decoupled mode (decoupled.py)."""
    if role == "colocated":
        from mgrpo_jax.train.trainer import Trainer

        summary = Trainer(config, workdir).run()
    elif role in ("main", "sub"):
        from mgrpo_jax.train.decoupled import MainRole, SubRole

        summary = (MainRole if role == "main" else SubRole)(config, workdir).run()
    else:
        raise ValueError(f"unknown role {role!r}: expected colocated, main or sub")
    log.info("done (%s): %s", role, {k: round(v, 4) for k, v in summary.items() if "reward" in k or "accuracy" in k})
    return summary
