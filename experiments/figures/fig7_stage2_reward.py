"""Fig. 7: stage-2 training reward, `mgrpo` vs `frozen_sub` vs `single_agent`, raw and EMA-smoothed.

    python -m experiments.figures.fig7_stage2_reward [--root runs/figures] [--seeds 5] [--plot-only]

The reward is the top agent's (the main agent, or the single agent of the baseline): 0.1 * format + 0.9 *
correct, with the hard format gate. Mean over seeds, +-1 std band; thin lines raw, thick lines EMA 0.8. The
ordering mgrpo > frozen_sub > single_agent is tested as two claims on the reward over the last third of the
steps, bootstrap over seeds (`stats.py`), paired by seed: the modes of a seed share its world, warm start and
stage-1 checkpoint. The results also give, per mode, the share of stage-2 episodes that ended on the context
limit or the turn limit (main agent and sub-agent for the multi-agent modes), so a budget that binds one
architecture more than the other is visible.
"""

from __future__ import annotations

from experiments.figures import runs

MODES = ("mgrpo", "frozen_sub", "single_agent")
FIGURE = "fig7_stage2_reward"
ORDER = (("mgrpo", "frozen_sub"), ("frozen_sub", "single_agent"))  # the paper's ordering, pair by pair
LIMITS = ("context", "max_turns")


def limit_shares(mode: str) -> dict:
    """{"<agent>/end/<limit>": mean over seeds and steps}: how often each limit ended this mode's episodes."""
    agents = ("single",) if mode == "single_agent" else ("main", "sub")
    out = {}
    for agent in agents:
        for limit in LIMITS:
            key = f"{agent}/end/{limit}"
            per_seed = [[row[key] for row in runs.rl_rows(n) if key in row] for n in runs.stage2(mode)]
            if all(per_seed):
                out[key] = float(sum(map(sum, per_seed)) / sum(map(len, per_seed)))
    return out


def main(argv=None) -> dict:
    args = runs.parse_args(__doc__, argv)
    if not args.plot_only:
        runs.ensure([n for m in MODES for n in runs.stage2(m)], args.root, args.jobs)
    fig, (ax_reward, ax_correct) = runs.new_figure(2)
    results, curves = runs.compare_panels(
        (ax_reward, ax_correct), ("reward", "correct"),
        lambda key: {mode: (mode, runs.stage2(mode), f"{runs.top_name(mode)}/{key}") for mode in MODES})
    results["claims"] = [
        runs.window_claim(f"stage-2 reward: {a} > {b}",
                          *((m, *curves[f"{m}/reward"], f"{runs.top_name(m)}/reward") for m in (a, b)), paired=True)
        for a, b in ORDER]
    results["limit_shares"] = {mode: limit_shares(mode) for mode in MODES}
    ax_reward.set(xlabel="stage-2 step", ylabel="training reward", title="Stage 2: training reward")
    ax_correct.set(xlabel="stage-2 step", ylabel="fraction correct", title="Stage 2: correct rollouts")
    runs.save_png(fig, FIGURE)
    runs.save_results(FIGURE, results, {mode: runs.stage2(mode) for mode in MODES})
    return results


if __name__ == "__main__":
    main()
