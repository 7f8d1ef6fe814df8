"""How much of each world's questions the experts' mistakes touch: why some worlds start RL further from right.

    python -m experiments.figures.noise_exposure [--seeds 8]
    python -m experiments.figures.noise_exposure --runs RUN_DIR[,RUN_DIR...] [--lookups 160] [--samples 4]

The compact experts make each of their mistakes on a subset of fact types that the world's seed fixes
(`CompactNoise`: the sub-agent opens a namesake of the wrong kind on half of the facts, at rate 0.7, so the mistake
is its greedy action there). The warm start clones those experts, so a world whose questions lean on the noisy facts
starts stage 1 with a sub-agent that reads most of its lookups wrong. For each world and question set (stage 2's
pool, the validation set and the XBench-style 3-hop chains): the share of sub-agent lookups whose fact carries the
sub-agent's mistake, the share of questions with no such lookup, and the scripted experts' success. The last line is
one JSON object {"worlds": [...]} with those figures per world.

With `--runs`, what the saved systems (any finished runs' workdirs: warm starts, stage 1 or stage 2) do about it: each
system answers `--lookups` of its world's single-lookup questions (stage 1's), `--samples` rollouts each at the
rollout temperature, asked in the world; every delegated lookup is scored against the world's value, split by
whether its fact carries the experts' mistake (`noisy`) or not (`clean`). The last line is one JSON object
{"runs": [{"run", "world", "noisy": {"accuracy", "lookups"}, "clean": {...}}, ...]}.
"""

from __future__ import annotations

import argparse
import json
import os
from collections.abc import Sequence

from experiments.figures.runs import N_SEEDS
from mgrpo_jax.env.compact.world import FACTS
from mgrpo_jax.env.questions import Question

SETS = ("stage2", "validation", "eval_xbench")


def exposure(questions: Sequence[Question], noisy_facts: frozenset[str]) -> dict[str, float]:
    """{"noisy_lookups": share of the questions' lookups whose fact is in `noisy_facts`, "clean_questions": share
    of questions none of whose lookups is}; lookups are the decomposition's sub-tasks that ask a fact."""
    lookups = [[task.fact for task in question.decomposition if task.fact] for question in questions]
    flat = [fact for facts in lookups for fact in facts]
    if not flat:
        raise ValueError("no lookups among the questions: nothing asks a fact")
    return {"noisy_lookups": sum(fact in noisy_facts for fact in flat) / len(flat),
            "clean_questions": sum(not any(fact in noisy_facts for fact in facts) for facts in lookups)
            / len(lookups)}


def world_exposure(seed: int) -> dict:
    """World `seed` at the `figures` preset: its sub-agent's noisy facts and, per set, `exposure` and the scripted
    multi-agent experts' success."""
    from mgrpo_jax.config import get_config
    from mgrpo_jax.env.build import build_environment, noise_config
    from mgrpo_jax.env.compact import CompactExperts, compact_success

    config = get_config("xbench", "figures,mgrpo")
    config.env.seed = seed
    env, noise = build_environment(config), noise_config(config)
    experts = CompactExperts(env.world, noise)
    out = {"world": seed, "noisy_facts": sorted(noise.wrong_kind)}
    for name in SETS:
        questions = getattr(env.questions, name)
        out[name] = {**exposure(questions, noise.wrong_kind),
                     "experts_correct": compact_success(experts, questions)["multi"], "questions": len(questions)}
    return out


def read_accuracy(reads: Sequence[tuple[str, bool]], noisy_facts: frozenset[str]) -> dict[str, dict]:
    """{"noisy"|"clean": {"accuracy", "lookups"}} of (fact, read right) pairs, split by `noisy_facts`; a side with
    no lookup has accuracy None."""
    out = {}
    for side, wanted in (("noisy", True), ("clean", False)):
        right = [ok for fact, ok in reads if (fact in noisy_facts) == wanted]
        out[side] = {"accuracy": sum(right) / len(right) if right else None, "lookups": len(right)}
    return out


def system_reads(run_dir: str, lookups: int, samples: int) -> dict:
    """The saved system's sub-agent reads on `lookups` of its world's single-lookup questions (`read_accuracy`)."""
    from experiments.figures.transfer_probe import delegated_task, rollouts, saved_system
    from mgrpo_jax.env.build import noise_config
    from mgrpo_jax.env.scoring import world_answer_correct

    with saved_system(run_dir) as (trainer, config):
        world = trainer.env.world
        questions = list(trainer.env.questions.stage1)[:lookups]
        subs = [sub for episodes in rollouts(trainer, questions, samples) for episode in episodes
                for sub in episode.subs]
        reads = []
        for sub in subs:  # only lookups of a real fact of an existing entity are reads
            words = delegated_task(sub).split()
            fact, name = words if len(words) == 2 else ("", "")
            if fact in FACTS and world.find(FACTS[fact][0], name) is not None:
                reads.append((fact, world_answer_correct(sub.answer or "", world.lookup(fact, name))))
        return {"run": run_dir, "world": int(config.env.seed),
                **read_accuracy(reads, noise_config(config).wrong_kind)}


def main(argv: Sequence[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seeds", type=int, default=N_SEEDS, help=f"worlds 0..N-1 (default {N_SEEDS})")
    parser.add_argument("--runs", default=None, help="comma-separated finished runs' workdirs: their sub-agents' reads")
    parser.add_argument("--lookups", type=int, default=160, help="single-lookup questions per run (with --runs)")
    parser.add_argument("--samples", type=int, default=4, help="rollouts per question (with --runs)")
    args = parser.parse_args(argv)
    if args.seeds < 1:
        parser.error(f"--seeds must be at least 1, got {args.seeds}")
    if args.runs is not None:
        if args.lookups < 1 or args.samples < 1:
            parser.error(f"--lookups and --samples must be at least 1, got {args.lookups} and {args.samples}")
        runs = [run for run in args.runs.split(",") if run]
        for run in runs:
            if not os.path.exists(os.path.join(run, "summary.json")):
                parser.error(f"--runs: {run} has no summary.json; pass finished runs' workdirs")
        result = {"runs": []}
        for run in runs:
            got = system_reads(run, args.lookups, args.samples)
            result["runs"].append(got)
            print(f"{run} (world {got['world']}): noisy reads {got['noisy']['accuracy']} of {got['noisy']['lookups']}, "
                  f"clean {got['clean']['accuracy']} of {got['clean']['lookups']}", flush=True)
        print(json.dumps(result))
        return result
    worlds = [world_exposure(seed) for seed in range(args.seeds)]
    for w in worlds:
        print(f"world {w['world']}: noisy facts {', '.join(w['noisy_facts'])}; " + "; ".join(
            f"{name} {w[name]['noisy_lookups']:.2f} of lookups noisy, {w[name]['clean_questions']:.2f} of "
            f"questions clean, experts {w[name]['experts_correct']:.2f}" for name in SETS))
    result = {"worlds": worlds}
    print(json.dumps(result))
    return result


if __name__ == "__main__":
    main()
