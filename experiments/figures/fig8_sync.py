"""Fig. 8: synchronised `mgrpo` vs `mgrpo_unsync` (the sub-agent trains from a FIFO, grouped regardless of query).

    python -m experiments.figures.fig8_sync [--root runs/figures] [--seeds 5] [--plot-only]

Left: the main agent's training reward; right: the sub-agent's reward R_S (which the two modes train on
differently). Mean over seeds, +-1 std band, EMA 0.8 thick. The claim synchronised > unsynchronised is tested
on the main agent's reward over the last third of the steps, bootstrap over seeds paired by world (`stats.py`);
R_S gets the same numbers as a secondary comparison. The two modes do equal work (`rollout.unsync_pop = "step"`
in the `figures` preset): one sub-agent update per RL step on as many real sub-trajectories as the synchronised
mode trains on; the unsynchronised one trains on the previous step's, grouped by arrival. The results record
both modes' updates and trajectories per step.
"""

from __future__ import annotations

from experiments.figures import runs

MODES = ("mgrpo", "mgrpo_unsync")
FIGURE = "fig8_sync"
LABELS = {"mgrpo": "synchronised", "mgrpo_unsync": "unsynchronised"}


def work_per_step(mode: str) -> dict:
    """The sub-agent's training per RL step, mean over seeds and steps: updates (train-step calls) and real
    sub-trajectories trained on (FIFO pops; the synchronised mode's real calls)."""
    rows = [row for name in runs.stage2(mode) for row in runs.rl_rows(name) if "sub/episodes" in row]
    if mode == "mgrpo_unsync":
        updates = [row.get("sub/unsync_chunks", 0.0) for row in rows]
        trajectories = [row.get("sub/fifo_popped", 0.0) for row in rows]
    else:
        updates = [1.0 for _ in rows]
        trajectories = [row["sub/episodes"] for row in rows]  # every real call (those beyond D are dropped)
    return {"updates": float(sum(updates) / len(rows)), "trajectories": float(sum(trajectories) / len(rows))}


def main(argv=None) -> dict:
    args = runs.parse_args(__doc__, argv)
    if not args.plot_only:
        runs.ensure([n for m in MODES for n in runs.stage2(m)], args.root, args.jobs)
    fig, axes = runs.new_figure(2)
    keys = ("main/reward", "sub/reward")
    results, curves = runs.compare_panels(
        axes, keys, lambda key: {mode: (LABELS[mode], runs.stage2(mode), key) for mode in MODES})
    arms = {key: [(LABELS[m], *curves[f"{m}/{key}"], key) for m in MODES] for key in keys}
    results["claims"] = [runs.window_claim("main reward: synchronised > unsynchronised", *arms["main/reward"],
                                           paired=True)]
    results["comparisons"] = [runs.window_claim("sub-agent reward R_S: synchronised vs unsynchronised",
                                                *arms["sub/reward"], claimed=False, paired=True)]
    results["work_per_step"] = {LABELS[m]: work_per_step(m) for m in MODES}
    for ax, key in zip(axes, keys, strict=True):
        ax.set(xlabel="stage-2 step", ylabel=key, title=f"Stage 2: {key}")
    runs.save_png(fig, FIGURE)
    runs.save_results(FIGURE, results, {LABELS[m]: runs.stage2(m) for m in MODES})
    return results


if __name__ == "__main__":
    main()
