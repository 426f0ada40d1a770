"""TextDataModule: reading text / JSONL, tokenizing with a local tokenizer (built offline), packing documents
into rows (document ids, restarting position ids, labels that never cross a document), determinism, rank
sharding, the validation split, and the packed rows reaching the models."""

from __future__ import annotations

import math
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

pytest.importorskip("transformers")

from builders import assert_mid_epoch_resume_equals_straight, save_tiny_tokenizer, write_tiny_corpus  # noqa: E402

from sparse_train.lightning.text_data import (  # noqa: E402
    PackedRows,
    RowShards,
    TextDataModule,
    expand_paths,
    pack_documents,
    read_documents,
    split_documents,
    tokenize_documents,
)
from sparse_train.tasks import IGNORE_INDEX  # noqa: E402

PAD, BOS, EOS = 1, 2, 3


@pytest.fixture(scope="module")
def tokenizer_dir(tmp_path_factory) -> Path:
    return save_tiny_tokenizer(tmp_path_factory.mktemp("tok") / "tiny")


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> Path:
    return write_tiny_corpus(tmp_path_factory.mktemp("corpus") / "data")


def _module(corpus: Path, tokenizer_dir: Path, **kwargs) -> TextDataModule:
    kwargs = {"seq_len": 17, "batch_size": 2, "val_fraction": 0.2, **kwargs}
    dm = TextDataModule([str(corpus)], tokenizer_path=str(tokenizer_dir), **kwargs)
    dm.setup("fit")
    return dm


def _check_row(row: dict[str, torch.Tensor], seq_len: int, pad_id: int = PAD) -> list[torch.Tensor]:
    """Assert the packed-row contract on one row; return its documents' tokens (padding excluded). Documents
    never contain ``pad_id`` here, so the padding is the row's last segment when it is all ``pad_id``."""
    tokens, labels, doc, pos = row["tokens"], row["labels"], row["document_ids"], row["position_ids"]
    assert tokens.shape == labels.shape == doc.shape == pos.shape == (seq_len,)
    assert (tokens.dtype, labels.dtype, doc.dtype, pos.dtype) == (torch.int64, torch.int64, torch.int32, torch.int64)
    assert doc[0] == 0 and pos[0] == 0
    step = doc[1:] - doc[:-1]
    assert bool(((step == 0) | (step == 1)).all()), f"document ids must be non-decreasing by 0/1: {doc}"
    new_doc = step == 1
    # positions restart at 0 exactly where a document starts and count up inside it
    assert torch.equal(pos[1:][new_doc], torch.zeros_like(pos[1:][new_doc]))
    assert torch.equal(pos[1:][~new_doc], pos[:-1][~new_doc] + 1)
    segments = [tokens[doc == d] for d in range(int(doc[-1]) + 1)]
    padded = bool((segments[-1] == pad_id).all())
    real = seq_len - (len(segments[-1]) if padded else 0)
    assert real > 0 and not bool((tokens[:real] == pad_id).any()), "padding inside the documents"
    # a label is the next token of the same document; a document's last token and padding have none
    inside = ~new_doc[: real - 1]
    assert torch.equal(labels[: real - 1][inside], tokens[1:real][inside])
    assert bool((labels[: real - 1][~inside] == IGNORE_INDEX).all()), "a label crosses into the next document"
    assert bool((labels[real - 1 :] == IGNORE_INDEX).all()), "the last document's end or padding is labelled"
    return segments[:-1] if padded else segments


# ---------------------------------------------------------------------------------------------- packing
def test_pack_documents_best_fit_decreasing():
    # pieces, longest first: (2,0,8) (4,0,7) (0,0,5) (2,8,4) (1,0,3) (3,0,2); each to the fullest row with room
    rows = pack_documents([5, 3, 12, 2, 7], seq_len=8)
    assert rows == [[(2, 0, 8)], [(4, 0, 7)], [(0, 0, 5), (1, 0, 3)], [(2, 8, 4), (3, 0, 2)]]


@pytest.mark.parametrize("seq_len", [1, 7, 16, 64], ids=lambda n: f"N{n}")
def test_pack_documents_covers_every_token_once(seq_len):
    lengths = torch.randint(1, 50, (40,), generator=torch.Generator().manual_seed(seq_len)).tolist()
    rows = pack_documents(lengths, seq_len)
    covered = {d: [] for d in range(len(lengths))}
    for row in rows:
        assert 0 < sum(n for _, _, n in row) <= seq_len
        for d, start, n in row:
            covered[d].append((start, n))
    for d, spans in covered.items():
        spans.sort()
        # pieces of a document tile it: seq_len-long pieces, then the remainder
        assert spans == [(s, min(seq_len, lengths[d] - s)) for s in range(0, lengths[d], seq_len)]
    # best fit never opens a row while an existing one still has room for the piece
    assert len(rows) <= sum(math.ceil(n / seq_len) for n in lengths)
    assert len(rows) >= math.ceil(sum(lengths) / seq_len)


def test_packed_rows_format_and_long_documents_split():
    # document d holds the distinct values 1000 * (d + 1) + offset, so every token says where it came from
    lengths = [1, 4, 13, 30, 6, 2, 9]
    docs = [torch.arange(n, dtype=torch.int32) + 1000 * (d + 1) for d, n in enumerate(lengths)]
    rows = PackedRows(docs, seq_len=13, pad_id=PAD)
    pieces = []
    for i in range(len(rows)):
        row = rows[i]
        row_docs = _check_row(row, 13)
        real = sum(len(p) for p in row_docs)
        assert bool((row["tokens"][real:] == PAD).all())
        if real < 13:
            assert row["document_ids"][real] == len(row_docs)  # padding is one more document
        pieces += row_docs
    # the 30-token document is split into 13 + 13 + 4, each piece a separate document
    assert sorted(len(p) for p in pieces if int(p[0]) // 1000 == 4) == [4, 13, 13]
    assert rows.num_tokens == sum(lengths) == sum(len(p) for p in pieces)
    for d, _n in enumerate(lengths):
        own = sorted((p for p in pieces if int(p[0]) // 1000 == d + 1), key=lambda p: int(p[0]))
        assert torch.equal(torch.cat(own), docs[d].long()), f"document {d} is not reassembled from its pieces"
    labelled = sum(int((rows[i]["labels"] != IGNORE_INDEX).sum()) for i in range(len(rows)))
    assert labelled == sum(len(p) - 1 for p in pieces)


# ---------------------------------------------------------------------------------------------- reading
def test_read_text_and_jsonl(tmp_path):
    (tmp_path / "sub").mkdir()
    (tmp_path / "a.txt").write_text("w1 w2\nw3")
    (tmp_path / "sub" / "b.md").write_text("w4")
    (tmp_path / "empty.txt").write_text("")
    (tmp_path / "skip.bin").write_bytes(b"\xff\xfe")
    (tmp_path / "c.jsonl").write_text('{"body": "w5 w6", "text": "not this"}\n\n{"body": ""}\n{"body": "w7"}\n')
    files = expand_paths([str(tmp_path)], ["*.txt", "*.md", "*.jsonl"])
    assert [f.relative_to(tmp_path).as_posix() for f in files] == ["a.txt", "c.jsonl", "empty.txt", "sub/b.md"]
    with pytest.raises(ValueError, match=r"c.jsonl:3 has no 'text' field"):
        read_documents(expand_paths([str(tmp_path / "c.jsonl")]), text_field="text")
    (tmp_path / "c.jsonl").write_text('{"body": "w5 w6"}\n\n{"body": ""}\n{"body": "w7"}\n')
    assert read_documents(files, text_field="body") == ["w1 w2\nw3", "w5 w6", "w7", "w4"]
    assert read_documents(files, text_field="body", max_documents=2) == ["w1 w2\nw3", "w5 w6"]
    # glob patterns (recursive) and plain files, each file once, in the given order
    assert expand_paths([str(tmp_path / "**" / "*.md"), str(tmp_path / "a.txt"), str(tmp_path / "*.txt")]) == [
        tmp_path / "sub" / "b.md",
        tmp_path / "a.txt",
        tmp_path / "empty.txt",
    ]


@pytest.mark.parametrize(
    "content, match",
    [
        ('{"text": "w1"}\n{"text": 3}\n', r"bad.jsonl:2: field 'text' must be a string"),
        ('{"text": "w1"}\nnot json\n', r"bad.jsonl:2 is not valid JSON"),
        ('["w1"]\n', r"bad.jsonl:1 has no 'text' field"),
    ],
    ids=["non_string", "invalid_json", "not_an_object"],
)
def test_read_jsonl_errors_name_file_and_line(tmp_path, content, match):
    (tmp_path / "bad.jsonl").write_text(content)
    with pytest.raises(ValueError, match=match):
        read_documents([tmp_path / "bad.jsonl"])


def test_read_errors(tmp_path):
    (tmp_path / "latin.txt").write_bytes("caf\xe9".encode("latin-1"))
    with pytest.raises(ValueError, match="latin.txt is not UTF-8"):
        read_documents([tmp_path / "latin.txt"])
    with pytest.raises(ValueError, match="paths: .*nothing_here.*neither a file"):
        expand_paths([str(tmp_path / "nothing_here*")])
    (tmp_path / "d").mkdir()
    with pytest.raises(ValueError, match="holds no file matching"):
        expand_paths([str(tmp_path / "d")])


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"paths": "data.txt"}, "single path"),
        ({"paths": []}, "non-empty list"),
        ({"seq_len": 0}, "seq_len"),
        ({"val_fraction": 1.0}, "val_fraction"),
        ({"tokenizer_path": "/no/such/tokenizer"}, "tokenizer_path"),
        ({"text_field": ""}, "text_field"),
        ({"patterns": "*.txt"}, "patterns"),
    ],
    ids=["bare_string", "empty", "seq_len", "val_fraction", "tokenizer_path", "text_field", "patterns"],
)
def test_constructor_rejects_bad_arguments(corpus, kwargs, match):
    with pytest.raises(ValueError, match=match):
        TextDataModule(**{"paths": [str(corpus)], **kwargs})


# ---------------------------------------------------------------------------------------------- tokenizing
@pytest.mark.parametrize(
    "bos, eos", [(True, False), (False, False), (True, True)], ids=["bos", "no_bos", "tokenizer_adds_eos"]
)
def test_tokenize_bos_per_convention_one_eos(tmp_path, bos, eos):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(save_tiny_tokenizer(tmp_path / "t", bos=bos, eos=eos), local_files_only=True)
    ids = tokenize_documents(tok, ["w0 w1 w2", "w59"], batch_size=1)
    body = [[4, 5, 6], [63]]
    assert [t.tolist() for t in ids] == [([BOS] if bos else []) + b + [EOS] for b in body]
    assert all(t.dtype == torch.int32 for t in ids)


# ---------------------------------------------------------------------------------------------- data module
def test_datamodule_rows_follow_the_contract(corpus, tokenizer_dir):
    dm = _module(corpus, tokenizer_dir)
    assert dm.vocab_size == 64
    texts = read_documents(expand_paths([str(corpus)]))
    assert dm.train_rows.num_documents + dm.val_rows.num_documents == len(texts) == 14
    for rows in (dm.train_rows, dm.val_rows):
        for i in range(len(rows)):
            for piece in _check_row(rows[i], 17):
                assert int(piece[0]) == BOS or int(piece[0]) >= 4  # a piece may start mid-document
    batch = next(iter(dm.train_dataloader()))
    assert set(batch) == {"tokens", "labels", "document_ids", "position_ids"}
    assert batch["tokens"].shape == batch["document_ids"].shape == (2, 17)
    # every document ends with EOS, which is the label of its last word: EOS is learned
    assert (
        int((torch.stack([dm.train_rows[i]["labels"] for i in range(len(dm.train_rows))]) == EOS).sum())
        == dm.train_rows.num_documents
    )


def test_datamodule_is_deterministic(corpus, tokenizer_dir):
    def rows(dm, split):
        data = getattr(dm, split)
        return [data[i] for i in range(len(data))]

    a, b = _module(corpus, tokenizer_dir, seed=3), _module(corpus, tokenizer_dir, seed=3)
    for split in ("train_rows", "val_rows"):
        for x, y in zip(rows(a, split), rows(b, split), strict=True):
            assert all(torch.equal(x[k], y[k]) for k in x)
    la, lb = a.train_dataloader(), b.train_dataloader()
    order = list(la.sampler)
    assert order == list(lb.sampler)
    la.sampler.set_epoch(1)
    assert sorted(list(la.sampler)) == sorted(order) and list(la.sampler) != order, "epoch 1 is not reshuffled"
    in_order = _module(corpus, tokenizer_dir, seed=3, shuffle=False).train_dataloader()
    assert list(in_order.sampler) == list(range(len(order)))


@pytest.mark.parametrize("world", [2, 3], ids=lambda w: f"world{w}")
@pytest.mark.parametrize("num_rows", [12, 13, 14], ids=lambda n: f"rows{n}")
def test_row_shards_disjoint_equal_and_complete(world, num_rows):
    for epoch in (0, 1):
        shards = []
        for rank in range(world):
            sampler = RowShards(num_rows, rank, world, seed=5)
            sampler.set_epoch(epoch)
            shards.append(list(sampler))
            assert len(shards[-1]) == len(sampler) == num_rows // world
        union = set().union(*map(set, shards))
        assert len(union) == sum(map(len, shards)), "ranks share a row"
        assert len(union) == num_rows - num_rows % world and union <= set(range(num_rows))
        if num_rows % world == 0:
            assert union == set(range(num_rows))
    with pytest.raises(ValueError, match="rank"):
        RowShards(num_rows, world, world)
    with pytest.raises(ValueError, match="cannot give each of 3 ranks a row"):
        RowShards(2, 0, 3)


@pytest.mark.parametrize("world", [2, 3], ids=lambda w: f"world{w}")
def test_datamodule_shards_by_trainer_rank(corpus, tokenizer_dir, world):
    dm = _module(corpus, tokenizer_dir, seq_len=9, val_fraction=0.3)
    seen = {}
    for split, loader_of in (("train", dm.train_dataloader), ("val", dm.val_dataloader)):
        shards = []
        for rank in range(world):
            dm.trainer = SimpleNamespace(
                global_rank=rank,
                world_size=world,
                _accelerator_connector=SimpleNamespace(use_distributed_sampler=False),
            )
            loader = loader_of()
            shards.append(list(loader.sampler))
            assert len(loader) == len(shards[0]) // 2 + len(shards[0]) % 2  # batches: equal on every rank
        rows = len(dm.train_rows if split == "train" else dm.val_rows)
        union = set().union(*map(set, shards))
        assert all(len(s) == rows // world for s in shards)
        assert len(union) == rows - rows % world == sum(map(len, shards))
        seen[split] = shards
    dm.trainer = SimpleNamespace(
        global_rank=0, world_size=world, _accelerator_connector=SimpleNamespace(use_distributed_sampler=True)
    )
    with pytest.raises(ValueError, match="use_distributed_sampler=false"):
        dm.train_dataloader()


def test_validation_split_is_held_out(corpus, tokenizer_dir):
    texts = read_documents(expand_paths([str(corpus)]))
    train, val = split_documents(texts, 0.3, seed=0)
    assert set(train).isdisjoint(val) and sorted(train + val) == list(range(len(texts)))
    assert 0 < len(val) < len(texts)
    # identical documents land on the same side; a tiny corpus still holds one out; 0 holds none out
    twice = texts + texts
    t2, v2 = split_documents(twice, 0.3, seed=0)
    assert all((i in v2) == (i + len(texts) in v2) for i in range(len(texts)))
    assert len(split_documents(texts[:2], 1e-9, seed=0)[1]) == 1
    assert split_documents(texts, 0.0, seed=0) == (list(range(len(texts))), [])
    with pytest.raises(ValueError, match="holds out all"):
        split_documents(texts[:1], 0.5, seed=0)
    # the module's validation rows hold exactly the held-out documents' tokens, none of the training ones
    dm = _module(corpus, tokenizer_dir, val_fraction=0.3)
    val_tokens = tokenize_documents(dm.tokenizer, [texts[i] for i in val])
    assert dm.val_rows.num_tokens == sum(len(t) for t in val_tokens)
    assert dm.train_rows.num_tokens == sum(len(t) for t in tokenize_documents(dm.tokenizer, [texts[i] for i in train]))
    held = {tuple(t.tolist()) for t in val_tokens}
    for i in range(len(dm.train_rows)):
        for piece in _check_row(dm.train_rows[i], 17):
            if len(piece) > 3:
                assert not any(tuple(piece.tolist()) == h[: len(piece)] for h in held)
    no_val = _module(corpus, tokenizer_dir, val_fraction=0.0)
    assert no_val.val_dataloader() == [] and len(no_val.val_rows) == 0


# ---------------------------------------------------------------------------------------------- models
def _tiny_llama(path: Path, vocab_size: int = 96) -> Path:
    import transformers

    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        vocab_size=vocab_size,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=128,
    )
    transformers.LlamaForCausalLM(config).save_pretrained(path)
    return save_tiny_tokenizer(path)


class _Recorder(torch.nn.Module):
    """A ``tokens -> logits`` model that records its keyword inputs."""

    def __init__(self, vocab: int) -> None:
        super().__init__()
        self.embed = torch.nn.Embedding(vocab, vocab)
        self.calls: list[dict] = []

    def forward(self, tokens, *, document_ids=None):
        self.calls.append({"document_ids": document_ids})
        return self.embed(tokens)


class _TokensOnly(_Recorder):
    def forward(self, tokens):
        self.calls.append({})
        return self.embed(tokens)


@pytest.mark.parametrize("model_cls", [_Recorder, _TokensOnly], ids=["takes_document_ids", "tokens_only"])
def test_training_step_passes_boundaries_the_model_takes(corpus, tokenizer_dir, model_cls):
    from sparse_train.lightning.training import CausalLMTraining, TrainingArgs

    dm = _module(corpus, tokenizer_dir)
    batch = next(iter(dm.train_dataloader()))
    module = torch.nn.Module()
    module.model = model_cls(64)
    args = TrainingArgs.checked(
        "test",
        lr=1e-3,
        selector_lr=None,
        weight_decay=0.0,
        betas=(0.9, 0.95),
        warmup_steps=0,
        min_lr_ratio=0.1,
        selector_loss_weight=1.0,
        train_only_selector=False,
        init_from=None,
    )
    logic = CausalLMTraining(module, args, vocab_size=64, attention="dense", vocab_error="", sparse_hint="")
    if model_cls is _Recorder:
        loss, _, count = logic._lm_loss(module, batch)
        assert torch.equal(module.model.calls[0]["document_ids"], batch["document_ids"])
    else:
        with pytest.warns(UserWarning, match="attention crosses the documents"):
            loss, _, count = logic._lm_loss(module, batch)
        logic._lm_loss(module, batch)  # warned once, still runs
        assert module.model.calls == [{}, {}]
    assert int(count) == int((batch["labels"] != IGNORE_INDEX).sum()) and math.isfinite(float(loss.detach()))


def test_hf_packed_rows_match_documents_run_alone(corpus, tokenizer_dir, tmp_path):
    """Through HFCausalLMModule (dense): each document of a packed row gets the logits it gets alone, so the
    restarting position ids reach the model and its attention stays inside the document."""
    from sparse_train.lightning import HFCausalLMModule

    module = HFCausalLMModule(str(_tiny_llama(tmp_path / "llama")), attention="dense", dtype="float64").eval()
    dm = _module(corpus, tokenizer_dir, seq_len=31, batch_size=64)
    batch = next(iter(dm.train_dataloader()))  # every training row
    # the training step hands the model exactly the restarting positions (HFCausalLM takes no document ids)
    inputs = module.training_logic.model_inputs(module.model, batch)
    assert list(inputs) == ["position_ids"] and inputs["position_ids"] is batch["position_ids"]
    with torch.no_grad():
        logits = module.model(batch["tokens"], **inputs)
        checked = 0
        for b in range(batch["tokens"].shape[0]):
            for d in batch["document_ids"][b].unique().tolist():
                at = batch["document_ids"][b] == d
                alone = module.model(batch["tokens"][b][at][None])
                torch.testing.assert_close(logits[b][at], alone[0], rtol=1e-9, atol=1e-9)
                checked += 1
        assert checked >= 2 * batch["tokens"].shape[0], "rows hold one document each: nothing was packed"
        plain = module.model(batch["tokens"])
    assert not torch.allclose(plain, logits), "position_ids did not change the result"


def test_tokenizer_defaults_to_the_model_checkpoint(corpus):
    dm = TextDataModule([str(corpus)])
    assert dm.vocab_size is None  # unknown until a model with a checkpoint directory is attached
    with pytest.raises(ValueError, match="tokenizer_path is unset"):
        dm.setup("fit")


def test_fit_through_the_hf_recipe(corpus, tmp_path, monkeypatch):
    """The stage-3 HF recipe, dense (so it runs whatever the sparse path supports), through the CLI: the
    tokenizer comes from the checkpoint directory, training and validation read packed rows."""
    from sparse_train import cli

    monkeypatch.chdir(tmp_path)
    checkpoint = _tiny_llama(tmp_path / "llama")
    result = cli.run_cli(
        [
            "fit",
            "--config",
            "finetune_hf_stage3_sparse",
            f"--model.init_args.pretrained_path={checkpoint}",
            "--model.init_args.attention=dense",
            "--model.init_args.init_from=null",
            f"--data.init_args.paths=[{corpus}]",
            "--data.init_args.seq_len=32",
            "--data.init_args.batch_size=2",
            "--data.init_args.val_fraction=0.2",
            "--trainer.accelerator=cpu",
            "--trainer.precision=32-true",
            "--trainer.max_steps=3",
            "--trainer.val_check_interval=3",
            "--trainer.limit_val_batches=1",
            "--logger_backend=none",
        ]
    )
    assert result.trainer.global_step == 3
    assert result.datamodule.tokenizer.name_or_path == str(checkpoint)
    metrics = result.trainer.callback_metrics
    for key in ("train/loss", "val/loss"):
        assert math.isfinite(float(metrics[key])), key


def test_vocabulary_larger_than_the_model_is_refused(corpus, tmp_path):
    from sparse_train.lightning import HFCausalLMModule

    module = HFCausalLMModule(str(_tiny_llama(tmp_path / "small", vocab_size=48)), attention="dense")
    with pytest.raises(ValueError, match="vocab_size >= 64 but the checkpoint .* has vocab_size = 48"):
        module.check_data(TextDataModule([str(corpus)], tokenizer_path=str(tmp_path / "small")))


@pytest.mark.parametrize("fork_step", [3, 9], ids=["in-epoch-0", "in-epoch-1"])
def test_mid_epoch_resume_continues_the_epoch_order(corpus, tokenizer_dir, tmp_path, fork_step):
    """A run stopped in the middle of an epoch of 7 batches (ForkPoint after 3 or 9 steps) and resumed to
    step 10 equals 10 steps straight: the resumed loader continues the interrupted epoch's row order where
    it stopped (it does not start that epoch over), and the next epoch is whole."""
    assert_mid_epoch_resume_equals_straight(
        lambda: TextDataModule(
            [str(corpus)], tokenizer_path=str(tokenizer_dir), seq_len=17, batch_size=2, val_fraction=0.2
        ),
        tmp_path,
        fork_step,
    )


def test_row_shards_skip_once_in_the_named_epoch():
    shards = RowShards(10, 1, 2, seed=3)
    shards.set_epoch(2)
    whole = list(shards)
    shards.skip_in_epoch(2, 3)
    shards.set_epoch(1)
    assert len(list(shards)) == 5  # another epoch: untouched, and the skip still waits for epoch 2
    shards.set_epoch(2)
    assert list(shards) == whole[3:]
    assert list(shards) == whole  # once
    with pytest.raises(ValueError, match="RowShards.count"):
        shards.skip_in_epoch(0, -1)
