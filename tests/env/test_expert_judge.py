from functools import cache

from mgrpo_jax.env import schema
from mgrpo_jax.env.expert_judge import ExpertJudge, answer_contains
from mgrpo_jax.env.questions import DELEGATE_STEP, QuestionSetSizes, generate_questions
from mgrpo_jax.env.world import generate_world


@cache
def env():
    world = generate_world(4, 1500)
    return world, generate_questions(world, 4, QuestionSetSizes(80, 80, 20, 20, 20, 40)), ExpertJudge(world)


def test_every_gold_sub_task_is_read_and_scored():
    world, sets, judge = env()
    count = 0
    for _, split in sets.items():
        for question in split:
            for step in question.decomposition:
                if step.tool != DELEGATE_STEP:
                    continue
                count += 1
                verdict = judge.assess(step.description, step.answer, question)
                assert verdict.resolved and verdict.score == 1.0 and verdict.golds == ((step.answer,),)
                assert judge.score(step.description, "I could not find it.", question) == 0.0
    assert count > 500


def _person_with_org(world):
    person = world.entities_of_kind(schema.PERSON)[0]
    return person, world.entity(world.value(person.id, "employer"))


def test_free_form_and_multi_hop_tasks():
    world, _, judge = env()
    org = world.entities_of_kind(schema.ORGANISATION)[3]
    founder = world.entity(world.value(org.id, "founder"))
    birthplace = world.value_text(founder.id, "born_in")
    assert judge.score(f"Please look up who established {org.name} (founder).", founder.name) == 1.0
    task = f"Which city was the founder of {org.name} born in? I need the birthplace."
    assert judge.assess(task, birthplace).golds == ((birthplace,),)
    assert judge.score(task, f"The founder was born in {birthplace}.") == 1.0
    assert judge.score(task, founder.name) == 0.0
    # Two targets in one task: partial credit.
    person, employer = _person_with_org(world)
    both = f"Find the employer of {person.name} and the employer of {founder.name}."
    assert judge.score(both, employer.name) == 0.5


def test_ambiguous_short_names_are_narrowed_by_the_question():
    world, sets, judge = env()
    for question in sets.stage1:
        subject = world.entity(question.answer_path[0][0])
        namesakes = world.entities_by_short_name[subject.short_name.lower()]
        if subject.kind == schema.PERSON and len(namesakes) > 1:
            step = question.decomposition[0]
            vague = schema.delegation_task(schema.FACT_TYPE_BY_NAME[step.fact], subject.short_name)
            verdict = judge.assess(vague, step.answer, question)
            assert verdict.golds == ((step.answer,),) and verdict.score == 1.0
            assert len(judge.assess(vague, step.answer).golds[0]) >= 1
            return
    raise AssertionError("no ambiguous person in stage1")


def test_unreadable_tasks_and_page_dumps_score_zero():
    world, _, judge = env()
    assert not judge.assess("Do your best.", "anything").resolved
    assert judge.score("Find out something about Nobody Anywhere.", "x") == 0.0
    person, employer = _person_with_org(world)
    task = f"Find the employer of {person.name}."
    assert judge.score(task, employer.name) == 1.0
    assert judge.score(task, world.page_of(person.id).text) == 0.0  # answers must be short


def test_answer_contains_matches_whole_tokens():
    assert answer_contains("about 48,210 people", "48210")
    assert not answer_contains("148210", "48210")
    assert answer_contains("Born on 1921-03-04.", "1921-03-04")
    assert not answer_contains("anything", "")
