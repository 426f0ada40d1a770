"""BlockIndex canonicalization, validation, plan and CSR views against slow per-row Python oracles."""

import math

import pytest
import torch
from builders import make_qkv, random_selection

import sparse_train as st
from sparse_train.index.block_index import capacity_tier


def oracle_row(cands, i, seq_len, bq, bk, window, sinks):
    last = (min((i + 1) * bq, seq_len) - 1) // bk
    chosen = {c for c in cands if 0 <= c <= last}
    chosen |= {j for j in range(last - window + 1, last + 1) if j >= 0}
    chosen |= {j for j in range(sinks) if j <= last}
    return sorted(chosen)


def ragged_selection(batch, heads, seq_len, bq, bk, k, seed):
    """Uniform causal candidates (duplicates common), 40% of the slots empty (-1): ragged rows, some empty."""
    return random_selection(batch, heads, seq_len, bq, bk, k, seed=seed, distinct=False, drop=0.4)


CASES = [
    # (batch, heads, seq_len, bq, bk, k, window, sinks)
    pytest.param(1, 1, 256, 64, 64, 3, 2, 1, id="B1-aligned"),
    pytest.param(2, 3, 300, 64, 64, 4, 2, 1, id="B2-odd-len"),
    pytest.param(2, 2, 517, 32, 64, 5, 3, 2, id="bq32-bk64-odd"),
    pytest.param(1, 2, 517, 128, 64, 6, 1, 0, id="bq128-bk64"),
    pytest.param(3, 1, 1000, 64, 128, 4, 0, 3, id="bk128-sinks-only"),
    pytest.param(1, 2, 200, 64, 64, 2, 10, 8, id="window-and-sinks-longer-than-prefix"),
    pytest.param(2, 2, 64, 64, 64, 1, 0, 0, id="single-block"),
    pytest.param(1, 1, 1, 64, 64, 1, 1, 1, id="N1"),
]


@pytest.mark.parametrize("batch,heads,seq_len,bq,bk,k,window,sinks", CASES)
def test_canonicalize_matches_oracle(batch, heads, seq_len, bq, bk, k, window, sinks):
    sel = ragged_selection(batch, heads, seq_len, bq, bk, k, seed=seq_len * 7 + k)
    idx = st.BlockIndex.from_selection(
        sel, seq_len=seq_len, block_q=bq, block_k=bk, window=window, sinks=sinks, check="full"
    )
    assert idx.indices.dtype == torch.int32 and idx.counts.dtype == torch.int32
    nqb = math.ceil(seq_len / bq)
    longest = 0
    for b in range(batch):
        for h in range(heads):
            for i in range(nqb):
                want = oracle_row(sel[b, h, i].tolist(), i, seq_len, bq, bk, window, sinks)
                row = idx.indices[b, h, i].tolist()
                count = int(idx.counts[b, h, i])
                assert row[:count] == want, (b, h, i)
                assert all(x == -1 for x in row[count:])
                longest = max(longest, count)
    assert idx.capacity == capacity_tier(longest, math.ceil(seq_len / bk))


def test_capacity_tiers_are_powers_of_two_capped():
    assert [capacity_tier(c, 100) for c in (0, 1, 2, 3, 5, 9, 17, 64, 65)] == [1, 1, 2, 4, 8, 16, 32, 64, 100]
    assert capacity_tier(5, 6) == 6


def test_capacity_stable_across_steps():
    # Two different selections with row lengths in the same tier give the same tensor shape.
    a = st.BlockIndex.from_selection(torch.tensor([[[[0], [0], [1], [2]]]]), seq_len=256, window=3)
    b = st.BlockIndex.from_selection(torch.tensor([[[[0], [0], [0], [0]]]]), seq_len=256, window=2)
    assert a.counts.max() == 3 and b.counts.max() == 3
    assert a.capacity == b.capacity == 4
    with pytest.raises(ValueError, match="capacity=2 is smaller"):
        st.BlockIndex.from_selection(torch.tensor([[[[0], [0], [1], [2]]]]), seq_len=256, window=3, capacity=2)


def test_to_dense_from_dense_roundtrip():
    sel = ragged_selection(2, 2, 700, 64, 64, 5, seed=3)
    idx = st.BlockIndex.from_selection(sel, seq_len=700, window=1, sinks=1)
    dense = idx.to_dense()
    assert dense.shape == (2, 2, 11, 11) and dense.dtype == torch.bool
    back = st.BlockIndex.from_dense(dense, seq_len=700)
    assert torch.equal(back.indices[..., : idx.capacity], idx.indices)
    assert torch.equal(back.counts, idx.counts)
    assert torch.equal(dense.sum(-1).to(torch.int32), idx.counts)


def test_full_index_and_is_full():
    full = st.BlockIndex.full(2, 3, 333, block_q=64, block_k=32)
    causal = torch.ones(6, 11, dtype=torch.bool)
    for i in range(6):
        causal[i, (min((i + 1) * 64, 333) - 1) // 32 + 1 :] = False
    assert torch.equal(full.to_dense()[1, 2], causal)
    assert full.is_full()
    assert math.isclose(full.density(), 1.0)
    partial = st.BlockIndex.from_selection(
        torch.zeros(2, 3, 6, 1, dtype=torch.int64), seq_len=333, block_q=64, block_k=32
    )
    assert not partial.is_full()


def brute_density(idx):
    n = idx.seq_len
    dense = idx.to_dense()
    total = 0
    for b in range(idx.batch):
        for h in range(idx.num_kv_heads):
            for q in range(n):
                for kpos in range(q + 1):
                    total += bool(dense[b, h, q // idx.block_q, kpos // idx.block_k])
    return total / (idx.batch * idx.num_kv_heads * n * (n + 1) / 2)


@pytest.mark.parametrize("seq_len,bq,bk", [(130, 64, 64), (200, 32, 64), (190, 64, 32)], ids=str)
def test_density_matches_brute_force(seq_len, bq, bk):
    sel = ragged_selection(1, 2, seq_len, bq, bk, 2, seed=seq_len)
    idx = st.BlockIndex.from_selection(sel, seq_len=seq_len, block_q=bq, block_k=bk, window=1)
    assert math.isclose(idx.density(), brute_density(idx), rel_tol=1e-12)


def test_repr_is_readable():
    idx = st.BlockIndex.from_selection(torch.zeros(1, 2, 4, 1, dtype=torch.int64), seq_len=256, window=2)
    text = repr(idx)
    for part in ("B=1", "HKV=2", "N=256", "BQ=64", "NQB=4", "K=", "density="):
        assert part in text


@pytest.mark.parametrize("r0", [0, 1, 3, 100], ids=lambda r: f"r0={r}")
def test_plan_matches_oracle(r0):
    sel = ragged_selection(2, 2, 640, 64, 64, 4, seed=11)
    idx = st.BlockIndex.from_selection(sel, seq_len=640, window=2, sinks=1)
    plan = idx.plan(r0)
    b, h, nqb, _ = idx.indices.shape
    nkb = idx.num_k_blocks
    num_hot = num_cold = 0
    for bb in range(b):
        for hh in range(h):
            for j in range(nkb):
                users = [i for i in range(nqb) if j in idx.indices[bb, hh, i].tolist()]
                row = (bb * h + hh) * nkb + j
                lo, hi = int(plan.kv_indptr[row]), int(plan.kv_indptr[row + 1])
                assert plan.kv_qblocks[lo:hi].tolist() == users
                assert int(plan.reuse[bb, hh, j]) == len(users)
                assert bool(plan.hot[bb, hh, j]) == (len(users) >= r0 and len(users) > 0)
                num_hot += len(users) > 0 and len(users) >= r0
                num_cold += 0 < len(users) < r0
    assert (plan.num_hot, plan.num_cold) == (num_hot, num_cold)
    assert plan.nnz == int(idx.counts.sum())
    assert plan.max_count == int(idx.counts.max())


def test_plan_deterministic_and_cached():
    sel = ragged_selection(1, 2, 512, 64, 64, 4, seed=5)
    idx = st.BlockIndex.from_selection(sel, seq_len=512, window=2)
    first = idx.plan(2)
    assert idx.plan(2) is first
    again = st.BlockIndex.from_selection(sel, seq_len=512, window=2).plan(2)
    assert torch.equal(first.kv_indptr, again.kv_indptr) and torch.equal(first.kv_qblocks, again.kv_qblocks)


def test_csr_roundtrip_with_ragged_rows():
    sel = ragged_selection(2, 2, 450, 64, 64, 5, seed=21)
    idx = st.BlockIndex.from_selection(sel, seq_len=450, sinks=1)
    indptr, cols = idx.to_csr()
    assert indptr.dtype == torch.int64 and cols.dtype == torch.int32
    assert int(indptr[-1]) == cols.numel() == int(idx.counts.sum())
    back = st.BlockIndex.from_csr(indptr, cols, batch=2, num_kv_heads=2, seq_len=450)
    assert torch.equal(back.indices, idx.indices) and torch.equal(back.counts, idx.counts)
    # Each row reversed and the last row given a duplicate: the same set, so the same index.
    rows = indptr.numel() - 1
    parts = [cols[int(indptr[r]) : int(indptr[r + 1])].flip(0) for r in range(rows)]
    parts[-1] = torch.cat([parts[-1], parts[-1][:1]]) if parts[-1].numel() else parts[-1]
    lengths = torch.tensor([p.numel() for p in parts])
    indptr3 = torch.zeros(rows + 1, dtype=torch.int64)
    indptr3[1:] = lengths.cumsum(0)
    again = st.BlockIndex.from_csr(indptr3, torch.cat(parts), batch=2, num_kv_heads=2, seq_len=450)
    assert torch.equal(again.indices, idx.indices)


# --------------------------------------------------------------------------- validation errors
def test_rejects_out_of_range_naming_row():
    sel = torch.full((2, 2, 4, 2), -1, dtype=torch.int64)
    sel[1, 0, 3, 1] = 9
    with pytest.raises(
        ValueError, match=r"candidate key block 9 at \(batch=1, kv_head=0, query_block=3\).*out of range"
    ):
        st.BlockIndex.from_selection(sel, seq_len=256)


def test_rejects_non_causal_naming_row():
    sel = torch.full((1, 2, 4, 1), -1, dtype=torch.int64)
    sel[0, 1, 1, 0] = 2
    with pytest.raises(ValueError, match=r"block 2 at \(batch=0, kv_head=1, query_block=1\).*not causally reachable"):
        st.BlockIndex.from_selection(sel, seq_len=256)


def test_rejects_negative_other_than_minus_one():
    sel = torch.full((1, 1, 4, 1), -2, dtype=torch.int64)
    with pytest.raises(ValueError, match="negative"):
        st.BlockIndex.from_selection(sel, seq_len=256)


@pytest.mark.parametrize(
    "make,match",
    [
        (lambda: torch.zeros(1, 1, 4, 1, dtype=torch.float32), "integer dtype"),
        (lambda: torch.zeros(1, 4, 1, dtype=torch.int64), "4 dims"),
        (lambda: torch.zeros(1, 1, 5, 1, dtype=torch.int64), "NQB = 4"),
    ],
    ids=["float-dtype", "3-dims", "wrong-nqb"],
)
def test_rejects_bad_selection_tensor(make, match):
    with pytest.raises(ValueError, match=match):
        st.BlockIndex.from_selection(make(), seq_len=256)


def test_rejects_bad_geometry_and_window():
    sel = torch.zeros(1, 1, 4, 1, dtype=torch.int64)
    with pytest.raises(ValueError, match="block_q"):
        st.BlockIndex.from_selection(sel, seq_len=256, block_q=0)
    with pytest.raises(ValueError, match="window and sinks"):
        st.BlockIndex.from_selection(sel, seq_len=256, window=-1)
    with pytest.raises(ValueError, match="check must be"):
        st.BlockIndex.from_selection(sel, seq_len=256, check="sometimes")


def test_from_dense_rejects_non_causal_and_shape():
    mask = torch.zeros(1, 1, 4, 4, dtype=torch.bool)
    mask[0, 0, 0, 3] = True
    with pytest.raises(ValueError, match="not causally reachable"):
        st.BlockIndex.from_dense(mask, seq_len=256)
    with pytest.raises(ValueError, match="NKB=4"):
        st.BlockIndex.from_dense(torch.zeros(1, 1, 4, 3, dtype=torch.bool), seq_len=256)


def test_from_canonical_full_check_catches_each_invariant():
    good = st.BlockIndex.from_selection(torch.zeros(1, 1, 4, 1, dtype=torch.int64), seq_len=256, window=2)
    st.BlockIndex.from_canonical(good.indices, good.counts, seq_len=256, block_q=64, block_k=64)
    broken = {
        "not strictly ascending": lambda ind, cnt: ind[0, 0, 3, :2].copy_(torch.tensor([3, 2])),
        "padding is not -1": lambda ind, cnt: ind[0, 0, 0, 2].fill_(0),
        "not causally reachable": lambda ind, cnt: ind[0, 0, 1, 1].fill_(3),
        "counts outside": lambda ind, cnt: cnt[0, 0, 2].fill_(9),
    }
    for message, corrupt in broken.items():
        ind, cnt = good.indices.clone(), good.counts.clone()
        corrupt(ind, cnt)
        with pytest.raises(ValueError, match=message):
            st.BlockIndex.from_canonical(ind, cnt, seq_len=256, block_q=64, block_k=64)


def test_from_csr_rejects_bad_indptr():
    with pytest.raises(ValueError, match="indptr must be 1-D"):
        st.BlockIndex.from_csr(
            torch.zeros(3, dtype=torch.int64), torch.zeros(0, dtype=torch.int32), batch=1, num_kv_heads=1, seq_len=256
        )
    with pytest.raises(ValueError, match="non-decreasing"):
        st.BlockIndex.from_csr(
            torch.tensor([0, 2, 1, 1, 1]), torch.zeros(1, dtype=torch.int32), batch=1, num_kv_heads=1, seq_len=256
        )


@pytest.mark.parametrize(
    "mutate,match",
    [
        (lambda q, k, v: (q, k[:, :1], v[:, :1]), "kv_heads=2"),
        (lambda q, k, v: (q[:, :3], k, v), "multiple of key/value heads"),
        (lambda q, k, v: (q.double(), k, v), "share a dtype"),
        (lambda q, k, v: (q[..., :8], k, v), "disagree on batch, length or head dim"),
        (lambda q, k, v: (q[:, :, :128], k[:, :, :128], v[:, :, :128]), "seq_len=256"),
        (lambda q, k, v: (q, k, v[..., :8]), "same shape"),
        (lambda q, k, v: (q.long(), k, v), "floating-point dtype"),
        (lambda q, k, v: (q[0], k, v), "4-D"),
        (lambda q, k, v: (torch.cat([q, q]), torch.cat([k, k]), torch.cat([v, v])), "batch=1"),
    ],
    ids=["kv-heads", "gqa-ratio", "dtype", "head-dim", "seq-len", "v-shape", "int-dtype", "3d", "batch"],
)
def test_check_compatible_errors(mutate, match):
    idx = st.BlockIndex.full(1, 2, 256)
    q, k, v = mutate(*make_qkv(1, 4, 2, 256, 16))
    with pytest.raises(ValueError, match=match):
        st.sparse_attention(q, k, v, idx)


def test_check_compatible_device_and_seq_lens():
    idx = st.BlockIndex.full(1, 2, 256)
    q, k, v = make_qkv(1, 4, 2, 256, 16)
    meta = torch.empty(1, 4, 256, 16, device="meta")
    with pytest.raises(ValueError, match="is on meta"):
        idx.check_compatible(meta, k, v)
    with pytest.raises(ValueError, match=r"seq_lens values must lie in \[0, N=256\]"):
        st.sparse_attention(q, k, v, idx, seq_lens=torch.tensor([300]))
    with pytest.raises(ValueError, match="entries for batch"):
        st.sparse_attention(q, k, v, idx, seq_lens=torch.tensor([3, 4]))


def test_import_from_repo_root_does_not_shadow_stdlib():
    import selectors  # stdlib module; a top-level selectors/ package would shadow it

    assert hasattr(selectors, "DefaultSelector")


@pytest.mark.gpu
def test_cuda_index_matches_cpu():
    sel = ragged_selection(2, 4, 4000, 64, 64, 8, seed=13)
    cpu = st.BlockIndex.from_selection(sel, seq_len=4000, window=4, sinks=1)
    gpu = st.BlockIndex.from_selection(sel.cuda(), seq_len=4000, window=4, sinks=1)
    assert gpu.device.type == "cuda"
    assert torch.equal(gpu.indices.cpu(), cpu.indices) and torch.equal(gpu.counts.cpu(), cpu.counts)
    pc, pg = cpu.plan(3), gpu.plan(3)
    assert torch.equal(pg.kv_indptr.cpu(), pc.kv_indptr) and torch.equal(pg.kv_qblocks.cpu(), pc.kv_qblocks)
    assert math.isclose(gpu.density(), cpu.density(), rel_tol=1e-12)


# ------------------------------------------------------------------------------------ stale state, domains
def test_plan_cache_follows_in_place_writes_to_the_index():
    """A cached plan is reused only while the index tensors are unmodified (version counters)."""
    a = st.BlockIndex.from_selection(ragged_selection(1, 2, 512, 64, 64, 3, seed=1), seq_len=512, window=1, capacity=8)
    b = st.BlockIndex.from_selection(ragged_selection(1, 2, 512, 64, 64, 3, seed=2), seq_len=512, window=1, capacity=8)
    first = a.plan(2)
    assert a.plan(2) is first
    a.indices.copy_(b.indices)
    a.counts.copy_(b.counts)
    again = a.plan(2)
    assert again is not first
    want = b.plan(2)
    for name in ("kv_indptr", "kv_qblocks", "reuse", "hot"):
        assert torch.equal(getattr(again, name), getattr(want, name)), name


def test_from_canonical_buffers_rewritten_in_place_never_give_a_stale_plan():
    """from_canonical (buffers a CUDA graph updates in place) caches no plan: after buf.copy_(new)
    the plan is the new selection's."""
    a = st.BlockIndex.from_selection(ragged_selection(2, 2, 640, 64, 64, 4, seed=3), seq_len=640, sinks=1, capacity=8)
    b = st.BlockIndex.from_selection(ragged_selection(2, 2, 640, 64, 64, 4, seed=4), seq_len=640, sinks=1, capacity=8)
    buf_i, buf_c = a.indices.clone(), a.counts.clone()
    idx = st.BlockIndex.from_canonical(buf_i, buf_c, seq_len=640, block_q=64, block_k=64)
    assert torch.equal(idx.plan().kv_qblocks, a.plan().kv_qblocks)
    buf_i.copy_(b.indices)
    buf_c.copy_(b.counts)
    assert torch.equal(idx.plan().kv_qblocks, b.plan().kv_qblocks)
    assert torch.equal(idx.plan().kv_indptr, b.plan().kv_indptr)
    # nothing is cached on caller-owned buffers (a graph replay would not bump any version counter)
    assert idx.plan() is not idx.plan()


def test_capacity_zero_is_rejected():
    """capacity=0 is refused (the reference would crash on it)."""
    sel = torch.full((1, 1, 4, 1), -1, dtype=torch.int64)
    with pytest.raises(ValueError, match="capacity must be a positive int, got 0"):
        st.BlockIndex.from_selection(sel, seq_len=256, capacity=0)
    with pytest.raises(ValueError, match="capacity must be a positive int, got 0"):
        st.BlockIndex.from_selection(sel, seq_len=256, capacity=0, check="none")


def test_capacity_above_nkb_is_clamped_to_nkb():
    """A huge explicit capacity does not reach the allocator. A row never holds more than NKB
    blocks, so capacity is clamped to NKB (the same cap capacity_tier applies)."""
    sel = torch.tensor([[[[0], [0], [1], [2]]]])
    exact = st.BlockIndex.from_selection(sel, seq_len=256, window=3, capacity=4)
    for capacity in (5, 2**40):
        idx = st.BlockIndex.from_selection(sel, seq_len=256, window=3, capacity=capacity, check="full")
        assert idx.capacity == 4
        assert torch.equal(idx.indices, exact.indices) and torch.equal(idx.counts, exact.counts)


def test_huge_window_and_sinks_mean_every_causal_block():
    sel = torch.full((1, 2, 5, 1), -1, dtype=torch.int64)
    full = st.BlockIndex.full(1, 2, 300, block_q=64, block_k=64)
    for window, sinks in ((10**12, 0), (0, 10**12), (5, 5)):
        idx = st.BlockIndex.from_selection(sel, seq_len=300, window=window, sinks=sinks)
        assert torch.equal(idx.indices, full.indices) and torch.equal(idx.counts, full.counts)


def test_trusted_capacity_too_small_truncates_rows_consistently():
    """check="none" skips the host sync that would catch a capacity below the longest row: the row is
    cut to its lowest blocks and its count with it, so no consumer reads past the row."""
    sel = torch.tensor([[[[0], [0], [1], [2]]]])
    idx = st.BlockIndex.from_selection(sel, seq_len=256, window=3, capacity=2, check="none")
    assert idx.capacity == 2 and int(idx.counts.max()) == 2
    idx.validate()
    assert idx.indices[0, 0, 3].tolist() == [1, 2]  # row {1, 2, 3} keeps its two lowest blocks


def test_from_csr_rejects_float_col_indices():
    """Float col_indices are refused, not truncated (2.7 -> 2)."""
    indptr = torch.tensor([0, 1, 2, 3, 4])
    with pytest.raises(ValueError, match="col_indices must have an integer dtype, got torch.float32"):
        st.BlockIndex.from_csr(indptr, torch.tensor([0.0, 0.9, 1.5, 2.7]), batch=1, num_kv_heads=1, seq_len=256)
    with pytest.raises(ValueError, match="indptr must have an integer dtype, got torch.float64"):
        st.BlockIndex.from_csr(indptr.double(), torch.tensor([0, 0, 1, 2]), batch=1, num_kv_heads=1, seq_len=256)
    with pytest.raises(ValueError, match="col_indices must have an integer dtype, got torch.bool"):
        st.BlockIndex.from_csr(indptr, torch.tensor([0, 0, 1, 1]).bool(), batch=1, num_kv_heads=1, seq_len=256)


SEL = torch.zeros(1, 1, 4, 1, dtype=torch.int64)


@pytest.mark.parametrize(
    "build,match",
    [
        (
            lambda: st.BlockIndex.from_selection(SEL, seq_len=256, window=1.5),
            r"window and sinks must be ints >= 0, got window=1.5",
        ),
        (
            lambda: st.BlockIndex.from_selection(SEL, seq_len=256, window=True),
            "window and sinks must be ints >= 0, got window=True",
        ),
        (lambda: st.BlockIndex.from_selection(SEL, seq_len=256, sinks=-2), "sinks=-2"),
        (
            lambda: st.BlockIndex.from_selection(SEL, seq_len=256.0),
            r"seq_len must be (an int|a positive int)\b.*, got 256\.0",
        ),
        (
            lambda: st.BlockIndex.from_selection(SEL, seq_len=256, block_q=True),
            r"block_q must be (an int|a positive int)\b.*, got True",
        ),
        (
            lambda: st.BlockIndex.from_selection(SEL, seq_len=256, block_k=-64),
            "block_k must be a positive int, got -64",
        ),
        (
            lambda: st.BlockIndex.from_selection(SEL, seq_len=256, capacity=2.0),
            r"capacity must be (an int|a positive int)\b.*, got 2\.0",
        ),
        (
            lambda: st.BlockIndex.from_selection(SEL, seq_len=256, capacity=True),
            r"capacity must be (an int|a positive int)\b.*, got True",
        ),
        (
            lambda: st.BlockIndex.from_selection(SEL.bool(), seq_len=256),
            "selected must have an integer dtype, got torch.bool",
        ),
        (lambda: st.BlockIndex.from_selection(SEL.tolist(), seq_len=256), "selected must be a torch.Tensor, got list"),
        (lambda: st.BlockIndex.full(-1, 1, 256), "batch must be an int >= 0, got -1"),
        (lambda: st.BlockIndex.full(1, 0, 256), "num_kv_heads must be a positive int, got 0"),
        (lambda: st.BlockIndex.full(1, 2.0, 256), r"num_kv_heads must be (an int|a positive int)\b.*, got 2\.0"),
        (
            lambda: st.BlockIndex.from_csr(
                torch.tensor([0, 1]), torch.tensor([0]), batch=1.0, num_kv_heads=1, seq_len=64
            ),
            r"batch must be (an int|a positive int)\b.*, got 1\.0",
        ),
        (
            lambda: st.BlockIndex.from_selection(SEL, seq_len=256).plan(1.5),
            r"r0 must be (an int|a positive int)\b.*, got 1\.5",
        ),
        (
            lambda: st.BlockIndex.from_selection(SEL, seq_len=256).plan(True),
            r"r0 must be (an int|a positive int)\b.*, got True",
        ),
        (lambda: st.BlockIndex.from_selection(SEL, seq_len=256).plan(-1), "r0 must be an int >= 0, got -1"),
        (
            lambda: st.BlockIndex.from_canonical(
                SEL.int(), SEL[..., 0].int(), seq_len=256, block_q=64, block_k=64, check=None
            ),
            "check must be one of",
        ),
    ],
    ids=[
        "window-float",
        "window-bool",
        "sinks-negative",
        "seq_len-float",
        "block_q-bool",
        "block_k-negative",
        "capacity-float",
        "capacity-bool",
        "selected-bool",
        "selected-list",
        "full-batch-negative",
        "full-kv-heads-zero",
        "full-kv-heads-float",
        "csr-batch-float",
        "plan-r0-float",
        "plan-r0-bool",
        "plan-r0-negative",
        "canonical-check-none-object",
    ],
)
def test_index_api_rejects_bad_arguments(build, match):
    with pytest.raises(ValueError, match=match):
        build()


def test_index_api_accepts_numpy_ints():
    np = pytest.importorskip("numpy")
    idx = st.BlockIndex.from_selection(SEL, seq_len=np.int64(256), block_q=np.int32(64), window=np.int64(2))
    assert idx.seq_len == 256 and type(idx.seq_len) is int and type(idx.block_q) is int


# ---------------------------------------------------------------------------------------------- inspection
def _two_heads():
    # batch 0, head 0 selects block 0 / 0 / 1 / nothing, head 1 nothing / 0 / 0 / 2; window 1 adds the diagonal
    sel = torch.tensor([[[[0], [0], [1], [-1]], [[-1], [0], [0], [2]]]])
    return st.BlockIndex.from_selection(sel, seq_len=256, window=1)


def test_to_string_draws_one_character_per_block():
    text = _two_heads().to_string()
    assert text == "\n".join(
        [
            "batch 0, kv_head 0:",
            "  █",
            "  ██",
            "  .██",
            "  ...█",
            "batch 0, kv_head 1:",
            "  █",
            "  ██",
            "  █.█",
            "  ..██",
        ]
    )


def test_to_string_truncates_large_grids_with_a_note():
    idx = st.BlockIndex.full(2, 3, 40 * 16, 16, 16)
    text = idx.to_string(max_blocks=5, max_pairs=2)
    lines = text.splitlines()
    assert lines[:7] == ["batch 0, kv_head 0:", "  █", "  ██", "  ███", "  ████", "  █████", "batch 0, kv_head 1:"]
    assert "(first 5 of 40 query blocks and 5 of 40 key blocks shown)" in lines
    assert lines[-1] == "(4 more (batch, kv_head) pairs not shown)"
    assert len(lines) == 2 * 6 + 2
    with pytest.raises(ValueError, match="max_blocks must be a positive int"):
        idx.to_string(max_blocks=0)


def test_repr_shows_the_grid_of_small_indices_only():
    small = _two_heads()
    assert repr(small).splitlines()[1:] == small.to_string().splitlines()
    large = st.BlockIndex.full(1, 1, 64 * 17)
    assert "\n" not in repr(large) and "NQB=17" in repr(large)
    many_heads = st.BlockIndex.full(1, 3, 256)
    assert "\n" not in repr(many_heads)


def test_getitem_restricts_to_batches_and_heads():
    sel = ragged_selection(3, 2, 300, 64, 64, 4, seed=7)
    idx = st.BlockIndex.from_selection(sel, seq_len=300, window=1, sinks=1)
    capacity = idx.capacity
    for key, (bs, hs) in [
        (1, ([1], [0, 1])),
        (-1, ([2], [0, 1])),
        ((0, 1), ([0], [1])),
        ((slice(None), 0), ([0, 1, 2], [0])),
        (slice(1, 3), ([1, 2], [0, 1])),
        ((slice(0, 3, 2), -2), ([0, 2], [0])),
    ]:
        part = idx[key]
        assert isinstance(part, st.BlockIndex)
        assert (part.batch, part.num_kv_heads, part.capacity) == (len(bs), len(hs), capacity)
        assert (part.seq_len, part.block_q, part.block_k) == (idx.seq_len, idx.block_q, idx.block_k)
        want = st.BlockIndex.from_selection(sel[bs][:, hs], seq_len=300, window=1, sinks=1, capacity=capacity)
        assert torch.equal(part.indices, want.indices) and torch.equal(part.counts, want.counts)
        part.validate()
    with pytest.raises(IndexError, match="batch index 3 is out of range for 3 batch entries"):
        idx[3]
    with pytest.raises(IndexError, match="kv_head index -3 is out of range"):
        idx[0, -3]
    with pytest.raises(IndexError, match="takes \\[batch\\] or \\[batch, kv_head\\]"):
        idx[0, 0, 0]
    with pytest.raises(TypeError, match="batch index must be an int or a slice, got float"):
        idx[1.0]


def test_attention_over_a_batch_of_the_index_is_that_batch_of_the_attention():
    q, k, v = make_qkv(3, 4, 2, 150, 16, torch.float64, seed=9)
    idx = st.BlockIndex.from_selection(
        ragged_selection(3, 2, 150, 32, 32, 3, seed=9), seq_len=150, block_q=32, block_k=32, window=1
    )
    full = st.sparse_attention(q, k, v, idx, backend="reference")
    one = st.sparse_attention(q[1:2], k[1:2], v[1:2], idx[1], backend="reference")
    assert torch.equal(one, full[1:2])
    head = st.sparse_attention(q[:, 2:4], k[:, 1:2], v[:, 1:2], idx[:, 1], backend="reference")
    assert torch.equal(head, full[:, 2:4])


GEOMETRY_40 = {"seq_len": 40, "block_q": 16, "block_k": 16}
EMPTY_BATCH_CONSTRUCTORS = [
    pytest.param(
        lambda: st.BlockIndex.from_selection(torch.zeros(0, 1, 3, 2, dtype=torch.int64), **GEOMETRY_40, window=1),
        id="from_selection",
    ),
    pytest.param(
        lambda: st.BlockIndex.from_selection(
            torch.zeros(0, 1, 3, 2, dtype=torch.int64),
            **GEOMETRY_40,
            window=1,
            sinks=1,
            document_ids=torch.zeros(0, 40, dtype=torch.int64),
        ),
        id="from_selection-documents-sinks",
    ),
    pytest.param(
        lambda: st.BlockIndex.from_selection(
            torch.zeros(0, 1, 3, 2, dtype=torch.int64), **GEOMETRY_40, sinks=1, check="full"
        ),
        id="from_selection-check-full",
    ),
    pytest.param(
        lambda: st.BlockIndex.from_dense(torch.zeros(0, 1, 3, 3, dtype=torch.bool), **GEOMETRY_40), id="from_dense"
    ),
    pytest.param(lambda: st.BlockIndex.full(0, 1, 40, 16, 16), id="full"),
    pytest.param(
        lambda: st.BlockIndex.full(0, 1, 40, 16, 16, document_ids=torch.zeros(0, 40, dtype=torch.int64)),
        id="full-documents",
    ),
    pytest.param(
        lambda: st.BlockIndex.from_csr(
            torch.zeros(1, dtype=torch.int64),
            torch.zeros(0, dtype=torch.int64),
            batch=0,
            num_kv_heads=1,
            **GEOMETRY_40,
            sinks=1,
            document_ids=torch.zeros(0, 40, dtype=torch.int64),
        ),
        id="from_csr-documents",
    ),
    pytest.param(
        lambda: st.BlockIndex.from_canonical(
            torch.zeros(0, 1, 3, 2, dtype=torch.int32), torch.zeros(0, 1, 3, dtype=torch.int32), **GEOMETRY_40
        ),
        id="from_canonical",
    ),
]


@pytest.mark.parametrize("make", EMPTY_BATCH_CONSTRUCTORS)
def test_constructors_take_an_empty_batch(make):
    """B = 0: every constructor gives an index of no rows, whose views and plan are empty too."""
    index = make()
    assert index.batch == 0 and index.num_q_blocks == 3
    index.validate()
    assert index.to_dense().shape == (0, 1, 3, 3)
    indptr, cols = index.to_csr()
    assert indptr.tolist() == [0] and cols.numel() == 0
    assert index.plan().kv_indptr.tolist() == [0]
