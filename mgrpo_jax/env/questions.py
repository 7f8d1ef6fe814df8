"""Questions over the offline world: curriculum splits, a validation split and three held-out eval sets.

Every question is built from paths of facts in the graph, so it carries its gold answer, its gold
decomposition into sub-tasks (lookups to delegate, then at most one `reason` step) and its answer path
(the facts it reads). Kinds:

- `lookup`: one fact ("What is the population of Dravosk?").
- `chain`: 2–4 facts composed ("What is the population of the birthplace of the founder of X?").
- `compare`: the same numeric or date attribute on two entities, answered with the winner's name.
- `sum`, `difference`: arithmetic over two integer attributes.
- `date_gap`: whole years between two dates.
- `walk`: a chain that starts from a page URL and follows its links (WebWalkerQA style).

Splits: `stage1` (lookups, to learn the format), `stage2` (2–4 hop compositions and reasoning),
`validation` (stage-2 mix, for tuning), and `eval_gaia` (mixed reasoning and lookups), `eval_xbench`
(long 3–4 hop chains), `eval_webwalker` (walks from a root page).

Held-out guarantee: no fact on the answer path of a validation or evaluation question lies on the
answer path of any training (stage1/stage2) question, and the topic entities of every split come from
disjoint pools. Held-out sets are drawn first; training questions that touch a reserved fact are
rejected.
"""

from __future__ import annotations

import hashlib
import random
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, fields

from mgrpo_jax.env import calculator, schema
from mgrpo_jax.env.schema import DATE, INTEGER, FactType
from mgrpo_jax.env.world import World

STAGE1, STAGE2, VALIDATION = "stage1", "stage2", "validation"
EVAL_GAIA, EVAL_XBENCH, EVAL_WEBWALKER = "eval_gaia", "eval_xbench", "eval_webwalker"
TRAIN_SPLITS = (STAGE1, STAGE2)
HELD_OUT_SPLITS = (VALIDATION, EVAL_GAIA, EVAL_XBENCH, EVAL_WEBWALKER)
# Stage-2 questions that no training split holds, drawn like stage 2 (held-out facts excluded): what the system
# scores on its own training distribution, against which the held-out sets' accuracy is a transfer gap.
FRESH = "fresh"
SPLITS = (*TRAIN_SPLITS, *HELD_OUT_SPLITS, FRESH)

LOOKUP, CHAIN, COMPARE, SUM, DIFFERENCE, DATE_GAP, WALK = (
    "lookup", "chain", "compare", "sum", "difference", "date_gap", "walk"
)
REASONING_KINDS = (COMPARE, SUM, DIFFERENCE, DATE_GAP)
QUESTION_KINDS = (LOOKUP, CHAIN, COMPARE, SUM, DIFFERENCE, DATE_GAP, WALK)

DELEGATE_STEP, REASON_STEP = "delegate", "reason"

# Topic-entity pools: each entity may start questions of one split family only.
_POOL_BOUNDS = ((STAGE1, 0.60), (VALIDATION, 0.66), (EVAL_GAIA, 0.77), (EVAL_XBENCH, 0.88), (EVAL_WEBWALKER, 1.0))

# Mix of kinds (and hop ranges) per split; weights need not sum to one.
_SPLIT_MIX: dict[str, tuple[tuple[str, float, tuple[int, int]], ...]] = {
    STAGE1: ((LOOKUP, 1.0, (1, 1)),),
    STAGE2: ((CHAIN, 0.4, (2, 4)), (COMPARE, 0.15, (2, 4)), (SUM, 0.15, (2, 4)),
             (DIFFERENCE, 0.1, (2, 4)), (DATE_GAP, 0.2, (2, 4))),
    EVAL_GAIA: ((LOOKUP, 0.2, (1, 1)), (CHAIN, 0.3, (2, 3)), (COMPARE, 0.15, (2, 3)), (SUM, 0.1, (2, 3)),
                (DIFFERENCE, 0.1, (2, 3)), (DATE_GAP, 0.15, (2, 3))),
    EVAL_XBENCH: ((CHAIN, 0.7, (3, 4)), (COMPARE, 0.3, (4, 4))),
    EVAL_WEBWALKER: ((WALK, 1.0, (2, 3)),),
}
_SPLIT_MIX[VALIDATION] = _SPLIT_MIX[FRESH] = _SPLIT_MIX[STAGE2]


@dataclass(frozen=True)
class SubTask:
    """One step of a gold decomposition.

    A `delegate` step looks up `fact` of the entity `subject_id` (its `description` is the canonical task
    text naming the gold subject); a `reason` step evaluates `expression` over earlier answers. `inputs`
    are the indices of the steps whose answers this step needs.
    """

    index: int
    tool: str
    description: str
    answer: str
    subject_id: int | None = None
    fact: str | None = None
    expression: str | None = None
    inputs: tuple[int, ...] = ()


@dataclass(frozen=True)
class Question:
    id: str
    split: str
    kind: str
    hops: int  # facts read (delegated lookups)
    text: str
    answer: str
    decomposition: tuple[SubTask, ...]
    answer_path: tuple[tuple[int, str], ...]  # every (subject id, fact) the answer depends on
    topic_ids: tuple[int, ...]
    root_url: str | None = None  # walk questions: the page the agent starts from


@dataclass(frozen=True)
class QuestionSetSizes:
    # Evaluation sizes mirror the real benchmarks (GAIA validation, XBench-DeepSearch-2505, WebWalkerQA).
    stage1: int = 2000
    stage2: int = 2000
    validation: int = 200
    eval_gaia: int = 165
    eval_xbench: int = 100
    eval_webwalker: int = 680
    fresh: int = 0


@dataclass(frozen=True)
class QuestionSets:
    stage1: tuple[Question, ...]
    stage2: tuple[Question, ...]
    validation: tuple[Question, ...]
    eval_gaia: tuple[Question, ...]
    eval_xbench: tuple[Question, ...]
    eval_webwalker: tuple[Question, ...]
    fresh: tuple[Question, ...] = ()

    def split(self, name: str) -> tuple[Question, ...]:
        if name not in SPLITS:
            raise KeyError(f"unknown split {name!r}; splits are {SPLITS}")
        return getattr(self, name)

    def items(self) -> Iterable[tuple[str, tuple[Question, ...]]]:
        return ((field.name, getattr(self, field.name)) for field in fields(self))


def filter_low_success(
    questions: Sequence[Question], success_rate: Callable[[Question], float], max_success: float = 0.5
) -> list[Question]:
    """Stage-2 curriculum hook: keep the questions the warm-started system solves at most `max_success`
    of the time (`success_rate` runs the model; this module only applies the predicate)."""
    return [question for question in questions if success_rate(question) <= max_success]


def topic_pool(seed: int, entity_id: int) -> str:
    """The split family an entity may start questions in (stage1 stands for both training stages)."""
    digest = hashlib.blake2b(f"pool/{seed}/{entity_id}".encode(), digest_size=8).digest()
    unit = int.from_bytes(digest, "big") / 2**64
    return next(split for split, bound in _POOL_BOUNDS if unit < bound)


def _pool_name(split: str) -> str:
    return STAGE1 if split in (*TRAIN_SPLITS, FRESH) else split


# ---------------------------------------------------------------- paths


def _random_path(
    rng: random.Random, world: World, start: int, hops: int, final: FactType | None = None,
    first_must_be_relation: bool = False,
) -> tuple[tuple[int, str], ...] | None:
    """A random path of exactly `hops` facts from `start` that never revisits an entity; all steps but
    the last are relations. With `final`, the last step must be that fact type. None when stuck."""
    path: list[tuple[int, str]] = []
    current, seen = start, {start}
    for step in range(hops):
        options = schema.facts_of_kind(world.entities[current].kind)
        last = step == hops - 1
        if not last or (first_must_be_relation and step == 0):
            options = tuple(fact for fact in options if fact.is_relation)
        if last and final is not None:
            options = tuple(fact for fact in options if fact.name == final.name)
        elif not last and final is not None and step == hops - 2:
            options = tuple(fact for fact in options if fact.object_kind == final.subject_kind)
        options = tuple(
            fact for fact in options if not fact.is_relation or world.facts[(current, fact.name)] not in seen
        )
        if not options:
            return None
        fact = rng.choice(options)
        path.append((current, fact.name))
        if fact.is_relation:
            current = world.facts[(current, fact.name)]
            seen.add(current)
    return tuple(path)


def _noun_phrase(rng: random.Random, world: World, path: Sequence[tuple[int, str]], root: str | None = None) -> str:
    """Describe the value at the end of `path`, nesting each fact's noun phrase around the topic."""
    phrase = root if root is not None else world.entities[path[0][0]].name
    for _, fact_name in path:
        phrase = rng.choice(schema.FACT_TYPE_BY_NAME[fact_name].noun_phrases).format(x=phrase)
    return phrase


def _lookup_steps(world: World, path: Sequence[tuple[int, str]], first_index: int,
                  first_description: str | None = None) -> list[SubTask]:
    steps = []
    for offset, (subject, fact_name) in enumerate(path):
        fact = schema.FACT_TYPE_BY_NAME[fact_name]
        description = schema.delegation_task(fact, world.entities[subject].name)
        if offset == 0 and first_description is not None:
            description = first_description
        steps.append(SubTask(
            index=first_index + offset,
            tool=DELEGATE_STEP,
            description=description,
            answer=world.value_text(subject, fact_name),
            subject_id=subject,
            fact=fact_name,
            inputs=(first_index + offset - 1,) if offset else (),
        ))
    return steps


def _end_entity(world: World, path: Sequence[tuple[int, str]]) -> int:
    """The entity holding the path's final attribute."""
    return path[-1][0]


# ---------------------------------------------------------------- question builders


@dataclass(frozen=True)
class _Draft:
    kind: str
    text: str
    answer: str
    decomposition: tuple[SubTask, ...]
    topic_ids: tuple[int, ...]
    root_url: str | None = None

    @property
    def answer_path(self) -> tuple[tuple[int, str], ...]:
        return tuple((step.subject_id, step.fact) for step in self.decomposition if step.tool == DELEGATE_STEP)


def _ask(fact: FactType, phrase: str) -> str:
    if fact.is_relation:
        return f"Which {schema.KIND_NOUN[fact.object_kind]} is {phrase}?"
    return f"What is {phrase}? {fact.answer_hint}".rstrip()


def _build_chain(rng, world, topic, hops, kind=LOOKUP) -> _Draft | None:
    path = _random_path(rng, world, topic, hops)
    if path is None:
        return None
    final = schema.FACT_TYPE_BY_NAME[path[-1][1]]
    steps = _lookup_steps(world, path, 0)
    return _Draft(kind, _ask(final, _noun_phrase(rng, world, path)), steps[-1].answer, tuple(steps), (topic,))


def _build_walk(rng, world, topic, hops) -> _Draft | None:
    path = _random_path(rng, world, topic, hops, first_must_be_relation=True)
    if path is None:
        return None
    entity = world.entities[topic]
    final = schema.FACT_TYPE_BY_NAME[path[-1][1]]
    described = f"the {schema.KIND_NOUN[entity.kind]} described there"
    first_fact = schema.FACT_TYPE_BY_NAME[path[0][1]]
    first_task = f"On the page {entity.url}, find {first_fact.noun_phrases[0].format(x=described)}."
    steps = _lookup_steps(world, path, 0, first_description=first_task)
    phrase = _noun_phrase(rng, world, path, root=f"the {schema.KIND_NOUN[entity.kind]} on that page")
    text = f"Start from the page {entity.url} and follow its links. {_ask(final, phrase)}"
    return _Draft(WALK, text, steps[-1].answer, tuple(steps), (topic,), root_url=entity.url)


def _two_sided(rng, world, pool_topics, hops, value_types) -> tuple | None:
    """Two paths of 1–2 facts (together `hops` facts) ending in the same numeric/date attribute (or, for
    date gaps, in two date attributes) on two different entities."""
    candidates = [fact for fact in schema.ATTRIBUTES if fact.value_type in value_types]
    final_a = rng.choice(candidates)
    final_b = final_a if value_types != (DATE,) else rng.choice(candidates)
    hops_a = rng.choice([h for h in (1, 2) if 1 <= hops - h <= 2])
    paths = []
    for final, side_hops in ((final_a, hops_a), (final_b, hops - hops_a)):
        for _ in range(30):
            topic = rng.choice(pool_topics)
            path = _random_path(rng, world, topic, side_hops, final=final)
            if path is not None:
                paths.append(path)
                break
        else:
            return None
    path_a, path_b = paths
    if path_a[0][0] == path_b[0][0] or _end_entity(world, path_a) == _end_entity(world, path_b):
        return None
    return path_a, path_b


def _build_reasoning(rng, world, pool_topics, kind, hops) -> _Draft | None:
    value_types = {COMPARE: (INTEGER, DATE), SUM: (INTEGER,), DIFFERENCE: (INTEGER,), DATE_GAP: (DATE,)}[kind]
    sides = _two_sided(rng, world, pool_topics, hops, value_types)
    if sides is None:
        return None
    path_a, path_b = sides
    steps_a = _lookup_steps(world, path_a, 0)
    steps_b = _lookup_steps(world, path_b, len(steps_a))
    value_a, value_b = steps_a[-1].answer, steps_b[-1].answer
    if value_a == value_b:
        return None  # a tie has no winner and a zero gap teaches nothing
    phrase_a, phrase_b = _noun_phrase(rng, world, path_a), _noun_phrase(rng, world, path_b)
    final = schema.FACT_TYPE_BY_NAME[path_a[-1][1]]
    if kind == COMPARE:
        attribute = final.noun_phrases[0].removeprefix("the ").removesuffix(" of {x}")
        earlier = final.value_type == DATE
        expression = f"{value_a} {'<' if earlier else '>'} {value_b}"
        holder_a = world.entities[_end_entity(world, path_a)].name
        holder_b = world.entities[_end_entity(world, path_b)].name
        text = (f"Which has the {'earlier' if earlier else 'larger'} {attribute}: {_holder(phrase_a, final)}"
                f" or {_holder(phrase_b, final)}? Answer with the name.")
    elif kind == SUM:
        expression = f"{value_a} + {value_b}"
        text = f"What is the sum of {phrase_a} and {phrase_b}? Give the number only."
    elif kind == DIFFERENCE:
        expression = f"abs({value_a} - {value_b})"
        text = f"What is the absolute difference between {phrase_a} and {phrase_b}? Give the number only."
    else:
        expression = f"abs(years_between({value_a}, {value_b}))"
        text = f"How many full years lie between {phrase_a} and {phrase_b}? Give the number only."
    result = calculator.evaluate(expression)
    reason_step = SubTask(
        index=len(steps_a) + len(steps_b), tool=REASON_STEP, description=f"Compute {expression}.",
        answer=result, expression=expression, inputs=(steps_a[-1].index, steps_b[-1].index),
    )
    answer = (holder_a if result == "true" else holder_b) if kind == COMPARE else result
    return _Draft(kind, text, answer, (*steps_a, *steps_b, reason_step), (path_a[0][0], path_b[0][0]))


def _holder(phrase: str, fact: FactType) -> str:
    """`the population of the birthplace of X` -> `the birthplace of X` (the entity being compared)."""
    for template in fact.noun_phrases:
        prefix, suffix = template.split("{x}")
        if phrase.startswith(prefix) and phrase.endswith(suffix):
            return phrase[len(prefix) : len(phrase) - len(suffix)]
    return phrase


def _draft(rng, world, pool_topics, kind, hops) -> _Draft | None:
    if kind in REASONING_KINDS:
        return _build_reasoning(rng, world, pool_topics, kind, hops)
    topic = rng.choice(pool_topics)
    if kind == WALK:
        return _build_walk(rng, world, topic, hops)
    return _build_chain(rng, world, topic, hops, kind=LOOKUP if hops == 1 else CHAIN)


def _sample_split(
    rng: random.Random, world: World, split: str, count: int, pool_topics: list[int],
    reserved_facts: set[tuple[int, str]], seen_texts: set[str],
) -> tuple[Question, ...]:
    mix = _SPLIT_MIX[split]
    kinds, weights = [entry[0] for entry in mix], [entry[1] for entry in mix]
    hop_ranges = {entry[0]: entry[2] for entry in mix}
    questions: list[Question] = []
    seen_paths: set[tuple[str, tuple[tuple[int, str], ...]]] = set()  # one phrasing per path and kind
    fruitless = 0  # attempts since the last accepted question: the world is exhausted when this runs long
    while len(questions) < count and fruitless < 3000:
        fruitless += 1
        kind = rng.choices(kinds, weights)[0]
        hops = rng.randint(*hop_ranges[kind])
        draft = _draft(rng, world, pool_topics, kind, hops)
        if draft is None or draft.text in seen_texts or (draft.kind, draft.answer_path) in seen_paths:
            continue
        if split not in HELD_OUT_SPLITS and reserved_facts.intersection(draft.answer_path):
            continue
        seen_texts.add(draft.text)
        seen_paths.add((draft.kind, draft.answer_path))
        fruitless = 0
        questions.append(Question(
            id=f"{split}-{len(questions):05d}",
            split=split,
            kind=draft.kind,
            hops=len(draft.answer_path),
            text=draft.text,
            answer=draft.answer,
            decomposition=draft.decomposition,
            answer_path=draft.answer_path,
            topic_ids=draft.topic_ids,
            root_url=draft.root_url,
        ))
    if len(questions) < count:
        raise ValueError(
            f"could only build {len(questions)} of {count} {split} questions: the world is too small"
        )
    return tuple(questions)


def generate_questions(world: World, seed: int = 0, sizes: QuestionSetSizes | None = None) -> QuestionSets:
    """Every split for `world`, deterministic in (world, seed, sizes)."""
    sizes = sizes or QuestionSetSizes()
    pools: dict[str, list[int]] = {}
    for entity in world.entities:
        pools.setdefault(topic_pool(seed, entity.id), []).append(entity.id)
    reserved: set[tuple[int, str]] = set()
    seen_texts: set[str] = set()
    built: dict[str, tuple[Question, ...]] = {}
    # Held-out sets first, so training questions can steer clear of every fact they read.
    for split in (*HELD_OUT_SPLITS, STAGE2, STAGE1, FRESH):
        rng = random.Random(f"questions/{seed}/{split}")
        built[split] = _sample_split(
            rng, world, split, getattr(sizes, split), pools[_pool_name(split)], reserved, seen_texts
        )
        if split in HELD_OUT_SPLITS:
            for question in built[split]:
                reserved.update(question.answer_path)
    return QuestionSets(**built)
