"""The d_k histogram: how many sub-agent calls the main agent makes per rollout during stage 2 (`mgrpo`).

    python -m experiments.figures.dk_histogram [--root runs/figures] [--plot-only]

Counts are summed over every stage-2 step of the `mgrpo` seeds, split into the first and second half
of training; the 99th percentile (the paper's choice of D) is marked.
"""

from __future__ import annotations

import numpy as np

from experiments.figures import runs, stats

FIGURE = "dk_histogram"


def dk_rows(name: str) -> list[dict]:
    """A run's RL steps that logged a d_k histogram (not the evaluation-only row of step 0)."""
    return [row for row in runs.rl_rows(name) if f"{runs.DK_HIST}0" in row]


def histogram(names, steps: slice | None = None, read=None) -> np.ndarray:
    """Summed d_k counts (entry i: rollouts with i sub-calls, the last bin open-ended) of the runs' RL steps.

    `read(name)` gives a run's rows that logged the histogram (default: `dk_rows`, from the committed logs).
    """
    return stats.summed_counts({name: (read or dk_rows)(name)[steps or slice(None)] for name in names}, runs.DK_HIST)


def main(argv=None) -> dict:
    args = runs.parse_args(__doc__, argv)
    names = runs.stage2("mgrpo")
    if not args.plot_only:
        runs.ensure(names, args.root, args.jobs)
    half = len(dk_rows(names[0])) // 2
    parts = {"first half": histogram(names, slice(0, half)), "second half": histogram(names, slice(half, None))}
    everything = parts["first half"] + parts["second half"]
    p99 = stats.count_percentile(everything, 0.99)
    fig, (ax,) = runs.new_figure(1)
    d = np.arange(len(everything))
    width = 0.4
    for offset, (label, counts) in zip((-width / 2, width / 2), parts.items(), strict=True):
        ax.bar(d + offset, counts / max(counts.sum(), 1), width, label=f"{label} of stage 2")
    ax.axvline(p99, color="k", linestyle="--", label=f"99th percentile: d = {p99}")
    ax.set(xlabel="sub-agent calls per rollout (d_k; last bin open-ended)", ylabel="fraction of rollouts",
           title="How often the main agent delegates (mgrpo, stage 2)", xticks=d)
    ax.legend()
    runs.save_png(fig, FIGURE)
    results = {"counts": everything.tolist(), "p99": p99, "n_seeds": len(names),
               "mean": float((d * everything).sum() / everything.sum()),
               **{f"fraction/{k}": (v / max(v.sum(), 1)).round(4).tolist() for k, v in parts.items()}}
    runs.save_results(FIGURE, results)
    return results


if __name__ == "__main__":
    main()
