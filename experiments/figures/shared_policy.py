"""Beyond the paper (issue 29): two distinct agents (M-GRPO) against one shared model serving both roles.

    python -m experiments.figures.shared_policy [--root runs/figures] [--seeds 8] [--plot-only]

Six systems after stage 2, each from a stage-1 checkpoint of the same seed's world (experiments/figures/runs.py),
the first four a 2 x 2 of model count and credit:

                      M-GRPO's credit    MATPO's credit
    two agents        `mgrpo`            `distinct_matpo`
    one shared model  `shared_mgrpo`     `matpo`

`mgrpo` is two compact agents; `distinct_matpo` the same two agents from the same stage-1 checkpoint trained with
MATPO's credit (`--config.credit=matpo`; arXiv 2510.04678: planner reward 0.9 correct + 0.1 format, each worker
call gets its parent's advantage); `shared_mgrpo` one compact model for both roles with M-GRPO's hierarchical
credit, and `matpo` that model with MATPO's credit from the same stage-1 checkpoint. Beside them `shared2x`
(`shared_mgrpo` with one model of about the two agents' summed parameters, `runs.SHARED2X_OVERRIDES`) and
`single_agent` (one agent doing both roles' work in one context, Fig. 7's baseline). What differs between the two
systems of each pair is stated in `DIFFERS` and recorded in each entry (`differs`); every stage-2 run of a world
trains on that world's one question pool. A pair that differs in model count also differs in the warm start and
stage 1 that trained those models (each model count has its own lineage): that is part of having other models.

The credits reward differently (MATPO's reward is 0.9 correct + 0.1 format, M-GRPO's R_M is not), so `main/reward`
is not compared: the systems are compared on the training episodes' correctness (`main/correct`, the single
agent's `single/correct`) and on held-out accuracy.

Left: training correctness over stage-2 steps, mean over seeds with a +-1 std band (EMA 0.8 thick). Right: final
held-out accuracy, the mean of the GAIA-, XBench- and WebWalker-style sets (avg@3) at each run's last evaluation
(the single agent's stage-2 run skips evaluations: `eval_single_agent_s{s}` evaluates its final checkpoint), mean
over seeds with +-1 std and each seed as a dot. Each pair below is compared on both metrics: each seed's mean over
the last window of the training curve (the last third of the steps, as every figure), or its final held-out
accuracy, paired by world: the difference of means with its bootstrap 95 % interval, the exact sign-flip p-value,
the paired t-interval and the verdict under the pre-stated rule (`stats.py`). MATPO's claim (matpo > single_agent)
and the paper's (mgrpo > single_agent) get a verdict on the claimed ordering ("claims"); the questions without a
claimed direction get which is higher ("comparisons"). Each entry records, beside `differs`, the loss settings its
arms' logs show (`loss_in_logs`: clip ranges, KL coefficient, and token- or row-mean aggregation read off the
logged loss denominator); where those differ, `differs` says so, since such logs predate the one loss
configuration. The results give each system's parameter count (all its learners, from `logs/<run>.params.json`).
A system with a run not yet collected is left out, named under "pending" with its missing runs, and so are the
pairs it is in (`pending_pairs`); with fewer than two systems ready the figure is skipped with a message naming
the missing runs.
"""

from __future__ import annotations

import re

import numpy as np

from experiments.figures import runs, stats

FIGURE = "shared_policy"
SYSTEMS = ("mgrpo", "shared_mgrpo", "matpo", "distinct_matpo", "shared2x", "single_agent")
HELDOUT_SETS = ("eval_gaia", "eval_xbench", "eval_webwalker")
# (A, B, what the pair asks, claimed): a claimed ordering A > B gets a verdict on it, the others which is higher.
PAIRS = (("mgrpo", "shared_mgrpo", "distinct vs shared models, M-GRPO credit", False),
         ("shared_mgrpo", "matpo", "credit on one shared model", False),
         ("mgrpo", "distinct_matpo", "credit on distinct models", False),
         ("distinct_matpo", "matpo", "distinct vs shared models, MATPO credit", False),
         ("mgrpo", "shared2x", "two models vs one model of their summed parameters", False),
         ("matpo", "single_agent", "MATPO's claim", True),
         ("mgrpo", "single_agent", "M-GRPO's claim", True))
# What differs between the two systems of each pair, among credit, model count / parameters, loss configuration
# and role weighting, as runs.py trains them (whoever changes those runs keeps this true): every cell of the 2 x 2
# and shared2x train with one loss configuration (`runs.LOSS_2X2`: the `grpo` defaults, clipped PPO 0.2 / 0.28,
# per-row mean, no KL), and a shared model weights its two roles' losses equally (per-role normalisation), so
# nothing else differs. The single agent's pairs are the papers' claims: they compare architectures.
DIFFERS = {
    ("mgrpo", "shared_mgrpo"): "model count (2 vs 1; parameters 338,304 vs 169,152 at vocab 589)",
    ("shared_mgrpo", "matpo"): "credit",
    ("mgrpo", "distinct_matpo"): "credit",
    ("distinct_matpo", "matpo"): "model count",
    ("mgrpo", "shared2x"): "model count (parameters ~matched)",
    ("matpo", "single_agent"): "architecture (one model delegating to itself in separate contexts vs one agent in "
                               "one context) and credit (MATPO's vs the single agent's GRPO)",
    ("mgrpo", "single_agent"): "architecture (two agents vs one agent in one context; parameters 338,304 vs "
                               "169,152) and credit (M-GRPO's vs the single agent's GRPO)",
}
LOSS_SETTINGS = ("eps_low", "eps_high", "kl_coef")  # logged per learner as `<learner>/loss/<setting>`
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


def logged_loss(system: str) -> dict:
    """The loss settings the system's training logs show, over its runs and learners: {setting: sorted distinct
    values} for `LOSS_SETTINGS`, and "aggregation": "token-mean" where every logged loss denominator equals the
    step's token count, else "row-mean". Empty when the logs record none."""
    found: dict[str, set] = {}
    for name in train_runs(system):
        rows = runs.rl_rows(name)
        for key in {k for row in rows for k in row if "/loss/" in k and k.rsplit("/", 1)[1] in LOSS_SETTINGS}:
            found.setdefault(key.rsplit("/", 1)[1], set()).update(row[key] for row in rows if key in row)
        for key in {k for row in rows for k in row if k.endswith("/train/loss_denominator")}:
            tokens = key.replace("loss_denominator", "tokens")
            token_mean = all(row[key] == row.get(tokens) for row in rows if key in row)
            found.setdefault("aggregation", set()).add("token-mean" if token_mean else "row-mean")
    return {setting: sorted(values) for setting, values in sorted(found.items())}


def differs(a: str, b: str, losses: dict) -> str:
    """What differs between systems a and b (`DIFFERS`), and the loss configuration too where their logs show it."""
    text = DIFFERS[(a, b)]
    if losses[a] != losses[b]:
        text += "; in these logs also the loss configuration (`loss_in_logs`)"
    return text


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
    results["claims"], results["comparisons"], results["pending_pairs"] = [], [], []
    losses = {system: logged_loss(system) for system in ready}
    for a, b, question, claimed in PAIRS:
        if a in waiting or b in waiting:
            results["pending_pairs"].append(claim_text("", a, b, question, claimed).lstrip(": "))
            continue
        out = results["claims"] if claimed else results["comparisons"]
        train = [(label, *curves[label], correct_key(label)) for label in (a, b)]
        pair = {"differs": differs(a, b, losses), "loss_in_logs": {a: losses[a], b: losses[b]}}
        out.append({**runs.window_claim(claim_text("training correct", a, b, question, claimed), *train,
                                        claimed=claimed, paired=True), **pair})
        out.append({**heldout_claim(claim_text("held-out accuracy", a, b, question, claimed), a, b, final,
                                    claimed), **pair})
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
