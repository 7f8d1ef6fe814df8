"""Scripted experts of the compact world, whose mistakes RL can fix, and its rule-based expert judge.

Mistakes are systematic *and* stochastic: each is tied to a fixed, seeded subset of
fact types, and inside that subset it happens with probability `rate` < 1. A greedy clone copies the
majority action (the mistake), while sampled rollouts still contain the one-token fix, so group-relative RL
has something to push up.

- sub-agent: on `wrong_kind_facts` of the fact types it opens a namesake of the wrong kind (for `born_in Varn`
  the city Varn instead of the person); that page lacks the fact, so it answers `none`;
- main agent: on `wrong_entity_facts` of the fact types asked at a chain's second hop or later, it asks about
  the question's own subject instead of the previous answer (`[ask country Varn ]` instead of
  `[ask country Drur ]`); on `skip_calc_facts` of the compared attributes it answers the first value without
  calling `calc`;
- single agent: all of the above in one context.
Recovery is part of every expert: the main agent asks again once when a sub-agent answers `none` (the sub
error is stochastic, so the second try often succeeds), and the single agent searches again. So the number
of delegations per rollout varies, and alignment has work to do.
"""

from __future__ import annotations

import hashlib
import math
import random
from collections.abc import Sequence
from dataclasses import dataclass

from mgrpo_jax.env.compact.grammar import COMPACT, NONE, render_answer, render_call
from mgrpo_jax.env.compact.questions import NUMBER_FACTS
from mgrpo_jax.env.compact.world import FACTS, CompactWorld, unit_hash
from mgrpo_jax.env.experts import Episode, Transcript, success_rates
from mgrpo_jax.env.prompts import ASSISTANT, MAIN, SINGLE, SUB, SYSTEM, TOOL, USER, Message
from mgrpo_jax.env.questions import COMPARE, REASON_STEP, Question


@dataclass(frozen=True)
class CompactNoise:
    """Which fact types each mistake applies to (fractions, subsets fixed by `seed`) and how often inside them.

    Defaults, decided from the design and never tuned on evaluation numbers: `rate` 0.7 makes the mistake the
    greedy majority action while 3 in 10 sampled actions are right; the fractions put a mistake on about half
    of the relevant fact types, so the clone is right on the other half (rewards vary within a group) and
    wrong often enough for RL to have a target.
    """

    seed: int = 0
    rate: float = 0.7
    wrong_kind_facts: float = 0.5  # sub-agent: of all fact types
    wrong_entity_facts: float = 0.5  # main agent: of the fact types a chain asks at hop >= 2
    skip_calc_facts: float = 0.5  # main agent: of the compared (number) facts

    @classmethod
    def clean(cls) -> CompactNoise:
        return cls(0, 0.0, 0.0, 0.0, 0.0)

    def subset(self, tag: str, names: Sequence[str], fraction: float) -> frozenset[str]:
        ranked = sorted(names, key=lambda name: unit_hash(self.seed, tag, name))
        return frozenset(ranked[: math.ceil(fraction * len(names) - 1e-9)])

    @property
    def wrong_kind(self) -> frozenset[str]:
        return self.subset("kind", list(FACTS), self.wrong_kind_facts)

    @property
    def wrong_entity(self) -> frozenset[str]:
        return self.subset("entity", list(FACTS), self.wrong_entity_facts)

    @property
    def skip_calc(self) -> frozenset[str]:
        return self.subset("calc", NUMBER_FACTS, self.skip_calc_facts)


class CompactJudge:
    """The expert score of a sub-agent's answer: 1 when it is the world's true value for its task
    (`none` when nothing of the fact's kind has that name), else 0."""

    def __init__(self, world: CompactWorld):
        self.world = world

    def score(self, task: str, answer: str | None, question: Question | None = None) -> float:
        words = task.split()
        if answer is None or len(words) != 2:
            return 0.0
        return float(answer.strip() == self.world.lookup(*words))


def _rng(*parts) -> random.Random:
    return random.Random(int.from_bytes(hashlib.blake2b("/".join(map(str, parts)).encode(), digest_size=8).digest(),
                                        "big"))


class CompactExperts:
    """The three experts over one world with one noise configuration. Each transcript draws its stochastic
    mistakes from a generator seeded by the question id and `draw` (several draws give several demonstrations)."""

    def __init__(self, world: CompactWorld, noise: CompactNoise | None = None):
        self.world = world
        self.noise = noise or CompactNoise()
        self.judge = CompactJudge(world)
        self._wrong_kind, self._wrong_entity, self._skip_calc = (
            self.noise.wrong_kind, self.noise.wrong_entity, self.noise.skip_calc)

    # -- the sub-agent's routine (also the single agent's research) --------------------------------------

    def _research(self, task: str, rng: random.Random) -> tuple[list[tuple[str, str]], str]:
        """(assistant turn, tool output) pairs of one lookup, and its finding."""
        turns, session = [], {}
        fact, name = task.split()
        output = self.world.search(task, session)
        turns.append((render_call("search", fact, name), output))
        ids = session.get("results", [])
        kind = FACTS[fact][0] if fact in FACTS else None
        found = [self.world.entities[e] for e in ids]
        right = [i for i, e in enumerate(found) if e.name == name and e.kind == kind]
        if not right:
            return turns, NONE
        pick = right[0]
        wrong = [i for i, e in enumerate(found) if e.name == name and i != pick]
        if wrong and fact in self._wrong_kind and rng.random() < self.noise.rate:
            pick = wrong[0]
        handle = f"r{pick + 1}"
        page = self.world.visit(handle, session)
        turns.append((render_call("visit", handle), page))
        words = page.split()
        found = words[words.index(fact) + 1] if fact in words[::2] else NONE
        return turns, found

    def sub_agent(self, task: str, context: str = "", rng: random.Random | None = None) -> Episode:
        rng = rng or _rng(self.noise.seed, "sub", task)
        turns, answer = self._research(task, rng)
        messages = [Message(SYSTEM, SUB), Message(USER, COMPACT.sub_agent_prompt(task))]
        for turn, output in turns:
            messages += [Message(ASSISTANT, turn), Message(TOOL, COMPACT.render_tool_response(output))]
        messages.append(Message(ASSISTANT, render_answer(answer)))
        return Episode(SUB, tuple(messages), answer, task=task)

    # -- planning (main and single agent) ---------------------------------------------------------------

    def _plan(self, question: Question, rng: random.Random, lookup) -> tuple[list[tuple[str, str]], str]:
        """The planner's turns and final answer; `lookup(task)` returns (turns, finding) of one attempt."""
        turns: list[tuple[str, str]] = []
        answers: dict[int, str] = {}
        topic = self.world.entities[question.topic_ids[0]].name
        for step in question.decomposition:
            if step.tool == REASON_STEP:
                continue
            subject = answers[step.inputs[0]] if step.inputs else self.world.entities[step.subject_id].name
            if step.inputs and step.fact in self._wrong_entity and rng.random() < self.noise.rate:
                subject = topic
            task = f"{step.fact} {subject}"
            for _ in range(2):  # ask again once when the finding is `none`
                attempt, found = lookup(task)
                turns += attempt
                if found != NONE:
                    break
            answers[step.index] = found
        final = answers[max(answers)]
        if question.kind == COMPARE:
            op = question.decomposition[-1].expression.split()[0]
            fact = question.decomposition[0].fact
            if fact in self._skip_calc and rng.random() < self.noise.rate:
                final = answers[0]
            else:
                final = self.world.calculate(f"{op} {answers[0]} {answers[1]}")
                turns.append((render_call("reason", op, answers[0], answers[1]), final))
        return turns, final

    def main_agent(self, question: Question, draw: int = 0) -> Transcript:
        rng = _rng(self.noise.seed, "main", question.id, draw)
        subs: list[Episode] = []

        def delegate(task):
            episode = self.sub_agent(task, rng=rng)
            subs.append(episode)
            return [(render_call("delegate", *task.split()), episode.answer)], episode.answer

        turns, final = self._plan(question, rng, delegate)
        top = self._episode(MAIN, question, turns, final)
        scores = tuple(self.judge.score(e.task, e.answer) for e in subs)
        return Transcript(question, "multi", top, tuple(subs), final, final == question.answer, scores)

    def single_agent(self, question: Question, draw: int = 0) -> Transcript:
        rng = _rng(self.noise.seed, "single", question.id, draw)
        turns, final = self._plan(question, rng, lambda task: self._research(task, rng))
        top = self._episode(SINGLE, question, turns, final)
        return Transcript(question, "single", top, (), final, final == question.answer)

    @staticmethod
    def _episode(agent: str, question: Question, turns, final: str) -> Episode:
        messages = [Message(SYSTEM, agent), Message(USER, COMPACT.question_prompt(question.text))]
        for turn, output in turns:
            messages += [Message(ASSISTANT, turn), Message(TOOL, COMPACT.render_tool_response(output))]
        messages.append(Message(ASSISTANT, render_answer(final)))
        return Episode(agent, tuple(messages), final)


# The share of questions each expert answers correctly, {"multi": …, "single": …}: the chat world's function
# serves any experts with `main_agent` / `single_agent`.
compact_success = success_rates
