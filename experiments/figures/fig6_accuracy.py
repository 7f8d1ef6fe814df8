"""Fig. 6: held-out accuracy (avg@3) during stage 2, `mgrpo` vs `frozen_sub`, on the three evaluation sets; and
the two controls that say whether held-out answers come from reading the tools.

    python -m experiments.figures.fig6_accuracy [--root runs/figures] [--seeds 5] [--plot-only]

Each stage-2 run evaluates at its start (its seed's stage-1 checkpoint) and every `train.eval_every` steps:
three sampled runs of each of `train.eval_questions` questions per set (GAIA-, XBench- and WebWalker-style, held
out by fact path: mgrpo_jax/env/compact/questions.py). Mean +-1 std over seeds. The claim `mgrpo` > `frozen_sub`
is tested per set on each seed's accuracy over the last third of the evaluations (with 3 evaluations: the final
one), paired by world: bootstrap interval, exact sign-flip p-value, t-interval and the verdict rule (`stats.py`).

Controls, on the final `mgrpo` system of every seed (its last evaluation):
- **transfer gap**: accuracy on `fresh` questions (new questions of the stage-2 distribution, over facts training
  read) minus accuracy on `validation` (the same kinds over held-out facts); a system that reads its tools has a
  gap near 0, one that recalls its training facts a large one. A comparison without a claimed direction (the
  two-sided permutation p, the t-interval and which is higher, `stats.compare`), with the gap on every world
  (`per_world`, in the order of `world_seeds`);
- **blind**: the same system with every tool answering "none" (`eval_blind/<set>/accuracy`); near 0 when the
  answers come from the tools, not from memory.
"""

from __future__ import annotations

import numpy as np

from experiments.figures import runs, stats

MODES = ("mgrpo", "frozen_sub")
SETS = (("eval_gaia", "GAIA-style"), ("eval_xbench", "XBench-style"), ("eval_webwalker", "WebWalker-style"))
CONTROL_SETS = ("validation", "fresh", *(name for name, _ in SETS))
FIGURE = "fig6_accuracy"


def final_accuracy(names, key: str) -> np.ndarray:
    """Each run's accuracy at its last evaluation that logged `key`."""
    _, values = runs.series(names, key)
    return values[:, -1]


def controls(names) -> dict:
    """The blind control per set and the transfer gap (fresh - validation, paired by seed) of the runs `names`."""
    out = {"blind": {}, "accuracy": {}}
    for split in CONTROL_SETS:
        out["accuracy"][split] = stats.arm(final_accuracy(names, f"eval/{split}/accuracy"))
        out["blind"][split] = stats.arm(final_accuracy(names, f"eval_blind/{split}/accuracy"))
    fresh, validation = (final_accuracy(names, f"eval/{s}/accuracy") for s in ("fresh", "validation"))
    out["transfer_gap"] = stats.compare(fresh, validation, ("fresh", "validation"), paired=True, claimed=False)
    out["transfer_gap"]["claim"] = "transfer gap: fresh (training facts) - validation (held-out facts), same kinds"
    out["transfer_gap"]["world_seeds"] = runs.worlds(names)
    out["transfer_gap"]["per_world"] = [float(x) for x in fresh - validation]  # the gap on each world, in order
    return out


def main(argv=None) -> dict:
    args = runs.parse_args(__doc__, argv)
    if not args.plot_only:
        runs.ensure([n for m in MODES for n in runs.stage2(m)], args.root, args.jobs)
    fig, axes = runs.new_figure(len(SETS) + 1, width=4.5)
    results, claims = {}, []
    for ax, (split, title) in zip(axes[:len(SETS)], SETS, strict=True):
        key = f"eval/{split}/accuracy"
        out, curves = runs.compare(ax, {mode: (runs.stage2(mode), key) for mode in MODES}, ema=None)
        results.update({f"{mode}/{split}": out[mode] for mode in MODES})
        results[f"identical/{split}"] = out["identical"]
        claims.append(runs.window_claim(f"held-out accuracy ({title}): mgrpo > frozen_sub",
                                        *((mode, *curves[mode], key) for mode in MODES), paired=True))
        ax.set(xlabel="stage-2 step", ylabel="accuracy (avg@3)", title=title)
    results["claims"] = claims
    results["controls"] = controls(runs.stage2("mgrpo"))
    ax = axes[-1]
    seeing = [results["controls"]["accuracy"][s]["mean"] for s in CONTROL_SETS]
    blind = [results["controls"]["blind"][s]["mean"] for s in CONTROL_SETS]
    x = np.arange(len(CONTROL_SETS))
    ax.bar(x - 0.2, seeing, 0.4, label="tools answer")
    ax.bar(x + 0.2, blind, 0.4, label='every tool answers "none"')
    ax.set_xticks(x, [s.replace("eval_", "") for s in CONTROL_SETS], rotation=30, fontsize=8)
    ax.set(ylabel="accuracy (avg@3)", title="final mgrpo: fresh vs held-out, blind control")
    ax.legend(fontsize=8)
    runs.save_png(fig, FIGURE)
    runs.save_results(FIGURE, results, {mode: runs.stage2(mode) for mode in MODES})
    return results


if __name__ == "__main__":
    main()
