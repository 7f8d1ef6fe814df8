"""Ablations beyond the paper (it has none): stage-2 `mgrpo` with one setting changed, against the default runs.

    python -m experiments.figures.ablations [--root runs/figures] [--seeds 5] [--d-low D] [--d-high D] [--plot-only]

Every ablation run starts from the same stage-1 checkpoint as `stage2_mgrpo_s*` and uses the same seeds, so the
only difference is the setting (`runs.ABLATIONS`):

- `ablation_align`: the trajectory alignment pads d_k < D with copies of the rollout's own sub-trajectories
  (`duplicate`, the paper's and the default) or with weight-0 slots (`mask`).
- `ablation_dmax`: D (`rollout.d_max`) below and above both the 99th percentile of d_k in the default stage-2 runs
  and the preset's D (low = max(1, min(p99, D) - 1), high = max(p99, D) + 2, fixed in `<root>/dmax.json` once
  those runs finish; `--d-low` / `--d-high` set them by hand), against the preset's D.
- `ablation_beta`: the sub-agent's reward without the expert term, beta = (0.1, 0.9, 0) instead of (0.1, 0.4,
  0.5). R_S is then a different function, so only the main agent's numbers compare like with like.

Each figure is mean +-1 std over seeds (EMA 0.8 thick); each comparison is the difference of the arms' means
over the last third of the steps with a bootstrap 95 % interval over seeds, paired by world (an ablation run and
its default run share the world, warm start and stage-1 checkpoint; `stats.py`), and the verdict says
which arm is higher, or "inconclusive" when the interval contains 0. Results go to results/ablation_*.json.
"""

from __future__ import annotations

import json
import os

from experiments.figures import runs

FIGURES = ("ablation_align", "ablation_dmax", "ablation_beta")


def dmax_labels() -> dict:
    """The D ablation's values, from the collected `logs/dmax.json` (written when its runs ran)."""
    path = os.path.join(runs.LOGS, runs.DMAX_FILE)
    if not os.path.exists(path):
        raise FileNotFoundError(f"{path}: the d_max ablation has no collected D values; run it without --plot-only")
    with open(path) as f:
        return json.load(f)


def spec(figure: str) -> dict:
    """{"arms": {label: run names}, "keys": [(metric, title)], "pairs": [(label a, label b, metric)], ...}."""
    default = runs.stage2("mgrpo")[: runs.N_ABLATION_SEEDS]  # the ablations' own seeds
    if figure == "ablation_align":
        return {"arms": {"duplicate": default, "mask": runs.ablation("align_mask")},
                "keys": [("main/reward", "main agent reward"), ("sub/reward", "sub-agent reward R_S")],
                "pairs": [("mask", "duplicate", "main/reward"), ("mask", "duplicate", "sub/reward")],
                "title": "Alignment of d_k < D: duplicate vs mask"}
    if figure == "ablation_dmax":
        chosen, preset = dmax_labels(), runs.preset_value("rollout.d_max")
        low, high = f"D = {chosen['low']} (low)", f"D = {chosen['high']} (high)"
        base = f"D = {preset} (preset)"
        pairs = [(arm, base, key) for key in ("main/reward", "sub/reward") for arm in (low, high)]
        return {"arms": {low: runs.ablation("dmax_low"), base: default, high: runs.ablation("dmax_high")},
                "keys": [("main/reward", "main agent reward"), ("sub/reward", "sub-agent reward R_S")],
                "pairs": pairs, "title": f"D around the 99th percentile of d_k (p99 = {chosen['p99']})",
                "extra": {"dmax": chosen, "preset_d_max": preset,
                          "coincides_with_preset": [k for k in ("low", "high") if chosen[k] == preset]}}
    if figure == "ablation_beta":
        beta = tuple(runs.preset_value("rewards.beta"))
        base, changed = f"β = {beta}", "β = (0.1, 0.9, 0) (no expert)"
        return {"arms": {base: default, changed: runs.ablation("beta_noexpert")},
                "keys": [("main/reward", "main agent reward"), ("main/correct", "main agent correct"),
                         ("sub/reward", "R_S (not comparable: a different function)")],
                "pairs": [(changed, base, "main/reward"), (changed, base, "main/correct")],
                "title": "Sub-agent reward without the expert term"}
    raise KeyError(f"unknown ablation figure {figure!r}; figures are {FIGURES}")


ARMS = {"ablation_align": ("align_mask",), "ablation_dmax": ("dmax_low", "dmax_high"),
        "ablation_beta": ("beta_noexpert",)}  # the ablation runs each figure compares with stage-2 mgrpo


def draw(figure: str) -> dict | None:
    """The figure and results from the collected logs; None (with a message) if a run has no log yet."""
    missing = [n for n in runs.stage2("mgrpo") + [n for a in ARMS[figure] for n in runs.ablation(a)]
               if not runs.has_log(n)]
    if missing:
        print(f"[figures] {figure}: skipped, no collected log yet for {', '.join(missing)}", flush=True)
        return None
    s = spec(figure)
    fig, axes = runs.new_figure(len(s["keys"]))
    keys = [key for key, _ in s["keys"]]
    results, curves = runs.compare_panels(
        axes, keys, lambda key: {label: (label, names, key) for label, names in s["arms"].items()})
    for ax, (key, title) in zip(axes, s["keys"], strict=True):
        ax.set(xlabel="stage-2 step", ylabel=key, title=title)
    fig.suptitle(s["title"])
    results["comparisons"] = [
        runs.window_claim(f"{key}: {a} vs {b}", (a, *curves[f"{a}/{key}"], key), (b, *curves[f"{b}/{key}"], key),
                          claimed=False, paired=True)
        for a, b, key in s["pairs"]]
    results.update(s.get("extra", {}))
    runs.save_png(fig, figure)
    runs.save_results(figure, results, s["arms"])
    return results


def main(argv=None) -> dict:
    args = runs.parse_args(__doc__, argv)
    if not args.plot_only:
        runs.ensure(runs.stage2("mgrpo") + [n for a in runs.ABLATIONS for n in runs.ablation(a)], args.root,
                    args.jobs)
    return {figure: draw(figure) for figure in FIGURES}


if __name__ == "__main__":
    main()
