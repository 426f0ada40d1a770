"""Probe (GPU): can a fused backward add its dQ shares into a float32 buffer fast enough? Times float32 tile
reductions into global memory: pointer atomics (``tl.atomic_add``, relaxed), TMA reduce-add (a tensor
descriptor's ``atomic_add``, with the descriptor made on the host and on the device) and a plain store of the
same tiles (the bandwidth reference). 8192 programs each add 32 tiles of [M, D] float32 at scattered tile
positions of a [32 * 65536, D] buffer (dQ of B = 1, HQ = 32 at 64K), for the tile shapes of the KV-centric
kernel's row slices; a small run checks that TMA and pointer atomics give the same sums.

    python scripts/probe_dq_reduction.py docs/benchmarks/speed_round2/h200_tma_reduce_probe.json

Result on the H200 (tenth session, ``h200_tma_reduce_probe_session10.json``): stores 3.9-4.3 TB/s, pointer
atomics 1.32-1.40 TB/s, TMA reduce-add 1.18-1.28 TB/s at every tile shape: the reductions are bound by the
L2's float32 reduction rate, not by how they are issued, so TMA does not rescue the fused backward (its
~13-27 GB of dQ reductions at 64K cost 10-20 ms).
"""
import json
import sys

import torch
import triton
import triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor


@triton.jit
def _ptr_kernel(ACC, NT, TILES: tl.constexpr, M: tl.constexpr, D: tl.constexpr, MODE: tl.constexpr):
    p = tl.program_id(0)
    offs_m = tl.arange(0, M)
    offs_d = tl.arange(0, D)
    val = (offs_m[:, None] + offs_d[None, :] + p).to(tl.float32) * 1e-3
    for t in range(TILES):
        tile = ((p * 7919 + t * 104729) % NT).to(tl.int64)
        ptrs = ACC + (tile * M + offs_m[:, None]) * D + offs_d[None, :]
        if MODE == 0:
            tl.atomic_add(ptrs, val, sem="relaxed")
        else:
            tl.store(ptrs, val)
        val = val + 1.0


@triton.jit
def _tma_add_tiles(desc, NT, TILES: tl.constexpr, M: tl.constexpr, D: tl.constexpr):
    p = tl.program_id(0)
    offs_m = tl.arange(0, M)
    offs_d = tl.arange(0, D)
    val = (offs_m[:, None] + offs_d[None, :] + p).to(tl.float32) * 1e-3
    for t in range(TILES):
        tile = (p * 7919 + t * 104729) % NT
        desc.atomic_add([tile * M, 0], val)
        val = val + 1.0


@triton.jit
def _tma_host_kernel(desc, NT, TILES: tl.constexpr, M: tl.constexpr, D: tl.constexpr):
    _tma_add_tiles(desc, NT, TILES, M, D)


@triton.jit
def _tma_dev_kernel(ACC, NT, TILES: tl.constexpr, M: tl.constexpr, D: tl.constexpr):
    desc = tl.make_tensor_descriptor(ACC, shape=[NT * M, D], strides=[D, 1], block_shape=[M, D])
    _tma_add_tiles(desc, NT, TILES, M, D)


def bench(fn, reps=10):
    fn(); torch.cuda.synchronize()
    s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    ts = []
    for _ in range(reps):
        s.record(); fn(); e.record(); e.synchronize(); ts.append(s.elapsed_time(e))
    ts.sort()
    return ts[len(ts) // 2]


def main():
    triton.set_allocator(lambda size, align, stream: torch.empty(size, device="cuda", dtype=torch.int8))
    rows = []
    for M, D in ((32, 128), (64, 128), (32, 64), (64, 64), (128, 64)):
        NT = (32 * 65536) // M  # dQ of B=1, HQ=32, 64K rows
        acc = torch.zeros(NT * M, D, device="cuda", dtype=torch.float32)
        programs, tiles = 8192, 32
        gbytes = programs * tiles * M * D * 4 / 1e9
        desc = TensorDescriptor(acc, [NT * M, D], [D, 1], [M, D])
        variants = {
            "store": lambda: _ptr_kernel[(programs,)](acc, NT, tiles, M, D, 1),
            "ptr_atomic": lambda: _ptr_kernel[(programs,)](acc, NT, tiles, M, D, 0),
            "tma_host": lambda: _tma_host_kernel[(programs,)](desc, NT, tiles, M, D),
            "tma_device": lambda: _tma_dev_kernel[(programs,)](acc, NT, tiles, M, D),
        }
        for name, fn in variants.items():
            try:
                ms = bench(fn)
                rows.append(dict(M=M, D=D, variant=name, ms=round(ms, 3), gbytes=round(gbytes, 2),
                                 gb_per_s=round(gbytes / ms * 1e3, 1)))
            except Exception as exc:  # report and go on
                rows.append(dict(M=M, D=D, variant=name, error=f"{type(exc).__name__}: {str(exc)[:300]}"))
            print(json.dumps(rows[-1]), flush=True)
        # correctness: TMA reduce equals pointer atomics on one small run
        a1 = torch.zeros_like(acc); a2 = torch.zeros_like(acc)
        _ptr_kernel[(64,)](a1, NT, 4, M, D, 0)
        try:
            _tma_host_kernel[(64,)](TensorDescriptor(a2, [NT * M, D], [D, 1], [M, D]), NT, 4, M, D)
            torch.cuda.synchronize()
            print(json.dumps(dict(M=M, D=D, check_max_abs_diff=float((a1 - a2).abs().max()))), flush=True)
        except Exception as exc:
            print("check failed", exc)
    if len(sys.argv) > 1:
        json.dump(rows, open(sys.argv[1], "w"), indent=1)


if __name__ == "__main__":
    main()
