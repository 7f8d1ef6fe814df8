from functools import cache

from mgrpo_jax.env.environment import build_offline_environment
from mgrpo_jax.env.experts import NoiseConfig, success_rates
from mgrpo_jax.env.prompts import ASSISTANT, SYSTEM, TOOL, USER, sub_agent_prompt
from mgrpo_jax.env.protocol import FinalAnswer, ToolCall, parse_turn, render_tool_response, trajectory_format_ok
from mgrpo_jax.env.questions import REASONING_KINDS, QuestionSetSizes
from mgrpo_jax.env.tools import MAIN_AGENT_TOOLS, SINGLE_AGENT_TOOLS, SUB_AGENT_TOOLS, single_agent_toolbox
from mgrpo_jax.env.world import estimate_tokens


@cache
def env():
    return build_offline_environment(6, 2000, QuestionSetSizes(60, 60, 20, 20, 20, 20))


def _sample():
    return [q for _, split in env().questions.items() for q in split[:12]]


def _replay(episode, toolbox):
    """Re-run every tool call of an episode through fresh tools: outputs must match the transcript."""
    messages = episode.messages
    for index, message in enumerate(messages):
        if message.role == ASSISTANT:
            parsed = parse_turn(message.text)
            if isinstance(parsed, ToolCall) and parsed.name != "delegate":
                assert messages[index + 1].text == render_tool_response(toolbox.execute(parsed))


def test_transcripts_follow_the_protocol_and_replay_exactly():
    environment = env()
    experts = environment.experts()
    single_box = single_agent_toolbox(environment.backend)
    for question in _sample():
        multi = experts.main_agent(question)
        assert trajectory_format_ok(multi.top.assistant_turns, allowed_tools=MAIN_AGENT_TOOLS)
        assert [m.role for m in multi.top.messages[:2]] == [SYSTEM, USER]
        delegations = [parse_turn(t) for t in multi.top.assistant_turns if '"delegate"' in t]
        assert len(delegations) == len(multi.subs) == len(multi.sub_scores) == question.hops
        for call, sub in zip(delegations, multi.subs, strict=True):
            assert sub.messages[1].text == sub_agent_prompt(call.arguments["task"], call.arguments.get("context", ""))
            assert trajectory_format_ok(sub.assistant_turns, allowed_tools=SUB_AGENT_TOOLS)
            _replay(sub, single_box)
        # The main agent sees each sub-agent's short answer as the delegate call's result.
        tool_outputs = [m.text for m in multi.top.messages if m.role == TOOL]
        assert tool_outputs[: len(multi.subs)] == [render_tool_response(sub.answer) for sub in multi.subs]
        final = parse_turn(multi.top.assistant_turns[-1])
        assert isinstance(final, FinalAnswer) and final.text == multi.answer
        single = experts.single_agent(question)
        assert trajectory_format_ok(single.top.assistant_turns, allowed_tools=SINGLE_AGENT_TOOLS)
        _replay(single.top, single_box)
        assert all(isinstance(role, str) and isinstance(text, str) for role, text in single.top.as_chat())


def test_clean_experts_solve_everything():
    experts = env().experts(NoiseConfig.clean())
    sample = _sample()
    assert success_rates(experts, sample) == {"multi": 1.0, "single": 1.0}
    transcripts = [experts.main_agent(q) for q in sample[:20]]
    assert all(score == 1.0 for t in transcripts for score in t.sub_scores)


def test_noise_is_systematic_and_configurable():
    environment = env()
    noise = NoiseConfig(seed=1)
    assert len(noise.misleading_query_facts) == round(0.2 * 26)
    assert len(noise.skipped_verification_kinds) == 2 and noise.skipped_verification_kinds <= set(REASONING_KINDS)
    assert NoiseConfig(seed=1).dropped_constraint_facts == noise.dropped_constraint_facts
    assert NoiseConfig(seed=2).misleading_query_facts != noise.misleading_query_facts
    experts, again = environment.experts(noise), environment.experts(noise)
    sample = _sample()
    # Same question, same mistakes: nothing is drawn per episode.
    assert [experts.main_agent(q).answer for q in sample] == [again.main_agent(q).answer for q in sample]
    rates = success_rates(experts, environment.questions.stage1)
    assert 0.4 <= rates["multi"] <= 0.9
    heavier = environment.experts(NoiseConfig(seed=1, misleading_query_fraction=0.6, namesake_page_fraction=0.4))
    assert success_rates(heavier, environment.questions.stage1)["multi"] < rates["multi"]


def test_skipped_verification_never_calls_reason():
    environment = env()
    noise = NoiseConfig(seed=0, misleading_query_fraction=0, namesake_page_fraction=0, dropped_constraint_fraction=0,
                        skipped_verification_fraction=1.0)
    experts = environment.experts(noise)
    for question in environment.questions.stage2:
        if question.kind in REASONING_KINDS:
            transcript = experts.main_agent(question)
            assert not any('"reason"' in turn for turn in transcript.top.assistant_turns)
            assert all(score == 1.0 for score in transcript.sub_scores)  # lookups stay correct


def test_single_agent_context_grows_with_hops_while_main_agent_stays_short():
    environment = env()
    experts = environment.experts(NoiseConfig.clean())
    four_hop = [q for q in environment.questions.stage2 if q.hops == 4][:3]
    for question in four_hop:
        single = sum(estimate_tokens(text) for _, text in experts.single_agent(question).top.as_chat())
        multi = experts.main_agent(question)
        main = sum(estimate_tokens(text) for _, text in multi.top.as_chat())
        assert single > 4096 > main * 4
        assert all(sum(estimate_tokens(t) for _, t in sub.as_chat()) < 2500 for sub in multi.subs)
