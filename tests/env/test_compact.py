"""The compact world, grammar, tokenizer and experts (mgrpo_jax/env/compact)."""

import collections
import dataclasses

import pytest
from hypothesis import given
from hypothesis import strategies as st

from mgrpo_jax import config
from mgrpo_jax.config import get_config
from mgrpo_jax.env.build import noise_config
from mgrpo_jax.env.compact import CompactNoise, build_compact_environment, compact_success
from mgrpo_jax.env.compact import world as world_module
from mgrpo_jax.env.compact.grammar import COMPACT, NONE, OPEN_TAGS, TAGS, render_answer, render_call
from mgrpo_jax.env.compact.questions import pose_in, quotas
from mgrpo_jax.env.compact.world import FACTS, generate_compact_world
from mgrpo_jax.env.grammar import CHAT, trajectory_format_ok
from mgrpo_jax.env.prompts import ASSISTANT, MAIN, SINGLE, SUB
from mgrpo_jax.env.protocol import BAD_CALL_SCHEMA, UNKNOWN_TOOL, FinalAnswer, FormatError, ToolCall
from mgrpo_jax.env.questions import HELD_OUT_SPLITS, QuestionSetSizes
from mgrpo_jax.rl import system

SIZES = QuestionSetSizes(stage1=1200, stage2=300, validation=30, eval_gaia=30, eval_xbench=30, eval_webwalker=30,
                         fresh=30)


@pytest.fixture(scope="module")
def env():
    return build_compact_environment(0, SIZES)


@pytest.fixture(scope="module")
def tokenizer(env):
    config = get_config("xbench", "local")
    return system.train_word_tokenizer(env, config)


# -- grammar -------------------------------------------------------------------------------------------------


def test_compact_turns_parse_to_canonical_calls():
    assert COMPACT.parse_turn("[ask born_in Varn ]") == ToolCall("delegate", {"task": "born_in Varn"})
    assert COMPACT.parse_turn("[calc max 31 17 ]") == ToolCall("reason", {"problem": "max 31 17"})
    assert COMPACT.parse_turn("[search born_in Varn ]") == ToolCall("search", {"query": "born_in Varn"})
    assert COMPACT.parse_turn(" [open  r2 ]\n") == ToolCall("visit", {"url": "r2"})
    assert COMPACT.parse_turn("[answer Drur ]") == FinalAnswer("Drur")
    assert COMPACT.parse_turn(render_call("delegate", "age", "Kelt")) == ToolCall("delegate", {"task": "age Kelt"})
    assert COMPACT.parse_turn(render_answer("31")) == FinalAnswer("31")


@pytest.mark.parametrize("text", ["", "Drur", "[ask born_in Varn", "[ask born_in ]", "[answer ]", "[answer a b ]",
                                  "[open r2 ] [open r1 ]", "[open r2 ] x", "[open [ask ]", "[answerDrur ]",
                                  "]", "=> r1", "[calc max 3 ]"])
def test_malformed_compact_turns_are_format_errors(text):
    assert isinstance(COMPACT.parse_turn(text), FormatError)


def test_compact_allowed_tools_and_arity():
    assert COMPACT.parse_turn("[search born_in Varn ]", allowed_tools=("delegate", "reason")).reason == UNKNOWN_TOOL
    assert COMPACT.parse_turn("[ask born_in ]", allowed_tools=("delegate",)).reason == BAD_CALL_SCHEMA
    assert isinstance(COMPACT.parse_turn(None), FormatError)


@given(st.lists(st.sampled_from([*TAGS, "born_in", "Varn", "r2", "31", " ", "\n", "[", "x]"]), max_size=12)
       .map("".join) | st.text(max_size=40))
def test_both_grammars_are_total(text):
    for grammar in (COMPACT, CHAT):
        parsed = grammar.parse_turn(text, allowed_tools=("delegate", "reason"))
        assert isinstance(parsed, ToolCall | FinalAnswer | FormatError)
        trajectory_format_ok(grammar, [text, text])


@given(st.sampled_from(["delegate", "search"]), st.sampled_from(list(FACTS)), st.sampled_from(["Varn", "Kelt", "x1"]))
def test_compact_render_parse_round_trip(tool, fact, name):
    parsed = COMPACT.parse_turn(render_call(tool, fact, name))
    assert parsed.name == tool and " ".join(parsed.arguments.values()) == f"{fact} {name}"


def test_format_gate_needs_calls_then_one_answer():
    assert trajectory_format_ok(COMPACT, ["[ask age Varn ]", "[answer 31 ]"])
    assert not trajectory_format_ok(COMPACT, ["[answer 31 ]", "[ask age Varn ]"])
    assert not trajectory_format_ok(COMPACT, ["[ask age Varn ]"])
    assert not trajectory_format_ok(COMPACT, [])


# -- world and tools -----------------------------------------------------------------------------------------


def test_world_is_deterministic_and_names_are_ambiguous(env):
    again = generate_compact_world(0)
    assert again.entities == env.world.entities and dict(again.facts) == dict(env.world.facts)
    assert generate_compact_world(1).facts != env.world.facts
    kinds = {name: {e.kind for e in group} for name, group in env.world.by_name.items()}
    shared = [name for name, k in kinds.items() if {"person", "city"} <= k]
    assert len(shared) == env.world.config.n_names
    for (entity_id, fact), value in env.world.facts.items():
        assert env.world.entities[entity_id].kind == FACTS[fact][0]
        assert " " not in value


def test_counterfactual_twins_keep_the_entities_and_questions_and_redraw_every_fact(env):
    twin = generate_compact_world(0, counterfactual=3)
    assert twin.entities == env.world.entities and twin.facts.keys() == env.world.facts.keys()
    assert dict(generate_compact_world(0, counterfactual=3).facts) == dict(twin.facts)  # deterministic
    changed = sum(twin.facts[k] != v for k, v in env.world.facts.items())
    assert changed > 0.9 * len(twin.facts)
    assert dict(generate_compact_world(0, counterfactual=4).facts) != dict(twin.facts)
    # The experts of a twin answer the twin's facts: the same task has the twin's value, read from its pages.
    experts = env.experts(CompactNoise.clean(), counterfactual=3)
    for q in env.questions.stage1[:20]:
        (entity_id, fact), = q.answer_path
        task = f"{fact} {twin.entities[entity_id].name}"
        assert experts.sub_agent(task).answer == twin.facts[(entity_id, fact)]
    for q in env.questions.stage2[:20]:
        if q.kind == "chain":  # the chain follows the twin's values hop by hop
            value = twin.entities[q.answer_path[0][0]].name
            for _, fact in q.answer_path:
                value = twin.lookup(fact, value)
            assert experts.main_agent(q).answer == value


def test_a_question_posed_in_its_own_world_is_unchanged_and_in_a_twin_takes_the_twins_answer(env):
    twin = generate_compact_world(0, counterfactual=5)
    for _, questions in env.questions.items():
        for q in questions:
            assert pose_in(env.world, q) == q  # answer, decomposition and answer path all recomputed equal
            posed = pose_in(twin, q)
            assert (posed.text, posed.kind, posed.id) == (q.text, q.kind, q.id)
            if q.kind == "compare":
                op, fact, a, b = q.text.split()
                values = [int(twin.lookup(fact, n)) for n in (a, b)]
                assert posed.answer == str(max(values) if op == "max" else min(values))
            else:
                *facts, value = q.text.split()
                for fact in reversed(facts):
                    value = twin.lookup(fact, value)
                assert posed.answer == value


def test_twins_stand_in_for_the_world_and_restore_it(env):
    task = env.questions.stage1[0].text
    truth = env.world.lookup(*task.split())
    tools = env.tools("sub")
    with env.posed_in_twin(7, env.questions.stage1[:3]) as posed:
        twin = generate_compact_world(0, counterfactual=7)
        assert env.twins.lookup(*task.split()) == twin.lookup(*task.split()) == posed[0].answer
        assert env.judge.score(task, posed[0].answer) == 1.0
        assert tools["search"]({"query": task}, {}) == twin.search(task)
    assert env.judge.score(task, truth) == 1.0 and tools["search"]({"query": task}, {}) == env.world.search(task)
    with pytest.raises(ValueError, match="twin 65"):
        env.twins.twin(65)


def _orders(world, queries):
    return [[(name, kind) for _, name, kind in zip(*[iter(world.search(q).split())] * 3, strict=True)]
            for q in queries]


def test_each_twin_lists_a_querys_results_in_an_order_of_its_own_unless_told_to_keep_the_worlds(env):
    queries = [f"{fact} {name}" for fact in ("born_in", "age", "mayor", "staff") for name in
               sorted(env.world.by_name)[:25]]
    world, twins = _orders(env.world, queries), [_orders(generate_compact_world(0, counterfactual=k), queries)
                                                 for k in (1, 2)]
    for twin in twins:  # the same namesakes (a twin keeps the entities), in another order for many queries
        assert sum(r != w for r, w in zip(twin, world, strict=True)) > len(queries) // 3
        assert all({(n, k) for n, k in r if n == q.split()[1]} == {(n, k) for n, k in w if n == q.split()[1]}
                   for q, r, w in zip(queries, twin, world, strict=True))
    assert twins[0] != twins[1]
    assert _orders(generate_compact_world(0, counterfactual=1), queries) == twins[0]  # seeded
    kept = dataclasses.replace(env.world.config, search_order="world")
    assert _orders(generate_compact_world(0, kept, counterfactual=1), queries) == world
    assert _orders(generate_compact_world(0, kept), queries) == world  # the world itself never changes
    with pytest.raises(ValueError, match="env.compact.search_order 'random'"):
        generate_compact_world(0, dataclasses.replace(kept, search_order="random"))
    assert config.SEARCH_ORDERS == world_module.SEARCH_ORDERS  # the config validates the world's own choices
    local = get_config("xbench", "local")
    assert local.env.compact.search_order == "per_twin"
    local.env.compact.search_order = "shuffled"
    with pytest.raises(ValueError, match=r"env.compact.search_order.*shuffled"):
        config.validate(local)


def test_search_open_and_calc(env):
    world = env.world
    person = world.of_kind("person")[0]
    session = {}
    out = world.search(f"born_in {person.name}", session).split()
    handles, names, kinds = out[0::3], out[1::3], out[2::3]
    assert handles == ["r1", "r2", "r3"][: len(handles)]
    assert sorted(k for n, k in zip(names, kinds, strict=True) if n == person.name) == ["city", "person"]
    handle = handles[[i for i, (n, k) in enumerate(zip(names, kinds, strict=True))
                      if n == person.name and k == "person"][0]]
    page = world.visit(handle, session).split()
    assert page[page.index("born_in") + 1] == world.facts[(person.id, "born_in")]
    assert world.visit("r2", {}) == "error" and world.visit("r9", session) == "error"
    assert world.search("nosuchfact Varn") == "error"
    assert world.calculate("max 31 17") == "31" and world.calculate("min 31 17") == "17"
    assert world.calculate("max 31 x") == "error" and world.calculate("sum 1 2") == "error"


def test_tools_answer_error_to_any_argument(env):
    """Words `str.isdigit` accepts but `int` does not, numbers past Python's digit limit, surrogates, non-strings:
    each once raised, or could."""
    tools = env.tools(SINGLE)
    assert tools["reason"]({"problem": "max 31 17"}) == "31"
    for problem in ("max ² 17", "min ٣ 17", "max 17 " + "9" * 5000, "max 17 -3", None, ["max", "1", "2"]):
        assert tools["reason"]({"problem": problem}) == "error"
    assert tools["search"]({"query": "born_in \ud800"}, {}).startswith("r1 ")  # distractors, hashed as UTF-8
    for url in ("r9", "\ud800", 2, None):
        assert tools["visit"]({"url": url}, {}) == "error"
    assert COMPACT.parse_turn("[calc max \ud800 17 ]") == ToolCall("reason", {"problem": "max \ufffd 17"})


def test_judge_scores_the_true_value(env):
    person = env.world.of_kind("person")[3]
    truth = env.world.facts[(person.id, "age")]
    assert env.judge.score(f"age {person.name}", truth) == 1.0
    assert env.judge.score(f"age {person.name}", "none") == 0.0
    assert env.judge.score("age Nobodyhere", NONE) == 1.0  # nothing to find: `none` is right
    assert env.judge.score("garbage", "x") == 0.0 and env.judge.score(f"age {person.name}", None) == 0.0


# -- questions -----------------------------------------------------------------------------------------------


def test_questions_have_world_answers_held_out_texts_and_every_lookup_in_training(env):
    world = env.world
    for split, questions in env.questions.items():
        assert questions, split
        for q in questions:
            value = world.entities[q.answer_path[0][0]].name
            if q.kind != "compare":
                for entity_id, fact in q.answer_path:
                    assert world.entities[entity_id].name == value
                    value = world.facts[(entity_id, fact)]
                assert value == q.answer
    training = env.questions.stage1 + env.questions.stage2
    held_out = [q for split in HELD_OUT_SPLITS for q in env.questions.split(split)]
    # Held out by text: no held-out question is a training question...
    assert not {q.text for q in held_out} & {q.text for q in training}
    texts = [q.text for split, questions in env.questions.items() if split != "fresh" for q in questions]
    assert len(texts) == len(set(texts))
    # ...while stage 1 asks every (entity, fact) of the world but the held-out lookups themselves.
    held_out_lookups = {q.answer_path for q in held_out if q.kind == "lookup"}
    assert {q.answer_path for q in env.questions.stage1} | held_out_lookups == {((e, f),) for e, f in world.facts}
    # `fresh` is the training distribution itself: stage-2 training texts, asked in the world, the first of each kind
    # in the validation set's numbers (both stratified: the gap compares the same kinds in the same numbers).
    stage2_texts = [q.text for q in env.questions.stage2]
    fresh_at = [stage2_texts.index(q.text) for q in env.questions.fresh]
    assert fresh_at == sorted(fresh_at)
    kinds = collections.Counter((q.kind, q.hops) for q in env.questions.fresh)
    assert kinds == collections.Counter((q.kind, q.hops) for q in env.questions.validation)
    assert sum(kinds.values()) == SIZES.fresh == SIZES.validation
    assert {q.split for q in env.questions.fresh} == {"fresh"}
    assert {q.hops for q in env.questions.eval_xbench} == {3}
    assert {q.kind for q in env.questions.stage2} == {q.kind for q in env.questions.fresh} == {"chain", "compare"}
    # Stage 2 trains 3-hop chains, the kind the XBench-style set asks over new texts; validation and fresh follow.
    hops = collections.Counter(q.hops for q in env.questions.stage2 if q.kind == "chain")
    assert set(hops) == {2, 3} and 0.1 < hops[3] / len(env.questions.stage2) < 0.35
    for split in ("validation", "fresh"):
        assert {q.hops for q in env.questions.split(split) if q.kind == "chain"} <= {2, 3}


# -- tokenizer -----------------------------------------------------------------------------------------------


def test_quotas_split_a_size_by_the_mix_weights_exactly():
    mix = (("chain", 0.45, 2), ("chain", 0.2, 3), ("compare", 0.35, 1))
    assert quotas(mix, 30) == [14, 6, 10]  # 13.5, 6.0, 10.5: the two halves go to the larger remainders, in order
    assert quotas(mix, 40) == [18, 8, 14]
    assert quotas(mix, 1) == [1, 0, 0] and quotas(mix, 0) == [0, 0, 0]
    assert sum(quotas(mix, 199)) == 199


def test_word_tokenizer_has_one_piece_per_word(env, tokenizer):
    assert tokenizer.vocab_size < 1000
    for word in env.world.vocabulary():
        ids = tokenizer.encode(" " + word)
        assert len(ids) == 1, word
        assert not tokenizer.id_to_piece(ids[0]).startswith("<0x"), word
    for word in [*OPEN_TAGS, "=>", "?", MAIN, SUB, SINGLE]:
        assert len(tokenizer.encode(word)) == 1, word
    transcript = env.experts().main_agent(env.questions.stage2[0])
    for episode in (transcript.top, *transcript.subs):
        ids, _ = tokenizer.render_chat(episode.as_chat())
        assert not any(tokenizer.id_to_piece(i).startswith("<0x") for i in ids)
        assert tokenizer.decode(tokenizer.encode(episode.messages[-1].text)) == episode.messages[-1].text


# -- experts -------------------------------------------------------------------------------------------------


def test_noise_free_experts_finish_every_question_within_the_preset_limits(env, tokenizer):
    """Replays the error-free experts' transcripts under the `local` preset's context, turn and turn-length caps."""
    config = get_config("xbench", "local")
    experts = env.experts(CompactNoise.clean())
    for split, questions in env.questions.items():
        for q in questions:
            multi, single = experts.main_agent(q), experts.single_agent(q)
            assert multi.correct and single.correct, (split, q.text)
            for agent, episode in [(MAIN, multi.top), (SINGLE, single.top)] + [(SUB, s) for s in multi.subs]:
                ids, _ = tokenizer.render_chat(episode.as_chat())
                assert len(ids) <= config[agent].context_tokens, (agent, q.text, len(ids))
                turns = episode.assistant_turns
                assert len(turns) <= config[agent].max_turns
                assert all(len(tokenizer.encode(t)) + 1 <= config.rollout.max_turn_tokens for t in turns)
            assert len(multi.subs) <= config.rollout.max_sub_calls


def test_noisy_experts_finish_stage2_three_hop_chains_within_the_main_agents_budgets(env, tokenizer):
    """The demonstrations of stage 2's longest kind, re-asks and all, fit the main agent's context and turns and the
    call cap (the noise-free ones: the test above)."""
    config = get_config("xbench", "local")
    experts = env.experts(noise_config(config))
    three_hop = [q for q in env.questions.stage2 if q.kind == "chain" and q.hops == 3]
    assert len(three_hop) > 30
    calls = collections.Counter()
    for q in three_hop:
        transcript = experts.main_agent(q)
        ids, _ = tokenizer.render_chat(transcript.top.as_chat())
        assert len(ids) <= config.main.context_tokens and len(transcript.top.assistant_turns) <= config.main.max_turns
        calls[len(transcript.subs)] += 1
    assert min(calls) == 3 and max(calls) <= config.rollout.max_sub_calls and max(calls) > 3  # re-asks happen


def test_noisy_experts_err_only_inside_their_subsets_and_not_always(env):
    noise = CompactNoise()
    experts = env.experts(noise)
    opened = collections.Counter()
    for q in env.questions.stage1:
        for sub in experts.main_agent(q).subs:
            fact = sub.task.split()[0]
            wrong = sub.answer == NONE
            opened[(fact in noise.wrong_kind, wrong)] += 1
    assert opened[(False, True)] == 0  # outside the subset the sub-agent never opens the wrong namesake
    rate = opened[(True, True)] / (opened[(True, True)] + opened[(True, False)])
    assert 0.5 < rate < 0.85  # first tries err at 0.7; re-asks dilute it a little
    rates = compact_success(experts, env.questions.stage2)
    perfect = compact_success(env.experts(CompactNoise.clean()), env.questions.stage2)
    assert 0.2 < rates["multi"] < 0.6 and perfect["multi"] == 1.0


def test_expert_mistakes_are_systematic_per_fact_and_stochastic_per_episode(env):
    noise = CompactNoise()
    assert len(noise.wrong_kind) == 5 and len(noise.skip_calc) == 2
    experts = env.experts(noise)
    fact = sorted(noise.wrong_kind)[0]
    person_or_other = env.world.of_kind(FACTS[fact][0])
    answers = [experts.sub_agent(f"{fact} {e.name}").answer for e in person_or_other[:60]]
    assert 0 < answers.count(NONE) < len(answers)
    assert [t.text for t in experts.sub_agent(f"{fact} {person_or_other[0].name}").messages if t.role == ASSISTANT] \
        == [t.text for t in experts.sub_agent(f"{fact} {person_or_other[0].name}").messages if t.role == ASSISTANT]
