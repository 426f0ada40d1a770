"""Packed-document language modelling over local text and JSONL files, tokenized with a local Hugging Face
tokenizer (:class:`TextDataModule`).

The steps below need no Lightning and are usable on their own:

* :func:`expand_paths` and :func:`read_documents`: files, directories and glob patterns -> document
  texts (a text file is one document; a JSONL file gives one document per line, its ``text_field``).
* :func:`split_documents`: a deterministic held-out fraction of the documents, by a keyed hash of each
  document's text (so a duplicated document never sits on both sides).
* :func:`tokenize_documents`: token ids per document, with the tokenizer's own special tokens (BOS where
  its convention adds one) and one EOS at the end of every document.
* :func:`pack_documents`: best-fit-decreasing packing of documents into rows of ``seq_len`` tokens;
  documents longer than a row are first cut into ``seq_len`` pieces, and each piece is a document of
  its own from then on (masking, positions, labels). The rest of a row that no piece fits is padding.
* :class:`PackedRows`: the dataset of packed rows. :class:`RowShards`: one rank's share of them.

A row (``seq_len`` = N) is the dict the LightningModules read, the format of transformers'
``DataCollatorWithFlattening`` plus document ids:

* ``tokens`` int64 ``[N]``: the documents one after the other, then padding (the tokenizer's pad id, or
  EOS when it has none).
* ``labels`` int64 ``[N]``: ``labels[t] = tokens[t + 1]`` when both belong to the same document, else
  ``IGNORE_INDEX`` (-100): a document's last token never predicts the next document's first token, and
  padding has no loss.
* ``document_ids`` int32 ``[N]``: 0 for the row's first document, +1 at each next one (non-decreasing,
  restarting at 0 in every row); padding is one more document after the last.
* ``position_ids`` int64 ``[N]``: 0, 1, 2, ... restarting at 0 at each document (padding included).
"""

from __future__ import annotations

import bisect
import glob
import hashlib
import json
import os
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from lightning.pytorch import LightningDataModule
from lightning.pytorch.utilities import rank_zero_info
from torch.utils.data import DataLoader, Dataset

from ..tasks import IGNORE_INDEX
from ..validation import check_bool, check_float, check_int
from .context_parallel import data_parallel_rank
from .data import RowShards, _loader, skip_trained_rows

__all__ = [
    "TextDataModule",
    "PackedRows",
    "RowShards",
    "expand_paths",
    "read_documents",
    "split_documents",
    "tokenize_documents",
    "pack_documents",
    "DEFAULT_PATTERNS",
    "JSONL_SUFFIX",
]

DEFAULT_PATTERNS = ("*.txt", "*.md", "*.jsonl")
"""File name patterns searched (recursively) inside a directory given in ``paths``."""

JSONL_SUFFIX = ".jsonl"
"""Files with this suffix are read as JSON Lines; every other file as one UTF-8 text document."""

PathLike = str | os.PathLike


def expand_paths(
    paths: Sequence[PathLike], patterns: Sequence[str] = DEFAULT_PATTERNS, label: str = "paths"
) -> list[Path]:
    """The files named by ``paths``, in a deterministic order, each once.

    Each entry is a file, a directory (searched recursively for ``patterns``; sorted) or a glob pattern
    (``*``, ``?``, ``[...]``, ``**`` across directories; sorted). Entries keep their given order.
    Raises ``ValueError`` naming ``label`` and the entry when an entry matches no file."""
    files: dict[Path, None] = {}
    for entry in paths:
        path = Path(entry)
        if path.is_dir():
            found = sorted({f for pattern in patterns for f in path.rglob(pattern) if f.is_file()})
            where = f"directory {str(entry)!r} holds no file matching {list(patterns)}"
        elif path.is_file():
            found, where = [path], ""
        else:
            found = sorted(Path(f) for f in glob.glob(str(entry), recursive=True) if Path(f).is_file())
            where = f"{str(entry)!r} is neither a file, a directory nor a glob pattern matching a file"
        if not found:
            raise ValueError(f"{label}: {where}")
        files.update(dict.fromkeys(found))
    return list(files)


def read_documents(files: Sequence[PathLike], text_field: str = "text", max_documents: int | None = None) -> list[str]:
    """Document texts of ``files`` in order: a ``.jsonl`` file gives one document per non-blank line (the
    string under ``text_field`` of the line's JSON object), any other file is one UTF-8 document.
    Empty texts are skipped; reading stops after ``max_documents`` documents.

    Raises ``ValueError`` naming the file (and line) for text that is not UTF-8, a line that is not a JSON
    object, or a missing or non-string ``text_field``."""
    docs: list[str] = []
    for file in files:
        path = Path(file)
        if path.suffix.lower() == JSONL_SUFFIX:
            texts = _jsonl_texts(path, text_field)
        else:
            try:
                texts = iter([path.read_text(encoding="utf-8")])
            except UnicodeDecodeError as ex:
                raise ValueError(
                    f"{path} is not UTF-8 text ({ex.reason} at byte {ex.start}); list text or {JSONL_SUFFIX} files only"
                ) from None
        for text in texts:
            if text:
                docs.append(text)
                if max_documents is not None and len(docs) >= max_documents:
                    return docs
    return docs


def _jsonl_texts(path: Path, text_field: str) -> Iterator[str]:
    with open(path, encoding="utf-8") as fh:
        for lineno, line in enumerate(fh, 1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError as ex:
                raise ValueError(f"{path}:{lineno} is not valid JSON ({ex.msg})") from None
            if not isinstance(record, dict) or text_field not in record:
                keys = sorted(record) if isinstance(record, dict) else type(record).__name__
                raise ValueError(f"{path}:{lineno} has no {text_field!r} field (text_field); found {keys}")
            text = record[text_field]
            if not isinstance(text, str):
                raise ValueError(f"{path}:{lineno}: field {text_field!r} must be a string, got {type(text).__name__}")
            yield text


def _unit_hash(text: str, seed: int) -> float:
    # A keyed hash of the text: the split depends on the content and the seed only, not on file names,
    # reading order or where the corpus lives.
    digest = hashlib.blake2b(text.encode("utf-8"), digest_size=8, key=str(seed).encode()).digest()
    return int.from_bytes(digest, "big") / 2.0**64


def split_documents(texts: Sequence[str], val_fraction: float, seed: int) -> tuple[list[int], list[int]]:
    """``(train, validation)`` document indices (ascending): a document is held out when a hash of
    ``(seed, text)`` falls below ``val_fraction``, so identical documents always share a side. When
    ``val_fraction > 0`` and the hash holds out nothing (a tiny corpus), the document with the smallest
    hash is held out. Raises ``ValueError`` when no training document remains."""
    if val_fraction <= 0:
        return list(range(len(texts))), []
    hashes = [_unit_hash(t, seed) for t in texts]
    val = {i for i, h in enumerate(hashes) if h < val_fraction}
    if not val and texts:
        val = {min(range(len(texts)), key=hashes.__getitem__)}
    train = [i for i in range(len(texts)) if i not in val]
    if not train:
        raise ValueError(f"val_fraction={val_fraction} holds out all {len(texts)} documents; lower it or add documents")
    return train, sorted(val)


def _adds_eos(tokenizer: Any) -> bool:
    """Whether the tokenizer's own special tokens already end a text with EOS (then none is appended)."""
    with_special = tokenizer("a", add_special_tokens=True)["input_ids"]
    plain = tokenizer("a", add_special_tokens=False)["input_ids"]
    eos = tokenizer.eos_token_id
    return bool(with_special) and with_special[-1] == eos and (not plain or plain[-1] != eos)


def tokenize_documents(tokenizer: Any, texts: Sequence[str], batch_size: int = 256) -> list[torch.Tensor]:
    """int32 token ids of each text: ``tokenizer(text, add_special_tokens=True)`` (BOS where the tokenizer's
    convention adds one), followed by its EOS unless the tokenizer already appends one.
    Raises ``ValueError`` when the tokenizer has no EOS token."""
    eos = tokenizer.eos_token_id
    if eos is None:
        raise ValueError(
            f"the tokenizer ({type(tokenizer).__name__}) has no eos_token: documents could not be "
            f"terminated; use a causal-LM tokenizer"
        )
    suffix = [] if _adds_eos(tokenizer) else [eos]
    out: list[torch.Tensor] = []
    for start in range(0, len(texts), batch_size):
        # verbose=False: documents longer than the tokenizer's model_max_length are expected (they are
        # cut into seq_len pieces later), its warning about them is noise.
        ids = tokenizer(list(texts[start : start + batch_size]), add_special_tokens=True, verbose=False)["input_ids"]
        out.extend(torch.tensor(list(doc) + suffix, dtype=torch.int32) for doc in ids)
    return out


def pack_documents(lengths: Sequence[int], seq_len: int) -> list[list[tuple[int, int, int]]]:
    """Rows of ``(document, start, length)`` pieces, each row holding at most ``seq_len`` tokens.

    Documents longer than ``seq_len`` are cut into ``seq_len``-token pieces (the last one shorter); then
    pieces are placed longest first, each into the row it fills best (the fullest row with room; a new
    row if none has room). Ties keep document order, so the result is a pure function of ``lengths``
    and ``seq_len``. Inside a row, pieces are in placement order."""
    check_int("seq_len", seq_len, minimum=1)
    pieces = [(doc, start, min(seq_len, n - start)) for doc, n in enumerate(lengths) for start in range(0, n, seq_len)]
    pieces.sort(key=lambda piece: -piece[2])  # stable: equal lengths stay in document order
    rows: list[list[tuple[int, int, int]]] = []
    room: list[tuple[int, int]] = []  # (free tokens, row), ascending: bisect finds the best fit
    for piece in pieces:
        length = piece[2]
        at = bisect.bisect_left(room, (length, -1))
        if at < len(room):
            free, row = room.pop(at)
        else:
            free, row = seq_len, len(rows)
            rows.append([])
        rows[row].append(piece)
        if free > length:
            bisect.insort(room, (free - length, row))
    return rows


class PackedRows(Dataset):
    """Rows of packed documents (see the module docstring for the item format), built once in memory.

    Args:
        documents: Token ids of each document (1-D integer tensors), EOS included.
        seq_len: Tokens per row N.
        pad_id: Token id written into padding (never labelled).
    """

    def __init__(self, documents: Sequence[torch.Tensor], seq_len: int, pad_id: int) -> None:
        self.seq_len = check_int("seq_len", seq_len, minimum=1)
        self.pad_id = check_int("pad_id", pad_id, minimum=0)
        lengths = [int(d.numel()) for d in documents]
        flat = [d.to(torch.int32).flatten() for d in documents]
        self.flat = torch.cat(flat) if flat else torch.zeros(0, dtype=torch.int32)
        offsets = [0]
        for n in lengths:
            offsets.append(offsets[-1] + n)
        # A row is kept as (offset into flat, length) spans and materialised per item: the corpus is held
        # once, as int32.
        self.rows = [
            [(offsets[doc] + start, length) for doc, start, length in row]
            for row in pack_documents(lengths, self.seq_len)
        ]
        self.num_documents = len(documents)
        self.num_tokens = sum(lengths)

    def __len__(self) -> int:
        return len(self.rows)

    @property
    def padding_fraction(self) -> float:
        """Share of all row positions that are padding."""
        return 1.0 - self.num_tokens / max(1, len(self.rows) * self.seq_len)

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        n = self.seq_len
        tokens = torch.full((n,), self.pad_id, dtype=torch.int64)
        labels = torch.full((n,), IGNORE_INDEX, dtype=torch.int64)
        document_ids = torch.empty(n, dtype=torch.int32)
        position_ids = torch.empty(n, dtype=torch.int64)
        at = 0
        spans = self.rows[index]
        for doc, (offset, length) in enumerate(spans):
            piece = self.flat[offset : offset + length].long()
            tokens[at : at + length] = piece
            labels[at : at + length - 1] = piece[1:]  # the piece's last position keeps IGNORE_INDEX
            document_ids[at : at + length] = doc
            position_ids[at : at + length] = torch.arange(length)
            at += length
        document_ids[at:] = len(spans)
        position_ids[at:] = torch.arange(n - at)
        return {"tokens": tokens, "labels": labels, "document_ids": document_ids, "position_ids": position_ids}


class TextDataModule(LightningDataModule):
    """Causal-LM fine-tuning data: local text / JSONL files, a local Hugging Face tokenizer, documents packed
    into rows of ``seq_len`` tokens with document ids and restarting position ids (see the module
    docstring for the batch format), sharded across ranks.

    ``setup`` reads and tokenizes the whole corpus once and keeps it in memory as int32 (meant for
    fine-tuning sets that fit in memory; every rank does the same work and gets the same rows). Documents
    are split into training and validation by a hash of their text (:func:`split_documents`), then each
    side is packed (:func:`pack_documents`). Training visits the rows in a new order every epoch, drawn
    from ``seed`` and the epoch; validation and test read the validation rows in order. Every loader is
    sharded by :class:`RowShards` over the trainer's ranks (``torch.distributed``'s without a trainer):
    disjoint rows and the same number of batches per rank (up to ``world_size - 1`` rows of a split are
    left out of an epoch for that). Sharding is done here, so a multi-device run needs
    ``trainer.use_distributed_sampler: false`` (the recipes set it; otherwise an error says so). A run
    resumed from a mid-epoch checkpoint (``--ckpt_path``) continues that epoch's order after the rows it
    had read (from ``trainer.global_step``), so it trains on the rows the uninterrupted run would.

    Args:
        paths: Files, directories or glob patterns (``data/*.jsonl``, ``corpus/**/*.txt``) to read, in
            this order; directories are searched recursively for ``patterns``. A ``.jsonl`` file holds
            one document per line; any other file is one UTF-8 document.
        tokenizer_path: Local tokenizer directory, loaded with
            ``AutoTokenizer.from_pretrained(tokenizer_path, local_files_only=True)``. ``None`` = the
            checkpoint directory of the model being trained (``HFCausalLMModule.pretrained_path``),
            resolved when the trainer attaches this module.
        patterns: File name patterns searched for inside directories given in ``paths``.
        text_field: Key of the document text in each JSONL line.
        seq_len: Tokens per packed row N.
        batch_size: Rows per training batch (per rank).
        eval_batch_size: Rows per validation/test batch (``None`` = ``batch_size``).
        val_fraction: Approximate fraction of documents held out for validation (at least one document
            when > 0; 0 = no validation).
        seed: Seed of the validation split and of the training order.
        shuffle: Visit the training rows in a new seeded order every epoch (``False`` = packing order).
        max_documents: Stop reading after this many documents (``None`` = all); bounds memory and
            start-up time of quick runs.
        num_workers: DataLoader worker processes.
    """

    def __init__(
        self,
        paths: Sequence[str],
        tokenizer_path: str | None = None,
        patterns: Sequence[str] = DEFAULT_PATTERNS,
        text_field: str = "text",
        seq_len: int = 4096,
        batch_size: int = 1,
        eval_batch_size: int | None = None,
        val_fraction: float = 0.01,
        seed: int = 0,
        shuffle: bool = True,
        max_documents: int | None = None,
        num_workers: int = 0,
    ) -> None:
        super().__init__()
        # A bare string is a Sequence[str] too: iterating it would read one "path" per character.
        if isinstance(paths, (str, os.PathLike)):
            raise ValueError(
                f"TextDataModule.paths must be a list of files, directories or glob patterns, got "
                f"the single path {paths!r}; write [{str(paths)!r}]"
            )
        if (
            not isinstance(paths, (list, tuple))
            or not paths
            or not all(isinstance(p, (str, os.PathLike)) for p in paths)
        ):
            raise ValueError(
                f"TextDataModule.paths must be a non-empty list of files, directories or glob patterns, got {paths!r}"
            )
        if (
            isinstance(patterns, str)
            or not isinstance(patterns, (list, tuple))
            or not patterns
            or not all(isinstance(p, str) and p for p in patterns)
        ):
            raise ValueError(
                f"TextDataModule.patterns must be a non-empty list of file name patterns, got {patterns!r}"
            )
        if tokenizer_path is not None and (
            not isinstance(tokenizer_path, (str, os.PathLike)) or not os.path.isdir(tokenizer_path)
        ):
            raise ValueError(
                f"TextDataModule.tokenizer_path must be a local tokenizer directory or None, got {tokenizer_path!r}"
            )
        if not isinstance(text_field, str) or not text_field:
            raise ValueError(f"TextDataModule.text_field must be a non-empty string, got {text_field!r}")
        for name, value in (("seq_len", seq_len), ("batch_size", batch_size)):
            check_int(f"TextDataModule.{name}", value, minimum=1)
        check_int("TextDataModule.eval_batch_size", eval_batch_size, minimum=1, optional=True)
        check_int("TextDataModule.max_documents", max_documents, minimum=1, optional=True)
        check_int("TextDataModule.num_workers", num_workers, minimum=0)
        check_int("TextDataModule.seed", seed)
        check_bool("TextDataModule.shuffle", shuffle)
        check_float("TextDataModule.val_fraction", val_fraction, minimum=0.0, exclusive_maximum=1.0)
        self.save_hyperparameters()
        self.files = expand_paths(paths, patterns, label="TextDataModule.paths")
        self._tokenizer: Any = None
        self.train_rows: PackedRows | None = None
        self.val_rows: PackedRows | None = None

    # ------------------------------------------------------------------ tokenizer
    def _tokenizer_path(self) -> str | None:
        if self.hparams.tokenizer_path is not None:
            return str(self.hparams.tokenizer_path)
        module = getattr(self.trainer, "lightning_module", None) if self.trainer is not None else None
        path = getattr(module, "hparams", {}).get("pretrained_path") if module is not None else None
        return None if path is None else str(path)

    @property
    def tokenizer(self) -> Any:
        """The Hugging Face tokenizer (loaded on first use). Raises ``ValueError`` when no path is known."""
        if self._tokenizer is None:
            path = self._tokenizer_path()
            if path is None:
                raise ValueError(
                    "TextDataModule.tokenizer_path is unset and the model being trained has no "
                    "pretrained_path to take the tokenizer from; set "
                    "--data.init_args.tokenizer_path=/path/to/tokenizer"
                )
            from transformers import AutoTokenizer

            self._tokenizer = AutoTokenizer.from_pretrained(path, local_files_only=True)
        return self._tokenizer

    @property
    def vocab_size(self) -> int | None:
        """Token ids the model must accept (the tokenizer's size, added tokens included); ``None`` while the
        tokenizer path is not known yet (default path, no trainer attached)."""
        if self._tokenizer is None and self._tokenizer_path() is None:
            return None
        return len(self.tokenizer)

    # ------------------------------------------------------------------ data
    def setup(self, stage: str | None = None) -> None:
        if self.train_rows is not None:
            return
        hp = self.hparams
        tokenizer = self.tokenizer
        texts = read_documents(self.files, hp.text_field, hp.max_documents)
        if not texts:
            raise ValueError(f"TextDataModule.paths: the {len(self.files)} files hold no non-empty document")
        train, val = split_documents(texts, hp.val_fraction, hp.seed)
        pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
        self.train_rows = PackedRows(tokenize_documents(tokenizer, [texts[i] for i in train]), hp.seq_len, pad_id)
        self.val_rows = PackedRows(tokenize_documents(tokenizer, [texts[i] for i in val]), hp.seq_len, pad_id)
        rank_zero_info(
            f"[sparse-train] text data: {len(texts)} documents in {len(self.files)} files; "
            + "; ".join(
                f"{name} {rows.num_documents} documents, {rows.num_tokens} tokens -> {len(rows)} rows "
                f"x {hp.seq_len} ({rows.padding_fraction:.1%} padding)"
                for name, rows in (("train", self.train_rows), ("validation", self.val_rows))
            )
        )

    def _rank_world(self) -> tuple[int, int]:
        if self.trainer is not None:
            return data_parallel_rank(self.trainer)  # the ranks of a context-parallel group share rows
        if dist.is_available() and dist.is_initialized():
            return dist.get_rank(), dist.get_world_size()
        return 0, 1

    def _sharded_loader(self, rows: PackedRows, batch_size: int, shuffle: bool) -> DataLoader:
        rank, world = self._rank_world()
        connector = getattr(self.trainer, "_accelerator_connector", None)
        if world > 1 and getattr(connector, "use_distributed_sampler", False):
            # Lightning would wrap RowShards in its own distributed sampler and shard the shards again.
            raise ValueError(
                "TextDataModule shards rows across ranks itself: set --trainer.use_distributed_sampler=false"
            )
        sampler = RowShards(len(rows), rank, world, seed=self.hparams.seed, shuffle=shuffle)
        return _loader(rows, self.hparams.num_workers, batch_size=batch_size, sampler=sampler)

    def train_dataloader(self) -> DataLoader:
        self.setup()
        loader = self._sharded_loader(self.train_rows, self.hparams.batch_size, self.hparams.shuffle)
        skip_trained_rows(self.trainer, loader, self.hparams.batch_size)
        return loader

    def val_dataloader(self) -> DataLoader | list:
        self.setup()
        if len(self.val_rows) == 0:
            return []  # val_fraction = 0: Lightning skips validation
        return self._sharded_loader(self.val_rows, self.hparams.eval_batch_size or self.hparams.batch_size, False)

    def test_dataloader(self) -> DataLoader | list:
        return self.val_dataloader()
