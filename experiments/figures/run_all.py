"""Every figure of the paper in miniature, and the ablations, in one command (resumable).

    python -m experiments.figures.run_all [--root runs/figures] [--jobs 2] [--seeds 5] [--stage2-steps N]
                                          [--d-low D] [--d-high D]
    python -m experiments.figures.run_all --plot-only   # redraw from experiments/figures/logs, no training
    python -m experiments.figures.run_all --table       # print the README's results tables from results/*.json
    python -m experiments.figures.run_all --status      # what is collected, running and left, and about how long
    python -m experiments.figures.run_all --worlds 2,3  # train those worlds' runs only (one machine's share)

Runs the positive control first: the first seed's warm start and stage 1, checked by `positive_control.gate`
(format kept, rewards that vary within groups, updates that move the policy); a failed control stops here, before
hours go into runs that cannot show anything. Then trains every run the figures need
(experiments/figures/runs.py; `--seeds` seeds per curve), `--jobs` at a time, then draws Figs. 5-8, the d_k
histogram, the three ablations and the shared-policy comparison (skipped, with a message naming them, while its
runs have no collected logs), writes results/*.json (each claimed ordering
with its last-window difference, bootstrap 95 % interval over seeds and verdict, `stats.py`), and writes the
case studies. Interrupt it at any point and start it again: finished runs are kept, unfinished ones resume
from their last checkpoint.

`--worlds` splits the set across machines or sessions: each world's runs start from its own warm start and need
only the collected logs of other worlds (the d_max ablation's D), so a share of whole worlds trains on its own;
commit its logs (experiments/figures/logs) and draw with `--plot-only` once every world is collected. The
positive control then runs on the share's first world.
"""

from __future__ import annotations

import argparse
import time

from experiments.figures import (
    ablations,
    case_studies,
    dk_histogram,
    fig5_stage1_reward,
    fig6_accuracy,
    fig7_stage2_reward,
    fig8_sync,
    positive_control,
    runs,
    shared_policy,
    table,
)
from mgrpo_jax.config import get_config
from mgrpo_jax.runtime.metrics import read_jsonl

FIGURES = (fig5_stage1_reward, fig6_accuracy, fig7_stage2_reward, fig8_sync, dk_histogram, ablations,
           shared_policy)


def control(root: str, jobs: int, world: int | None = None) -> None:
    """The positive control on `world`'s warm start and stage 1 (default the first seed's; trained here if
    missing); raises on a failure."""
    world = runs.SEEDS[0] if world is None else world
    warm, stage1 = f"warm_mgrpo_s{world}", f"stage1_mgrpo_s{world}"
    runs.ensure([stage1], root, jobs)
    target = get_config("xbench", "figures").warmstart.format_target
    problems = positive_control.gate(read_jsonl(runs.metrics_log(root, warm)),
                                     read_jsonl(runs.metrics_log(root, stage1)), target)
    if problems:
        raise SystemExit("positive control failed; fix the setup before the long runs:\n  " + "\n  ".join(problems))
    print(f"[figures] positive control passed ({warm}, {stage1})", flush=True)


def status(root: str, jobs: int) -> str:
    """The set's progress under `root` by run kind, and the wall time left at `jobs` runs at a time, estimated from
    each kind's mean recorded wall time (kinds without a record are named, not guessed)."""
    kinds = runs.progress(root)
    total = {key: sum(row[key] for row in kinds.values()) for key in ("runs", "collected", "running", "to_train")}
    lines = [f"design {runs.DESIGN} under {root}: {total['collected']} of {total['runs']} runs collected, "
             f"{total['running']} running, {total['to_train']} to train",
             f"{'kind':<24}{'runs':>6}{'collected':>11}{'running':>9}{'to train':>10}{'mean s':>9}"]
    for kind, row in kinds.items():
        mean = "-" if row["mean_s"] is None else f"{row['mean_s']:.0f}"
        lines.append(f"{kind:<24}{row['runs']:>6}{row['collected']:>11}{row['running']:>9}{row['to_train']:>10}"
                     f"{mean:>9}")
    unknown = [kind for kind, row in kinds.items() if row["to_train"] and row["mean_s"] is None]
    left_s = sum(row["to_train"] * row["mean_s"] for row in kinds.values() if row["to_train"] and row["mean_s"])
    lines.append(f"about {left_s / 3600 / max(jobs, 1):.1f} h of training left at --jobs {jobs}"
                 + (f", besides {unknown} (no recorded wall time)" if unknown else ""))
    return "\n".join(lines) + "\n"


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--table", action="store_true", help="print the README tables from results/*.json only")
    parser.add_argument("--status", action="store_true", help="print where the set stands under --root; train nothing")
    parser.add_argument("--worlds", type=_worlds, default=None,
                        help="comma-separated worlds: train only their runs, draw nothing (default: every world)")
    args = runs.parse_args(__doc__, argv, parser)
    unknown = sorted(set(args.worlds or ()) - set(runs.SEEDS))
    if unknown:
        parser.error(f"--worlds {unknown} are not among the set's worlds {list(runs.SEEDS)} "
                     f"(--seeds {len(runs.SEEDS)})")
    if args.table:
        table.main([])
        return
    if args.status:
        print(status(args.root, args.jobs), end="")
        return
    start = time.monotonic()
    if args.worlds and not args.plot_only:
        control(args.root, args.jobs, args.worlds[0])
        runs.ensure([n for n, run in runs.RUNS.items() if run.world in args.worlds], args.root, args.jobs)
        print(f"[figures] worlds {args.worlds} trained in {(time.monotonic() - start) / 60:.1f} min; the figures "
              "are drawn with --plot-only once every world is collected", flush=True)
        print(status(args.root, args.jobs), end="")
        return
    if not args.plot_only:
        control(args.root, args.jobs)
        runs.ensure(list(runs.RUNS), args.root, args.jobs)
        print(f"[figures] all {len(runs.RUNS)} runs finished in {(time.monotonic() - start) / 60:.1f} min", flush=True)
        for kind, t in runs.wall_times(runs.RUNS).items():  # the set's cost, per run kind (collected records)
            print(f"[figures] wall time {kind}: {t['runs']} runs, mean {t['mean_s']:.0f} s, total "
                  f"{t['total_s'] / 60:.1f} min", flush=True)
    flags = ["--root", args.root, "--plot-only", "--seeds", str(len(runs.SEEDS))]
    for figure in FIGURES:
        figure.main(flags)
    if not args.plot_only:
        case_studies.main(["--root", args.root])
    print(table.render(), end="")


def _worlds(text: str) -> list[int]:
    try:
        worlds = sorted({int(w) for w in text.split(",")})
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated world numbers such as 2,3, got {text!r}") from None
    return worlds


if __name__ == "__main__":
    main()
