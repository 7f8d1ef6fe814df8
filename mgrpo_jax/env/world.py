"""The seeded offline world: a knowledge graph of fictional entities rendered to wiki-like pages.

Every entity has exactly one value for each relation and attribute of its kind, so every question
built from a path of facts has a single gold answer. Names deliberately share parts (people share
surnames, organisations share roots, events recur every few years): a careless searcher who drops part
of a name lands on a namesake's page, which is how the noisy experts make systematic mistakes.

Pages are long on purpose (DESIGN §4): a handful of fact sentences scattered among neutral background
paragraphs, so a single agent that visits a page per hop fills its context on 3–4 hop questions while a
main agent that delegates sees only short answers. `WorldConfig.background_sentences` sets the length.

`generate_world(seed, n_entities)` is a pure function of its arguments: the same inputs give the same
pages byte for byte (`World.digest()`), on any machine, because only `random.Random(seed)` draws are used
and every iteration order is fixed.
"""

from __future__ import annotations

import datetime
import hashlib
import random
import re
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from functools import cached_property

from mgrpo_jax.env import schema
from mgrpo_jax.env.schema import CITY, COUNTRY, EVENT, ORGANISATION, PERSON, WORK, FactType

URL_PREFIX = "https://wiki.offline/"

# Shares of the entity budget per kind; countries stay few, like in the real world.
_KIND_SHARES = {PERSON: 0.40, ORGANISATION: 0.17, CITY: 0.15, COUNTRY: 0.02, WORK: 0.16, EVENT: 0.10}

_ONSETS = ("b", "d", "f", "g", "k", "l", "m", "n", "p", "r", "s", "t", "v", "z", "br", "dr", "kl", "tr",
           "st", "sh", "th", "gr", "h", "j")
_VOWELS = ("a", "e", "i", "o", "u", "ai", "ea", "ou", "y")
_CODAS = ("", "", "n", "r", "l", "s", "th", "k", "m", "x")

_ORG_SUFFIXES = ("Institute", "Press", "Works", "Company", "Foundation", "Guild", "Bank", "University",
                 "Museum", "Society", "Trust", "Studios", "Laboratories", "Collective")
_CITY_SUFFIXES = ("Falls", "Harbour", "Heights", "Crossing", "Vale")
_COUNTRY_FORMS = ("Republic of {r}", "Kingdom of {r}", "{r}", "Federation of {r}", "{r} Union")
_WORK_ADJECTIVES = ("Silent", "Golden", "Broken", "Hidden", "Last", "Crimson", "Distant", "Quiet", "Burning",
                    "Frozen", "Wandering", "Lost", "Bright", "Hollow", "Iron", "Glass", "Endless", "Shifting",
                    "Northern", "Secret", "Patient", "Restless", "Painted", "Sunken")
_WORK_NOUNS = ("Lantern", "River", "Orchard", "Compass", "Harbour", "Archive", "Garden", "Mirror", "Tide",
               "Engine", "Meadow", "Tower", "Letter", "Bridge", "Forest", "Atlas", "Signal", "Voyage",
               "Kingdom", "Clockmaker", "Cartographer", "Lighthouse", "Season", "Debt", "Choir", "Winter",
               "Crossing", "Inheritance", "Machine", "Weaver")
_EVENT_TYPES = ("Lantern Festival", "Trade Fair", "Chess Open", "Film Festival", "Marathon",
                "Science Congress", "Music Week", "Book Fair", "Regatta", "Design Biennial")
_OCCUPATIONS = ("architect", "botanist", "cartographer", "chemist", "composer", "economist", "engineer",
                "historian", "journalist", "linguist", "mathematician", "painter", "pharmacist", "physician",
                "photographer", "sculptor", "surveyor", "translator", "novelist", "astronomer")
_SECTORS = ("banking", "publishing", "shipbuilding", "pharmaceuticals", "education", "textiles", "energy",
            "logistics", "software", "agriculture", "insurance", "broadcasting", "mining", "tourism")
_GENRES = ("mystery", "science fiction", "historical fiction", "poetry", "biography", "satire", "fantasy",
           "travel writing", "drama", "essay")

# Neutral background prose: it lengthens pages like real articles do without stating any fact a
# question could ask about (no sentence here names another entity or one of the schema's attributes).
_BACKGROUND = (
    "Local archives hold {n} letters and notebooks that mention {name}.",
    "Accounts of {name} vary between sources, and several of them were revised over the years.",
    "A small exhibition about {name} attracted interest from students and collectors.",
    "Historians have described the period around {name} as one of gradual change.",
    "Several photographs associated with {name} were restored by volunteers.",
    "The records concerning {name} were digitised in a project that took {n} weeks.",
    "Commentators often cite {name} when discussing the wider region.",
    "An early description of {name} survives in a handwritten ledger.",
    "Some of the surviving material about {name} is kept in private collections.",
    "Visitors who read about {name} often ask about the surrounding landscape.",
    "A short documentary featuring {name} was broadcast on regional television.",
    "Guidebooks give {name} between one and {small} paragraphs.",
    "The spelling of the name {name} has changed slightly over time.",
    "Little is known about the everyday details surrounding {name}.",
    "Researchers have compiled {n} references to {name} in printed sources.",
    "Debates about {name} continue in specialist journals.",
    "Newspapers of the time reported on {name} only occasionally.",
    "A commemorative plaque mentions {name} in passing.",
    "Oral histories collected in the area refer to {name} with affection.",
    "The most complete account of {name} runs to {n} typed pages.",
    "Scholars disagree about how much weight to give the early reports on {name}.",
    "There is an informal society of enthusiasts devoted to {name}.",
    "Maps from several decades show how the surroundings of {name} changed.",
    "Few of the original documents about {name} are available online.",
)
_ARTICLE = {PERSON: "a", ORGANISATION: "an", CITY: "a", COUNTRY: "a", WORK: "a", EVENT: "an"}
_SECTION_TITLES = ("Background", "Reception", "Sources", "Legacy", "Further reading", "Notes")


@dataclass(frozen=True)
class Entity:
    id: int
    kind: str
    name: str
    short_name: str  # the ambiguous part of the name a careless searcher keeps (surname, root, …)
    url: str


@dataclass(frozen=True)
class Page:
    url: str
    title: str
    text: str
    links: tuple[str, ...]
    fact_sentences: tuple[str, ...]  # the sentences that state facts (indexed by the search backend)


@dataclass(frozen=True)
class WorldConfig:
    n_entities: int = 10_000
    background_sentences: int = 26  # per page; ~2.6k characters of prose around the facts
    max_backlinks: int = 8


@dataclass(frozen=True)
class World:
    seed: int
    config: WorldConfig
    entities: tuple[Entity, ...]
    facts: Mapping[tuple[int, str], int | str]  # (subject id, fact type) -> object id or value text
    pages: Mapping[str, Page]  # url -> page

    def entity(self, entity_id: int) -> Entity:
        return self.entities[entity_id]

    def value(self, subject_id: int, fact_name: str) -> int | str:
        return self.facts[(subject_id, fact_name)]

    def value_text(self, subject_id: int, fact_name: str) -> str:
        """The fact's value as it is written on pages and in gold answers (entity name or literal)."""
        value = self.facts[(subject_id, fact_name)]
        return self.entities[value].name if schema.FACT_TYPE_BY_NAME[fact_name].is_relation else value

    def page_of(self, entity_id: int) -> Page:
        return self.pages[self.entities[entity_id].url]

    @cached_property
    def entity_by_url(self) -> dict[str, Entity]:
        return {entity.url: entity for entity in self.entities}

    @cached_property
    def entity_by_name(self) -> dict[str, Entity]:
        return {entity.name.lower(): entity for entity in self.entities}

    @cached_property
    def entities_by_short_name(self) -> dict[str, tuple[Entity, ...]]:
        grouped: dict[str, list[Entity]] = {}
        for entity in self.entities:
            grouped.setdefault(entity.short_name.lower(), []).append(entity)
        return {name: tuple(group) for name, group in grouped.items()}

    def entities_of_kind(self, kind: str) -> tuple[Entity, ...]:
        return tuple(entity for entity in self.entities if entity.kind == kind)

    def digest(self) -> str:
        """SHA-256 over every page's URL and text, in entity order: equal digests, equal worlds."""
        hasher = hashlib.sha256()
        for entity in self.entities:
            page = self.pages[entity.url]
            hasher.update(page.url.encode())
            hasher.update(b"\0")
            hasher.update(page.text.encode())
            hasher.update(b"\0")
        return hasher.hexdigest()


def slugify(name: str) -> str:
    return re.sub(r"[^a-z0-9]+", "-", name.lower()).strip("-")


CHARS_PER_TOKEN = 4  # about four characters per token for English BPE vocabularies


def estimate_tokens(text: str) -> int:
    """A tokenizer-free length estimate (`CHARS_PER_TOKEN`)."""
    return (len(text) + CHARS_PER_TOKEN - 1) // CHARS_PER_TOKEN


class _NameMaker:
    """Unique pronounceable roots drawn from syllables; one pool for the whole world so no two kinds
    share a root by accident."""

    def __init__(self, rng: random.Random):
        self._rng = rng
        self._used: set[str] = set()

    def root(self, syllables: tuple[int, ...] = (2, 2, 3)) -> str:
        while True:
            count = self._rng.choice(syllables)
            word = "".join(
                self._rng.choice(_ONSETS) + self._rng.choice(_VOWELS) + self._rng.choice(_CODAS)
                for _ in range(count)
            )
            word = word.capitalize()
            if word not in self._used and 4 <= len(word) <= 12:
                self._used.add(word)
                return word


def _kind_counts(n_entities: int) -> dict[str, int]:
    if n_entities < 60:
        raise ValueError(f"n_entities must be at least 60 to hold every kind, got {n_entities}")
    counts = {kind: max(3, int(n_entities * share)) for kind, share in _KIND_SHARES.items()}
    counts[PERSON] += n_entities - sum(counts.values())
    return counts


def _random_date(rng: random.Random, first_year: int, last_year: int) -> datetime.date:
    start = datetime.date(first_year, 1, 1).toordinal()
    end = datetime.date(last_year, 12, 31).toordinal()
    return datetime.date.fromordinal(rng.randint(start, end))


def _shift_years(day: datetime.date, years: int) -> datetime.date:
    return day.replace(year=day.year + years, day=min(day.day, 28))


def _make_names(rng: random.Random, counts: dict[str, int]) -> dict[str, list[tuple[str, str]]]:
    """(full name, short name) per entity, per kind; full names are unique across the world."""
    maker = _NameMaker(rng)
    names: dict[str, list[tuple[str, str]]] = {}
    taken: set[str] = set()

    def add(kind: str, full: str, short: str) -> bool:
        if full.lower() in taken:
            return False
        taken.add(full.lower())
        names[kind].append((full, short))
        return True

    names[PERSON] = []
    given = [maker.root((2,)) for _ in range(max(40, counts[PERSON] // 12))]
    surnames = [maker.root() for _ in range(max(10, counts[PERSON] // 3))]
    while len(names[PERSON]) < counts[PERSON]:
        surname = rng.choice(surnames)
        add(PERSON, f"{rng.choice(given)} {surname}", surname)

    names[ORGANISATION] = []
    org_roots = [maker.root() for _ in range(max(5, counts[ORGANISATION] // 2))]
    while len(names[ORGANISATION]) < counts[ORGANISATION]:
        root = rng.choice(org_roots)
        add(ORGANISATION, f"{root} {rng.choice(_ORG_SUFFIXES)}", root)

    names[CITY] = []
    city_roots = [maker.root() for _ in range(max(5, (counts[CITY] * 2) // 3))]
    for root in city_roots:
        add(CITY, root, root)
    while len(names[CITY]) < counts[CITY]:
        root = rng.choice(city_roots)
        add(CITY, f"{root} {rng.choice(_CITY_SUFFIXES)}", root)
    names[CITY] = names[CITY][: counts[CITY]]

    names[COUNTRY] = []
    while len(names[COUNTRY]) < counts[COUNTRY]:
        root = maker.root()
        add(COUNTRY, rng.choice(_COUNTRY_FORMS).format(r=root), root)

    names[WORK] = []
    while len(names[WORK]) < counts[WORK]:
        noun = rng.choice(_WORK_NOUNS)
        if rng.random() < 0.5:
            full = f"The {rng.choice(_WORK_ADJECTIVES)} {noun}"
        else:
            full = f"The {rng.choice(_WORK_ADJECTIVES)} {noun} of {maker.root()}"
        add(WORK, full, f"The {noun}")
    return names


def _sample_facts(rng: random.Random, kind_ids: dict[str, list[int]]) -> dict[tuple[int, str], int | str]:
    """Draw every relation and attribute; dates are kept consistent along the graph (founders are born
    before they found, authors before they publish) so date arithmetic questions make sense."""
    facts: dict[tuple[int, str], int | str] = {}
    birth: dict[int, datetime.date] = {}
    for person in kind_ids[PERSON]:
        birth[person] = _random_date(rng, 1850, 2000)
        facts[(person, "birth_date")] = birth[person].isoformat()
        facts[(person, "height_cm")] = str(rng.randint(150, 200))
        facts[(person, "occupation")] = rng.choice(_OCCUPATIONS)
        facts[(person, "born_in")] = rng.choice(kind_ids[CITY])
        facts[(person, "employer")] = rng.choice(kind_ids[ORGANISATION])
        facts[(person, "alma_mater")] = rng.choice(kind_ids[ORGANISATION])
    for org in kind_ids[ORGANISATION]:
        founder = rng.choice(kind_ids[PERSON])
        facts[(org, "founder")] = founder
        facts[(org, "headquarters")] = rng.choice(kind_ids[CITY])
        founded = _shift_years(birth[founder], rng.randint(22, 60))
        founded += datetime.timedelta(days=rng.randint(0, 364))
        facts[(org, "founding_date")] = founded.isoformat()
        facts[(org, "employees")] = str(rng.randint(12, 90_000))
        facts[(org, "sector")] = rng.choice(_SECTORS)
    countries = kind_ids[COUNTRY]
    for index, city in enumerate(kind_ids[CITY]):
        # Every country gets at least one city, so every country has a capital inside it.
        country = countries[index] if index < len(countries) else rng.choice(countries)
        facts[(city, "located_in")] = country
        facts[(city, "mayor")] = rng.choice(kind_ids[PERSON])
        facts[(city, "population")] = str(rng.randint(2_000, 4_000_000))
        facts[(city, "elevation_m")] = str(rng.randint(1, 2_900))
    cities_by_country: dict[int, list[int]] = {}
    for city in kind_ids[CITY]:
        cities_by_country.setdefault(facts[(city, "located_in")], []).append(city)
    for country in countries:
        facts[(country, "capital")] = rng.choice(cities_by_country[country])
        facts[(country, "area_km2")] = str(rng.randint(900, 2_500_000))
    for work in kind_ids[WORK]:
        author = rng.choice(kind_ids[PERSON])
        facts[(work, "author")] = author
        facts[(work, "publisher")] = rng.choice(kind_ids[ORGANISATION])
        facts[(work, "publication_year")] = str(birth[author].year + rng.randint(20, 70))
        facts[(work, "page_count")] = str(rng.randint(48, 1_200))
        facts[(work, "genre")] = rng.choice(_GENRES)
    for event in kind_ids[EVENT]:
        facts[(event, "organiser")] = rng.choice(kind_ids[ORGANISATION])
        facts[(event, "attendance")] = str(rng.randint(150, 250_000))
    return facts


def _sample_events(
    rng: random.Random, event_ids: list[int], city_entities: list[tuple[int, str, str]],
    facts: dict[tuple[int, str], int | str], taken: set[str],
) -> list[tuple[str, str]]:
    """Events are named after their host city, type and year ("Dravosk Book Fair 1987"), so one city's
    recurring fair yields a family of near-identical names."""
    names = []
    for event in event_ids:
        while True:
            city_id, city_name, _ = rng.choice(city_entities)
            event_type = rng.choice(_EVENT_TYPES)
            day = _random_date(rng, 1900, 2024)
            full = f"{city_name} {event_type} {day.year}"
            if full.lower() not in taken:
                break
        taken.add(full.lower())
        facts[(event, "venue")] = city_id
        facts[(event, "event_date")] = day.isoformat()
        names.append((full, f"{city_name} {event_type}"))
    return names


def _fact_sentence(rng: random.Random, fact: FactType, subject: str, value: str) -> str:
    return rng.choice(fact.sentences).format(s=subject, o=value)


def _render_page(
    rng: random.Random, entity: Entity, world_entities: list[Entity],
    facts: dict[tuple[int, str], int | str], backlinks: list[int], config: WorldConfig,
    title_by_url: dict[str, str],
) -> Page:
    fact_sentences = []
    links = []
    for fact in schema.facts_of_kind(entity.kind):
        value = facts[(entity.id, fact.name)]
        if fact.is_relation:
            target = world_entities[value]
            fact_sentences.append(_fact_sentence(rng, fact, entity.name, target.name))
            links.append(target.url)
        else:
            fact_sentences.append(_fact_sentence(rng, fact, entity.name, value))
    rng.shuffle(fact_sentences)
    # Cycle through shuffled templates so a page repeats none until it has used them all.
    templates: list[str] = []
    while len(templates) < config.background_sentences:
        templates.extend(rng.sample(_BACKGROUND, len(_BACKGROUND)))
    background = [
        template.format(name=entity.name, n=rng.randint(3, 900), small=rng.randint(2, 9))
        for template in templates[: config.background_sentences]
    ]
    # Facts are scattered through the article, not stacked in the lead: reading only the top of a page
    # (or a truncated page) misses some of them.
    body = [fact_sentences[0]] + background
    for sentence in fact_sentences[1:]:
        body.insert(rng.randint(1, len(body)), sentence)
    paragraphs = [body[start : start + 5] for start in range(0, len(body), 5)]
    kind_noun = f"{_ARTICLE[entity.kind]} {schema.KIND_NOUN[entity.kind]}"
    sections = [f"{entity.name}\n\n{entity.name} is {kind_noun} in the offline wiki."]
    for index, paragraph in enumerate(paragraphs):
        heading = "" if index == 0 else f"== {_SECTION_TITLES[(index - 1) % len(_SECTION_TITLES)]} ==\n"
        sections.append(heading + " ".join(paragraph))
    for backlink in backlinks[: config.max_backlinks]:
        links.append(world_entities[backlink].url)
    link_lines = "\n".join(f"- {title_by_url[url]}: {url}" for url in dict.fromkeys(links))
    sections.append(f"== Links ==\n{link_lines}")
    return Page(
        url=entity.url,
        title=entity.name,
        text="\n\n".join(sections),
        links=tuple(dict.fromkeys(links)),
        fact_sentences=tuple(fact_sentences),
    )


def generate_world(seed: int, n_entities: int = 10_000, config: WorldConfig | None = None) -> World:
    """Generate the world for `seed`; `n_entities` overrides `config.n_entities`."""
    config = WorldConfig(n_entities=n_entities) if config is None else config
    if config.n_entities != n_entities:
        config = WorldConfig(n_entities, config.background_sentences, config.max_backlinks)
    rng = random.Random(seed)
    counts = _kind_counts(config.n_entities)
    kind_order = (PERSON, ORGANISATION, CITY, COUNTRY, WORK, EVENT)
    kind_ids: dict[str, list[int]] = {}
    next_id = 0
    for kind in kind_order:
        kind_ids[kind] = list(range(next_id, next_id + counts[kind]))
        next_id += counts[kind]
    names = _make_names(rng, counts)
    facts = _sample_facts(rng, kind_ids)
    taken = {full.lower() for group in names.values() for full, _ in group}
    city_entities = [(city, *names[CITY][i]) for i, city in enumerate(kind_ids[CITY])]
    names[EVENT] = _sample_events(rng, kind_ids[EVENT], city_entities, facts, taken)

    entities: list[Entity] = []
    for kind in kind_order:
        for entity_id, (full, short) in zip(kind_ids[kind], names[kind], strict=True):
            entities.append(Entity(entity_id, kind, full, short, f"{URL_PREFIX}{kind}/{slugify(full)}"))
    if len({entity.url for entity in entities}) != len(entities):
        raise AssertionError("slug collision: two entity names map to one URL")

    backlinks: dict[int, list[int]] = {entity.id: [] for entity in entities}
    for (subject, fact_name), value in facts.items():
        if schema.FACT_TYPE_BY_NAME[fact_name].is_relation:
            backlinks[value].append(subject)
    title_by_url = {entity.url: entity.name for entity in entities}
    pages = {}
    for entity in entities:
        page_rng = random.Random(f"{seed}/{entity.id}")  # per-page streams: pages don't shift each other
        pages[entity.url] = _render_page(
            page_rng, entity, entities, facts, sorted(backlinks[entity.id]), config, title_by_url
        )
    return World(seed=seed, config=config, entities=tuple(entities), facts=facts, pages=pages)


def iter_fact_paths(world: World, start_id: int, max_hops: int) -> Iterator[tuple[tuple[int, str], ...]]:
    """Every path of (subject id, fact type) steps from `start_id` with at most `max_hops` steps that
    never revisits an entity; paths ending in an attribute stop there."""
    def walk(entity_id: int, path: tuple[tuple[int, str], ...], seen: frozenset[int]):
        for fact in schema.facts_of_kind(world.entities[entity_id].kind):
            step = path + ((entity_id, fact.name),)
            if fact.is_relation:
                target = world.facts[(entity_id, fact.name)]
                if target in seen:
                    continue
                yield step
                if len(step) < max_hops:
                    yield from walk(target, step, seen | {target})
            else:
                yield step

    yield from walk(start_id, (), frozenset({start_id}))
