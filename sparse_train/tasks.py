"""Training tasks as plain PyTorch data: a synthetic long-context retrieval task and byte-level language
modelling over local files. No Lightning here: the datasets and the batch sampler work with any
``torch.utils.data.DataLoader``; :mod:`sparse_train.lightning.data` wraps them in data modules.

Every sample is generated from ``(seed, index)`` alone, so a sample does not depend on the number of
dataloader workers, the batch size or what was drawn before it: runs are reproducible and validation
and test sets (different seeds from training) are fixed, held-out sets.

Samples are dicts ``{"tokens": int64 [N], "labels": int64 [N]}`` (batched: ``[B, N]``) where
``labels[t]`` is the target of the prediction made at position ``t`` and ``-100`` (``IGNORE_INDEX``)
marks positions without a loss.
"""

from __future__ import annotations

import os
import zlib
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
from torch.utils.data import Dataset, Sampler

from .validation import check_choice, check_int

__all__ = [
    "IGNORE_INDEX",
    "sample_generator",
    "check_retrieval_args",
    "RetrievalTask",
    "RetrievalDataset",
    "CurriculumStage",
    "CurriculumBatches",
    "ByteCrops",
    "default_corpus_root",
    "read_byte_corpus",
]

IGNORE_INDEX = -100


def sample_generator(seed: int, index: int) -> torch.Generator:
    """The random stream of sample ``index`` of stream ``seed``."""
    # Mix seed and index through a hash so neighbouring (seed, index) pairs give unrelated streams.
    g = torch.Generator()
    g.manual_seed(zlib.crc32(f"{seed}:{index}".encode()) * 2654435761 % (2**63 - 1))
    return g


def check_retrieval_args(owner: str, *, filler: str, **sizes: int) -> None:
    """Check the :class:`RetrievalTask` arguments; messages name ``<owner>.<argument>`` (the task or the
    data module that forwards them, whichever the user configured)."""
    for name, value in sizes.items():
        check_int(f"{owner}.{name}", value, minimum=1)
    check_choice(f"{owner}.filler", filler, ("repeat", "random"))


class RetrievalTask:
    """Multi-key passkey retrieval in a long haystack ("needles anywhere").

    Token layout of one sample of length N (inputs; targets are the sequence shifted by one)::

        BOS  filler ... (k3,v3) ... filler ... (k1,v1) ... filler   Q_k1 (k1,v1)  Q_k3 (k3,v3) ...

    ``num_pairs`` distinct keys each hide one needle token ``(k, v)`` at a uniformly random haystack
    position; the tail asks ``num_queries`` of them in random order with a query token ``Q_k``, and the
    target after ``Q_k`` is the needle token ``(k, v)``. Needle tokens use a separate id range per key
    (id = ``needle0 + k * num_values + v``), so one attention hop ("find the token of key k") retrieves
    the answer; the value ``v`` itself appears only in the needle, so without reading the needle the best
    possible accuracy is chance = ``1 / num_values``. The haystack is, as in the passkey test of
    Mohtashami & Jaggi (2023), one filler "sentence" of ``num_filler`` tokens repeated
    (``filler="repeat"``, random phase), or i.i.d. filler tokens (``filler="random"``, harder). A needle
    is its token repeated ``needle_len`` times (the passkey test states its key twice), which makes the
    needle's key block stand out in the block-pooled keys the selector scores. Only answers carry a
    loss, so accuracy is exactly the retrieval accuracy. The last query's answer is the target of the
    last input position.
    """

    PAD, BOS = 0, 1
    NUM_SPECIAL = 2

    def __init__(
        self,
        seq_len: int = 4096,
        num_pairs: int = 8,
        num_queries: int = 8,
        num_keys: int = 8,
        num_values: int = 8,
        num_filler: int = 32,
        filler: str = "repeat",
        needle_len: int = 1,
    ) -> None:
        check_retrieval_args(
            "RetrievalTask",
            seq_len=seq_len,
            num_pairs=num_pairs,
            num_queries=num_queries,
            num_keys=num_keys,
            num_values=num_values,
            num_filler=num_filler,
            filler=filler,
            needle_len=needle_len,
        )
        self.needle_len = needle_len
        self.filler = filler
        if num_queries > num_pairs:
            raise ValueError(f"num_queries={num_queries} exceeds num_pairs={num_pairs}")
        if num_pairs > num_keys:
            raise ValueError(f"num_pairs={num_pairs} needs at least as many distinct keys (num_keys={num_keys})")
        self.seq_len, self.num_pairs, self.num_queries = seq_len, num_pairs, num_queries
        self.num_keys, self.num_values, self.num_filler = num_keys, num_values, num_filler
        self.filler0 = self.NUM_SPECIAL
        self.query0 = self.filler0 + num_filler
        self.needle0 = self.query0 + num_keys
        self.vocab_size = self.needle0 + num_keys * num_values
        self.haystack_len(seq_len)  # validates the default length

    def haystack_len(self, seq_len: int) -> int:
        """Haystack positions ``1 .. haystack_len`` of a sample of length ``seq_len``."""
        hay = seq_len - 2 * self.num_queries
        if hay < self.num_pairs * self.needle_len:
            raise ValueError(f"seq_len={seq_len} too short for {self.num_pairs} needles and {self.num_queries} queries")
        return hay

    @property
    def chance(self) -> float:
        """Accuracy of guessing the value uniformly (the query reveals the key, never the value)."""
        return 1.0 / self.num_values

    def sample(self, seed: int, index: int, seq_len: int | None = None) -> dict[str, torch.Tensor]:
        """The sample ``index`` of the stream ``seed`` (pure function of its arguments)."""
        n = seq_len or self.seq_len
        hay_len = self.haystack_len(n)
        g = sample_generator(seed, index)
        if self.filler == "repeat":  # the passkey-test haystack: one filler "sentence" repeated, random phase
            phase = int(torch.randint(self.num_filler, (1,), generator=g))
            hay = self.filler0 + (torch.arange(hay_len) + phase) % self.num_filler
        else:
            hay = self.filler0 + torch.randint(self.num_filler, (hay_len,), generator=g)
        keys = torch.randperm(self.num_keys, generator=g)[: self.num_pairs]
        needles = self.needle0 + keys * self.num_values + torch.randint(self.num_values, (self.num_pairs,), generator=g)
        # Non-overlapping needle slots of needle_len tokens at uniformly random places: choose starts among
        # the free positions, then shift the i-th smallest by i * (needle_len - 1) (stars and bars).
        span = self.needle_len - 1
        starts = torch.randperm(hay_len - span * self.num_pairs, generator=g)[: self.num_pairs].sort().values
        starts = starts + span * torch.arange(self.num_pairs)
        order = torch.randperm(self.num_pairs, generator=g)  # which needle goes to which slot
        for j in range(self.needle_len):
            hay[starts + j] = needles[order]
        ask = torch.randperm(self.num_pairs, generator=g)[: self.num_queries]
        tail = torch.stack([self.query0 + keys[ask], needles[ask]], dim=1).flatten()
        seq = torch.cat([torch.tensor([self.BOS]), hay, tail])  # n + 1 tokens
        tokens = seq[:-1].clone()
        labels = torch.full_like(tokens, IGNORE_INDEX)
        query_pos = n - 2 * self.num_queries + 1 + 2 * torch.arange(self.num_queries)
        labels[query_pos] = seq[query_pos + 1]
        return {"tokens": tokens, "labels": labels}

    def needle_positions(self, tokens: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        """Where each question's answer is, for needle-block recall.

        Args:
            tokens, labels: int64 ``[B, N]`` batch of samples of this task.

        Returns:
            int64 ``[M, 3]`` rows ``(sample, query position, needle position)``: one row per copy of
            the needle that answers the question asked at ``query position`` (the labelled position).
        """
        rows = []
        for b in range(tokens.shape[0]):
            toks = tokens[b]
            hay_end = self.haystack_len(toks.shape[0]) + 1
            hay = toks[:hay_end]
            for p in (labels[b] != IGNORE_INDEX).nonzero().flatten().tolist():
                lo = self.needle0 + (int(toks[p]) - self.query0) * self.num_values
                found = ((hay >= lo) & (hay < lo + self.num_values)).nonzero().flatten()
                rows.extend((b, p, int(n)) for n in found.tolist())
        return torch.tensor(rows, dtype=torch.int64).view(-1, 3)

    def recover_answers(self, tokens: torch.Tensor, labels: torch.Tensor) -> list[int | None]:
        """Solve one sample by lookup: for each labelled (query) position, the needle token of the
        queried key found in the haystack, or ``None`` when the haystack holds no needle for it.
        Tests use it to prove the answer is recoverable from the input (and only from the needle)."""
        toks = tokens.tolist()
        hay = toks[1 : self.haystack_len(len(toks)) + 1]
        answers: list[int | None] = []
        for p in (labels != IGNORE_INDEX).nonzero().flatten().tolist():
            key = toks[p] - self.query0
            lo = self.needle0 + key * self.num_values
            found = [t for t in hay if lo <= t < lo + self.num_values]
            answers.append(found[0] if found and len(set(found)) == 1 else None)
        return answers


class RetrievalDataset(Dataset):
    """``length`` samples of a :class:`RetrievalTask` stream ``seed``; items are indices or
    ``(index, seq_len)`` pairs (curriculum)."""

    def __init__(self, task: RetrievalTask, seed: int, length: int) -> None:
        self.task, self.seed, self.length = task, seed, length

    def __len__(self) -> int:
        return self.length

    def __getitem__(self, item: int | tuple[int, int]) -> dict[str, torch.Tensor]:
        index, seq_len = item if isinstance(item, tuple) else (item, None)
        return self.task.sample(self.seed, index, seq_len)


@dataclass
class CurriculumStage:
    """One stage of a length curriculum: ``steps`` training batches of ``batch_size`` x ``seq_len``."""

    steps: int
    """Number of optimiser steps spent in this stage."""
    seq_len: int
    """Context length of the stage."""
    batch_size: int
    """Samples per batch in the stage (shorter contexts afford larger batches)."""

    def __post_init__(self) -> None:
        check_int("CurriculumStage.steps", self.steps, minimum=0)
        check_int("CurriculumStage.seq_len", self.seq_len, minimum=1)
        check_int("CurriculumStage.batch_size", self.batch_size, minimum=1)


class CurriculumBatches(Sampler):
    """Batches of ``(sample_index, seq_len)`` for :class:`RetrievalDataset`: the curriculum stages, then
    the final length until ``total_steps``. Sample indices run consecutively, so batch ``t`` is the same
    whatever the worker count. Under data parallelism each of the ``world_size`` ranks takes its own
    ``batch_size`` slice of step ``t``'s samples.

    ``start_step`` (resume): the batches already trained on, counted over epochs of ``total_steps`` batches.
    The first iteration starts at that position of its epoch; later ones are whole epochs, as in the
    uninterrupted run. The length stays the epoch's: Lightning counts the batches of a resumed epoch from the
    checkpoint's position on, so the epoch ends where the uninterrupted run's ends."""

    def __init__(
        self,
        stages: Sequence[CurriculumStage],
        final_len: int,
        final_batch: int,
        total_steps: int,
        start_step: int = 0,
        rank: int = 0,
        world_size: int = 1,
    ) -> None:
        self.rank, self.world_size = rank, world_size
        self.plan: list[tuple[int, int]] = []  # (batch_size, seq_len) per step
        for st in stages:
            self.plan.extend([(st.batch_size, st.seq_len)] * st.steps)
        self.plan = self.plan[:total_steps]
        self.plan.extend([(final_batch, final_len)] * (total_steps - len(self.plan)))
        self.start_step = start_step % len(self.plan) if self.plan else 0

    def __len__(self) -> int:
        return len(self.plan)

    def __iter__(self) -> Iterator[list[tuple[int, int]]]:
        start, self.start_step = self.start_step, 0
        first = sum(b for b, _ in self.plan[:start]) * self.world_size
        for bs, n in self.plan[start:]:
            yield [(first + self.rank * bs + i, n) for i in range(bs)]
            first += bs * self.world_size


def default_corpus_root() -> Path:
    """The Python standard library's source directory: a text corpus present on every install."""
    return Path(os.path.dirname(os.__file__))


def _corpus_files(paths: Sequence[str | os.PathLike] | None, pattern: str) -> list[Path]:
    roots = [Path(p) for p in paths] if paths else [default_corpus_root()]
    files: list[Path] = []
    for root in roots:
        if root.is_dir():
            files.extend(sorted(p for p in root.rglob(pattern) if p.is_file()))
        elif root.is_file():
            files.append(root)
        else:
            raise FileNotFoundError(f"corpus path {root} does not exist")
    if not files:
        raise FileNotFoundError(f"no files matching {pattern!r} under {roots}")
    return files


def read_byte_corpus(
    paths: Sequence[str | os.PathLike] | None, pattern: str, val_fraction: float, max_bytes: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """uint8 ``(train, validation)`` bytes of a text corpus, each file followed by a newline.

    ``paths`` are files, or directories searched recursively for ``pattern`` (sorted); ``None`` reads
    the standard library sources. Files are split by a hash of their path, so the validation text is
    never seen in training; reading stops once ``max_bytes`` are loaded; unreadable files are skipped;
    a corpus too small to hold out a file by hash gives its last file to validation. Raises
    ``FileNotFoundError`` when nothing can be read."""
    train, val, total = [], [], 0
    cut = int(val_fraction * 10_000)
    for path in _corpus_files(paths, pattern):
        try:
            data = path.read_bytes()
        except OSError:
            continue  # unreadable files (permissions, broken links) are skipped, not fatal
        (val if zlib.crc32(str(path).encode()) % 10_000 < cut else train).append(data + b"\n")
        total += len(data)
        if total >= max_bytes:
            break
    if not train and not val:
        raise FileNotFoundError(f"none of the corpus files under {paths or default_corpus_root()} could be read")
    if not val:  # tiny corpora: hold out the last file so validation still exists
        val.append(train.pop())
    return (
        torch.frombuffer(bytearray(b"".join(train)), dtype=torch.uint8),
        torch.frombuffer(bytearray(b"".join(val)), dtype=torch.uint8),
    )


class ByteCrops(Dataset):
    """``length`` fixed-length crops of a byte buffer; crop ``i`` starts at a position drawn from ``(seed, i)``."""

    def __init__(self, data: torch.Tensor, seq_len: int, seed: int, length: int) -> None:
        if data.numel() < seq_len + 2:
            raise ValueError(f"corpus of {data.numel()} bytes is shorter than seq_len={seq_len}")
        self.data, self.seq_len, self.seed, self.length = data, seq_len, seed, length

    def __len__(self) -> int:
        return self.length

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        g = sample_generator(self.seed, index)
        start = int(torch.randint(self.data.numel() - self.seq_len - 1, (1,), generator=g))
        chunk = self.data[start : start + self.seq_len + 1].long()
        return {"tokens": chunk[:-1], "labels": chunk[1:]}
