"""One call that assembles the offline environment: world, question splits, backend, judge, experts."""

from __future__ import annotations

from dataclasses import dataclass

from mgrpo_jax.env.expert_judge import ExpertJudge
from mgrpo_jax.env.experts import NoiseConfig, ScriptedExperts
from mgrpo_jax.env.questions import QuestionSets, QuestionSetSizes, generate_questions
from mgrpo_jax.env.tools import WorldBackend
from mgrpo_jax.env.world import World, WorldConfig, generate_world


@dataclass(frozen=True)
class OfflineEnvironment:
    world: World
    questions: QuestionSets
    backend: WorldBackend
    judge: ExpertJudge

    def experts(self, noise: NoiseConfig | None = None) -> ScriptedExperts:
        return ScriptedExperts(self.world, noise, backend=self.backend, judge=self.judge)


def build_offline_environment(
    seed: int = 0, n_entities: int = 10_000, sizes: QuestionSetSizes | None = None,
    world_config: WorldConfig | None = None,
) -> OfflineEnvironment:
    world = generate_world(seed, n_entities, world_config)
    return OfflineEnvironment(world, generate_questions(world, seed, sizes), WorldBackend(world), ExpertJudge(world))
