"""Nothing a model writes can crash a run: the real rollout engine of both grammars, driven by a fake sampler whose
turns hypothesis draws (random ids, random text, valid turns with mutated arguments, mutated turns), finishes every
episode without an exception, and no tool raises on the arguments (`<agent>/tool_errors` stays 0). Plus the
issue's two inputs as regression cases, and the engine's last line of defence around a tool that does raise."""

from __future__ import annotations

import collections
import dataclasses
import json
import re
import types

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from mgrpo_jax.config import get_config
from mgrpo_jax.env.build import build_environment
from mgrpo_jax.env.compact.grammar import CLOSE, COMPACT, ERROR, OPEN_TAGS, QUESTION, RESULT
from mgrpo_jax.env.compact.world import CALC_OPS, FACTS, HANDLES
from mgrpo_jax.env.grammar import CHAT
from mgrpo_jax.env.prompts import MAIN, SINGLE, SUB
from mgrpo_jax.env.protocol import PROTOCOL_TAGS, ToolCall, parse_turn, render_answer, valid_unicode
from mgrpo_jax.env.tools import main_agent_toolbox, sub_agent_toolbox
from mgrpo_jax.rl import system
from mgrpo_jax.rollout.engine import AgentRuntime, RolloutEngine, RolloutLimits
from mgrpo_jax.rollout.episode import END_REASONS
from mgrpo_jax.sampling.sampler import SampleOutput
from mgrpo_jax.tokenizer import SPECIAL_TOKENS

QUESTIONS = 4  # per engine run; each with ROLLOUTS rollouts
ROLLOUTS = 4


# -- the worlds, as the trainer builds them ----------------------------------------------------------------------


@dataclasses.dataclass(repr=False)
class World:
    preset: str
    config: object
    env: object
    tokenizer: object

    def __repr__(self) -> str:  # what hypothesis prints of a fixture in a falsifying example
        return f"<the {self.preset} preset's world>"


def _world(preset: str, **limits) -> World:
    config = get_config("xbench", preset)
    for agent in (MAIN, SUB, SINGLE):
        config[agent].max_turns = limits.get("max_turns", config[agent].max_turns)
    config.rollout.max_turn_tokens = limits["max_turn_tokens"]
    env = build_environment(config)
    return World(preset, config, env, system.build_tokenizer(config, env, None))


@pytest.fixture(scope="module")
def chat():
    # The smoke preset's chat world; turns long enough for a JSON call with odd arguments, and a few more turns.
    return _world("smoke", max_turn_tokens=96, max_turns=5)


@pytest.fixture(scope="module")
def compact():
    # The local preset's compact world; 24 tokens a turn (the preset's 8 would cut most malformed arguments, which
    # are spelled in byte pieces, before they reach a tool).
    return _world("local", max_turn_tokens=24)


def _build_engine(world: World, samplers: dict):
    """`system.build_engine` over fake learners (a sampler, no tokenizer of their own) of the agents in `samplers`;
    in the single-agent mode when they are the single agent's."""
    config = world.config
    if SINGLE in samplers:
        config = config.copy_and_resolve_references()
        config.mode = "single_agent"
    learners = {name: types.SimpleNamespace(sampler=sampler, tokenizer=None) for name, sampler in samplers.items()}
    return system.build_engine(config, world.tokenizer, world.env, learners)


# -- a sampler that replays drawn model outputs ------------------------------------------------------------------


def sample_output(rows, *, max_new, stop_tokens, budgets, pad_id, **unused) -> SampleOutput:
    """What the real `Sampler.sample` returns for rows that would sample `rows` (lists of ids): each cut at its
    first stop token and at its budget, `stopped` iff it ends on a stop token, pad ids after the end."""
    tokens = np.full((len(rows), max_new), pad_id, np.int32)
    logprobs = np.zeros((len(rows), max_new), np.float32)
    lengths = np.zeros(len(rows), np.int32)
    stopped = np.zeros(len(rows), bool)
    for row, (ids, budget) in enumerate(zip(rows, budgets, strict=True)):
        ends = [i for i, token in enumerate(ids) if token in stop_tokens]
        ids = list(ids[: ends[0] + 1] if ends else ids)[: min(budget, max_new)]
        tokens[row, : len(ids)] = ids
        logprobs[row, : len(ids)] = -1.0
        lengths[row] = len(ids)
        stopped[row] = bool(ids) and ids[-1] in stop_tokens
    return SampleOutput(tokens, logprobs, lengths, stopped)


def spell(tokenizer, text: str) -> list[int]:
    """Ids that decode to `text` (lone surrogates as U+FFFD), as a model could sample them. The compact world's word
    tokenizer glues an unknown word to the space before it (it decodes as `▁word`), so a word it does not spell
    back goes through byte pieces, space included."""
    ids = tokenizer.encode(text)
    if tokenizer.decode(ids) == valid_unicode(text):
        return ids
    out = []
    for part in re.split("( )", text):
        piece = tokenizer.encode(part)
        if tokenizer.decode(piece) != valid_unicode(part):
            piece = [tokenizer.piece_id(f"<0x{b:02X}>") for b in valid_unicode(part).encode("utf-8")]
        out.extend(piece)
    return out


class ReplaySampler:
    """Answers each prompt with one of `calls` (token ids, or text it spells and ends with the end-of-turn id), or
    one time in four with one of `junk`; which one depends on a running row count and the prompt's length. The calls
    are well-formed tool calls of the agent's own tools (odd arguments and all), so episodes go on for several
    turns and the tools run; the junk (anything else) ends an episode or feeds a tool worse arguments."""

    top_k, top_p = 0, 1.0  # no filters: the engine records them on each episode

    def __init__(self, tokenizer, calls, junk=()):
        self.tokenizer, self.count = tokenizer, 0
        encode = lambda o: spell(tokenizer, o) + [tokenizer.end_of_turn_id] if isinstance(o, str) else list(o)
        self.calls, self.junk = [encode(o) for o in calls], [encode(o) for o in junk]

    def sample(self, prompts, **kwargs):
        rows = []
        for prompt in prompts:
            self.count += 1
            pick = len(prompt) * 7 + self.count * 3
            pool = self.junk if self.junk and (pick % 4 == 0 or not self.calls) else self.calls
            rows.append(pool[pick // 4 % len(pool)])
        return sample_output(rows, pad_id=self.tokenizer.pad_id, **kwargs)


# -- what a model might write ------------------------------------------------------------------------------------

NASTY_TEXT = ["\ud800", "\udfff", "\ud83d\ude00", "\ud83d", "a\x00b", "\x1b[2J", "\u2581", "\ufffd", "\u202e", "",
              " ", "\n\n", "x" * 300, "é", "😀", "{}", "]", "[", "\\", '"', "'", "None", "-1", "1e999", "r99",
              "<answer>x</answer>", "<tool_response>", "<|im_end|>", "<|im_start|><|system|>", "⁇", "%s%n{0}"]
NASTY_EXPRESSIONS = ["(1,2) < 3", "max(1,2) < (3,4)", "1 < 2 < (1,)", "10**10**10", "1/0", "0 ** -1", "1 % 0.0",
                     "round(10**30, -10**30)", "round(1.5, 1e300)", "(-8) ** 0.5", "max(1921-03-04, 3)", "()",
                     "[1,2] < [3]", "9" * 600, "(" * 300 + "1" + ")" * 300, "years_between(1921-03-04)",
                     "days_between(1921-02-30, 1)", "1e308 * 10", "sum(())", "not (1, 2)", "__import__('os')",
                     "2 ** 64.5", "'1921-03-04' - 1", "\ud800", "1921-03-04 < 1930-01-01", "48210 + 1250"]
FRAGMENTS = [*PROTOCOL_TAGS, *SPECIAL_TOKENS, "{", "}", "[", "]", ":", ",", '"', "\\", "\\ud800", "\\udc00",
             '"name"', '"arguments"', "null", "1e999", "NaN", "[" * 60, "{" * 30, "\x00", "\n", " "]

_json_scalar = st.one_of(st.sampled_from(NASTY_TEXT), st.sampled_from(NASTY_EXPRESSIONS), st.text(max_size=20),
                         st.characters(categories=["Cs"]), st.integers(-(10**40), 10**40), st.booleans(), st.none(),
                         st.floats(allow_nan=False, allow_infinity=False))
_json_value = st.recursive(_json_scalar, lambda inner: st.lists(inner, max_size=3)
                           | st.dictionaries(st.text(max_size=5), inner, max_size=3), max_leaves=6)


@st.composite
def _mutated(draw, text: str) -> str:
    """`text` after a few edits: a span cut, a fragment or random text inserted, a span repeated."""
    for _ in range(draw(st.integers(0, 3))):
        at = draw(st.integers(0, len(text)))
        edit = draw(st.sampled_from(("cut", "insert", "repeat")))
        if edit == "cut":
            text = text[:at] + text[at + draw(st.integers(1, 8)):]
        elif edit == "insert":
            text = text[:at] + draw(st.sampled_from(FRAGMENTS) | st.text(max_size=6)) + text[at:]
        else:
            text = text[:at] + text[at: at + draw(st.integers(1, 12))] * 2 + text[at:]
    return text


ARGUMENT = {"delegate": "task", "reason": "problem", "search": "query", "visit": "url"}
CHAT_TOOLS = {MAIN: ("delegate", "reason"), SUB: ("search", "visit"), SINGLE: ("search", "visit", "reason")}


@st.composite
def chat_call(draw, names: tuple[str, ...], urls: tuple[str, ...], well_formed: bool = True) -> str:
    """A `<tool_call>` of one of `names`: well-formed JSON with the tool's argument (a sensible value, an odd
    string or any JSON value), or with `well_formed=False` any name and payload. Strings are JSON-escaped or not
    (an escaped lone surrogate is how `"\\ud800"` gets past the tokenizer into the parser)."""
    name = draw(st.sampled_from(names) if well_formed else st.sampled_from(names) | st.text(max_size=8))
    good = {"delegate": st.sampled_from(("Find the founding year of Vujair Works.", "who?")),
            "reason": st.sampled_from(NASTY_EXPRESSIONS), "search": st.sampled_from(("Vujair Works", "staff")),
            "visit": st.sampled_from(urls)}.get(name, st.just("x"))
    value = draw(good | st.sampled_from(NASTY_TEXT) | st.characters(categories=["Cs"]) | _json_value)
    arguments = {ARGUMENT.get(name, "x"): value}
    if draw(st.booleans()):
        arguments.update(draw(st.dictionaries(st.sampled_from(("context", "task", "k", "")), _json_value,
                                              max_size=2)))
    payload = {"name": name, "arguments": arguments}
    if not well_formed:
        payload = draw(st.sampled_from((payload, {"name": name, "arguments": value}, {"name": name},
                                        [name, arguments])))
    body = json.dumps(payload, ensure_ascii=draw(st.booleans()))
    think = draw(st.sampled_from(("plan", "")) | st.text(max_size=10))
    return f"<think>{think}</think><tool_call>{body}</tool_call>"


def _ids(vocab: int, end_of_turn: int, max_size: int):
    """Raw ids: any piece, ids past the tokenizer's vocabulary (a model's padded embedding rows), with or without
    a final end-of-turn."""
    return st.tuples(st.lists(st.integers(0, vocab + 63), max_size=max_size), st.booleans()).map(
        lambda drawn: drawn[0] + [end_of_turn] * drawn[1])


def chat_junk(urls: tuple[str, ...], vocab: int, end_of_turn: int):
    names = ("delegate", "reason", "search", "visit")
    answer = (st.sampled_from(NASTY_TEXT) | st.text(min_size=1, max_size=20)).map(
        lambda text: f"<think>done</think><answer>{text}</answer>")
    text = st.lists(st.sampled_from(FRAGMENTS) | st.text(max_size=10), max_size=12).map("".join)
    return st.one_of(
        chat_call(names, urls, well_formed=False), chat_call(names, urls).flatmap(_mutated), answer,
        answer.flatmap(_mutated), text, st.just(render_answer("42", think="found")), _ids(vocab, end_of_turn, 80))


COMPACT_TAGS = {MAIN: ("[ask", "[calc"), SUB: ("[search", "[open"), SINGLE: ("[search", "[open", "[calc")}
ODD_WORDS = ("²", "٣", "9" * 50, "-1", "0", "3", "10", "99", "r0", "r5", "r99", "\ud800", "\x00", "x", "é", "none",
             "error", *CALC_OPS, *HANDLES, *FACTS)


@st.composite
def compact_turn(draw, tags: tuple[str, ...], words: tuple[str, ...], well_formed: bool = True) -> str:
    """One bracketed action of `tags` with the tag's arity (any arity with `well_formed=False`), of world words,
    odd words or random text."""
    word = (st.sampled_from(words) | st.sampled_from(ODD_WORDS)
            | st.text(max_size=4).map(lambda text: "".join(text.split()) or "x"))
    tag = draw(st.sampled_from(tags))
    if tag == "[calc":
        arguments = [draw(st.sampled_from(CALC_OPS) | word), draw(word), draw(word)]
    elif tag == "[open":
        arguments = [draw(st.sampled_from(HANDLES) | word)]
    else:
        arguments = [draw(st.sampled_from(tuple(FACTS)) | word), draw(word)]
    if not well_formed:
        arguments = arguments[: draw(st.integers(0, 3))] + draw(st.lists(word, max_size=2))
    return " ".join((tag, *arguments, CLOSE))


def compact_junk(words: tuple[str, ...], vocab: int, end_of_turn: int):
    tags = (*OPEN_TAGS, CLOSE, RESULT, QUESTION)
    soup = st.lists(st.sampled_from(tags) | st.sampled_from(words) | st.text(max_size=4), max_size=8).map(" ".join)
    return st.one_of(compact_turn(OPEN_TAGS, words, well_formed=False),
                     compact_turn(OPEN_TAGS, words).flatmap(_mutated), soup,
                     st.sampled_from(words).map(lambda w: f"[answer {w} ]"), _ids(vocab, end_of_turn, 24))


# -- the property ------------------------------------------------------------------------------------------------


def _check(batch, world, grammar: str) -> None:
    """Every episode ended for a known reason with aligned arrays and encodable text; no tool raised. Counts the
    turns and tool calls."""
    stats = batch.stats()
    for episode in batch.episodes():
        assert episode.end_reason in END_REASONS
        assert len(episode.tokens) == len(episode.loss_mask) == len(episode.logprobs)
        world.tokenizer.decode(episode.tokens).encode("utf-8")
        for text in (*episode.turns, episode.answer or "", episode.task, *episode.call.values()):
            text.encode("utf-8")
        TURNS[grammar][-1] += len(episode.turns)
        CALLS[grammar].update({f"{episode.agent}/{tool}": n for tool, n in episode.tool_calls.items()})
    for key, value in stats.items():
        if key.endswith("/tool_errors"):
            assert value == 0, {k: v for k, v in stats.items() if "tool_errors" in k}


# What the property tests drove, for the last test of the section: turns per example, tool calls per agent and tool.
TURNS: dict[str, list[int]] = {"chat": [], "compact": []}
CALLS: dict[str, collections.Counter] = {"chat": collections.Counter(), "compact": collections.Counter()}


def _run(world, grammar: str, data, calls, junk) -> None:
    """Both engines of `world` on QUESTIONS x ROLLOUTS, each agent replaying its own drawn calls and shared junk."""
    junk = data.draw(st.lists(junk, max_size=8), label="junk")
    samplers = {}
    for agent in (MAIN, SUB, SINGLE):
        drawn = data.draw(st.lists(calls(agent), min_size=1, max_size=6), label=f"{agent} calls")
        samplers[agent] = ReplaySampler(world.tokenizer, drawn, junk)
    questions = world.env.questions.stage1[:QUESTIONS]
    seed = data.draw(st.integers(0, 100), label="seed")
    multi = _build_engine(world, {MAIN: samplers[MAIN], SUB: samplers[SUB]})
    single = _build_engine(world, {SINGLE: samplers[SINGLE]})
    TURNS[grammar].append(0)
    for engine in (multi, single):
        _check(engine.run(questions, ROLLOUTS, seed=seed), world, grammar)


_settings = settings(suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])


@_settings
@given(data=st.data())
def test_chat_engine_survives_any_model_output(chat, data):
    urls = tuple(entity.url for entity in chat.env.world.entities[:5])
    _run(chat, "chat", data, lambda agent: chat_call(CHAT_TOOLS[agent], urls),
         chat_junk(urls, chat.tokenizer.vocab_size, chat.tokenizer.end_of_turn_id))


@_settings
@given(data=st.data())
def test_compact_engine_survives_any_model_output(compact, data):
    words = compact.env.world.vocabulary()
    _run(compact, "compact", data, lambda agent: compact_turn(COMPACT_TAGS[agent], words),
         compact_junk(words, compact.tokenizer.vocab_size, compact.tokenizer.end_of_turn_id))


def test_the_property_tests_ran_thousands_of_turns_and_every_tool():
    """Runs after the two property tests (file order); `-s` shows the counts."""
    if not TURNS["chat"] or not TURNS["compact"]:
        pytest.skip("runs with the property tests")
    for grammar, turns in TURNS.items():
        calls = dict(sorted(CALLS[grammar].items()))
        print(f"\n{grammar}: {len(turns)} examples, {sum(turns)} turns; tool calls {calls}")
        assert sum(turns) >= 1000
        tools = {f"{agent}/{tool}" for agent, names in CHAT_TOOLS.items() for tool in names}
        assert all(CALLS[grammar][tool] >= 20 for tool in tools), CALLS[grammar]


# -- the inputs, through the tools and through the engine ------------------------------------------------

SURROGATE_CALL = '<think>x</think><tool_call>{"name": "%s", "arguments": {"%s": "a\\ud800b"}}</tool_call>'


def test_regression_reason_on_a_tuple_comparison_is_an_error_message():
    output = main_agent_toolbox().execute(ToolCall("reason", {"problem": "(1,2) < 3"}))
    assert output.startswith("Error: comparisons need numbers or dates")


def test_regression_a_json_surrogate_escape_parses_to_valid_unicode(chat):
    for tool, argument in (("delegate", "task"), ("search", "query")):
        parsed = parse_turn(SURROGATE_CALL % (tool, argument))
        assert parsed == ToolCall(tool, {argument: "a\ufffdb"}, think="x")
    # A raw surrogate that reaches a tool some other way is cleaned there, before a backend or the tokenizer sees it.
    output = sub_agent_toolbox(chat.env.backend).execute(ToolCall("search", {"query": "a\ud800b"}))
    assert output == 'No results for "a\ufffdb". Try other keywords.'
    assert chat.tokenizer.decode(chat.tokenizer.encode(output)) == output


class Script:
    """A sampler that plays each agent's turns in order (one list per agent), then answers."""

    top_k, top_p = 0, 1.0

    def __init__(self, tokenizer, turns):
        self.tokenizer, self.turns = tokenizer, turns

    def sample(self, prompts, **kwargs):
        rows = []
        for prompt in prompts:
            done = list(prompt).count(self.tokenizer.end_of_turn_id) - 2  # past the system and user messages
            text = self.turns[done // 2] if done // 2 < len(self.turns) else render_answer("done")
            rows.append(self.tokenizer.encode(text) + [self.tokenizer.end_of_turn_id])
        return sample_output(rows, pad_id=self.tokenizer.pad_id, **kwargs)


def test_regression_both_inputs_through_the_engine(chat):
    main = Script(chat.tokenizer, ['<think>x</think><tool_call>{"name": "reason", "arguments": '
                                   '{"problem": "(1,2) < 3"}}</tool_call>', SURROGATE_CALL % ("delegate", "task")])
    sub = Script(chat.tokenizer, [SURROGATE_CALL % ("search", "query")])
    engine = _build_engine(chat, {MAIN: main, SUB: sub})
    batch = engine.run(chat.env.questions.stage1[:1], 1)
    episode = batch.top[0][0]
    assert episode.end_reason == "answer" and len(episode.subs) == 1
    assert "Error: comparisons need numbers or dates, got (1, 2)" in chat.tokenizer.decode(episode.tokens)
    (sub_episode,) = episode.subs
    assert sub_episode.task == "a\ufffdb" and sub_episode.call["task"] == "a\ufffdb"
    assert 'No results for "a\ufffdb"' in chat.tokenizer.decode(sub_episode.tokens)
    stats = batch.stats()
    assert stats["main/tool_errors"] == stats["sub/tool_errors"] == 0
    assert stats["main/tool_calls/reason"] == stats["main/tool_calls/delegate"] == 1


# -- the last line of defence ------------------------------------------------------------------------------------


def _raising(arguments, session=None):
    return {"boom": 1}[arguments["problem"]]  # a tool bug: KeyError on most arguments


def _engine_with_tool(tokenizer, turns, grammar):
    top = AgentRuntime("single", Script(tokenizer, turns), "single", {"reason": _raising}, max_turns=4,
                       context_tokens=1024)
    return RolloutEngine(tokenizer, top, None, RolloutLimits(max_turn_tokens=96), grammar=grammar)


def test_a_tool_that_raises_is_answered_with_an_error_and_counted(chat, caplog):
    call = '<think>x</think><tool_call>{"name": "reason", "arguments": {"problem": "2 + 2"}}</tool_call>'
    batch = _engine_with_tool(chat.tokenizer, [call, call], CHAT).run(chat.env.questions.stage1[:1], 2)
    episode = batch.top[0][0]
    assert episode.end_reason == "answer"
    text = chat.tokenizer.decode(episode.tokens)
    assert text.count("Error: reason failed on its arguments: KeyError: '2 + 2'") == 2
    assert episode.tool_calls == {"reason": 2, "error/reason": 2}
    stats = batch.stats()
    assert stats["single/tool_errors"] == stats["single/tool_errors/reason"] == 2.0
    assert "single/tool_calls/error/reason" not in stats and stats["single/tool_calls/reason"] == 2.0
    assert len([r for r in caplog.records if "raised on model-written arguments" in r.getMessage()]) == 1


def test_a_compact_tool_that_raises_is_answered_with_the_error_word(compact):
    batch = _engine_with_tool(compact.tokenizer, ["[calc max 31 17 ]"], COMPACT).run(
        compact.env.questions.stage1[:1], 1)
    episode = batch.top[0][0]
    assert f"{RESULT} {ERROR}" in compact.tokenizer.decode(episode.tokens)
    assert batch.stats()["single/tool_errors"] == 1.0


def test_exceptions_outside_the_tool_call_still_raise(chat):
    class Broken:
        def sample(self, prompts, **kwargs):
            raise RuntimeError("a sampler bug")

    engine = _build_engine(chat, {SINGLE: Broken()})
    with pytest.raises(RuntimeError, match="a sampler bug"):
        engine.run(chat.env.questions.stage1[:1], 1)
