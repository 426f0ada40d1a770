"""The token-level indexer and the oracle selector (selectors/indexer.py): their scores against brute force in
float64, gradients, the module's use of them, configuration and RoPE conventions."""

import math
from types import SimpleNamespace

import pytest
import torch
from builders import check_close

import sparse_train as st
from sparse_train.integrations.hf import rope_style
from sparse_train.selection import OracleSelector, TokenIndexer, build_selector, selection_geometry
from sparse_train.selection import indexer as indexer_module
from sparse_train.selection.scorer import EMPTY_BLOCK_SCORE


def _brute_force_max_logits(q, k, block_q, block_k, seq_lens=None, document_ids=None):
    """float64 [B, HKV, NQB, NKB]: the largest q_g[r] . k[t] over the group heads g, rows r of the query block and
    keys t of the key block with t <= r, r and t < len, same document; -inf where no pair is valid."""
    batch, hq, n, _ = q.shape
    hkv = k.shape[1]
    group = hq // hkv
    nqb, nkb = math.ceil(n / block_q), math.ceil(n / block_k)
    out = torch.full((batch, hkv, nqb, nkb), float("-inf"), dtype=torch.float64)
    logits = torch.einsum("bhgrd,bhtd->bhgrt", q.double().view(batch, hkv, group, n, -1), k.double())
    for b in range(batch):
        length = n if seq_lens is None else int(seq_lens[b])
        for r in range(length):
            for t in range(r + 1):
                if document_ids is not None and document_ids[b, r] != document_ids[b, t]:
                    continue
                i, j = r // block_q, t // block_k
                out[b, :, i, j] = torch.maximum(out[b, :, i, j], logits[b, :, :, r, t].amax(dim=1))
    return out


def _identity_indexer(hq, hkv, d):
    """A TokenIndexer whose index heads are the group's query heads and whose index keys are the keys: its raw
    score is the pair's largest logit (temperature 1, scale 1, no bias)."""
    indexer = TokenIndexer(hq, hkv, d, index_dim=d, index_heads=hq // hkv, lr_multiplier=1.0)
    group = hq // hkv
    with torch.no_grad():
        proj = torch.zeros(hkv, group, d, group, d)
        for g in range(group):
            proj[:, g, :, g, :] = torch.eye(d)
        indexer.query_proj.copy_(proj.reshape(hkv, group * d, group * d))
        indexer.key_proj.copy_(torch.eye(d).expand(hkv, d, d))
    return indexer


@pytest.mark.parametrize(
    "hq,hkv,n,block_q,block_k,lengths,documents",
    [
        pytest.param(2, 2, 90, 16, 16, None, False, id="mha-odd-n"),
        pytest.param(4, 2, 77, 16, 32, (77, 40), False, id="gqa2-blocks-differ-lengths"),
        pytest.param(3, 1, 64, 32, 16, None, True, id="gqa3-documents"),
        pytest.param(4, 1, 50, 16, 16, (0, 50), False, id="gqa4-empty-row"),
    ],
)
def test_token_scores_are_the_pairs_largest_logit(hq, hkv, n, block_q, block_k, lengths, documents):
    torch.manual_seed(0)
    d = 16
    batch = 2
    q = torch.randn(batch, hq, n, d)
    k = torch.randn(batch, hkv, n, d)
    seq_lens = None if lengths is None else torch.tensor(lengths)
    document_ids = None
    if documents:
        document_ids = torch.stack([torch.arange(n) // 23, torch.arange(n) // 40])
    if seq_lens is not None:  # padded rows hold NaN: they must not reach a score
        pad = torch.arange(n).view(1, 1, n, 1) >= seq_lens.view(-1, 1, 1, 1)
        q, k = q.masked_fill(pad, float("nan")), k.masked_fill(pad, float("nan"))
    indexer = _identity_indexer(hq, hkv, d)
    geometry = selection_geometry(n, block_q, block_k, 2, 1, 1)
    got = indexer(q, k, 1.0, geometry, seq_lens=seq_lens, document_ids=document_ids)
    want = _brute_force_max_logits(q, k, block_q, block_k, seq_lens, document_ids)
    assert got.dtype == torch.float32 and got.shape == want.shape
    empty = torch.isinf(want)
    assert torch.all(got[empty] == EMPTY_BLOCK_SCORE)
    torch.testing.assert_close(got[~empty].double(), want[~empty], rtol=1e-5, atol=1e-5)


def test_token_initialisation_ranks_like_raw_logits():
    """At initialisation (E = G, shared projection) the indexer's block ranking follows the pair's largest raw
    logit: a planted key that one row matches strongly puts its block first for that row's query block."""
    torch.manual_seed(1)
    hq, hkv, n, d = 4, 2, 512, 64
    q = torch.randn(1, hq, n, d) * 0.3
    k = torch.randn(1, hkv, n, d) * 0.3
    k[0, :, 70] = q[0, 0, 500] * 8  # key 70 (block 1) answers row 500 (block 7) of query head 0 / KV head 0
    k[0, 1, 70] = q[0, 2, 500] * 8
    indexer = TokenIndexer(hq, hkv, d, index_dim=32, index_heads=2, lr_multiplier=10.0)
    geometry = selection_geometry(n, 64, 64, 2, 1, 1)
    scores = indexer(*indexer.pool(q, k, 64, 64), 1 / math.sqrt(d), geometry)
    assert scores[0, :, 7, :7].argmax(dim=-1).tolist() == [1, 1]


def test_token_gradients_reach_every_parameter_and_stay_finite():
    torch.manual_seed(2)
    hq, hkv, n, d = 4, 2, 100, 32
    indexer = TokenIndexer(hq, hkv, d, index_dim=16, index_heads=2, lr_multiplier=10.0, distance_bias=True)
    q, k = torch.randn(2, hq, n, d), torch.randn(2, hkv, n, d)
    geometry = selection_geometry(n, 16, 16, 2, 1, 1)
    scores = indexer(q, k, 0.2, geometry, seq_lens=torch.tensor([100, 30]))
    causal = scores > EMPTY_BLOCK_SCORE
    torch.log_softmax(scores, dim=-1)[causal].sum().backward()
    for name, param in indexer.named_parameters():
        assert param.grad is not None and torch.isfinite(param.grad).all(), name
        assert param.grad.abs().sum() > 0, name


def test_oracle_selects_the_block_holding_the_attention_mass():
    torch.manual_seed(3)
    hq, hkv, n, d = 2, 1, 256, 32
    q = torch.randn(1, hq, n, d) * 0.1
    k = torch.randn(1, hkv, n, d) * 0.1
    q[0, 1, 250] = 0.0
    q[0, 1, 250, 0] = 30.0
    k[0, 0, 100, 0] = 30.0  # row 250 of head 1 puts nearly all its mass on key 100 (block 3 of 64)
    oracle = OracleSelector(hq, hkv, d)
    geometry = selection_geometry(n, 64, 64, 1, 1, 1)
    scores = oracle(*oracle.pool(q, k, 64, 64), 1.0, geometry)
    assert scores.shape == (1, 1, 4, 4)
    # block 1 holds all of row 250's mass; block 2 at most the ~1/3 a uniform row puts on it
    assert scores[0, 0, 3, 1] > scores[0, 0, 3, 2] + 0.5
    assert torch.all(scores[0, 0, 0, 1:] == EMPTY_BLOCK_SCORE)  # non-causal blocks have no mass
    candidates = st.selection.selection_candidates(scores, geometry, window=1, sinks=1)
    assert candidates[0, 0, 3].tolist() == [1]
    assert list(oracle.parameters()) == []


@pytest.mark.parametrize("selector", ["pooled", "token", "oracle"])
def test_module_trains_with_each_selector(selector):
    torch.manual_seed(4)
    cfg = st.SparseAttentionConfig(
        block_q=16,
        block_k=16,
        top_k=2,
        window=1,
        sinks=1,
        dense_warmup_steps=0,
        selector=selector,
        selector_dim=16,
        selector_index_heads=2,
        selector_rope_theta=10000.0,
        selector_rope_style="interleaved",
    )
    attn = st.SparseAttention(cfg, 4, 2, 32).train()
    q = torch.randn(2, 4, 150, 32, requires_grad=True)
    k = torch.randn(2, 2, 150, 32, requires_grad=True)
    v = torch.randn(2, 2, 150, 32, requires_grad=True)
    o = attn(q, k, v, seq_lens=torch.tensor([150, 97]))
    assert torch.isfinite(o).all()
    loss = o.square().mean() + st.collect_selector_losses(attn)
    loss.backward()
    assert attn.last_selection is not None and attn.last_selection.density() < 1.0
    params = dict(attn.named_parameters())
    if selector == "oracle":
        assert params == {} and attn.selector_loss is None
    else:
        assert torch.isfinite(attn.selector_loss) and attn.selector_loss > 0
        for name, param in params.items():
            assert param.grad is not None and torch.isfinite(param.grad).all(), name


def test_token_selector_state_dict_round_trip():
    cfg = st.SparseAttentionConfig(
        block_q=16, block_k=16, top_k=2, window=1, sinks=1, dense_warmup_steps=0, selector="token", selector_dim=16
    )
    a = st.SparseAttention(cfg, 4, 2, 32)
    with torch.no_grad():
        a.scorer.query_proj.add_(0.5)
    b = st.SparseAttention(cfg, 4, 2, 32)
    b.load_state_dict(a.state_dict())
    q, k = torch.randn(1, 4, 64, 32), torch.randn(1, 2, 64, 32)
    geometry = selection_geometry(64, 16, 16, 2, 1, 1)
    torch.testing.assert_close(a.scorer(q, k, 0.2, geometry), b.scorer(q, k, 0.2, geometry), rtol=0, atol=0)


def test_build_selector_follows_the_config():
    for name, cls in (("pooled", st.selection.BlockScorer), ("token", TokenIndexer), ("oracle", OracleSelector)):
        assert isinstance(build_selector(st.SparseAttentionConfig(selector=name), 4, 2, 32), cls)


@pytest.mark.parametrize(
    "field,value", [("selector", "blocks"), ("selector_rope_style", "neox"), ("selector_index_heads", 0)]
)
def test_config_rejects_bad_selector_fields(field, value):
    with pytest.raises(ValueError, match=field):
        st.SparseAttentionConfig(**{field: value})


def test_set_rope_rejects_unknown_style():
    indexer = TokenIndexer(2, 1, 32, index_dim=16)
    with pytest.raises(ValueError, match="rope style"):
        indexer.set_rope(torch.ones(16), "neox")


@pytest.mark.parametrize(
    "model_type,style",
    [("llama", "rotate_half"), ("qwen2", "rotate_half"), ("gptj", "interleaved"), ("cohere", "interleaved")],
)
def test_hf_rope_style_by_model_type(model_type, style):
    assert rope_style(SimpleNamespace(config=SimpleNamespace(model_type=model_type))) == style


def test_context_parallel_refuses_the_oracle_selector():
    """Before it looks for a process group: the oracle scores dense attention of the whole sequence."""
    attn = st.SparseAttention(st.SparseAttentionConfig(selector="oracle"), 4, 2, 32)
    with pytest.raises(ValueError, match="not the oracle selector"):
        st.enable_context_parallel(attn, group=None)


@pytest.mark.gpu
@pytest.mark.parametrize("hq,hkv", [(8, 8), (12, 4), (32, 8)], ids=["mha", "gqa3", "gqa4"])
def test_token_selector_on_gpu(hq, hkv):
    """The module with the token selector on CUDA (index-score kernel, bf16): its scores against the float64
    scores of the same indexer on the CPU, and a training step with NaN padding and packed documents."""
    torch.manual_seed(5)
    n, d, batch = 4097, 64, 2
    cfg = st.SparseAttentionConfig(
        top_k=4,
        window=1,
        sinks=1,
        dense_warmup_steps=0,
        selector="token",
        selector_distill="block",  # exact scores (against the CPU's) and the block-level KL
        selector_candidates=None,
        selector_rope_theta=10000.0,
    )
    attn = st.SparseAttention(cfg, hq, hkv, d).cuda().train()
    q = torch.randn(batch, hq, n, d, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    k = torch.randn(batch, hkv, n, d, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    v = torch.randn(batch, hkv, n, d, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    seq_lens = torch.tensor([n, 3001], device="cuda")
    with torch.no_grad():
        pad = torch.arange(n, device="cuda").view(1, 1, n, 1) >= seq_lens.view(-1, 1, 1, 1)
        for t in (q, k, v):
            t.masked_fill_(pad, float("nan"))
    documents = (torch.arange(n, device="cuda") // 1500).expand(batch, n).contiguous()
    geometry = selection_geometry(n, 64, 64, 4, 1, 1)
    inputs = attn.scorer.pool(q, k, 64, 64, seq_lens)
    got = attn.scorer(*inputs, attn.scale, geometry, seq_lens=seq_lens, document_ids=documents)  # with autograd
    with torch.no_grad():  # the selection's path: the index queries from the one-pass kernel
        selection = attn.scorer(*inputs, attn.scale, geometry, seq_lens=seq_lens, document_ids=documents)
    cpu = TokenIndexer(
        hq, hkv, d, index_dim=cfg.selector_dim, lr_multiplier=cfg.selector_lr_multiplier, distance_bias=True
    ).double()
    cpu.load_state_dict(attn.scorer.state_dict())
    cpu.set_rope(attn.scorer.rope_inv_freq.cpu())
    ref_inputs = cpu.pool(q.detach().cpu().double(), k.detach().cpu().double(), 64, 64, seq_lens.cpu())
    want = cpu(*ref_inputs, attn.scale, geometry, seq_lens=seq_lens.cpu(), document_ids=documents.cpu())
    filled = want > EMPTY_BLOCK_SCORE
    for name, scores in (("autograd path", got), ("selection path", selection)):
        assert torch.equal(scores.cpu() > EMPTY_BLOCK_SCORE, filled)
        error = (scores.cpu().double()[filled] - want[filled]).abs().max()
        print(
            f"token scores ({name}), bf16 kernels vs float64: max abs error {error:.3e}, "
            f"max |score| {want[filled].abs().max():.3e}"
        )
        assert error <= 2e-2 * want[filled].abs().max()
    o = attn(q, k, v, seq_lens=seq_lens, document_ids=documents)
    valid = ~pad.expand_as(o)
    assert torch.isfinite(o[valid]).all()
    loss = torch.where(valid, o.float(), 0.0).square().mean() + st.collect_selector_losses(attn)
    loss.backward()
    for name, param in attn.named_parameters():
        assert param.grad is not None and torch.isfinite(param.grad).all(), name


def test_token_scores_of_listed_query_blocks_equal_the_full_rows():
    """The sampled distillation scores its query blocks apart (query_rows + query_blocks): the same values and
    the same parameter gradients as those rows of the full scores."""
    torch.manual_seed(6)
    hq, hkv, n, d = 4, 2, 150, 32
    indexer = TokenIndexer(hq, hkv, d, index_dim=16, index_heads=2, lr_multiplier=10.0, distance_bias=True)
    q, k = indexer.pool(torch.randn(2, hq, n, d), torch.randn(2, hkv, n, d), 32, 32, torch.tensor([150, 70]))
    geometry = selection_geometry(n, 32, 32, 2, 1, 1)
    rows = torch.tensor([4, 0, 2])  # unsorted, with the partial last block
    weights = torch.randn(2, hkv, 3, geometry.num_k_blocks)
    full = indexer(q, k, 0.3, geometry, seq_lens=torch.tensor([150, 70])).index_select(2, rows)
    (full * weights).sum().backward()
    want = {name: p.grad.clone() for name, p in indexer.named_parameters()}
    indexer.zero_grad()
    listed = indexer(indexer.query_rows(q, rows, 32), k, 0.3, geometry, rows, seq_lens=torch.tensor([150, 70]))
    (listed * weights).sum().backward()
    torch.testing.assert_close(listed, full, rtol=1e-6, atol=1e-6)
    for name, p in indexer.named_parameters():
        torch.testing.assert_close(p.grad, want[name], rtol=1e-5, atol=1e-6)


def test_token_distillation_loss_matches_brute_force():
    """selector_distill="token": the per-row KL from the row's dense attention over keys (max over the group's
    heads, renormalised) to the softmax of its index logits, against a direct float64 computation."""
    torch.manual_seed(7)
    hq, hkv, n, d, block = 4, 2, 70, 16, 16
    indexer = TokenIndexer(hq, hkv, d, index_dim=16, index_heads=2, lr_multiplier=10.0).double()
    q, k = torch.randn(2, hq, n, d, dtype=torch.float64), torch.randn(2, hkv, n, d, dtype=torch.float64)
    seq_lens = torch.tensor([70, 41])
    documents = torch.stack([torch.arange(n) // 30, torch.zeros(n, dtype=torch.int64)])
    blocks = torch.tensor([4, 1])
    q_index, k_index = indexer.pool(q, k, block, block, seq_lens)
    total, count, _ = indexer.token_distillation_loss(
        indexer.query_rows(q_index, blocks, block),
        k_index,
        q,
        k,
        blocks,
        0.25,
        block,
        seq_lens=seq_lens,
        document_ids=documents,
    )
    want_total, want_count = torch.zeros((), dtype=torch.float64), 0
    u, w = indexer._index_vectors(q_index, k_index)
    temperature = indexer._temperature(0.25)
    for b in range(2):
        for h in range(hkv):
            for blk in blocks.tolist():
                for r in range(blk * block, min((blk + 1) * block, n)):
                    if r >= seq_lens[b]:
                        continue
                    keys = [t for t in range(r + 1) if documents[b, t] == documents[b, r]]
                    att = torch.stack([torch.softmax(0.25 * q[b, h * 2 + g, r] @ k[b, h, keys].T, 0) for g in range(2)])
                    target = att.amax(0) / att.amax(0).sum()
                    logits = (u[b, h, r] @ w[b, h, keys].T).amax(0) * temperature[h]
                    want_total += (target * (target.log() - torch.log_softmax(logits, 0))).sum()
                    want_count += 1
    assert int(count) == want_count
    torch.testing.assert_close(total.double(), want_total, rtol=1e-5, atol=1e-6)


def _shards(n: int, block: int, world: int):
    """The zig-zag shards of a sequence of ``n`` rows over ``world`` ranks (context parallelism's layout), as
    ``(query blocks, rows)`` per rank: rank r holds chunks r and 2W-1-r of 2W."""
    chunk = n // (2 * world)
    shards = []
    for rank in range(world):
        rows = torch.cat(
            [
                torch.arange(rank * chunk, (rank + 1) * chunk),
                torch.arange((2 * world - 1 - rank) * chunk, (2 * world - rank) * chunk),
            ]
        )
        shards.append((rows[::block] // block, rows))
    return shards


def _local_lengths(seq_lens, rows):
    """The count of valid rows among a shard's rows (a prefix of them)."""
    return (rows.view(1, -1) < seq_lens.view(-1, 1)).sum(dim=1)


def test_shard_queries_address_their_rows_by_global_block():
    """``pool(query_blocks=)`` (a context-parallel shard): the shard's rows of any listed global blocks, un-rotated at
    the rows' global positions, equal those rows of the whole sequence's queries; the rows of a block the shard does
    not hold are 0 (placeholders), also where the queries hold NaN (padding past a length)."""
    torch.manual_seed(8)
    hq, hkv, n, d, block = 4, 2, 128, 6, 16
    indexer = TokenIndexer(hq, hkv, d, index_dim=4).double()
    indexer.set_rope(torch.tensor([1.0, 0.1]))
    q, k = torch.randn(2, hq, n, d, dtype=torch.float64), torch.randn(2, hkv, n, d, dtype=torch.float64)
    seq_lens = torch.tensor([128, 50])
    q = torch.where(torch.arange(n).view(1, 1, -1, 1) >= seq_lens.view(-1, 1, 1, 1), float("nan"), q)
    whole, _ = indexer.pool(q, k, block, block, seq_lens)
    listed = torch.tensor([6, 1, 3, 0])
    want = indexer.query_rows(whole, listed, block)
    covered = torch.zeros_like(want)
    for blocks, rows in _shards(n, block, 2):
        local, _ = indexer.pool(
            q[:, :, rows], k[:, :, rows], block, block, _local_lengths(seq_lens, rows), None, blocks
        )
        got = indexer.query_rows(local, listed, block)
        held = torch.isin(listed, blocks).repeat_interleave(block).view(1, 1, -1, 1)
        assert torch.equal(torch.where(held, 0.0, got), torch.zeros_like(got))
        covered += got
    torch.testing.assert_close(covered, want, rtol=1e-12, atol=1e-12)
    with pytest.raises(ValueError, match="query_blocks lists 3 blocks of 16 rows, but q holds 64 rows"):
        indexer.pool(q[:, :, :64], k[:, :, :64], block, block, query_blocks=torch.tensor([0, 1, 2]))
    with pytest.raises(ValueError, match="pass the query_blocks to score"):
        indexer(local, k, 1.0, selection_geometry(n, block, block, 2, 1, 1))
    with pytest.raises(ValueError, match="need the GLOBAL positions of its rows"):
        indexer_module.IndexQueries(q, None, None, None, "rotate_half", torch.tensor([0, 1]))


def test_token_distillation_loss_of_shards_sums_to_the_whole():
    """``token_distillation_loss(q_blocks=)``: each shard's KL sum over the sampled rows it holds (its q only, the
    keys of the whole sequence), summed over the shards, is the whole sequence's sum, with the same count (every
    sampled row's, on every shard), and so are the parameter gradients (at the float32 precision of the indexer's
    weights); NaN padding in q reaches nothing."""
    torch.manual_seed(9)
    hq, hkv, n, d, block = 4, 2, 128, 6, 16
    indexer = TokenIndexer(hq, hkv, d, index_dim=4, index_heads=2).double()
    q, k = torch.randn(2, hq, n, d, dtype=torch.float64), torch.randn(2, hkv, n, d, dtype=torch.float64)
    seq_lens = torch.tensor([128, 70])
    q = torch.where(torch.arange(n).view(1, 1, -1, 1) >= seq_lens.view(-1, 1, 1, 1), float("nan"), q)
    documents = torch.stack([torch.arange(n) // 40, torch.zeros(n, dtype=torch.int64)])
    sampled = torch.tensor([7, 2, 4])
    kwargs = dict(seq_lens=seq_lens, document_ids=documents)
    whole, keys = indexer.pool(q, k, block, block, seq_lens)
    total, count, _ = indexer.token_distillation_loss(
        indexer.query_rows(whole, sampled, block), keys, q, k, sampled, 0.3, block, **kwargs
    )
    total.backward()
    want = {name: p.grad.clone() for name, p in indexer.named_parameters()}
    indexer.zero_grad()
    totals = []
    for blocks, rows in _shards(n, block, 2):
        local, _ = indexer.pool(
            q[:, :, rows], k[:, :, rows], block, block, _local_lengths(seq_lens, rows), None, blocks
        )
        part, part_count, _ = indexer.token_distillation_loss(
            indexer.query_rows(local, sampled, block),
            keys,
            q[:, :, rows],
            k,
            sampled,
            0.3,
            block,
            q_blocks=blocks,
            **kwargs,
        )
        part.backward()
        assert torch.equal(part_count, count)
        totals.append(part.detach())
    assert all(t > 0 for t in totals)  # both shards hold sampled rows
    torch.testing.assert_close(sum(totals), total.detach(), rtol=1e-12, atol=0)
    for name, p in indexer.named_parameters():  # the weights enter in float32: float32 precision
        torch.testing.assert_close(p.grad, want[name], rtol=1e-5, atol=1e-6)


@pytest.mark.gpu
@pytest.mark.parametrize("hq,hkv", [(8, 8), (12, 4), (32, 8)], ids=["mha", "gqa3", "gqa4"])
def test_token_distillation_loss_on_gpu(hq, hkv, monkeypatch):
    """selector_distill="token" on CUDA in bf16 runs the streaming kernels: the loss and every parameter's gradient
    against the same indexer in float64 on the CPU, beside the PyTorch reference on the GPU in bf16 (odd N, a
    partial last block, NaN padding, packed documents)."""
    torch.manual_seed(9)
    n, d, block = 4097, 64, 64
    blocks = torch.tensor([64, 0, 40, 17])  # the partial last block (one row), the first, two inside
    seq_lens = torch.tensor([n, 3001])
    documents = (torch.arange(n) // 1500).expand(2, n).contiguous()
    q = torch.randn(2, hq, n, d, dtype=torch.float64)
    k = torch.randn(2, hkv, n, d, dtype=torch.float64)
    pad = torch.arange(n).view(1, 1, n, 1) >= seq_lens.view(-1, 1, 1, 1)
    q, k = q.masked_fill(pad, float("nan")), k.masked_fill(pad, float("nan"))
    gpu = TokenIndexer(hq, hkv, d, index_dim=32, lr_multiplier=10.0).cuda()
    gpu.set_rope(1.0 / 10000.0 ** (torch.arange(0, d, 2, dtype=torch.float32) / d))
    cpu = TokenIndexer(hq, hkv, d, index_dim=32, lr_multiplier=10.0).double()
    cpu.load_state_dict(gpu.state_dict())
    cpu.set_rope(gpu.rope_inv_freq.cpu())

    def loss_and_grads(indexer, device, dtype):
        qd, kd = q.to(device, dtype), k.to(device, dtype)
        lens, docs, listed = seq_lens.to(device), documents.to(device), blocks.to(device)
        q_index, k_index = indexer.pool(qd, kd, block, block, lens)
        total, count, _ = indexer.token_distillation_loss(
            indexer.query_rows(q_index, listed, block), k_index, qd, kd, listed, 0.125, block,
            seq_lens=lens, document_ids=docs,
        )  # fmt: skip
        indexer.zero_grad()
        (total / count).backward()
        return [total.detach().double().cpu()] + [p.grad.double().cpu() for p in indexer.parameters()]

    taken = []
    original = indexer_module._token_kl_kernel_takes
    monkeypatch.setattr(indexer_module, "_token_kl_kernel_takes", lambda *a: taken.append(original(*a)) or taken[-1])
    got = loss_and_grads(gpu, "cuda", torch.bfloat16)
    assert taken == [True], "the bf16 CUDA loss did not take the kernels"
    monkeypatch.setattr(indexer_module, "_token_kl_kernel_takes", lambda *a: False)
    low = loss_and_grads(gpu, "cuda", torch.bfloat16)
    want = loss_and_grads(cpu, "cpu", torch.float64)
    names = ["loss"] + [name for name, _ in gpu.named_parameters()]
    assert len(names) == len(got) and all(torch.isfinite(t).all() for t in got)
    for name, a, b, c in zip(names, got, want, low):
        check_close(f"token distillation {name}", a, b, c, torch.bfloat16)


@pytest.mark.parametrize("candidates", [None, 3], ids=["every-block", "three-candidates"])
def test_module_trains_with_token_level_distillation(candidates):
    torch.manual_seed(8)
    cfg = st.SparseAttentionConfig(
        block_q=16,
        block_k=16,
        top_k=2,
        window=1,
        sinks=1,
        dense_warmup_steps=0,
        selector="token",
        selector_distill="token",
        selector_candidates=candidates,
        selector_dim=16,
    )
    attn = st.SparseAttention(cfg, 4, 2, 32).train()
    q, k, v = (torch.randn(2, h, 150, 32, requires_grad=True) for h in (4, 2, 2))
    o = attn(q, k, v, seq_lens=torch.tensor([150, 97]))
    (o.square().mean() + st.collect_selector_losses(attn)).backward()
    assert torch.isfinite(o).all() and torch.isfinite(attn.selector_loss) and attn.selector_loss > 0
    assert attn.last_selection.density() < 1.0
    for name in ("query_proj", "key_proj", "log_temperature"):
        grad = getattr(attn.scorer, name).grad
        assert grad is not None and torch.isfinite(grad).all() and grad.abs().sum() > 0, name
