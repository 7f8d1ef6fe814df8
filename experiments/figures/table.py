"""The README's results tables, rendered from experiments/figures/results/*.json (paste them as they come).

    python -m experiments.figures.table          # or: python -m experiments.figures.run_all --table

One row per claimed ordering of the paper (Figs. 5-8) with the numbers here, mean ± std over seeds of each
seed's mean over the last window, the difference of means with its bootstrap 95 % interval over seeds, the
minimum detectable difference (80 % power), the number of seeds and the verdict; then one row per ablation
comparison, whose verdict says which arm is higher; then the shared-policy comparison
(experiments/figures/shared_policy.py): each pair on training correctness and on final held-out accuracy (a
claimed ordering in bold, otherwise which is higher), and each system's parameters.
"""

from __future__ import annotations

import argparse
import json
import os

from experiments.figures import runs

CLAIM_FIGURES = (("fig5_stage1_reward", "Fig. 5"), ("fig6_accuracy", "Fig. 6"), ("fig7_stage2_reward", "Fig. 7"),
                 ("fig8_sync", "Fig. 8"))
ABLATION_FIGURES = (("ablation_align", "alignment"), ("ablation_dmax", "D"), ("ablation_beta", "β"))
SHARED_FIGURE = "shared_policy"


def load(figure: str, results_dir: str | None = None) -> dict | None:
    path = os.path.join(results_dir or os.path.join(runs.HERE, "results"), f"{figure}.json")
    if not os.path.exists(path):
        return None
    with open(path) as f:
        return json.load(f)


def _num(x: float) -> str:
    return f"{x:.3f}"


def _signed(x: float) -> str:
    return f"{x:+.3f}"


def _here(entry: dict) -> str:
    arms = "; ".join(f"`{label}` {_num(entry['arms'][label]['mean'])} ± {_num(entry['arms'][label]['std'])}"
                     for label in entry["order"])
    lo, hi = entry["window_steps"]
    where = f"steps {lo}–{hi}" if lo != hi else f"step {lo}"
    if "first_window_steps" in entry:
        flo, fhi = entry["first_window_steps"]
        where += f" vs {flo}–{fhi}" if flo != fhi else f" vs {flo}"
    return f"{arms} ({where})"


def _interval(entry: dict) -> str:
    lo, hi = entry["ci95"]
    return f"{_signed(entry['diff'])} [{_signed(lo)}, {_signed(hi)}]"


def _mdd(entry: dict) -> str:
    """The minimum detectable difference (stats.minimum_detectable_difference); results from before it: "–"."""
    mdd = entry.get("mdd")
    return "–" if mdd is None or mdd != mdd else _num(mdd)


def row(link: str, entry: dict, bold: bool = True) -> str:
    verdict = f"**{entry['verdict']}**" if bold else entry["verdict"]
    return (f"| {link} | {entry['claim']} | {_here(entry)} | {_interval(entry)} | {_mdd(entry)} | {entry['n_seeds']} "
            f"| {verdict} |")


MDD_HEADER = "minimum detectable difference"



def render(results_dir: str | None = None) -> str:
    """The claims table and the ablations table (markdown); figures without results are listed as missing."""
    lines = ["| figure | paper's claim | here: mean ± std over seeds of each seed's last-window mean | "
             f"difference [bootstrap 95 % CI] | {MDD_HEADER} | seeds | verdict |", "|---|---|---|---|---|---|---|"]
    missing = []

    def rows(figures, key: str, bold: bool) -> list[str]:
        out = []
        for figure, name in figures:
            results = load(figure, results_dir)
            if results is None or key not in results:
                missing.append(figure)
                continue
            out += [row(f"[{name}](experiments/figures/{figure}.png)", entry, bold=bold) for entry in results[key]]
        return out

    lines += rows(CLAIM_FIGURES, "claims", bold=True)
    dk = load("dk_histogram", results_dir)
    if dk is not None:
        lines += ["", f"d_k ([histogram](experiments/figures/dk_histogram.png)): 99th percentile {dk['p99']} over "
                  f"{dk.get('n_seeds', '?')} seeds of stage-2 `mgrpo` (counts by d_k: {dk['counts']}, last bin "
                  f"open-ended), mean {dk['mean']:.2f}."]
    lines += ["", "| ablation | comparison | here: mean ± std over seeds of each seed's last-window mean | "
              f"difference [bootstrap 95 % CI] | {MDD_HEADER} | seeds | higher |", "|---|---|---|---|---|---|---|"]
    lines += rows(ABLATION_FIGURES, "comparisons", bold=False)
    shared = load(SHARED_FIGURE, results_dir)
    if shared is None:
        missing.append(SHARED_FIGURE)
    else:
        lines += ["", *shared_policy_table(shared)]
    if missing:
        lines += ["", f"No results yet for: {', '.join(missing)}."]
    return "\n".join(lines) + "\n"


def _count(n: int | None) -> str:
    return "?" if n is None else f"{n:,}"


def shared_policy_table(results: dict) -> list[str]:
    """The shared-policy comparison: one row per pair and metric (claims in bold), then the parameter counts."""
    link = "[shared policy](experiments/figures/shared_policy.png)"
    lines = ["| comparison | pair | here: mean ± std over seeds (training: each seed's last-window mean; held-out: "
             f"final evaluation) | difference [bootstrap 95 % CI] | {MDD_HEADER} | seeds | verdict |",
             "|---|---|---|---|---|---|---|"]
    lines += [row(link, entry, bold=True) for entry in results.get("claims", [])]
    lines += [row(link, entry, bold=False) for entry in results.get("comparisons", [])]
    systems = results.get("systems", {})
    parts = []
    for name in results.get("system_order", sorted(systems)):
        params = systems[name]["params"]
        learners = params.get("learners") or {}
        inner = " + ".join(f"{learner} {_count(n)}" for learner, n in learners.items()) if len(learners) > 1 else ""
        approx = "~" if params.get("varies_over_seeds") else ""
        parts.append(f"`{name}` {approx}{_count(params['total'])}" + (f" ({inner})" if inner else ""))
    if parts:
        ratio = results.get("params_ratio_shared2x_to_mgrpo")
        lines += ["", "Parameters (all learners of a system): " + "; ".join(parts) + "."
                  + (f" `shared2x` / `mgrpo` = {ratio:.3f}." if ratio is not None else "")]
    waiting = results.get("pending") or {}
    if waiting:
        lines += ["", "Not yet in the comparison (no collected log yet): "
                  + "; ".join(f"`{system}` ({names})" for system, names in waiting.items()) + "."]
    return lines


def main(argv=None) -> str:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--results", default=None, help="the results folder (default experiments/figures/results)")
    args = parser.parse_args(argv)
    text = render(args.results)
    print(text, end="")
    return text


if __name__ == "__main__":
    main()
