"""Fig. 5: stage-1 training reward vs step, from a warm start that does not yet follow the format reliably.

    python -m experiments.figures.fig5_stage1_reward [--root runs/figures] [--seeds 5] [--plot-only]

`--seeds` runs of stage 1 (`stage1_mgrpo_s*`) from one shared warm start; mean and +-1 std over seeds of the
main agent's reward and its format-valid fraction (the reward's format term is what stage 1 teaches). The
claim "the reward rises" compares each seed's mean over the last third of the steps with its own mean over the
first third (paired bootstrap over seeds, `stats.py`).
"""

from __future__ import annotations

from experiments.figures import runs

FIGURE = "fig5_stage1_reward"
CLAIM_KEY = "main/reward"


def names() -> list[str]:
    return [f"stage1_mgrpo_s{s}" for s in runs.SEEDS]


def main(argv=None) -> dict:
    args = runs.parse_args(__doc__, argv)
    if not args.plot_only:
        runs.ensure(names(), args.root, args.jobs)
    fig, (ax_reward, ax_format) = runs.new_figure(2)
    results, claims = {}, []
    for ax, key, title in ((ax_reward, CLAIM_KEY, "main agent reward"),
                           (ax_format, "main/format_ok", "format-valid rollouts")):
        steps, values = runs.series(names(), key)
        runs.band(ax, steps, values, f"stage 1 ({len(values)} seeds, mean ± std)", ema=0.8)
        results[key] = runs.summary(steps, values)
        runs.shade_window(ax, results[key]["first_window_steps"], "first window", alpha=0.04)
        runs.shade_window(ax, results[key]["last_window_steps"], "last window")
        if key == CLAIM_KEY:
            claims.append(runs.rise_claim("stage-1 reward rises (last vs first window)", "mgrpo", steps, values, key))
        ax.set(xlabel="RL step", ylabel=key, title=f"Stage 1: {title}")
        ax.legend(fontsize=8)
    results["claims"] = claims
    runs.save_png(fig, FIGURE)
    runs.save_results(FIGURE, results, {"mgrpo": names()})
    return results


if __name__ == "__main__":
    main()
