"""Every figure of the paper in miniature, in one command (about 2 hours on a quiet 2-core CPU; resumable).

    python -m experiments.figures.run_all [--root runs/figures] [--jobs 2] [--plot-only]

Trains every run the figures need (experiments/figures/runs.py), two at a time by default, then draws Figs.
5-8, the d_k histogram and the longer-warm-start follow-up, and writes the case studies. Interrupt it at any
point and start it again: finished runs are kept, unfinished ones resume from their last checkpoint.
"""

from __future__ import annotations

import time

from experiments.figures import (
    case_studies,
    dk_histogram,
    fig5_stage1_reward,
    fig6_accuracy,
    fig7_stage2_reward,
    fig8_sync,
    runs,
)

FIGURES = (fig5_stage1_reward, fig6_accuracy, fig7_stage2_reward, fig8_sync, dk_histogram)


def main(argv=None) -> None:
    args = runs.parse_args(__doc__, argv)
    start = time.monotonic()
    if not args.plot_only:
        runs.ensure(list(runs.RUNS), args.root, args.jobs)
        print(f"[figures] all runs finished in {(time.monotonic() - start) / 60:.1f} min", flush=True)
    flags = ["--root", args.root, "--plot-only"]
    for figure in FIGURES:
        figure.main(flags)
    if not args.plot_only:
        case_studies.main(["--root", args.root])


if __name__ == "__main__":
    main()
