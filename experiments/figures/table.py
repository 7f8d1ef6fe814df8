"""The README's results tables, rendered from experiments/figures/results/*.json (paste them as they come).

    python -m experiments.figures.table          # or: python -m experiments.figures.run_all --table

One row per claimed ordering of the paper (Figs. 5-8) with the numbers here, mean ± std over seeds of each
seed's mean over the last window, the difference of means with its bootstrap 95 % interval over seeds, the
number of seeds and the verdict; then one row per ablation comparison, whose verdict says which arm is higher.
"""

from __future__ import annotations

import argparse
import json
import os

from experiments.figures import runs

CLAIM_FIGURES = (("fig5_stage1_reward", "Fig. 5"), ("fig6_accuracy", "Fig. 6"), ("fig7_stage2_reward", "Fig. 7"),
                 ("fig8_sync", "Fig. 8"))
ABLATION_FIGURES = (("ablation_align", "alignment"), ("ablation_dmax", "D"), ("ablation_beta", "β"))


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


def row(link: str, entry: dict, bold: bool = True) -> str:
    verdict = f"**{entry['verdict']}**" if bold else entry["verdict"]
    return f"| {link} | {entry['claim']} | {_here(entry)} | {_interval(entry)} | {entry['n_seeds']} | {verdict} |"


def render(results_dir: str | None = None) -> str:
    """The claims table and the ablations table (markdown); figures without results are listed as missing."""
    lines = ["| figure | paper's claim | here: mean ± std over seeds of each seed's last-window mean | "
             "difference [bootstrap 95 % CI] | seeds | verdict |", "|---|---|---|---|---|---|"]
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
              "difference [bootstrap 95 % CI] | seeds | higher |", "|---|---|---|---|---|---|"]
    lines += rows(ABLATION_FIGURES, "comparisons", bold=False)
    if missing:
        lines += ["", f"No results yet for: {', '.join(missing)}."]
    return "\n".join(lines) + "\n"


def main(argv=None) -> str:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--results", default=None, help="the results folder (default experiments/figures/results)")
    args = parser.parse_args(argv)
    text = render(args.results)
    print(text, end="")
    return text


if __name__ == "__main__":
    main()
