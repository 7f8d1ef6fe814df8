"""Fig. 6: held-out accuracy (avg@3) during stage 2, `mgrpo` vs `frozen_sub`, on the three evaluation sets.

    python -m experiments.figures.fig6_accuracy [--root runs/figures] [--seeds 5] [--plot-only]

Each stage-2 run evaluates at its start (the shared stage-1 checkpoint) and every `train.eval_every` steps:
three sampled runs of each of `train.eval_questions` questions per set (GAIA-, XBench- and WebWalker-style).
Mean +-1 std over seeds. The claim `mgrpo` > `frozen_sub` is tested per set on each seed's accuracy over the
last third of the evaluations (with 3 evaluations: the final one), bootstrap over seeds (`stats.py`).
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
    results, claims = {}, []
    for ax, (split, title) in zip(axes, SETS, strict=True):
        key = f"eval/{split}/accuracy"
        out, curves = runs.compare(ax, {mode: (runs.stage2(mode), key) for mode in MODES}, ema=None)
        results.update({f"{mode}/{split}": out[mode] for mode in MODES})
        results[f"identical/{split}"] = out["identical"]
        claims.append(runs.window_claim(f"held-out accuracy ({title}): mgrpo > frozen_sub",
                                        *((mode, *curves[mode], key) for mode in MODES)))
        ax.set(xlabel="stage-2 step", ylabel="accuracy (avg@3)", title=title)
    results["claims"] = claims
    runs.save_png(fig, FIGURE)
    runs.save_results(FIGURE, results)
    return results


if __name__ == "__main__":
    main()
