"""Questions over the compact world, in the same splits and `Question` records as the chat world's.

A question's text is its facts from the outside in, then its subject(s):

    lookup    born_in Varn              the birthplace of the person Varn (stage 1)
    chain     country born_in Varn      the country of that birthplace (stage 2: 2 and 3 hops; XBench style: 3)
    compare   max age Varn Kelt         the larger of two ages: needs `calc` (stage 2)
    walk      born_in founder Lorm      a chain from an organisation (WebWalkerQA style, 2-3 hops)

Splits: stage1 (lookups), stage2 (2- and 3-hop chains and comparisons), validation (as stage 2), eval_gaia
(lookups, 2-hop chains, comparisons), eval_xbench (3-hop chains: new texts of a trained kind), eval_webwalker
(walks), and fresh (as stage 2, the yardstick of the transfer gap). Stage 2's 3-hop chains fit the main agent's
budgets (96 tokens, 8 turns): the noise-free experts' take 55 tokens and 4 turns, the noisy experts' at most 91
and 7, with at most 6 calls (world 0; tests/env/test_compact.py replays both).

Held out by facts and by text, not by names. A tiny agent writes only the (fact, name) pairs it has written in
training: held out by fact path (no training question on a held-out question's path), the system answered 0.05 of
the validation set against 0.31 of new stage-2 questions over training paths (world 0, after the warm start), and
by name a tiny decoder copies nothing (a measured probe: 0.00-0.06 held-out copying for 160 to 8,000 names). So
every lookup of the world is a stage-1 question (every name and every fact it has, as a pretrained model has seen
every entity), and what is held out is the answers: training poses its questions in counterfactual twins of the
world (`warmstart.counterfactual_share`, `rollout.counterfactual_share`: the same entities, every value drawn
again), so no answer of the world itself is ever a training target, and evaluation asks the world. Held-out
questions are also new texts (none is a training text; drawn first) in their own styles. `fresh` holds stage-2
training texts (the first of each kind, as many of each as the validation set has), asked in the world: the
training distribution with answers new to the system, against which the validation set (new texts of the same
kinds, in the same numbers: both stratified by `quotas`) gives the transfer gap. The stage-2
curriculum trains every fresh text unfiltered and filters only the other stage-2 texts (mgrpo_jax/rl/curriculum.py),
so every fresh text is a trained text and no outcome chooses which are.
"""

from __future__ import annotations

import dataclasses
import random
from dataclasses import fields

from mgrpo_jax.env.compact.grammar import NONE
from mgrpo_jax.env.compact.world import CALC_OPS, COUNTRY, FACTS, NUMBER, CompactWorld
from mgrpo_jax.env.questions import (
    CHAIN,
    COMPARE,
    DELEGATE_STEP,
    EVAL_GAIA,
    EVAL_WEBWALKER,
    EVAL_XBENCH,
    FRESH,
    HELD_OUT_SPLITS,
    LOOKUP,
    REASON_STEP,
    STAGE1,
    STAGE2,
    VALIDATION,
    WALK,
    Question,
    QuestionSets,
    QuestionSetSizes,
    SubTask,
)

_MIX = {
    STAGE1: ((LOOKUP, 1.0, 1),),
    STAGE2: ((CHAIN, 0.45, 2), (CHAIN, 0.2, 3), (COMPARE, 0.35, 1)),
    EVAL_GAIA: ((LOOKUP, 0.2, 1), (CHAIN, 0.4, 2), (COMPARE, 0.4, 1)),
    EVAL_XBENCH: ((CHAIN, 1.0, 3),),
    EVAL_WEBWALKER: ((WALK, 1.0, 2), (WALK, 1.0, 3)),
}
_MIX[VALIDATION] = _MIX[FRESH] = _MIX[STAGE2]
NUMBER_FACTS = tuple(fact for fact, (_, value) in FACTS.items() if value == NUMBER)


def _chain(rng: random.Random, world: CompactWorld, hops: int, start_kind: str | None):
    """A path of `hops` facts from a random topic entity: (steps as (entity id, fact), answer)."""
    names = sorted(world.by_name)
    for _ in range(50):
        facts = [f for f, (domain, _) in FACTS.items() if start_kind in (None, domain)]
        first_fact = rng.choice(facts)
        entity = world.find(FACTS[first_fact][0], rng.choice(names))
        if entity is None:
            continue
        path, fact = [], first_fact
        while True:
            path.append((entity.id, fact))
            if len(path) == hops:
                return path
            next_id = world.values[(entity.id, fact)]
            if next_id is None or world.entities[next_id].kind == COUNTRY:
                break
            entity = world.entities[next_id]
            fact = rng.choice([f for f, (domain, _) in FACTS.items() if domain == entity.kind])
    return None


def _chain_question(world, split, kind, path) -> Question:
    steps, inputs = [], ()
    for i, (entity_id, fact) in enumerate(path):
        subject = world.entities[entity_id].name
        answer = world.facts[(entity_id, fact)]
        steps.append(SubTask(i, DELEGATE_STEP, f"{fact} {subject}", answer, entity_id, fact, inputs=inputs))
        inputs = (i,)
    text = " ".join([fact for _, fact in reversed(path)] + [world.entities[path[0][0]].name])
    return Question("", split, kind, len(path), text, steps[-1].answer, tuple(steps), tuple(path),
                    (path[0][0],))


def _compare(rng: random.Random, world: CompactWorld, split: str) -> Question | None:
    fact = rng.choice(NUMBER_FACTS)
    a, b = rng.sample(world.of_kind(FACTS[fact][0]), 2)
    va, vb = world.facts[(a.id, fact)], world.facts[(b.id, fact)]
    if va == vb:
        return None
    op = rng.choice(CALC_OPS)
    answer = str(max(int(va), int(vb)) if op == "max" else min(int(va), int(vb)))
    steps = (SubTask(0, DELEGATE_STEP, f"{fact} {a.name}", va, a.id, fact),
             SubTask(1, DELEGATE_STEP, f"{fact} {b.name}", vb, b.id, fact),
             SubTask(2, REASON_STEP, f"{op} {va} {vb}", answer, expression=f"{op} {va} {vb}", inputs=(0, 1)))
    return Question("", split, COMPARE, 2, f"{op} {fact} {a.name} {b.name}", answer, steps,
                    ((a.id, fact), (b.id, fact)), (a.id, b.id))


def _draw(rng, world, split, kind, hops) -> Question | None:
    if kind == COMPARE:
        return _compare(rng, world, split)
    path = _chain(rng, world, hops, "org" if kind == WALK else None)
    return None if path is None else _chain_question(world, split, kind, path)


def _every_lookup(rng: random.Random, world: CompactWorld) -> list[Question]:
    """Every (entity, fact) of the world as a lookup, in a seeded order: stage 1 asks every name about every fact
    it has, so no pair a held-out question asks is one the agents never wrote."""
    paths = [(e.id, fact) for e in world.entities for fact, (domain, _) in FACTS.items() if domain == e.kind]
    return [_chain_question(world, STAGE1, LOOKUP, [path]) for path in rng.sample(paths, len(paths))]


def pose_in(world: CompactWorld, question: Question) -> Question:
    """`question` asked in `world` (a counterfactual twin of its own): the same text and kind, the answer path and
    answer that `world`'s facts give. A chain follows the twin's values hop by hop, so its later hops may pass
    through other entities (or stop at `none` where the twin's chain leaves the fact's domain)."""
    if question.kind == COMPARE:
        op, fact, *names = question.text.split()
        ids = [world.find(FACTS[fact][0], name).id for name in names]
        values = [world.facts[(i, fact)] for i in ids]
        answer = world.calculate(f"{op} {values[0]} {values[1]}")
        steps = (SubTask(0, DELEGATE_STEP, f"{fact} {names[0]}", values[0], ids[0], fact),
                 SubTask(1, DELEGATE_STEP, f"{fact} {names[1]}", values[1], ids[1], fact),
                 SubTask(2, REASON_STEP, f"{op} {values[0]} {values[1]}", answer,
                         expression=f"{op} {values[0]} {values[1]}", inputs=(0, 1)))
        return dataclasses.replace(question, answer=answer, decomposition=steps,
                                   answer_path=tuple((i, fact) for i in ids))
    *facts, name = question.text.split()
    path, value = [], name
    for fact in reversed(facts):
        entity = world.find(FACTS[fact][0], value)
        if entity is None:
            value = NONE
            break
        path.append((entity.id, fact))
        value = world.facts[(entity.id, fact)]
    posed = _chain_question(world, question.split, question.kind, path) if len(path) == len(facts) else None
    if posed is None:
        return dataclasses.replace(question, answer=value)
    return dataclasses.replace(question, answer=posed.answer, decomposition=posed.decomposition,
                               answer_path=posed.answer_path)


def quotas(mix, size: int) -> list[int]:
    """How many of `size` questions each entry of `mix` gets: its weight's share, rounded by largest remainder (the
    counts add up to `size`)."""
    total = sum(weight for _, weight, _ in mix)
    exact = [size * weight / total for _, weight, _ in mix]
    counts = [int(x) for x in exact]
    for i in sorted(range(len(mix)), key=lambda i: counts[i] - exact[i])[: size - sum(counts)]:
        counts[i] += 1
    return counts


def _entry(mix, question: Question) -> int | None:
    """The entry of `mix` a question was drawn for: its kind, and for chains and walks its hop count."""
    return next((i for i, (kind, _, hops) in enumerate(mix)
                 if kind == question.kind and (kind == COMPARE or hops == question.hops)), None)


def _sample_split(world, split, size, seed, taken) -> tuple[Question, ...]:
    """`size` new texts of `split`'s mix. The transfer gap's validation set is stratified: each entry of the mix gets
    exactly its `quotas` share (fresh takes the same shares), so the gap compares the same kinds in the same
    numbers; the other splits draw each question's entry at random by weight."""
    rng = random.Random(f"{seed}/{split}")
    mix = _MIX[split]
    left = quotas(mix, size) if split == VALIDATION else None
    out: list[Question] = []
    drafts = iter(_every_lookup(rng, world) if split == STAGE1 else ())
    for _ in range(size * 50):
        if len(out) == size:
            break
        weights = left or [w for _, w, _ in mix]
        entry = rng.choices(range(len(mix)), weights)[0]
        kind, _, hops = mix[entry]
        question = next(drafts, None) or _draw(rng, world, split, kind, hops)
        if question is None or question.text in taken:
            continue
        taken.add(question.text)
        if left is not None:
            left[entry] -= 1
        out.append(Question(f"{split}-{len(out)}", *[getattr(question, f.name) for f in fields(Question)][1:]))
    return tuple(out)


def _fresh(stage2: tuple[Question, ...], size: int) -> tuple[Question, ...]:
    """The transfer gap's trained texts: the first stage-2 questions that fill the validation set's shares of each
    kind (`quotas`), so fresh and validation hold the same kinds in the same numbers."""
    mix = _MIX[FRESH]
    left, out = quotas(mix, size), []
    for question in stage2:
        entry = _entry(mix, question)
        if entry is not None and left[entry] > 0:
            left[entry] -= 1
            out.append(dataclasses.replace(question, id=f"{FRESH}-{len(out)}", split=FRESH))
    return tuple(out)


def generate_compact_questions(world: CompactWorld, seed: int = 0,
                               sizes: QuestionSetSizes | None = None) -> QuestionSets:
    sizes = sizes or QuestionSetSizes(stage1=1000, stage2=1000, validation=100, eval_gaia=100, eval_xbench=100,
                                      eval_webwalker=100, fresh=100)
    taken: set[str] = set()
    splits = {split: _sample_split(world, split, getattr(sizes, split), seed, taken)
              for split in (*HELD_OUT_SPLITS, STAGE1, STAGE2)}
    splits[FRESH] = _fresh(splits[STAGE2], sizes.fresh)
    return QuestionSets(**{f.name: splits[f.name] for f in fields(QuestionSets)})
