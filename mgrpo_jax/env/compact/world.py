"""The compact world: a few hundred entities whose names, facts and values are single words, and its tools.

Kinds and facts (each fact's domain kind fixes which namesake a lookup is about):

    person   born_in -> city    works_for -> org    age -> number
    city     country -> country mayor -> person     size -> number
    org      based_in -> city   founder -> person   staff -> number
    country  (no facts: the end of a chain)

Names are deliberately ambiguous: every name is both a person and a city, and the first `n_orgs` names of a
seeded order are also organisations. So `search born_in Varn` lists several entities called Varn, and the
sub-agent must open the one whose kind `born_in` applies to. Numbers are the words 10..99.

Tools (each answers one line; `session` is the episode's own scratch space, which holds the last search's
results so that `open r2` means the second result of *this* episode's last search):

    search(query="born_in Varn") -> "r1 Varn city r2 Varn person r3 Kelt person"   (namesakes + a distractor,
                                                                                     in a seeded order per query,
                                                                                     another in each twin)
    visit(url="r2")              -> "born_in Drur works_for Lorm age 31"            (the entity's facts)
    reason(problem="max 31 17")  -> "31"                                            (max / min of two numbers)

Anything a tool cannot serve is answered with `error` (no argument makes a tool raise). `generate_compact_world(seed,
...)` is a pure function.
"""

from __future__ import annotations

import contextlib
import hashlib
import random
from collections.abc import Mapping
from dataclasses import dataclass
from functools import cached_property

from mgrpo_jax.env.compact.grammar import ERROR, NONE
from mgrpo_jax.env.protocol import valid_unicode

PERSON, CITY, ORG, COUNTRY, NUMBER = "person", "city", "org", "country", "number"
KINDS = (PERSON, CITY, ORG, COUNTRY)
FACTS: dict[str, tuple[str, str]] = {  # fact -> (domain kind, value kind)
    "born_in": (PERSON, CITY), "works_for": (PERSON, ORG), "age": (PERSON, NUMBER),
    "country": (CITY, COUNTRY), "mayor": (CITY, PERSON), "size": (CITY, NUMBER),
    "based_in": (ORG, CITY), "founder": (ORG, PERSON), "staff": (ORG, NUMBER),
}
NUMBERS = tuple(str(n) for n in range(10, 100))
HANDLES = ("r1", "r2", "r3", "r4")
CALC_OPS = ("max", "min")
MAX_CALC_DIGITS = 30  # `calc` reads plain ASCII numbers up to this many digits
ROLE_WORDS = ("main", "sub", "single")  # the one-word system prompts

_ONSETS = ("b", "d", "f", "g", "k", "l", "m", "n", "p", "r", "s", "t", "v", "z", "br", "dr", "kl", "tr", "gr", "th")
_VOWELS = ("a", "e", "i", "o", "u", "ai", "ou")
_CODAS = ("n", "r", "l", "s", "k", "m", "x", "rn", "lt", "nd")


def unit_hash(*parts: object) -> float:
    digest = hashlib.blake2b("/".join(map(str, parts)).encode(), digest_size=8).digest()
    return int.from_bytes(digest, "big") / 2**64


@dataclass(frozen=True)
class CompactWorldConfig:
    n_names: int = 160  # each is a person and a city
    n_orgs: int = 40  # organisations, named after the first n_orgs names of a seeded order
    n_countries: int = 10
    search_results: int = 3  # namesakes first, then distractors of the fact's domain kind
    # "per_twin": each counterfactual twin lists a query's results (and draws its distractors) in an order of its
    # own, the world in its order; "world": every twin in the world's order. With one order a sub-agent can learn
    # which handle to open for a query it practised in twins, and the texts it trained on are those queries.
    search_order: str = "per_twin"


SEARCH_ORDERS = ("per_twin", "world")



@dataclass(frozen=True)
class Entity:
    id: int
    kind: str
    name: str


@dataclass(frozen=True)
class CompactWorld:
    seed: int
    config: CompactWorldConfig
    entities: tuple[Entity, ...]
    facts: Mapping[tuple[int, str], str]  # (entity id, fact) -> value word (a name or a number)
    values: Mapping[tuple[int, str], int | None]  # (entity id, fact) -> the value's entity id (None: a number)
    counterfactual: int = 0  # 0: the world; k > 0: its twin k

    @property
    def order_key(self) -> tuple:
        """What a search's seeded order hashes besides the query: the world's seed, and the twin's index where
        each twin orders its own results."""
        if self.counterfactual and self.config.search_order == "per_twin":
            return self.seed, "twin", self.counterfactual
        return (self.seed,)

    @cached_property
    def by_name(self) -> dict[str, tuple[Entity, ...]]:
        out: dict[str, list[Entity]] = {}
        for entity in self.entities:
            out.setdefault(entity.name, []).append(entity)
        return {name: tuple(group) for name, group in out.items()}

    def find(self, kind: str, name: str) -> Entity | None:
        return next((e for e in self.by_name.get(name, ()) if e.kind == kind), None)

    def of_kind(self, kind: str) -> tuple[Entity, ...]:
        return tuple(e for e in self.entities if e.kind == kind)

    def page(self, entity: Entity) -> str:
        return " ".join(f"{fact} {self.facts[(entity.id, fact)]}" for fact, (domain, _) in FACTS.items()
                        if domain == entity.kind) or NONE

    def lookup(self, fact: str, name: str) -> str:
        """The true answer of the task `fact name` (`none` if no entity of the fact's kind has that name)."""
        if fact not in FACTS:
            return NONE
        entity = self.find(FACTS[fact][0], name)
        return self.facts[(entity.id, fact)] if entity is not None else NONE

    def vocabulary(self) -> tuple[str, ...]:
        """Every word the world, its tools and its questions can write after a space (the tokenizer's user symbols)."""
        names = sorted({e.name for e in self.entities})
        words = (*names, *FACTS, *KINDS, *NUMBERS, *HANDLES, *CALC_OPS, NONE, ERROR)
        return tuple(dict.fromkeys(words))  # `country` is a kind and a fact

    # -- tools --------------------------------------------------------------------------------------------

    def search(self, query: str, session: dict | None = None) -> str:
        words = query.split()
        if len(words) != 2 or words[0] not in FACTS:
            return ERROR
        fact, name = words
        results = list(self.by_name.get(name, ()))
        domain = self.of_kind(FACTS[fact][0])
        others = sorted((e for e in domain if e.name != name),
                        key=lambda e: unit_hash(*self.order_key, "distract", query, e.id))
        results += others[: max(0, self.config.search_results - len(results))]
        results.sort(key=lambda e: unit_hash(*self.order_key, "order", query, e.id))
        if session is not None:
            session["results"] = [e.id for e in results]
        return " ".join(f"{handle} {e.name} {e.kind}" for handle, e in zip(HANDLES, results, strict=False))

    def visit(self, handle: str, session: dict | None = None) -> str:
        results = (session or {}).get("results", [])
        if handle not in HANDLES or HANDLES.index(handle) >= len(results):
            return ERROR
        return self.page(self.entities[results[HANDLES.index(handle)]])

    @staticmethod
    def calculate(problem: str) -> str:
        words = problem.split()
        # ASCII digits only: str.isdigit() also accepts e.g. "²", which int() rejects.
        if len(words) != 3 or words[0] not in CALC_OPS or not all(
                w.isascii() and w.isdigit() and len(w) <= MAX_CALC_DIGITS for w in words[1:]):
            return ERROR
        pick = max if words[0] == "max" else min
        return str(pick(int(words[1]), int(words[2])))


# Counterfactual twins a world has (`generate_compact_world(seed, config, counterfactual=1..TWINS)`): the warm
# start's demonstrations and the RL steps posed in a twin (`warmstart.counterfactual_share`,
# `rollout.counterfactual_share`) draw one of these.
TWINS = 64


class Twins:
    """A world and its counterfactual twins, one of them active: a stand-in for a `CompactWorld` whose tools,
    lookups and pages are the active twin's (0: the world itself). The RL loop poses a step's questions in a
    twin (`active(k)`); evaluation and everything else see the world."""

    def __init__(self, world: CompactWorld):
        self.real, self.current, self._cache = world, world, {0: world}

    def twin(self, k: int) -> CompactWorld:
        if not 0 <= k <= TWINS:
            raise ValueError(f"twin {k} is not one of 0..{TWINS}")
        if k not in self._cache:
            self._cache[k] = generate_compact_world(self.real.seed, self.real.config, k)
        return self._cache[k]

    @contextlib.contextmanager
    def active(self, k: int):
        previous, self.current = self.current, self.twin(k)
        try:
            yield self.current
        finally:
            self.current = previous

    def __getattr__(self, name):  # search, visit, lookup, calculate, entities, ... of the active twin
        if name.startswith("__") or name in ("real", "current", "_cache"):  # copies and pickles of a bare object
            raise AttributeError(name)
        return getattr(self.current, name)


class CompactTool:
    """A compact tool as the rollout engine calls it: `tool(arguments, session) -> str`; never raises."""

    def __init__(self, world: CompactWorld, name: str):
        self.world, self.name = world, name

    def __call__(self, arguments: Mapping, session: dict | None = None) -> str:
        value = arguments.get({"search": "query", "visit": "url", "reason": "problem"}[self.name], "")
        if not isinstance(value, str):
            return ERROR
        text = valid_unicode(value)  # `search` hashes its query as UTF-8
        if self.name == "search":
            return self.world.search(text, session)
        if self.name == "visit":
            return self.world.visit(text, session)
        return self.world.calculate(text)


def _names(rng: random.Random, count: int) -> list[str]:
    names: set[str] = set()
    while len(names) < count:
        names.add((rng.choice(_ONSETS) + rng.choice(_VOWELS) + rng.choice(_CODAS)).capitalize())
    return sorted(names)


def generate_compact_world(seed: int = 0, config: CompactWorldConfig | None = None,
                           counterfactual: int = 0) -> CompactWorld:
    """World `seed`; `counterfactual` > 0 gives one of its counterfactual twins: the same entities (names, kinds,
    ids), so the same questions and tasks, with every fact's value drawn again. Demonstrations in the twins
    (`warmstart.counterfactual_share`) cannot be answered from a memory of the world's facts, only by reading
    the tools, which is what a held-out question asks of an agent."""
    config = config or CompactWorldConfig()
    if config.search_order not in SEARCH_ORDERS:
        raise ValueError(f"env.compact.search_order {config.search_order!r} is not one of {SEARCH_ORDERS}")
    rng = random.Random(seed)
    pool = _names(rng, config.n_names + config.n_countries)
    rng.shuffle(pool)
    names, country_names = pool[: config.n_names], pool[config.n_names:]
    entities: list[Entity] = []
    for kind, kind_names in ((PERSON, names), (CITY, names), (ORG, names[: config.n_orgs]),
                             (COUNTRY, country_names)):
        entities += [Entity(len(entities) + i, kind, name) for i, name in enumerate(sorted(kind_names))]
    if counterfactual:
        rng = random.Random(f"{seed}/counterfactual/{counterfactual}")
    by_kind = {kind: [e for e in entities if e.kind == kind] for kind in KINDS}
    facts: dict[tuple[int, str], str] = {}
    values: dict[tuple[int, str], int | None] = {}
    for entity in entities:
        for fact, (domain, value_kind) in FACTS.items():
            if domain != entity.kind:
                continue
            if value_kind == NUMBER:
                facts[(entity.id, fact)], values[(entity.id, fact)] = rng.choice(NUMBERS), None
                continue
            # Never the entity's own namesake: "mayor Varn" answering Varn would be a free copy.
            target = rng.choice([e for e in by_kind[value_kind] if e.name != entity.name])
            facts[(entity.id, fact)], values[(entity.id, fact)] = target.name, target.id
    return CompactWorld(seed, config, tuple(entities), facts, values, counterfactual)
