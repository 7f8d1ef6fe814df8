"""The README's results tables, rendered from experiments/figures/results/*.json (paste them as they come).

    python -m experiments.figures.table          # or: python -m experiments.figures.run_all --table

One row per claimed ordering of the paper (Figs. 5-8) with the numbers here, mean ± std over seeds of each
seed's mean over the last window, the difference of means with its bootstrap 95 % interval over seeds, the 95 %
t-interval with its degrees of freedom, the exact permutation p-value (one-sided in the claimed direction), the
minimum detectable difference (80 % power), the number of seeds and the verdict under the pre-stated rule
(`stats.VERDICT_RULE`, printed under the table); then one row per ablation comparison, whose verdict says which
arm is higher (two-sided p); then the shared-policy comparison (experiments/figures/shared_policy.py): each pair on
training correctness and on final held-out accuracy (a claimed ordering in bold, otherwise which is higher), with
what differs between its systems, and each system's parameters. A p-value from seeded random permutations rather
than all of them is marked "MC".
"""

from __future__ import annotations

import argparse
import json
import os

from experiments.figures import runs, stats

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


def _t_interval(entry: dict) -> str:
    """The 95 % t-interval and its degrees of freedom (integers for paired t, one decimal for Welch's)."""
    if "t_interval" not in entry or any(x != x for x in entry["t_interval"]):
        return "–"
    lo, hi = entry["t_interval"]
    dof = entry["t_dof"]
    digits = 0 if dof == int(dof) else 1
    return f"[{_signed(lo)}, {_signed(hi)}] ({dof:.{digits}f} dof)"


def _p(entry: dict) -> str:
    """The permutation p-value; "MC" when it came from seeded random permutations, not all of them."""
    if "p_value" not in entry:
        return "–"
    p = entry["p_value"]
    text = f"{p:.3f}" if p >= 0.001 else f"{p:.1e}"
    return text if entry["p_method"].startswith("exact") else f"{text} MC"


def row(link: str, entry: dict, bold: bool = True, extra: tuple = ()) -> str:
    verdict = f"**{entry['verdict']}**" if bold else entry["verdict"]
    cells = [link, entry["claim"], *extra, _here(entry), _interval(entry), _t_interval(entry), _p(entry),
             _mdd(entry), str(entry["n_seeds"]), verdict]
    return "| " + " | ".join(cells) + " |"


MDD_HEADER = "minimum detectable difference"
STATS_HEADER = f"difference [bootstrap 95 % CI] | 95 % t-interval (dof) | {{p}} | {MDD_HEADER} | seeds"
RULE_LINE = (f"Verdict rule, fixed before the eight-world runs (`experiments/figures/stats.py`): {stats.VERDICT_RULE}; "
             "an ablation or comparison names the higher arm under the same two parts. With 5 seeds the smallest "
             "one-sided sign-flip p is 1/32 = 0.031 > 0.025, so no 5-world claim can be reproduced; 8 seeds reach "
             "1/256 = 0.004.")


def header(first: str, claim: str, here: str, p: str, last: str) -> list[str]:
    head = f"| {first} | {claim} | {here} | {STATS_HEADER.format(p=p)} | {last} |"
    return [head, "|" + "---|" * (head.count("|") - 1)]


def render(results_dir: str | None = None) -> str:
    """The claims table and the ablations table (markdown); figures without results are listed as missing."""
    here = "here: mean ± std over seeds of each seed's last-window mean"
    lines = header("figure", "paper's claim", here, "exact permutation p (one-sided)", "verdict")
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
    lines += ["", RULE_LINE]
    dk = load("dk_histogram", results_dir)
    if dk is not None:
        lines += ["", f"d_k ([histogram](experiments/figures/dk_histogram.png)): 99th percentile {dk['p99']} over "
                  f"{dk.get('n_seeds', '?')} seeds of stage-2 `mgrpo` (counts by d_k: {dk['counts']}, last bin "
                  f"open-ended), mean {dk['mean']:.2f}."]
    lines += ["", *header("ablation", "comparison", here, "exact permutation p (two-sided)", "higher")]
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
    lines = header("comparison", "pair | what differs", "here: mean ± std over seeds (training: each seed's "
                   "last-window mean; held-out: final evaluation)", "exact permutation p (claims one-sided, "
                   "comparisons two-sided)", "verdict")
    lines += [row(link, entry, bold=True, extra=(entry.get("differs", "–"),)) for entry in results.get("claims", [])]
    lines += [row(link, entry, bold=False, extra=(entry.get("differs", "–"),))
              for entry in results.get("comparisons", [])]
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
        if results.get("pending_pairs"):
            lines[-1] += " Pairs waiting for them: " + "; ".join(results["pending_pairs"]) + "."
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
