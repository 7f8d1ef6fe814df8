"""Follow-up to Figs. 7-8: co-training vs a frozen sub-agent once the sub-agent can keep the protocol.

    python -m experiments.figures.longer_warmstart [--root runs/figures] [--plot-only]

In the main set the sub-agent's 200-step warm start never produces a protocol-valid episode, so its reward is
0 and `mgrpo` cannot differ from `frozen_sub`. Here the sub-agent's warm start is 600 steps (the main agent's
stays 300) and stage 2 runs straight from it, 12 steps, 3 seeds per mode. Left: the main agent's reward;
right: the sub-agent's reward R_S (the gradient `mgrpo` trains it on).
"""

from __future__ import annotations

from experiments.figures import runs

MODES = ("mgrpo", "frozen_sub")
FIGURE = "longer_warmstart"


def names(mode: str) -> list[str]:
    return [f"sub600_stage2_{mode}_s{s}" for s in runs.SEEDS]


def main(argv=None) -> dict:
    args = runs.parse_args(__doc__, argv)
    if not args.plot_only:
        runs.ensure([n for m in MODES for n in names(m)], args.root, args.jobs)
    fig, axes = runs.new_figure(2)
    keys = ("main/reward", "sub/reward")
    results = runs.compare_panels(axes, keys, lambda key: {mode: (mode, names(mode), key) for mode in MODES})
    for ax, key in zip(axes, keys, strict=True):
        ax.set(xlabel="stage-2 step", ylabel=key, title=f"Sub-agent warm start 600 steps: {key}")
    runs.save_png(fig, FIGURE)
    runs.save_results(FIGURE, results)
    return results


if __name__ == "__main__":
    main()
