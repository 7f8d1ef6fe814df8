"""Beyond the paper (issue 29): two distinct agents (M-GRPO) against one shared model serving both roles.

    python -m experiments.figures.shared_policy [--root runs/figures] [--seeds 5] [--plot-only]

Five systems after stage 2, each from its own stage-1 checkpoint of the same seed's world (experiments/figures/
runs.py): `mgrpo` (two compact agents), `shared_mgrpo` (one compact model for both roles, M-GRPO's hierarchical
credit), `matpo` (that model with MATPO's credit, arXiv 2510.04678: planner reward 0.9 correct + 0.1 format, each
worker call gets its parent's advantage; it starts from the same stage-1 checkpoint as `shared_mgrpo`), `shared2x`
(`shared_mgrpo` with one model of about the two agents' summed parameters, `runs.SHARED2X_OVERRIDES`) and
`single_agent` (one agent doing both roles' work in one context, Fig. 7's baseline).

The credits reward differently (MATPO's reward is 0.9 correct + 0.1 format, M-GRPO's R_M is not), so `main/reward`
is not compared: the systems are compared on the training episodes' correctness (`main/correct`, the single
agent's `single/correct`) and on held-out accuracy.

Left: training correctness over stage-2 steps, mean over seeds with a +-1 std band (EMA 0.8 thick). Right: final
held-out accuracy, the mean of the GAIA-, XBench- and WebWalker-style sets (avg@3) at each run's last evaluation
(the single agent's stage-2 run skips evaluations: `eval_single_agent_s{s}` evaluates its final checkpoint), mean
over seeds with +-1 std and each seed as a dot. Each pair below is compared on both metrics: each seed's mean over
the last window of the training curve (the last third of the steps, as every figure), or its final held-out
accuracy; the difference of means with a bootstrap 95 % interval over seeds, paired by world (`stats.py`).
MATPO's claim (matpo > single_agent) and the paper's (mgrpo > single_agent) get a verdict on the claimed ordering
("claims"); the three questions without a claimed direction get which is higher ("comparisons"). The results give
each system's parameter count (all its learners, from `logs/<run>.params.json`). A system with a run not yet
collected is left out, named under "pending" with its missing runs, and so are the pairs it is in; with fewer than
two systems ready the figure is skipped with a message naming the missing runs.
"""

from __future__ import annotations

import re

import numpy as np

from experiments.figures import runs, stats

FIGURE = "shared_policy"
SYSTEMS = ("mgrpo", "shared_mgrpo", "matpo", "shared2x", "single_agent")
HELDOUT_SETS = ("eval_gaia", "eval_xbench", "eval_webwalker")
# (A, B, what the pair asks, claimed): a claimed ordering A > B gets a verdict on it, the others which is higher.
PAIRS = (("mgrpo", "shared_mgrpo", "distinct vs shared models, M-GRPO credit", False),
         ("shared_mgrpo", "matpo", "credit on one shared model", False),
         ("mgrpo", "shared2x", "two models vs one model of their summed parameters", False),
         ("matpo", "single_agent", "MATPO's claim", True),
         ("mgrpo", "single_agent", "M-GRPO's claim", True))
HELDOUT_METRIC = "mean of eval/{eval_gaia,eval_xbench,eval_webwalker}/accuracy at the last evaluation"


def train_runs(system: str) -> list[str]:
    """The system's stage-2 training runs, one per seed."""
    return runs.stage2(system)


def eval_runs(system: str) -> list[str]:
    """The runs whose evaluations give the system's final held-out accuracy."""
    return [f"eval_single_agent_s{s}" for s in runs.SEEDS] if system == "single_agent" else runs.stage2(system)


def correct_key(system: str) -> str:
    return f"{runs.top_name(system)}/correct"


def needed(systems=SYSTEMS) -> list[str]:
    return list(dict.fromkeys(n for system in systems for n in train_runs(system) + eval_runs(system)))


def pending() -> dict[str, list[str]]:
    """{system: its runs without a collected log} for the systems not ready to draw."""
    missing = {system: [n for n in needed((system,)) if not runs.has_log(n)] for system in SYSTEMS}
    return {system: names for system, names in missing.items() if names}


def brief(names) -> str:
    """Run names with their seeds folded: `stage2_matpo_s{0,1,2}`."""
    seeds: dict[str, list[str]] = {}
    for name in names:
        match = re.fullmatch(r"(.*_s)(\d+)", name)
        stem, seed = match.groups() if match else (name, "")
        seeds.setdefault(stem, []).append(seed)
    return ", ".join(f"{stem}{seed[0]}" if len(seed) == 1 else f"{stem}{{{','.join(seed)}}}"
                     for stem, seed in seeds.items())


def final_heldout(name: str) -> tuple[float, int]:
    """(mean accuracy over the held-out sets, step) at the run's last evaluation that logged all of them."""
    keys = [f"eval/{split}/accuracy" for split in HELDOUT_SETS]
    rows = [row for row in runs.rl_rows(name) if all(k in row for k in keys)]
    if not rows:
        raise ValueError(f"run {name} logged no evaluation of {', '.join(HELDOUT_SETS)}")
    row = max(rows, key=lambda r: r["step"])
    return float(np.mean([row[k] for k in keys])), int(row["step"])


def heldout(system: str) -> tuple[np.ndarray, list[int]]:
    """Per seed, the final held-out accuracy and the stage-2 step of the system it measured (the single agent's
    evaluation run measures its stage-2 run's final checkpoint: that run's last step)."""
    values, steps = [], []
    for name, trained in zip(eval_runs(system), train_runs(system), strict=True):
        value, step = final_heldout(name)
        if name != trained:
            step = max(row["step"] for row in runs.rl_rows(trained))
        values.append(value)
        steps.append(step)
    return np.asarray(values, np.float64), steps


def param_count(system: str) -> dict:
    """The system's parameters, all learners together, from its training runs' `params.json` (None if missing):
    {"total": per-seed total (the mean when the seeds' worlds differ), "per_seed", "learners" (the first seed's),
    "varies_over_seeds", "missing" (runs without a params file)}."""
    found = {name: runs.params(name) for name in train_runs(system)}
    totals = [sum(counts.values()) if counts else None for counts in found.values()]
    known = [t for t in totals if t is not None]
    first = next((counts for counts in found.values() if counts), None)
    return {"total": int(round(np.mean(known))) if known else None, "per_seed": totals, "learners": first,
            "varies_over_seeds": len(set(known)) > 1, "missing": [n for n, c in found.items() if not c]}


def heldout_claim(text: str, a: str, b: str, values: dict, claimed: bool) -> dict:
    (per_a, steps_a), (per_b, steps_b) = values[a], values[b]
    steps = steps_a + steps_b
    result = stats.compare(per_a, per_b, (a, b), paired=True, claimed=claimed)
    return {"claim": text, "metric": {a: HELDOUT_METRIC, b: HELDOUT_METRIC}, "window": 1,
            "window_steps": [min(steps), max(steps)], "evaluated_at_step": {a: steps_a, b: steps_b}, **result}


def claim_text(metric: str, a: str, b: str, question: str, claimed: bool) -> str:
    return f"{metric}: {a} {'>' if claimed else 'vs'} {b} ({question})"


def draw() -> dict | None:
    """The figure and results of the systems whose runs are all collected (the others named under "pending");
    None (with a message) while fewer than two systems are ready."""
    waiting = pending()
    ready = [system for system in SYSTEMS if system not in waiting]
    missing = brief([n for names in waiting.values() for n in names])
    if len(ready) < 2:
        print(f"[figures] {FIGURE}: skipped, no collected log yet for {missing}", flush=True)
        return None
    if waiting:
        print(f"[figures] {FIGURE}: drawn without {', '.join(waiting)} (no collected log yet for {missing})",
              flush=True)
    fig, (ax_train, ax_heldout) = runs.new_figure(2)
    summaries, curves = runs.compare(ax_train, {system: (train_runs(system), correct_key(system))
                                                for system in ready})
    ax_train.set(xlabel="stage-2 step", ylabel="fraction correct", title="Stage 2: correct training episodes")
    results: dict = {f"{system}/correct": summaries[system] for system in ready}
    results["identical/correct"] = summaries["identical"]
    results["pending"] = {system: brief(names) for system, names in waiting.items()}
    final = {system: heldout(system) for system in ready}
    systems = {}
    for system in ready:
        per_seed, at = stats.last_window(*curves[system])
        systems[system] = {"train_runs": train_runs(system), "eval_runs": eval_runs(system),
                           "params": param_count(system),
                           "train_correct": {"metric": correct_key(system), **at, **stats.arm(per_seed)},
                           "heldout_accuracy": {"metric": HELDOUT_METRIC, "evaluated_at_step": final[system][1],
                                                **stats.arm(final[system][0])}}
    results["systems"], results["system_order"] = systems, ready  # the JSON sorts the keys
    missing_params = [n for s in systems.values() for n in s["params"]["missing"]]
    if missing_params:
        print(f"[figures] {FIGURE}: no parameter count for {brief(missing_params)}", flush=True)
    totals = {system: systems[system]["params"]["total"] for system in ready}
    if totals.get("mgrpo") and totals.get("shared2x"):
        results["params_ratio_shared2x_to_mgrpo"] = totals["shared2x"] / totals["mgrpo"]
    results["claims"], results["comparisons"] = [], []
    for a, b, question, claimed in PAIRS:
        if a in waiting or b in waiting:
            continue
        out = results["claims"] if claimed else results["comparisons"]
        train = [(label, *curves[label], correct_key(label)) for label in (a, b)]
        out.append(runs.window_claim(claim_text("training correct", a, b, question, claimed), *train,
                                     claimed=claimed, paired=True))
        out.append(heldout_claim(claim_text("held-out accuracy", a, b, question, claimed), a, b, final, claimed))
    x = np.arange(len(ready))
    means = [systems[s]["heldout_accuracy"]["mean"] for s in ready]
    stds = [systems[s]["heldout_accuracy"]["std"] for s in ready]
    ax_heldout.bar(x, means, 0.6, yerr=stds, capsize=3, color=[f"C{SYSTEMS.index(s)}" for s in ready], alpha=0.8)
    for i, system in enumerate(ready):
        seeds = final[system][0]
        ax_heldout.scatter(np.full(len(seeds), i) + np.linspace(-0.15, 0.15, len(seeds)), seeds, s=10, color="k",
                           zorder=3)
    labels = [s if totals[s] is None else f"{s}\n{totals[s] / 1e3:.0f}k params" for s in ready]
    ax_heldout.set_xticks(x, labels, fontsize=8)
    ax_heldout.set(ylabel="accuracy (avg@3)", title="Final held-out accuracy (GAIA, XBench, WebWalker mean)")
    runs.save_png(fig, FIGURE)
    runs.save_results(FIGURE, results, {system: train_runs(system) for system in ready})
    return results


def main(argv=None) -> dict | None:
    args = runs.parse_args(__doc__, argv)
    if not args.plot_only:
        runs.ensure(needed(), args.root, args.jobs)
    return draw()


if __name__ == "__main__":
    main()
