"""Render a training run's metrics to PNG plots: loss, accuracy, step-time split and attention density.

Inputs (one or more runs, overlaid for A/B comparisons such as sparse vs dense):
  * a Lightning CSVLogger ``metrics.csv`` (or a directory containing one, searched recursively), or
  * a W&B offline run directory (``wandb/offline-run-*``) or its ``run-*.wandb`` file; the history
    records are read straight from the file, without network or a W&B account.

    python -m scripts.tools.plot_metrics runs/retrieval runs/retrieval_dense --labels sparse dense --out plots/
"""

from __future__ import annotations

import argparse
import csv
import json
import math
import struct
from pathlib import Path

Series = dict[str, list[tuple[float, float]]]  # metric -> [(step, value)]


def read_csv_metrics(path: Path) -> Series:
    """All numeric columns of a CSVLogger file as ``metric -> [(step, value)]`` (empty cells skipped)."""
    out: Series = {}
    with path.open(newline="") as f:
        for row in csv.DictReader(f):
            step = row.get("step")
            if step in (None, ""):
                continue
            for key, value in row.items():
                if key in ("step", "epoch") or value in (None, ""):
                    continue
                try:
                    out.setdefault(key, []).append((float(step), float(value)))
                except ValueError:
                    continue
    return out


def _wandb_records(path: Path):
    """Yield the raw protobuf records of a ``.wandb`` file (LevelDB-log framing: 32 KiB blocks,
    7-byte header per chunk: crc32, length, type FULL=1/FIRST=2/MIDDLE=3/LAST=4, after a 7-byte
    file header ``:W&B`` + magic + version)."""
    data = path.read_bytes()
    if data[:4] != b":W&B":
        raise ValueError(f"{path} is not a W&B run file")
    block, pos, pending = 32768, 7, b""
    while pos + 7 <= len(data):
        left = block - pos % block
        if left < 7:  # block trailer padding
            pos += left
            continue
        _crc, length, kind = struct.unpack("<IHB", data[pos : pos + 7])
        chunk = data[pos + 7 : pos + 7 + length]
        pos += 7 + length
        if kind == 0 and length == 0:
            continue
        if kind == 1:
            yield chunk
        elif kind == 2:
            pending = chunk
        elif kind == 3:
            pending += chunk
        elif kind == 4:
            yield pending + chunk
            pending = b""


def read_wandb_metrics(path: Path) -> Series:
    """History of a W&B offline run file as ``metric -> [(step, value)]``."""
    from wandb.proto import wandb_internal_pb2 as pb  # installed with wandb; no network involved

    out: Series = {}
    for raw in _wandb_records(path):
        rec = pb.Record()
        rec.ParseFromString(raw)
        if rec.WhichOneof("record_type") != "history":
            continue
        items = {}
        for item in rec.history.item:
            key = item.key or "/".join(item.nested_key)
            try:
                items[key] = json.loads(item.value_json)
            except ValueError:
                continue
        step = items.get("trainer/global_step", items.get("_step"))
        if step is None:
            continue
        for key, value in items.items():
            if key.startswith("_") or key == "trainer/global_step" or not isinstance(value, (int, float)):
                continue
            out.setdefault(key, []).append((float(step), float(value)))
    return out


def load_run(path: Path) -> Series:
    """Metrics of a run given as a CSV file, a ``.wandb`` file or a directory holding either."""
    if path.is_file():
        return read_wandb_metrics(path) if path.suffix == ".wandb" else read_csv_metrics(path)
    csvs = sorted(path.rglob("metrics.csv"), key=lambda p: p.stat().st_mtime)
    if csvs:
        return read_csv_metrics(csvs[-1])  # newest version of the run directory
    runs = sorted(path.rglob("*.wandb"), key=lambda p: p.stat().st_mtime)
    if runs:
        return read_wandb_metrics(runs[-1])
    raise FileNotFoundError(f"no metrics.csv or .wandb file under {path}")


PANELS = {
    "loss": ["train/loss", "train/lm_loss", "val/loss"],
    "accuracy": ["train/acc", "val/acc"],
    "step_time": ["time/forward_ms", "time/backward_ms", "time/optimizer_ms", "time/step_ms"],
    "attention": [
        "attn/density",
        "attn/mass_recall_mean",
        "attn/mass_recall_p5",
        "attn/oracle_mass_recall_mean",
        "attn/selector_loss",
    ],
    "selection": ["val/needle_recall", "val/needle_recall/layer0", "val/needle_recall/layer1"],
    "throughput": ["throughput/tokens_per_s", "throughput/tokens_per_s_wall"],
}


def _smooth(values: list[float], window: int) -> list[float]:
    if window <= 1:
        return values
    out, acc = [], []
    for v in values:
        acc.append(v)
        if len(acc) > window:
            acc.pop(0)
        out.append(sum(acc) / len(acc))
    return out


def plot(runs: list[tuple[str, Series]], out_dir: Path, smooth: int = 1) -> list[Path]:
    """One PNG per panel with any data; returns the written paths."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out_dir.mkdir(parents=True, exist_ok=True)
    written = []
    for panel, keys in PANELS.items():
        present = [k for k in keys if any(k in s for _, s in runs)]
        if not present:
            continue
        cols = len(present)
        fig, axes = plt.subplots(1, cols, figsize=(4.2 * cols, 3.4), squeeze=False)
        for ax, key in zip(axes[0], present):
            for label, series in runs:
                pts = [(x, y) for x, y in series.get(key, []) if math.isfinite(y)]
                if not pts:
                    continue
                xs, ys = zip(*pts)
                marker = "o" if len(pts) < 30 else None
                ax.plot(xs, _smooth(list(ys), 1 if key.startswith("val/") else smooth), label=label, marker=marker)
            ax.set_title(key)
            ax.set_xlabel("step")
            ax.grid(alpha=0.3)
        if len(runs) > 1:  # one legend beside the last panel, so long run labels never hide a curve
            axes[0][-1].legend(loc="upper left", bbox_to_anchor=(1.02, 1.0), fontsize="small", frameon=False)
        fig.tight_layout()
        path = out_dir / f"{panel}.png"
        fig.savefig(path, dpi=110)
        plt.close(fig)
        written.append(path)
    return written


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("runs", nargs="+", type=Path, help="metrics.csv, .wandb file, or run directory")
    ap.add_argument("--labels", nargs="*", help="legend label per run (default: directory names)")
    ap.add_argument("--out", type=Path, default=Path("plots"), help="output directory for PNGs")
    ap.add_argument("--smooth", type=int, default=1, help="moving-average window for training curves")
    args = ap.parse_args(argv)
    labels = args.labels or [p.name for p in args.runs]
    if len(labels) != len(args.runs):
        ap.error("--labels needs one label per run")
    runs = [(label, load_run(path)) for label, path in zip(labels, args.runs)]
    for path in plot(runs, args.out, args.smooth):
        print(path)


if __name__ == "__main__":
    main()
