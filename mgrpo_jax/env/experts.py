"""Scripted, systematically noisy experts that write demonstration transcripts in the real protocol.

Three experts share one research routine:
- the **sub-agent** reads its delegated task (with the judge's `TaskReader`), searches, picks a result,
  visits the page and answers with the fact;
- the **main agent** follows the question's decomposition: it delegates one lookup per turn (naming
  the entity the previous sub-agent reported, so errors propagate), calls `reason` for comparisons and
  arithmetic, and answers;
- the **single agent** does all of it in one context with search, visit and reason.

Every turn goes through `protocol.render_*` and every tool output comes from the real tools, so
transcripts parse and replay exactly.

Noise is systematic, never a per-episode coin flip (DESIGN §4: a clone averages independent noise
away). Each kind of mistake is tied to a fixed subset of fact types, entities or question kinds, chosen
by hashing with `NoiseConfig.seed`:
- misleading search: for some fact types the expert always searches with the bare short name and
  off-topic words, and trusts the top result;
- namesake page: for some entities the expert always opens a namesake's page instead of theirs;
- dropped constraint: for some fact types the main agent always delegates with only the ambiguous part
  of the subject's name (the single agent searches that way);
- skipped verification: for some reasoning kinds the planner never calls `reason` and answers with a
  mental shortcut (first option wins; arithmetic on rounded numbers; years subtracted without dates).
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from dataclasses import dataclass, field

from mgrpo_jax.env import calculator, schema
from mgrpo_jax.env.expert_judge import ExpertJudge, TaskReader, TaskTarget
from mgrpo_jax.env.prompts import (
    ASSISTANT,
    MAIN,
    SINGLE,
    SUB,
    SYSTEM,
    TOOL,
    USER,
    Message,
    question_prompt,
    sub_agent_prompt,
    system_prompt,
)
from mgrpo_jax.env.protocol import render_answer, render_tool_call, render_tool_response
from mgrpo_jax.env.questions import (
    COMPARE,
    DATE_GAP,
    DELEGATE_STEP,
    DIFFERENCE,
    REASONING_KINDS,
    SUM,
    Question,
)
from mgrpo_jax.env.scoring import world_answer_correct
from mgrpo_jax.env.tools import (
    DELEGATE,
    REASON,
    SEARCH,
    VISIT,
    ReasonTool,
    SearchTool,
    VisitTool,
    WebBackend,
    WorldBackend,
    main_agent_toolbox,
    single_agent_toolbox,
    sub_agent_toolbox,
)
from mgrpo_jax.env.world import World

NOT_FOUND = "Not found"
_FACT_NAMES = [fact.name for fact in schema.FACT_TYPES]


def _unit_hash(*parts: object) -> float:
    digest = hashlib.blake2b("/".join(map(str, parts)).encode(), digest_size=8).digest()
    return int.from_bytes(digest, "big") / 2**64


def _affected_subset(seed: int, tag: str, names: Sequence[str], fraction: float) -> frozenset[str]:
    """Exactly round(fraction · len(names)) names, chosen by hash: a fixed, seed-dependent subset."""
    ranked = sorted(names, key=lambda name: _unit_hash(seed, tag, name))
    return frozenset(ranked[: round(fraction * len(names))])


@dataclass(frozen=True)
class NoiseConfig:
    """How often (as a share of fact types, entities or reasoning kinds) each systematic mistake applies."""

    seed: int = 0
    misleading_query_fraction: float = 0.2  # of fact types
    namesake_page_fraction: float = 0.1  # of entities
    dropped_constraint_fraction: float = 0.2  # of fact types
    skipped_verification_fraction: float = 0.5  # of reasoning kinds (compare, sum, difference, date_gap)

    @classmethod
    def clean(cls) -> NoiseConfig:
        return cls(0, 0.0, 0.0, 0.0, 0.0)

    @property
    def misleading_query_facts(self) -> frozenset[str]:
        return _affected_subset(self.seed, "query", _FACT_NAMES, self.misleading_query_fraction)

    @property
    def dropped_constraint_facts(self) -> frozenset[str]:
        return _affected_subset(self.seed, "drop", _FACT_NAMES, self.dropped_constraint_fraction)

    @property
    def skipped_verification_kinds(self) -> frozenset[str]:
        return _affected_subset(self.seed, "verify", list(REASONING_KINDS), self.skipped_verification_fraction)

    def mistakes_page_of(self, entity_id: int) -> bool:
        return _unit_hash(self.seed, "namesake", entity_id) < self.namesake_page_fraction


@dataclass(frozen=True)
class Episode:
    """One agent's conversation. `messages` start with the system prompt and the first user message;
    assistant messages are protocol turns, tool messages are wrapped tool outputs."""

    agent: str  # main / sub / single
    messages: tuple[Message, ...]
    answer: str
    task: str | None = None  # sub-agent episodes: the delegated task

    @property
    def assistant_turns(self) -> tuple[str, ...]:
        return tuple(message.text for message in self.messages if message.role == ASSISTANT)

    def as_chat(self) -> list[tuple[str, str]]:
        return [(message.role, message.text) for message in self.messages]


@dataclass(frozen=True)
class Transcript:
    """A demonstration for one question: the top-level episode, the sub-agent episodes it delegated
    (in call order; empty for the single agent), and the expert judge's score of each sub-episode."""

    question: Question
    mode: str  # "multi" or "single"
    top: Episode
    subs: tuple[Episode, ...]
    answer: str
    correct: bool
    sub_scores: tuple[float, ...] = ()


@dataclass
class _Research:
    """The tool turns and finding of one lookup, to be placed in a sub-agent's or single agent's context."""

    turns: list[tuple[str, str]] = field(default_factory=list)  # (assistant turn, tool output)
    answer: str = NOT_FOUND
    answer_entity: int | None = None


class ScriptedExperts:
    """The three experts over one world and backend, with one noise configuration."""

    def __init__(self, world: World, noise: NoiseConfig | None = None, backend: WebBackend | None = None,
                 top_k: int = 5, judge: ExpertJudge | None = None):
        self.world = world
        self.noise = noise or NoiseConfig()
        self.backend = backend or WorldBackend(world)
        self.reader = TaskReader(world)
        self.judge = judge or ExpertJudge(world)
        self._search, self._visit = SearchTool(self.backend, top_k), VisitTool(self.backend)
        self._reason = ReasonTool()
        self._misleading = self.noise.misleading_query_facts
        self._dropped = self.noise.dropped_constraint_facts
        self._skipped = self.noise.skipped_verification_kinds

    # ------------------------------------------------------------ research (sub-agent routine)

    def _choose_hit(self, hits, name: str, careless: bool, intended: int | None) -> list[str]:
        """URLs to try, in order. A careful searcher prefers the result titled exactly `name`; a careless
        one trusts the ranking; one who confuses `intended` with a namesake skips its page."""
        urls = [hit.url for hit in hits]
        if not careless:
            exact = [hit.url for hit in hits if hit.title.lower() == name.lower()]
            urls = exact + [url for url in urls if url not in exact]
        if intended is not None and self.noise.mistakes_page_of(intended):
            intended_url = self.world.entities[intended].url
            urls = [url for url in urls if url != intended_url] + [url for url in urls if url == intended_url]
        return urls

    def _lookup(self, research: _Research, target: TaskTarget, display: str) -> None:
        """Follow `target.facts` from the mentioned entity, one search or link and one visit per fact."""
        current_url: str | None = self.world.entities[target.candidates[0]].url if target.via_url else None
        current_name = display
        intended = target.candidates[0] if len(target.candidates) == 1 else None
        for fact_name in target.facts:
            fact = schema.FACT_TYPE_BY_NAME[fact_name]
            wanted = fact.noun_phrases[0].format(x=current_name)
            urls: list[str]
            if current_url is None:
                careless = fact_name in self._misleading
                short = self._short_name(current_name)
                query = f"{short} {fact.misleading_query_words}" if careless else f"{current_name} {fact.query_words}"
                output, hits = self._search.search_with_hits(query)
                research.turns.append((render_tool_call(
                    SEARCH, {"query": query}, f"I need {wanted}. I will search for it."), output))
                urls = self._choose_hit(hits, current_name, careless, intended)
            else:
                urls = [current_url]
            value = None
            for url in urls[:2]:
                output = self._visit({"url": url})
                reason = ("This page should state it." if current_url else
                          "This result looks like the right page.")
                research.turns.append((render_tool_call(VISIT, {"url": url}, f"{reason} Opening {url}."), output))
                entity = self.world.entity_by_url.get(url)
                if entity is not None and (entity.id, fact_name) in self.world.facts:
                    value = self.world.facts[(entity.id, fact_name)]
                    break
            if value is None:
                research.answer, research.answer_entity = NOT_FOUND, None
                return
            if fact.is_relation:
                next_entity = self.world.entities[value]
                current_name, current_url, intended = next_entity.name, next_entity.url, next_entity.id
                research.answer, research.answer_entity = next_entity.name, next_entity.id
            else:
                research.answer, research.answer_entity = str(value), None

    def _short_name(self, name: str) -> str:
        entity = self.world.entity_by_name.get(name.lower())
        return entity.short_name if entity is not None else name

    def _research(self, task: str) -> _Research:
        research = _Research()
        reading = self.reader.read(task)
        findings = []
        for target in reading.targets:
            if len(target.candidates) == 1:
                display = self.world.entities[target.candidates[0]].name
            else:
                display = self.world.entities[target.candidates[0]].short_name
            step = _Research()
            self._lookup(step, target, display)
            research.turns.extend(step.turns)
            findings.append(step)
        if findings:
            research.answer = "; ".join(step.answer for step in findings)
            research.answer_entity = findings[0].answer_entity if len(findings) == 1 else None
        return research

    def sub_agent(self, task: str, context: str = "") -> Episode:
        """The sub-agent expert's episode for `delegate(task, context)`."""
        research = self._research(task)
        messages = [
            Message(SYSTEM, system_prompt(SUB, sub_agent_toolbox(self.backend).specs)),
            Message(USER, sub_agent_prompt(task, context)),
        ]
        for turn, output in research.turns:
            messages += [Message(ASSISTANT, turn), Message(TOOL, render_tool_response(output))]
        think = ("I found the answer." if research.answer != NOT_FOUND
                 else "I could not find what the task asks for.")
        messages.append(Message(ASSISTANT, render_answer(research.answer, think)))
        return Episode(SUB, tuple(messages), research.answer, task=task)

    # ------------------------------------------------------------ planning (main and single agent)

    def _task_for(self, question: Question, step, answers: dict[int, str]) -> str:
        fact = schema.FACT_TYPE_BY_NAME[step.fact]
        if not step.inputs and question.root_url is not None:
            return step.description  # the walk's first task names the start page
        subject = answers[step.inputs[0]] if step.inputs else self.world.entities[step.subject_id].name
        if step.fact in self._dropped:
            subject = self._short_name(subject)
        return schema.delegation_task(fact, subject)

    def _reasoning(self, question: Question, answers: dict[int, str], holders: tuple[str, str]):
        """(expression or None if skipped, result text, final answer) for a reasoning question."""
        reason_step = question.decomposition[-1]
        value_a, value_b = (answers[index] for index in reason_step.inputs)
        kind = question.kind
        expression = {
            COMPARE: f"{value_a} {'<' if _looks_like_date(value_a) else '>'} {value_b}",
            SUM: f"{value_a} + {value_b}",
            DIFFERENCE: f"abs({value_a} - {value_b})",
            DATE_GAP: f"abs(years_between({value_a}, {value_b}))",
        }[kind]
        if kind in self._skipped:
            return None, None, _shortcut(kind, value_a, value_b, holders)
        try:
            result = calculator.evaluate(expression)
        except calculator.CalculatorError:
            result = None
        if kind == COMPARE:
            final = holders[0] if result == "true" else holders[1]
        else:
            final = result if result is not None else value_a
        return expression, result, final

    def _holders(self, question: Question, answers: dict[int, str]) -> tuple[str, str]:
        """The names of the two compared entities, as far as this agent knows them."""
        reason_step = question.decomposition[-1]
        names = []
        for index in reason_step.inputs:
            step = question.decomposition[index]
            names.append(answers[step.inputs[0]] if step.inputs else self.world.entities[step.subject_id].name)
        return names[0], names[1]

    def main_agent(self, question: Question) -> Transcript:
        """The main-agent expert's transcript, with one sub-agent episode per delegation."""
        messages = [
            Message(SYSTEM, system_prompt(MAIN, main_agent_toolbox().specs)),
            Message(USER, question_prompt(question.text)),
        ]
        answers: dict[int, str] = {}
        subs: list[Episode] = []
        for step in question.decomposition:
            if step.tool != DELEGATE_STEP:
                continue
            task = self._task_for(question, step, answers)
            context = "" if not step.inputs else f"Found earlier: {answers[step.inputs[0]]}."
            arguments = {"task": task, "context": context} if context else {"task": task}
            messages.append(Message(ASSISTANT, render_tool_call(
                DELEGATE, arguments, f"Next I need one fact. I will delegate: {task}")))
            episode = self.sub_agent(task, context)
            subs.append(episode)
            answers[step.index] = episode.answer
            messages.append(Message(TOOL, render_tool_response(episode.answer)))
        final = self._finish(question, answers, messages)
        scores = tuple(self.judge.score(episode.task, episode.answer, question) for episode in subs)
        return Transcript(question, "multi", Episode(MAIN, tuple(messages), final), tuple(subs), final,
                          world_answer_correct(final, question.answer), scores)

    def single_agent(self, question: Question) -> Transcript:
        """The single-agent expert's transcript: every search and visit in one context."""
        messages = [
            Message(SYSTEM, system_prompt(SINGLE, single_agent_toolbox(self.backend).specs)),
            Message(USER, question_prompt(question.text)),
        ]
        answers: dict[int, str] = {}
        for step in question.decomposition:
            if step.tool != DELEGATE_STEP:
                continue
            research = self._research(self._task_for(question, step, answers))
            for turn, output in research.turns:
                messages += [Message(ASSISTANT, turn), Message(TOOL, render_tool_response(output))]
            answers[step.index] = research.answer
        final = self._finish(question, answers, messages)
        return Transcript(question, "single", Episode(SINGLE, tuple(messages), final), (), final,
                          world_answer_correct(final, question.answer))

    def _finish(self, question: Question, answers: dict[int, str], messages: list[Message]) -> str:
        """Append the reason call (if any) and the final answer turn; return the final answer."""
        last_lookup = max(answers)
        if question.kind not in REASONING_KINDS:
            final = answers[last_lookup]
            think = "The last finding answers the question."
        else:
            holders = self._holders(question, answers)
            expression, result, final = self._reasoning(question, answers, holders)
            if expression is None:
                think = "I can work this out in my head."
            else:
                messages.append(Message(ASSISTANT, render_tool_call(
                    REASON, {"problem": expression}, "I have both values; I will compute the result exactly.")))
                messages.append(Message(TOOL, render_tool_response(self._reason({"problem": expression}))))
                think = f"The computation gives {result}."
        if not final.strip():
            final = NOT_FOUND
        messages.append(Message(ASSISTANT, render_answer(final, think)))
        return final


def _looks_like_date(text: str) -> bool:
    return len(text) == 10 and text[4] == "-" and text[7] == "-"


def _shortcut(kind: str, value_a: str, value_b: str, holders: tuple[str, str]) -> str:
    """The systematically wrong mental arithmetic of an expert that skips `reason`."""
    if kind == COMPARE:
        return holders[0]
    try:
        if kind == DATE_GAP:
            return str(abs(int(value_a[:4]) - int(value_b[:4])))
        rounded_a, rounded_b = round(int(value_a), -2), round(int(value_b), -2)
    except ValueError:
        return value_a
    return str(rounded_a + rounded_b if kind == SUM else abs(rounded_a - rounded_b))


def success_rates(experts: ScriptedExperts, questions: Sequence[Question]) -> dict[str, float]:
    """The share of `questions` each expert answers correctly: {"multi": …, "single": …}."""
    if not questions:
        return {"multi": 0.0, "single": 0.0}
    multi = sum(experts.main_agent(question).correct for question in questions)
    single = sum(experts.single_agent(question).correct for question in questions)
    return {"multi": multi / len(questions), "single": single / len(questions)}
