"""Index block scores (sparse_train/kernels/index_scores.py) on the GPU: time, throughput, correctness.

Times, in one process, ``index_block_scores`` at B=1, H=8, block 64 (query and key), bf16, for N in
{16384, 65536, 131072} and (E, S) in {(1, 32), (1, 64), (2, 32), (4, 16), (4, 32)}:

* ``fwd``     the scores only (no autograd: the selection path)
* ``fwd_bwd`` the scores with the winners stored, then the backward's scatter-add into du and dw

with the automatic tiles (``tile_options``) at every N, and at N = 65536 also the tile variants of ``VARIANTS``
(each orientation of the product, 64 keys per step on 4 warps, 256 keys on 8 warps, two query blocks per program;
``--variants`` picks some). Timed by
``scripts.bench.harness.measure`` (CUDA events, warm-up, L2 flushed before each repeat, device time only), median
and p95; effective TFLOP/s counts the causal work, N^2 / 2 (row, key) pairs x 2 E S flops x H. Correctness: for each
(N, E, S), the kernel on three listed query
blocks (first, middle, last) against the float64 reference (largest error relative to the largest |score|),
and the full kernel's rows at those blocks equal the listed ones bit for bit; each tile variant's full scores
against the automatic tiles' (the same -inf pattern, the largest relative difference). Checks the budget: forward at
N = 65536 (best tiles) <= 1.2 ms.

Writes ``index_scores.json`` and ``index_scores.md`` (a markdown table) to ``--out``.

Usage::

    python -m scripts.bench.index_scores --out bench_out
    python -m scripts.bench.index_scores --out bench_out --variants auto rows-major   # the orientations only
    python -m scripts.bench.index_scores --out docs_dir --render bench_out/index_scores.json   # the table again
    python -m scripts.bench.index_scores --out /tmp/smoke --n 256 --heads 1 --shapes 1x16 --device cpu   # smoke

(on the CPU the scores take the PyTorch reference: the smoke checks the script, not the kernel)
"""

from __future__ import annotations

import argparse
import json
import math
import platform
from datetime import datetime, timezone
from pathlib import Path

import torch

from scripts.bench.harness import measure
from sparse_train.kernels.reference.index_scores import reference_index_block_scores
from sparse_train.kernels.triton.index_scores import (
    IndexScoreOptions,
    index_block_scores,
    tile_options,
)

SHAPES = ((1, 32), (1, 64), (2, 32), (4, 16), (4, 32))
"""(E index heads, S index dim) pairs timed."""
LENGTHS = (16384, 65536, 131072)
VARIANT_LENGTH = 65536
"""The length at which the tile variants are timed besides the automatic tiles."""
VARIANTS = {
    "auto": None,
    "rows-major": IndexScoreOptions(keys_major=False),
    "keys-major": IndexScoreOptions(keys_major=True),
    "keys64-w4": IndexScoreOptions(key_tile=64, num_warps=4),
    "keys256-w8": IndexScoreOptions(key_tile=256, num_warps=8),
    "keys-major-keys256-w8": IndexScoreOptions(key_tile=256, num_warps=8, keys_major=True),
    "pairs": IndexScoreOptions(blocks_per_program=2),
    "keys-major-pairs": IndexScoreOptions(blocks_per_program=2, keys_major=True),
}
BUDGET_MS = 1.2
"""Forward budget at N = 65536, H = 8 (issue 34: scoring + top-k + plan <= 2.0 ms in all)."""


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", type=Path, required=True, help="output directory (created)")
    p.add_argument(
        "--render",
        type=Path,
        default=None,
        help="only write index_scores.md to --out from this index_scores.json (an earlier run's), timing nothing",
    )
    p.add_argument("--n", type=int, nargs="+", default=list(LENGTHS), help="sequence lengths")
    p.add_argument("--heads", type=int, default=8, help="heads H (KV heads of the selector)")
    p.add_argument("--block", type=int, default=64, help="block size (query and key)")
    p.add_argument("--shapes", nargs="+", default=[f"{e}x{s}" for e, s in SHAPES], help="ExS pairs")
    p.add_argument(
        "--max-repeats",
        type=int,
        default=20,
        help="most timed repeats of one call (at least 5, and until 400 ms are measured)",
    )
    p.add_argument(
        "--variants", nargs="+", default=list(VARIANTS), choices=list(VARIANTS), help="tile variants at N = 65536"
    )
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--device", default="cuda")
    return p.parse_args(argv)


def causal_flops(seq_len: int, heads: int, index_heads: int, index_dim: int) -> float:
    """N^2 / 2 causal (row, key) pairs x 2 E S flops per pair x H heads."""
    return seq_len * seq_len / 2 * 2 * index_heads * index_dim * heads


def same_scores(scores, auto_scores) -> dict:
    """A tile variant's scores against the automatic tiles': the same -inf pattern, and the largest difference
    relative to the largest |score| (0 unless the product's summation order differs)."""
    finite = torch.isfinite(auto_scores)
    diff = (scores.double() - auto_scores.double())[finite].abs().max() / auto_scores[finite].abs().max()
    return {"same_inf_pattern": bool(torch.equal(torch.isfinite(scores), finite)), "max_rel_diff": diff.item()}


def check_rows(u, w, block: int) -> dict:
    """Kernel vs float64 reference on the first, middle and last query block, and the full kernel's rows."""
    nqb = math.ceil(w.shape[2] / block)
    blocks = torch.tensor(sorted({0, nqb // 2, nqb - 1}), device=u.device)
    rows = (blocks.view(-1, 1) * block + torch.arange(block, device=u.device)).reshape(-1).clamp(max=w.shape[2] - 1)
    u_listed = u[:, :, rows].contiguous()
    with torch.no_grad():
        listed = index_block_scores(u_listed, w, block_q=block, block_k=block, query_blocks=blocks)
        full = index_block_scores(u, w, block_q=block, block_k=block)
        ref = reference_index_block_scores(
            u_listed.double(), w.double(), block_q=block, block_k=block, query_blocks=blocks
        )
    finite = torch.isfinite(ref)
    same_pattern = bool(torch.equal(torch.isfinite(listed), finite))
    err = ((listed.double() - ref)[finite].abs().max() / ref[finite].abs().max()).item()
    return {
        "query_blocks": blocks.tolist(),
        "max_rel_err": err,
        "same_inf_pattern": same_pattern,
        "full_equals_listed": bool(torch.equal(full[:, :, blocks], listed)),
    }


def variant_checks(check: dict) -> dict:
    """``{variant: same_scores(...)}`` of one (N, E, S) check."""
    return {key.removesuffix("_vs_auto"): value for key, value in check.items() if key.endswith("_vs_auto")}


def render_markdown(report: dict, args=None) -> str:
    """The markdown table of a run's ``index_scores.json`` content (``report``: env, results, checks, budget)."""
    env, results, checks, budget = report["env"], report["results"], report["checks"], report["budget"]
    heads = results[0]["H"] if results else (args.heads if args else "?")
    block = results[0]["block"] if results else (args.block if args else "?")
    lines = [
        f"Index block scores, B=1, H={heads}, block {block}, {env['dtype']}, {env['device']}, {env['date']}",
        "",
        "| N | E | S | tiles (key, row, warps, blocks, orientation) | fwd ms (p95) | fwd TFLOP/s | fwd+bwd ms (p95) |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in results:
        if r["mode"] != "fwd":
            continue
        fb = next(
            x for x in results if x["mode"] == "fwd_bwd" and all(x[k] == r[k] for k in ("N", "E", "S", "variant"))
        )
        tl = r["tiles"]
        lines.append(
            f"| {r['N']} | {r['E']} | {r['S']} | {r['variant']} ({tl['key_tile']}, {tl['row_tile']}, "
            f"{tl['num_warps']}, {tl['blocks_per_program']}, {'keys' if tl.get('keys_major') else 'rows'}) | "
            f"{r['median_ms']:.3f} ({r['p95_ms']:.3f}) | "
            f"{r['tflops']:.1f} | {fb['median_ms']:.3f} ({fb['p95_ms']:.3f}) |"
        )
    lines += ["", f"Budget: forward at N={VARIANT_LENGTH} <= {BUDGET_MS} ms (best tiles):", ""]
    lines += [
        f"- E={b['E']} S={b['S']}: {b['median_ms']:.3f} ms ({b['best_variant']}) "
        f"{'within' if b['within_budget'] else 'OVER'}"
        for b in budget
    ]
    lines += ["", "Correctness (three listed query blocks vs the float64 reference):", ""]
    lines += [
        f"- N={c['N']} E={c['E']} S={c['S']}: max rel err {c['max_rel_err']:.2e}, -inf pattern "
        f"{'equal' if c['same_inf_pattern'] else 'DIFFERS'}, full kernel rows "
        f"{'equal' if c['full_equals_listed'] else 'DIFFER'}"
        + "".join(
            f"; {name} vs auto: largest rel diff {v['max_rel_diff']:.1e}"
            + ("" if v["same_inf_pattern"] else ", -inf pattern DIFFERS")
            for name, v in variant_checks(c).items()
            if name != "auto"
        )
        for c in checks
    ]
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.render is not None:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "index_scores.md").write_text(render_markdown(json.loads(args.render.read_text()), args))
        return 0
    device = torch.device(args.device)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    args.out.mkdir(parents=True, exist_ok=True)
    shapes = [tuple(int(x) for x in s.split("x")) for s in args.shapes]
    results, checks = [], []
    for n in args.n:
        for E, S in shapes:
            g = torch.Generator(device=device).manual_seed(n + E * S)
            u = torch.randn(1, args.heads, n, E, S, device=device, generator=g).to(dtype)
            w = torch.randn(1, args.heads, n, S, device=device, generator=g).to(dtype)
            check = {"N": n, "E": E, "S": S, **check_rows(u, w, args.block)}
            checks.append(check)
            print(
                f"check N={n} E={E} S={S}: rel err {check['max_rel_err']:.2e}, -inf pattern "
                f"{check['same_inf_pattern']}, full == listed {check['full_equals_listed']}",
                flush=True,
            )
            variants = {k: VARIANTS[k] for k in args.variants} if n == VARIANT_LENGTH else {"auto": None}
            with torch.no_grad():
                auto_scores = index_block_scores(u, w, block_q=args.block, block_k=args.block)
            for name, options in variants.items():
                tiles = tile_options(args.block, args.block, E, S, options)
                with torch.no_grad():
                    scores = index_block_scores(u, w, block_q=args.block, block_k=args.block, options=options)
                check[f"{name}_vs_auto"] = same_scores(scores, auto_scores)
                print(f"check N={n} E={E} S={S} {name} vs auto: {check[f'{name}_vs_auto']}", flush=True)
                del scores
                u_grad = u.detach().requires_grad_()
                w_grad = w.detach().requires_grad_()

                def forward(options=options, u=u, w=w):
                    with torch.no_grad():
                        index_block_scores(u, w, block_q=args.block, block_k=args.block, options=options)

                def forward_backward(options=options, u_grad=u_grad, w_grad=w_grad):
                    scores = index_block_scores(u_grad, w_grad, block_q=args.block, block_k=args.block, options=options)
                    torch.autograd.grad(scores, (u_grad, w_grad), torch.ones_like(scores))

                flops = causal_flops(n, args.heads, E, S)
                for mode, fn in (("fwd", forward), ("fwd_bwd", forward_backward)):
                    t = measure(
                        fn,
                        device=device,
                        warmup=args.warmup,
                        max_reps=max(5, args.max_repeats),
                        busy=device.type == "cuda",
                    )._asdict()
                    row = {
                        "N": n,
                        "H": args.heads,
                        "E": E,
                        "S": S,
                        "block": args.block,
                        "variant": name,
                        "tiles": tiles._asdict(),
                        "mode": mode,
                        **t,
                        "tflops": flops / (t["median_ms"] * 1e-3) / 1e12 if mode == "fwd" else None,
                    }
                    results.append(row)
                    tf = f", {row['tflops']:.1f} TFLOP/s" if row["tflops"] is not None else ""
                    print(
                        f"N={n} E={E} S={S} {name:10s} {mode:8s} median {t['median_ms']:.3f} ms "
                        f"p95 {t['p95_ms']:.3f} ms{tf}",
                        flush=True,
                    )
                del u_grad, w_grad
            del u, w
            if device.type == "cuda":
                torch.cuda.empty_cache()

    budget = []
    for E, S in shapes:
        fwd = [r for r in results if r["N"] == VARIANT_LENGTH and r["E"] == E and r["S"] == S and r["mode"] == "fwd"]
        if fwd:
            best = min(fwd, key=lambda r: r["median_ms"])
            budget.append(
                {
                    "E": E,
                    "S": S,
                    "best_variant": best["variant"],
                    "median_ms": best["median_ms"],
                    "budget_ms": BUDGET_MS,
                    "within_budget": best["median_ms"] <= BUDGET_MS,
                }
            )
    env = {
        "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "torch": torch.__version__,
        "python": platform.python_version(),
        "dtype": str(dtype),
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else platform.processor(),
    }
    (args.out / "index_scores.json").write_text(
        json.dumps({"env": env, "results": results, "checks": checks, "budget": budget}, indent=1)
    )
    markdown = render_markdown({"env": env, "results": results, "checks": checks, "budget": budget}, args)
    (args.out / "index_scores.md").write_text(markdown)
    print(markdown, end="")
    ok = all(c["same_inf_pattern"] and c["full_equals_listed"] and c["max_rel_err"] < 1e-4 for c in checks) and all(
        v["same_inf_pattern"] and v["max_rel_diff"] < 1e-4 for c in checks for v in variant_checks(c).values()
    )
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
