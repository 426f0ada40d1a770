"""Lightning data modules over the tasks of :mod:`sparse_train.tasks` (retrieval, byte-level LM).

The samples, datasets and the curriculum batch sampler live in :mod:`sparse_train.tasks`, which does
not import Lightning; this module adds what Lightning needs: data loaders per stage, the trainer's step
count and rank for the training stream, and the data facts the LightningModule reads (``vocab_size``,
``chance``, ``needle_positions``). Batches are dicts ``{"tokens": int64 [B, N], "labels": int64 [B, N]}``
(``-100`` = no loss).
"""

from __future__ import annotations

import os
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import torch
from lightning.pytorch import LightningDataModule
from torch.utils.data import DataLoader, Dataset, Sampler

from ..tasks import (
    IGNORE_INDEX,
    ByteCrops,
    CurriculumBatches,
    CurriculumStage,
    RetrievalDataset,
    RetrievalTask,
    check_retrieval_args,
    default_corpus_root,
    read_byte_corpus,
    sample_generator,
)
from ..validation import check_bool, check_float, check_int, check_keys
from .context_parallel import data_parallel_rank

# The task-side names stay importable from here (the path they had before sparse_train.tasks existed).
__all__ = [
    "RetrievalDataModule",
    "ByteLMDataModule",
    "RetrievalTask",
    "RetrievalDataset",
    "CurriculumStage",
    "default_corpus_root",
    "IGNORE_INDEX",
    "RowShards",
    "skip_trained_rows",
]


def _loader(dataset: Dataset, num_workers: int, **kwargs: Any) -> DataLoader:
    # Workers, when there are any, persist across epochs: no re-spawn for every validation run.
    return DataLoader(dataset, num_workers=num_workers, persistent_workers=num_workers > 0, **kwargs)


class RowShards(Sampler[int]):
    """The row indices rank ``rank`` of ``world_size`` reads, one epoch at a time.

    Each epoch orders all rows (a permutation drawn from ``(seed, epoch)`` when ``shuffle``, else
    ascending), drops the last ``num_rows % world_size`` of that order, and gives rank ``r`` the
    positions ``r, r + world_size, ...``: the ranks' rows are disjoint, every rank gets
    ``num_rows // world_size`` of them (DDP/FSDP need the same number of batches everywhere), and with a
    shuffle the dropped rows change from epoch to epoch. Lightning calls :meth:`set_epoch`.
    """

    def __init__(self, num_rows: int, rank: int, world_size: int, seed: int = 0, shuffle: bool = True) -> None:
        check_int("RowShards.world_size", world_size, minimum=1)
        check_int("RowShards.rank", rank, minimum=0, maximum=world_size - 1)
        check_int("RowShards.num_rows", num_rows, minimum=0)
        if num_rows < world_size:
            raise ValueError(
                f"RowShards: {num_rows} rows cannot give each of {world_size} ranks a row; add "
                f"documents, lower seq_len or use fewer devices"
            )
        self.num_rows, self.rank, self.world_size = num_rows, rank, world_size
        self.seed = check_int("RowShards.seed", seed)
        self.shuffle = check_bool("RowShards.shuffle", shuffle)
        self.epoch = 0
        self._skip: tuple[int, int] | None = None

    def set_epoch(self, epoch: int) -> None:
        """Select the epoch whose order :meth:`__iter__` yields."""
        self.epoch = int(epoch)

    def skip_in_epoch(self, epoch: int, count: int) -> None:
        """Leave out the first ``count`` of this rank's rows the next time epoch ``epoch`` is iterated, once:
        a run resumed in the middle of an epoch continues that epoch's order where it stopped, instead of
        reading its first rows again; later epochs are whole."""
        self._skip = (check_int("RowShards.epoch", epoch, minimum=0), check_int("RowShards.count", count, minimum=0))

    def __len__(self) -> int:
        return self.num_rows // self.world_size

    def __iter__(self) -> Iterator[int]:
        skip = 0
        if self._skip is not None and self._skip[0] == self.epoch:
            skip, self._skip = self._skip[1], None
        kept = len(self) * self.world_size
        if not self.shuffle:  # ascending: a range, however many rows (a byte-LM stream has millions)
            return iter(range(self.rank + skip * self.world_size, kept, self.world_size))
        order = torch.randperm(self.num_rows, generator=sample_generator(self.seed, self.epoch))
        return iter(order[self.rank : kept : self.world_size][skip:].tolist())


def skip_trained_rows(trainer: Any, loader: DataLoader, batch_size: int) -> None:
    """On a resumed run (``trainer.global_step > 0``), make ``loader``'s :class:`RowShards` sampler leave out the rows
    of the interrupted epoch that were trained before the checkpoint: Lightning restarts that epoch's loader from
    its first batch. The step count says how many (every epoch has the same number of batches, fewer with
    ``limit_train_batches``, as Lightning counts them)."""
    if trainer is None or getattr(trainer, "global_step", 0) <= 0:
        return
    per_epoch = len(loader)
    limit = getattr(trainer, "limit_train_batches", 1.0)
    if isinstance(limit, int):
        per_epoch = min(per_epoch, limit)
    elif isinstance(limit, float) and limit < 1.0:
        per_epoch = int(per_epoch * limit)
    accumulate = max(1, int(getattr(trainer, "accumulate_grad_batches", 1)))
    done = trainer.global_step * accumulate
    if per_epoch > 0:
        loader.sampler.skip_in_epoch(done // per_epoch, (done % per_epoch) * batch_size)


class RetrievalDataModule(LightningDataModule):
    """Synthetic long-context retrieval (see :class:`RetrievalTask`), generated on the fly.

    Training can follow a length curriculum (``curriculum``): content retrieval is learned in a few
    hundred steps at short length, where a needle gets a large share of the initial uniform attention,
    and then carries over to long contexts; from scratch at 4K the gradient reaching the needle is
    ~1/4096 of the attention and learning stalls. After the stages, training continues at ``seq_len``.
    Validation and test always use ``seq_len``. The training batches are rank-aware already (one slice of
    each step's samples per data-parallel replica): with a multi-GPU strategy pass
    ``--trainer.use_distributed_sampler=false``. Every replica evaluates the whole validation and test sets.

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
        batch_size: int = 8,
        eval_batch_size: int | None = None,
        curriculum: list[CurriculumStage] | None = None,
        train_seed: int = 0,
        val_seed: int = 1,
        test_seed: int = 2,
        train_steps: int = 1000,
        val_samples: int = 128,
        test_samples: int = 256,
        num_workers: int = 0,
    ) -> None:
        super().__init__()
        for name, value in (("batch_size", batch_size), ("train_steps", train_steps)):
            check_int(f"RetrievalDataModule.{name}", value, minimum=1)
        check_int("RetrievalDataModule.eval_batch_size", eval_batch_size, minimum=1, optional=True)
        for name, value in (("val_samples", val_samples), ("test_samples", test_samples), ("num_workers", num_workers)):
            check_int(f"RetrievalDataModule.{name}", value, minimum=0)
        for name, value in (("train_seed", train_seed), ("val_seed", val_seed), ("test_seed", test_seed)):
            check_int(f"RetrievalDataModule.{name}", value)
        check_retrieval_args(
            "RetrievalDataModule",
            seq_len=seq_len,
            num_pairs=num_pairs,
            num_queries=num_queries,
            num_keys=num_keys,
            num_values=num_values,
            num_filler=num_filler,
            filler=filler,
            needle_len=needle_len,
        )
        if len({train_seed, val_seed, test_seed}) != 3:
            raise ValueError("train_seed, val_seed and test_seed must differ so evaluation is held out")
        self.save_hyperparameters()
        self.task = RetrievalTask(seq_len, num_pairs, num_queries, num_keys, num_values, num_filler, filler, needle_len)
        self.curriculum = [self._stage(i, c) for i, c in enumerate(curriculum or [])]
        for c in self.curriculum:
            self.task.haystack_len(c.seq_len)

    @staticmethod
    def _stage(i: int, stage: CurriculumStage | dict) -> CurriculumStage:
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
        rank, world = data_parallel_rank(self.trainer)  # the ranks of a context-parallel group share rows
        sampler = CurriculumBatches(
            self.curriculum, self.hparams.seq_len, self.hparams.batch_size, total, start, rank, world
        )
        return _loader(
            RetrievalDataset(self.task, self.hparams.train_seed, 0), self.hparams.num_workers, batch_sampler=sampler
        )

    def _eval_loader(self, seed: int, length: int) -> DataLoader:
        return _loader(
            RetrievalDataset(self.task, seed, length),
            self.hparams.num_workers,
            batch_size=self.hparams.eval_batch_size or self.hparams.batch_size,
        )

    def val_dataloader(self) -> DataLoader:
        return self._eval_loader(self.hparams.val_seed, self.hparams.val_samples)

    def test_dataloader(self) -> DataLoader:
        return self._eval_loader(self.hparams.test_seed, self.hparams.test_samples)


class ByteLMDataModule(LightningDataModule):
    """Byte-level language modelling over local text files (vocabulary 256, no tokenizer, no download).

    Files are split into train and validation by a hash of their path, so the validation text is never
    seen in training. With no ``paths`` the corpus is the Python standard library's ``.py`` sources.
    Several ranks without Lightning's distributed sampler (``--cp``) split the training crops by
    data-parallel replica; every replica evaluates the whole validation set. A run resumed in the middle of an
    epoch continues that epoch's crops (under Lightning's distributed sampler the epoch starts over).

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

    def __init__(
        self,
        paths: Sequence[str] | None = None,
        pattern: str = "*.py",
        seq_len: int = 1024,
        batch_size: int = 8,
        val_fraction: float = 0.05,
        max_bytes: int = 32_000_000,
        seed: int = 0,
        train_samples: int = 10_000_000,
        val_samples: int = 64,
        num_workers: int = 0,
    ) -> None:
        super().__init__()
        # A bare string is a Sequence[str] too: iterating it would read one "path" per character.
        if isinstance(paths, (str, os.PathLike)):
            raise ValueError(
                f"ByteLMDataModule.paths must be a list of files or directories, got the single path "
                f"{paths!r}; write [{str(paths)!r}]"
            )
        if paths is not None and (
            not isinstance(paths, (list, tuple)) or not all(isinstance(p, (str, os.PathLike)) for p in paths)
        ):
            raise ValueError(f"ByteLMDataModule.paths must be a list of files or directories or None, got {paths!r}")
        missing = [str(p) for p in paths or [] if not Path(p).exists()]
        if missing:
            raise ValueError(f"ByteLMDataModule.paths: {', '.join(map(repr, missing))} does not exist")
        for name, value in (
            ("seq_len", seq_len),
            ("batch_size", batch_size),
            ("max_bytes", max_bytes),
            ("train_samples", train_samples),
        ):
            check_int(f"ByteLMDataModule.{name}", value, minimum=1)
        for name, value in (("val_samples", val_samples), ("num_workers", num_workers)):
            check_int(f"ByteLMDataModule.{name}", value, minimum=0)
        check_int("ByteLMDataModule.seed", seed)
        check_float("ByteLMDataModule.val_fraction", val_fraction, minimum=0.0, exclusive_maximum=1.0)
        self.save_hyperparameters()
        self.train_bytes: torch.Tensor | None = None
        self.val_bytes: torch.Tensor | None = None

    def setup(self, stage: str | None = None) -> None:
        if self.train_bytes is None:
            self.train_bytes, self.val_bytes = read_byte_corpus(
                self.hparams.paths, self.hparams.pattern, self.hparams.val_fraction, self.hparams.max_bytes
            )

    def _crops_loader(self, data: torch.Tensor, seed: int, length: int) -> DataLoader:
        return _loader(
            ByteCrops(data, self.hparams.seq_len, seed, length),
            self.hparams.num_workers,
            batch_size=self.hparams.batch_size,
        )

    def train_dataloader(self) -> DataLoader:
        crops = ByteCrops(self.train_bytes, self.hparams.seq_len, self.hparams.seed, self.hparams.train_samples)
        rank, world = data_parallel_rank(self.trainer)  # the ranks of a context-parallel group share rows
        connector = getattr(self.trainer, "_accelerator_connector", None)
        if world > 1 and getattr(connector, "use_distributed_sampler", True):
            # Lightning's distributed sampler shards the crops (a resumed run reads its epoch from the start)
            return _loader(crops, self.hparams.num_workers, batch_size=self.hparams.batch_size)
        # one process, or replicas without Lightning's sampler (context parallelism refuses it): replica r takes
        # crops r, r + world, ..., the same number on every replica (DDP steps together); a resumed run continues
        # the interrupted epoch's crops where it stopped
        sampler = RowShards(len(crops), rank, world, seed=self.hparams.seed, shuffle=False)
        loader = _loader(crops, self.hparams.num_workers, batch_size=self.hparams.batch_size, sampler=sampler)
        skip_trained_rows(self.trainer, loader, self.hparams.batch_size)
        return loader

    def val_dataloader(self) -> DataLoader:
        return self._crops_loader(self.val_bytes, self.hparams.seed + 1, self.hparams.val_samples)

    def test_dataloader(self) -> DataLoader:
        return self.val_dataloader()
