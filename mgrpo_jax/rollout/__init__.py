"""The multi-agent rollout engine: batched whole-system episodes -> trajectories, rewards, aligned batches."""

from mgrpo_jax.rollout.engine import AgentRuntime, RolloutEngine, RolloutLimits
from mgrpo_jax.rollout.episode import END_REASONS, Episode, RolloutBatch

__all__ = ["END_REASONS", "AgentRuntime", "Episode", "RolloutBatch", "RolloutEngine", "RolloutLimits"]
