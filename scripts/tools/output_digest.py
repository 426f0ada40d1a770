"""SHA-256 digests of the public API's outputs and gradients on fixed inputs, to show that a change which should
not touch the numbers (a restructuring, a move) leaves every bit as it is.

The script uses only the public API (``BlockIndex.from_selection``, ``sparse_attention``, ``SparseAttention``,
``collect_selector_losses``), so one copy of it runs against any checkout of the package::

    PYTHONPATH=/path/to/checkout_a python -m scripts.tools.output_digest --out a.json
    PYTHONPATH=/path/to/checkout_b python -m scripts.tools.output_digest --out b.json
    python -m scripts.tools.output_digest --compare a.json b.json

(run it as a file, ``python scripts/tools/output_digest.py``, when ``scripts`` is not importable from the
checkout under test). On a GPU the cases are the benchmark shapes (B = 1, HQ = 32, HKV = 8, 64K, patterns P64 and
P128, D = 128 and 64, bf16) plus packed documents, right padding, dropout, GQA 4 and the deterministic backward,
and the module's forward and backward with its selector and distillation loss; on a CPU (Triton interpreter or
the reference backend) the same cases at small shapes.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import sys

import torch

import sparse_train as st

PATTERNS = {"P64": dict(block=64, sinks=1, window=8, topk=16), "P128": dict(block=128, sinks=1, window=4, topk=8)}


def digest(t: torch.Tensor) -> str:
    """SHA-256 of a tensor's bytes (contiguous, on the CPU), with its dtype and shape."""
    t = t.detach().contiguous().cpu()
    h = hashlib.sha256(f"{t.dtype}{tuple(t.shape)}".encode())
    h.update(t.view(torch.uint8).numpy().tobytes() if t.numel() else b"")
    return h.hexdigest()[:24]


def selection(b, hkv, n, pattern, seed, device):
    """int32 [B, HKV, NQB, topk]: the pattern's top-k causal key blocks by a seeded uniform score, -1 where fewer
    are causal."""
    bs = pattern["block"]
    nb = math.ceil(n / bs)
    g = torch.Generator(device=device).manual_seed(seed)
    scores = torch.rand(b, hkv, nb, nb, device=device, generator=g)
    last = (torch.clamp((torch.arange(nb, device=device) + 1) * bs, max=n) - 1) // bs
    causal = torch.arange(nb, device=device).view(1, 1, 1, -1) <= last.view(1, 1, -1, 1)
    val, sel = scores.masked_fill(~causal, -1.0).topk(min(pattern["topk"], nb), dim=-1)
    return torch.where(val >= 0, sel, -1).to(torch.int32)


def document_ids(b, n, low, high, seed, device):
    """int32 [B, N] ids of packed documents with lengths uniform in [low, high] (seeded)."""
    g = torch.Generator().manual_seed(seed)
    lengths, total = [], 0
    while total < n:
        lengths.append(min(int(torch.randint(low, high + 1, (1,), generator=g)), n - total))
        total += lengths[-1]
    ids = torch.repeat_interleave(torch.arange(len(lengths)), torch.tensor(lengths))
    return ids.to(device=device, dtype=torch.int32).view(1, n).expand(b, n).contiguous()


def functional_case(name, *, n, d, pattern, b=1, hq=32, hkv=8, dtype, device, backend, **kwargs):
    """Digests of o, lse, dq, dk, dv of ``sparse_attention`` on seeded normal inputs."""
    torch.manual_seed(0)
    q = torch.randn(b, hq, n, d, device=device, dtype=dtype, requires_grad=True)
    k = torch.randn(b, hkv, n, d, device=device, dtype=dtype, requires_grad=True)
    v = torch.randn(b, hkv, n, d, device=device, dtype=dtype, requires_grad=True)
    do = torch.randn(b, hq, n, d, device=device, dtype=dtype)
    p = PATTERNS[pattern]
    idx = st.BlockIndex.from_selection(
        selection(b, hkv, n, p, 0, device),
        seq_len=n,
        block_q=p["block"],
        block_k=p["block"],
        window=p["window"],
        sinks=p["sinks"],
    )
    o, lse = st.sparse_attention(q, k, v, idx, return_lse=True, backend=backend, **kwargs)
    o.backward(do)
    return name, {"o": digest(o), "lse": digest(lse), "dq": digest(q.grad), "dk": digest(k.grad), "dv": digest(v.grad)}


def module_case(name, *, n, d, b=1, hq=8, hkv=2, dtype, device, backend):
    """Digests of the module's output, the q/k/v gradients and every selector parameter's gradient after one
    training step's forward and backward (attention loss plus the selector's distillation loss)."""
    torch.manual_seed(0)
    # the pooled selector, named where the checkout has the field (the default selector differs between checkouts)
    pooled = {"selector": "pooled"} if "selector" in st.SparseAttentionConfig.__dataclass_fields__ else {}
    cfg = st.SparseAttentionConfig(top_k=4, window=2, dense_warmup_steps=0, backend=backend, **pooled)
    attn = st.SparseAttention(cfg, num_heads=hq, num_kv_heads=hkv, head_dim=d).to(device)
    q = torch.randn(b, hq, n, d, device=device, dtype=dtype, requires_grad=True)
    k = torch.randn(b, hkv, n, d, device=device, dtype=dtype, requires_grad=True)
    v = torch.randn(b, hkv, n, d, device=device, dtype=dtype, requires_grad=True)
    do = torch.randn(b, hq, n, d, device=device, dtype=dtype)
    attn.train()
    o = attn(q, k, v)
    loss = (o.float() * do.float()).sum() + st.collect_selector_losses(attn)
    loss.backward()
    out = {"o": digest(o), "dq": digest(q.grad), "dk": digest(k.grad), "dv": digest(v.grad)}
    for pname, param in sorted(attn.named_parameters()):
        if param.grad is not None:
            out[f"grad:{pname}"] = digest(param.grad)
    return name, out


def cases(device):
    """The case list of a device: the benchmark shapes on a GPU, small shapes on a CPU."""
    if device == "cuda":
        bf16 = dict(dtype=torch.bfloat16, device=device, backend="auto")
        yield lambda: functional_case("64k_P64_d128", n=65536, d=128, pattern="P64", **bf16)
        yield lambda: functional_case("64k_P128_d128", n=65536, d=128, pattern="P128", **bf16)
        yield lambda: functional_case("64k_P64_d64", n=65536, d=64, pattern="P64", **bf16)
        yield lambda: functional_case("64k_P128_d64", n=65536, d=64, pattern="P128", **bf16)
        yield lambda: functional_case(
            "16k_P64_documents",
            n=16384,
            d=128,
            pattern="P64",
            document_ids=document_ids(1, 16384, 100, 3000, 0, device),
            **bf16,
        )
        yield lambda: functional_case(
            "16k_P64_seq_lens_b2",
            n=16384,
            d=128,
            b=2,
            pattern="P64",
            seq_lens=torch.tensor([16384, 9001], device=device),
            **bf16,
        )
        yield lambda: functional_case(
            "16k_P64_dropout", n=16384, d=128, pattern="P64", dropout_p=0.1, dropout_seed=1234, **bf16
        )
        yield lambda: functional_case(
            "16k_P64_deterministic", n=16384, d=128, pattern="P64", deterministic=True, **bf16
        )
        yield lambda: functional_case(
            "12345_P128_gqa4_fp16",
            n=12345,
            d=64,
            hq=16,
            hkv=4,
            pattern="P128",
            dtype=torch.float16,
            device=device,
            backend="auto",
        )
        yield lambda: module_case("module_8k", n=8192, d=64, dtype=torch.bfloat16, device=device, backend="auto")
    else:
        for backend in ("reference", "triton"):
            f32 = dict(dtype=torch.float32, device=device, backend=backend)
            yield lambda f32=f32: functional_case(
                f"{f32['backend']}_300_P64", n=300, d=32, hq=4, hkv=2, pattern="P64", **f32
            )
            yield lambda f32=f32: functional_case(
                f"{f32['backend']}_300_P64_documents",
                n=300,
                d=32,
                hq=4,
                hkv=2,
                pattern="P64",
                document_ids=document_ids(1, 300, 20, 120, 0, device),
                **f32,
            )
            yield lambda f32=f32: module_case(f"{f32['backend']}_module_256", n=256, d=32, hq=4, hkv=2, **f32)


def compare(a_path, b_path) -> int:
    """Print each case's equal / differing fields; exit status 1 when any differs or is missing."""
    a, b = (json.load(open(p)) for p in (a_path, b_path))
    bad = 0
    for case in sorted(set(a["cases"]) | set(b["cases"])):
        ca, cb = a["cases"].get(case), b["cases"].get(case)
        if ca is None or cb is None:
            print(f"{case}: only in {'b' if ca is None else 'a'}")
            bad += 1
            continue
        diff = [k for k in sorted(set(ca) | set(cb)) if ca.get(k) != cb.get(k)]
        print(f"{case}: {'bitwise equal' if not diff else 'DIFFERS in ' + ', '.join(diff)} ({len(ca)} tensors)")
        bad += bool(diff)
    print(f"{'all cases bitwise equal' if not bad else f'{bad} case(s) differ'}")
    return 1 if bad else 0


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", help="JSON file for the digests")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--compare", nargs=2, metavar=("A", "B"), help="compare two digest files instead")
    args = ap.parse_args(argv)
    if args.compare:
        return compare(*args.compare)
    result = {"package": st.__file__, "torch": torch.__version__, "cases": {}}
    if args.device == "cuda":
        result["gpu"] = torch.cuda.get_device_name()
    for make in cases(args.device):
        name, fields = make()
        result["cases"][name] = fields
        print(name, fields.get("o"), flush=True)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
