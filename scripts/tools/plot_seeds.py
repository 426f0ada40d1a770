"""Plot one metric per step for groups of seeds (A/B evidence): a thin line per run and a thick line for
the group's mean over the steps every run logged.

    python -m scripts.tools.plot_seeds --metric val/acc --title "16K retrieval" --out acc.png \\
        dense=runs/d_s0,runs/d_s1 sparse=runs/s_s0,runs/s_s1

Each run is anything ``plot_metrics.load_run`` reads (a run directory, ``metrics.csv`` or W&B file).
Several ``--metric`` values give one panel each.
"""

from __future__ import annotations

import argparse
import statistics
from pathlib import Path

from scripts.tools.plot_metrics import load_run


def parse_group(text: str) -> tuple[str, list[Path]]:
    label, _, runs = text.partition("=")
    if not runs:
        raise argparse.ArgumentTypeError(f"expected LABEL=RUN[,RUN...], got {text!r}")
    return label, [Path(p) for p in runs.split(",")]


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("groups", nargs="+", type=parse_group, help="LABEL=RUN[,RUN...]")
    ap.add_argument("--metric", action="append", required=True)
    ap.add_argument("--title", default="")
    ap.add_argument("--out", required=True)
    ap.add_argument("--max-step", type=float, default=None, help="leave out points after this step")
    args = ap.parse_args(argv)

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(args.metric), figsize=(6 * len(args.metric), 4), squeeze=False)
    for ax, metric in zip(axes[0], args.metric):
        for color, (label, runs) in zip(plt.rcParams["axes.prop_cycle"].by_key()["color"], args.groups):
            series = [
                {
                    step: value
                    for step, value in load_run(run).get(metric, [])
                    if args.max_step is None or step <= args.max_step
                }
                for run in runs
            ]
            for s in series:
                steps = sorted(s)
                ax.plot(steps, [s[t] for t in steps], color=color, alpha=0.3, linewidth=1)
            common = sorted(set.intersection(*(set(s) for s in series))) if series else []
            means = [statistics.fmean(s[t] for s in series) for t in common]
            final = f" (final mean {means[-1]:.3f})" if means else ""
            ax.plot(common, means, color=color, linewidth=2.5, label=f"{label}, {len(runs)} runs{final}")
        ax.set_xlabel("step")
        ax.set_ylabel(metric)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle(args.title)
    fig.tight_layout()
    fig.savefig(args.out, dpi=110)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
