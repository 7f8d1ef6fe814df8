"""Figures of the offline environment: generation time, tool latency, calibration, expert success.

    python -m mgrpo_jax.env.bench [--per_split 100] [--entities 10000]

The last line is one JSON object with at least `worldgen_s_10k`, `search_ms`, `visit_ms` and
`expert_success` ({split: {"multi": rate, "single": rate}}), plus token-length calibration figures
(tokens estimated at four characters each).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

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


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--entities", type=int, default=10_000)
    parser.add_argument("--per_split", type=int, default=100)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    figures = run(args.entities, args.per_split, args.seed)
    for key, value in figures.items():
        if not isinstance(value, dict):
            print(f"{key:>32}: {value}")
    for split, rates in figures["expert_success"].items():
        print(f"{'expert success ' + split:>32}: multi {rates['multi']:.2f}  single {rates['single']:.2f}")
    print(json.dumps(figures))


if __name__ == "__main__":
    main()
