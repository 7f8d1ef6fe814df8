"""Figures of the offline environments: generation time, tool latency, calibration, expert success.

    python -m mgrpo_jax.bench.env [--per_split 100] [--entities 10000] [--grammar chat|compact|both]
    python -m mgrpo_jax.bench.env --judge=http [--judge_answers 512] [--judge_concurrency 16] [--judge_latency_ms 0]

The last line is one JSON object. For the chat world: at least `worldgen_s_10k`, `search_ms`, `visit_ms` and
`expert_success` ({split: {"multi": rate, "single": rate}}), plus token-length calibration figures (tokens
estimated at four characters each). For the compact world (the `local` and `figures` presets' sizes), under
`compact`: `expert_success`, `expert_success_perfect_sub` (the sub-agent expert without its mistakes) and
`expert_success_perfect_main` (the main-agent expert without its own), per split and `overall`, the mean expert
score of the sub-agent's episodes, the d_k histogram of the main expert, and episode lengths in words.

`--judge=http` measures the HTTP reward judge instead (`mgrpo_jax.env.judges.HttpJudge`, one batch of answers against
a loopback OpenAI-compatible server that waits `--judge_latency_ms` per reply): `judged_answers_per_s` at
`judge_concurrency` requests in flight. At latency 0 it is the client's own ceiling; with a real endpoint's latency
L, expect about concurrency / L answers per second until the endpoint saturates.

`--quick`: a 2,000-entity world (about the smallest that holds the default question sets) and 10 questions per
split, both grammars (seconds); further flags still apply."""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import sys
import time

from mgrpo_jax.env.build import build_environment, noise_config
from mgrpo_jax.env.experts import NoiseConfig, ScriptedExperts
from mgrpo_jax.env.questions import generate_questions
from mgrpo_jax.env.tools import SearchTool, VisitTool, WorldBackend
from mgrpo_jax.env.world import estimate_tokens, generate_world


def _episode_tokens(episode) -> int:
    return sum(estimate_tokens(text) for _, text in episode.as_chat())


def run(n_entities: int = 10_000, per_split: int = 100, seed: int = 0) -> dict:
    started = time.perf_counter()
    world = generate_world(seed, n_entities)
    worldgen_s = time.perf_counter() - started
    started = time.perf_counter()
    backend = WorldBackend(world)
    index_s = time.perf_counter() - started
    started = time.perf_counter()
    questions = generate_questions(world, seed)
    questions_s = time.perf_counter() - started

    search, visit = SearchTool(backend), VisitTool(backend)
    probes = world.entities[:: max(1, len(world.entities) // 100)][:100]
    started = time.perf_counter()
    search_outputs = [search({"query": f"{entity.name} founded born population"}) for entity in probes]
    search_ms = 1000 * (time.perf_counter() - started) / len(probes)
    started = time.perf_counter()
    pages = [visit({"url": entity.url}) for entity in probes]
    visit_ms = 1000 * (time.perf_counter() - started) / len(probes)

    experts = ScriptedExperts(world, NoiseConfig(), backend=backend)
    success: dict[str, dict[str, float]] = {}
    single_tokens_by_hops: dict[int, list[int]] = {}
    main_tokens, sub_tokens, sub_scores = [], [], []
    for split, split_questions in questions.items():
        sample = split_questions[:per_split]
        if not sample:  # a split this world's sizes leave empty (the chat world has no `fresh` split)
            continue
        multi = [experts.main_agent(question) for question in sample]
        single = [experts.single_agent(question) for question in sample]
        success[split] = {
            "multi": round(sum(t.correct for t in multi) / len(sample), 3),
            "single": round(sum(t.correct for t in single) / len(sample), 3),
        }
        for transcript in multi:
            main_tokens.append(_episode_tokens(transcript.top))
            sub_tokens.extend(_episode_tokens(episode) for episode in transcript.subs)
            sub_scores.extend(transcript.sub_scores)
        for transcript in single:
            single_tokens_by_hops.setdefault(transcript.question.hops, []).append(_episode_tokens(transcript.top))
    return {
        "worldgen_s_10k" if n_entities == 10_000 else f"worldgen_s_{n_entities}": round(worldgen_s, 2),
        "index_s": round(index_s, 2),
        "questions_s": round(questions_s, 2),
        "search_ms": round(search_ms, 2),
        "visit_ms": round(visit_ms, 3),
        "page_tokens_mean": round(statistics.mean(estimate_tokens(page) for page in pages)),
        "search_result_tokens_mean": round(statistics.mean(estimate_tokens(out) for out in search_outputs)),
        "question_counts": {split: len(split_questions) for split, split_questions in questions.items()},
        "main_episode_tokens_mean": round(statistics.mean(main_tokens)),
        "sub_episode_tokens_mean": round(statistics.mean(sub_tokens)),
        "single_episode_tokens_mean_by_hops": {
            hops: round(statistics.mean(tokens)) for hops, tokens in sorted(single_tokens_by_hops.items())
        },
        "sub_agent_r_expert_mean": round(statistics.mean(sub_scores), 3),
        "expert_success": success,
        "expert_success_questions_per_split": per_split,
    }


def run_compact(per_split: int = 100, seed: int = 0) -> dict:
    """Expert success on the compact world (as the `local` preset builds it), with and without each agent's mistakes."""
    from mgrpo_jax.config import get_config
    from mgrpo_jax.env.compact import compact_success

    config = get_config("xbench", "local")
    config.env.seed = seed
    started = time.perf_counter()
    env = build_environment(config)
    build_s = time.perf_counter() - started
    noisy = noise_config(config)
    variants = {"expert_success": noisy,
                "expert_success_perfect_sub": dataclasses.replace(noisy, wrong_kind_facts=0.0),
                "expert_success_perfect_main": dataclasses.replace(noisy, wrong_entity_facts=0.0, skip_calc_facts=0.0)}
    out: dict = {"build_s": round(build_s, 2), "question_counts": {s: len(q) for s, q in env.questions.items()}}
    for key, noise in variants.items():
        experts = env.experts(noise)
        rates = {split: compact_success(experts, questions[:per_split]) for split, questions in env.questions.items()}
        weights = {split: min(per_split, len(questions)) for split, questions in env.questions.items()}
        total = sum(weights.values())
        rates["overall"] = {agent: round(sum(rates[s][agent] * w for s, w in weights.items()) / total, 3)
                            for agent in ("multi", "single")}
        out[key] = {split: {agent: round(v, 3) for agent, v in r.items()} for split, r in rates.items()}
    experts = env.experts(noisy)
    transcripts = [experts.main_agent(q) for q in env.questions.stage2[:per_split]]
    words = {"main": [t.top for t in transcripts], "sub": [s for t in transcripts for s in t.subs],
             "single": [experts.single_agent(q).top for q in env.questions.stage2[:per_split]]}
    out["episode_words_mean"] = {agent: round(statistics.mean(sum(len(m.text.split()) for m in e.messages)
                                                              for e in episodes), 1)
                                 for agent, episodes in words.items()}
    out["sub_agent_r_expert_mean"] = round(statistics.mean(s for t in transcripts for s in t.sub_scores), 3)
    counts = [len(t.subs) for t in transcripts]
    out["stage2_d_k_hist"] = {str(d): counts.count(d) for d in range(max(counts) + 1)}
    return out


def run_judge(answers: int = 512, concurrency: int = 16, latency_ms: float = 0.0) -> dict:
    """Judged answers per second of `HttpJudge` against a loopback chat-completions server."""
    from mgrpo_jax.env.judges import AnswerCase, HttpJudge
    from mgrpo_jax.env.loopback import LoopbackServer, Reply, chat_reply
    from mgrpo_jax.env.questions import Question
    from mgrpo_jax.env.scoring import XBENCH_PROMPT
    from mgrpo_jax.env.services import ChatEndpoint, ServiceClient

    def reply(request):
        last = request.json()["messages"][-1]["content"]
        return Reply(body=chat_reply(f"结论: {'正确' if len(last) % 2 else '错误'}"), delay_s=latency_ms / 1000)

    question = Question("bench", "bench", "multi", 1, "Which city was the founder of Brel born in?", "Varn", (), (), ())
    cases = [AnswerCase(f"bench/rollout{i}", question, f"Perhaps city number {i}") for i in range(answers)]
    with LoopbackServer(reply, max_requests=answers) as server:
        judge = HttpJudge(ChatEndpoint(server.url + "/v1", "bench", ServiceClient("judge endpoint", timeout_s=60)),
                          XBENCH_PROMPT, concurrency=concurrency)
        start = time.perf_counter()
        judge.correct(cases)
        seconds = time.perf_counter() - start
    assert len(server.requests) == answers and judge.metrics()["judge/unparseable"] == 0
    return {"judge": "http", "judge_answers": answers, "judge_concurrency": concurrency,
            "judge_latency_ms": latency_ms, "judge_s": round(seconds, 3),
            "judged_answers_per_s": round(answers / seconds, 1)}


def measure(argv: list[str]) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--judge", choices=("none", "http"), default="none",
                        help="http: measure the HTTP reward judge against a loopback server (nothing else)")
    parser.add_argument("--judge_answers", type=int, default=512)
    parser.add_argument("--judge_concurrency", type=int, default=16)
    parser.add_argument("--judge_latency_ms", type=float, default=0.0)
    parser.add_argument("--entities", type=int, default=10_000)
    parser.add_argument("--per_split", type=int, default=100)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--grammar", choices=("chat", "compact", "both"), default="both")
    args = parser.parse_args(argv)
    if args.judge == "http":
        figures = run_judge(args.judge_answers, args.judge_concurrency, args.judge_latency_ms)
        print(f"{figures['judged_answers_per_s']} judged answers/s at concurrency {args.judge_concurrency} "
              f"(server latency {args.judge_latency_ms:g} ms)")
        print(json.dumps(figures))
        return
    figures = run(args.entities, args.per_split, args.seed) if args.grammar != "compact" else {}
    for key, value in figures.items():
        if not isinstance(value, dict):
            print(f"{key:>32}: {value}")
    for split, rates in figures.get("expert_success", {}).items():
        print(f"{'expert success ' + split:>32}: multi {rates['multi']:.2f}  single {rates['single']:.2f}")
    if args.grammar != "chat":
        figures["compact"] = compact = run_compact(args.per_split, args.seed)
        for key in ("expert_success", "expert_success_perfect_sub", "expert_success_perfect_main"):
            for split, rates in compact[key].items():
                print(f"{'compact ' + key.replace('expert_success', 'expert') + ' ' + split:>48}: "
                      f"multi {rates['multi']:.2f}  single {rates['single']:.2f}")
        print(f"{'compact episode words':>48}: {compact['episode_words_mean']}, "
              f"stage-2 d_k {compact['stage2_d_k_hist']}")
    print(json.dumps(figures))



QUICK = ["--entities", "2000", "--per_split", "10"]


def main(argv: list[str] | None = None) -> None:
    argv = list(sys.argv[1:] if argv is None else argv)
    if "--quick" in argv:
        argv = [*QUICK, *(a for a in argv if a != "--quick")]
    measure(argv)


if __name__ == "__main__":
    main()
