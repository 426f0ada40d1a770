"""The held-out evaluation suite (scripts/eval): task generators checked by exact solvers, the model's
interleaved RoPE and row oracle, and the runner end to end on the CPU (two families, dense and pooled)."""

import dataclasses
import json
import math

import pytest
import torch

import sparse_train as st
from scripts.eval import heldout, tasks
from scripts.eval.model import EvalModel, RowOracleCore, rope_interleaved, row_oracle_selection
from scripts.eval.tasks import (
    FAMILIES,
    IGNORE,
    VOCAB_SIZE,
    family,
    make_batch,
    solve,
    stream_seed,
)


@pytest.mark.parametrize("name", list(FAMILIES))
@pytest.mark.parametrize("seq_len", [256, 333])
def test_answers_are_recoverable_from_the_row(name, seq_len):
    gen = torch.Generator().manual_seed(stream_seed(name, seq_len))
    tokens, targets = make_batch(name, seq_len, 6, gen)
    assert tokens.shape == targets.shape == (6, seq_len)
    assert int(tokens.min()) >= 0 and int(tokens.max()) < VOCAB_SIZE
    for row_tokens, row_targets in zip(tokens, targets):
        asked = row_targets != IGNORE
        assert int(asked.sum()) > 0
        # next-token targets: the answer is the following input token (teacher forcing)
        positions = asked.nonzero().flatten()
        assert torch.equal(row_targets[positions], row_tokens[positions + 1])
        assert torch.equal(solve(name, row_tokens), row_targets)


@pytest.mark.parametrize("name", list(FAMILIES))
def test_solver_reads_the_answers_from_the_haystack(name):
    # shift the value part of every fact and span token in the haystack by one: every value the solver
    # reads shifts by one too (the generator's targets are not consulted)
    tokens, targets = make_batch(name, 300, 3, torch.Generator().manual_seed(7))
    for row, row_targets in zip(tokens, targets):
        asked = (row_targets != IGNORE).nonzero().flatten()
        shifted = row.clone()
        for p in range(int(asked[0])):  # every position before the first question (copy's ASK is no fact)
            t = int(row[p])
            for r in (tasks.FACT, tasks.SPAN):
                if t in r:
                    base = t - (t - r.start) % tasks.NUM_VALUES
                    shifted[p] = base + ((t - base) + 1) % tasks.NUM_VALUES
        expected = row_targets.clone()
        values = asked[(row_targets[asked] >= tasks.VALUE.start) & (row_targets[asked] < tasks.VALUE.stop)]
        assert len(values) > 0  # multihop's first answers are keys (read from links, which do not shift)
        expected[values] = tasks.VALUE.start + (row_targets[values] - tasks.VALUE.start + 1) % tasks.NUM_VALUES
        assert torch.equal(solve(name, shifted), expected)


def test_multihop_solver_follows_the_links():
    # rotate the targets of the haystack's links (chain i's first key now points to chain i+1's second key):
    # each first answer becomes the new target and each second answer that key's value in the haystack
    tokens, targets = make_batch("multihop", 300, 3, torch.Generator().manual_seed(11))
    for row, row_targets in zip(tokens, targets):
        asked = (row_targets != IGNORE).nonzero().flatten()
        hay = range(int(asked[0]))  # the haystack: every position before the first question
        links = [p for p in hay if int(row[p]) in tasks.LINK]
        assert len(links) == 4
        sources = [(int(row[p]) - tasks.LINK.start) // tasks.LINK_KEYS for p in links]
        ends = [(int(row[p]) - tasks.LINK.start) % tasks.LINK_KEYS for p in links]
        points_to = {sources[i]: ends[(i + 1) % len(links)] for i in range(len(links))}
        rotated = row.clone()
        for p, source in zip(links, sources):
            rotated[p] = tasks.LINK.start + source * tasks.LINK_KEYS + points_to[source]
        value_of = {
            (int(row[p]) - tasks.FACT.start) // tasks.NUM_VALUES: (int(row[p]) - tasks.FACT.start) % tasks.NUM_VALUES
            for p in hay
            if int(row[p]) in tasks.FACT
        }
        expected = row_targets.clone()
        for q in asked[::2].tolist():  # each question: query(k1) at q, query(k2) at q + 1
            second = points_to[int(row[q]) - tasks.QUERY.start]
            expected[q] = tasks.QUERY[second]
            expected[q + 1] = tasks.VALUE[value_of[second]]
        assert not torch.equal(expected, row_targets)
        assert torch.equal(solve("multihop", rotated), expected)


def test_streams_are_reproducible_and_held_out():
    def rows(*labels):
        return make_batch("needles", 256, 2, torch.Generator().manual_seed(stream_seed(*labels)))[0]

    assert torch.equal(rows("needles", "train", 256, 0), rows("needles", "train", 256, 0))
    assert not torch.equal(rows("needles", "train", 256, 0), rows("needles", "train", 256, 1))
    assert not torch.equal(rows("needles", "train", 256, 0), rows("needles", "eval", 256))


def test_bad_arguments_are_named():
    with pytest.raises(ValueError, match="family"):
        family("nope")
    with pytest.raises(ValueError, match="seq_len"):
        make_batch("assoc", 63, 1, torch.Generator())
    with pytest.raises(ValueError, match="batch"):
        make_batch("copy", 256, 0, torch.Generator())


def test_rope_rotates_interleaved_pairs():
    # Meta's reference formulation: consecutive pairs as complex numbers times exp(i * pos * freq)
    torch.manual_seed(0)
    x = torch.randn(2, 3, 10, 8, dtype=torch.float64)
    pos = torch.arange(10)
    freqs = 500.0 ** (-torch.arange(0, 8, 2, dtype=torch.float64) / 8)
    rot = torch.polar(torch.ones(10, 4, dtype=torch.float64), pos[:, None] * freqs[None, :])
    expected = torch.view_as_real(torch.view_as_complex(x.reshape(2, 3, 10, 4, 2)) * rot).flatten(-2)
    assert torch.allclose(rope_interleaved(x, pos, 500.0).double(), expected, atol=1e-5)
    # scores depend on relative position only
    q, k = torch.randn(8), torch.randn(8)

    def score(m, n):
        qm = rope_interleaved(q.view(1, 1, 1, 8).expand(1, 1, 20, 8), torch.arange(20), 500.0)[0, 0, m]
        kn = rope_interleaved(k.view(1, 1, 1, 8).expand(1, 1, 20, 8), torch.arange(20), 500.0)[0, 0, n]
        return float(qm @ kn)

    assert math.isclose(score(7, 3), score(15, 11), rel_tol=1e-4, abs_tol=1e-5)


def test_row_oracle_keeps_each_rows_heaviest_blocks():
    torch.manual_seed(0)
    n, block, d = 8 * 16, 16, 8
    q = torch.randn(1, 4, n, d) * 0.1
    k = torch.randn(1, 2, n, d) * 0.1
    # every query row of group 0 looks at key 40 (block 2), of group 1 at key 75 (block 4)
    q[:, :2] += 3.0 * torch.eye(d)[0]
    k[:, 0, 40] += 3.0 * torch.eye(d)[0]
    q[:, 2:] += 3.0 * torch.eye(d)[1]
    k[:, 1, 75] += 3.0 * torch.eye(d)[1]
    mask, _ = row_oracle_selection(q, k, (0, n), top_k=1, block=block, window=1, sinks=1, scale=1.0)
    assert mask.shape == (1, 4, n, n)
    blocks = mask.view(1, 4, n, n // block, block).any(-1)  # [1, 4, rows, NKB]
    target_of_group = {0: 2, 1: 4}
    for row in range(n):
        own = row // block
        for head in range(4):
            got = set(blocks[0, head, row].nonzero().flatten().tolist())
            assert {0, own} <= got and len(got) <= 3  # sink, window, at most top_k more
            target = target_of_group[head // 2]
            if 0 < target < own:
                assert target in got
        assert not mask[0, :, row, row + 1 :].any()  # causal
    # with a budget covering every block the mask is the causal mask
    full, _ = row_oracle_selection(q, k, (0, n), top_k=n // block, block=block, window=1, sinks=1, scale=1.0)
    assert torch.equal(full[0, 0], torch.ones(n, n, dtype=torch.bool).tril())


def test_row_oracle_kept_mass_is_the_dense_mass_on_its_keys():
    """The kept mass of each (query head, row) equals the dense softmax summed over the keys its mask allows, 1 where
    the budget covers every block, and the chunked core's mean recall is the mean of it."""
    torch.manual_seed(1)
    n, block, d = 5 * 16 + 3, 16, 8
    q, k = torch.randn(2, 4, n, d), torch.randn(2, 2, n, d)
    kw = dict(top_k=1, block=block, window=1, sinks=1, scale=0.5)
    mask, kept = row_oracle_selection(q, k, (0, n), **kw)
    probs = (
        (q @ k.repeat_interleave(2, dim=1).transpose(-1, -2) * 0.5)
        .masked_fill(~torch.ones(n, n, dtype=torch.bool).tril(), float("-inf"))
        .softmax(-1)
    )
    torch.testing.assert_close(kept, (probs * mask).sum(-1))
    assert (kept <= 1 + 1e-6).all() and (kept < 0.99).any()  # rows past the budget lose mass
    _, full = row_oracle_selection(q, k, (0, n), **dict(kw, top_k=n // block + 1))
    torch.testing.assert_close(full, torch.ones_like(full))
    core = RowOracleCore(
        dense_warmup_steps=0,
        chunk_elements=2 * 4 * n * 32,
        **{name: value for name, value in kw.items() if name != "scale"},
    )
    core(q * math.sqrt(d) * 0.5, k, torch.randn(2, 2, n, d))  # scale 1/sqrt(d) inside: the same logits as above
    torch.testing.assert_close(core.last_mass_recall, kept.mean())


def _job(**overrides) -> heldout.JobConfig:
    fields = dict(
        family="needles",
        mode="dense",
        seed=0,
        seq_len=8192,
        steps=1200,
        batch=8,
        lr=3e-3,
        layers=2,
        d_model=256,
        num_heads=4,
        num_kv_heads=2,
        rope_theta=10000.0,
        warmup_fraction=0.25,
        short_steps=300,
        short_len=64,
        eval_rows=256,
        log_every=50,
    )
    return heldout.JobConfig(**{**fields, **overrides})


def test_same_seed_same_initial_weights_in_every_mode():
    base = dict(family="needles", seed=3, seq_len=256, steps=4, batch=2, d_model=128, num_heads=2, num_kv_heads=1)
    models = {mode: heldout.build_model(_job(mode=mode, **base))[0] for mode in ("dense", "pooled", "row_oracle")}
    own = {name: p for name, p in models["dense"].named_parameters()}
    for mode in ("pooled", "row_oracle"):
        params = dict(models[mode].named_parameters())
        for name, p in own.items():
            assert torch.equal(params[name], p), (mode, name)
    assert isinstance(models["dense"], EvalModel)


def test_row_oracle_job_records_its_training_density_and_mass_recall():
    """The row oracle is no st.SparseAttention, so collect_attention_stats does not see it: its job records the
    density (a fraction of the causal area below dense) and the mass recall of its last training step itself."""
    job = _job(mode="row_oracle", seq_len=512, steps=3, short_steps=1, warmup_fraction=0.0, batch=2, d_model=64)
    record = heldout.run_job(dataclasses.replace(job, num_heads=2, num_kv_heads=1, eval_rows=2, log_every=1))
    assert "error" not in record, record.get("error")
    assert 0.0 < record["train_stats"]["density"] < 1.0
    assert math.isclose(record["train_stats"]["density"], record["eval_density"], rel_tol=0.2)
    assert 0.0 < record["train_stats"]["mass_recall_mean"] <= 1.0


def test_curriculum_stages_and_job_keys():
    """Short rows, then the middle stage, then the full length; a job without a middle stage keeps the key it has
    without the middle-stage fields (results of such runs resume), a job with one gets another key."""
    job = _job(mid_steps=500, mid_len=2048)
    lengths = [job.row_length(step) for step in (0, 299, 300, 799, 800, 1199)]
    assert lengths == [64, 64, 2048, 2048, 8192, 8192]
    plain = _job()
    assert [plain.row_length(step) for step in (299, 300)] == [64, 8192]
    assert "mid_steps" not in json.loads(plain.key)
    assert json.loads(job.key)["mid_steps"] == 500
    assert _job(mid_len=4096).key == plain.key  # the length of an absent stage is not part of the key
    assert job.key != plain.key


def test_budget_override_keys_and_summary_groups():
    """``top_k`` 0 is the family's budget and keeps the key of a job without it; another budget or a middle stage
    makes its own summary row, so runs of one family at equal steps are not averaged across them."""
    assert _job().budget == family("needles").top_k
    assert "top_k" not in json.loads(_job().key)
    assert _job(top_k=8).budget == 8 and json.loads(_job(top_k=8).key)["top_k"] == 8
    jobs = [_job(), _job(seed=1), _job(top_k=8), _job(mid_steps=500)]
    records = [
        {"config": dataclasses.asdict(job), "accuracy": 0.5, "eval_density": 0.1, "steps_per_s": 1.0}
        | {"chance": 0.125, "top_k": job.budget}
        for job in jobs
    ]
    groups = heldout.build_summary(records)
    assert [(g["top_k"], g["mid_steps"], len(g["modes"]["dense"]["seeds"])) for g in groups] == [
        (4, 0, 2),
        (4, 500, 1),
        (8, 0, 1),
    ]


def test_query_block_override_keys_config_and_summary_groups():
    """``block_q`` 0 is BLOCK query rows and keeps the key of a job without it; another query block reaches the
    module's config (key blocks stay BLOCK) and makes its own summary row, named in the table's budget column."""
    assert "block_q" not in json.loads(_job().key)
    assert _job().query_block == heldout.BLOCK
    job = _job(mode="token_cand", block_q=16)
    assert json.loads(job.key)["block_q"] == 16 and job.key != _job(mode="token_cand").key
    cfg, _ = heldout.sparse_config(job)
    assert (cfg.block_q, cfg.block_k) == (16, heldout.BLOCK)
    jobs = [_job(), _job(block_q=16), _job(block_q=16, seed=1)]
    records = [
        {"config": dataclasses.asdict(job), "accuracy": 0.5, "eval_density": 0.1, "steps_per_s": 1.0}
        | {"chance": 0.125, "top_k": job.budget}
        for job in jobs
    ]
    groups = heldout.build_summary(records)
    assert [(g["block_q"], len(g["modes"]["dense"]["seeds"])) for g in groups] == [(16, 2), (heldout.BLOCK, 1)]
    table = heldout.summary_markdown(groups, records)
    assert "| 4 (block_q 16) |" in table and "| 4 |" in table


def test_default_mode_takes_the_modules_selector_defaults_and_token_cand_a_count():
    """``default`` adds nothing to the shared keywords, so its selector fields are SparseAttentionConfig's defaults;
    ``token_cand`` fixes CANDIDATES_PER_TOP_K x top_k candidates at every length."""
    defaults = st.SparseAttentionConfig()
    cfg, _ = heldout.sparse_config(_job(mode="default"))
    fields = ("selector", "selector_distill", "selector_candidates", "distill", "selector_index_heads", "selector_dim")
    assert [getattr(cfg, f) for f in fields] == [getattr(defaults, f) for f in fields]
    cand, _ = heldout.sparse_config(_job(mode="token_cand"))
    assert cand.selector_candidates == heldout.CANDIDATES_PER_TOP_K * cand.top_k
    assert cand.resolved_selector_candidates_min_len == 0


def test_default_mode_key_records_the_defaults(monkeypatch):
    """A ``default`` job under other module defaults has another key, so a rerun does not resume from results measured
    with the old ones; the other modes' keys name their selector fields already and do not change."""
    key = json.loads(_job(mode="default").key)
    assert key["defaults"]["selector"] == st.SparseAttentionConfig().selector
    before = (_job(mode="default").key, _job(mode="token_cand").key)
    monkeypatch.setattr(st.config, "CANDIDATES_MIN_SEQ_LEN", 4096)
    assert json.loads(_job(mode="default").key)["defaults"]["candidates_min_len"] == 4096
    assert _job(mode="default").key != before[0] and _job(mode="token_cand").key == before[1]


@pytest.mark.parametrize("value", ["8", "128", "-16"], ids=["below-16", "above-key-block", "negative"])
def test_query_block_option_rejects(value, capsys):
    with pytest.raises(SystemExit):
        heldout.parse_args(["--block-q", value, "--out", "unused"])
    assert "--block-q must be 0 or one of" in capsys.readouterr().err


def test_runner_end_to_end(tmp_path):
    out = tmp_path / "run"
    argv = [
        "--families",
        "needles,copy",
        "--modes",
        "dense,pooled",
        "--seeds",
        "0",
        "--seq-len",
        "256",
        "--steps",
        "3",
        "--short-steps",
        "1",
        "--batch",
        "4",
        "--eval-rows",
        "8",
        "--log-every",
        "2",
        "--jobs",
        "2",
        "--device",
        "cpu",
        "--out",
        str(out),
    ]
    assert heldout.main(argv) == 0
    lines = (out / "results.jsonl").read_text().splitlines()
    records = [json.loads(line) for line in lines]
    assert sorted((r["config"]["family"], r["config"]["mode"]) for r in records) == [
        ("copy", "dense"),
        ("copy", "pooled"),
        ("needles", "dense"),
        ("needles", "pooled"),
    ]
    for r in records:
        assert "error" not in r
        assert 0.0 <= r["accuracy"] <= 1.0 and r["answers"] > 0
        assert [point[0] for point in r["train_curve"]] == [2, 3]
        assert all(math.isfinite(point[1]) for point in r["train_curve"])
        assert r["steps_per_s"] > 0 and 0.0 < r["eval_density"] <= 1.0
        assert r["chance"] == family(r["config"]["family"]).chance
        if r["config"]["mode"] == "pooled":
            assert r["sparse_config"]["top_k"] == family(r["config"]["family"]).top_k
            assert r["sparse_config"]["window"] == 1 and r["sparse_config"]["sinks"] == 1
            assert r["sparse_config"]["dense_warmup_steps"] == 1
            assert "selector_loss" in r["train_stats"]
    # the same initial weights and rows: the first training losses agree (dense warm-up step)
    for name in ("needles", "copy"):
        first = {r["config"]["mode"]: r["train_curve"][0][1] for r in records if r["config"]["family"] == name}
        assert math.isclose(first["dense"], first["pooled"], rel_tol=1e-4)
    summary = json.loads((out / "summary.json").read_text())
    assert [(g["family"], g["seq_len"]) for g in summary] == [("needles", 256), ("copy", 256)]
    for g in summary:
        assert set(g["modes"]) == {"dense", "pooled"}
        assert g["modes"]["dense"]["seeds"] == {
            "0": next(
                r["accuracy"] for r in records if (r["config"]["family"], r["config"]["mode"]) == (g["family"], "dense")
            )
        }
        assert math.isclose(g["ratios"]["pooled/dense"], g["modes"]["pooled"]["mean"] / g["modes"]["dense"]["mean"])
    table = (out / "summary.md").read_text()
    assert "| needles | 256 | 3 x 4 |" in table and "| copy | 256 | 3 x 4 |" in table
    assert (out / "plot.png").stat().st_size > 0
    # resumable: a rerun finds every job done and appends nothing
    assert heldout.main(argv) == 0
    assert (out / "results.jsonl").read_text().splitlines() == lines
    # the summary is rebuilt from results.jsonl alone
    (out / "summary.md").unlink()
    assert heldout.main(["--summarize", str(out)]) == 0
    assert (out / "summary.md").read_text() == table
