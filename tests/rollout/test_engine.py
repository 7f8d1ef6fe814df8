"""The rollout engine's bookkeeping, driven by a scripted policy (no model): delegation, tool responses,
limits, token/mask/log-prob alignment, and aligned fixed-size batches."""

import dataclasses
import types

import jax
import numpy as np
import pytest

from mgrpo_jax.core import align
from mgrpo_jax.env import protocol
from mgrpo_jax.rollout import batches
from mgrpo_jax.rollout.engine import AgentRuntime, RolloutEngine, RolloutLimits
from mgrpo_jax.rollout.episode import Episode
from mgrpo_jax.tokenizer import Tokenizer


@pytest.fixture(scope="module")
def tokenizer():
    corpus = ["Question: what is the population of Veloria? Task: find it. search visit reason delegate"] * 50
    return Tokenizer.train(corpus, vocab_size=400)


class ScriptedSampler:
    """Answers each prompt with `policy(prompt_text)`, tokenised, plus the end-of-turn id; log-prob -0.5."""

    top_k, top_p = 0, 1.0  # no filters: the engine records them on each episode

    def __init__(self, tokenizer, policy):
        self.tokenizer, self.policy = tokenizer, policy
        self.batch_sizes = []

    def sample(self, prompts, *, max_new, rng, temperature, stop_tokens, budgets):
        self.batch_sizes.append(len(prompts))
        rows = []
        for prompt, budget in zip(prompts, budgets, strict=True):
            ids = self.tokenizer.encode(self.policy(self.tokenizer.decode(prompt))) + [stop_tokens[0]]
            rows.append(ids[:budget])
        tokens = np.zeros((len(rows), max_new), np.int32)
        logprobs = np.zeros((len(rows), max_new), np.float32)
        for i, ids in enumerate(rows):
            tokens[i, : len(ids)] = ids
            logprobs[i, : len(ids)] = -0.5
        lengths = np.asarray([len(r) for r in rows], np.int32)
        stopped = np.asarray([r[-1] == stop_tokens[0] for r in rows])
        return types.SimpleNamespace(tokens=tokens, logprobs=logprobs, lengths=lengths, stopped=stopped)


def main_policy(text):
    # Delegate as often as the question number says, then answer with the last report.
    wanted = int(text.split("Question: q")[1].split("?")[0])
    done = text.count("<tool_response>")
    if done < wanted:
        return protocol.render_tool_call("delegate", {"task": f"lookup {done}", "context": ""}, think="plan")
    return protocol.render_answer(f"final after {done}", think="done")


def sub_policy(text):
    if "<tool_response>" not in text:
        return protocol.render_tool_call("search", {"query": "veloria"}, think="look")
    return protocol.render_answer("42", think="found")


def _engine(tokenizer, main=main_policy, sub=sub_policy, **limits):
    search = lambda args, session=None: f"results for {args['query']}"  # noqa: E731
    top = AgentRuntime("main", ScriptedSampler(tokenizer, main), "main system", {"reason": lambda a, session=None: "7"},
                       can_delegate=True, max_turns=limits.pop("max_turns", 8), context_tokens=4096)
    sub_rt = AgentRuntime("sub", ScriptedSampler(tokenizer, sub), "sub system", {"search": search}, max_turns=4,
                          context_tokens=4096)
    return RolloutEngine(tokenizer, top, sub_rt, RolloutLimits(max_turn_tokens=256, **limits))


def _questions(*counts):
    return [types.SimpleNamespace(text=f"q{n}?", answer="x") for n in counts]


def test_delegations_are_run_batched_and_returned_to_their_parent(tokenizer):
    engine = _engine(tokenizer)
    batch = engine.run(_questions(0, 1, 3), rollouts=2)
    np.testing.assert_array_equal(batch.sub_counts(), [[0, 0], [1, 1], [3, 3]])
    for row in batch.top:
        for episode in row:
            assert episode.end_reason == "answer"
            assert episode.answer == f"final after {len(episode.subs)}"
            assert [s.invocation for s in episode.subs] == list(range(len(episode.subs)))
            assert all(s.answer == "42" and s.task == f"lookup {i}" for i, s in enumerate(episode.subs))
            assert protocol.trajectory_format_ok(episode.turns, allowed_tools=("reason", "delegate"))
    # All four sub-agents of the first delegation round share one sampler call.
    assert max(engine.sub.sampler.batch_sizes) == 4


def test_tokens_masks_and_logprobs_line_up(tokenizer):
    batch = _engine(tokenizer).run(_questions(2), rollouts=1)
    episode = batch.top[0][0]
    arrays = episode.arrays()
    assert len(arrays["tokens"]) == len(arrays["loss_mask"]) == len(arrays["old_logprobs"])
    trained = arrays["loss_mask"] > 0
    np.testing.assert_array_equal(arrays["old_logprobs"][trained], -0.5)
    np.testing.assert_array_equal(arrays["old_logprobs"][~trained], 0.0)
    # The trained tokens are exactly the sampled turns (content + end-of-turn), nothing else.
    assert trained.sum() == sum(len(tokenizer.encode(t)) + 1 for t in episode.turns)
    # The token stream decodes to the rendered conversation, tool responses included.
    text = tokenizer.decode(arrays["tokens"])
    assert text.count("<tool_response>") == 2 and "42" in text


def test_limits_end_episodes_cleanly(tokenizer):
    batch = _engine(tokenizer, max_turns=2).run(_questions(5), rollouts=1)
    assert batch.top[0][0].end_reason == "max_turns" and batch.top[0][0].answer is None
    capped = _engine(tokenizer, max_sub_calls=1).run(_questions(3), rollouts=1).top[0][0]
    assert len(capped.subs) == 1 and "at most 1 delegations" in tokenizer.decode(capped.tokens)
    broken = _engine(tokenizer, main=lambda text: "no tags at all").run(_questions(1), rollouts=1).top[0][0]
    assert broken.end_reason == "format_error" and broken.format_error == protocol.STRAY_TEXT
    long_turn = _engine(tokenizer, main=lambda text: "<think>" + "x " * 400).run(_questions(1), rollouts=1)
    assert long_turn.top[0][0].end_reason == "turn_too_long"


def test_context_budget_ends_an_episode(tokenizer):
    engine = _engine(tokenizer)
    engine.top.context_tokens = 60
    episode = engine.run(_questions(3), rollouts=1).top[0][0]
    assert episode.end_reason == "context"
    assert len(episode.tokens) <= 60 + 300  # only an untrained tool response may pass the budget


def test_aligned_batches_have_fixed_shapes_and_point_home(tokenizer):
    batch = _engine(tokenizer).run(_questions(0, 2, 5), rollouts=2)
    counts = batch.sub_counts()
    index, weight = align(counts, 3, jax.random.key(0))
    adv = np.arange(counts.size * 3, dtype=np.float32).reshape(3, 2, 3)
    subs = batches.sub_batch(batch.top, index, weight, adv, seq_len=512)
    assert subs["tokens"].shape == (3 * 2 * 3, 512)
    np.testing.assert_array_equal(subs["weights"][:6], 0.0)  # d_k = 0 rollouts are masked
    np.testing.assert_array_equal(subs["advantages"][:6], 0.0)
    assert subs["weights"][6:].all()
    for row, (q, k, i) in enumerate(subs["source"]):
        if i >= 0:
            episode = batch.top[q][k].subs[i]
            assert np.array_equal(subs["tokens"][row, : len(episode.tokens)], episode.tokens)
            assert subs["attention_mask"][row].sum() == len(episode.tokens)
    top = batches.top_batch(batch.top, np.zeros((3, 2)), seq_len=1024)
    assert top["tokens"].shape == (6, 1024) and top["positions"][0, 5] == 5
    with pytest.raises(ValueError, match="seq_len=16"):
        batches.top_batch(batch.top, np.zeros((3, 2)), seq_len=16)


def test_stats_count_tools_and_end_reasons(tokenizer):
    stats = _engine(tokenizer).run(_questions(1, 2), rollouts=2).stats()
    assert stats["main/tool_calls/delegate"] == 1.5
    assert stats["sub/tool_calls/search"] == 1.0
    assert stats["main/end/answer"] == 1.0 and stats["d_k/max"] == 2
    assert stats["main/tool_errors"] == stats["sub/tool_errors"] == 0.0  # always reported (test_robustness.py)


def test_each_episode_has_its_own_tool_session_and_its_record_holds_no_engine_state(tokenizer):
    """The tools' scratch space is the engine's, one per episode and run; the `Episode` is the trajectory only."""
    sessions = []

    def search(args, session):
        session["calls"] = session.get("calls", 0) + 1
        sessions.append(session)
        return f"results {session['calls']}"

    def sub(text):  # two searches, then an answer
        if text.count("<tool_response>") < 2:
            return protocol.render_tool_call("search", {"query": "veloria"}, think="look")
        return protocol.render_answer("42", think="found")

    engine = _engine(tokenizer, sub=sub)
    engine.sub.tools = {"search": search}
    batch = engine.run(_questions(1, 2), rollouts=2)
    subs = list(batch.episodes("sub"))
    assert len(subs) == 6 and all(s.answer == "42" for s in subs)
    assert len({id(s) for s in sessions}) == 6 and all(s == {"calls": 2} for s in sessions)
    assert all("results 1" in tokenizer.decode(s.tokens) and "results 2" in tokenizer.decode(s.tokens) for s in subs)
    fields = {f.name for f in dataclasses.fields(Episode)}
    assert not fields & {"waiting_on", "tool_session"}
    assert Episode.from_json(subs[0].to_json()) == dataclasses.replace(subs[0], subs=[])
