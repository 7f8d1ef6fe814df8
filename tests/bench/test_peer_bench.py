"""The peer benchmark (bench.peer): its seeded workload, its token counts worked out by hand, the check of the engine's
episodes against the rendered workload, and its quick mode with vLLM absent (no timing is asserted).

The run with vLLM needs vLLM's virtualenv (launch/peer_vllm_venv.sh) and a minute or more: opt in with
MGRPO_TEST_VLLM=1 (vLLM's python from MGRPO_VLLM_PYTHON or .venv-vllm/bin/python)."""

import json
import os
import subprocess
import sys
import types
from pathlib import Path

import pytest

from mgrpo_jax.bench import peer

REPO = Path(__file__).resolve().parents[2]
# The quick plan (seed 0): 3 episodes x 2 turns of 4-12 tokens, as random.Random(0) draws them.
QUICK_TURNS = [[12, 8], [4, 12], [4, 5]]
# By hand, with PeerTokenizer (one id per character, a role header 2 ids, a message ends with 2 more):
# first prompt = 1 (start) + system (2 + 16 + 2) + user (2 + len("Question: ") 10 + 4 + 2) + assistant header 2 = 41;
# after a turn = separator 1 + tool (2 + "<tool_response>" 15 + 6 + "</tool_response>" 16 + 2) + header 2 = 44.
QUICK_FIRST_PROMPT, QUICK_APPEND = 41, 44


def run_quick(*flags):
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}
    env["PYTHONPATH"] = str(REPO) + os.pathsep + env.get("PYTHONPATH", "")
    proc = subprocess.run([sys.executable, "-m", "mgrpo_jax.bench.peer", "--quick", *flags], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def quick_args(**changes):
    return peer.parse_args(["--quick", *(f"--{k.replace('_', '-')}={v}" for k, v in changes.items())])


def test_the_plan_is_seeded_and_in_range():
    args = quick_args()
    a = peer.plan(args.episodes, args.turns, args.turn_tokens, args.response_tokens, args.system_tokens,
                  args.question_tokens, args.seed)
    assert a.turns == QUICK_TURNS
    b = peer.plan(32, 4, (16, 128), 64, 256, 32, seed=0)
    assert b == peer.plan(32, 4, (16, 128), 64, 256, 32, seed=0) != peer.plan(32, 4, (16, 128), 64, 256, 32, 1)
    assert all(16 <= n <= 128 for t in b.turns for n in t) and len(b.turns) == 32 and {len(t) for t in b.turns} == {4}
    assert {len(r) for rs in b.responses for r in rs} == {64} and {len(rs) for rs in b.responses} == {3}
    assert len(b.system) == 256 and {len(q) for q in b.questions} == {32}
    assert not any("<" in r for rs in b.responses for r in rs)  # nothing for the grammar to neutralise


def test_token_counts_by_hand():
    args = quick_args()
    p = peer.plan(args.episodes, args.turns, args.turn_tokens, args.response_tokens, args.system_tokens,
                  args.question_tokens, args.seed)
    tokenizer = peer.PeerTokenizer(args.vocab)
    work = peer.token_workload(p, tokenizer)
    assert [len(x) for x in work.prefixes] == [QUICK_FIRST_PROMPT] * 3
    assert [[len(a) for a in x] for x in work.appends] == [[QUICK_APPEND]] * 3
    assert all(0 <= i < args.vocab for x in work.prefixes + [a for x in work.appends for a in x] for i in x)
    assert work.prefixes[0][:1 + 20] == work.prefixes[1][:1 + 20]  # the shared system prompt
    # Last prompt and last turn: 41 + 44 + the two turns.
    assert [work.context_tokens(i) for i in range(3)] == [QUICK_FIRST_PROMPT + QUICK_APPEND + sum(t)
                                                          for t in QUICK_TURNS] == [105, 101, 94]
    # Prompts counted whole at each turn: 41, then 41 + turn 1 + 44.
    assert [work.prompt_tokens(i) for i in range(3)] == [41 + 41 + t[0] + 44 for t in QUICK_TURNS]


def fake_episode(i, work, lengths, end="answer"):
    tokens, mask = list(work.prefixes[i]), [0.0] * len(work.prefixes[i])
    for t, n in enumerate(lengths):
        tokens += [7] * n
        mask += [1.0] * n
        tail = work.appends[i][t] if t < len(work.appends[i]) else work.separator
        tokens += tail
        mask += [0.0] * len(tail)
    return types.SimpleNamespace(question_index=i, end_reason=end, tokens=tokens, loss_mask=mask,
                                 generated_tokens=int(sum(mask)))


def test_the_engines_episodes_are_checked_segment_by_segment():
    args = quick_args()
    p = peer.plan(args.episodes, args.turns, args.turn_tokens, args.response_tokens, args.system_tokens,
                  args.question_tokens, args.seed)
    work = peer.token_workload(p, peer.PeerTokenizer(args.vocab))
    good = [fake_episode(i, work, QUICK_TURNS[i]) for i in range(3)]
    assert peer.check_episodes(good, work) == [20, 16, 9]
    with pytest.raises(RuntimeError, match="generated runs"):
        peer.check_episodes([fake_episode(0, work, [12, 7]), *good[1:]], work)
    with pytest.raises(RuntimeError, match="ended"):
        peer.check_episodes([fake_episode(0, work, QUICK_TURNS[0], end="context"), *good[1:]], work)
    wrong = fake_episode(1, work, QUICK_TURNS[1])
    wrong.tokens[3] += 1
    with pytest.raises(RuntimeError, match="prompt segments"):
        peer.check_episodes([good[0], wrong, good[2]], work)


def test_quick_mode_without_vllm_runs_this_engine_and_says_vllm_is_absent():
    figures = run_quick("--vllm-python=/nonexistent/python")
    assert figures["vllm"] == "absent" and figures["vllm_tokens_per_s"] is None and figures["tokens_ratio"] is None
    assert figures["turn_lengths"] == QUICK_TURNS and (figures["episodes"], figures["turns"]) == (3, 2)
    assert figures["generated_tokens"] == 12 + 8 + 4 + 12 + 4 + 5 == 45
    assert figures["engine"]["generated_per_episode"] == [20, 16, 9]
    assert figures["context_tokens"] == 105 + 101 + 94
    assert figures["workload"]["first_prompt_tokens"] == QUICK_FIRST_PROMPT
    assert figures["workload"]["append_tokens"] == QUICK_APPEND
    engine = figures["engine"]
    assert engine["compiles_in_timed_run"] == 0 and engine["slots"] == 3 and engine["context_budget"] == 128
    assert figures["engine_tokens_per_s"] * engine["run_s"] == pytest.approx(45)
    assert figures["engine_episodes_per_s"] * engine["run_s"] == pytest.approx(3)
    # Every token the turns saw went through the model once: each episode but its last sampled id.
    assert engine["prefill_tokens"] == figures["context_tokens"] - 3
    assert figures["model"]["params"] > 0 and figures["model"]["head_dim"] == 64
    assert figures["threads"] == len(figures["cpus"]) >= 1


@pytest.mark.skipif(os.environ.get("MGRPO_TEST_VLLM") != "1", reason="opt in: MGRPO_TEST_VLLM=1 (vLLM's venv)")
def test_quick_mode_with_vllm_generates_the_same_tokens_per_episode():
    figures = run_quick()
    assert isinstance(figures["vllm"], dict) and figures["same_tokens_per_episode"] is True
    assert figures["vllm"]["generated_per_episode"] == figures["engine"]["generated_per_episode"] == [20, 16, 9]
    assert figures["vllm"]["prompt_tokens"] == figures["prompt_tokens"]
    assert figures["tokens_ratio"] == pytest.approx(figures["engine_tokens_per_s"] / figures["vllm_tokens_per_s"])
