"""Data modules: a synthetic long-context retrieval task and byte-level language modelling.

Both generate every sample from ``(seed, index)`` alone, so a sample does not depend on the number of
dataloader workers, the batch size or what was drawn before it: runs are reproducible and validation
and test sets (different seeds from training) are fixed, held-out sets.

Batches are dicts ``{"tokens": int64 [B, N], "labels": int64 [B, N]}`` where ``labels[:, t]`` is the
target for the prediction made at position ``t`` and ``-100`` marks positions without a loss.
"""

from __future__ import annotations

import os
import zlib
from pathlib import Path
from dataclasses import dataclass
from typing import Iterator, Optional, Sequence, Union

import torch
from lightning.pytorch import LightningDataModule
from torch.utils.data import DataLoader, Dataset, Sampler

from ..validation import check_choice, check_float, check_int, check_keys

__all__ = ["RetrievalTask", "RetrievalDataset", "RetrievalDataModule", "CurriculumStage", "ByteLMDataModule",
           "default_corpus_root", "IGNORE_INDEX"]

IGNORE_INDEX = -100


def _generator(seed: int, index: int) -> torch.Generator:
    # Mix seed and index through a hash so neighbouring (seed, index) pairs give unrelated streams.
    g = torch.Generator()
    g.manual_seed(zlib.crc32(f"{seed}:{index}".encode()) * 2654435761 % (2**63 - 1))
    return g


def _check_task_args(owner: str, *, filler: str, **sizes: int) -> None:
    # Shared by RetrievalTask and RetrievalDataModule so the message names the class the user configured.
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

    def __init__(self, seq_len: int = 4096, num_pairs: int = 8, num_queries: int = 8, num_keys: int = 8,
                 num_values: int = 8, num_filler: int = 32, filler: str = "repeat", needle_len: int = 1) -> None:
        _check_task_args("RetrievalTask", seq_len=seq_len, num_pairs=num_pairs, num_queries=num_queries,
                         num_keys=num_keys, num_values=num_values, num_filler=num_filler, filler=filler,
                         needle_len=needle_len)
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
            raise ValueError(f"seq_len={seq_len} too short for {self.num_pairs} needles and "
                             f"{self.num_queries} queries")
        return hay

    @property
    def chance(self) -> float:
        """Accuracy of guessing the value uniformly (the query reveals the key, never the value)."""
        return 1.0 / self.num_values

    def sample(self, seed: int, index: int, seq_len: Optional[int] = None) -> dict[str, torch.Tensor]:
        """The sample ``index`` of the stream ``seed`` (pure function of its arguments)."""
        n = seq_len or self.seq_len
        hay_len = self.haystack_len(n)
        g = _generator(seed, index)
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

    def recover_answers(self, tokens: torch.Tensor, labels: torch.Tensor) -> list[Optional[int]]:
        """Solve one sample by lookup: for each labelled (query) position, the needle token of the
        queried key found in the haystack, or ``None`` when the haystack holds no needle for it.
        Tests use it to prove the answer is recoverable from the input (and only from the needle)."""
        toks = tokens.tolist()
        hay = toks[1: self.haystack_len(len(toks)) + 1]
        answers: list[Optional[int]] = []
        for p in (labels != IGNORE_INDEX).nonzero().flatten().tolist():
            key = toks[p] - self.query0
            lo = self.needle0 + key * self.num_values
            found = [t for t in hay if lo <= t < lo + self.num_values]
            answers.append(found[0] if found and len(set(found)) == 1 else None)
        return answers


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


class _CurriculumBatches(Sampler):
    """Batches of ``(sample_index, seq_len)``: the curriculum stages, then the final length until
    ``total_steps``. Sample indices run consecutively, so batch ``t`` is the same whatever the worker
    count; ``start_step`` skips the batches already trained on (resume). Under data parallelism each of
    the ``world_size`` ranks takes its own ``batch_size`` slice of step ``t``'s samples."""

    def __init__(self, stages: Sequence[CurriculumStage], final_len: int, final_batch: int, total_steps: int,
                 start_step: int = 0, rank: int = 0, world_size: int = 1) -> None:
        self.rank, self.world_size = rank, world_size
        self.plan: list[tuple[int, int]] = []  # (batch_size, seq_len) per step
        for st in stages:
            self.plan.extend([(st.batch_size, st.seq_len)] * st.steps)
        self.plan = self.plan[:total_steps]
        self.plan.extend([(final_batch, final_len)] * (total_steps - len(self.plan)))
        self.start_step = min(start_step, len(self.plan))

    def __len__(self) -> int:
        return len(self.plan) - self.start_step

    def __iter__(self) -> Iterator[list[tuple[int, int]]]:
        first = sum(b for b, _ in self.plan[: self.start_step]) * self.world_size
        for bs, n in self.plan[self.start_step:]:
            yield [(first + self.rank * bs + i, n) for i in range(bs)]
            first += bs * self.world_size


class RetrievalDataset(Dataset):
    """``length`` samples of a :class:`RetrievalTask` stream ``seed``; items are indices or
    ``(index, seq_len)`` pairs (curriculum)."""

    def __init__(self, task: RetrievalTask, seed: int, length: int) -> None:
        self.task, self.seed, self.length = task, seed, length

    def __len__(self) -> int:
        return self.length

    def __getitem__(self, item: Union[int, tuple[int, int]]) -> dict[str, torch.Tensor]:
        index, seq_len = item if isinstance(item, tuple) else (item, None)
        return self.task.sample(self.seed, index, seq_len)


class RetrievalDataModule(LightningDataModule):
    """Synthetic long-context retrieval (see :class:`RetrievalTask`), generated on the fly.

    Training can follow a length curriculum (``curriculum``): content retrieval is learned in a few
    hundred steps at short length, where a needle gets a large share of the initial uniform attention,
    and then carries over to long contexts; from scratch at 4K the gradient reaching the needle is
    ~1/4096 of the attention and learning stalls. After the stages, training continues at ``seq_len``.
    Validation and test always use ``seq_len``. The training batches are rank-aware already: with a
    multi-GPU strategy pass ``--trainer.use_distributed_sampler=false``.

    Args:
        seq_len: Evaluation context length N (and training length after the curriculum).
        num_pairs: Needles (distinct keys) hidden in each haystack.
        num_queries: How many of them are asked at the end (each is one scored answer).
        num_keys: Size of the key alphabet.
        num_values: Values per key; chance accuracy is ``1 / num_values``.
        num_filler: Size of the filler alphabet (the period of the repeated filler).
        filler: ``repeat`` (a repeated filler sentence, as in the passkey test) or ``random`` (i.i.d.).
        needle_len: Consecutive copies of each needle token.
        batch_size: Samples per training batch at ``seq_len``.
        eval_batch_size: Samples per validation/test batch (``None`` = ``batch_size``).
        curriculum: Length stages run before training at ``seq_len`` (empty = none).
        train_seed: Seed of the training stream.
        val_seed: Seed of the held-out validation set (must differ from ``train_seed``).
        test_seed: Seed of the held-out test set.
        train_steps: Training batches when ``trainer.max_steps`` is unset.
        val_samples: Size of the validation set.
        test_samples: Size of the test set.
        num_workers: DataLoader worker processes (0 generates in the training process).
    """

    def __init__(self, seq_len: int = 4096, num_pairs: int = 8, num_queries: int = 8, num_keys: int = 8,
                 num_values: int = 8, num_filler: int = 32, filler: str = "repeat", needle_len: int = 1, batch_size: int = 8,
                 eval_batch_size: Optional[int] = None, curriculum: Optional[list[CurriculumStage]] = None,
                 train_seed: int = 0, val_seed: int = 1, test_seed: int = 2, train_steps: int = 1000,
                 val_samples: int = 128, test_samples: int = 256, num_workers: int = 0) -> None:
        super().__init__()
        for name, value in (("batch_size", batch_size), ("train_steps", train_steps)):
            check_int(f"RetrievalDataModule.{name}", value, minimum=1)
        check_int("RetrievalDataModule.eval_batch_size", eval_batch_size, minimum=1, optional=True)
        for name, value in (("val_samples", val_samples), ("test_samples", test_samples), ("num_workers", num_workers)):
            check_int(f"RetrievalDataModule.{name}", value, minimum=0)
        for name, value in (("train_seed", train_seed), ("val_seed", val_seed), ("test_seed", test_seed)):
            check_int(f"RetrievalDataModule.{name}", value)
        _check_task_args("RetrievalDataModule", seq_len=seq_len, num_pairs=num_pairs, num_queries=num_queries,
                         num_keys=num_keys, num_values=num_values, num_filler=num_filler, filler=filler,
                         needle_len=needle_len)
        if len({train_seed, val_seed, test_seed}) != 3:
            raise ValueError("train_seed, val_seed and test_seed must differ so evaluation is held out")
        self.save_hyperparameters()
        self.task = RetrievalTask(seq_len, num_pairs, num_queries, num_keys, num_values, num_filler, filler,
                                  needle_len)
        self.curriculum = [self._stage(i, c) for i, c in enumerate(curriculum or [])]
        for c in self.curriculum:
            self.task.haystack_len(c.seq_len)

    @staticmethod
    def _stage(i: int, stage: Union[CurriculumStage, dict]) -> CurriculumStage:
        if isinstance(stage, CurriculumStage):
            return stage
        check_keys(f"RetrievalDataModule.curriculum[{i}]", stage, CurriculumStage.__dataclass_fields__)
        missing = [k for k in CurriculumStage.__dataclass_fields__ if k not in stage]
        if missing:
            raise ValueError(f"RetrievalDataModule.curriculum[{i}] lacks {', '.join(missing)}, got {stage!r}")
        return CurriculumStage(**stage)

    @property
    def vocab_size(self) -> int:
        """Token ids the model must accept."""
        return self.task.vocab_size

    @property
    def chance(self) -> float:
        """Accuracy of guessing."""
        return self.task.chance

    def needle_positions(self, tokens: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        """``(sample, query position, needle position)`` rows of a batch (:meth:`RetrievalTask.needle_positions`)."""
        return self.task.needle_positions(tokens, labels)

    def _trainer_steps(self) -> tuple[int, int]:
        trainer = self.trainer
        total = self.hparams.train_steps
        start = 0
        if trainer is not None:
            accum = max(1, int(getattr(trainer, "accumulate_grad_batches", 1)))
            if trainer.max_steps and trainer.max_steps > 0:
                total = trainer.max_steps * accum
            start = trainer.global_step * accum
        return total, start

    def train_dataloader(self) -> DataLoader:
        total, start = self._trainer_steps()
        rank, world = (self.trainer.global_rank, self.trainer.world_size) if self.trainer is not None else (0, 1)
        sampler = _CurriculumBatches(self.curriculum, self.hparams.seq_len, self.hparams.batch_size, total, start,
                                     rank, world)
        return DataLoader(RetrievalDataset(self.task, self.hparams.train_seed, 0), batch_sampler=sampler,
                          num_workers=self.hparams.num_workers, persistent_workers=self.hparams.num_workers > 0)

    def _eval_loader(self, seed: int, length: int) -> DataLoader:
        return DataLoader(RetrievalDataset(self.task, seed, length),
                          batch_size=self.hparams.eval_batch_size or self.hparams.batch_size,
                          num_workers=self.hparams.num_workers, persistent_workers=self.hparams.num_workers > 0)

    def val_dataloader(self) -> DataLoader:
        return self._eval_loader(self.hparams.val_seed, self.hparams.val_samples)

    def test_dataloader(self) -> DataLoader:
        return self._eval_loader(self.hparams.test_seed, self.hparams.test_samples)


def default_corpus_root() -> Path:
    """The Python standard library's source directory: a text corpus present on every install."""
    return Path(os.path.dirname(os.__file__))


class _ByteCrops(Dataset):
    """Fixed-length crops of a byte buffer; crop ``i`` starts at a position drawn from ``(seed, i)``."""

    def __init__(self, data: torch.Tensor, seq_len: int, seed: int, length: int) -> None:
        if data.numel() < seq_len + 2:
            raise ValueError(f"corpus of {data.numel()} bytes is shorter than seq_len={seq_len}")
        self.data, self.seq_len, self.seed, self.length = data, seq_len, seed, length

    def __len__(self) -> int:
        return self.length

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        g = _generator(self.seed, index)
        start = int(torch.randint(self.data.numel() - self.seq_len - 1, (1,), generator=g))
        chunk = self.data[start: start + self.seq_len + 1].long()
        return {"tokens": chunk[:-1], "labels": chunk[1:]}


class ByteLMDataModule(LightningDataModule):
    """Byte-level language modelling over local text files (vocabulary 256, no tokenizer, no download).

    Files are split into train and validation by a hash of their path, so the validation text is never
    seen in training. With no ``paths`` the corpus is the Python standard library's ``.py`` sources.

    Args:
        paths: Files or directories to read (directories are searched recursively with ``pattern``);
            ``None`` uses the standard library sources.
        pattern: Glob for files inside directories.
        seq_len: Context length in bytes.
        batch_size: Crops per batch.
        val_fraction: Approximate fraction of files held out for validation.
        max_bytes: Stop reading files once this many bytes are loaded (bounds memory and start-up time).
        seed: Seed of the training crops; validation uses ``seed + 1``.
        train_samples: Length of the training stream (training is bounded by ``trainer.max_steps``).
        val_samples: Number of validation crops.
        num_workers: DataLoader worker processes.
    """

    vocab_size = 256

    def __init__(self, paths: Optional[Sequence[str]] = None, pattern: str = "*.py", seq_len: int = 1024,
                 batch_size: int = 8, val_fraction: float = 0.05, max_bytes: int = 32_000_000, seed: int = 0,
                 train_samples: int = 10_000_000, val_samples: int = 64, num_workers: int = 0) -> None:
        super().__init__()
        # A bare string is a Sequence[str] too: iterating it would read one "path" per character.
        if isinstance(paths, (str, os.PathLike)):
            raise ValueError(f"ByteLMDataModule.paths must be a list of files or directories, got the single path "
                             f"{paths!r}; write [{str(paths)!r}]")
        if paths is not None and (not isinstance(paths, (list, tuple))
                                  or not all(isinstance(p, (str, os.PathLike)) for p in paths)):
            raise ValueError(f"ByteLMDataModule.paths must be a list of files or directories or None, got {paths!r}")
        missing = [str(p) for p in paths or [] if not Path(p).exists()]
        if missing:
            raise ValueError(f"ByteLMDataModule.paths: {', '.join(map(repr, missing))} does not exist")
        for name, value in (("seq_len", seq_len), ("batch_size", batch_size), ("max_bytes", max_bytes),
                            ("train_samples", train_samples)):
            check_int(f"ByteLMDataModule.{name}", value, minimum=1)
        for name, value in (("val_samples", val_samples), ("num_workers", num_workers)):
            check_int(f"ByteLMDataModule.{name}", value, minimum=0)
        check_int("ByteLMDataModule.seed", seed)
        check_float("ByteLMDataModule.val_fraction", val_fraction, minimum=0.0, exclusive_maximum=1.0)
        self.save_hyperparameters()
        self.train_bytes: Optional[torch.Tensor] = None
        self.val_bytes: Optional[torch.Tensor] = None

    def _files(self) -> list[Path]:
        roots = [Path(p) for p in self.hparams.paths] if self.hparams.paths else [default_corpus_root()]
        files: list[Path] = []
        for root in roots:
            if root.is_dir():
                files.extend(sorted(p for p in root.rglob(self.hparams.pattern) if p.is_file()))
            elif root.is_file():
                files.append(root)
            else:
                raise FileNotFoundError(f"corpus path {root} does not exist")
        if not files:
            raise FileNotFoundError(f"no files matching {self.hparams.pattern!r} under {roots}")
        return files

    def setup(self, stage: Optional[str] = None) -> None:
        if self.train_bytes is not None:
            return
        train, val, total = [], [], 0
        cut = int(self.hparams.val_fraction * 10_000)
        for path in self._files():
            try:
                data = path.read_bytes()
            except OSError:
                continue  # unreadable files (permissions, broken links) are skipped, not fatal
            (val if zlib.crc32(str(path).encode()) % 10_000 < cut else train).append(data + b"\n")
            total += len(data)
            if total >= self.hparams.max_bytes:
                break
        if not train and not val:
            raise FileNotFoundError(f"none of the corpus files under {self.hparams.paths or default_corpus_root()} "
                                    "could be read")
        if not val:  # tiny corpora: hold out the last file so validation still exists
            val.append(train.pop())
        self.train_bytes = torch.frombuffer(bytearray(b"".join(train)), dtype=torch.uint8)
        self.val_bytes = torch.frombuffer(bytearray(b"".join(val)), dtype=torch.uint8)

    def _loader(self, data: torch.Tensor, seed: int, length: int) -> DataLoader:
        return DataLoader(_ByteCrops(data, self.hparams.seq_len, seed, length), batch_size=self.hparams.batch_size,
                          num_workers=self.hparams.num_workers, persistent_workers=self.hparams.num_workers > 0)

    def train_dataloader(self) -> DataLoader:
        return self._loader(self.train_bytes, self.hparams.seed, self.hparams.train_samples)

    def val_dataloader(self) -> DataLoader:
        return self._loader(self.val_bytes, self.hparams.seed + 1, self.hparams.val_samples)

    def test_dataloader(self) -> DataLoader:
        return self.val_dataloader()
