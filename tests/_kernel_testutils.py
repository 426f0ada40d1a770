"""Shared helpers for the Triton kernel tests (CPU interpreter and GPU)."""
import math

import torch

from sparse_train.index import BlockIndex


def random_index(B, HKV, N, BQ, BK, topk, window, sinks, seed, device="cpu", dups=False):
    """Canonical index from a random causal top-k selection (optionally with duplicate candidates)."""
    g = torch.Generator().manual_seed(seed)
    nqb, nkb = math.ceil(N / BQ), math.ceil(N / BK)
    last = (torch.clamp((torch.arange(nqb) + 1) * BQ, max=N) - 1) // BK
    scores = torch.rand(B, HKV, nqb, nkb, generator=g)
    causal = torch.arange(nkb).view(1, 1, 1, -1) <= last.view(1, 1, -1, 1)
    scores = scores.masked_fill(~causal, -1.0)
    val, sel = scores.topk(min(topk, nkb), dim=-1)
    sel = torch.where(val >= 0, sel, -1)
    if dups:
        sel = torch.cat([sel, sel.flip(-1)], dim=-1)  # every candidate twice
    return BlockIndex.from_selection(sel.to(device), seq_len=N, block_q=BQ, block_k=BK, window=window, sinks=sinks)


def rel_err(a, b):
    a, b = a.double(), b.double()
    fin = torch.isfinite(b)
    assert torch.equal(torch.isfinite(a), fin), "non-finite pattern differs"
    a, b = a[fin], b[fin]
    return ((a - b).norm() / b.norm().clamp_min(1e-30)).item()


# c * err(PyTorch in the kernel's precision) + floor; floors: fp32 ~ 1e-6, fp16 ~ 1e-4
TOL_C = 4.0
FLOOR = {torch.float32: 2e-6, torch.float16: 2e-4, torch.bfloat16: 2e-3}


def check_close(name, got, ref64, ref_lowp, dtype):
    e_k, e_r = rel_err(got, ref64), rel_err(ref_lowp, ref64)
    print(f"{name}: kernel err {e_k:.3e} | torch-{str(dtype).split('.')[-1]} err {e_r:.3e}")
    assert e_k <= TOL_C * e_r + FLOOR[dtype], f"{name}: kernel err {e_k:.3e} > {TOL_C} * {e_r:.3e} + {FLOOR[dtype]}"


def make_qkv(B, HQ, HKV, N, D, dtype, seed=0, device="cpu"):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(B, HQ, N, D, generator=g).to(device=device, dtype=dtype)
    k = torch.randn(B, HKV, N, D, generator=g).to(device=device, dtype=dtype)
    v = torch.randn(B, HKV, N, D, generator=g).to(device=device, dtype=dtype)
    return q, k, v
