"""Benchmark: Triton block-sparse attention against dense causal SDPA (cuDNN, flash) and compiled
FlexAttention on the same block indices, on one GPU, in one process.

    python -m scripts.bench.attention --out docs/benchmarks
    python -m scripts.bench.attention --n 65536 --head-dim 64 --no-sweep --out /tmp/attention
    python -m scripts.bench.attention --packed 2048:16384 --n 65536 --no-sweep --out /tmp/packed
    python -m scripts.bench.attention --dry-run            # CPU: the packed inputs built and checked, no timing

Protocol (CONTRIBUTING.md, "Benchmarks"): ceilings first (device copy bandwidth, bf16 matmul, random data);
then per sequence length N and pattern: index build + plan time, our fwd / bwd / fwd+bwd (and
deterministic, fused-dQ and stored-dS fwd+bwd), dense causal SDPA (cuDNN and flash backends), FlexAttention
compiled with a BlockMask built from our indices (diagonal blocks partial with a causal mask_mod, the rest full).
Timing (scripts/bench/harness.py): warm-up, L2 flushed before each repeat, median and p95; effective TFLOP/s
counting only causally valid (q, k) pairs inside selected blocks (4*D FLOPs per pair per query head forward, 2.5x
that backward), fraction of the measured matmul ceiling, peak extra memory. Device time: the GPU kept busy by a
sleep kernel while the host launches. CUDA-graph replay: forward + backward captured once and replayed.
r0 sweep (hybrid backward): time of the dQ+atomic kernel, of the KV-centric kernel, workspace bytes.
Sustained (--sustained SECONDS, default 6): every implementation's forward + backward, and the matmul ceiling,
back to back that long with nvidia-smi sampling power and SM clock: under load the GPU sits at its power cap and
below its top clock, which timings on a cool GPU do not show.

Inputs (scripts/bench/inputs.py): B=1, HQ=32, HKV=8, D=128 (--head-dim), bf16; patterns
P64 = BQ=BK=64, 1 sink + 8 window + 16 random top-k causal blocks (seeded);
P128 = BQ=BK=128, 1 sink + 4 window + 8 top-k.

Packed mode (--packed LO:HI): the row packs documents of random lengths in [LO, HI] (seeded per N, the
last one cut at N); each token attends its own document only (``document_ids``). The pattern's
selection loses the blocks that share no document with their query block (what a document-aware
selection drops), and on that same selection we time our fwd / bwd / fwd+bwd with the document mask,
our kernels without it (the mask's overhead), and FlexAttention with a BlockMask built from the same
index plus a document_id mask_mod (blocks crossing the diagonal or a document boundary partial, the
rest full). TFLOP/s count only the valid (same-document, causal) pairs. No dense SDPA, no r0 sweep.
--dry-run builds the packed inputs, selection and Flex BlockMask on the CPU at small N and checks them
(no timing; tests/scripts/test_bench_attention.py runs it).

Options: --quick (N=65536 only), --n N [N ...], --pattern P64|P128, --no-flex / --no-dense / --no-sweep,
--tune [fwd dq kv chunk tma stored] (launch-config sweeps at the largest N), --head-dim D, --packed LO:HI,
--sustained SECONDS, --dry-run.
Outputs: <out>/attention.{json,md,png} (packed: <out>/attention_packed.*), the run's date inside.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import time
import traceback

import torch
import triton
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.nn.attention.flex_attention import BlockMask, flex_attention

from scripts.bench.harness import (
    ceilings,
    flush_l2,
    measure,
    peak_extra_mb,
    quantile,
    record_graph_time,
    record_sustained,
)
from scripts.bench.inputs import (
    HKV,
    HQ,
    PATTERNS,
    B,
    D,
    benchmark_inputs,
    build_index,
    packed_document_ids,
    random_selection,
)
from sparse_train.documents import block_document_ranges
from sparse_train.kernels.triton import backward as kb
from sparse_train.kernels.triton import forward as kf
from sparse_train.kernels.triton.op import triton_sparse_attention
from sparse_train.plan import plan as planning
from sparse_train.plan import tuning
from sparse_train.timing import elapsed_ms, stage_events

OUTPUT_STEM = "attention"


def valid_pairs(idx, docs=None, chunk=64):
    """Causally valid (query, key) pairs inside selected blocks, summed over batch and KV heads (same
    document only, with ``docs``), counted exactly, query blocks in chunks."""
    n, bq, bk = idx.seq_len, idx.block_q, idx.block_k
    device = idx.indices.device
    total = 0
    for c0 in range(0, idx.num_q_blocks, chunk):
        blocks = idx.indices[:, :, c0 : c0 + chunk].to(torch.int64)  # [B, HKV, C, K]
        c = blocks.shape[2]
        kpos = (blocks.clamp_min(0).unsqueeze(-1) * bk + torch.arange(bk, device=device)).flatten(-2)  # [B,HKV,C,K*BK]
        kok = (blocks >= 0).unsqueeze(-1).expand(-1, -1, -1, -1, bk).flatten(-2) & (kpos < n)
        qpos = torch.arange(c0, c0 + c, device=device).view(-1, 1) * bq + torch.arange(bq, device=device)  # [C, BQ]
        ok = kok.unsqueeze(3) & (kpos.unsqueeze(3) <= qpos.view(1, 1, c, bq, 1)) & (qpos.view(1, 1, c, bq, 1) < n)
        if docs is not None:
            dk = docs.long().gather(1, kpos.clamp(max=n - 1).flatten(1)).view(kpos.shape)
            dq = docs.long()[:, qpos.clamp(max=n - 1).flatten()].view(-1, 1, c, bq, 1)
            ok = ok & (dk.unsqueeze(3) == dq)
        total += int(ok.sum())
    return total


def flex_block_mask(idx, N, docs=None):
    """BlockMask from our canonical index: blocks crossing the diagonal (and, with ``docs`` int32
    ``[B, N]``, a document boundary) are partial, with a causal (and same-document) mask_mod, the others
    full.  H = HQ (each query head gets its KV head's selection)."""
    bq, bk = idx.block_q, idx.block_k
    dense = idx.to_dense()  # [B, HKV, NQB, NKB]
    nqb, nkb = dense.shape[-2:]
    qi = torch.arange(nqb, device=dense.device).view(-1, 1)
    kj = torch.arange(nkb, device=dense.device).view(1, -1)
    crosses = (kj * bk + bk - 1 > qi * bq) | (kj * bk + bk > N)
    if docs is not None:
        # a block before the diagonal is in one document iff its first key and the query block's last
        # query share an id (the kernels' skip rule)
        rq = block_document_ranges(docs, bq)
        rk = block_document_ranges(docs, bk)
        crosses = crosses | (rk[:, None, :, 0] != rq[:, :, None, 1]).unsqueeze(1)
    partial = dense & crosses
    full = dense & ~crosses

    def compact(mask):
        num = mask.sum(-1).to(torch.int32)
        ind = torch.argsort((~mask).to(torch.int8), dim=-1, stable=True).to(torch.int32)
        g = HQ // HKV
        return num.repeat_interleave(g, dim=1).contiguous(), ind.repeat_interleave(g, dim=1).contiguous()

    pn, pi = compact(partial)
    fn, fi = compact(full)

    def causal(b, h, q, kv):
        return q >= kv

    def causal_document(b, h, q, kv):
        return (q >= kv) & (docs[b, q] == docs[b, kv])

    return BlockMask.from_kv_blocks(
        pn, pi, fn, fi, BLOCK_SIZE=(bq, bk), mask_mod=causal if docs is None else causal_document, seq_lengths=(N, N)
    )


def rec(results, row):
    results["rows"].append(row)
    print(json.dumps(row), flush=True)


def run_ours(N, pat_name, pat, sel, ceil, results, args, q, k, v, do, docs=None):
    # index build + plan, each rep a fresh index (the plan cache lives on the index)
    t_idx, t_idx95, *_ = measure(lambda: build_index(sel, N, pat, docs=docs), warmup=1, min_reps=5, budget_ms=200)
    idx, plan = build_index(sel, N, pat, docs=docs)
    pairs = idx.density() * N * (N + 1) / 2 * B * HQ if docs is None else valid_pairs(idx, docs) * (HQ // HKV)
    f_fwd = 4 * D * pairs
    f_bwd = 2.5 * f_fwd
    row = dict(
        kind="ours" if docs is None else "ours_packed",
        N=N,
        pattern=pat_name,
        density=idx.density(),
        mean_blocks=float(idx.counts.float().mean()),
        index_plan_ms=t_idx,
        index_plan_p95_ms=t_idx95,
        num_hot=plan.num_hot,
        num_cold=plan.num_cold,
        r0=plan.r0,
        max_reuse=plan.max_reuse,
    )
    if docs is not None:
        row.update(
            documents=int(docs[0, -1]) + 1, valid_pair_fraction=pairs / (idx.density() * N * (N + 1) / 2 * B * HQ)
        )
        # the same selection without the document mask: the mask's cost (a different function)
        t = measure(lambda: triton_sparse_attention(q, k, v, idx, kernel_options={"plan": plan})).median_ms
        row["nodocs_fwd_ms"] = t
    t, t95, *_ = measure(
        lambda: triton_sparse_attention(q, k, v, idx, kernel_options={"plan": plan}, document_ids=docs)
    )
    row.update(fwd_ms=t, fwd_p95_ms=t95, fwd_TFLOPs=f_fwd / t / 1e9, fwd_frac_ceiling=f_fwd / t / 1e9 / ceil)
    qg, kg, vg = (x.detach().clone().requires_grad_() for x in (q, k, v))
    if docs is not None:

        def fb_nodocs():
            oo, _ = triton_sparse_attention(qg, kg, vg, idx, kernel_options={"plan": plan})
            torch.autograd.grad(oo, (qg, kg, vg), do)

        row["nodocs_fwdbwd_ms"] = measure(fb_nodocs).median_ms
    # the default backward, the deterministic one, the fused one (dQ from the KV-centric kernel by atomics) and
    # the stored-dS one (the KV-centric kernel files dS, the dQ kernel reads it)
    for pfx, det, extra in (
        ("", False, {}),
        ("det_", True, {}),
        ("fused_", False, {"fused_dq": True}),
        ("stored_", False, {"stored_ds": True}),
    ):
        options = {"plan": plan, **extra}
        o, _ = triton_sparse_attention(qg, kg, vg, idx, deterministic=det, kernel_options=options, document_ids=docs)
        tb, tb95, *_ = measure(lambda: torch.autograd.grad(o, (qg, kg, vg), do, retain_graph=True))
        # o's graph holds the leaves' gradient accumulators, made on the default stream: alive through the capture
        # below, they make the captured backward wait on that stream, which invalidates the capture
        o = None

        def fb():
            oo, _ = triton_sparse_attention(
                qg, kg, vg, idx, deterministic=det, kernel_options=options, document_ids=docs
            )
            torch.autograd.grad(oo, (qg, kg, vg), do)

        tfb, tfb95, *_ = measure(fb)
        if pfx == "":
            # device time: the GPU kept busy while the host launches (as in a training step, where the previous
            # layer's kernels hide the host work); the competitors are timed the same way
            row["fwd_device_ms"] = measure(
                lambda: triton_sparse_attention(q, k, v, idx, kernel_options={"plan": plan}, document_ids=docs),
                busy=True,
            ).median_ms
            row["fwdbwd_device_ms"] = measure(fb, busy=True).median_ms

            def fb_capturable():  # no host read of the document ids' values (a capture cannot sync)
                oo, _ = triton_sparse_attention(
                    qg, kg, vg, idx, kernel_options=options, document_ids=docs, check_values=False
                )
                torch.autograd.grad(oo, (qg, kg, vg), do)

            # before any capture: run after one, the held loop's allocator reserve grows until it runs out of
            # memory (observed; the mechanism is not isolated)
            record_sustained(row, fb, args.sustained)
            record_graph_time(row, fb_capturable)
        row.update(
            {
                f"{pfx}bwd_ms": tb,
                f"{pfx}bwd_p95_ms": tb95,
                f"{pfx}fwdbwd_ms": tfb,
                f"{pfx}fwdbwd_p95_ms": tfb95,
                f"{pfx}bwd_TFLOPs": f_bwd / tb / 1e9,
                f"{pfx}bwd_frac_ceiling": f_bwd / tb / 1e9 / ceil,
            }
        )
        if pfx in ("", "stored_"):
            row[f"{pfx}fwdbwd_peak_extra_MB"] = peak_extra_mb(fb)
        for name in ("dq", "dkdv"):  # the fused mode does not launch dQ: its entry is the last default one
            if name in kb.LAST_COMPILED and not (name == "dq" and pfx == "fused_"):
                ck = kb.LAST_COMPILED[name]
                row.update({f"{pfx}{name}_regs": ck.n_regs, f"{pfx}{name}_spills": ck.n_spills})
    row["det_overhead"] = row["det_fwdbwd_ms"] / row["fwdbwd_ms"] - 1
    row["fused_bwd_speedup"] = row["bwd_ms"] / row["fused_bwd_ms"]
    row["stored_bwd_speedup"] = row["bwd_ms"] / row["stored_bwd_ms"]
    rec(results, row)
    return idx, plan


def run_dense(N, results, q, k, v, do, sustained=0.0):
    g = HQ // HKV
    ke, ve = k.repeat_interleave(g, 1), v.repeat_interleave(g, 1)
    f_fwd = 4 * D * N * (N + 1) / 2 * B * HQ
    for name, be in (("cudnn", SDPBackend.CUDNN_ATTENTION), ("flash", SDPBackend.FLASH_ATTENTION)):
        row = dict(kind=f"dense_{name}", N=N)
        try:
            with sdpa_kernel([be]):
                fwd = lambda: torch.nn.functional.scaled_dot_product_attention(q, ke, ve, is_causal=True)  # noqa: E731
                budget = 400.0
                t, t95, *_ = measure(fwd, warmup=1, min_reps=3, budget_ms=budget)
                qg, kg, vg = (x.detach().clone().requires_grad_() for x in (q, ke, ve))

                def fb():
                    o = torch.nn.functional.scaled_dot_product_attention(qg, kg, vg, is_causal=True)
                    torch.autograd.grad(o, (qg, kg, vg), do)

                tfb, tfb95, *_ = measure(fb, warmup=1, min_reps=3, budget_ms=budget)
                tfb_device = measure(fb, warmup=0, min_reps=3, budget_ms=budget, busy=True).median_ms
                record_sustained(row, fb, sustained)  # before the capture (run_ours)
                record_graph_time(row, fb)
            row.update(
                fwd_ms=t,
                fwd_p95_ms=t95,
                fwdbwd_ms=tfb,
                fwdbwd_p95_ms=tfb95,
                bwd_ms=tfb - t,
                fwdbwd_device_ms=tfb_device,
                fwd_TFLOPs=f_fwd / t / 1e9,
                fwdbwd_TFLOPs=3.5 * f_fwd / tfb / 1e9,
            )
        except Exception as exc:  # report, don't crash the run
            row["error"] = f"{type(exc).__name__}: {str(exc)[:300]}"
        rec(results, row)


_FLEX = None


def run_flex(N, pat_name, idx, results, q, k, v, do, docs=None, sustained=0.0):
    global _FLEX
    # Every (N, pattern, kernel options) is a new specialisation; past dynamo's recompile limit the
    # compiled wrapper silently runs flex_attention EAGERLY (unfused, materialises N^2 scores).
    # Reset dynamo per case.
    torch._dynamo.reset()
    for name, val in (("recompile_limit", 64), ("cache_size_limit", 64), ("accumulated_recompile_limit", 1024)):
        if hasattr(torch._dynamo.config, name):
            setattr(torch._dynamo.config, name, val)
    _FLEX = torch.compile(flex_attention, dynamic=False)
    row = dict(kind="flex" if docs is None else "flex_packed", N=N, pattern=pat_name)
    try:
        t0 = time.perf_counter()
        bm = flex_block_mask(idx, N, docs)
        row["blockmask_build_s"] = time.perf_counter() - t0
    except Exception as exc:
        row["error"] = f"BlockMask: {type(exc).__name__}: {str(exc)[:300]}"
        rec(results, row)
        return
    opts_list = [None] if idx.block_q >= 128 else [None, {"BLOCK_M": 64, "BLOCK_N": 64}]
    for opts in opts_list:
        try:
            fwd = lambda: _FLEX(q, k, v, block_mask=bm, enable_gqa=True, kernel_options=opts)  # noqa: E731
            t0 = time.perf_counter()
            fwd()
            torch.cuda.synchronize()
            row["fwd_compile_s"] = time.perf_counter() - t0
            t, t95, *_ = measure(fwd)
            row.update(fwd_ms=t, fwd_p95_ms=t95, fwd_kernel_options=str(opts))
            row["fwd_device_ms"] = measure(fwd, busy=True).median_ms
            # same indices, same function: the outputs must agree (bf16 rounding only)
            ours, _ = triton_sparse_attention(q, k, v, idx, document_ids=docs)
            ref = fwd().float()
            row["rel_diff_vs_ours"] = float((ours.float() - ref).norm() / ref.norm())
            if "fwd_error" in row:
                row["fwd_failed_attempts"] = row.pop("fwd_error")
            break
        except Exception as exc:
            row["fwd_error"] = row.get("fwd_error", "") + f" [opts={opts}: {type(exc).__name__}: {str(exc)[:240]}]"
    bopts_list = (
        [None]
        if idx.block_q >= 128
        else [
            None,
            {"BLOCK_M": 64, "BLOCK_N": 64, "BLOCK_M1": 32, "BLOCK_N1": 64, "BLOCK_M2": 64, "BLOCK_N2": 32},
            {
                "BLOCK_M": 64,
                "BLOCK_N": 64,
                "BLOCK_M1": 64,
                "BLOCK_N1": 64,
                "BLOCK_M2": 64,
                "BLOCK_N2": 64,
                "num_stages": 1,
            },
        ]
    )
    for opts in bopts_list:
        try:
            qg, kg, vg = (x.detach().clone().requires_grad_() for x in (q, k, v))

            def fb():
                o = _FLEX(qg, kg, vg, block_mask=bm, enable_gqa=True, kernel_options=opts)
                torch.autograd.grad(o, (qg, kg, vg), do)

            t0 = time.perf_counter()
            fb()
            torch.cuda.synchronize()
            row["bwd_compile_s"] = time.perf_counter() - t0
            tfb, tfb95, *_ = measure(fb)
            row.update(fwdbwd_ms=tfb, fwdbwd_p95_ms=tfb95, fwdbwd_kernel_options=str(opts))
            row["fwdbwd_device_ms"] = measure(fb, busy=True).median_ms
            record_sustained(row, fb, sustained)  # before the capture (run_ours)
            record_graph_time(row, fb)
            if "fwd_ms" in row:
                row["bwd_ms"] = tfb - row["fwd_ms"]
            if "fwdbwd_error" in row:
                row["fwdbwd_failed_attempts"] = row.pop("fwdbwd_error")
            break
        except Exception as exc:
            row["fwdbwd_error"] = (
                row.get("fwdbwd_error", "") + f" [opts={opts}: {type(exc).__name__}: {str(exc)[:240]}]"
            )
    rec(results, row)


def r0_sweep(N, pat_name, pat, sel, results, q, k, v, do):
    idx, _ = build_index(sel, N, pat)
    base = idx.plan(1)
    max_reuse = base.max_reuse
    qd, kd, vd = q, k, v
    scale = 1 / math.sqrt(D)
    o, lse = kf.sparse_attn_forward(
        q, k, v, idx.indices, idx.counts, block_q=pat["block"], block_k=pat["block"], scale=scale
    )
    r0s = sorted({1, 2, 4, 8, 12, 16, 24, 32, 64, max_reuse + 1})
    for det in (False, True):
        for r0 in r0s if not det else [max_reuse + 1]:
            plan = idx.plan(r0)
            slots = planning.cold_slots(plan.hot, plan.reuse, det)
            num_cold = 0 if det else plan.num_cold
            ev = stage_events(4)

            def bwd():
                kb.sparse_attn_backward(
                    do,
                    qd,
                    kd,
                    vd,
                    o,
                    lse,
                    idx.indices,
                    idx.counts,
                    plan.kv_indptr,
                    plan.kv_qblocks,
                    slots,
                    num_cold,
                    block_q=pat["block"],
                    block_k=pat["block"],
                    scale=scale,
                    stage_events=ev,
                )

            t, t95, *_ = measure(bwd)
            # per-stage breakdown (median over a few runs)
            pre, dq_t, kv_t = [], [], []
            for _ in range(5):
                flush_l2()
                bwd()
                pre.append(elapsed_ms(ev[0], ev[1]))
                dq_t.append(elapsed_ms(ev[1], ev[2]))
                kv_t.append(elapsed_ms(ev[2], ev[3]))
            med = lambda xs: quantile(xs, 0.5)  # noqa: E731
            rec(
                results,
                dict(
                    kind="r0_sweep",
                    N=N,
                    pattern=pat_name,
                    r0=r0,
                    deterministic=det,
                    bwd_ms=t,
                    bwd_p95_ms=t95,
                    preprocess_ms=med(pre),
                    dq_atomic_kernel_ms=med(dq_t),
                    kv_centric_kernel_ms=med(kv_t),
                    num_hot=0 if det else plan.num_hot,
                    num_cold=num_cold,
                    workspace_bytes=2 * num_cold * pat["block"] * D * 4,
                ),
            )


TUNE_PARTS = ("fwd", "dq", "kv", "chunk", "tma", "stored")


def tune(N, pat_name, pat, sel, results, q, k, v, do, parts=TUNE_PARTS):
    """Launch-config sweeps at one N: forward (heads per program, warps, stages); backward in
    deterministic mode (so the dQ kernel and the KV-centric kernel are timed apart): dQ tiles,
    KV-centric tiles (heads per program, warps, stages, rows per step), KV chunk size; TMA descriptor loads
    on and off in each kernel (default tiles, and one pipeline stage more with TMA); the stored-dS backward with
    the KV-centric kernel's TMA (q/dO loads and dS stores) on and off. ``parts``: which
    of :data:`TUNE_PARTS` to sweep."""
    idx, plan = build_index(sel, N, pat)
    scale = 1 / math.sqrt(D)
    bs = pat["block"]
    pairs = idx.density() * N * (N + 1) / 2 * B * HQ
    fwd_cfgs = [(h, w, s) for h in (1, 2, 4) for w in (4, 8) for s in (2, 3) if h * bs <= 256] if "fwd" in parts else []
    for hpp, nw, ns in fwd_cfgs:
        cfg = dict(kind="tune_fwd", N=N, pattern=pat_name, hpp=hpp, num_warps=nw, num_stages=ns)
        try:
            config = tuning.ForwardConfig(hpp, nw, ns)
            t = measure(
                lambda: kf.sparse_attn_forward(
                    q, k, v, idx.indices, idx.counts, block_q=bs, block_k=bs, scale=scale, config=config
                ),
                budget_ms=100,
            ).median_ms
            ck = kf.LAST_COMPILED["fwd"]
            cfg.update(ms=t, TFLOPs=4 * D * pairs / t / 1e9, regs=ck.n_regs, spills=ck.n_spills)
        except Exception as exc:
            cfg["error"] = f"{type(exc).__name__}: {str(exc)[:200]}"
        rec(results, cfg)
    group = HQ // HKV
    for fwd_tma in (False, True) if "tma" in parts else ():
        config = tuning.forward_config(group, bs, bs, D, {"fwd_tma": fwd_tma})
        t, t95, *_ = measure(
            lambda: kf.sparse_attn_forward(
                q, k, v, idx.indices, idx.counts, block_q=bs, block_k=bs, scale=scale, config=config
            ),
            busy=True,
        )
        ck = kf.LAST_COMPILED["fwd"]
        rec(
            results,
            dict(
                kind="tune_tma",
                N=N,
                pattern=pat_name,
                kernel="fwd",
                tma=fwd_tma,
                config=str(config),
                ms=t,
                p95_ms=t95,
                TFLOPs=4 * D * pairs / t / 1e9,
                regs=ck.n_regs,
                spills=ck.n_spills,
            ),
        )
    o, lse = kf.sparse_attn_forward(q, k, v, idx.indices, idx.counts, block_q=bs, block_k=bs, scale=scale)
    slots = planning.cold_slots(plan.hot, plan.reuse, True)
    # KV-centric: (heads per program, warps, stages, query rows per step), the rows at most the tile
    if bs == 64:
        dq_cfgs = [(1, 4, 2), (2, 8, 3), (2, 8, 2), (1, 8, 2), (2, 4, 2)]
        kv_cfgs = [
            (h, w, s, r) for h in (1, 2) for w in (4, 8) for s in (1, 2, 3) for r in (16, 32, 64, 128) if r <= h * bs
        ]
    else:
        dq_cfgs = [(1, w, s) for w in (4, 8) for s in (1, 2, 3)]
        kv_cfgs = [(1, w, s, r) for w in (4, 8) for s in (1, 2, 3) for r in (32, 64, 128)]
    tma_variants = []
    for kernel in ("dq", "kv") if "tma" in parts else ():
        default = tuning.backward_config(group, bs, bs, D, False, {f"{kernel}_tma": True})
        stages = default.dq_num_stages if kernel == "dq" else default.kv_num_stages
        tma_variants += [
            {f"{kernel}_tma": False},
            {f"{kernel}_tma": True},
            {f"{kernel}_tma": True, f"{kernel}_num_stages": stages + 1},
        ]
    # the stored-dS mode varies only the KV-centric kernel's loads and dS stores (its dQ kernel's tiles barely
    # change its time)
    variants = (
        ([dict(dq=c) for c in dq_cfgs] if "dq" in parts else [])
        + ([dict(stored=True, tma={"kv_tma": t}) for t in (False, True)] if "stored" in parts else [])
        + ([dict(kv=c) for c in kv_cfgs] if "kv" in parts else [])
        + ([dict(chunk=c) for c in (16, 32, 128)] if "chunk" in parts else [])
        + [dict(tma=c) for c in tma_variants]
    )
    for var in variants:
        dqc, kvc, chunk = var.get("dq"), var.get("kv"), var.get("chunk")
        stored = var.get("stored", False)
        cfg = dict(
            kind="tune_bwd_det",
            N=N,
            pattern=pat_name,
            dq_cfg=str(dqc),
            kv_cfg=str(kvc),
            kv_chunk=chunk,
            tma_options=str(var.get("tma")),
            stored_ds=stored,
        )
        ev = stage_events(4)
        options = dict(var.get("tma") or {})
        if stored:
            options["stored_ds"] = True
        if dqc:
            options.update(dq_heads_per_program=dqc[0], dq_num_warps=dqc[1], dq_num_stages=dqc[2])
        if kvc:
            options.update(kv_heads_per_program=kvc[0], kv_num_warps=kvc[1], kv_num_stages=kvc[2], kv_tile_rows=kvc[3])
        if chunk:
            options.update(kv_chunk=chunk)
        try:
            config = tuning.backward_config(HQ // HKV, bs, bs, D, False, options)

            def bwd():
                kb.sparse_attn_backward(
                    do,
                    q,
                    k,
                    v,
                    o,
                    lse,
                    idx.indices,
                    idx.counts,
                    plan.kv_indptr,
                    plan.kv_qblocks,
                    slots,
                    0,
                    block_q=bs,
                    block_k=bs,
                    scale=scale,
                    stage_events=ev,
                    config=config,
                    kv_pairs=plan.kv_pairs,
                )

            t = measure(bwd, budget_ms=100).median_ms
            # the stored-dS mode runs the KV-centric kernel first (its events: backward.sparse_attn_backward)
            first, second = elapsed_ms(ev[1], ev[2]), elapsed_ms(ev[2], ev[3])
            cfg.update(
                ms=t,
                dq_ms=second if stored else first,
                kv_ms=first if stored else second,
                TFLOPs=2.5 * 4 * D * pairs / t / 1e9,
                dq_regs=kb.LAST_COMPILED["dq"].n_regs,
                dq_spills=kb.LAST_COMPILED["dq"].n_spills,
                kv_regs=kb.LAST_COMPILED["dkdv"].n_regs,
                kv_spills=kb.LAST_COMPILED["dkdv"].n_spills,
            )
        except Exception as exc:
            cfg["error"] = f"{type(exc).__name__}: {str(exc)[:200]}"
        rec(results, cfg)


def inspect_compiled(results):
    info = {}
    for name, ck in kf.LAST_COMPILED.items():
        ptx = ck.asm.get("ptx", "")
        sass = ck.asm.get("sass", "") if "sass" in ck.asm else ""
        info[name] = dict(
            regs=ck.n_regs,
            spills=ck.n_spills,
            shared=ck.metadata.shared,
            num_warps=ck.metadata.num_warps,
            num_stages=ck.metadata.num_stages,
            wgmma_in_ptx=ptx.count("wgmma.mma_async"),
            mma_sync_in_ptx=ptx.count("mma.sync"),
            hgmma_in_sass=sass.count("HGMMA"),
        )
    results["compiled"] = info
    print("compiled:", json.dumps(info), flush=True)


def cell(x, fmt="{:.3f}"):
    """A table cell: the number formatted, or n/a."""
    return fmt.format(x) if isinstance(x, (int, float)) else "n/a"


def vs_other(ours, other, key):
    """``ours[key] / other[key]`` as "0.71x" (our time as a fraction of the competitor's), or n/a."""
    return cell(ours[key] / other[key], "{:.2f}x") if key in other else "n/a"


def speedup_over(other, ours, key):
    """``other[key] / ours[key]`` as "15.2x" (how many times faster we are), or n/a."""
    return cell(other[key] / ours[key], "{:.1f}x") if key in other else "n/a"


def sustained_power(row):
    """A row's sustained power draw and SM clock as "W / MHz", or "-"."""
    watts, mhz = row.get("fwdbwd_sustained_watts"), row.get("fwdbwd_sustained_sm_mhz")
    return "-" if watts is None or mhz is None else f"{watts:.0f} / {mhz:.0f}"


def fwdbwd_row(ours, flex_row, cudnn_row, key, ceiling, power=None):
    """One line of a forward + backward table timed one way (``key``: graph replay, sustained): our time, its share
    of ``ceiling`` (3.5x the forward's FLOPs), with ``power`` our and Flex's "W / MHz" after each time, cuDNN's
    time, our time as a fraction of Flex's and the speedup over cuDNN."""
    flops = 3.5 * ours["fwd_TFLOPs"] * ours["fwd_ms"] * 1e9
    cells = [str(ours["N"]), ours["pattern"], cell(ours[key]), f"{100 * flops / ours[key] / 1e9 / ceiling:.0f}%"]
    cells += [power(ours)] if power else []
    cells += [cell(flex_row.get(key))] + ([power(flex_row)] if power else [])
    cells += [cell(cudnn_row.get(key)), vs_other(ours, flex_row, key), speedup_over(cudnn_row, ours, key)]
    return "| " + " | ".join(cells) + " |"


def packed_table(rows):
    """Markdown lines of the packed-documents table (rows of kinds ours_packed and flex_packed)."""
    flex = {(r["N"], r["pattern"]): r for r in rows if r["kind"] == "flex_packed"}

    lines = [
        "| N | pattern | documents | density | valid pairs / selected | ours fwd (p95) | ours bwd (p95) | "
        "ours fwd+bwd (p95) | det fwd+bwd | same selection, no document mask: fwd, fwd+bwd | "
        "fwd TFLOP/s (% ceil) | Flex fwd (p95) | Flex fwd+bwd (p95) | fwd vs Flex | fwd+bwd vs Flex |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        if r["kind"] != "ours_packed" or "fwd_ms" not in r:
            continue
        fx = flex.get((r["N"], r["pattern"]), {})
        lines.append(
            "| "
            + " | ".join(
                [
                    str(r["N"]),
                    r["pattern"],
                    str(r["documents"]),
                    cell(r["density"], "{:.4f}"),
                    cell(r["valid_pair_fraction"], "{:.3f}"),
                    f"{cell(r['fwd_ms'])} ({cell(r['fwd_p95_ms'])})",
                    f"{cell(r['bwd_ms'])} ({cell(r['bwd_p95_ms'])})",
                    f"{cell(r['fwdbwd_ms'])} ({cell(r['fwdbwd_p95_ms'])})",
                    cell(r["det_fwdbwd_ms"]),
                    f"{cell(r['nodocs_fwd_ms'])}, {cell(r['nodocs_fwdbwd_ms'])}",
                    f"{r['fwd_TFLOPs']:.0f} ({100 * r['fwd_frac_ceiling']:.0f}%)",
                    f"{cell(fx.get('fwd_ms'))} ({cell(fx.get('fwd_p95_ms'))})",
                    f"{cell(fx.get('fwdbwd_ms'))} ({cell(fx.get('fwdbwd_p95_ms'))})",
                    vs_other(r, fx, "fwd_ms"),
                    vs_other(r, fx, "fwdbwd_ms"),
                ]
            )
            + " |"
        )
    return lines


def write_outputs(results, out):
    os.makedirs(out, exist_ok=True)
    packed = results.get("packed")
    stem = os.path.join(out, OUTPUT_STEM + ("_packed" if packed else ""))
    with open(stem + ".json", "w") as f:
        json.dump(results, f, indent=1)
    rows = results["rows"]
    c = results["ceilings"]
    lines = [
        f"# Block-sparse attention benchmark, {results['gpu']}, {results['date']}",
        "",
        f"B={B}, HQ={HQ}, HKV={HKV}, D={D}, bf16, causal. Ceilings measured in the same process: "
        f"copy {c['copy_TBps']:.2f} TB/s, bf16 matmul {c['bf16_matmul_TFLOPs']:.0f} TFLOP/s. "
        "Medians of CUDA-event timings (ms), L2 flushed per repeat; TFLOP/s counts only causally valid "
        "(q,k) pairs inside selected blocks (bwd = 2.5x fwd FLOPs). torch "
        + results["torch"]
        + ", triton "
        + results["triton"]
        + ".",
        "",
    ] + [f"Note: {n}" for n in results.get("notes", [])]
    if packed:
        lines += [
            "",
            f"Packed documents: lengths uniform in [{packed[0]}, {packed[1]}] (seeded per N), each token "
            "attends its own document; the selection without the blocks that share no document with their "
            "query block; Flex on the same index with a document_id mask_mod. TFLOP/s count valid pairs only.",
            "",
        ] + packed_table(rows)
    lines += [
        "",
        "| N | pattern | density | index+plan ms | ours fwd | ours bwd | ours fwd+bwd | fwd TFLOP/s (% ceil) | bwd TFLOP/s (% ceil) | Flex fwd | Flex fwd+bwd | cuDNN fwd | cuDNN fwd+bwd | flash fwd | flash fwd+bwd | fwd vs Flex | fwd+bwd vs Flex | fwd speedup vs cuDNN | fwd+bwd speedup vs cuDNN |",  # noqa: E501
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    dense = {(r["kind"], r["N"]): r for r in rows if r["kind"].startswith("dense")}
    flex = {(r["N"], r["pattern"]): r for r in rows if r["kind"] == "flex"}

    for r in rows:
        if r["kind"] != "ours" or "fwd_ms" not in r:
            continue
        fx = flex.get((r["N"], r["pattern"]), {})
        cu = dense.get(("dense_cudnn", r["N"]), {})
        fl = dense.get(("dense_flash", r["N"]), {})
        lines.append(
            "| "
            + " | ".join(
                [
                    str(r["N"]),
                    r["pattern"],
                    cell(r["density"], "{:.4f}"),
                    cell(r["index_plan_ms"]),
                    cell(r["fwd_ms"]),
                    cell(r["bwd_ms"]),
                    cell(r["fwdbwd_ms"]),
                    f"{r['fwd_TFLOPs']:.0f} ({100 * r['fwd_frac_ceiling']:.0f}%)",
                    f"{r['bwd_TFLOPs']:.0f} ({100 * r['bwd_frac_ceiling']:.0f}%)",
                    cell(fx.get("fwd_ms")),
                    cell(fx.get("fwdbwd_ms")),
                    cell(cu.get("fwd_ms")),
                    cell(cu.get("fwdbwd_ms")),
                    cell(fl.get("fwd_ms")),
                    cell(fl.get("fwdbwd_ms")),
                    vs_other(r, fx, "fwd_ms"),
                    vs_other(r, fx, "fwdbwd_ms"),
                    speedup_over(cu, r, "fwd_ms"),
                    speedup_over(cu, r, "fwdbwd_ms"),
                ]
            )
            + " |"
        )
    device_rows = [r for r in rows if r["kind"] == "ours" and "fwdbwd_device_ms" in r]
    if device_rows:
        lines += [
            "",
            "Device time (ms; the GPU kept busy by a sleep kernel queued before the start event, so host "
            "launch work is not counted, as in a training step where earlier kernels hide it; every "
            "implementation timed so):",
            "",
            "| N | pattern | ours fwd | ours fwd+bwd | fwd / fwd+bwd % of ceiling | Flex fwd | Flex fwd+bwd | "
            "cuDNN fwd+bwd | fwd+bwd vs Flex | fwd+bwd speedup vs cuDNN |",
            "|---|---|---|---|---|---|---|---|---|---|",
        ]
        for r in device_rows:
            fx = flex.get((r["N"], r["pattern"]), {})
            cu = dense.get(("dense_cudnn", r["N"]), {})
            f_fwd = r["fwd_TFLOPs"] * r["fwd_ms"] * 1e9
            ceiling = c["bf16_matmul_TFLOPs"]
            fwd_frac = f_fwd / r["fwd_device_ms"] / 1e9 / ceiling
            bwd_device = r["fwdbwd_device_ms"] - r["fwd_device_ms"]
            bwd_frac = 2.5 * f_fwd / bwd_device / 1e9 / ceiling if bwd_device > 0 else float("nan")
            lines.append(
                "| "
                + " | ".join(
                    [
                        str(r["N"]),
                        r["pattern"],
                        cell(r["fwd_device_ms"]),
                        cell(r["fwdbwd_device_ms"]),
                        f"{100 * fwd_frac:.0f}% / {100 * bwd_frac:.0f}% (bwd = fwd+bwd - fwd)",
                        cell(fx.get("fwd_device_ms")),
                        cell(fx.get("fwdbwd_device_ms")),
                        cell(cu.get("fwdbwd_device_ms")),
                        vs_other(r, fx, "fwdbwd_device_ms"),
                        speedup_over(cu, r, "fwdbwd_device_ms"),
                    ]
                )
                + " |"
            )
    graph_rows = [r for r in rows if r["kind"] == "ours" and "fwdbwd_graph_ms" in r]
    if graph_rows:
        lines += [
            "",
            "CUDA graph replay (ms; forward + backward captured once per implementation and replayed, L2 "
            "flushed per repeat: no host work in the timed call, as in a training step that graphs its "
            "layers; every implementation timed so):",
            "",
            "| N | pattern | ours fwd+bwd | % of ceiling | Flex fwd+bwd | cuDNN fwd+bwd | fwd+bwd vs Flex | "
            "fwd+bwd speedup vs cuDNN |",
            "|---|---|---|---|---|---|---|---|",
        ]
        for r in graph_rows:
            lines.append(
                fwdbwd_row(
                    r,
                    flex.get((r["N"], r["pattern"]), {}),
                    dense.get(("dense_cudnn", r["N"]), {}),
                    "fwdbwd_graph_ms",
                    c["bf16_matmul_TFLOPs"],
                )
            )
    held_rows = [r for r in rows if r["kind"] == "ours" and "fwdbwd_sustained_ms" in r]
    if held_rows:
        held_ceiling = c.get("bf16_matmul_sustained_TFLOPs") or c["bf16_matmul_TFLOPs"]
        lines += [
            "",
            "Sustained (ms; each implementation's forward + backward back to back for seconds, no flush, "
            "medians of the second half: the card at its power and clock limits, as through a training run; "
            f"% of the matmul ceiling held the same way, {held_ceiling:.0f} TFLOP/s"
            + (
                f" at {c['matmul_sustained_watts']:.0f} W, {c['matmul_sustained_sm_mhz']:.0f} MHz"
                if c.get("matmul_sustained_watts")
                else ""
            )
            + "):",
            "",
            "| N | pattern | ours fwd+bwd | % of ceiling | ours W / MHz | Flex fwd+bwd | Flex W / MHz | "
            "cuDNN fwd+bwd | fwd+bwd vs Flex | fwd+bwd speedup vs cuDNN |",
            "|---|---|---|---|---|---|---|---|---|---|",
        ]
        for r in held_rows:
            lines.append(
                fwdbwd_row(
                    r,
                    flex.get((r["N"], r["pattern"]), {}),
                    dense.get(("dense_cudnn", r["N"]), {}),
                    "fwdbwd_sustained_ms",
                    held_ceiling,
                    power=sustained_power,
                )
            )
    modes = [r for r in rows if r["kind"] == "ours" and "fwd_ms" in r]
    if modes:
        lines += [
            "",
            "Backward modes on the same index (ms; the default is the hybrid two-kernel backward; "
            "peak extra memory of one fwd+bwd over the inputs):",
            "",
            "| N | pattern | bwd | fwd+bwd | deterministic bwd | deterministic fwd+bwd | fused-dQ bwd | "
            "fused-dQ fwd+bwd | stored-dS bwd | stored-dS fwd+bwd | peak extra MB, default / stored-dS |",
            "|---|---|---|---|---|---|---|---|---|---|---|",
        ]
        for r in modes:
            lines.append(
                "| "
                + " | ".join(
                    [
                        str(r["N"]),
                        r["pattern"],
                        cell(r["bwd_ms"]),
                        cell(r["fwdbwd_ms"]),
                        cell(r.get("det_bwd_ms")),
                        cell(r.get("det_fwdbwd_ms")),
                        cell(r.get("fused_bwd_ms")),
                        cell(r.get("fused_fwdbwd_ms")),
                        cell(r.get("stored_bwd_ms")),
                        cell(r.get("stored_fwdbwd_ms")),
                        f"{cell(r.get('fwdbwd_peak_extra_MB'), '{:.0f}')} / {cell(r.get('stored_fwdbwd_peak_extra_MB'), '{:.0f}')}",  # noqa: E501
                    ]
                )
                + " |"
            )
    errs = [r for r in rows if any("error" in kk for kk in r)]
    if errs:
        lines += ["", "Failures (reported, not crashed):", ""]
        for r in errs:
            short = lambda t: " ".join(str(t).split())[:220]  # noqa: E731
            lines.append(
                f"- {r['kind']} N={r['N']} {r.get('pattern', '')}: "
                + "; ".join(f"{kk}={short(vv)}" for kk, vv in r.items() if "error" in kk)
                + (f" ({r['note']})" if "note" in r else "")
            )
    sw = [r for r in rows if r["kind"] == "r0_sweep"]
    if sw:
        lines += [
            "",
            "r0 sweep (hybrid backward; dQ+atomic kernel vs KV-centric kernel; ms):",
            "",
            "| N | pattern | r0 | det | hot | cold | workspace MB | preprocess | dQ+atomic kernel | KV-centric kernel | bwd total |",  # noqa: E501
            "|---|---|---|---|---|---|---|---|---|---|---|",
        ]
        for r in sw:
            lines.append(
                f"| {r['N']} | {r['pattern']} | {r['r0']} | {r['deterministic']} | {r['num_hot']} | {r['num_cold']} | "
                f"{r['workspace_bytes'] / 2**20:.1f} | {r['preprocess_ms']:.3f} | {r['dq_atomic_kernel_ms']:.3f} | "
                f"{r['kv_centric_kernel_ms']:.3f} | {r['bwd_ms']:.3f} |"
            )
    if results.get("compiled"):
        lines += ["", "Compiled kernels (last launch): " + json.dumps(results["compiled"])]
    with open(stem + ".md", "w") as fh:
        fh.write("\n".join(lines) + "\n")
    print("\n".join(lines), flush=True)
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, axes = plt.subplots(1, 2, figsize=(12, 4.5))
        ours_kind, flex_kind = ("ours_packed", "flex_packed") if packed else ("ours", "flex")
        for ax, key, title in ((axes[0], "fwd_ms", "forward"), (axes[1], "fwdbwd_ms", "forward + backward")):
            for pat in PATTERNS:
                mine = [r for r in rows if r.get("pattern") == pat and key in r]
                ours = sorted((r["N"], r[key]) for r in mine if r["kind"] == ours_kind)
                fl = sorted((r["N"], r[key]) for r in mine if r["kind"] == flex_kind)
                if ours:
                    ax.plot(*zip(*ours), "o-", label=f"ours {pat}")
                if fl:
                    ax.plot(*zip(*fl), "s--", label=f"Flex {pat}")
            for kind in ("dense_cudnn", "dense_flash"):
                d = sorted((r["N"], r[key]) for r in rows if r["kind"] == kind and key in r)
                if d:
                    ax.plot(*zip(*d), "^:", label=kind.replace("_", " "))
            ax.set_xscale("log", base=2)
            ax.set_yscale("log")
            ax.set_xlabel("N")
            ax.set_ylabel("ms (median)")
            ax.set_title(title)
            ax.grid(True, which="both", alpha=0.3)
            ax.legend(fontsize=7)
        what = "causal, packed documents" if packed else "causal"
        fig.suptitle(f"B={B} HQ={HQ} HKV={HKV} D={D} bf16 {what}, {results['gpu']}, {results['date']}")
        fig.tight_layout()
        fig.savefig(stem + ".png", dpi=110)
    except Exception as exc:
        print("plot failed:", exc)


def parse_packed(text):
    """``"LO:HI"`` -> (LO, HI): document lengths, ints with 1 <= LO <= HI."""
    try:
        low, high = (int(x) for x in text.split(":"))
    except ValueError:
        raise argparse.ArgumentTypeError(f"--packed takes LO:HI (two ints), got {text!r}") from None
    if not 1 <= low <= high:
        raise argparse.ArgumentTypeError(f"--packed LO:HI needs 1 <= LO <= HI, got {text!r}")
    return low, high


def _blocks_to_dense(num, ind, nkb):
    """Flex's (num_blocks [B, H, NQB], indices [B, H, NQB, *]) -> bool [B, H, NQB, NKB]."""
    keep = torch.arange(ind.shape[-1]).view(1, 1, 1, -1) < num.unsqueeze(-1)
    dense = torch.zeros(*num.shape, nkb + 1, dtype=torch.bool)
    dense.scatter_(-1, torch.where(keep, ind.long(), nkb), True)
    return dense[..., :nkb]


def dry_run(ns, patterns, packed):
    """The packed mode's inputs on the CPU, checked (no kernels, no timing): document ids, the pruned
    selection (every kept block shares a document with its query block, every dropped one shares none,
    the diagonal blocks stay), the valid-pair count (against an element mask), and the Flex BlockMask
    (its blocks are the index's, its full blocks exactly the selected blocks whose pairs are all valid,
    its mask_mod causal & same document). Returns one summary dict per (N, pattern); raises AssertionError on a
    mismatch."""
    out = []
    for n in ns:
        docs, lengths = packed_document_ids(n, *packed, seed=n, device="cpu")
        pos = torch.arange(n)
        elem = (pos.view(1, -1) <= pos.view(-1, 1)) & (docs[0].view(1, -1) == docs[0].view(-1, 1))  # [N, N]
        for name in patterns:
            pat = PATTERNS[name]
            bs = pat["block"]
            sel = random_selection(n, pat, seed=n, device="cpu")
            full, _ = build_index(sel, n, pat)
            idx, plan = build_index(sel, n, pat, docs=docs)
            nb = idx.num_q_blocks
            padded = torch.nn.functional.pad(elem, (0, nb * bs - n, 0, nb * bs - n))
            block_pairs = padded.view(nb, bs, nb, bs).sum(dim=(1, 3))  # valid pairs per (query block, key block)
            kept, before = idx.to_dense()[0], full.to_dense()[0]  # [HKV, NQB, NKB]
            assert torch.equal(kept, before & (block_pairs > 0)), "pruning must keep exactly blocks with valid pairs"
            assert kept[:, torch.arange(nb), torch.arange(nb)].all(), "diagonal blocks must stay"
            pairs = valid_pairs(idx, docs)
            assert pairs == int((kept * block_pairs).sum()), "valid pair count"
            mask = flex_block_mask(idx, n, docs)
            flex_dense = mask.to_dense()[0]  # [HQ, NQB, NKB]
            assert torch.equal(flex_dense, kept.repeat_interleave(HQ // HKV, dim=0)), "Flex blocks != our index"
            full_blocks = _blocks_to_dense(mask.full_kv_num_blocks, mask.full_kv_indices, nb)[0]
            area = torch.clamp(n - torch.arange(nb) * bs, max=bs)
            complete = block_pairs == area.view(-1, 1) * area.view(1, -1)
            # full exactly where every pair is valid (then the block is before the diagonal and in one
            # document); partial blocks are the rest, which the mask_mod decides element by element
            assert torch.equal(full_blocks, kept.repeat_interleave(HQ // HKV, dim=0) & complete), "full Flex blocks"
            q_idx = torch.arange(n).view(-1, 1)
            mod = mask.mask_mod(torch.tensor(0), torch.tensor(0), q_idx, torch.arange(n).view(1, -1))
            assert torch.equal(mod, elem), "mask_mod must be causal & same document"
            out.append(
                dict(
                    N=n,
                    pattern=name,
                    documents=len(lengths),
                    blocks=int(full.counts.sum()),
                    kept_blocks=int(idx.counts.sum()),
                    valid_pairs=pairs,
                    num_hot=plan.num_hot,
                    flex_full_blocks=int(full_blocks.sum()),
                )
            )
    return out


def main(argv=None):
    global D
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--n", type=int, nargs="*", default=None)
    ap.add_argument("--pattern", nargs="*", default=list(PATTERNS), choices=list(PATTERNS))
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--no-flex", action="store_true")
    ap.add_argument("--no-dense", action="store_true")
    ap.add_argument("--no-sweep", action="store_true")
    ap.add_argument("--sweep-n", type=int, default=65536)
    ap.add_argument(
        "--tune",
        nargs="*",
        default=None,
        choices=TUNE_PARTS,
        help="sweep launch configs at the largest N: the parts named (default all)",
    )
    ap.add_argument("--head-dim", type=int, default=D, help="head dimension D (default 128)")
    ap.add_argument("--out", default="docs/benchmarks")
    ap.add_argument(
        "--packed",
        type=parse_packed,
        default=None,
        metavar="LO:HI",
        help="packed documents with lengths uniform in [LO, HI] (module docstring)",
    )
    ap.add_argument(
        "--sustained",
        type=float,
        default=6.0,
        metavar="SECONDS",
        help="forward + backward of ours, Flex and SDPA (and the matmul ceiling) back to back this long, "
        "the card at its power limit (default 6; 0 skips)",
    )
    ap.add_argument(
        "--dry-run",
        action="store_true",
        help="CPU: build and check the packed inputs (default --packed 64:700, N 1000 3001), no timing",
    )
    args = ap.parse_args(argv)
    if args.dry_run:
        for row in dry_run(args.n or [1000, 3001], args.pattern, args.packed or (64, 700)):
            print(json.dumps(row), flush=True)
        return
    D = args.head_dim
    ns = args.n or ([65536] if args.quick else [8192, 16384, 32768, 65536, 131072])
    results = dict(
        gpu=torch.cuda.get_device_name(),
        torch=torch.__version__,
        triton=triton.__version__,
        date=time.strftime("%Y-%m-%d", time.gmtime()),
        rows=[],
        shape=dict(B=B, HQ=HQ, HKV=HKV, D=D, dtype="bf16"),
        packed=args.packed,
    )
    results["ceilings"] = ceilings(args.sustained)
    print("ceilings:", results["ceilings"], flush=True)
    ceil = results["ceilings"]["bf16_matmul_TFLOPs"]
    for N in ns:
        q, k, v, do = benchmark_inputs(N, D, seed=N)
        docs = None if args.packed is None else packed_document_ids(N, *args.packed, seed=N)[0]
        for pat_name in args.pattern:
            pat = PATTERNS[pat_name]
            sel = random_selection(N, pat, seed=N)
            try:
                idx, plan = run_ours(N, pat_name, pat, sel, ceil, results, args, q, k, v, do, docs=docs)
            except Exception:
                traceback.print_exc()
                rec(results, dict(kind="ours", N=N, pattern=pat_name, error=traceback.format_exc()[-400:]))
                continue
            if args.tune is not None and N == max(ns) and docs is None:
                tune(N, pat_name, pat, sel, results, q, k, v, do, parts=args.tune or TUNE_PARTS)
            if not args.no_flex:
                run_flex(N, pat_name, idx, results, q, k, v, do, docs=docs, sustained=args.sustained)
            if not args.no_sweep and N == args.sweep_n and docs is None:
                try:
                    r0_sweep(N, pat_name, pat, sel, results, q, k, v, do)
                except Exception:
                    traceback.print_exc()
            write_outputs(results, args.out)
        if not args.no_dense and docs is None:
            run_dense(N, results, q, k, v, do, sustained=args.sustained)
        del q, k, v, do
        torch.cuda.empty_cache()
        write_outputs(results, args.out)
    inspect_compiled(results)
    write_outputs(results, args.out)


if __name__ == "__main__":
    main()
