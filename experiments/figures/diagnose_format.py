"""Why the miniature runs stay near zero: protocol validity and accuracy of a saved system vs sampling temperature.

    python -m experiments.figures.diagnose_format --run stage1_mgrpo_s0 [--questions 8] [--samples 2]

Runs the system saved by `--run` on validation questions (never the evaluation sets) at each temperature and
prints, per agent, the fraction of episodes that end with a protocol-valid answer and how they end otherwise,
plus the fraction of correct final answers. Results go to experiments/figures/results/diagnose_<run>.json.
"""

from __future__ import annotations

import argparse
import collections
import os

from experiments.figures import runs
from experiments.figures.case_studies import rollouts
from mgrpo_jax.env.scoring import world_answer_correct


def summarise(questions, batch) -> dict:
    top = [e for row in batch.top for e in row]
    subs = [s for e in top for s in e.subs]
    out = {"episodes": len(top), "correct": sum(
        e.answer is not None and world_answer_correct(e.answer, questions[e.question_index].answer) for e in top
    ) / len(top)}
    for name, episodes in (("top", top), ("sub", subs)):
        ends = collections.Counter(e.end_reason for e in episodes)
        out[f"{name}/episodes"] = len(episodes)
        out[f"{name}/answered"] = ends.get("answer", 0) / max(len(episodes), 1)
        out[f"{name}/end"] = {k: v / max(len(episodes), 1) for k, v in sorted(ends.items())}
    return out


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--root", default=os.path.join(runs.REPO, "runs", "figures"))
    parser.add_argument("--run", default="stage1_mgrpo_s0")
    parser.add_argument("--questions", type=int, default=8)
    parser.add_argument("--samples", type=int, default=2)
    parser.add_argument("--temperatures", default="0,0.7")
    args = parser.parse_args(argv)
    results = {}
    for t in (float(x) for x in args.temperatures.split(",")):
        questions, batch = rollouts(args.root, args.run, args.questions, args.samples, temperature=t)
        results[f"temperature_{t:g}"] = summarise(questions, batch)
    runs.save_results(f"diagnose_{args.run}", results)
    return results


if __name__ == "__main__":
    main()
