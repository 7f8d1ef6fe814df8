"""The compact miniature: a world, questions, tools and experts that agents under 1M parameters can learn.

`build_compact_environment(seed, sizes)` gives the same surface the trainer uses for the chat world
(`questions.split(name)`, `experts(noise)`, `judge.score`) plus what the compact grammar needs (its tools,
one-word system prompts and the vocabulary of its word-level tokenizer).
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

from mgrpo_jax.env.compact.experts import CompactExperts, CompactJudge, CompactNoise, compact_success
from mgrpo_jax.env.compact.grammar import CLOSE, OPEN_TAGS, QUESTION, RESULT
from mgrpo_jax.env.compact.questions import generate_compact_questions, pose_in
from mgrpo_jax.env.compact.world import (
    ROLE_WORDS,
    CompactTool,
    CompactWorld,
    CompactWorldConfig,
    Twins,
    generate_compact_world,
)
from mgrpo_jax.env.prompts import MAIN, SINGLE, SUB
from mgrpo_jax.env.questions import QuestionSets, QuestionSetSizes

WORD_SPACE = "\u2581"  # SentencePiece's whitespace mark
AGENT_TOOLS = {MAIN: ("delegate", "reason"), SUB: ("search", "visit"), SINGLE: ("search", "visit", "reason")}


@dataclass(frozen=True)
class CompactEnvironment:
    world: CompactWorld
    questions: QuestionSets
    judge: CompactJudge  # of `twins`: the active twin's true values
    twins: Twins  # what the tools and the judge read: the world, or a twin while an RL step is posed in one

    @contextlib.contextmanager
    def posed_in_twin(self, k: int, questions):
        """Activates twin `k` for the tools and the judge, and yields `questions` posed in it (the same texts, the
        twin's answers); the world is active again afterwards."""
        with self.twins.active(k) as twin:
            yield [pose_in(twin, q) for q in questions]

    def experts(self, noise: CompactNoise | None = None, counterfactual: int = 0) -> CompactExperts:
        """The scripted experts; in counterfactual twin `counterfactual` of the world when it is > 0."""
        return CompactExperts(self.twins.twin(counterfactual), noise)

    def tools(self, agent: str) -> dict[str, CompactTool]:
        """The agent's in-process tools (`delegate` is run by the rollout engine)."""
        return {name: CompactTool(self.twins, name) for name in AGENT_TOOLS[agent] if name != "delegate"}

    @staticmethod
    def system_prompt(agent: str) -> str:
        return agent  # one word: the role is all a compact agent needs to know

    def tokenizer_symbols(self) -> tuple[str, ...]:
        """The word-level tokenizer's user symbols: each word a compact episode can hold, as one piece. A message
        starts with a tag or a role word (no space before it); every other word follows a space, so it is
        registered with SentencePiece's whitespace mark."""
        spaced = (*self.world.vocabulary(), CLOSE)
        return (*OPEN_TAGS, RESULT, QUESTION, *ROLE_WORDS, *(WORD_SPACE + word for word in spaced))


def build_compact_environment(seed: int = 0, sizes: QuestionSetSizes | None = None,
                              config: CompactWorldConfig | None = None) -> CompactEnvironment:
    world = generate_compact_world(seed, config)
    twins = Twins(world)
    return CompactEnvironment(world, generate_compact_questions(world, seed, sizes), CompactJudge(twins), twins)


__all__ = ["CompactEnvironment", "CompactExperts", "CompactJudge", "CompactNoise", "CompactWorldConfig",
           "build_compact_environment", "compact_success"]
