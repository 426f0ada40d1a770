"""What bounds each attention kernel, read by Nsight Compute on the GPU and summarised anywhere.

``run`` (GPU): the forward + backward of the attention benchmark's inputs (scripts/bench/inputs.py: B = 1, HQ = 32,
HKV = 8, bf16, a random top-k + window + sinks index) with the default kernels; two warm-up calls, then one call
inside a profiler range (``cudaProfilerStart``/``Stop``), so Nsight Compute started with ``--profile-from-start off``
profiles exactly the kernels of one forward + backward:

    ncu --clock-control none --profile-from-start off --print-units base --csv --page raw \\
        --section SpeedOfLight --section ComputeWorkloadAnalysis --section MemoryWorkloadAnalysis \\
        --section WarpStateStats --section Occupancy --section LaunchStats \\
        python3 -m scripts.tools.ncu_kernel_limits run --head-dim 128 --pattern P128 > raw.csv

``summarize`` (anywhere): ncu's raw CSV -> one row per kernel: time, SM / tensor-pipe / issue-slot / DRAM
utilisation, achieved occupancy, registers, and the stall reasons that hold its warps most (each as its share of
the warps' cycles between two issued instructions, ncu's ``..._issue_stalled_<reason>_per_issue_active``):

    python3 -m scripts.tools.ncu_kernel_limits summarize raw.csv --out limits.json

``--clock-control none`` leaves the card's clocks as they are (never lock or change them on a lent machine).
"""

from __future__ import annotations

import argparse
import csv
import json
import re
import sys

import torch

from scripts.bench.inputs import PATTERNS, benchmark_inputs, build_index, random_selection
from sparse_train.kernels.triton.op import triton_sparse_attention

# ncu's raw-page metric names a summary row reports, the first present of each tuple (ncu versions name some
# differently); absent ones are left out
METRICS = {
    "time_ms": ("gpu__time_duration.sum",),
    "sm_throughput_pct": ("sm__throughput.avg.pct_of_peak_sustained_elapsed",),
    # cycles the tensor pipe works (wgmma included) per cycle the SM is active: the share of the peak the
    # tile products can reach at this clock
    "tensor_pipe_pct": (
        "sm__pipe_tensor_cycles_active.avg.pct_of_peak_sustained_active",
        "sm__pipe_tensor_op_hmma_cycles_active.avg.pct_of_peak_sustained_active",
    ),
    "issue_active_pct": (
        "sm__issue_active.avg.pct_of_peak_sustained_elapsed",
        "sm__inst_issued.avg.pct_of_peak_sustained_active",
    ),
    "dram_throughput_pct": (
        "gpu__dram_throughput.avg.pct_of_peak_sustained_elapsed",
        "dram__throughput.avg.pct_of_peak_sustained_elapsed",
    ),
    "l2_hit_pct": ("lts__t_sector_hit_rate.pct",),
    "achieved_occupancy_pct": ("sm__warps_active.avg.pct_of_peak_sustained_active",),
    "registers_per_thread": ("launch__registers_per_thread",),
    "shared_bytes_per_block": ("launch__shared_mem_per_block",),
    "blocks_per_sm_by_registers": ("launch__occupancy_limit_registers",),
    "blocks_per_sm_by_shared_memory": ("launch__occupancy_limit_shared_mem",),
    "threads_per_block": ("launch__block_size",),
    "grid_size": ("launch__grid_size",),
    "sm_mhz": ("gpc__cycles_elapsed.avg.per_second", "smsp__cycles_elapsed.avg.per_second"),
    "cycles_between_issues": (
        "smsp__average_warp_latency_per_inst_issued.ratio",
        "smsp__average_warps_active_per_issue_active.ratio",
    ),
}
_TIME_UNITS = {"nsecond": 1e-6, "ns": 1e-6, "usecond": 1e-3, "us": 1e-3, "msecond": 1.0, "ms": 1.0, "second": 1e3}
_FREQUENCY_UNITS = {
    "hz": 1e-6,
    "cycle/second": 1e-6,
    "cycle/nsecond": 1e3,
    "cycle/usecond": 1.0,
    "khz": 1e-3,
    "mhz": 1.0,
    "ghz": 1e3,
}
_STALL = re.compile(r"^smsp__average_warps_issue_stalled_(?P<reason>[a-z_]+?)_per_issue_active\.ratio$")


def _number(text):
    """An ncu cell as a float (thousands separators dropped), None when it is not a number."""
    try:
        return float(text.replace(",", ""))
    except (AttributeError, ValueError):
        return None


def read_raw_csv(text):
    """ncu's ``--csv --page raw`` output (the profiled program's own lines and ``==PROF==`` lines may come
    before it) -> (header, units, rows): the metric names, their units and one dict per profiled kernel."""
    lines = text.splitlines()
    start = next((i for i, line in enumerate(lines) if line.startswith('"ID"')), None)
    if start is None:
        raise ValueError('no ncu raw CSV found (no header line starting with "ID")')
    table = list(csv.reader(lines[start:]))
    header, units = table[0], table[1]
    rows = [dict(zip(header, row)) for row in table[2:] if len(row) == len(header)]
    return header, dict(zip(header, units)), rows


def summarize(text, top_stalls=6):
    """The raw CSV -> one summary dict per kernel, in launch order (module docstring)."""
    header, units, rows = read_raw_csv(text)
    out = []
    for row in rows:
        entry = {"kernel": row.get("Kernel Name", "?").split("(")[0].strip()}
        for key, candidates in METRICS.items():
            metric = next((name for name in candidates if _number(row.get(name)) is not None), None)
            if metric is None:
                continue
            value = _number(row[metric])
            unit = units.get(metric, "").strip().lower()
            if key == "time_ms":
                value *= _TIME_UNITS.get(unit, 1.0)
            elif key == "sm_mhz":
                value *= _FREQUENCY_UNITS.get(unit, 1.0)
            entry[key] = value
        stalls = {}
        for name in header:
            match = _STALL.match(name)
            value = _number(row.get(name))
            if match and value and not match["reason"].endswith("not_issued"):
                stalls[match["reason"]] = value
        # each reason's cycles per issued instruction, as a share of all cycles between two issues (ncu's own
        # total where reported, else the reasons' sum)
        total = entry.get("cycles_between_issues") or sum(stalls.values())
        if total > 0 and stalls:
            ranked = sorted(stalls.items(), key=lambda item: -item[1])[:top_stalls]
            entry["cycles_between_issues"] = total
            entry["top_stalls"] = {reason: value / total for reason, value in ranked}
        out.append(entry)
    return out


def markdown(summary):
    """The summary as a table: one line per kernel that took at least 10 us."""
    lines = [
        "| kernel | ms | MHz | SM % | tensor pipe % | issue slots % | DRAM % | L2 hit % | occupancy % | regs | "
        "top stalls (share of cycles between issues) |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]

    def pct(value):
        return "-" if value is None else f"{value:.0f}"

    for entry in summary:
        if entry.get("time_ms", 0.0) < 0.01:
            continue
        stalls = ", ".join(f"{reason} {100 * share:.0f}%" for reason, share in entry.get("top_stalls", {}).items())
        columns = [f"`{entry['kernel']}`", f"{entry.get('time_ms', float('nan')):.3f}"]
        columns += [
            pct(entry.get(key))
            for key in (
                "sm_mhz",
                "sm_throughput_pct",
                "tensor_pipe_pct",
                "issue_active_pct",
                "dram_throughput_pct",
                "l2_hit_pct",
                "achieved_occupancy_pct",
                "registers_per_thread",
            )
        ]
        lines.append("| " + " | ".join(columns + [stalls or "-"]) + " |")
    return "\n".join(lines)


def run(args):
    pattern = PATTERNS[args.pattern]
    q, k, v, do = benchmark_inputs(args.n, args.head_dim, seed=args.n, requires_grad=True)
    idx, plan = build_index(random_selection(args.n, pattern, seed=args.n), args.n, pattern)

    def forward_backward():
        o, _ = triton_sparse_attention(q, k, v, idx, kernel_options={"plan": plan})
        torch.autograd.grad(o, (q, k, v), do)

    for _ in range(2):  # compile, then one warm call
        forward_backward()
    torch.cuda.synchronize()
    with torch.cuda.profiler.profile():
        forward_backward()
        torch.cuda.synchronize()
    print(f"profiled one forward + backward: N={args.n} D={args.head_dim} {args.pattern}", file=sys.stderr)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="command", required=True)
    run_ap = sub.add_parser("run", help="(GPU) one forward + backward inside a profiler range")
    run_ap.add_argument("--n", type=int, default=65536)
    run_ap.add_argument("--head-dim", type=int, default=128)
    run_ap.add_argument("--pattern", default="P128", choices=list(PATTERNS))
    sum_ap = sub.add_parser("summarize", help="ncu's raw CSV -> JSON (and a markdown table on stdout)")
    sum_ap.add_argument("csv", help="ncu --csv --page raw output")
    sum_ap.add_argument("--out", default=None, help="JSON file (default: print only)")
    args = ap.parse_args(argv)
    if args.command == "run":
        run(args)
        return
    with open(args.csv) as fh:
        summary = summarize(fh.read())
    if args.out:
        with open(args.out, "w") as fh:
            json.dump(summary, fh, indent=1)
    print(markdown(summary))


if __name__ == "__main__":
    main()
