"""Training-step benchmark: a ~1B-parameter Llama-style model, sparse vs dense cuDNN attention.

One optimisation step (forward + loss, backward, AdamW step) of the repository's
:class:`~sparse_train.lightning.model.Transformer` (RMSNorm, RoPE, GQA, SwiGLU; random init), B=1,
bf16 autocast with fp32 master weights (or pure bf16 weights with ``--precision bf16``), timed per
phase with :class:`sparse_train.timing.Marks` (CUDA events on a GPU). Warm-up steps are discarded; the table and
JSON report the median (and p95) over ``--repeats`` steps plus the peak allocated memory. The tokens come from
scripts/bench/inputs.py (``benchmark_tokens``, seed 1: the same as the context-parallel benchmark's).

Default shape (Llama-3.2-1B-like, 32K vocabulary): d_model 2048, 16 layers, 32 query heads, 8 KV
heads, head dim 64, SwiGLU 8192 -> about 1.1B parameters.

    python -m scripts.bench.step --out docs/benchmarks/bench_step.json            # 32K and 64K, both variants
    python -m scripts.bench.step --contexts 65536 --variants sparse --act-ckpt on
    python -m scripts.bench.step --device cpu --contexts 512 --layers 2 --d-model 128 --heads 4 \\
        --kv-heads 2 --ffn 256 --vocab 256 --repeats 2 --warmup 1            # CPU smoke test

A configuration that runs out of memory is retried with activation checkpointing (``--act-ckpt auto``)
and recorded as ``oom`` if it still fails; the remaining configurations keep running.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import platform
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.profiler import ProfilerActivity, profile

import sparse_train as st
from scripts.bench.harness import quantile
from scripts.bench.inputs import benchmark_tokens, candidates_argument
from scripts.tools import trace_attention_windows
from sparse_train.lightning import model as model_lib
from sparse_train.lightning.model import Transformer, TransformerConfig
from sparse_train.timing import Marks


def _dense_attention_factory(backend: str) -> Callable[..., torch.Tensor]:
    """Dense causal SDPA restricted to one backend. GQA goes through ``enable_gqa`` when the backend
    accepts it, otherwise K/V are expanded to the query heads. ``attend.prepare(...)`` probes which, once,
    before the timed model runs: never inside a call, where the probe would run in a checkpointed block's
    first forward but not in its recompute, and selective checkpointing (which hands the recompute the kept
    SDPA outputs in call order) would give the recompute the probe's output."""
    backends = {
        "cudnn": [SDPBackend.CUDNN_ATTENTION],
        "flash": [SDPBackend.FLASH_ATTENTION],
        "efficient": [SDPBackend.EFFICIENT_ATTENTION],
        "math": [SDPBackend.MATH],
    }
    state: dict[str, Any] = {"expand": None}

    def ctx() -> contextlib.AbstractContextManager:
        return sdpa_kernel(backends[backend]) if backend != "auto" else contextlib.nullcontext()

    def prepare(device: torch.device, heads: int, kv_heads: int, head_dim: int, dtype: torch.dtype) -> None:
        q = torch.zeros(1, heads, 128, head_dim, device=device, dtype=dtype)
        kv = torch.zeros(1, kv_heads, 128, head_dim, device=device, dtype=dtype)
        try:
            with ctx(), torch.no_grad():
                F.scaled_dot_product_attention(q, kv, kv, is_causal=True, enable_gqa=heads != kv_heads)
            state["expand"] = False
        except RuntimeError:
            state["expand"] = True
            print(f"[bench] SDPA backend {backend!r} rejects enable_gqa; expanding K/V to {heads} heads")

    def attend(
        q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, scale: float, document_ids: torch.Tensor | None = None
    ) -> torch.Tensor:
        if document_ids is not None:  # the benchmark's rows are single sequences
            raise ValueError("the dense baseline of this benchmark takes no document_ids")
        if state["expand"] is None:
            raise RuntimeError("call attend.prepare(...) before the first forward")
        groups = q.shape[1] // k.shape[1]
        with ctx():
            if groups > 1 and state["expand"]:
                k, v = k.repeat_interleave(groups, 1), v.repeat_interleave(groups, 1)
                return F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale)
            if groups > 1:
                return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True, scale=scale)
            return F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale)

    attend.prepare = prepare
    return attend


POINTWISE = {"on": True, "off": False, "auto": "auto"}
"""``--compile-pointwise`` values as ``TransformerConfig.compile_pointwise`` takes them."""
GLUON = {"on": True, "off": False, "auto": None}
"""``--gluon`` values as ``KernelOptions.fwd_gluon`` / ``dq_gluon`` / ``kv_gluon`` take them."""
_SPARSE_DEFAULTS = st.SparseAttentionConfig()
"""The module's defaults, which the sparse variant's selector options take unless given."""


def time_steps(
    step: Callable[[], dict[str, float]], warmup: int, repeats: int, device: torch.device, tokens: int, q: float
) -> dict[str, Any]:
    """Run ``step`` (returning ``{"<phase>_ms": ...}``, ``step_ms`` among them) ``warmup`` times untimed,
    then ``repeats`` times: the median of each phase, its ``q`` quantile (key ``<phase>_p<100 q>_ms``),
    tokens/s from the median step, and the peak CUDA memory of the timed steps (GiB)."""
    for _ in range(warmup):
        step()
    if device.type == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    samples = [step() for _ in range(repeats)]
    result: dict[str, Any] = {}
    for key in samples[0]:
        vals = [sample[key] for sample in samples]
        result[key] = quantile(vals, 0.5)
        result[key.replace("_ms", f"_p{round(100 * q)}_ms")] = quantile(vals, q)
    result["tokens_per_s"] = tokens / (result["step_ms"] / 1e3)
    if device.type == "cuda":
        result["peak_mem_gib"] = torch.cuda.max_memory_allocated() / 2**30
    return result


def build_model(args: argparse.Namespace, variant: str, act_ckpt: bool) -> Transformer:
    """The benchmark's model (shape and sparse config from the :func:`add_model_arguments` options), seeded
    with 0, on the CPU in fp32 (``scripts/bench/cp.py`` builds the same one)."""
    torch.manual_seed(0)
    # No dense warm-up: the benchmark times the sparse path a trained selector runs (the module's default
    # 500-step warm-up would make every timed step dense attention).
    sparse_cfg = dict(
        block_q=args.block,
        block_k=args.block,
        top_k=args.top_k,
        window=args.window,
        sinks=args.sinks,
        distill=args.distill,
        backend=args.backend,
        dense_warmup_steps=0,
        kernel_options=dict(
            fused_dq=args.fused_backward == "on",
            stored_ds=args.stored_ds_backward == "on",
            fwd_gluon=GLUON[args.gluon],
            dq_gluon=GLUON[args.gluon],
            kv_gluon=GLUON[args.gluon],
        ),
        selector=args.selector,
        selector_index_heads=args.index_heads,
        selector_distill=args.selector_distill,
        selector_candidates=args.candidates,
    )
    cfg = TransformerConfig(
        vocab_size=args.vocab,
        d_model=args.d_model,
        n_layers=args.layers,
        n_heads=args.heads,
        n_kv_heads=args.kv_heads,
        head_dim=args.head_dim,
        ffn_hidden=args.ffn,
        rope_theta=args.rope_theta,
        tie_embeddings=False,
        attention=variant,
        sparse=sparse_cfg,
        activation_checkpointing=act_ckpt,
        checkpoint_keeps_attention=args.keep_attention == "on",
        compile_pointwise=POINTWISE[args.compile_pointwise],
    )
    return Transformer(cfg)


def add_model_arguments(ap: argparse.ArgumentParser) -> None:
    """The model-shape and sparse-config options of :func:`build_model` (defaults: the 1.1B shape)."""
    ap.add_argument("--layers", type=int, default=16)
    ap.add_argument("--d-model", type=int, default=2048)
    ap.add_argument("--heads", type=int, default=32)
    ap.add_argument("--kv-heads", type=int, default=8)
    ap.add_argument("--head-dim", type=int, default=None)
    ap.add_argument("--ffn", type=int, default=8192)
    ap.add_argument("--vocab", type=int, default=32000)
    ap.add_argument("--rope-theta", type=float, default=500000.0)
    ap.add_argument("--block", type=int, default=64, help="sparse block size (BQ = BK)")
    ap.add_argument("--top-k", type=int, default=16)
    ap.add_argument("--window", type=int, default=8)
    ap.add_argument("--sinks", type=int, default=1)
    ap.add_argument(
        "--selector",
        choices=["pooled", "token"],
        default=_SPARSE_DEFAULTS.selector,
        help="sparse variant: SparseAttentionConfig.selector (default: the module's)",
    )
    ap.add_argument(
        "--index-heads",
        type=int,
        default=1,
        help="sparse variant: SparseAttentionConfig.selector_index_heads (token selector)",
    )
    ap.add_argument(
        "--selector-distill",
        choices=["block", "token"],
        default=_SPARSE_DEFAULTS.selector_distill,
        help="sparse variant: SparseAttentionConfig.selector_distill (token selector; default: the module's)",
    )
    ap.add_argument(
        "--candidates",
        type=candidates_argument,
        default=_SPARSE_DEFAULTS.selector_candidates,
        help="sparse variant: SparseAttentionConfig.selector_candidates, a count, 'auto' (the module's default: "
        "2 top_k from 8192 tokens up for the token selector trained by --selector-distill token) or 'none' (exact "
        "scores)",
    )
    ap.add_argument(
        "--distill",
        choices=["sparse", "dense", "sampled", "off"],
        default="sampled",
        help="selector distillation during the timed steps (part of a real training step; default: the module default)",
    )
    ap.add_argument("--backend", default="auto", help="sparse kernel backend: auto | triton | reference")
    ap.add_argument(
        "--keep-attention",
        choices=["on", "off"],
        default="off",
        help="with activation checkpointing, keep the attention outputs instead of recomputing them "
        "(TransformerConfig.checkpoint_keeps_attention; both variants)",
    )
    ap.add_argument(
        "--fused-backward",
        choices=["on", "off"],
        default="off",
        help="sparse variant: dQ from the KV-centric kernel by atomics (KernelOptions.fused_dq)",
    )
    ap.add_argument(
        "--stored-ds-backward",
        choices=["on", "off"],
        default="off",
        help="sparse variant: dQ from dS tiles the KV-centric kernel stores (KernelOptions.stored_ds)",
    )
    ap.add_argument(
        "--gluon",
        choices=sorted(GLUON),
        default="auto",
        help="sparse variant: the Gluon kernels (KernelOptions.fwd_gluon / dq_gluon / kv_gluon: auto = each kernel's "
        "default, on = wherever they apply, off = the Triton kernels only)",
    )
    ap.add_argument(
        "--compile-pointwise",
        choices=sorted(POINTWISE),
        default="auto",
        help="RMSNorm, RoPE and the SwiGLU gate as torch.compile'd fused kernels "
        "(TransformerConfig.compile_pointwise, both variants; auto = on for CUDA, the default)",
    )
    ap.add_argument(
        "--loss",
        choices=["chunked", "logits"],
        default="chunked",
        help="LM loss: the model's chunked head + cross-entropy (forward(labels=...), as the training "
        "recipes; logits of 8,192 tokens at a time) or F.cross_entropy on the full [N, vocab] "
        "logits",
    )


def run_one(args: argparse.Namespace, n: int, variant: str, act_ckpt: bool) -> dict[str, Any]:
    """Time ``args.repeats`` training steps of one (context, variant) configuration."""
    device = torch.device(args.device)
    model = build_model(args, variant, act_ckpt).to(device)
    autocast = args.precision == "bf16-mixed"
    if not autocast:
        model = model.to(torch.bfloat16)
    fused = device.type == "cuda"
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, betas=(0.9, 0.95), weight_decay=0.1, fused=fused)
    tokens = benchmark_tokens(n, args.vocab, device=device)
    if variant == "dense":
        model_lib.dense_causal_attention.prepare(
            device, args.heads, args.kv_heads, model.cfg.resolved_head_dim, torch.bfloat16
        )
    x, y = tokens[:, :-1], tokens[:, 1:]
    clock = Marks(device)
    amp = torch.autocast(device.type, dtype=torch.bfloat16) if autocast else contextlib.nullcontext()

    def step() -> dict[str, float]:
        clock.mark("start")
        with amp:
            if args.loss == "chunked":
                out = model(x, labels=y)
                loss = out.loss_sum / out.count
            else:
                loss = F.cross_entropy(model(x).float().view(-1, args.vocab), y.reshape(-1))
        if variant == "sparse":
            loss = loss + st.collect_selector_losses(model)
        clock.mark("forward")
        loss.backward()
        clock.mark("backward")
        opt.step()
        opt.zero_grad(set_to_none=True)
        clock.mark("end")
        return {
            "forward_ms": clock.ms("start", "forward"),
            "backward_ms": clock.ms("forward", "backward"),
            "optimizer_ms": clock.ms("backward", "end"),
            "step_ms": clock.ms("start", "end"),
        }

    result: dict[str, Any] = {
        "context": n,
        "variant": variant,
        "status": "ok",
        "act_ckpt": act_ckpt,
        "keep_attention": act_ckpt and args.keep_attention == "on",
        "fused_backward": variant == "sparse" and args.fused_backward == "on",
        "stored_ds_backward": variant == "sparse" and args.stored_ds_backward == "on",
        "gluon": args.gluon if variant == "sparse" else None,
        "compile_pointwise": model_lib.compiles_pointwise(POINTWISE[args.compile_pointwise], device),
        "params": model.num_parameters(),
        "repeats": args.repeats,
    }
    result.update(time_steps(step, args.warmup, args.repeats, device, n, q=0.95))
    if variant == "sparse":
        core = next(iter(model.sparse_cores()))
        result["selector"] = {  # the configuration the step ran, "auto" resolved
            "selector": core.config.selector,
            "distill": core.config.resolved_selector_distill,
            "candidates": core.config.selector_candidates_at(n),
        }
        stats = st.collect_attention_stats(model)
        result["density"] = stats.get("density")
        result["fallbacks"] = {k: v for k, v in stats.items() if k.startswith("fallbacks/") and v}
        if args.profile:
            for core in model.sparse_cores():
                core.config.profile = True
            step()
            stats = st.collect_attention_stats(model)
            breakdown = {k: v for k, v in stats.items() if k.startswith("time/")}
            result["attention_breakdown_ms_per_layer"] = breakdown
            # the phases do not overlap (a checkpoint's recompute runs before the layer's attention backward
            # starts), so their sum is the attention-related time per layer, recompute included
            result["attention_ms_per_layer"] = sum(breakdown.values())
            print(
                f"[bench] N={n} attention per layer {result['attention_ms_per_layer']:.2f} ms: "
                + ", ".join(f"{k.removeprefix('time/')} {v:.2f}" for k, v in breakdown.items())
            )
            for core in model.sparse_cores():
                core.config.profile = False
    if args.kernel_table is not None and device.type == "cuda":
        result["kernels"], result["attention_windows"] = kernel_table(
            step, args.kernel_table, f"n{n}_{variant}_ckpt{int(act_ckpt)}"
        )
    return result


def kernel_table(
    step: Callable[[], dict[str, float]], out_dir: Path, tag: str, top: int = 25
) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """One more step under ``torch.profiler``: every GPU kernel's total time, call count and share of the
    step's kernel time (the split the CUDA-event phases cannot give, e.g. how much of the backward is
    the checkpoint recompute). Writes ``<out_dir>/kernels_<tag>.txt`` (profiler table),
    ``<out_dir>/trace_<tag>.json.gz`` (Chrome trace: every op and kernel in time order) and
    ``<out_dir>/windows_<tag>.json`` (each attention call's kernel and idle time on the GPU timeline,
    ``scripts/tools/trace_attention_windows.py``), and returns the ``top`` kernels by total device time and the
    windows' medians."""
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        step()
        torch.cuda.synchronize()
    events = [e for e in prof.key_averages() if e.device_type == torch.autograd.DeviceType.CUDA]
    total_us = sum(e.self_device_time_total for e in events) or 1.0
    rows = sorted(
        (
            {
                "kernel": e.key[:160],
                "calls": e.count,
                "total_ms": e.self_device_time_total / 1e3,
                "share": e.self_device_time_total / total_us,
            }
            for e in events
        ),
        key=lambda r: -r["total_ms"],
    )
    out_dir.mkdir(parents=True, exist_ok=True)
    trace_path = str(out_dir / f"trace_{tag}.json.gz")
    prof.export_chrome_trace(trace_path)
    (out_dir / f"kernels_{tag}.txt").write_text(
        prof.key_averages().table(sort_by="self_device_time_total", row_limit=60, max_name_column_width=90)
    )
    print(f"[bench] {tag}: kernel time {total_us / 1e3:.1f} ms in {len(events)} kernels; top:")
    for r in rows[:12]:
        print(f"    {r['total_ms']:9.2f} ms {r['share']:6.1%} x{r['calls']:<5} {r['kernel'][:90]}")
    windows = trace_attention_windows.main([trace_path, "--out", str(out_dir / f"windows_{tag}.json")])
    return rows[:top], windows


def run_config(args: argparse.Namespace, n: int, variant: str) -> dict[str, Any]:
    """``run_one`` with the activation-checkpointing policy and OOM handling."""
    tries = {"on": [True], "off": [False], "auto": [False, True]}[args.act_ckpt]
    last_error = ""
    for ckpt in tries:
        try:
            return run_one(args, n, variant, ckpt)
        except torch.OutOfMemoryError as exc:  # retry (auto) or record, never abort the whole run
            last_error = str(exc).splitlines()[0]
            print(f"[bench] N={n} {variant} act_ckpt={ckpt}: out of memory")
        finally:
            gc.collect()
            if torch.cuda.is_available():
                torch.cuda.empty_cache()
    return {"context": n, "variant": variant, "status": "oom", "error": last_error}


def print_table(results: list[dict[str, Any]]) -> None:
    head = (
        f"{'N':>7} {'variant':>7} {'ckpt':>5} {'fwd ms':>9} {'bwd ms':>9} {'opt ms':>8} {'step ms':>9} "
        f"{'tok/s':>9} {'peak GiB':>9} {'density':>8}"
    )
    print(head)
    print("-" * len(head))
    for r in results:
        if r["status"] != "ok":
            print(f"{r['context']:>7} {r['variant']:>7} {r['status']}")
            continue
        dens = f"{r['density']:.3f}" if r.get("density") is not None else "-"
        peak = f"{r['peak_mem_gib']:.1f}" if "peak_mem_gib" in r else "-"
        print(
            f"{r['context']:>7} {r['variant']:>7} {str(r['act_ckpt']):>5} {r['forward_ms']:9.1f} "
            f"{r['backward_ms']:9.1f} {r['optimizer_ms']:8.1f} {r['step_ms']:9.1f} {r['tokens_per_s']:9.0f} "
            f"{peak:>9} {dens:>8}"
        )
        if r.get("fallbacks"):
            print(f"{'':>7} WARNING: the sparse variant left the sparse path: {r['fallbacks']}")
    by = {(r["context"], r["variant"]): r for r in results if r["status"] == "ok"}
    for n in sorted({r["context"] for r in results}):
        s, d = by.get((n, "sparse")), by.get((n, "dense"))
        if s and d:
            print(
                f"N={n}: sparse/dense step time = {s['step_ms'] / d['step_ms']:.3f} "
                f"(fwd {s['forward_ms'] / d['forward_ms']:.3f}, bwd {s['backward_ms'] / d['backward_ms']:.3f})"
                + ("" if s["act_ckpt"] == d["act_ckpt"] else "  [different act_ckpt settings]")
            )


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--contexts", type=int, nargs="+", default=[32768, 65536])
    ap.add_argument("--variants", nargs="+", choices=["sparse", "dense"], default=["sparse", "dense"])
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    add_model_arguments(ap)
    ap.add_argument("--dense-backend", choices=["cudnn", "flash", "efficient", "math", "auto"], default="cudnn")
    ap.add_argument("--precision", choices=["bf16-mixed", "bf16"], default="bf16-mixed")
    ap.add_argument(
        "--act-ckpt",
        choices=["auto", "on", "off"],
        default="auto",
        help="activation checkpointing per block; auto = off, retried on when out of memory",
    )
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--repeats", type=int, default=10)
    ap.add_argument("--profile", action="store_true", help="one extra step with the attention breakdown")
    ap.add_argument(
        "--kernel-table",
        type=Path,
        default=None,
        metavar="DIR",
        help="one more step under torch.profiler per configuration (CUDA): kernel times and a "
        "trace to DIR, the top kernels to the JSON",
    )
    ap.add_argument("--out", type=Path, default=None, help="JSON output path")
    args = ap.parse_args(argv)

    model_lib.dense_causal_attention = _dense_attention_factory(args.dense_backend if args.device != "cpu" else "auto")
    results = []
    for n in args.contexts:
        for variant in args.variants:
            t0 = time.perf_counter()
            r = run_config(args, n, variant)
            r["wall_s"] = time.perf_counter() - t0
            results.append(r)
            print(
                f"[bench] N={n} {variant}: {r['status']}"
                + (f", step {r['step_ms']:.1f} ms" if r["status"] == "ok" else ""),
                flush=True,
            )
    print_table(results)
    meta = {
        "date": time.strftime("%Y-%m-%d"),
        "torch": torch.__version__,
        "python": platform.python_version(),
        "device": torch.cuda.get_device_name() if args.device.startswith("cuda") else platform.processor() or "cpu",
        "args": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
    }
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps({"meta": meta, "results": results}, indent=2))
        print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
