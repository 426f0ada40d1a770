"""Held-out task families for the selector evaluation: token rows with a few answer positions.

Every family writes rows of exactly ``seq_len`` tokens over one shared vocabulary of ``VOCAB_SIZE``
tokens: ``BOS``, random filler with a few *fact tokens* scattered through it, and questions at the end.
A fact is one token that carries both of its parts (as the needles of ``sparse_train``'s retrieval task
and the issue's measurement): ``fact(k, v)`` says key ``k`` has value ``v``; ``link(k1, k2)`` says key
``k1`` leads to key ``k2``; ``span(i, c)`` is symbol ``c`` at slot ``i`` of a span. A question is a query
token followed by its answer token; ``targets`` holds -100 everywhere except at the query positions,
whose target is the answer (next-token prediction: ``targets[p] == tokens[p + 1]``). Accuracy is the
fraction of query positions predicted exactly.

Every answer is one attention lookup, so a two-layer model can learn every family in a few hundred
steps: a two-hop question writes its intermediate key out, as a model that answers step by step does,
and each of its two answers reads one fact. The facts a question needs are single tokens, so they lie
in a few key blocks: ``top_k`` of a family is the number of facts its questions need, the selection
budget that suffices when the selector finds them.

Families:

* ``needles``: 8 facts over 8 keys in filler, 4 asked (the issue's task).
* ``multihop``: 4 chains ``link(k1, k2)``, ``fact(k2, v)`` over 8 keys, the two facts of a chain at
  independent places; 2 asked as ``query(k1) query(k2) v``: the first answer is the key the link points to,
  the second the value of that key (two lookups in two places, the second reachable only through the
  first).
* ``vartrack``: 8 variables (keys 0-7) each assigned twice, ``fact(x, v)`` at two random places (different values);
  4 asked, answered by the later assignment (variable tracking: the latest update wins; ``top_k`` counts
  the 4 latest assignments, the earlier ones are distractors).
* ``copy``: one contiguous span ``span(0, c0) .. span(L-1, c_{L-1})`` (L in 8..16); reproduced at the end
  as ``ASK index(0) c0 index(1) c1 ..`` (every symbol asked).
* ``assoc``: 32 facts, one for each of 32 keys, spread over the row; 4 asked (associative recall over
  many keys).

``solve(family, tokens)`` recovers every answer from the tokens alone (the rule a perfect model
applies); the tests compare it with the generator's targets.
"""

from __future__ import annotations

import zlib
from dataclasses import dataclass

import torch
from torch import Tensor

__all__ = ["FAMILIES", "IGNORE", "VOCAB_SIZE", "Family", "family", "make_batch", "solve", "stream_seed"]

NUM_KEYS = 32
NUM_VALUES = 8
NUM_FILLER = 32
NUM_SLOTS = 16
LINK_KEYS = 8

# vocabulary: consecutive ranges
BOS, ASK = 1, 2
FILLER = range(3, 3 + NUM_FILLER)
QUERY = range(FILLER.stop, FILLER.stop + NUM_KEYS)  # query(k)
VALUE = range(QUERY.stop, QUERY.stop + NUM_VALUES)  # answers and span symbols
FACT = range(VALUE.stop, VALUE.stop + NUM_KEYS * NUM_VALUES)  # fact(k, v) = FACT[k * NUM_VALUES + v]
LINK = range(FACT.stop, FACT.stop + LINK_KEYS * LINK_KEYS)  # link(a, b) = LINK[a * LINK_KEYS + b]
SPAN = range(LINK.stop, LINK.stop + NUM_SLOTS * NUM_VALUES)  # span(i, c) = SPAN[i * NUM_VALUES + c]
INDEX = range(SPAN.stop, SPAN.stop + NUM_SLOTS)  # index(i)
VOCAB_SIZE = 768
assert INDEX.stop <= VOCAB_SIZE
IGNORE = -100


@dataclass(frozen=True)
class Family:
    """One task family: its name, the facts its questions need (``top_k``), the chance accuracy of a
    uniform guess over the answer alphabet and the shortest row."""

    name: str
    top_k: int
    min_len: int
    description: str
    chance: float = 1.0 / NUM_VALUES


FAMILIES: dict[str, Family] = {
    f.name: f
    for f in (
        Family("needles", 4, 32, "8 single-token key->value needles in filler, 4 asked"),
        Family("multihop", 4, 32, "4 two-hop chains k1->k2->v in filler, 2 asked as k1 -> k2 -> v"),
        Family("vartrack", 4, 32, "8 variables assigned twice in filler, 4 asked (answer: the later value)"),
        Family("copy", 2, 64, "a span of 8-16 slot-tagged symbols, every symbol asked at the end"),
        Family("assoc", 4, 64, "32 key->value facts spread over the row, 4 asked"),
    )
}


def family(name: str) -> Family:
    """The :class:`Family` called ``name``; ValueError naming the argument otherwise."""
    if name not in FAMILIES:
        raise ValueError(f"family must be one of {', '.join(FAMILIES)}, got {name!r}")
    return FAMILIES[name]


def stream_seed(*parts: object) -> int:
    """A stable 31-bit seed from any labels (family, split, length, run seed): the same labels give the
    same stream in every process, different labels independent streams."""
    return zlib.crc32("/".join(map(str, parts)).encode()) & 0x7FFFFFFF


def _perm(count: int, gen: torch.Generator) -> list[int]:
    return torch.randperm(count, generator=gen).tolist()


def _values(count: int, gen: torch.Generator) -> list[int]:
    return torch.randint(NUM_VALUES, (count,), generator=gen).tolist()


def _sample_row(name: str, n: int, gen: torch.Generator) -> tuple[Tensor, Tensor]:
    """tokens, targets (int64 ``[n]``) of one row of family ``name``."""
    facts: list[int] = []  # fact tokens, each at its own random haystack position
    block: list[int] = []  # copy: one contiguous run of tokens at a random position
    questions: list[tuple[int, ...]] = []  # (query token, answer token) or (query, key, value) for multihop
    prefix: list[int] = []  # tokens between the haystack and the questions
    if name in ("needles", "assoc"):
        keys, asked = (8, 4) if name == "needles" else (32, 4)
        chosen = _perm(keys, gen)
        values = _values(keys, gen)
        facts = [FACT[k * NUM_VALUES + v] for k, v in zip(chosen, values)]
        questions = [(QUERY[chosen[i]], VALUE[values[i]]) for i in _perm(keys, gen)[:asked]]
    elif name == "multihop":
        chains, asked = 4, 2
        keys = _perm(LINK_KEYS, gen)[: 2 * chains]
        values = _values(chains, gen)
        for c in range(chains):
            first, second = keys[2 * c], keys[2 * c + 1]
            facts += [LINK[first * LINK_KEYS + second], FACT[second * NUM_VALUES + values[c]]]
        questions = [(QUERY[keys[2 * c]], QUERY[keys[2 * c + 1]], VALUE[values[c]]) for c in _perm(chains, gen)[:asked]]
    elif name == "vartrack":
        variables, asked = 8, 4
        chosen = _perm(variables, gen)
        first = _values(variables, gen)
        # the second assignment differs from the first, so the latest one is the only right answer
        second = [
            (v + 1 + s) % NUM_VALUES
            for v, s in zip(first, torch.randint(NUM_VALUES - 1, (variables,), generator=gen).tolist())
        ]
        facts = [FACT[k * NUM_VALUES + v] for k, v in zip(chosen, first)]
        facts += [FACT[k * NUM_VALUES + v] for k, v in zip(chosen, second)]
        questions = [(QUERY[chosen[i]], None) for i in _perm(variables, gen)[:asked]]  # answered after placement
    elif name == "copy":
        length = int(torch.randint(8, NUM_SLOTS + 1, (1,), generator=gen))
        symbols = _values(length, gen)
        block = [SPAN[i * NUM_VALUES + c] for i, c in enumerate(symbols)]
        prefix = [ASK]
        questions = [(INDEX[i], VALUE[c]) for i, c in enumerate(symbols)]
    else:
        family(name)
    tail = len(prefix) + sum(len(q) for q in questions)
    stop = n - tail  # haystack: positions 1 .. stop-1
    units = len(facts) + (1 if block else 0)
    room = stop - 1 - len(block) + (1 if block else 0)  # positions when the block counts as one unit
    if room < units:
        raise ValueError(f"seq_len={n} is too short for family {name!r} ({units} facts, {tail} question tokens)")
    tokens = torch.randint(FILLER.start, FILLER.stop, (n,), generator=gen)
    tokens[0] = BOS
    # choose `units` distinct slots among `room`, then shift the slots after the block by its length
    slots = torch.randperm(room, generator=gen)[:units].sort().values.tolist()
    order = _perm(units, gen)
    items = [[f] for f in facts] + ([block] if block else [])
    shift = 0
    for slot, item in zip(slots, (items[i] for i in order)):
        start = 1 + slot + shift
        tokens[start : start + len(item)] = torch.tensor(item)
        shift += len(item) - 1
    if name == "vartrack":
        hay = tokens[:stop].tolist()
        questions = [(q, _latest_value(hay, q - QUERY.start)) for q, _ in questions]
    tail_tokens = list(prefix)
    asked: list[int] = []  # every token of a question but its last: its target is the next token
    for question in questions:
        asked += [stop + len(tail_tokens) + j for j in range(len(question) - 1)]
        tail_tokens += question
    tokens[stop:] = torch.tensor(tail_tokens)
    targets = torch.full((n,), IGNORE, dtype=torch.int64)
    query_pos = torch.tensor(asked)
    targets[query_pos] = tokens[query_pos + 1]
    return tokens, targets


def _latest_value(hay: list[int], key: int) -> int:
    """The value token of the last fact about ``key`` in ``hay``."""
    found = [t for t in hay if t in FACT and (t - FACT.start) // NUM_VALUES == key]
    if not found:
        raise ValueError(f"no fact about key {key} in the haystack")
    return VALUE[(found[-1] - FACT.start) % NUM_VALUES]


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


def _unique(found: list[int], what: str) -> int:
    if len(found) != 1:
        raise ValueError(f"{what}: {len(found)} matching facts in the haystack")
    return found[0]


def solve(name: str, tokens: Tensor) -> Tensor:
    """The answers of one row recovered from its tokens alone, as targets (int64 ``[n]``, -100 where
    nothing is asked): each query token names what to look up, the haystack's fact tokens give the answer
    (for ``vartrack`` the last assignment; for ``multihop`` the key the link points to, then that key's
    value), independent of how the row was generated."""
    family(name)
    row = tokens.tolist()
    n = len(row)
    out = torch.full((n,), IGNORE, dtype=torch.int64)
    query_range = INDEX if name == "copy" else QUERY
    # the questions fill the end of the row: (query, answer) pairs, or (query, key, value) triples for multihop
    size = 3 if name == "multihop" else 2
    p = n - size
    while p >= 0 and row[p] in query_range:
        p -= size
    first = p + size
    hay = row[: first - (1 if name == "copy" else 0)]
    facts = [t - FACT.start for t in hay if t in FACT]
    for q in range(first, n, size):
        if name == "copy":
            slot = row[q] - INDEX.start
            symbol = _unique(
                [(t - SPAN.start) % NUM_VALUES for t in hay if t in SPAN and (t - SPAN.start) // NUM_VALUES == slot],
                f"slot {slot}",
            )
            out[q] = VALUE[symbol]
            continue
        key = row[q] - QUERY.start
        about = [f % NUM_VALUES for f in facts if f // NUM_VALUES == key]
        if name == "multihop":
            second = _unique(
                [(t - LINK.start) % LINK_KEYS for t in hay if t in LINK and (t - LINK.start) // LINK_KEYS == key],
                f"link from {key}",
            )
            about = [f % NUM_VALUES for f in facts if f // NUM_VALUES == second]
            out[q] = QUERY[second]
            out[q + 1] = VALUE[_unique(about, f"fact of key {second}")]
        elif name == "vartrack":
            if not about:
                raise ValueError(f"no assignment of variable {key}")
            out[q] = VALUE[about[-1]]
        else:
            out[q] = VALUE[_unique(about, f"fact of key {key}")]
    return out
