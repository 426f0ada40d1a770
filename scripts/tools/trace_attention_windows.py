"""Where a training step's attention time goes on the GPU timeline: reads a ``torch.profiler`` Chrome trace
(``python -m scripts.bench.step --kernel-table DIR`` writes ``DIR/trace_<tag>.json.gz``) and splits every attention
call into kernel time and GPU idle time.

A *window* is a run of the project's attention kernels of one kind (``forward``: ``_fwd*``/``_merge``;
``backward``: delta, the KV schedule, dQ, dK/dV and their finish kernels) together with whatever small kernels run
between them (allocations' fills, casts). For each window the script reports its span (first kernel start to last
kernel end), the kernel time inside it, the idle time inside it (span minus kernels: the GPU waiting for the host)
and the idle gap just before it. The ``attn_bwd`` phase of ``scripts.bench.step --profile`` spans about one backward
window
plus the gap before it, so a phase longer than the kernel benchmark's device time is either idle (host-bound
launches) or kernels running slower in the step (clocks, L2): this tells which.

    python -m scripts.tools.trace_attention_windows DIR/trace_n65536_sparse_ckpt1.json.gz --out windows.json
"""

from __future__ import annotations

import argparse
import gzip
import json
import re
import statistics
from collections import defaultdict

KINDS = {
    "forward": re.compile(r"^_(fwd|merge)\w*kernel"),
    "backward": re.compile(r"^_(delta|kv_schedule|dq|dkdv)\w*kernel"),
}
# a window ends at the first kernel of another kind or at a kernel this long that is not ours (a matmul of the
# next layer), whichever comes first
FOREIGN_BREAK_US = 50.0


def load_kernels(path: str) -> list[dict]:
    opener = gzip.open if path.endswith(".gz") else open
    with opener(path, "rt") as f:
        trace = json.load(f)
    events = trace["traceEvents"] if isinstance(trace, dict) else trace
    kernels = [e for e in events if e.get("ph") == "X" and e.get("cat") == "kernel"]
    kernels.sort(key=lambda e: e["ts"])
    return kernels


def kind_of(name: str) -> str | None:
    for kind, pattern in KINDS.items():
        if pattern.match(name):
            return kind
    return None


def windows(kernels: list[dict]) -> list[dict]:
    """Group the timeline into attention windows (see the module docstring)."""
    found, current = [], None
    for i, e in enumerate(kernels):
        kind = kind_of(e["name"])
        if current is not None and (
            kind not in (None, current["kind"]) or (kind is None and e["dur"] >= FOREIGN_BREAK_US)
        ):
            found.append(current)
            current = None
        if kind is None:
            if current is not None:
                current["pending"].append(e)
            continue
        if current is None:
            prev_end = kernels[i - 1]["ts"] + kernels[i - 1]["dur"] if i else e["ts"]
            current = {
                "kind": kind,
                "start": e["ts"],
                "gap_before_us": max(0.0, e["ts"] - prev_end),
                "kernels": [],
                "pending": [],
                "previous_kernel": kernels[i - 1]["name"][:80] if i else None,
            }
        # small foreign kernels between two of ours belong to the window; after the last one they do not
        current["kernels"].extend(current["pending"])
        current["pending"] = []
        current["kernels"].append(e)
    if current is not None:
        found.append(current)
    rows = []
    for w in found:
        ks = w["kernels"]
        end = max(k["ts"] + k["dur"] for k in ks)
        busy = sum(k["dur"] for k in ks)
        per_name = defaultdict(float)
        for k in ks:
            per_name[k["name"][:60]] += k["dur"]
        rows.append(
            {
                "kind": w["kind"],
                "span_ms": (end - w["start"]) / 1e3,
                "kernel_ms": busy / 1e3,
                "idle_ms": (end - w["start"] - busy) / 1e3,
                "gap_before_ms": w["gap_before_us"] / 1e3,
                "num_kernels": len(ks),
                "previous_kernel": w["previous_kernel"],
                "kernels_ms": {name: us / 1e3 for name, us in per_name.items()},
            }
        )
    return rows


def summarize(rows: list[dict]) -> dict:
    out = {}
    for kind in KINDS:
        mine = [r for r in rows if r["kind"] == kind]
        if not mine:
            continue
        names = sorted({n for r in mine for n in r["kernels_ms"]})
        out[kind] = {
            "windows": len(mine),
            **{
                f"median_{key}": statistics.median(r[key] for r in mine)
                for key in ("span_ms", "kernel_ms", "idle_ms", "gap_before_ms")
            },
            # over the windows that ran the kernel (the Gluon and Triton variants of a kernel never share one)
            "median_ms_per_kernel": {
                n: statistics.median(r["kernels_ms"][n] for r in mine if n in r["kernels_ms"]) for n in names
            },
        }
    return out


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("trace", help="Chrome trace (.json or .json.gz) of torch.profiler")
    ap.add_argument("--out", default=None, help="JSON output: every window and the medians")
    args = ap.parse_args(argv)
    rows = windows(load_kernels(args.trace))
    summary = summarize(rows)
    for kind, s in summary.items():
        print(
            f"[windows] {kind}: {s['windows']} windows, median span {s['median_span_ms']:.3f} ms = kernels "
            f"{s['median_kernel_ms']:.3f} + idle {s['median_idle_ms']:.3f}; idle gap before "
            f"{s['median_gap_before_ms']:.3f} ms"
        )
        for name, ms in s["median_ms_per_kernel"].items():
            print(f"    {ms:8.3f} ms  {name}")
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"summary": summary, "windows": rows}, f, indent=1)
    return summary


if __name__ == "__main__":
    main()
