import time
from functools import cache

import pytest

from mgrpo_jax.env import schema
from mgrpo_jax.env.world import URL_PREFIX, WorldConfig, estimate_tokens, generate_world, iter_fact_paths


@cache
def small_world(seed=3):
    return generate_world(seed, 1200)


def test_same_seed_same_world_byte_for_byte():
    first, second = generate_world(11, 600), generate_world(11, 600)
    assert first.digest() == second.digest()
    assert first.facts == second.facts
    assert generate_world(12, 600).digest() != first.digest()


def test_ten_thousand_entities_generate_in_seconds():
    started = time.perf_counter()
    world = generate_world(0, 10_000)
    assert time.perf_counter() - started < 20  # ~3 s on the shared 2-core machine
    assert len(world.entities) == len(world.pages) == 10_000


def test_every_entity_has_every_fact_of_its_kind_stated_on_its_page():
    world = small_world()
    for entity in world.entities:
        page = world.page_of(entity.id)
        assert page.title == entity.name and page.url == entity.url and page.url.startswith(URL_PREFIX)
        for fact in schema.facts_of_kind(entity.kind):
            value = world.value_text(entity.id, fact.name)
            assert any(value in sentence and entity.name in sentence for sentence in page.fact_sentences)
            if fact.is_relation:
                target = world.entity(world.value(entity.id, fact.name))
                assert target.kind == fact.object_kind
                assert target.url in page.links and target.url in page.text


def test_names_and_urls_are_unique_and_short_names_are_shared():
    world = small_world()
    assert len({entity.name.lower() for entity in world.entities}) == len(world.entities)
    assert len({entity.url for entity in world.entities}) == len(world.entities)
    shared = [group for group in world.entities_by_short_name.values() if len(group) > 1]
    assert len(shared) > 50  # namesakes exist, so careless searches can go wrong
    for entity in world.entities:
        assert entity.short_name.lower() in entity.name.lower() or entity.kind == schema.WORK


def test_graph_is_consistent():
    world = small_world()
    for country in world.entities_of_kind(schema.COUNTRY):
        assert world.value(world.value(country.id, "capital"), "located_in") == country.id
    for org in world.entities_of_kind(schema.ORGANISATION):
        founder = world.value(org.id, "founder")
        assert world.value(founder, "birth_date") < world.value(org.id, "founding_date")
    for event in world.entities_of_kind(schema.EVENT):
        assert event.name.endswith(world.value(event.id, "event_date")[:4])


def test_pages_are_long_enough_to_fill_a_single_agents_context():
    world = small_world()
    tokens = [estimate_tokens(page.text) for page in world.pages.values()]
    assert 550 < sum(tokens) / len(tokens) < 1000
    shorter = generate_world(3, 300, WorldConfig(300, background_sentences=4))
    assert max(estimate_tokens(page.text) for page in shorter.pages.values()) < 400


def test_fact_paths_never_revisit_and_stop_at_attributes():
    world = small_world()
    paths = list(iter_fact_paths(world, 0, 3))
    assert paths and max(len(path) for path in paths) == 3
    for path in paths:
        subjects = [subject for subject, _ in path]
        assert len(set(subjects)) == len(subjects)
        assert all(schema.FACT_TYPE_BY_NAME[name].is_relation for _, name in path[:-1])


def test_too_small_world_is_refused():
    with pytest.raises(ValueError, match="at least"):
        generate_world(0, 10)
