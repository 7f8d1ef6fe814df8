"""The vocabulary of the offline world: entity kinds, typed relations and attributes, and every way each
one is phrased (page sentences, question noun phrases, delegated-task wording, search queries, keywords).

One table drives the page renderer, the question generator, the scripted experts and the rule-based
expert judge, so a fact is always stated, asked and recognised with the same vocabulary.
"""

from __future__ import annotations

from dataclasses import dataclass

PERSON, ORGANISATION, CITY = "person", "organisation", "city"
COUNTRY, WORK, EVENT = "country", "work", "event"
ENTITY_KINDS: tuple[str, ...] = (PERSON, ORGANISATION, CITY, COUNTRY, WORK, EVENT)

# What a value of each kind is called in a question ("Which city is …?").
KIND_NOUN = {
    PERSON: "person",
    ORGANISATION: "organisation",
    CITY: "city",
    COUNTRY: "country",
    WORK: "work",
    EVENT: "event",
}

DATE, INTEGER, TEXT = "date", "integer", "text"


@dataclass(frozen=True)
class FactType:
    """A relation (value is another entity) or an attribute (value is a date, integer or text).

    `noun_phrases` are templates with `{x}` naming the subject ("the birthplace of {x}"); the first is the
    canonical one experts use when they delegate. `sentences` state the fact on the subject's page with
    `{s}` and `{o}` (the object or value). `keywords` recognise the fact in free-form task text (the
    judge and the sub-agent expert read delegated tasks with them). `query_words` are what a competent
    searcher adds to the subject's name; `misleading_query_words` are the systematic bad phrasing of a
    noisy expert.
    """

    name: str
    subject_kind: str
    object_kind: str | None  # an entity kind for relations, None for attributes
    value_type: str | None  # DATE / INTEGER / TEXT for attributes, None for relations
    noun_phrases: tuple[str, ...]
    sentences: tuple[str, ...]
    keywords: tuple[str, ...]
    query_words: str
    misleading_query_words: str
    answer_hint: str = ""

    @property
    def is_relation(self) -> bool:
        return self.object_kind is not None


def _relation(name, subject, obj, phrases, sentences, keywords, query, misleading) -> FactType:
    return FactType(name, subject, obj, None, phrases, sentences, keywords, query, misleading)


def _attribute(name, subject, value_type, phrases, sentences, keywords, query, misleading, hint) -> FactType:
    return FactType(name, subject, None, value_type, phrases, sentences, keywords, query, misleading, hint)


_DATE_HINT = "Give the date as YYYY-MM-DD."
_NUMBER_HINT = "Give the number only."

FACT_TYPES: tuple[FactType, ...] = (
    _relation(
        "born_in", PERSON, CITY,
        ("the birthplace of {x}", "the city where {x} was born"),
        ("{s} was born in {o}.", "The birthplace of {s} is {o}.", "{o} is the city where {s} was born."),
        ("birthplace", "born in", "city where", "place of birth", "hometown"),
        "birthplace born in", "hometown childhood",
    ),
    _relation(
        "employer", PERSON, ORGANISATION,
        ("the employer of {x}", "the organisation {x} works for"),
        ("{s} works for {o}.", "{s} is employed by {o}.", "The employer of {s} is {o}."),
        ("employer", "works for", "employed by", "work for"),
        "employer works for", "career colleagues",
    ),
    _relation(
        "alma_mater", PERSON, ORGANISATION,
        ("the alma mater of {x}", "the institution where {x} studied"),
        ("{s} studied at {o}.", "{s} was educated at {o}.", "The alma mater of {s} is {o}."),
        ("alma mater", "studied", "educated", "study"),
        "studied at alma mater", "teachers school years",
    ),
    _relation(
        "headquarters", ORGANISATION, CITY,
        ("the headquarters city of {x}", "the city where {x} is headquartered"),
        ("{s} is headquartered in {o}.", "The headquarters of {s} are in {o}.", "{s} is based in {o}."),
        ("headquarter", "based in", "head office"),
        "headquartered in", "offices branches",
    ),
    _relation(
        "founder", ORGANISATION, PERSON,
        ("the founder of {x}", "the person who founded {x}"),
        ("{s} was founded by {o}.", "{o} founded {s}.", "The founder of {s} is {o}."),
        ("founder", "founded by", "who founded", "established by"),
        "founded by founder", "origins history",
    ),
    _relation(
        "located_in", CITY, COUNTRY,
        ("the country of {x}", "the country in which {x} lies"),
        ("{s} is a city in {o}.", "{s} lies in {o}.", "{s} is located in {o}."),
        ("country of", "country in which", "which country", "located in", "lies in"),
        "city located in country", "region province",
    ),
    _relation(
        "capital", COUNTRY, CITY,
        ("the capital of {x}", "the capital city of {x}"),
        ("The capital of {s} is {o}.", "{o} is the capital of {s}."),
        ("capital",),
        "capital city", "largest town",
    ),
    _relation(
        "mayor", CITY, PERSON,
        ("the mayor of {x}", "the person who serves as mayor of {x}"),
        ("The mayor of {s} is {o}.", "{o} serves as mayor of {s}."),
        ("mayor",),
        "mayor of", "council leaders",
    ),
    _relation(
        "author", WORK, PERSON,
        ("the author of {x}", "the person who wrote {x}"),
        ("{s} was written by {o}.", "{o} is the author of {s}.", "{o} wrote {s}."),
        ("author", "wrote", "written by", "writer"),
        "written by author", "readers reviews",
    ),
    _relation(
        "publisher", WORK, ORGANISATION,
        ("the publisher of {x}", "the organisation that published {x}"),
        ("{s} was published by {o}.", "{o} published {s}.", "The publisher of {s} is {o}."),
        ("publisher", "published by", "that published"),
        "published by publisher", "editions printing",
    ),
    _relation(
        "venue", EVENT, CITY,
        ("the host city of {x}", "the city that hosted {x}"),
        ("{s} was held in {o}.", "{o} hosted {s}.", "The host city of {s} is {o}."),
        ("host city", "hosted", "held in", "venue"),
        "held in host city", "tickets travel",
    ),
    _relation(
        "organiser", EVENT, ORGANISATION,
        ("the organiser of {x}", "the organisation that organised {x}"),
        ("{s} was organised by {o}.", "{o} organised {s}.", "The organiser of {s} is {o}."),
        ("organiser", "organised", "organized", "organizer", "run by"),
        "organised by organiser", "sponsors volunteers",
    ),
    _attribute(
        "birth_date", PERSON, DATE,
        ("the birth date of {x}", "the date of birth of {x}"),
        ("{s} was born on {o}.", "The date of birth of {s} is {o}.", "{s}'s birth date is {o}."),
        ("birth date", "date of birth", "born on", "birthday"),
        "born on date of birth", "early life", _DATE_HINT,
    ),
    _attribute(
        "height_cm", PERSON, INTEGER,
        ("the height in centimetres of {x}",),
        ("{s} is {o} cm tall.", "{s} stands {o} centimetres tall."),
        ("height", "tall", "centimetres"),
        "height cm tall", "appearance portrait", _NUMBER_HINT,
    ),
    _attribute(
        "occupation", PERSON, TEXT,
        ("the occupation of {x}", "the profession of {x}"),
        ("{s} works as a {o}.", "By profession, {s} is a {o}.", "The occupation of {s} is {o}."),
        ("occupation", "profession", "works as", "job"),
        "occupation profession", "daily routine", "",
    ),
    _attribute(
        "founding_date", ORGANISATION, DATE,
        ("the founding date of {x}", "the date on which {x} was founded"),
        ("{s} was founded on {o}.", "{s} was established on {o}.", "The founding date of {s} is {o}."),
        ("founding date", "founded on", "established on", "date of founding", "was founded"),
        "founded on founding date", "anniversary", _DATE_HINT,
    ),
    _attribute(
        "employees", ORGANISATION, INTEGER,
        ("the number of employees of {x}", "the staff count of {x}"),
        ("{s} has {o} employees.", "The staff of {s} numbers {o}.", "{s} employs {o} people."),
        ("employees", "staff", "workforce", "employs"),
        "number of employees staff", "hiring jobs", _NUMBER_HINT,
    ),
    _attribute(
        "sector", ORGANISATION, TEXT,
        ("the sector of {x}", "the industry of {x}"),
        ("{s} operates in the {o} sector.", "The sector of {s} is {o}."),
        ("sector", "industry"),
        "sector industry", "products customers", "",
    ),
    _attribute(
        "population", CITY, INTEGER,
        ("the population of {x}", "the number of inhabitants of {x}"),
        ("{s} has a population of {o}.", "{o} people live in {s}.", "The population of {s} is {o}."),
        ("population", "inhabitants", "residents", "people live"),
        "population inhabitants", "census districts", _NUMBER_HINT,
    ),
    _attribute(
        "elevation_m", CITY, INTEGER,
        ("the elevation in metres of {x}",),
        ("{s} lies {o} metres above sea level.", "The elevation of {s} is {o} metres."),
        ("elevation", "altitude", "above sea level"),
        "elevation metres above sea level", "hills climate", _NUMBER_HINT,
    ),
    _attribute(
        "area_km2", COUNTRY, INTEGER,
        ("the area in square kilometres of {x}",),
        ("{s} covers {o} square kilometres.", "The area of {s} is {o} square kilometres."),
        ("area", "square kilomet"),
        "area square kilometres", "borders geography", _NUMBER_HINT,
    ),
    _attribute(
        "publication_year", WORK, INTEGER,
        ("the publication year of {x}", "the year {x} was first published"),
        ("{s} was first published in {o}.", "The publication year of {s} is {o}."),
        ("publication year", "first published", "year published", "published in"),
        "first published year", "reprint edition", _NUMBER_HINT,
    ),
    _attribute(
        "page_count", WORK, INTEGER,
        ("the page count of {x}", "the number of pages of {x}"),
        ("{s} runs to {o} pages.", "The page count of {s} is {o}."),
        ("page count", "pages"),
        "number of pages", "chapters plot", _NUMBER_HINT,
    ),
    _attribute(
        "genre", WORK, TEXT,
        ("the genre of {x}",),
        ("{s} belongs to the {o} genre.", "The genre of {s} is {o}."),
        ("genre",),
        "genre", "style themes", "",
    ),
    _attribute(
        "event_date", EVENT, DATE,
        ("the date of {x}", "the day on which {x} took place"),
        ("{s} took place on {o}.", "{s} was held on {o}.", "The date of {s} is {o}."),
        ("date of", "took place", "held on", "happened"),
        "took place on date", "programme schedule", _DATE_HINT,
    ),
    _attribute(
        "attendance", EVENT, INTEGER,
        ("the attendance of {x}", "the number of attendees of {x}"),
        ("{s} drew {o} attendees.", "The attendance of {s} was {o}."),
        ("attendance", "attendees", "visitors", "attended"),
        "attendance attendees", "crowds weather", _NUMBER_HINT,
    ),
)

FACT_TYPE_BY_NAME: dict[str, FactType] = {fact.name: fact for fact in FACT_TYPES}
RELATIONS: tuple[FactType, ...] = tuple(fact for fact in FACT_TYPES if fact.is_relation)
ATTRIBUTES: tuple[FactType, ...] = tuple(fact for fact in FACT_TYPES if not fact.is_relation)


def facts_of_kind(kind: str) -> tuple[FactType, ...]:
    """Every relation and attribute whose subject is an entity of `kind`."""
    return tuple(fact for fact in FACT_TYPES if fact.subject_kind == kind)


def delegation_task(fact: FactType, subject: str) -> str:
    """The canonical wording of a one-fact research task, as the main-agent expert delegates it."""
    task = f"Find {fact.noun_phrases[0].format(x=subject)}."
    return f"{task} {fact.answer_hint}" if fact.answer_hint else task
