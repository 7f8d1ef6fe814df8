"""Fig. 6: held-out accuracy (avg@3) during stage 2, `mgrpo` vs `frozen_sub`, on the three evaluation sets.

    python -m experiments.figures.fig6_accuracy [--root runs/figures] [--plot-only]

Each stage-2 run evaluates at its start (the shared stage-1 checkpoint) and every `train.eval_every` steps:
three sampled runs of each of `train.eval_questions` questions per set (GAIA-, XBench- and WebWalker-style).
"""

from __future__ import annotations

from experiments.figures import runs

MODES = ("mgrpo", "frozen_sub")
SETS = (("eval_gaia", "GAIA-style"), ("eval_xbench", "XBench-style"), ("eval_webwalker", "WebWalker-style"))
FIGURE = "fig6_accuracy"


def main(argv=None) -> dict:
    args = runs.parse_args(__doc__, argv)
    if not args.plot_only:
        runs.ensure([n for m in MODES for n in runs.stage2(m)], args.root, args.jobs)
    fig, axes = runs.new_figure(len(SETS), width=4.5)
    results = {}
    for ax, (split, title) in zip(axes, SETS, strict=True):
        key = f"eval/{split}/accuracy"
        for mode in MODES:
            steps, values = runs.series(runs.stage2(mode), key)
            runs.band(ax, steps, values, mode)
            results[f"{mode}/{split}"] = {"start": runs.final(values[:, :1]), "end": runs.final(values),
                                          "steps": steps.tolist()}
        ax.set(xlabel="stage-2 step", ylabel="accuracy (avg@3)", title=title)
        ax.legend()
    runs.save_png(fig, FIGURE)
    runs.save_results(FIGURE, results)
    return results


if __name__ == "__main__":
    main()
