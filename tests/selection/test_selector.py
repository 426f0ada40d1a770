"""Selector: geometry, pooling, top-k + canonical merge, distillation targets and loss, quality metrics.

CPU, tiny shapes, reference semantics; every expected value comes from a brute-force computation.
"""

import math
import re

import pytest
import torch
from builders import make_qkv

import sparse_train as st
from sparse_train.kernels.reference.attention import reference_sparse_attention
from sparse_train.selection import (
    BlockScorer,
    allowed_dynamic_blocks,
    block_kl,
    block_mean,
    causal_block_mask,
    dense_block_mass,
    needle_block_recall,
    query_row_positions,
    selection_candidates,
    selection_geometry,
    selection_quality,
    sparse_block_mass,
)
from sparse_train.selection.scorer import DISTANCE_BUCKETS, block_distance_buckets

GEOMETRIES = [
    # (N, BQ, BK, top_k, window, sinks)
    pytest.param(100, 16, 16, 2, 2, 1, id="odd-N-bq16-bk16"),
    pytest.param(130, 32, 16, 3, 1, 2, id="bq32-bk16"),
    pytest.param(90, 16, 32, 1, 1, 0, id="bq16-bk32-no-sinks"),
    pytest.param(64, 16, 16, 8, 2, 1, id="full-selection"),
    pytest.param(200, 16, 16, 0, 3, 1, id="window-and-sinks-only"),
    pytest.param(150, 16, 16, 4, 0, 0, id="top-k-only"),
]


def _rand_qk(batch, heads, kv_heads, n, dim, seed=0, dtype=torch.float64):
    q, k, _ = make_qkv(batch, heads, kv_heads, n, dim, dtype=dtype, seed=seed)
    return q, k


@pytest.mark.parametrize("n,bq,bk,top_k,window,sinks", GEOMETRIES)
def test_geometry_predicts_canonical_index(n, bq, bk, top_k, window, sinks):
    """The shape-only geometry (used for the path decision without a device sync) must agree with
    the index that canonicalize actually builds from random scores."""
    geom = selection_geometry(n, bq, bk, top_k, window, sinks)
    scores = torch.randn(2, 3, geom.num_q_blocks, geom.num_k_blocks)
    cand = selection_candidates(scores, geom, window=window, sinks=sinks)
    index = st.BlockIndex.from_selection(
        cand, seq_len=n, block_q=bq, block_k=bk, window=window, sinks=sinks, capacity=geom.capacity, check="full"
    )
    index.validate()
    assert index.capacity == geom.capacity
    assert (index.counts.sum(dim=-1) == geom.selected_blocks).all()
    assert index.is_full() == geom.is_full
    causal = causal_block_mask(geom)
    assert int(causal.sum()) == geom.causal_blocks
    auto = st.BlockIndex.from_selection(cand, seq_len=n, block_q=bq, block_k=bk, window=window, sinks=sinks)
    assert auto.capacity == geom.capacity, "capacity tier must equal the one canonicalize picks itself"


@pytest.mark.parametrize("n,bq,bk,top_k,window,sinks", GEOMETRIES)
def test_selection_is_window_sinks_plus_topk_of_remaining(n, bq, bk, top_k, window, sinks):
    geom = selection_geometry(n, bq, bk, top_k, window, sinks)
    scores = torch.randn(1, 2, geom.num_q_blocks, geom.num_k_blocks)
    cand = selection_candidates(scores, geom, window=window, sinks=sinks)
    index = st.BlockIndex.from_selection(
        cand, seq_len=n, block_q=bq, block_k=bk, window=window, sinks=sinks, capacity=geom.capacity
    )
    dense = index.to_dense()
    allowed = allowed_dynamic_blocks(geom, window, sinks)
    causal = causal_block_mask(geom)
    for h in range(2):
        for i in range(geom.num_q_blocks):
            row_allowed = allowed[i].nonzero().flatten().tolist()
            best = sorted(row_allowed, key=lambda j: -float(scores[0, h, i, j]))[:top_k]
            forced = set(j for j in range(geom.num_k_blocks) if causal[i, j] and not allowed[i, j])
            expected = forced | set(best)
            got = set(dense[0, h, i].nonzero().flatten().tolist())
            assert got == expected, f"row (h={h}, i={i})"


def test_selection_puts_empty_key_blocks_last():
    """With seq_lens, blocks past the valid length rank below every real block."""
    n, b = 128, 16
    geom = selection_geometry(n, b, b, 3, 1, 0)
    scores = torch.zeros(1, 1, geom.num_q_blocks, geom.num_k_blocks)
    scores[..., 5:] = 100.0  # padding blocks would win on score alone
    cand = selection_candidates(scores, geom, window=1, sinks=0, seq_lens=torch.tensor([70]))
    last_row = cand[0, 0, -1].tolist()
    real = [j for j in last_row if 0 <= j and j * b < 70]
    assert len(real) == 3, f"expected the 3 picks to be real key blocks, got {last_row}"


@pytest.mark.parametrize("group", [1, 3], ids=["group1", "group3"])
@pytest.mark.parametrize("with_lengths", [False, True], ids=["no-lengths", "lengths"])
def test_block_mean_matches_loop(group, with_lengths):
    batch, heads, n, dim, block = 2, 2, 37, 5, 8
    x = torch.randn(batch, heads * group, n, dim, dtype=torch.float64)
    lengths = torch.tensor([37, 13]) if with_lengths else None
    got = block_mean(x, block, group, lengths)
    nb = math.ceil(n / block)
    assert got.shape == (batch, heads, nb, dim)
    for bi in range(batch):
        limit = n if lengths is None else int(lengths[bi])
        for h in range(heads):
            for j in range(nb):
                rows = [r for r in range(j * block, min(n, (j + 1) * block)) if r < limit]
                if not rows:
                    assert torch.all(got[bi, h, j] == 0)
                    continue
                ref = x[bi, h * group : (h + 1) * group, rows].mean(dim=(0, 1))
                torch.testing.assert_close(got[bi, h, j].double(), ref, rtol=1e-5, atol=1e-6)


def test_scorer_init_tracks_pooled_logit():
    """JL initialisation: before training, the score approximates scale * <qbar, kbar>."""
    torch.manual_seed(0)
    scorer = BlockScorer(num_heads=4, num_kv_heads=2, head_dim=32, selector_dim=512)
    q, k = _rand_qk(1, 4, 2, 256, 32, dtype=torch.float32)
    k = k + q.view(1, 2, 2, 256, 32).mean(2)  # make pooled logits vary a lot
    qbar, kbar = scorer.pool(q, k, 16, 16)
    scale = 1 / math.sqrt(32)
    got = scorer(qbar, kbar, scale).flatten()
    ref = (torch.matmul(qbar, kbar.transpose(-1, -2)) * scale).flatten()
    corr = torch.corrcoef(torch.stack([got, ref]))[0, 1]
    assert corr > 0.95, f"correlation {corr:.3f}"


def _rotate_half_rope(x, theta):
    """RoPE as the Llama / Hugging Face models apply it (pairs (i, i + D/2), position n turns by n * f_i)."""
    n, dim = x.shape[-2], x.shape[-1]
    freqs = theta ** (-torch.arange(0, dim, 2, dtype=torch.float64) / dim)
    angles = torch.arange(n, dtype=torch.float64).view(-1, 1) * freqs
    x1, x2 = x[..., : dim // 2], x[..., dim // 2 :]
    return torch.cat((x1 * angles.cos() - x2 * angles.sin(), x2 * angles.cos() + x1 * angles.sin()), dim=-1)


@pytest.mark.parametrize("key_pooling", ["mean", "mean_max"], ids=["mean", "mean-max"])
@pytest.mark.parametrize("with_lengths", [False, True], ids=["no-lengths", "lengths"])
def test_rope_aware_scorer_pools_the_unrotated_content(key_pooling, with_lengths):
    """With RoPE frequencies set, the pooled features are those of the pre-rotation q and k."""
    theta, block = 500.0, 8
    q_content, k_content = _rand_qk(2, 6, 2, 45, 16, dtype=torch.float32)
    lengths = torch.tensor([45, 20]) if with_lengths else None
    scorer = BlockScorer(num_heads=6, num_kv_heads=2, head_dim=16, selector_dim=8, key_pooling=key_pooling)
    scorer.set_rope(st.selection.rope_inverse_frequencies(theta, 16))
    qbar, kbar = scorer.pool(
        _rotate_half_rope(q_content.double(), theta).float(),
        _rotate_half_rope(k_content.double(), theta).float(),
        block,
        block,
        lengths,
    )
    plain = BlockScorer(num_heads=6, num_kv_heads=2, head_dim=16, selector_dim=8, key_pooling=key_pooling)
    want_q, want_k = plain.pool(q_content, k_content, block, block, lengths)
    torch.testing.assert_close(qbar, want_q, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(kbar, want_k, rtol=1e-4, atol=1e-5)
    # without the frequencies the same rotated inputs pool to something else
    rotated_q, _ = plain.pool(_rotate_half_rope(q_content.double(), theta).float(), k_content, block, block, lengths)
    assert (rotated_q - want_q).abs().max() > 0.1


def test_distance_bias_gradient_is_the_per_bucket_sum():
    """The distance bias's backward (one masked sum per bucket) equals autograd's gradient of plain
    indexing, on a geometry whose buckets repeat many times."""
    from sparse_train.selection.scorer import _BucketLookup

    geometry = st.selection.selection_geometry(1000, 16, 16, 4, 2, 1)
    buckets = block_distance_buckets(geometry)
    table = torch.randn(3, DISTANCE_BUCKETS, dtype=torch.float64, requires_grad=True)
    grad = torch.randn(3, *buckets.shape, dtype=torch.float64)
    (ours,) = torch.autograd.grad(_BucketLookup.apply(table, buckets), table, grad)
    (plain,) = torch.autograd.grad(table[:, buckets], table, grad)
    torch.testing.assert_close(ours, plain, rtol=1e-12, atol=1e-12)
    assert torch.equal(_BucketLookup.apply(table, buckets), table[:, buckets])


def test_rope_aware_scorer_rejects_bad_frequencies():
    scorer = BlockScorer(num_heads=2, num_kv_heads=1, head_dim=8, selector_dim=4)
    with pytest.raises(ValueError, match="at most head_dim/2=4"):
        scorer.set_rope(torch.ones(5))
    with pytest.raises(ValueError, match="finite"):
        scorer.set_rope(torch.tensor([1.0, float("nan")]))
    with pytest.raises(ValueError, match="selector_rope_theta"):
        st.SparseAttentionConfig(selector_rope_theta=0.0)
    layer = st.SparseAttention(st.SparseAttentionConfig(selector_rope_theta=1e4), 2, 1, 8)
    torch.testing.assert_close(layer.scorer.rope_inv_freq, 1e4 ** (-torch.arange(0, 8, 2) / 8.0))
    assert "scorer.rope_inv_freq" not in layer.state_dict()


def test_distance_buckets_are_log2_of_blocks_behind_the_causal_edge():
    geometry = selection_geometry(100, 16, 8, 4, 1, 0)  # 7 query blocks, 13 key blocks
    buckets = block_distance_buckets(geometry)
    for i in range(geometry.num_q_blocks):
        last = (min((i + 1) * 16, 100) - 1) // 8
        for j in range(geometry.num_k_blocks):
            behind = max(0, last - j)
            assert buckets[i, j] == min(behind.bit_length(), DISTANCE_BUCKETS - 1), (i, j)


def test_distance_bias_starts_at_zero_and_adds_per_bucket():
    torch.manual_seed(0)
    geometry = selection_geometry(96, 16, 16, 2, 1, 0)
    scorer = BlockScorer(
        num_heads=4, num_kv_heads=2, head_dim=8, selector_dim=4, lr_multiplier=10.0, distance_bias=True
    )
    q, k = _rand_qk(1, 4, 2, 96, 8, dtype=torch.float32)
    qbar, kbar = scorer.pool(q, k, 16, 16)
    plain = scorer(qbar, kbar, 0.5)
    torch.testing.assert_close(scorer(qbar, kbar, 0.5, geometry), plain)
    with torch.no_grad():
        scorer.distance_bias.copy_(torch.arange(2 * DISTANCE_BUCKETS, dtype=torch.float32).view(2, -1))
    got = scorer(qbar, kbar, 0.5, geometry) - plain
    buckets = block_distance_buckets(geometry)
    want = 10.0 * torch.stack([buckets.float(), buckets.float() + DISTANCE_BUCKETS])  # multiplier 10
    torch.testing.assert_close(got[0], want)
    assert BlockScorer(4, 2, 8, 4).distance_bias is None  # off unless asked for


def test_scorer_logits_stay_float32_under_autocast():
    """Autocast would run the projections and the product in bfloat16 and tie blocks the selector ranks: the
    scorer computes its logits in float32 all the same, equal to those outside autocast."""
    torch.manual_seed(0)
    geometry = selection_geometry(256, 16, 16, 2, 1, 0)
    scorer = BlockScorer(num_heads=4, num_kv_heads=2, head_dim=8, selector_dim=4, distance_bias=True)
    q, k = _rand_qk(1, 4, 2, 256, 8, dtype=torch.float32)
    qbar, kbar = scorer.pool(q, k, 16, 16)
    plain = scorer(qbar, kbar, 0.5, geometry)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        mixed = scorer(qbar, kbar, 0.5, geometry)
    assert mixed.dtype == torch.float32
    torch.testing.assert_close(mixed, plain, rtol=0, atol=0)


def _brute_block_mass(q, k, allowed_keys, block_q, block_k, scale, seq_lens=None, row_pool="mean"):
    """Pooled mass per (b, kv head, query block, key block) from an explicit [B, HKV, N, N] mask;
    ``row_pool="max"`` takes each block's largest single-row mass, renormalised over the blocks."""
    batch, heads, n, _ = q.shape
    kv_heads = k.shape[1]
    group = heads // kv_heads
    kk = k.repeat_interleave(group, dim=1)
    logits = torch.einsum("bhqd,bhkd->bhqk", q, kk) * scale
    mask = allowed_keys.repeat_interleave(group, dim=1)
    p = torch.softmax(logits.masked_fill(~mask, float("-inf")), dim=-1).nan_to_num(0.0)
    nqb, nkb = math.ceil(n / block_q), math.ceil(n / block_k)
    out = torch.zeros(batch, kv_heads, nqb, nkb, dtype=q.dtype)
    for bi in range(batch):
        limit = n if seq_lens is None else int(seq_lens[bi])
        for h in range(kv_heads):
            for i in range(nqb):
                rows = [r for r in range(i * block_q, min(n, (i + 1) * block_q)) if r < limit]
                if not rows:
                    continue
                pr = p[bi, h * group : (h + 1) * group, rows]  # [G, R, N]
                for j in range(nkb):
                    per_row = pr[..., j * block_k : (j + 1) * block_k].sum(-1)
                    out[bi, h, i, j] = per_row.mean() if row_pool == "mean" else per_row.max()
    if row_pool == "max":
        out = out / out.sum(-1, keepdim=True).clamp(min=1e-30)
    return out


def _element_mask(index, n, seq_lens=None):
    """[B, HKV, N, N] bool: key block selected for the query's block, causal, key < seq_len."""
    dense = index.to_dense()
    qb = torch.arange(n) // index.block_q
    kb = torch.arange(n) // index.block_k
    sel = dense[:, :, qb][:, :, :, kb]
    pos = torch.arange(n)
    sel = sel & (pos.view(1, -1) <= pos.view(-1, 1))
    if seq_lens is not None:
        sel = sel & (pos.view(1, 1, 1, -1) < seq_lens.view(-1, 1, 1, 1))
    return sel


@pytest.mark.parametrize("row_pool", ["max", "mean"], ids=["row-max", "row-mean"])
@pytest.mark.parametrize("with_lengths", [False, True], ids=["no-lengths", "lengths"])
def test_sparse_block_mass_matches_brute_force(with_lengths, row_pool):
    torch.manual_seed(1)
    n, bq, bk = 75, 16, 16
    q, k = _rand_qk(2, 4, 2, n, 8, seed=1)
    seq_lens = torch.tensor([75, 40]) if with_lengths else None
    geom = selection_geometry(n, bq, bk, 1, 1, 1)
    cand = selection_candidates(torch.randn(2, 2, geom.num_q_blocks, geom.num_k_blocks), geom, window=1, sinks=1)
    index = st.BlockIndex.from_selection(
        cand, seq_len=n, block_q=bq, block_k=bk, window=1, sinks=1, capacity=geom.capacity
    )
    scale = 0.3
    _, lse = reference_sparse_attention(q, k, k, index, scale=scale, seq_lens=seq_lens)
    with_lse, valid_a = sparse_block_mass(q, k, index, scale=scale, lse=lse, seq_lens=seq_lens, row_pool=row_pool)
    without, valid_b = sparse_block_mass(q, k, index, scale=scale, seq_lens=seq_lens, chunk_mb=1, row_pool=row_pool)
    brute = _brute_block_mass(q, k, _element_mask(index, n, seq_lens), bq, bk, scale, seq_lens, row_pool=row_pool)
    expected = brute.gather(-1, index.indices.long().clamp(min=0)) * (index.indices >= 0)
    expected = expected / expected.sum(-1, keepdim=True).clamp(min=1e-30)
    assert torch.equal(valid_a, valid_b)
    live = valid_a.unsqueeze(-1).expand_as(expected)
    torch.testing.assert_close(with_lse[live].double(), expected[live], rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(without[live].double(), expected[live], rtol=1e-5, atol=1e-6)
    if with_lengths:
        assert not valid_a[1, :, 3:].any(), "query blocks entirely past seq_lens must be invalid rows"


@pytest.mark.parametrize("row_pool", ["max", "mean"], ids=["row-max", "row-mean"])
def test_dense_block_mass_matches_brute_force_and_sums_to_one(row_pool):
    n, bq, bk = 70, 16, 8
    q, k = _rand_qk(1, 6, 2, n, 8, seed=2)
    mass, valid = dense_block_mass(q, k, block_q=bq, block_k=bk, scale=0.25, chunk_mb=1, row_pool=row_pool)
    causal = torch.ones(1, 2, n, n, dtype=torch.bool).tril()
    brute = _brute_block_mass(q, k, causal, bq, bk, 0.25, row_pool=row_pool)
    torch.testing.assert_close(mass.double(), brute, rtol=1e-5, atol=1e-7)
    assert valid.all()
    torch.testing.assert_close(mass.sum(-1), torch.ones_like(mass.sum(-1)))
    picks = torch.tensor([1, 3])
    subset, _ = dense_block_mass(q, k, block_q=bq, block_k=bk, scale=0.25, query_blocks=picks, row_pool=row_pool)
    torch.testing.assert_close(subset, mass[:, :, picks])


def test_row_subsampling_positions_and_estimate():
    pos = query_row_positions(3, 16, 4, None)
    assert pos.tolist() == [[2, 6, 10, 14], [18, 22, 26, 30], [34, 38, 42, 46]]
    assert torch.equal(query_row_positions(2, 8, None, None), torch.arange(16).view(2, 8))
    q, k = _rand_qk(1, 2, 1, 128, 8, seed=3)
    exact, _ = dense_block_mass(q, k, block_q=32, block_k=16, scale=0.3, row_pool="mean")
    approx, _ = dense_block_mass(q, k, block_q=32, block_k=16, scale=0.3, rows_per_block=8, row_pool="mean")
    assert not torch.allclose(exact, approx), "subsampling must actually use fewer rows"
    assert (exact - approx).abs().max() < 0.25


def test_block_kl_values_and_nan_safety():
    target = torch.tensor([[0.5, 0.5, 0.0], [1.0, 0.0, 0.0], [0.0, 0.0, 0.0]])
    allowed = torch.tensor([[True, True, False], [True, True, True], [False, False, False]])
    row_valid = torch.tensor([True, True, False])
    logits = torch.zeros(3, 3, requires_grad=True)
    loss = block_kl(target, logits, allowed, row_valid)
    # row 0: uniform over 2 allowed == target -> 0; row 1: KL(delta || uniform over 3) = log 3
    torch.testing.assert_close(loss, torch.tensor(math.log(3) / 2))
    loss.backward()
    assert torch.isfinite(logits.grad).all()
    assert logits.grad[2].abs().sum() == 0 and logits.grad[0, 2] == 0
    perfect = torch.log(torch.tensor([[0.5, 0.5, 1.0], [1.0, 1e-30, 1e-30], [1.0, 1.0, 1.0]]))
    assert block_kl(target, perfect, allowed, row_valid) < 1e-6


def test_query_mean_max_pooling():
    """``query_pooling="mean_max"``: qbar is [mean over the block's rows and the group's heads,
    element-wise max over the rows of the group's mean query] (a brute-force check), and the max half starts with zero
    weight, so the initial
    scores equal those of mean pooling."""
    torch.manual_seed(0)
    q, k = _rand_qk(2, 4, 2, 45, 8, dtype=torch.float32)
    lengths = torch.tensor([45, 20])
    both = BlockScorer(num_heads=4, num_kv_heads=2, head_dim=8, selector_dim=4, query_pooling="mean_max")
    plain = BlockScorer(num_heads=4, num_kv_heads=2, head_dim=8, selector_dim=4)
    assert both.query_proj.shape == (2, 16, 4) and plain.query_proj.shape == (2, 8, 4)
    qbar, kbar = both.pool(q, k, 16, 8, lengths)
    for bi in range(2):
        for h in range(2):
            for i in range(3):
                rows = [r for r in range(16 * i, min(45, 16 * i + 16)) if r < int(lengths[bi])]
                if not rows:
                    assert torch.all(qbar[bi, h, i] == 0)
                    continue
                block = q[bi, 2 * h : 2 * h + 2, rows]  # [G, R, D]
                torch.testing.assert_close(qbar[bi, h, i, :8], block.mean(dim=(0, 1)))
                torch.testing.assert_close(qbar[bi, h, i, 8:], block.mean(dim=0).amax(dim=0))
    plain_qbar, plain_kbar = plain.pool(q, k, 16, 8, lengths)
    torch.testing.assert_close(both(qbar, kbar, 0.3), plain(plain_qbar, plain_kbar, 0.3))
    with pytest.raises(ValueError, match="query_pooling"):
        BlockScorer(4, 2, 8, 4, query_pooling="max")
    layer = st.SparseAttention(st.SparseAttentionConfig(query_pooling="mean_max"), 4, 2, 8)
    assert layer.scorer.query_proj.shape == (2, 16, 32)
    # a selector trained with mean pooling (an older checkpoint) loads as a zero max half: same scores
    with torch.no_grad():
        plain.query_proj.normal_()
        plain.key_proj.normal_()
    both.load_state_dict(plain.state_dict())
    assert torch.equal(both.query_proj[:, 8:], torch.zeros(2, 8, 4))
    torch.testing.assert_close(both(qbar, kbar, 0.3), plain(plain_qbar, plain_kbar, 0.3))


def test_distillation_training_improves_selector():
    """Distill a deliberately bad selector (independent projections) toward dense block mass: the
    loss falls and the attention-mass recall closes most of the gap to the best selection of the
    same size (top blocks of the target itself); gradients never reach q/k."""
    torch.manual_seed(0)
    n, block, dim = 256, 16, 16
    q, k = _rand_qk(1, 4, 2, n, dim, seed=4, dtype=torch.float32)
    # planted structure: each query block prefers a few earlier key blocks
    k = k + 2.0 * q.view(1, 2, 2, n, dim).mean(2).roll(shifts=3 * block, dims=2)
    q.requires_grad_(True)
    k.requires_grad_(True)
    cfg = st.SparseAttentionConfig(
        block_q=block,
        block_k=block,
        top_k=2,
        window=1,
        sinks=1,
        selector_dim=16,
        distill="dense",
        dense_fallback=False,
        backend="reference",
        dense_warmup_steps=0,
        selector_lr_multiplier=1.0,
    )
    attn = st.SparseAttention(cfg, num_heads=4, num_kv_heads=2, head_dim=dim)
    with torch.no_grad():
        attn.scorer.query_proj.normal_()
        attn.scorer.key_proj.normal_()
        attn.scorer.query_proj[:, dim:] = 0.0  # random mean projections; the query-max half as initialised
    opt = torch.optim.Adam(attn.scorer.parameters(), lr=0.05)
    picks = torch.arange(n // block)

    def quality(index):
        return float(selection_quality(q, k, index, scale=attn.scale, query_blocks=picks)["mass_recall_mean"])

    losses, recalls = [], []
    # 120 steps: the default mean_max query summary has twice the features of "mean"; on this planted
    # toy it needs about 3x the steps of "mean" (40) to reach the oracle's recall (measured: 40 steps
    # close 52% of the gap, 120 steps all of it)
    for _ in range(120):
        attn(q, k, k)
        loss = attn.selector_loss
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(float(loss.detach()))
        recalls.append(quality(attn._last_index))
    geometry = selection_geometry(n, block, block, 2, 1, 1)
    target, _ = dense_block_mass(q, k, block_q=block, block_k=block, scale=attn.scale)
    best = target.masked_fill(~allowed_dynamic_blocks(geometry, 1, 1), -1.0).topk(2, dim=-1)
    oracle = st.BlockIndex.from_selection(
        torch.where(best.values >= 0, best.indices, -1), seq_len=n, block_q=block, block_k=block, window=1, sinks=1
    )
    best_recall = quality(oracle)
    print(
        f"KL {losses[0]:.4f} -> {losses[-1]:.4f}; mass recall {recalls[0]:.4f} -> {recalls[-1]:.4f} "
        f"(best possible {best_recall:.4f})"
    )
    assert q.grad is None and k.grad is None, "distillation must not send gradients into the main model"
    assert losses[-1] < 0.5 * losses[0], f"KL {losses[0]:.3f} -> {losses[-1]:.3f}"
    assert best_recall > recalls[0] + 0.02, "the planted structure must leave room to improve"
    assert recalls[-1] - recalls[0] > 0.75 * (best_recall - recalls[0])


def test_selector_lr_multiplier_is_an_adam_learning_rate_factor():
    """Under Adam, multiplier m with learning rate lr/m follows the same trajectory as multiplier 1
    with lr (the reparametrisation changes only the effective step size of the selector)."""
    n, block, dim = 128, 16, 16
    q, k = _rand_qk(1, 4, 2, n, dim, seed=7, dtype=torch.float32)

    def run(multiplier, lr):
        torch.manual_seed(3)
        cfg = st.SparseAttentionConfig(
            selector="pooled",
            block_q=block,
            block_k=block,
            top_k=2,
            window=1,
            sinks=1,
            selector_dim=8,
            distill="dense",
            dense_fallback=False,
            backend="reference",
            dense_warmup_steps=0,
            selector_lr_multiplier=multiplier,
        )
        attn = st.SparseAttention(cfg, num_heads=4, num_kv_heads=2, head_dim=dim)
        # Adam's eps is the one term that does not scale with the gradient; at the default 1e-8 it moves
        # the parameters whose gradients are small (the query-max half) by up to 3e-4, at 1e-12 by 2e-6
        opt = torch.optim.Adam(attn.scorer.parameters(), lr=lr, eps=1e-12)
        for _ in range(5):
            attn(q, k, k)
            opt.zero_grad()
            attn.selector_loss.backward()
            opt.step()
        qbar, kbar = attn.scorer.pool(q, k, block, block)
        return attn.scorer(qbar, kbar, attn.scale).detach()

    base = run(1.0, 0.01)
    torch.testing.assert_close(run(10.0, 0.001), base, rtol=1e-4, atol=1e-4)
    assert not torch.allclose(run(10.0, 0.01), base, rtol=1e-3, atol=1e-3), "10x must move faster"


@pytest.mark.parametrize("with_lengths", [False, True], ids=["no-lengths", "lengths"])
def test_selection_quality_is_per_row_dense_mass_inside_selection(with_lengths):
    n, block = 96, 16
    q, k = _rand_qk(2, 4, 2, n, 8, seed=5)
    seq_lens = torch.tensor([96, 53]) if with_lengths else None
    geom = selection_geometry(n, block, block, 1, 1, 1)
    cand = selection_candidates(torch.randn(2, 2, geom.num_q_blocks, geom.num_k_blocks), geom, window=1, sinks=1)
    index = st.BlockIndex.from_selection(cand, seq_len=n, block_q=block, block_k=block, window=1, sinks=1)
    picks = torch.tensor([0, 2, 5])
    # brute force: dense causal softmax per row, mass inside the row's selected key blocks
    kk = k.repeat_interleave(2, dim=1)
    logits = torch.einsum("bhqd,bhkd->bhqk", q, kk) * 0.5
    pos = torch.arange(n)
    allowed = (pos.view(1, -1) <= pos.view(-1, 1)).view(1, 1, n, n)
    limit = torch.full((2,), n) if seq_lens is None else seq_lens
    allowed = allowed & (pos.view(1, 1, 1, n) < limit.view(-1, 1, 1, 1))
    p = torch.softmax(logits.masked_fill(~allowed, float("-inf")), dim=-1)
    sel = index.to_dense().repeat_interleave(2, dim=1)[:, :, pos // block][..., pos // block]  # [B, HQ, N, N]
    per_row = (p * sel).sum(-1)  # [B, HQ, N]
    rows = [
        (b, h, r)
        for b in range(2)
        for h in range(4)
        for r in range(n)
        if r // block in picks.tolist() and r < int(limit[b])
    ]
    expected = torch.stack([per_row[b, h, r] for b, h, r in rows])
    # oracle: per (batch, kv head, query block), the same number of key blocks with the most row mass
    mass_on_block = torch.stack(
        [p[..., pos // block == j].sum(-1) for j in range(n // block)], dim=-1
    )  # [B, HQ, N, NKB]
    oracle_rows = []
    for b, h, r in rows:
        i, kv = r // block, h // 2
        group_rows = [
            (hh, rr) for hh in (2 * kv, 2 * kv + 1) for rr in range(i * block, (i + 1) * block) if rr < int(limit[b])
        ]
        totals = sum(mass_on_block[b, hh, rr] for hh, rr in group_rows)
        best = torch.topk(totals, int(index.to_dense()[b, kv, i].sum())).indices
        oracle_rows.append(mass_on_block[b, h, r, best].sum())
    oracle = torch.stack(oracle_rows)
    got = selection_quality(q, k, index, scale=0.5, query_blocks=picks, seq_lens=seq_lens)
    print(
        f"mass recall mean {float(got['mass_recall_mean']):.4f}, p5 {float(got['mass_recall_p5']):.4f}; "
        f"oracle mean {float(got['oracle_mass_recall_mean']):.4f}"
    )
    assert float(got["mass_recall_mean"]) == pytest.approx(float(expected.mean()), rel=1e-6)
    assert float(got["mass_recall_p5"]) == pytest.approx(float(torch.quantile(expected, 0.05)), rel=1e-6)
    assert float(got["mass_recall_p5"]) < float(got["mass_recall_mean"]) < 1.0
    assert float(got["oracle_mass_recall_mean"]) == pytest.approx(float(oracle.mean()), rel=1e-6)
    assert float(got["oracle_mass_recall_p5"]) == pytest.approx(float(torch.quantile(oracle, 0.05)), rel=1e-6)
    assert float(got["oracle_mass_recall_mean"]) >= float(got["mass_recall_mean"]) - 1e-9


def test_selection_quality_of_full_selection_is_one():
    n, block = 80, 16
    q, k = _rand_qk(1, 2, 1, n, 8, seed=6)
    index = st.BlockIndex.full(1, 1, n, block_q=block, block_k=block)
    got = selection_quality(q, k, index, scale=0.5, query_blocks=torch.arange(index.num_q_blocks))
    for key in ("mass_recall_mean", "mass_recall_p5", "oracle_mass_recall_mean", "oracle_mass_recall_p5"):
        assert float(got[key]) == pytest.approx(1.0, abs=1e-6), key


def test_needle_block_recall_counts_selected_needle_blocks():
    # N=64, blocks of 16; kv head 0 selects key block 1 for query block 3, kv head 1 selects block 2
    selected = torch.tensor([[[[-1], [-1], [-1], [1]], [[-1], [-1], [-1], [2]]]])
    index = st.BlockIndex.from_selection(selected, seq_len=64, block_q=16, block_k=16, window=1, sinks=0)
    pairs = torch.tensor([[0, 60, 20], [0, 61, 40], [0, 62, 63]])  # needles in key blocks 1, 2 and 3 (window)
    recall = needle_block_recall(index, pairs)
    torch.testing.assert_close(recall, torch.tensor([2 / 3, 2 / 3]))


def test_building_a_selector_leaves_the_global_rng_alone():
    """A sparse model and its dense twin built from one seed get identical weights."""
    torch.manual_seed(123)
    before = torch.rand(3)
    torch.manual_seed(123)
    BlockScorer(num_heads=4, num_kv_heads=2, head_dim=16, selector_dim=8, key_pooling="mean_max", distance_bias=True)
    st.SparseAttention(st.SparseAttentionConfig(), 4, 2, 16)
    assert torch.equal(torch.rand(3), before)


def test_sparse_transformer_and_dense_twin_start_from_the_same_weights():
    from sparse_train.lightning import Transformer, TransformerConfig

    models = {}
    for attention in ("sparse", "dense"):
        torch.manual_seed(7)
        models[attention] = Transformer(TransformerConfig(vocab_size=32, d_model=32, n_layers=2, attention=attention))
    dense_state = models["dense"].state_dict()
    sparse_state = models["sparse"].state_dict()
    assert set(dense_state) < set(sparse_state)
    for name, tensor in dense_state.items():
        assert torch.equal(sparse_state[name], tensor), name


@pytest.mark.parametrize("unrotate", [True, False], ids=["unrotated", "rotated"])
def test_transformer_hands_its_rope_to_the_selector(unrotate):
    from sparse_train.lightning import Transformer, TransformerConfig

    cfg = TransformerConfig(vocab_size=32, d_model=32, n_layers=1, rope_theta=500.0, selector_unrotates_rope=unrotate)
    scorer = Transformer(cfg).blocks[0].attn.core.scorer
    if unrotate:
        torch.testing.assert_close(scorer.rope_inv_freq, st.selection.rope_inverse_frequencies(500.0, 8))
    else:
        assert scorer.rope_inv_freq.numel() == 0
    explicit = TransformerConfig(vocab_size=32, d_model=32, n_layers=1, sparse={"selector_rope_theta": 9.0})
    torch.testing.assert_close(
        Transformer(explicit).blocks[0].attn.core.scorer.rope_inv_freq, st.selection.rope_inverse_frequencies(9.0, 8)
    )


def test_selector_saved_without_distance_bias_loads_as_zero_bias():
    old = st.SparseAttention(st.SparseAttentionConfig(selector="pooled", selector_distance_bias=False), 4, 2, 16)
    state = old.state_dict()
    assert "scorer.distance_bias" not in state
    new = st.SparseAttention(st.SparseAttentionConfig(selector="pooled"), 4, 2, 16)
    with torch.no_grad():
        new.scorer.distance_bias.fill_(1.0)
    new.load_state_dict(state, strict=True)
    assert torch.equal(new.scorer.distance_bias, torch.zeros_like(new.scorer.distance_bias))
    assert torch.equal(new.scorer.query_proj, old.scorer.query_proj)


def _multiplier_module(selector: str, multiplier: float) -> st.SparseAttention:
    config = st.SparseAttentionConfig(
        selector=selector,
        block_q=16,
        block_k=16,
        top_k=2,
        window=1,
        sinks=1,
        selector_dim=8,
        backend="reference",
        dense_warmup_steps=0,
        dense_fallback=False,
        selector_lr_multiplier=multiplier,
    )
    return st.SparseAttention(config, num_heads=4, num_kv_heads=2, head_dim=16).train()


@pytest.mark.parametrize("selector", ["pooled", "token"])
@pytest.mark.parametrize("configured", [5.0, 40.0], ids=["configured-half", "configured-4x"])
def test_state_dict_of_another_multiplier_loads_at_the_configured_multiplier(selector, configured):
    """A selector saved at ``selector_lr_multiplier`` 10 loaded into a module configured with 5 or 40: the module
    keeps its configured multiplier (the pace it learns at: the stored parameters' gradients scale with it), and
    the effective weights (multiplier x parameter), the attention output, the selection and the selector loss are
    the saved module's bitwise."""
    torch.manual_seed(0)
    saved = _multiplier_module(selector, 10.0)
    with torch.no_grad():
        for p in saved.scorer.parameters():
            p.add_(torch.randn_like(p) * 0.05)  # a trained selector, not the initialisation
    loaded = _multiplier_module(selector, configured)
    loaded.load_state_dict(saved.state_dict(), strict=True)
    assert float(loaded.scorer.lr_multiplier) == configured
    for (name, want), got in zip(saved.scorer.named_parameters(), loaded.scorer.parameters()):
        assert torch.equal(got * loaded.scorer.lr_multiplier, want * saved.scorer.lr_multiplier), name
    q, k, v = make_qkv(2, 4, 2, 112, 16, seed=5)
    outputs = [module(q, k, v) for module in (saved, loaded)]
    assert torch.equal(outputs[0], outputs[1])
    assert torch.equal(saved.last_selection.indices, loaded.last_selection.indices)
    assert torch.equal(saved.selector_loss, loaded.selector_loss)
    saved.selector_loss.backward()
    loaded.selector_loss.backward()
    for (name, want), got in zip(saved.scorer.named_parameters(), loaded.scorer.parameters()):
        assert torch.equal(got.grad, want.grad * (configured / 10.0)), name


@pytest.mark.parametrize("selector", ["pooled", "token"])
@pytest.mark.parametrize(
    "saved_multiplier,configured,message",
    [
        pytest.param(10.0, 3.0, "the ratio 3.33333, not a power of two", id="ratio-not-a-power-of-two"),
        pytest.param(2.0**100, 2.0**-100, "leaves the range of torch.float32", id="rescaled-out-of-range"),
    ],
)
def test_state_dict_of_a_multiplier_that_cannot_be_rescaled_exactly_is_refused(
    selector, saved_multiplier, configured, message
):
    """When the saved parameters cannot be rescaled to the configured multiplier with their effective weights kept
    exactly, loading raises a ValueError naming selector_lr_multiplier and the value that loads the state dict."""
    state = _multiplier_module(selector, saved_multiplier).state_dict()
    module = _multiplier_module(selector, configured)
    before = {name: p.clone() for name, p in module.scorer.named_parameters()}
    with pytest.raises(
        ValueError, match=re.escape(message) + ".*" + re.escape(f"selector_lr_multiplier={saved_multiplier:g} ")
    ):
        module.load_state_dict(state)
    assert float(module.scorer.lr_multiplier) == configured
    assert all(torch.equal(p, before[name]) for name, p in module.scorer.named_parameters())
