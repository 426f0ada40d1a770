"""Adaptive budget (``top_p``) and the oracle budget metric.

CPU, tiny shapes; expected values come from per-row loops written out in Python.
"""

import math

import pytest
import torch
from builders import make_qkv

import sparse_train as st
from sparse_train.selection import (
    allowed_dynamic_blocks,
    oracle_budget,
    selection_candidates,
    selection_geometry,
    selection_quality,
)


def _expected_top_p(scores, geom, window, sinks, top_p):
    """Per row: allowed blocks by descending score, kept while the softmax mass before them is < top_p,
    at most dynamic_k of them."""
    allowed = allowed_dynamic_blocks(geom, window, sinks)
    out = []
    for row_scores, row_allowed in zip(
        scores.reshape(-1, scores.shape[-1]), allowed.repeat(scores.shape[0] * scores.shape[1], 1)
    ):
        ids = [j for j in range(row_scores.numel()) if row_allowed[j]]
        if not ids:
            out.append(set())
            continue
        logits = torch.tensor([float(row_scores[j]) for j in ids], dtype=torch.float64)
        probs = torch.softmax(logits, dim=0)
        ranked = sorted(range(len(ids)), key=lambda t: -float(logits[t]))[: geom.dynamic_k]
        kept, before = set(), 0.0
        for t in ranked:
            if before >= top_p:
                break
            kept.add(ids[t])
            before += float(probs[t])
        out.append(kept)
    return out


@pytest.mark.parametrize("top_p", [0.3, 0.8, 0.99], ids=["p0.3", "p0.8", "p0.99"])
@pytest.mark.parametrize("temperature", [0.3, 3.0], ids=["peaked", "flat"])
def test_top_p_keeps_fewest_best_blocks_reaching_predicted_mass(top_p, temperature):
    n, block, top_k, window, sinks = 190, 16, 5, 1, 1
    geom = selection_geometry(n, block, block, top_k, window, sinks)
    gen = torch.Generator().manual_seed(3)
    scores = torch.randn(2, 3, geom.num_q_blocks, geom.num_k_blocks, generator=gen, dtype=torch.float64) / temperature
    got = selection_candidates(scores, geom, window=window, sinks=sinks, top_p=top_p)
    assert got.shape == (2, 3, geom.num_q_blocks, geom.dynamic_k)
    expected = _expected_top_p(scores, geom, window, sinks, top_p)
    for row, want in zip(got.reshape(-1, got.shape[-1]), expected):
        assert {int(j) for j in row if j >= 0} == want
    full = selection_candidates(scores, geom, window=window, sinks=sinks)
    kept, all_kept = int((got >= 0).sum()), int((full >= 0).sum())
    print(f"top_p={top_p} temperature={temperature}: keeps {kept} of {all_kept} dynamic blocks")
    assert kept <= all_kept


def test_top_p_none_and_one_keep_every_top_k_block():
    n, block = 160, 16
    geom = selection_geometry(n, block, block, 4, 2, 1)
    scores = torch.randn(1, 2, geom.num_q_blocks, geom.num_k_blocks, generator=torch.Generator().manual_seed(0))
    base = selection_candidates(scores, geom, window=2, sinks=1)
    one = selection_candidates(scores, geom, window=2, sinks=1, top_p=1.0)
    assert torch.equal(torch.sort(base, dim=-1).values, torch.sort(one, dim=-1).values)


def _peaked_scores(geom, spread, seed=0):
    """float32 block scores of a confident selector: standard normal times ``spread``, so the best block of a row
    holds nearly all of its softmax mass and the rest hold 1e-5 to 1e-40 of it."""
    g = torch.Generator().manual_seed(seed)
    return torch.randn(2, 2, geom.num_q_blocks, geom.num_k_blocks, generator=g) * spread


@pytest.mark.parametrize("spread", [10.0, 40.0], ids=["spread10", "spread40"])
@pytest.mark.parametrize("masks", ["none", "seq_lens", "documents"])
def test_top_p_one_selects_what_none_selects_on_peaked_scores(spread, masks):
    """top_p = 1.0 needs the whole mass, so it keeps every candidate None keeps, however confident the row."""
    n, block, top_k = 320, 16, 6
    geom = selection_geometry(n, block, block, top_k, 1, 1)
    scores = _peaked_scores(geom, spread)
    kwargs = {"window": 1, "sinks": 1}
    if masks == "seq_lens":
        kwargs["seq_lens"] = torch.tensor([320, 200])
    if masks == "documents":
        kwargs["document_ids"] = (torch.arange(n) // 100).repeat(2, 1)
    base = selection_candidates(scores, geom, **kwargs)
    one = selection_candidates(scores, geom, top_p=1.0, **kwargs)
    print(f"spread {spread}, {masks}: top_p=1.0 keeps {int((one >= 0).sum())} of {int((base >= 0).sum())}")
    assert torch.equal(torch.sort(base, dim=-1).values, torch.sort(one, dim=-1).values)


@pytest.mark.parametrize("top_p", [0.9, 0.99999, 1 - 1e-7], ids=["p0.9", "p0.99999", "p1-1e-7"])
@pytest.mark.parametrize("spread", [10.0, 20.0], ids=["spread10", "spread20"])
def test_top_p_below_one_keeps_the_exact_set_on_peaked_float32_scores(top_p, spread):
    """The kept blocks are the exact (float64, per-row loop) smallest set reaching top_p, also when the mass
    of the better blocks is within float32 rounding of 1."""
    n, block, top_k, window, sinks = 320, 16, 6, 1, 1
    geom = selection_geometry(n, block, block, top_k, window, sinks)
    scores = _peaked_scores(geom, spread, seed=1)
    got = selection_candidates(scores, geom, window=window, sinks=sinks, top_p=top_p)
    expected = _expected_top_p(scores, geom, window, sinks, top_p)
    rows = [{int(j) for j in row if j >= 0} for row in got.reshape(-1, got.shape[-1])]
    print(f"kept {sum(map(len, rows))} blocks, the exact set {sum(map(len, expected))}")
    assert rows == expected


def test_module_with_top_p_one_selects_what_none_selects():
    cfg = dict(
        block_q=16,
        block_k=16,
        top_k=4,
        window=1,
        sinks=1,
        dense_warmup_steps=0,
        backend="reference",
        selector_rope_theta=None,
        scale=100.0,  # also scales the selector's logits: a confident selector
    )
    q, k, v = make_qkv(2, 4, 2, 200, 16, dtype=torch.float32, seed=1)
    none = st.SparseAttention(st.SparseAttentionConfig(**cfg), 4, 2, 16).eval()
    one = st.SparseAttention(st.SparseAttentionConfig(**cfg, top_p=1.0), 4, 2, 16).eval()
    one.load_state_dict(none.state_dict())
    none(q, k, v)
    one(q, k, v)
    kept, all_kept = int(one.last_selection.to_dense().sum()), int(none.last_selection.to_dense().sum())
    print(f"top_p=1.0 keeps {kept} of {all_kept} blocks")
    assert torch.equal(none.last_selection.to_dense(), one.last_selection.to_dense())


def test_top_p_keeps_one_block_when_one_score_dominates():
    n, block = 128, 16
    geom = selection_geometry(n, block, block, 4, 1, 1)
    scores = torch.zeros(1, 1, geom.num_q_blocks, geom.num_k_blocks)
    scores[..., 3] = 50.0  # allowed for query blocks 5, 6, 7 (outside their window and the sink)
    got = selection_candidates(scores, geom, window=1, sinks=1, top_p=0.9)
    for i in (5, 6, 7):
        assert [int(j) for j in got[0, 0, i] if j >= 0] == [3]


def test_module_with_top_p_selects_no_more_than_top_k():
    cfg = dict(
        block_q=16,
        block_k=16,
        top_k=4,
        window=1,
        sinks=1,
        dense_warmup_steps=0,
        backend="reference",
        selector_rope_theta=None,
    )
    q, k, v = make_qkv(2, 4, 2, 200, 16, dtype=torch.float32, seed=1)
    dense_k = st.SparseAttention(st.SparseAttentionConfig(**cfg), 4, 2, 16).eval()
    adaptive = st.SparseAttention(st.SparseAttentionConfig(**cfg, top_p=0.5), 4, 2, 16).eval()
    adaptive.load_state_dict(dense_k.state_dict())
    dense_k(q, k, v)
    adaptive(q, k, v)
    fixed, chosen = dense_k.last_selection.to_dense(), adaptive.last_selection.to_dense()
    print(f"density top_k {dense_k.last_selection.density():.3f}, top_p 0.5 {adaptive.last_selection.density():.3f}")
    assert not (chosen & ~fixed).any(), "top_p must choose among the top_k blocks"
    assert int(chosen.sum()) < int(fixed.sum())


@pytest.mark.parametrize("top_p", [0.0, 1.5, float("nan")], ids=["zero", "above-one", "nan"])
def test_config_rejects_bad_top_p(top_p):
    with pytest.raises(ValueError, match="top_p"):
        st.SparseAttentionConfig(top_p=top_p)


@pytest.mark.parametrize("top_p", [0.0, 1.0 + 1e-9, float("nan"), True], ids=["zero", "above-one", "nan", "bool"])
def test_selection_candidates_rejects_top_p_outside_zero_one(top_p):
    geom = selection_geometry(64, 16, 16, 2, 1, 1)
    scores = torch.zeros(1, 1, geom.num_q_blocks, geom.num_k_blocks)
    with pytest.raises(ValueError, match=r"top_p must be a finite number in \(0, 1\]"):
        selection_candidates(scores, geom, window=1, sinks=1, top_p=top_p)


def _brute_oracle_density(q, k, scale, block, picks, seq_lens, goal):
    """Per sampled (batch, KV head, query block): blocks by descending total row mass until the mean
    recall of the real rows reaches goal; needed / causally reachable, summed."""
    batch, heads, n, _ = q.shape
    kv_heads = k.shape[1]
    group = heads // kv_heads
    kk = k.repeat_interleave(group, dim=1)
    logits = torch.einsum("bhqd,bhkd->bhqk", q, kk) * scale
    pos = torch.arange(n)
    limit = torch.full((batch,), n) if seq_lens is None else seq_lens
    allowed = (pos.view(1, -1) <= pos.view(-1, 1)).view(1, 1, n, n) & (pos.view(1, 1, 1, n) < limit.view(-1, 1, 1, 1))
    p = torch.softmax(logits.masked_fill(~allowed, float("-inf")), dim=-1)
    nkb = math.ceil(n / block)
    mass_on_block = torch.stack([p[..., pos // block == j].sum(-1) for j in range(nkb)], dim=-1)  # [B, HQ, N, NKB]
    needed_total = reachable_total = 0
    for b in range(batch):
        for kv in range(kv_heads):
            for i in picks.tolist():
                rows = [
                    (h, r)
                    for h in range(kv * group, (kv + 1) * group)
                    for r in range(i * block, min((i + 1) * block, n))
                    if r < int(limit[b])
                ]
                if not rows:
                    continue
                totals = sum(mass_on_block[b, h, r] for h, r in rows)
                recall, needed = 0.0, 0
                for mass in torch.sort(totals, descending=True).values.tolist():
                    needed += 1
                    recall += mass / len(rows)
                    if recall >= goal - 1e-6:
                        break
                needed_total += min(needed, i + 1)
                reachable_total += i + 1
    return needed_total / reachable_total


@pytest.mark.parametrize("with_lengths", [False, True], ids=["no-lengths", "lengths"])
@pytest.mark.parametrize("goal", [0.5, 0.9], ids=["goal0.5", "goal0.9"])
def test_oracle_budget_matches_brute_force(with_lengths, goal):
    n, block = 112, 16
    q, k, _ = make_qkv(2, 4, 2, n, 8, dtype=torch.float64, seed=7)
    q = q * 3.0  # sharper attention, so the goal is met before the last block
    seq_lens = torch.tensor([112, 41]) if with_lengths else None
    picks = torch.tensor([1, 4, 6])
    got = float(
        oracle_budget(q, k, block_q=block, block_k=block, scale=0.5, query_blocks=picks, seq_lens=seq_lens, goal=goal)
    )
    want = _brute_oracle_density(q, k, 0.5, block, picks, seq_lens, goal)
    print(f"oracle density for mean recall {goal}: {got:.4f} (brute force {want:.4f})")
    assert got == pytest.approx(want, rel=1e-6)  # a ratio of block counts, returned in float32
    assert 0.0 < got <= 1.0


def test_selection_quality_reports_oracle_density():
    n, block = 96, 16
    q, k, _ = make_qkv(1, 2, 1, n, 8, dtype=torch.float64, seed=2)
    index = st.BlockIndex.full(1, 1, n, block_q=block, block_k=block)
    picks = torch.arange(index.num_q_blocks)
    got = selection_quality(q, k, index, scale=0.5, query_blocks=picks)
    want = oracle_budget(q, k, block_q=block, block_k=block, scale=0.5, query_blocks=picks)
    assert float(got["oracle_density_r90"]) == float(want)
