"""The training tasks of :mod:`sparse_train.tasks` without Lightning: retrieval samples are deterministic,
seeded and answerable only from their needles; the curriculum sampler resumes and shards exactly; the
module imports without Lightning installed."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch

from sparse_train.tasks import IGNORE_INDEX, CurriculumBatches, CurriculumStage, RetrievalTask

REPO = Path(__file__).resolve().parents[1]


def test_tasks_import_without_lightning():
    """A finder that refuses ``lightning`` (as if it were not installed): sparse_train.tasks must import."""
    code = (
        "import sys\n"
        "class NoLightning:\n"
        "    def find_spec(self, name, path=None, target=None):\n"
        "        if name.split('.')[0] in ('lightning', 'pytorch_lightning'):\n"
        "            raise ImportError('lightning is blocked')\n"
        "sys.meta_path.insert(0, NoLightning())\n"
        "from sparse_train.tasks import RetrievalTask\n"
        "print(RetrievalTask(seq_len=64, num_pairs=2, num_queries=2, num_keys=2).sample(0, 0)['tokens'].shape)\n"
    )
    proc = subprocess.run(
        [sys.executable, "-c", code],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
        env={"PYTHONPATH": str(REPO), "PATH": "/usr/bin:/bin"},
    )
    assert proc.returncode == 0, proc.stderr
    assert "torch.Size([64])" in proc.stdout


def test_retrieval_samples_are_deterministic_and_seeded():
    task = RetrievalTask(seq_len=300, num_pairs=4, num_queries=3, num_keys=6, num_values=8)
    a, b = task.sample(0, 7), task.sample(0, 7)
    assert torch.equal(a["tokens"], b["tokens"]) and torch.equal(a["labels"], b["labels"])
    assert not torch.equal(task.sample(0, 8)["tokens"], a["tokens"])
    assert not torch.equal(task.sample(1, 7)["tokens"], a["tokens"])  # validation seed != training seed
    assert a["tokens"].shape == (300,) and int(a["tokens"].max()) < task.vocab_size


@pytest.mark.parametrize("filler", ["repeat", "random"])
def test_retrieval_answer_is_in_the_needle_and_only_there(filler):
    task = RetrievalTask(seq_len=257, num_pairs=5, num_queries=4, num_keys=8, num_values=8, filler=filler)
    for index in range(20):
        s = task.sample(3, index)
        tokens, labels = s["tokens"], s["labels"]
        answers = labels[labels != IGNORE_INDEX]
        assert len(answers) == 4
        assert task.recover_answers(tokens, labels) == answers.tolist()
        # The answer appears exactly once before its question: in the needle (never in the filler).
        first_query = int((labels != IGNORE_INDEX).nonzero()[0])
        for ans in answers.tolist():
            assert int((tokens[:first_query] == ans).sum()) == 1
        # Remove the needles: the lookup finds nothing, so the labels really depend on them.
        hay = tokens.clone()
        hay[1 : task.haystack_len(257) + 1][hay[1 : task.haystack_len(257) + 1] >= task.needle0] = task.filler0
        assert task.recover_answers(hay, labels) == [None] * 4


@pytest.mark.parametrize("needle_len", [1, 3], ids=["single-token", "three-tokens"])
def test_needle_positions_point_at_the_answers(needle_len):
    task = RetrievalTask(
        seq_len=300, num_pairs=5, num_queries=3, num_keys=8, num_values=8, filler="random", needle_len=needle_len
    )
    batch = [task.sample(4, i) for i in range(3)]
    tokens = torch.stack([b["tokens"] for b in batch])
    labels = torch.stack([b["labels"] for b in batch])
    pairs = task.needle_positions(tokens, labels)
    assert pairs.shape == (3 * 3 * needle_len, 3)
    for b, query_pos, needle_pos in pairs.tolist():
        assert labels[b, query_pos] != IGNORE_INDEX and tokens[b, needle_pos] == labels[b, query_pos]
        assert needle_pos < query_pos


def test_needles_cover_the_whole_context():
    task = RetrievalTask(seq_len=512, num_pairs=4, num_queries=4, num_keys=4, num_values=8)
    positions = []
    for index in range(200):
        toks = task.sample(0, index)["tokens"][: task.haystack_len(512) + 1]
        positions += (toks >= task.needle0).nonzero().flatten().tolist()
    assert min(positions) < 20 and max(positions) > 480  # "anywhere", not clustered near the questions


def test_curriculum_batches_and_resume_skip():
    stages = [CurriculumStage(steps=2, seq_len=64, batch_size=4), CurriculumStage(steps=1, seq_len=128, batch_size=2)]
    full = list(CurriculumBatches(stages, final_len=256, final_batch=1, total_steps=5))
    assert [(len(b), b[0][1]) for b in full] == [(4, 64), (4, 64), (2, 128), (1, 256), (1, 256)]
    assert [i for b in full for i, _ in b] == list(range(12))  # consecutive sample indices
    resumed = CurriculumBatches(stages, final_len=256, final_batch=1, total_steps=5, start_step=3)
    assert len(resumed) == 5  # the epoch's length, as Lightning counts a resumed epoch
    assert list(resumed) == full[3:]
    assert list(resumed) == full  # the next epoch is whole
    in_second_epoch = CurriculumBatches(stages, final_len=256, final_batch=1, total_steps=5, start_step=5 + 2)
    assert list(in_second_epoch) == full[2:]
    ranks = [list(CurriculumBatches(stages, 256, 1, 5, start_step=1, rank=r, world_size=2)) for r in (0, 1)]
    for a, b in zip(*ranks):  # data parallel: same shapes per step, disjoint samples
        assert len(a) == len(b) and a[0][1] == b[0][1] and not {i for i, _ in a} & {i for i, _ in b}
