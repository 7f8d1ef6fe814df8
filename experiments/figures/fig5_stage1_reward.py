"""Fig. 5: stage-1 training reward vs step, from a warm start that does not yet follow the format reliably.

    python -m experiments.figures.fig5_stage1_reward [--root runs/figures] [--plot-only]

Three seeds of stage 1 (`stage1_mgrpo_s{0,1,2}`) from one shared warm start; mean and +-1 std over seeds of the
main agent's reward and its format-valid fraction (the reward's format term is what stage 1 teaches).
"""

from __future__ import annotations

from experiments.figures import runs

NAMES = [f"stage1_mgrpo_s{s}" for s in runs.SEEDS]
FIGURE = "fig5_stage1_reward"


def main(argv=None) -> dict:
    args = runs.parse_args(__doc__, argv)
    if not args.plot_only:
        runs.ensure(NAMES, args.root, args.jobs)
    fig, (ax_reward, ax_format) = runs.new_figure(2)
    results = {}
    for ax, key, title in ((ax_reward, "main/reward", "main agent reward"),
                           (ax_format, "main/format_ok", "format-valid rollouts")):
        steps, values = runs.series(NAMES, key)
        runs.band(ax, steps, values, "stage 1 (3 seeds)", ema=0.8)
        ax.set(xlabel="RL step", ylabel=key, title=f"Stage 1: {title}")
        ax.legend()
        results[key] = {"first3": runs.final(values[:, :3], 3), "last3": runs.final(values, 3)}
    runs.save_png(fig, FIGURE)
    runs.save_results(FIGURE, results)
    return results


if __name__ == "__main__":
    main()
