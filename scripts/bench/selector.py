"""Selector and distillation cost against the sparse attention they serve (GPU measurement).

Times, in one process, at the headline shape (default N=65536, B=1, HQ=32, HKV=8, D=128, bf16,
BQ=BK=64, top_k=16, window=8, sinks=1), with the module's selector as ``SparseAttentionConfig`` defaults build it
(the token indexer trained by the token-level KL, 2 top_k candidate blocks from 8192 tokens up; ``--selector``,
``--selector-distill`` and ``--candidates`` choose another, e.g. ``--selector pooled`` for the block-pooled scorer
with mean and max pooling and its distance bias, ``--candidates none`` for exact token scores) un-rotating RoPE of base
``--rope-theta`` (10000, as the Transformer and the Hugging Face integration set it; 0 turns it off):

* ``selector/pool``         the scorer's ``pool``: block pooling of q and k (one Triton kernel each where the
                            attention kernels run); for the token selector the keys un-rotated, the queries left to
                            the scoring's one-pass projection
* ``selector/scores_topk``  pooling + learned block scores + top-k candidates
* ``selector/canonicalize`` ``BlockIndex.from_selection`` (window/sink merge, dedup, canonical form)
* ``selector/plan``         ``BlockIndex.plan`` (reuse counts, transposed index, hot/cold split)
* ``selector/total``        the three together, as one training step pays them (no host sync on this
                            path: capacity from the geometry, plan with shape-fixed arrays)
* ``selector/total[cuda_graph]`` with ``--graph``: the same path captured once in a CUDA graph and
                            replayed (proves it is capturable; the replay is checked against eager)
* ``distill/sparse[rows]``  sparse distillation target (from the kernel's lse) + KL + its backward,
                            for all rows of each query block and for a row subsample
* ``distill/sampled_target[blocks]`` the sampled dense target (``distill="sampled"``) alone: ``dense_block_mass``
                            over ``--sampled-blocks`` random query blocks with all their causal key blocks (the
                            per-row log-mass kernel where it runs); ``reference/sampled_target[blocks]`` the same
                            target by the PyTorch reference on fp32 copies (the path unsupported inputs take)
* ``attention/fwd_bwd``     ``st.sparse_attention(..., backend="auto")`` forward + backward
* ``module/fwd_bwd``        ``st.SparseAttention`` end to end on its sparse path (selector, plan, kernels,
                            distillation) with distill off / sparse / sampled (the default); the
                            differences to "off" are the distillation's cost in a step

With ``--compile`` (the ``"token"`` selector) it times the selector call eager against ``torch.compile(fullgraph=True)``
of it, the token selector's Triton kernels running in the compiled graph as custom ops, and checks the compiled results
against eager's:

* ``compile/selection[eager|compiled]``      ``pool`` + the scores of every block pair (no gradient) + top-k
* ``compile/token_distill[eager|compiled]``  the token-level distillation (``token_distillation_loss`` on
                            ``--sampled-blocks`` query blocks, pooling included) forward + backward into the selector's
                            parameters

With ``--kernel-table`` it also profiles five selections (the kernels, their device time and launches per
selection); with ``--sweep-pool`` it times the pooling kernel's tilings (``plan.pool_config``'s source);

and prints a table with each cost as a fraction of the attention forward+backward, against the
budgets the table checks: selector <= 10 %, sparse distillation <= 15 %. Timing: scripts/bench/harness.py
(warm-up, then ``--repeats`` repeats, median and p95; no cache flush: the phases run back to back in a step);
inputs: scripts/bench/inputs.py (seed 0).
If the Triton backend is unavailable the script says so, still times the selector, and skips the
attention timings unless ``--allow-reference`` (the reference backend is far slower, so ratios
against it mean little).

Usage::

    python -m scripts.bench.selector --out selector_bench.json
    python -m scripts.bench.selector --graph --repeats 100 --out selector_graph.json   # + CUDA-graph replay
    python -m scripts.bench.selector --selector-only --d 64 --kernel-table kernels.txt --sweep-pool --out s.json
    python -m scripts.bench.selector --device cpu --n 2048 --hq 4 --hkv 2 --d 64 --out /tmp/s.json  # smoke
    python -m scripts.bench.selector --selector token --candidates 32 --compile --selector-only --out t.json
"""

from __future__ import annotations

import argparse
import json
import math
import platform
import sys
from datetime import datetime, timezone
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

import sparse_train as st
from scripts.bench.harness import measure as measure_call
from scripts.bench.inputs import benchmark_inputs, candidates_argument
from sparse_train.cuda_graphs import capture_cuda_graph
from sparse_train.functional import resolve_backend
from sparse_train.kernels.reference.block_mass import reference_dense_block_mass
from sparse_train.kernels.triton.pool import block_pool_launch
from sparse_train.plan.tuning import pool_config
from sparse_train.selection import (
    block_kl,
    build_selector,
    dense_block_mass,
    rope_inverse_frequencies,
    sample_query_blocks,
    selection_candidates,
    selection_geometry,
    sparse_block_mass,
)

_DEFAULTS = st.SparseAttentionConfig()
"""The module's defaults, which the selector options take unless given."""


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--n", type=int, default=65536)
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--hq", type=int, default=32)
    p.add_argument("--hkv", type=int, default=8)
    p.add_argument("--d", type=int, default=128)
    p.add_argument("--block", type=int, default=64)
    p.add_argument("--top-k", type=int, default=16)
    p.add_argument("--window", type=int, default=8)
    p.add_argument("--sinks", type=int, default=1)
    p.add_argument(
        "--selector",
        choices=["pooled", "token"],
        default=_DEFAULTS.selector,
        help="SparseAttentionConfig.selector: block-pooled scorer or token-level indexer (default: the module's)",
    )
    p.add_argument("--selector-dim", type=int, default=32)
    p.add_argument("--index-heads", type=int, default=1, help="SparseAttentionConfig.selector_index_heads (token)")
    p.add_argument(
        "--selector-distill",
        choices=["block", "token"],
        default=_DEFAULTS.selector_distill,
        help="SparseAttentionConfig.selector_distill (token selector; default: the module's)",
    )
    p.add_argument(
        "--candidates",
        type=candidates_argument,
        default=_DEFAULTS.selector_candidates,
        help="SparseAttentionConfig.selector_candidates (token selector trained by --selector-distill token): a "
        "count, 'auto' (the module's default: 2 top_k from 8192 tokens up, exact scores below) or 'none' (exact "
        "scores)",
    )
    p.add_argument(
        "--rope-theta",
        type=float,
        default=10000.0,
        help="the selector un-rotates RoPE of this base before pooling, as the Transformer and the Hugging "
        "Face integration set it; 0 pools q and k as given",
    )
    p.add_argument("--dtype", choices=["bfloat16", "float16", "float32"], default="bfloat16")
    p.add_argument("--device", default="cuda")
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--repeats", type=int, default=20)
    p.add_argument(
        "--distill-rows",
        type=int,
        nargs="*",
        default=[0],
        help="rows per query block for the sparse distillation target; 0 = all rows (the kernels); "
        "a row subsample runs the PyTorch path",
    )
    p.add_argument(
        "--allow-reference",
        action="store_true",
        help="time attention through the reference backend when Triton is unavailable",
    )
    p.add_argument(
        "--graph",
        action="store_true",
        help="also capture selector + canonicalize + plan in a CUDA graph and time its replay",
    )
    p.add_argument(
        "--kernel-table",
        type=Path,
        default=None,
        metavar="FILE",
        help="five more selections under torch.profiler: the kernel table to FILE, the top kernels (time "
        "and launches per selection) to the JSON",
    )
    p.add_argument(
        "--sweep-pool",
        action="store_true",
        help="(CUDA) time the pooling kernel's tilings (rows, warps, heads per program) for q and k; the "
        "source of plan.pool_config's defaults",
    )
    p.add_argument(
        "--sampled-blocks",
        type=int,
        default=st.SparseAttentionConfig().distill_query_blocks,
        help="query blocks of the sampled dense target (default: the config's distill_query_blocks); "
        "0 skips its timing",
    )
    p.add_argument(
        "--selector-only",
        action="store_true",
        help="time only the selector phases (no distillation, attention or module timings)",
    )
    p.add_argument(
        "--compile",
        action="store_true",
        help="(token selector) time the selection and the token-level distillation eager and under "
        "torch.compile(fullgraph=True), and check the compiled results against eager",
    )
    p.add_argument("--out", type=Path, required=True, help="JSON output path")
    return p.parse_args(argv)


def measure(fn, device, warmup, repeats):
    """``{"median_ms", "p95_ms", "min_ms", "repeats"}`` of ``fn()``: ``warmup`` untimed calls, then ``repeats``
    timed ones back to back (no cache flush)."""
    timing = measure_call(fn, device=device, warmup=warmup, min_reps=repeats, max_reps=repeats, flush=False)
    return {"median_ms": timing.median_ms, "p95_ms": timing.p95_ms, "min_ms": timing.min_ms, "repeats": timing.repeats}


def kernel_table(selection, device, path: Path, repeats: int = 5) -> list[dict]:
    """Profile ``repeats`` selections; write the profiler's table to ``path`` and return the kernels (device
    time and launches per selection, largest first)."""
    cuda = device.type == "cuda"
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    selection()
    with profile(activities=activities) as prof:
        for _ in range(repeats):
            selection()
        if cuda:
            torch.cuda.synchronize(device)
    averages = prof.key_averages()
    sort_by = "self_cuda_time_total" if cuda else "self_cpu_time_total"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(averages.table(sort_by=sort_by, row_limit=60, max_name_column_width=90))
    rows = []
    for event in averages:
        self_us = getattr(event, "self_device_time_total", 0.0) if cuda else event.self_cpu_time_total
        if self_us > 0 and (not cuda or getattr(event, "device_type", None) == torch.autograd.DeviceType.CUDA):
            rows.append(
                {
                    "kernel": event.key[:120],
                    "launches_per_selection": event.count / repeats,
                    "us_per_selection": self_us / repeats,
                }
            )
    rows.sort(key=lambda row: -row["us_per_selection"])
    return rows[:40]


def sweep_pool(q, k, block: int, group: int, scorer, args) -> list[dict]:
    """Median milliseconds of the pooling kernel on q and k for each tiling (rows per step, warps, heads per
    program) around ``plan.pool_config``'s default, with the scorer's RoPE frequencies and mean + max pooling."""
    inv_freq = scorer.rope_inv_freq if scorer.rope_inv_freq.numel() else None
    default = pool_config(inv_freq is not None, block, q.shape[-1])
    padded = 1 << max(0, block - 1).bit_length()
    tilings = {default}
    for rows in {min(padded, 128)} if inv_freq is not None else {min(padded, 32), min(padded, 64)}:
        for warps in (2, 4, 8):
            for heads in (1, 2, 4, 8) if inv_freq is not None else (1, 2):
                tilings.add((rows, warps, heads))
    gbytes = (q.numel() + k.numel()) * q.element_size() / 1e9
    out = []
    for rows, warps, heads in sorted(tilings):

        def pool(rows=rows, warps=warps, heads=heads):
            tile = dict(rows=rows, num_warps=warps, heads_per_program=heads)
            return (
                block_pool_launch(q, block, group, None, inv_freq, None, True, **tile),
                block_pool_launch(k, block, 1, None, inv_freq, None, True, **tile),
            )

        ms = measure(pool, q.device, args.warmup, args.repeats)["median_ms"]
        out.append(
            {
                "rows": rows,
                "warps": warps,
                "heads_per_program": heads,
                "median_ms": ms,
                "tb_per_s": gbytes / ms,
                "default": (rows, warps, heads) == default,
            }
        )
        print(
            f"pool rows={rows:4d} warps={warps} heads/program={heads}  {ms:.4f} ms"
            f"{'  (default)' if out[-1]['default'] else ''}"
        )
    return out


def _relative_error(got: torch.Tensor, want: torch.Tensor) -> float:
    """|got - want| / |want| (Frobenius norms, float64)."""
    return ((got.double() - want.double()).norm() / want.double().norm().clamp_min(1e-30)).item()


def compile_comparison(scorer, q, k, geom, scale: float, args, device) -> tuple[dict, dict]:
    """Eager against ``torch.compile(fullgraph=True)`` of the token selector (``--compile``): timings (see the module
    docstring) and the checks of the compiled results against eager's: the block scores (largest absolute
    difference), the selection (equal), the distillation loss and the selector's gradients (relative errors)."""
    blk = args.block
    qd, kd = q.detach(), k.detach()
    picks = sample_query_blocks(geom.num_q_blocks, max(1, args.sampled_blocks), torch.Generator().manual_seed(0))
    picks = picks.to(device)

    def selection(q, k):
        qbar, kbar = scorer.pool(q, k, blk, blk)
        with torch.no_grad():
            scores = scorer(qbar, kbar, scale, geom)  # [B, HKV, NQB, NKB]
        return scores, selection_candidates(scores, geom, window=args.window, sinks=args.sinks)

    def distill_loss(q, k):
        qbar, kbar = scorer.pool(q, k, blk, blk)
        rows = scorer.query_rows(qbar, picks, blk)  # [B, HQ, R * BQ, D]
        total, count, _ = scorer.token_distillation_loss(rows, kbar, q, k, picks, scale, blk)
        return total / count

    compiled_selection = torch.compile(selection, fullgraph=True)
    compiled_loss = torch.compile(distill_loss, fullgraph=True)

    def distill_step(loss_fn):
        scorer.zero_grad(set_to_none=True)
        loss = loss_fn(qd, kd)
        loss.backward()
        return loss.detach(), [p.grad.clone() for p in scorer.parameters() if p.grad is not None]

    timings = {}
    for label, fn in (("eager", selection), ("compiled", compiled_selection)):
        timings[f"compile/selection[{label}]"] = measure(lambda fn=fn: fn(qd, kd), device, args.warmup, args.repeats)
    for label, fn in (("eager", distill_loss), ("compiled", compiled_loss)):
        timings[f"compile/token_distill[{label}]"] = measure(
            lambda fn=fn: distill_step(fn), device, args.warmup, args.repeats
        )
    (scores, picked), (scores_c, picked_c) = selection(qd, kd), compiled_selection(qd, kd)
    (loss, grads), (loss_c, grads_c) = distill_step(distill_loss), distill_step(compiled_loss)
    finite = torch.isfinite(scores)
    checks = {
        "scores_finite_pattern_equal": bool(torch.equal(finite, torch.isfinite(scores_c))),
        "scores_max_abs_diff": (scores_c[finite] - scores[finite]).abs().max().item() if finite.any() else 0.0,
        "selection_equal": bool(torch.equal(picked, picked_c)),
        "selection_rows_differing": int((picked.sort(-1).values != picked_c.sort(-1).values).any(-1).sum()),
        "distill_loss": loss.item(),
        "distill_loss_rel_err": abs(loss_c.item() - loss.item()) / max(abs(loss.item()), 1e-30),
        "selector_grad_rel_err": max(_relative_error(g, w) for g, w in zip(grads_c, grads)),
    }
    checks["ok"] = (
        checks["scores_finite_pattern_equal"]
        and checks["selection_rows_differing"] == 0
        and checks["distill_loss_rel_err"] < 1e-3
        and checks["selector_grad_rel_err"] < 3e-2
    )
    for label in ("selection", "token_distill"):
        eager_ms = timings[f"compile/{label}[eager]"]["median_ms"]
        compiled_ms = timings[f"compile/{label}[compiled]"]["median_ms"]
        print(f"{label}: eager {eager_ms:.3f} ms, compiled {compiled_ms:.3f} ms ({eager_ms / compiled_ms:.2f}x)")
    print(f"compiled vs eager: {checks}")
    return timings, checks


def main(argv=None) -> int:
    args = parse_args(argv)
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        print("CUDA is not available; rerun with --device cpu for a smoke run", file=sys.stderr)
        return 2
    dtype = getattr(torch, args.dtype)
    b, hq, hkv, n, d, blk = args.batch, args.hq, args.hkv, args.n, args.d, args.block
    q, k, v, grad_out = benchmark_inputs(
        n, d, seed=0, batch=b, heads=hq, kv_heads=hkv, dtype=dtype, device=device, requires_grad=True
    )
    scale = 1.0 / math.sqrt(d)
    geom = selection_geometry(n, blk, blk, args.top_k, args.window, args.sinks)
    # the module's scorer with its defaults (pooling, distance bias), of the kind --selector names
    token_level = {"selector_distill": args.selector_distill, "selector_candidates": args.candidates}
    selector_cfg = st.SparseAttentionConfig(
        top_k=args.top_k,
        window=args.window,
        sinks=args.sinks,
        selector=args.selector,
        selector_dim=args.selector_dim,
        selector_index_heads=args.index_heads,
        **token_level,
    )
    candidate_blocks = selector_cfg.selector_candidates_at(n)
    scorer = build_selector(selector_cfg, hq, hkv, d).to(device)
    if args.rope_theta > 0:
        scorer.set_rope(rope_inverse_frequencies(args.rope_theta, d))
    timings: dict[str, dict] = {}
    notes: list[str] = []

    def scores_topk():
        qbar, kbar = scorer.pool(q, k, blk, blk)
        with torch.no_grad():
            scores = scorer(qbar, kbar, scale, geom)  # with the distance bias, as the module scores
        return selection_candidates(scores, geom, window=args.window, sinks=args.sinks)

    candidates = scores_topk()

    def pool():
        return scorer.pool(q, k, blk, blk)

    def canonicalize():
        return st.BlockIndex.from_selection(
            candidates,
            seq_len=n,
            block_q=blk,
            block_k=blk,
            window=args.window,
            sinks=args.sinks,
            capacity=geom.capacity,
            check="none",
        )

    index = canonicalize()

    def plan():
        fresh = st.BlockIndex.from_canonical(
            index.indices, index.counts, seq_len=n, block_q=blk, block_k=blk, check="none"
        )
        return fresh.plan()

    def selector_total():
        idx = st.BlockIndex.from_selection(
            scores_topk(),
            seq_len=n,
            block_q=blk,
            block_k=blk,
            window=args.window,
            sinks=args.sinks,
            capacity=geom.capacity,
            check="none",
        )
        return idx.plan()

    timings["selector/pool"] = measure(pool, device, args.warmup, args.repeats)
    timings["selector/scores_topk"] = measure(scores_topk, device, args.warmup, args.repeats)
    timings["selector/canonicalize"] = measure(canonicalize, device, args.warmup, args.repeats)
    timings["selector/plan"] = measure(plan, device, args.warmup, args.repeats)
    timings["selector/total"] = measure(selector_total, device, args.warmup, args.repeats)
    if args.graph:
        if device.type != "cuda":
            notes.append("--graph needs CUDA; skipped")
        else:
            graph, captured = capture_cuda_graph(selector_total, warmup=3)
            timings["selector/total[cuda_graph]"] = measure(graph.replay, device, args.warmup, args.repeats)
            graph.replay()
            eager = selector_total()
            same = all(
                torch.equal(getattr(captured, name), getattr(eager, name))
                for name in ("reuse", "kv_indptr", "kv_qblocks", "hot", "stats")
            )
            notes.append(f"CUDA-graph replay equals eager: {same}")

    compile_checks = None
    if args.compile:
        if args.selector != "token":
            notes.append("--compile compares the token selector; skipped for the pooled one")
        else:
            compile_timings, compile_checks = compile_comparison(scorer, q, k, geom, scale, args, device)
            timings.update(compile_timings)
            notes.append(f"compiled == eager: {compile_checks['ok']}")

    kernels = kernel_table(selector_total, device, args.kernel_table) if args.kernel_table else None
    pool_sweep = None
    if args.sweep_pool:
        if device.type != "cuda" or scorer.rope_inv_freq.device.type != "cuda" or args.selector != "pooled":
            notes.append("--sweep-pool needs CUDA and the pooled selector; skipped")
        else:
            pool_sweep = sweep_pool(q, k, blk, hq // hkv, scorer, args)

    backend, reason = resolve_backend(q, k, v, index, "auto")
    if args.selector_only:
        args.distill_rows = []
    if backend != "triton":
        notes.append(f"Triton backend unavailable for this input ({reason}); attention would run on the reference")
        print(f"NOTE: {notes[-1]}", file=sys.stderr)
    time_attention = (backend == "triton" or args.allow_reference) and not args.selector_only

    with torch.no_grad():
        _, lse = st.sparse_attention(q, k, v, index, scale=scale, return_lse=True, backend="auto")
    qbar, kbar = scorer.pool(q, k, blk, blk)
    slots = index.indices.to(torch.int64)
    for rows in args.distill_rows:
        rows_arg = None if rows == 0 else rows
        label = "all" if rows_arg is None else str(rows_arg)

        def distill():
            target, valid = sparse_block_mass(q, k, index, scale=scale, lse=lse, rows_per_block=rows_arg)
            logits = scorer(qbar, kbar, scale, geom).gather(-1, slots.clamp(min=0))
            loss = block_kl(target, logits, slots >= 0, valid)
            loss.backward()
            return loss

        try:
            timings[f"distill/sparse[rows={label}]"] = measure(distill, device, args.warmup, args.repeats)
        except torch.OutOfMemoryError as err:
            notes.append(f"distill rows={label}: out of memory ({err})")
            torch.cuda.empty_cache()
    if args.sampled_blocks > 0 and not args.selector_only:
        picks = sample_query_blocks(-(-n // blk), args.sampled_blocks, torch.Generator().manual_seed(0))
        label = f"blocks={len(picks)}"
        qd, kd = q.detach(), k.detach()
        qf, kf = qd.float(), kd.float()
        timings[f"distill/sampled_target[{label}]"] = measure(
            lambda: dense_block_mass(qd, kd, block_q=blk, block_k=blk, scale=scale, query_blocks=picks),
            device,
            args.warmup,
            args.repeats,
        )
        timings[f"reference/sampled_target[{label}]"] = measure(
            lambda: reference_dense_block_mass(qf, kf, block_q=blk, block_k=blk, scale=scale, query_blocks=picks),
            device,
            args.warmup,
            args.repeats,
        )

    if time_attention:
        fixed_plan = index.plan()

        def attention():
            q.grad = k.grad = v.grad = None
            out = st.sparse_attention(q, k, v, index, scale=scale, backend="auto", kernel_options={"plan": fixed_plan})
            out.backward(grad_out)

        timings["attention/fwd_bwd"] = measure(attention, device, args.warmup, args.repeats)

        # the module on its sparse path (no dense warm-up) with each distillation mode; the differences
        # to distill="off" are what the distillation costs inside a training step
        # candidates apply only with distill sampled or off (under "sparse" the selector would score every pair)
        distills = ("off", "sampled") if candidate_blocks is not None else ("off", "sparse", "sampled")
        for distill in distills:
            cfg = st.SparseAttentionConfig(
                block_q=blk,
                block_k=blk,
                top_k=args.top_k,
                window=args.window,
                sinks=args.sinks,
                selector=args.selector,
                selector_dim=args.selector_dim,
                selector_index_heads=args.index_heads,
                distill=distill,
                dense_warmup_steps=0,
                selector_rope_theta=args.rope_theta if args.rope_theta > 0 else None,
                **token_level,
            )
            module = st.SparseAttention(cfg, num_heads=hq, num_kv_heads=hkv, head_dim=d).to(device).train()

            def module_step():
                q.grad = k.grad = v.grad = None
                out = module(q, k, v)
                loss = (out * grad_out).sum()
                if module.selector_loss is not None:
                    loss = loss + module.selector_loss
                loss.backward()

            timings[f"module/fwd_bwd(distill={distill})"] = measure(module_step, device, args.warmup, args.repeats)
            notes.append(f"module distill={distill} fallbacks: {module.fallback_counts}")
        off = timings["module/fwd_bwd(distill=off)"]["median_ms"]
        for distill in distills[1:]:
            extra = timings[f"module/fwd_bwd(distill={distill})"]["median_ms"] - off
            timings[f"distill/{distill} in module (minus distill=off)"] = {"median_ms": extra, "p95_ms": float("nan")}

    attn_ms = timings.get("attention/fwd_bwd", {}).get("median_ms")
    budgets = {"selector/total": 0.10}
    budgets.update({key: 0.15 for key in timings if key.startswith("distill/")})
    rows_out = []
    print(
        f"\nselector benchmark  N={n} B={b} HQ={hq} HKV={hkv} D={d} {args.dtype} BQ=BK={blk} "
        f"top_k={args.top_k} window={args.window} sinks={args.sinks}  backend={backend}"
    )
    print(f"{'phase':38s} {'median ms':>10s} {'p95 ms':>10s} {'% of attn':>10s} {'budget':>8s}")
    for key, t in timings.items():
        share = t["median_ms"] / attn_ms if attn_ms else None
        budget = budgets.get(key)
        verdict = "" if share is None or budget is None else ("ok" if share <= budget else "OVER")
        share_txt = f"{100 * share:9.1f}%" if share is not None else f"{'-':>10s}"
        budget_txt = f"{100 * budget:.0f}% {verdict}" if budget is not None else ""
        print(f"{key:38s} {t['median_ms']:10.3f} {t['p95_ms']:10.3f} {share_txt} {budget_txt:>8s}")
        rows_out.append(
            {
                "phase": key,
                **t,
                "fraction_of_attention": share,
                "budget": budget,
                "within_budget": None if share is None or budget is None else share <= budget,
            }
        )
    for note in notes:
        print(f"note: {note}")

    result = {
        "date": datetime.now(timezone.utc).isoformat(),
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else platform.processor() or "cpu",
        "torch": torch.__version__,
        "shape": {
            "N": n,
            "B": b,
            "HQ": hq,
            "HKV": hkv,
            "D": d,
            "dtype": args.dtype,
            "BQ": blk,
            "BK": blk,
            "top_k": args.top_k,
            "window": args.window,
            "sinks": args.sinks,
            "selector_dim": args.selector_dim,
            "rope_theta": args.rope_theta,
            "selector": args.selector,
            "index_heads": args.index_heads,
            "selector_distill": selector_cfg.resolved_selector_distill,
            "candidates": candidate_blocks,
            "query_pooling": selector_cfg.query_pooling if args.selector == "pooled" else None,
            "key_pooling": selector_cfg.key_pooling if args.selector == "pooled" else None,
            "distance_bias": scorer.distance_bias is not None,
        },
        "index": {
            "capacity": index.capacity,
            "selected_blocks_per_head": geom.selected_blocks,
            "block_density": geom.block_density,
        },
        "backend": backend,
        "backend_reason": reason,
        "results": rows_out,
        "notes": notes,
    }
    if kernels is not None:
        result["selector_kernels"] = kernels
    if compile_checks is not None:
        result["compile_checks"] = compile_checks
    if pool_sweep is not None:
        result["pool_sweep"] = pool_sweep
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2))
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
