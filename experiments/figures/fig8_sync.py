"""Fig. 8: synchronised `mgrpo` vs `mgrpo_unsync` (the sub-agent trains from a FIFO, grouped regardless of query).

    python -m experiments.figures.fig8_sync [--root runs/figures] [--plot-only]

Left: the main agent's training reward; right: the sub-agent's reward R_S (which the two modes train on
differently). Mean over three seeds, +-1 std band, EMA 0.8 thick.
"""

from __future__ import annotations

from experiments.figures import runs

MODES = ("mgrpo", "mgrpo_unsync")
FIGURE = "fig8_sync"


def main(argv=None) -> dict:
    args = runs.parse_args(__doc__, argv)
    if not args.plot_only:
        runs.ensure([n for m in MODES for n in runs.stage2(m)], args.root, args.jobs)
    fig, axes = runs.new_figure(2)
    labels = {"mgrpo": "synchronised", "mgrpo_unsync": "unsynchronised"}
    keys = ("main/reward", "sub/reward")
    results = runs.compare_panels(
        axes, keys, lambda key: {mode: (labels[mode], runs.stage2(mode), key) for mode in MODES})
    for ax, key in zip(axes, keys, strict=True):
        ax.set(xlabel="stage-2 step", ylabel=key, title=f"Stage 2: {key}")
    runs.save_png(fig, FIGURE)
    runs.save_results(FIGURE, results)
    return results


if __name__ == "__main__":
    main()
