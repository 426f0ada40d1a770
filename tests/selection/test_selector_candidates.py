"""Token scores on candidate blocks: the references of kernels/reference/index_candidates.py (the bound against the
exact scores in float64, the candidates' exact scores and gradients against the full reference), certification
and candidate_block_scores of selection/candidates.py, and the indexer with ``selector_candidates`` (the module
trains with it: test_selector_indexer.py). The kernels against these references:
tests/kernels/test_kernel_index_candidates.py."""

import pytest
import torch

import sparse_train as st
from sparse_train.config import CANDIDATES_MIN_SEQ_LEN
from sparse_train.kernels.reference.index_candidates import (
    reference_candidate_index_scores,
    reference_index_score_bounds,
)
from sparse_train.kernels.reference.index_scores import reference_index_block_scores
from sparse_train.selection import TokenIndexer, selection_geometry
from sparse_train.selection.candidates import candidate_block_scores, certified_rows, dynamic_block_bounds
from sparse_train.selection.scorer import EMPTY_BLOCK_SCORE

CASES = [
    # id: (B, H, N, E, S, block_q, block_k, seq_lens, documents)
    pytest.param(1, 1, 64, 1, 4, 16, 16, None, False, id="one-head-whole-blocks"),
    pytest.param(2, 3, 211, 2, 8, 16, 32, (211, 150), False, id="odd-n-two-index-heads-lengths"),
    pytest.param(2, 2, 97, 1, 5, 32, 16, (0, 97), False, id="empty-row"),
    pytest.param(2, 1, 130, 3, 4, 16, 16, (130, 77), True, id="documents"),
]


def _inputs(B, H, N, E, S, seq_lens, documents, seed=0):
    """float64 u [B, H, N, E, S], w [B, H, N, S] with NaN past each length, seq_lens and document ids."""
    generator = torch.Generator().manual_seed(seed)
    u = torch.randn(B, H, N, E, S, generator=generator, dtype=torch.float64)
    w = torch.randn(B, H, N, S, generator=generator, dtype=torch.float64)
    lens = None if seq_lens is None else torch.tensor(seq_lens)
    if lens is not None:
        past = torch.arange(N).view(1, 1, N) >= lens.view(B, 1, 1)
        u = u.masked_fill(past.view(B, 1, N, 1, 1), float("nan"))
        w = w.masked_fill(past.view(B, 1, N, 1), float("nan"))
    docs = None
    if documents:
        cuts = torch.sort(torch.randint(0, N, (B, 3), generator=generator), dim=1).values
        docs = (torch.arange(N).view(1, N, 1) >= cuts.view(B, 1, 3)).sum(-1)
    return u, w, lens, docs


@pytest.mark.parametrize("B,H,N,E,S,block_q,block_k,seq_lens,documents", CASES)
def test_bound_is_at_least_the_exact_score_of_every_pair(B, H, N, E, S, block_q, block_k, seq_lens, documents):
    u, w, lens, docs = _inputs(B, H, N, E, S, seq_lens, documents)
    kw = dict(block_q=block_q, block_k=block_k, seq_lens=lens, document_ids=docs)
    exact = reference_index_block_scores(u, w, **kw)
    bound = reference_index_score_bounds(u, w, **kw)
    assert bound.shape == exact.shape and bound.dtype == torch.float64
    assert not torch.isnan(bound).any()
    scored = torch.isfinite(exact)
    slack = 1e-12 * exact[scored].abs().clamp(min=1.0)
    assert (bound[scored] >= exact[scored] - slack).all()
    # -inf exactly where the key block starts past the query block's last valid row or holds no valid key
    nqb, nkb = bound.shape[2], bound.shape[3]
    limit = torch.full((B,), N) if lens is None else lens
    last_row = torch.minimum((torch.arange(nqb) + 1) * block_q, limit.view(B, 1)) - 1  # [B, NQB]
    first_key = torch.arange(nkb) * block_k
    reachable = (first_key.view(1, 1, nkb) <= last_row.view(B, nqb, 1)) & (
        first_key.view(1, 1, nkb) < limit.view(B, 1, 1)
    )
    reachable = reachable & (torch.arange(nqb) * block_q < limit.view(B, 1)).view(B, nqb, 1)
    assert torch.equal(torch.isfinite(bound), reachable.unsqueeze(1).expand_as(bound))
    if docs is None:
        assert torch.equal(torch.isfinite(bound), scored)


@pytest.mark.parametrize("B,H,N,E,S,block_q,block_k,seq_lens,documents", CASES)
def test_candidate_scores_and_gradients_equal_the_full_reference(B, H, N, E, S, block_q, block_k, seq_lens, documents):
    u, w, lens, docs = _inputs(B, H, N, E, S, seq_lens, documents, seed=1)
    kw = dict(block_q=block_q, block_k=block_k, seq_lens=lens, document_ids=docs)
    nkb = -(-N // block_k)
    picks = torch.randint(0, nkb, (B, H, -(-N // block_q), 3), generator=torch.Generator().manual_seed(2))
    u_full, w_full = u.clone().requires_grad_(), w.clone().requires_grad_()
    full = reference_index_block_scores(u_full, w_full, **kw).gather(-1, picks)
    u_cand, w_cand = u.clone().requires_grad_(), w.clone().requires_grad_()
    cand = reference_candidate_index_scores(u_cand, w_cand, picks, **kw)
    scored = torch.isfinite(full)
    assert torch.equal(torch.isfinite(cand), scored)
    err = (cand[scored] - full[scored]).abs().max().item() if scored.any() else 0.0
    print(f"candidates vs full reference, float64: max abs err {err:.2e}")
    assert err <= 1e-12
    grad = torch.randn(full.shape, dtype=torch.float64, generator=torch.Generator().manual_seed(3))
    grad = torch.where(scored, grad, 0.0)
    full_grads = torch.autograd.grad((full.masked_fill(~scored, 0.0) * grad).sum(), (u_full, w_full))
    cand_grads = torch.autograd.grad((cand.masked_fill(~scored, 0.0) * grad).sum(), (u_cand, w_cand))
    for name, a, b in zip(("du", "dw"), cand_grads, full_grads):
        assert not torch.isnan(a).any(), name
        assert torch.allclose(a, b, rtol=1e-12, atol=1e-12), name


def test_candidate_scores_of_listed_query_blocks_equal_the_full_rows():
    u, w, lens, docs = _inputs(2, 2, 150, 1, 6, (150, 101), True, seed=4)
    kw = dict(block_q=16, block_k=16, seq_lens=lens, document_ids=docs)
    bound = reference_index_score_bounds(u, w, **kw)
    picks = bound.topk(4, dim=-1).indices
    exact = reference_candidate_index_scores(u, w, picks, **kw)
    listed = torch.tensor([9, 0, 4])
    rows = TokenIndexer.query_rows(u.flatten(3), listed, 16).unflatten(3, (1, 6))
    listed_kw = dict(kw, query_blocks=listed)
    assert torch.equal(reference_index_score_bounds(rows, w, **listed_kw), bound[:, :, listed])
    assert torch.equal(reference_candidate_index_scores(rows, w, picks[:, :, listed], **listed_kw), exact[:, :, listed])


def test_certified_rows_are_those_whose_kth_exact_score_beats_every_bound_left_out():
    bounds = torch.tensor([[[[5.0, 4.0, 3.0, 2.5]]]])
    picks = torch.tensor([[[[0, 1]]]])
    assert certified_rows(bounds, picks, torch.tensor([[[[4.0, 3.0]]]])).item()  # 3.0 >= 3.0 left out
    assert not certified_rows(bounds, picks, torch.tensor([[[[4.0, 2.9]]]])).item()
    assert certified_rows(bounds, picks, torch.tensor([[[[4.0, 2.9]]]]), k=1).item()
    with pytest.raises(ValueError, match="k must be an int in \\[1, C=2\\]"):
        certified_rows(bounds, picks, torch.tensor([[[[4.0, 2.9]]]]), k=3)


def test_certified_rows_ignore_unlisted_slots():
    """A -1 slot (fewer dynamic blocks than candidates) lists nothing: block 0 stays among the bounds left out."""
    bounds = torch.tensor([[[[3.5, 4.0, float("-inf")]]]])
    picks = torch.tensor([[[[1, -1]]]])
    exact = torch.tensor([[[[3.0, float("-inf")]]]])
    assert not certified_rows(bounds, picks, exact, k=1).item()  # block 0 (bound 3.5) may beat 3.0
    assert certified_rows(bounds, picks, torch.tensor([[[[3.5, float("-inf")]]]]), k=1).item()


def test_a_certified_row_holds_the_true_top_k():
    """Random scores: on every certified row the candidates' top k equals the full scores' top k."""
    u, w, lens, _ = _inputs(2, 2, 512, 1, 4, (512, 300), False, seed=5)
    kw = dict(block_q=16, block_k=16, seq_lens=lens)
    full = reference_index_block_scores(u, w, **kw)
    bound = reference_index_score_bounds(u, w, **kw)
    picked = bound.topk(8, dim=-1)
    exact = reference_candidate_index_scores(u, w, picked.indices, **kw)
    certified = certified_rows(bound, picked.indices, exact, k=2)
    assert 0 < certified.sum() < certified.numel()  # both kinds of rows occur, so the check below means something
    top_full = full.topk(2, dim=-1).values
    top_cand = exact.topk(2, dim=-1).values
    assert torch.equal(top_cand[certified], top_full[certified])


@pytest.mark.parametrize("window,sinks", [(1, 1), (0, 0), (2, 3)], ids=["window1-sink1", "no-forced", "window2-sinks3"])
def test_candidate_block_scores_pick_the_best_bounded_dynamic_blocks(window, sinks):
    u, w, lens, _ = _inputs(2, 2, 300, 1, 6, (300, 140), False, seed=9)
    geometry = selection_geometry(300, 16, 16, 2, window, sinks)
    scores, picked = candidate_block_scores(u, w, geometry, 4, window=window, sinks=sinks, seq_lens=lens)
    bounds = dynamic_block_bounds(u, w, geometry, window=window, sinks=sinks, seq_lens=lens)
    full = reference_index_block_scores(u, w, block_q=16, block_k=16, seq_lens=lens)
    allowed = st.selection.allowed_dynamic_blocks(geometry, window, sinks)
    assert torch.equal(
        torch.isfinite(bounds),
        torch.isfinite(reference_index_score_bounds(u, w, block_q=16, block_k=16, seq_lens=lens)) & allowed,
    )
    listed = picked >= 0
    # every listed pick is dynamic, no bound left out beats the smallest picked bound, and -1 only when the row has
    # fewer dynamic blocks with a finite bound
    assert allowed.expand_as(bounds).gather(-1, picked.clamp(min=0))[listed].all()
    smallest = torch.where(listed, bounds.gather(-1, picked.clamp(min=0)), float("inf")).amin(-1)
    left = bounds.scatter(-1, picked.clamp(min=0), float("-inf")).amax(-1)
    assert (left <= smallest).all()
    assert torch.equal(listed.sum(-1), torch.isfinite(bounds).sum(-1).clamp(max=4))
    # the picked blocks carry their exact score, every other block -inf
    kept = torch.isfinite(scores)
    assert torch.allclose(scores[kept], full[kept], rtol=1e-12, atol=1e-12)
    assert not (kept & ~allowed).any() and (kept.sum(-1) <= listed.sum(-1)).all()


def _indexer_pair(candidates, window, sinks, candidates_min_len=0):
    torch.manual_seed(6)
    shared = dict(index_dim=8, index_heads=2, distance_bias=True)
    full = TokenIndexer(4, 2, 16, **shared)
    pruning = dict(candidates=candidates, window=window, sinks=sinks, candidates_min_len=candidates_min_len)
    pruned = TokenIndexer(4, 2, 16, **shared, **pruning)
    with torch.no_grad():
        full.distance_bias.normal_()
    pruned.load_state_dict(full.state_dict())
    return full, pruned


@pytest.mark.parametrize("documents", [False, True], ids=["no-documents", "documents"])
def test_indexer_candidates_keep_exact_scores_of_the_best_bounded_dynamic_blocks(documents):
    full, pruned = _indexer_pair(candidates=3, window=2, sinks=1)
    n = 300
    q, k = torch.randn(2, 4, n, 16, dtype=torch.float64), torch.randn(2, 2, n, 16, dtype=torch.float64)
    lens = torch.tensor([300, 170])
    docs = (torch.arange(n) >= 120).long().view(1, n).expand(2, n).contiguous() if documents else None
    geometry = selection_geometry(n, 16, 16, 3, 2, 1)
    kw = dict(seq_lens=lens, document_ids=docs)
    reference = full(*full.pool(q, k, 16, 16, lens), 0.25, geometry, **kw)
    scores = pruned(*pruned.pool(q, k, 16, 16, lens), 0.25, geometry, **kw)
    allowed = st.selection.allowed_dynamic_blocks(geometry, 2, 1, None, docs)
    allowed = allowed.unsqueeze(1) if allowed.dim() == 3 else allowed
    kept = scores != EMPTY_BLOCK_SCORE
    assert not (kept & ~allowed).any()  # only dynamic blocks are candidates
    assert (kept.sum(-1) <= 3).all() and (kept.sum(-1) == 3).any()
    assert torch.allclose(scores[kept], reference[kept], rtol=1e-12, atol=1e-12)


def test_indexer_with_candidates_for_every_block_scores_as_without():
    full, pruned = _indexer_pair(candidates=1000, window=1, sinks=1)
    q, k = torch.randn(1, 4, 100, 16), torch.randn(1, 2, 100, 16)
    geometry = selection_geometry(100, 16, 16, 2, 1, 1)
    assert torch.equal(
        pruned(*pruned.pool(q, k, 16, 16), 0.25, geometry), full(*full.pool(q, k, 16, 16), 0.25, geometry)
    )


@pytest.mark.parametrize(
    "min_len,exact",
    [(300, False), (301, True), (0, False)],
    ids=["length-at-min_len-candidates", "length-below-min_len-exact", "no-min_len-candidates"],
)
def test_indexer_scores_sequences_shorter_than_candidates_min_len_exactly(min_len, exact):
    """N = 300 tokens: candidates from ``candidates_min_len`` <= N up, every pair's exact score below."""
    full, pruned = _indexer_pair(candidates=3, window=1, sinks=1, candidates_min_len=min_len)
    q, k = torch.randn(2, 4, 300, 16, dtype=torch.float64), torch.randn(2, 2, 300, 16, dtype=torch.float64)
    lens = torch.tensor([300, 170])
    geometry = selection_geometry(300, 16, 16, 3, 1, 1)
    reference = full(*full.pool(q, k, 16, 16, lens), 0.25, geometry, seq_lens=lens)
    scores = pruned(*pruned.pool(q, k, 16, 16, lens), 0.25, geometry, seq_lens=lens)
    if exact:
        assert torch.equal(scores, reference)
    else:
        kept = scores != EMPTY_BLOCK_SCORE
        assert (kept.sum(-1) <= 3).all() and (kept.sum(-1) < (reference != EMPTY_BLOCK_SCORE).sum(-1)).any()
        assert torch.allclose(scores[kept], reference[kept], rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize(
    "fields,message",
    [
        pytest.param({"selector": "pooled"}, "needs selector='token'", id="pooled-selector"),
        pytest.param(
            {"selector": "token", "selector_distill": "block"}, "selector_distill='token'", id="block-level-kl"
        ),
        pytest.param({"distill": "dense"}, "distill 'sampled' or 'off'", id="dense-kl"),
        pytest.param(
            {"selector": "token", "selector_distill": "token", "distill": "sparse"},
            "distill 'sampled' or 'off'",
            id="sparse-kl",
        ),
        pytest.param(
            {"selector": "token", "selector_distill": "token", "top_k": 4, "selector_candidates": 3},
            "selector_candidates=3 must be >= top_k=4",
            id="fewer-than-top-k",
        ),
    ],
)
def test_config_rejects_candidates_it_cannot_use(fields, message):
    kwargs = dict(block_q=16, block_k=16, selector_candidates=2, top_k=2, **{})
    kwargs.update(fields)
    with pytest.raises(ValueError, match=message.replace("(", "\\(").replace(")", "\\)")):
        st.SparseAttentionConfig(**kwargs)


# (fields over the defaults, what selector_candidates="auto" resolves to): 2 * top_k where the token selector trains
# by the token-level KL alone (distill sampled or off), exact scores (None) wherever a block-level KL or another
# selector needs every pair's score
AUTO_CANDIDATES = [
    pytest.param({}, 32, id="defaults"),
    pytest.param({"top_k": 5}, 10, id="top_k-5"),
    pytest.param({"distill": "off"}, 32, id="distill-off"),
    pytest.param({"top_k": 0}, None, id="no-learned-blocks"),
    pytest.param({"distill": "sparse"}, None, id="distill-sparse"),
    pytest.param({"distill": "dense"}, None, id="distill-dense"),
    pytest.param({"selector_distill": "block"}, None, id="block-level-kl"),
    pytest.param({"selector": "pooled"}, None, id="pooled"),
    pytest.param({"selector": "pooled", "block_q": 256, "block_k": 8}, None, id="pooled-any-block"),
    pytest.param({"selector": "oracle"}, None, id="oracle"),
    pytest.param({"selector": "pooled", "distill": "dense"}, None, id="pooled-dense"),
]


@pytest.mark.parametrize("fields,resolved", AUTO_CANDIDATES)
def test_auto_candidates_resolve_by_selector_and_distillation(fields, resolved):
    """A config that sets only the fields it cares about is valid: the default candidates resolve to what its
    selector and distillation can use, and the selector built from it takes that count."""
    config = st.SparseAttentionConfig(**fields)
    assert config.selector_candidates == "auto"
    assert config.resolved_selector_candidates == resolved
    assert config.resolved_selector_candidates_min_len == CANDIDATES_MIN_SEQ_LEN
    assert st.SparseAttentionConfig(**config.to_dict()) == config  # "auto" round-trips through to_dict
    scorer = st.SparseAttention(config, num_heads=4, num_kv_heads=2, head_dim=16).scorer
    assert getattr(scorer, "candidates", None) == resolved
    if isinstance(scorer, TokenIndexer):
        assert scorer.candidates_min_len == CANDIDATES_MIN_SEQ_LEN


@pytest.mark.parametrize("value", [None, 1, 40])
def test_explicit_candidates_resolve_as_given(value):
    config = st.SparseAttentionConfig(top_k=1, selector_candidates=value)
    assert config.resolved_selector_candidates == value
    assert config.resolved_selector_candidates_min_len == 0  # a count given applies at every length
    assert st.SparseAttention(config, 4, 2, 16).scorer.candidates_min_len == 0


def test_defaults_are_the_token_selector_trained_at_token_level_with_candidates():
    config = st.SparseAttentionConfig()
    assert (config.selector, config.selector_distill, config.distill) == ("token", "token", "sampled")
    assert config.resolved_selector_candidates == 2 * config.top_k
    assert config.resolved_selector_candidates_min_len == CANDIDATES_MIN_SEQ_LEN
    assert config.selector_candidates_at(CANDIDATES_MIN_SEQ_LEN - 1) is None
    assert config.selector_candidates_at(CANDIDATES_MIN_SEQ_LEN) == 2 * config.top_k
    assert isinstance(st.SparseAttention(config, 4, 2, 16).scorer, TokenIndexer)


@pytest.mark.parametrize("value", ["all", "Auto", 0, -1, 2.0, True])
def test_config_rejects_candidates_that_are_no_count(value):
    with pytest.raises(ValueError, match="selector_candidates must be a positive int, None or 'auto', got"):
        st.SparseAttentionConfig(selector_candidates=value)


@pytest.mark.parametrize("name", ["block_q", "block_k"])
@pytest.mark.parametrize("size", [8, 256])
def test_token_selector_block_sizes_name_the_pooled_selector(name, size):
    """The default selector takes blocks of 16-128 tokens; the error for another size says to pass the pooled one,
    which then takes it."""
    with pytest.raises(ValueError) as info:
        st.SparseAttentionConfig(**{name: size})
    message = str(info.value)
    assert f"SparseAttentionConfig.{name} must be one of (16, 32, 64, 128) with selector='token'" in message, message
    assert "pass selector='pooled'" in message, message
    assert st.SparseAttentionConfig(**{name: size, "selector": "pooled"}).resolved_selector_candidates is None
