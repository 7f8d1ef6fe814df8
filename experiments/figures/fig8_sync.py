"""Fig. 8: synchronised `mgrpo` vs `mgrpo_unsync` (the sub-agent trains from a FIFO, grouped regardless of query).

    python -m experiments.figures.fig8_sync [--root runs/figures] [--seeds 5] [--plot-only]

Left: the main agent's training reward; right: the sub-agent's reward R_S (which the two modes train on
differently). Mean over seeds, +-1 std band, EMA 0.8 thick. The claim synchronised > unsynchronised is tested
on the main agent's reward over the last third of the steps, bootstrap over seeds (`stats.py`); R_S gets the
same numbers as a secondary comparison.
"""

from __future__ import annotations

from experiments.figures import runs

MODES = ("mgrpo", "mgrpo_unsync")
FIGURE = "fig8_sync"
LABELS = {"mgrpo": "synchronised", "mgrpo_unsync": "unsynchronised"}


def main(argv=None) -> dict:
    args = runs.parse_args(__doc__, argv)
    if not args.plot_only:
        runs.ensure([n for m in MODES for n in runs.stage2(m)], args.root, args.jobs)
    fig, axes = runs.new_figure(2)
    keys = ("main/reward", "sub/reward")
    results, curves = runs.compare_panels(
        axes, keys, lambda key: {mode: (LABELS[mode], runs.stage2(mode), key) for mode in MODES})
    arms = {key: [(LABELS[m], *curves[f"{m}/{key}"], key) for m in MODES] for key in keys}
    results["claims"] = [runs.window_claim("main reward: synchronised > unsynchronised", *arms["main/reward"])]
    results["comparisons"] = [runs.window_claim("sub-agent reward R_S: synchronised vs unsynchronised",
                                                *arms["sub/reward"], claimed=False)]
    for ax, key in zip(axes, keys, strict=True):
        ax.set(xlabel="stage-2 step", ylabel=key, title=f"Stage 2: {key}")
    runs.save_png(fig, FIGURE)
    runs.save_results(FIGURE, results)
    return results


if __name__ == "__main__":
    main()
