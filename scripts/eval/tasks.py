"""Held-out task families for the selector evaluation: token rows with a few answer positions.

Every family writes rows of exactly ``seq_len`` tokens over one shared vocabulary of ``VOCAB_SIZE``
tokens: random filler with a few *facts* scattered through it and a question at the end. ``targets``
holds -100 everywhere except at the positions whose next token is an answer (next-token prediction:
``targets[p] == tokens[p + 1]``); accuracy is the fraction of those positions predicted exactly.
Answers are given to the model as inputs after each answer position (teacher forcing), so an answer
of several tokens (a chain, a span) is a sequence of single lookups: a 2-layer model composes one
lookup per position, not several.

The facts a question needs are a few tokens each, so they lie in a few key blocks: ``top_k`` of a
family is the number of facts its question needs, the selection budget that suffices when the
selector finds them.

Families:

* ``needles``: 8 facts ``k v`` (key, value) in filler; 4 asked as ``? k v``.
* ``multihop``: 4 chains ``MARK k1 k2`` and ``MARK k2 v`` (two hops) in filler; 2 asked as
  ``? k1 k2 v`` (answers: the intermediate key, then the value).
* ``vartrack``: 4 chains of assignments ``Xa = n``, ``Xb = Xa``, ``Xc = Xb`` (in this order in the
  row, chains interleaved); 2 asked as ``? Xc Xb Xa n`` (answers: each variable's right-hand side).
* ``copy``: one span ``OPEN s1 .. sL CLOSE`` (L in 8..16, distinct tokens); reproduced at the end as
  ``ASK s1 .. sL`` (answers: every span token).
* ``assoc``: 48 facts ``k v`` in filler (associative recall over many keys); 4 asked as ``? k v``.

``solve(family, tokens)`` recovers every answer from the tokens alone (the rule a perfect model
applies); the tests compare it with the generator's targets.
"""

from __future__ import annotations

import zlib
from dataclasses import dataclass

import torch
from torch import Tensor

__all__ = ["FAMILIES", "Family", "VOCAB_SIZE", "family", "make_batch", "solve", "stream_seed"]

# vocabulary
BOS, QUERY, EQ, MARK, OPEN, CLOSE, ASK = 1, 2, 3, 4, 5, 6, 7
FILLER = range(8, 40)      # 32 filler tokens, never part of a fact
KEYS = range(40, 104)      # 64 keys / variable names / span tokens
VALUES = range(104, 120)   # 16 values
VOCAB_SIZE = 128
IGNORE = -100


@dataclass(frozen=True)
class Family:
    """One task family: its name, the facts its question needs (``top_k``), the chance accuracy of a
    uniform guess over each answer's alphabet (mean over answer tokens) and the shortest row."""

    name: str
    top_k: int
    chance: float
    min_len: int
    description: str


FAMILIES: dict[str, Family] = {f.name: f for f in (
    Family("needles", 4, 1 / len(VALUES), 64,
           "8 single-token key->value needles in filler, 4 asked"),
    Family("multihop", 4, (1 / len(KEYS) + 1 / len(VALUES)) / 2, 96,
           "4 two-hop chains k1->k2->v in filler, 2 asked (answers k2 then v)"),
    Family("vartrack", 6, (2 / len(KEYS) + 1 / len(VALUES)) / 3, 128,
           "4 chains Xa=n, Xb=Xa, Xc=Xb in filler, 2 asked (answers Xb, Xa, n)"),
    Family("copy", 2, 1 / len(KEYS), 64,
           "one marked span of 8-16 distinct tokens, reproduced at the end"),
    Family("assoc", 4, 1 / len(VALUES), 192,
           "48 key->value pairs spread over the row, 4 asked"),
)}


def family(name: str) -> Family:
    """The :class:`Family` called ``name``; ValueError naming the argument otherwise."""
    if name not in FAMILIES:
        raise ValueError(f"family must be one of {', '.join(FAMILIES)}, got {name!r}")
    return FAMILIES[name]


def stream_seed(*parts: object) -> int:
    """A stable 31-bit seed from any labels (family, split, run seed): the same labels give the same
    stream in every process and Python version, different labels independent streams."""
    return zlib.crc32("/".join(map(str, parts)).encode()) & 0x7FFFFFFF


def _pick(pool: range, count: int, gen: torch.Generator) -> list[int]:
    """``count`` distinct tokens of ``pool`` in random order."""
    order = torch.randperm(len(pool), generator=gen)[:count]
    return [pool.start + int(i) for i in order]


def _slots(count: int, size: int, start: int, stop: int, gen: torch.Generator) -> list[int]:
    """Start positions of ``count`` non-overlapping facts of ``size`` tokens in ``[start, stop)``, ascending."""
    free = (stop - start) // size
    if free < count:
        raise ValueError(f"seq_len too short: {count} facts of {size} tokens need {count * size} haystack positions, "
                         f"{stop - start} available")
    chosen = torch.randperm(free, generator=gen)[:count].sort().values
    return [start + int(s) * size for s in chosen]


def _sample_row(name: str, n: int, gen: torch.Generator) -> tuple[Tensor, Tensor]:
    """tokens, targets (int64 ``[n]``) of one row of family ``name``."""
    facts: list[list[int]] = []      # in the order they appear in the row
    question: list[int] = []
    answers: list[int] = []          # indices into question whose token is an answer
    ordered = False
    if name in ("needles", "assoc"):
        count, asked = (8, 4) if name == "needles" else (48, 4)
        keys = _pick(KEYS, count, gen)
        values = torch.randint(VALUES.start, VALUES.stop, (count,), generator=gen).tolist()
        facts = [[k, v] for k, v in zip(keys, values)]
        for i in torch.randperm(count, generator=gen)[:asked].tolist():
            question += [QUERY, keys[i], values[i]]
            answers.append(len(question) - 1)
    elif name == "multihop":
        chains, asked = 4, 2
        keys = _pick(KEYS, 2 * chains, gen)
        values = torch.randint(VALUES.start, VALUES.stop, (chains,), generator=gen).tolist()
        for c in range(chains):
            k1, k2 = keys[2 * c], keys[2 * c + 1]
            facts += [[MARK, k1, k2], [MARK, k2, values[c]]]
        for c in torch.randperm(chains, generator=gen)[:asked].tolist():
            question += [QUERY, keys[2 * c], keys[2 * c + 1], values[c]]
            answers += [len(question) - 2, len(question) - 1]
    elif name == "vartrack":
        chains, depth, asked = 4, 3, 2
        names = _pick(KEYS, chains * depth, gen)
        values = torch.randint(VALUES.start, VALUES.stop, (chains,), generator=gen).tolist()
        # chain c: names[c*depth + 0] = value, names[c*depth + i] = names[c*depth + i - 1]
        statements = {c: [[names[c * depth], EQ, values[c]]] + [[names[c * depth + i], EQ, names[c * depth + i - 1]]
                                                              for i in range(1, depth)] for c in range(chains)}
        # interleave the chains at random, each chain's statements in order
        owners = torch.tensor([c for c in range(chains) for _ in range(depth)])
        owners = owners[torch.randperm(len(owners), generator=gen)].tolist()
        seen = {c: 0 for c in range(chains)}
        for c in owners:
            facts.append(statements[c][seen[c]])
            seen[c] += 1
        ordered = True
        for c in torch.randperm(chains, generator=gen)[:asked].tolist():
            question += [QUERY] + [names[c * depth + i] for i in reversed(range(depth))] + [values[c]]
            answers += [len(question) - 1 - i for i in reversed(range(depth))]
    elif name == "copy":
        length = int(torch.randint(8, 17, (1,), generator=gen))
        span = _pick(KEYS, length, gen)
        facts = [[OPEN] + span + [CLOSE]]
        question = [ASK] + span
        answers = list(range(1, len(question)))
    else:
        family(name)
    size = max(len(f) for f in facts)
    start, stop = 1, n - len(question)
    positions = _slots(len(facts), size, start, stop, gen)
    if not ordered:
        order = torch.randperm(len(facts), generator=gen).tolist()
        facts = [facts[i] for i in order]
    tokens = torch.randint(FILLER.start, FILLER.stop, (n,), generator=gen)
    tokens[0] = BOS
    for pos, fact in zip(positions, facts):
        tokens[pos:pos + len(fact)] = torch.tensor(fact)
    tokens[stop:] = torch.tensor(question)
    targets = torch.full((n,), IGNORE, dtype=torch.int64)
    where = torch.tensor(answers) + stop
    targets[where - 1] = tokens[where]
    return tokens, targets


def make_batch(name: str, seq_len: int, batch: int, gen: torch.Generator) -> tuple[Tensor, Tensor]:
    """``batch`` rows of family ``name``: tokens and targets, int64 ``[batch, seq_len]`` on the CPU,
    drawn from ``gen`` (the same generator state gives the same rows)."""
    fam = family(name)
    if not isinstance(seq_len, int) or seq_len < fam.min_len:
        raise ValueError(f"seq_len must be an int >= {fam.min_len} for family {name!r}, got {seq_len!r}")
    if not isinstance(batch, int) or batch < 1:
        raise ValueError(f"batch must be a positive int, got {batch!r}")
    rows = [_sample_row(name, seq_len, gen) for _ in range(batch)]
    return torch.stack([r[0] for r in rows]), torch.stack([r[1] for r in rows])


def _lookup(row: list[int], key: int, before: int, prefix: int | None, suffix: int | None) -> int:
    """The token after the unique occurrence of ``key`` before position ``before`` that is preceded by
    ``prefix`` (when given) and followed by ``suffix`` (when given; the answer is then the token after it)."""
    hits = [p for p in range(before) if row[p] == key
            and (prefix is None or (p > 0 and row[p - 1] == prefix))
            and (suffix is None or row[p + 1] == suffix)]
    if len(hits) != 1:
        raise ValueError(f"key {key} occurs {len(hits)} times in the haystack with the fact's shape")
    return row[hits[0] + (2 if suffix is not None else 1)]


def solve(name: str, tokens: Tensor) -> Tensor:
    """The answers of one row recovered from its tokens alone, as targets (int64 ``[n]``, -100 where
    nothing is asked): the exact rule of each family (find the fact the question's current token names,
    read its answer), independent of how the row was generated."""
    family(name)
    row = tokens.tolist()
    n = len(row)
    out = torch.full((n,), IGNORE, dtype=torch.int64)
    if name == "copy":
        ask = row.index(ASK)
        start = row.index(OPEN)
        out[ask] = row[start + 1]
        for p in range(ask + 1, n - 1):
            j = row.index(row[p], start + 1)
            if row[j + 1] != CLOSE:
                out[p] = row[j + 1]
        return out
    first = row.index(QUERY)
    for p in range(first, n - 1):
        if row[p] == QUERY:
            continue
        if name in ("needles", "assoc"):
            if row[p - 1] == QUERY:
                out[p] = _lookup(row, row[p], first, None, None)
        elif name == "multihop":
            if row[p - 1] == QUERY or (p >= 2 and row[p - 2] == QUERY):
                out[p] = _lookup(row, row[p], first, MARK, None)
        elif name == "vartrack":
            if row[p] in KEYS:
                out[p] = _lookup(row, row[p], first, None, EQ)
    return out
