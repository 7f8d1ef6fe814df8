"""Reading free-form research tasks against the world, and the rule-based expert judge (`r_expert`).

The main agent writes its delegated tasks in its own words, so the judge cannot look tasks up by
string. It reads them instead: entity mentions (full names, URLs, or an ambiguous short name such as a
bare surname), and the fact types named by the schema's keywords. For each mentioned entity it finds the
longest chain of mentioned facts that type-checks from that entity ("the birthplace of the founder of
X" → founder, then born_in), and the world gives the true value at the end of the chain.

`ExpertJudge.score(task, answer)` is then the fraction of the task's targets whose true value appears in
the sub-agent's answer (whole tokens, numbers without thousands separators). Answers longer than
`max_answer_tokens` score 0, so dumping a page cannot earn credit. The scripted sub-agent expert reads
tasks with the same `read_task`, so what it understands is exactly what the judge rewards.
"""

from __future__ import annotations

import itertools
import re
from collections.abc import Sequence
from dataclasses import dataclass
from functools import cached_property

from mgrpo_jax.env import schema
from mgrpo_jax.env.questions import Question
from mgrpo_jax.env.world import URL_PREFIX, World

_TOKEN = re.compile(r"[a-z0-9]+")
_URL = re.compile(re.escape(URL_PREFIX) + r"[A-Za-z0-9/_\-]+")
_THOUSANDS = re.compile(r"(?<=\d)[,\u202f ](?=\d{3}\b)")
_MAX_NAME_TOKENS = 8


def answer_tokens(text: str) -> list[str]:
    """Lower-case word/number tokens, with thousands separators inside numbers removed."""
    return _TOKEN.findall(_THOUSANDS.sub("", text.lower()))


@dataclass(frozen=True)
class TaskTarget:
    """One thing a task asks for: the chain `facts` read from the entity named by `mention`.

    `candidates` are the entities the mention can denote: one for a full name or URL, several for an
    ambiguous short name (a careless task that dropped part of the name).
    """

    mention: str
    candidates: tuple[int, ...]
    facts: tuple[str, ...]
    via_url: bool = False


@dataclass(frozen=True)
class TaskReading:
    targets: tuple[TaskTarget, ...]

    @property
    def resolved(self) -> bool:
        return bool(self.targets)


@dataclass(frozen=True)
class _Mention:
    start: int  # token position
    text: str
    candidates: tuple[int, ...]
    via_url: bool


class TaskReader:
    """Reads task text against one world (builds its name index once)."""

    def __init__(self, world: World):
        self.world = world

    @cached_property
    def _names(self) -> dict[tuple[str, ...], tuple[int, ...]]:
        index: dict[tuple[str, ...], list[int]] = {}
        for entity in self.world.entities:
            index.setdefault(tuple(_TOKEN.findall(entity.name.lower())), []).append(entity.id)
        for short, group in self.world.entities_by_short_name.items():
            key = tuple(_TOKEN.findall(short))
            if key not in index:  # a full name always wins over a short name spelled the same
                index[key] = [entity.id for entity in group]
        return {key: tuple(ids) for key, ids in index.items()}

    def _mentions(self, text: str) -> tuple[list[_Mention], list[str]]:
        """Entity mentions, and the task's tokens with the mentioned names removed (so that a name such
        as "Baxhil Heights" is not read as the keyword "height")."""
        mentions = []
        rest: list[str] = []
        for match in _URL.finditer(text):
            entity = self.world.entity_by_url.get(match.group(0).rstrip("/.-"))
            if entity is not None:
                mentions.append(_Mention(-1, match.group(0), (entity.id,), True))
        tokens = _TOKEN.findall(_URL.sub(" ", text).lower())
        position = 0
        while position < len(tokens):
            for length in range(min(_MAX_NAME_TOKENS, len(tokens) - position), 0, -1):
                key = tuple(tokens[position : position + length])
                candidates = self._names.get(key)
                if candidates is not None:
                    mentions.append(_Mention(position, " ".join(key), candidates, False))
                    position += length
                    rest.append("|")  # keeps keywords on either side of a name from joining up
                    break
            else:
                rest.append(tokens[position])
                position += 1
        return mentions, rest

    @staticmethod
    def _fact_positions(tokens: Sequence[str]) -> dict[str, int]:
        """Fact types whose keywords occur in the tokens (each keyword starting at a word boundary), with
        the first character position of a keyword in the space-joined tokens."""
        joined = " " + " ".join(tokens)
        positions = {}
        for fact in schema.FACT_TYPES:
            hits = [joined.find(" " + keyword) for keyword in fact.keywords if " " + keyword in joined]
            if hits:
                positions[fact.name] = min(hits)
        return positions

    def _chain_from(self, kinds: set[str], facts: dict[str, int]) -> tuple[str, ...]:
        """The longest chain of mentioned facts that type-checks from an entity of one of `kinds`; ties go
        to the chain whose outermost fact is named first (English nests "the A of the B of X" outward)."""
        best: tuple[str, ...] = ()
        best_key = (0, 0)
        names = list(facts)
        for length in range(1, min(4, len(names)) + 1):
            for chain in itertools.permutations(names, length):
                if not _type_checks(chain, kinds):
                    continue
                key = (length, -facts[chain[-1]])
                if key > best_key:
                    best, best_key = chain, key
        return best

    def read(self, task: str) -> TaskReading:
        mentions, rest = self._mentions(task)
        facts = self._fact_positions(rest)
        if not facts:
            return TaskReading(())
        targets = []
        for mention in mentions:
            kinds = {self.world.entities[candidate].kind for candidate in mention.candidates}
            chain = self._chain_from(kinds, facts)
            if not chain:
                continue
            candidates = tuple(
                candidate for candidate in mention.candidates
                if _type_checks(chain, {self.world.entities[candidate].kind})
            )
            targets.append(TaskTarget(mention.text, candidates, chain, mention.via_url))
        return TaskReading(tuple(targets))

    def true_value(self, subject_id: int, facts: Sequence[str]) -> str:
        """The world's value at the end of the fact chain from `subject_id`."""
        current = subject_id
        for fact_name in facts[:-1]:
            current = self.world.facts[(current, fact_name)]
        return self.world.value_text(current, facts[-1])


def _type_checks(chain: Sequence[str], kinds: set[str]) -> bool:
    for start_kind in kinds:
        kind = start_kind
        for index, fact_name in enumerate(chain):
            fact = schema.FACT_TYPE_BY_NAME[fact_name]
            if fact.subject_kind != kind or (not fact.is_relation and index < len(chain) - 1):
                break
            kind = fact.object_kind
        else:
            return True
    return False


def answer_contains(answer: str, gold: str) -> bool:
    """True when the gold value's tokens appear contiguously in the answer's tokens."""
    gold_tokens, tokens = answer_tokens(gold), answer_tokens(answer)
    if not gold_tokens:
        return False
    width = len(gold_tokens)
    return any(tokens[start : start + width] == gold_tokens for start in range(len(tokens) - width + 1))


@dataclass(frozen=True)
class ExpertVerdict:
    score: float  # in [0, 1]
    resolved: bool  # False when the task names no entity/fact the judge can check
    golds: tuple[tuple[str, ...], ...]  # acceptable values per target
    found: tuple[bool, ...]


class ExpertJudge:
    """`r_expert` for the offline world: how well a sub-agent's answer fulfils its delegated task."""

    def __init__(self, world: World, max_answer_tokens: int = 60):
        self.reader = TaskReader(world)
        self.max_answer_tokens = max_answer_tokens

    def assess(self, task: str, answer: str, question: Question | None = None) -> ExpertVerdict:
        """Score `answer` against the truth of every target of `task`. With `question`, an ambiguous
        mention is narrowed to the entities on the question's answer path."""
        reading = self.reader.read(task)
        if not reading.resolved:
            return ExpertVerdict(0.0, False, (), ())
        on_path = {subject for subject, _ in question.answer_path} if question is not None else set()
        golds, found = [], []
        for target in reading.targets:
            candidates = target.candidates
            if len(candidates) > 1 and on_path.intersection(candidates):
                candidates = tuple(candidate for candidate in candidates if candidate in on_path)
            values = tuple(sorted({self.reader.true_value(candidate, target.facts) for candidate in candidates}))
            golds.append(values)
            found.append(any(answer_contains(answer, value) for value in values))
        if len(answer_tokens(answer)) > self.max_answer_tokens:
            found = [False] * len(found)
        return ExpertVerdict(sum(found) / len(found), True, tuple(golds), tuple(found))

    def score(self, task: str, answer: str, question: Question | None = None) -> float:
        """The `r_expert` reward in [0, 1]; 0 when the task cannot be read (see `assess` to tell apart)."""
        return self.assess(task, answer, question).score
