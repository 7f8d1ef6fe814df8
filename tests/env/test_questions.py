from functools import cache

import pytest

from mgrpo_jax.env import calculator, questions
from mgrpo_jax.env.questions import QuestionSetSizes, filter_low_success, generate_questions
from mgrpo_jax.env.world import generate_world

SIZES = QuestionSetSizes(stage1=150, stage2=150, validation=40, eval_gaia=40, eval_xbench=40, eval_webwalker=40,
                         fresh=20)


@cache
def env():
    world = generate_world(2, 1500)
    return world, generate_questions(world, 2, SIZES)


def _walk_value(world, path):
    return world.value_text(*path[-1])


def test_split_sizes_kinds_and_hops():
    _, sets = env()
    assert {name: len(split) for name, split in sets.items()} == {
        "stage1": 150, "stage2": 150, "validation": 40, "eval_gaia": 40, "eval_xbench": 40, "eval_webwalker": 40,
        "fresh": 20}
    assert {q.kind for q in sets.fresh} <= {q.kind for q in sets.stage2}
    assert not {q.text for q in sets.fresh} & {q.text for q in sets.stage1 + sets.stage2}
    assert {q.kind for q in sets.stage1} == {"lookup"} and {q.hops for q in sets.stage1} == {1}
    assert {q.hops for q in sets.stage2} == {2, 3, 4}
    assert {q.kind for q in sets.stage2} >= {"chain", "compare", "sum", "difference", "date_gap"}
    assert {q.hops for q in sets.eval_xbench} <= {3, 4}
    assert {q.kind for q in sets.eval_webwalker} == {"walk"}
    assert all(q.root_url and q.root_url in q.text for q in sets.eval_webwalker)
    assert len({q.kind for q in sets.eval_gaia}) >= 4
    all_ids = [q.id for _, split in sets.items() for q in split]
    assert len(set(all_ids)) == len(all_ids)


def test_gold_answers_follow_the_world():
    world, sets = env()
    for _, split in sets.items():
        for question in split:
            answers = {}
            for step in question.decomposition:
                if step.tool == questions.DELEGATE_STEP:
                    if step.inputs:  # a chained lookup's subject is the previous step's answer
                        assert world.entities[step.subject_id].name == answers[step.inputs[0]]
                    assert step.answer == world.value_text(step.subject_id, step.fact)
                else:
                    assert step.answer == calculator.evaluate(step.expression)
                answers[step.index] = step.answer
            assert question.hops == len(question.answer_path)
            if question.kind not in questions.REASONING_KINDS:
                assert question.answer == _walk_value(world, question.answer_path)
            elif question.kind != "compare":
                assert question.answer == question.decomposition[-1].answer


def test_held_out_sets_share_no_fact_with_training():
    world, sets = env()
    train_facts = {fact for split in (sets.stage1, sets.stage2, sets.fresh) for q in split for fact in q.answer_path}
    train_topics = {topic for split in (sets.stage1, sets.stage2) for q in split for topic in q.topic_ids}
    for name in questions.HELD_OUT_SPLITS:
        for question in sets.split(name):
            assert not train_facts.intersection(question.answer_path)
            assert not train_topics.intersection(question.topic_ids)
    texts = [q.text for _, split in sets.items() for q in split]
    assert len(set(texts)) == len(texts)


def test_generation_is_deterministic():
    world, sets = env()
    assert generate_questions(world, 2, SIZES) == sets
    assert generate_questions(world, 3, SIZES).stage1 != sets.stage1


def test_low_success_filter_takes_a_predicate():
    _, sets = env()
    rates = {q.id: (0.0 if q.hops >= 3 else 0.9) for q in sets.stage2}
    kept = filter_low_success(sets.stage2, lambda q: rates[q.id], max_success=0.5)
    assert kept and all(q.hops >= 3 for q in kept)


def test_too_many_questions_for_the_world_is_an_error():
    world = generate_world(2, 200)
    with pytest.raises(ValueError, match="could only build .* eval_webwalker"):
        generate_questions(world, 0, QuestionSetSizes(5, 5, 5, 5, 5, eval_webwalker=20_000))
