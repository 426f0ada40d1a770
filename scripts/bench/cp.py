"""Context-parallel training-step benchmark: the 1.1B model of ``scripts/bench/step.py`` (its
``build_model``; RMSNorm, RoPE, GQA 32/8 heads, head dim 64, SwiGLU, sparse attention, activation
checkpointing, bf16 autocast) trained with CP=W over NCCL against one GPU.

    NCCL_NVLS_ENABLE=0 torchrun --nproc-per-node 2 -m scripts.bench.cp --modes cp --out /tmp/cp \\
        --contexts 131072 196608 262144 327680 393216 524288
    torchrun --nproc-per-node 1 -m scripts.bench.cp --modes single --out /tmp/single --contexts 131072 196608 229376
    # CPU smoke test (gloo, tiny shapes, seconds on two cores; not in the test suite for its time):
    TRITON_INTERPRET=1 torchrun --nproc-per-node 2 -m scripts.bench.cp --device cpu --smoke --out /tmp/cp_smoke

For every N (ascending): the CP step on all W ranks (each holds the zig-zag shard of the N tokens; DDP-style
gradient all-reduce over the CP group, bucketed), then the single-GPU step on rank 0 (the other ranks wait).
One step = forward (+ LM loss over the local tokens / N + the selectors' loss shares), backward, gradient
all-reduce, AdamW. Tokens: scripts/bench/inputs.py (``benchmark_tokens``, seed 1), each rank taking its shard.
Reported per mode and N: step time (median and p95 over ``--repeats`` after ``--warmup``,
:class:`sparse_train.timing.Marks`), tokens/s (N per step), peak allocated memory per GPU, and the communication share
of the
step: the device time of the NCCL kernels (torch profiler, one extra profiled step) over the step's wall
time, split by collective (K/V all-gather, reduce-scatter, gradient all-reduce, small selector collectives).
Run each mode in its own process (above): memory of a step that ran out of memory can stay allocated, so every
result after an OOM in the process is flagged ``after_oom``. An out-of-memory configuration is recorded as
``oom`` and the longer N of that mode are skipped (CP: every
rank agrees through one all-reduce of a flag; the ranks' memory is symmetric, so an OOM in CP usually hits
every rank at the same point; if it does not, the collective times out after ``--timeout-min``).

Output under ``--out``: ``bench_cp.json`` (meta + results) and ``bench_cp.md`` (the table), written by rank 0.
The longest N that fits with CP but not on one GPU is named in the markdown.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import gc
import json
import os
import platform
import sys
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.profiler import ProfilerActivity, profile

import sparse_train as st
import sparse_train.parallel.context_parallel as cpm
from scripts.bench import step as bench_step
from scripts.bench.inputs import benchmark_tokens
from sparse_train.timing import Marks

SMOKE = [
    "--layers",
    "2",
    "--d-model",
    "64",
    "--heads",
    "4",
    "--kv-heads",
    "2",
    "--ffn",
    "128",
    "--vocab",
    "97",
    "--block",
    "16",
    "--top-k",
    "2",
    "--window",
    "2",
    "--contexts",
    "256",
    "--repeats",
    "2",
    "--warmup",
    "1",
    "--backend",
    "reference",
    "--precision",
    "fp32",
    "--distill",
    "sampled",
]


def _collective_kind(name: str) -> str | None:
    low = name.lower()
    if "nccl" not in low and "gloo" not in low:
        return None
    for kind in ("allgather", "reducescatter", "allreduce", "broadcast"):
        if kind in low.replace("_", ""):
            return kind
    return "other"


class Run:
    """One (mode, N) configuration: model, optimizer, the step and its measurements."""

    def __init__(self, args: argparse.Namespace, n: int, group, device: torch.device) -> None:
        self.args, self.n, self.group, self.device = args, n, group, device
        self.rank, self.world = cpm.context_parallel_rank(group) if group is not None else (0, 1)
        model = bench_step.build_model(args, "sparse", act_ckpt=True)
        for core in model.sparse_cores():
            # the 1.1B benchmark measures the sparse path; the dense warm-up would time dense attention
            core.config.dense_warmup_steps = 0
        self.model = model.to(device) if args.precision != "bf16" else model.to(device, torch.bfloat16)
        if group is not None:
            cpm.enable_context_parallel(self.model, group, backend=args.backend)
        fused = device.type == "cuda"
        self.opt = torch.optim.AdamW(self.model.parameters(), lr=1e-4, betas=(0.9, 0.95), weight_decay=0.1, fused=fused)
        tokens = benchmark_tokens(n, args.vocab, seed=1, device=device)
        x, y = tokens[:, :-1], tokens[:, 1:]
        if group is not None:
            x, y = (cpm.shard_sequence(t, 1, self.rank, self.world) for t in (x, y))
        self.x, self.y = x, y
        self.clock = Marks(device)

    def step(self) -> dict[str, float]:
        args, clock = self.args, self.clock
        amp = (
            torch.autocast(self.device.type, dtype=torch.bfloat16)
            if args.precision == "bf16-mixed"
            else contextlib.nullcontext()
        )
        clock.mark("start")
        with amp:
            if args.loss == "chunked":
                loss_sum = self.model(self.x, labels=self.y).loss_sum
            else:
                loss_sum = F.cross_entropy(
                    self.model(self.x).float().view(-1, args.vocab), self.y.reshape(-1), reduction="sum"
                )
        # the loss of the local tokens over the GLOBAL count: the ranks' gradients sum to the one-GPU gradient
        loss = loss_sum / self.n
        loss = loss + st.collect_selector_losses(self.model)
        clock.mark("forward")
        loss.backward()
        clock.mark("backward")
        if self.group is not None:
            grads = [p.grad for p in self.model.parameters() if p.grad is not None]
            flat = torch.cat([g.reshape(-1).float() for g in grads])  # one bucket: DDP's all-reduce, unoverlapped
            dist.all_reduce(flat, group=self.group)
            offset = 0
            for g in grads:
                g.copy_(flat[offset : offset + g.numel()].view_as(g))
                offset += g.numel()
        clock.mark("reduced")
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)
        clock.mark("end")
        return {
            "forward_ms": clock.ms("start", "forward"),
            "backward_ms": clock.ms("forward", "backward"),
            "grad_allreduce_ms": clock.ms("backward", "reduced"),
            "optimizer_ms": clock.ms("reduced", "end"),
            "step_ms": clock.ms("start", "end"),
        }

    def communication(self) -> dict[str, float]:
        """Device time of the collective kernels in one profiled step, by kind, in ms."""
        activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if self.device.type == "cuda" else [])
        with profile(activities=activities) as prof:
            self.step()
            if self.device.type == "cuda":
                torch.cuda.synchronize()
        out: dict[str, float] = {}
        for event in prof.key_averages():
            kind = _collective_kind(event.key)
            if kind is None:
                continue
            # GPU kernels on CUDA (NCCL runs as kernels); the CPU-side collective calls under gloo
            us = getattr(event, "device_time_total", 0.0) if self.device.type == "cuda" else event.cpu_time_total
            if self.device.type == "cuda" and not us:
                continue
            out[kind] = out.get(kind, 0.0) + us / 1e3
        return out


def measure(args: argparse.Namespace, n: int, group, device: torch.device) -> dict[str, Any]:
    run = Run(args, n, group, device)
    result: dict[str, Any] = {"context": n, "status": "ok", "repeats": args.repeats}
    result.update(bench_step.time_steps(run.step, args.warmup, args.repeats, device, n, q=0.95))
    comm = run.communication()
    result["comm_ms"] = comm
    result["comm_share"] = sum(comm.values()) / result["step_ms"] if result["step_ms"] else float("nan")
    stats = st.collect_attention_stats(run.model)
    result["density"] = stats.get("density")
    result["fallbacks"] = {k: v for k, v in stats.items() if k.startswith("fallbacks/") and v}
    del run
    return result


def _cleanup(device: torch.device) -> None:
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


_OOM_SEEN = False
"""Set by the first out-of-memory error of this process. Memory of the failed step can stay allocated after
it (later runs then report more peak memory and can fail at an N that fits in a fresh process), so every later
result is flagged ``after_oom`` and is not evidence of what fits: run such a mode again alone (``--modes single``)."""


def run_mode(args: argparse.Namespace, mode: str, group, device: torch.device, rank: int) -> list[dict[str, Any]]:
    """Every N of ``mode`` ("cp": all ranks; "single": rank 0 alone, the others wait)."""
    global _OOM_SEEN
    results: list[dict[str, Any]] = []
    failed = False
    for n in sorted(args.contexts):
        if failed:
            results.append({"context": n, "mode": mode, "status": "skipped (a shorter N ran out of memory)"})
            continue
        runs_here = mode == "cp" or rank == 0
        result: dict[str, Any] = {"context": n, "mode": mode, "status": "not run"}
        if _OOM_SEEN:
            result["after_oom"] = True
        oom = torch.zeros(1, device=device)
        t0 = time.perf_counter()
        if runs_here:
            try:
                result = {
                    **measure(args, n, group if mode == "cp" else None, device),
                    "mode": mode,
                    **({"after_oom": True} if _OOM_SEEN else {}),
                }
            except torch.OutOfMemoryError as exc:
                result = {"context": n, "mode": mode, "status": "oom", "error": str(exc).splitlines()[0]}
                oom.fill_(1)
            finally:
                _cleanup(device)
        result["wall_s"] = time.perf_counter() - t0
        dist.all_reduce(oom)  # every rank learns of an OOM (and the waiting ranks wait here)
        failed = bool(oom.item())
        _OOM_SEEN = _OOM_SEEN or failed
        if mode == "cp":
            peaks = [None] * dist.get_world_size()
            dist.all_gather_object(peaks, result.get("peak_mem_gib"))
            result["peak_mem_gib_per_rank"] = peaks
            shares = [None] * dist.get_world_size()
            dist.all_gather_object(shares, result.get("comm_share"))
            result["comm_share_per_rank"] = shares
        if rank == 0:
            # the whole record, as soon as it exists: a sweep cut by a time limit keeps what it measured
            print(
                f"[bench_cp] {mode} N={n}: {result['status']}"
                + (
                    f", step {result['step_ms']:.1f} ms, comm {result['comm_share']:.1%}"
                    if result["status"] == "ok"
                    else ""
                )
                + f" | {json.dumps(result, default=str)}",
                flush=True,
            )
        results.append(result)
    return results


def markdown(results: list[dict[str, Any]], world: int, meta: dict[str, Any]) -> str:
    lines = [
        f"# Context-parallel training step ({meta['date']}, {meta['device']}, CP={world} vs one GPU)",
        "",
        f"Model: scripts/bench/step.py's build_model ({meta['args']['layers']} layers, "
        f"d_model {meta['args']['d_model']}, "
        f"{meta['args']['heads']}/{meta['args']['kv_heads']} heads), sparse attention (top_k "
        f"{meta['args']['top_k']}, window {meta['args']['window']}, block {meta['args']['block']}, distill "
        f"{meta['args']['distill']}, backend {meta['args']['backend']}), LM loss {meta['args'].get('loss')}, "
        f"activation checkpointing, "
        f"{meta['args']['precision']}. Median (p95) over {meta['args']['repeats']} steps.",
        "",
        "| N | mode | step ms (p95) | tokens/s | peak GiB per GPU | comm share | all-gather / reduce-scatter / "
        "all-reduce ms |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in results:
        mode = r["mode"] + (" (after an OOM: rerun alone)" if r.get("after_oom") else "")
        if r["status"] != "ok":
            lines.append(f"| {r['context']} | {mode} | {r['status']} | | | | |")
            continue
        peaks = r.get("peak_mem_gib_per_rank") or [r.get("peak_mem_gib")]
        peak = " / ".join("-" if p is None else f"{p:.1f}" for p in peaks)
        comm = r.get("comm_ms", {})
        parts = " / ".join(f"{comm.get(k, 0.0):.1f}" for k in ("allgather", "reducescatter", "allreduce"))
        lines.append(
            f"| {r['context']} | {mode} | {r['step_ms']:.1f} ({r['step_p95_ms']:.1f}) | "
            f"{r['tokens_per_s']:.0f} | {peak} | {r['comm_share']:.1%} | {parts} |"
        )
    # one GPU "does not fit" N only where a clean process ran out of memory at N or below
    single_oom = [
        r["context"] for r in results if r["mode"] == "single" and r["status"] == "oom" and not r.get("after_oom")
    ]
    only_cp = [
        r["context"]
        for r in results
        if r["mode"] == "cp"
        and r["status"] == "ok"
        and not r.get("after_oom")
        and single_oom
        and min(single_oom) <= r["context"]
    ]
    lines.append("")
    lines.append(
        f"Longest N that fits with CP={world} but not on one GPU (both measured): "
        f"{max(only_cp) if only_cp else 'none measured'}."
    )
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    bench_step.add_model_arguments(ap)
    ap.add_argument("--contexts", type=int, nargs="+", default=[131072, 196608, 262144, 327680, 393216, 524288])
    ap.add_argument("--modes", nargs="+", choices=["cp", "single"], default=["cp", "single"])
    ap.add_argument("--device", choices=["cuda", "cpu"], default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--precision", choices=["bf16-mixed", "bf16", "fp32"], default="bf16-mixed")
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--timeout-min", type=float, default=10.0, help="collective timeout (a rank left behind)")
    ap.add_argument("--smoke", action="store_true", help="tiny shapes on the CPU (gloo): " + " ".join(SMOKE))
    ap.add_argument("--out", type=Path, required=True, help="output directory (JSON + markdown)")
    raw = list(sys.argv[1:] if argv is None else argv)
    args = ap.parse_args((SMOKE + raw) if "--smoke" in raw else raw)

    os.environ.setdefault("NCCL_NVLS_ENABLE", "0")  # NVLink multicast off: plain NCCL (as scripts/tools/gpu_env.sh)
    backend = "nccl" if args.device == "cuda" else "gloo"
    if not dist.is_initialized():
        dist.init_process_group(backend, timeout=datetime.timedelta(minutes=args.timeout_min))
    rank, world = dist.get_rank(), dist.get_world_size()
    if args.device == "cuda":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", rank)))
        device = torch.device("cuda", torch.cuda.current_device())
    else:
        device = torch.device("cpu")
    group = dist.group.WORLD
    for n in args.contexts:
        cpm.check_layout(n, world, args.block, args.block)
    results = []
    for mode in args.modes:
        results.extend(run_mode(args, mode, group, device, rank))
    if rank == 0:
        meta = {
            "date": time.strftime("%Y-%m-%d"),
            "torch": torch.__version__,
            "python": platform.python_version(),
            "world": world,
            "nccl_nvls_enable": os.environ.get("NCCL_NVLS_ENABLE"),
            "device": torch.cuda.get_device_name() if device.type == "cuda" else platform.processor() or "cpu",
            "args": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
        }
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "bench_cp.json").write_text(json.dumps({"meta": meta, "results": results}, indent=2))
        (args.out / "bench_cp.md").write_text(markdown(results, world, meta))
        print(markdown(results, world, meta))
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
