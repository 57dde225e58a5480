"""Data that needs no download: a real text corpus, byte-level tokens, synthetic long-context tasks.

The corpus (``data.corpus``):

* ``pydoc`` (default): the Python Language Reference and library topics that every CPython ships
  as ``pydoc_data.topics`` (about 466 KB of English technical prose, used by ``help()``): real text,
  on every machine with Python, no download.
* ``pysource``: the top-level modules of the running Python's standard library (``Lib/*.py``,
  sorted by file name, joined by blank lines): about 4.7 MB of Python source code on CPython 3.11,
  a corpus of another kind than pydoc's prose, also on every machine with Python and no download
  (it differs a little between Python versions).
* a path to any UTF-8 (or raw byte) text file, e.g. WikiText-103's raw text if you have it; it is
  memory-mapped, so its size is not bounded by RAM.

Tokenisation is byte-level (vocabulary 256, token = byte): nothing to download or train, exact
round trip, comparable to seed 001's character-level setup.

Batches are a pure function of ``(seed, step)``: every rank draws the global batch's window offsets
from one generator seeded by ``(seed, step)`` and takes its own slice of it. So the data of a
step does not depend on the world size or on what ran before; resuming needs no loader state.
A fraction ``task_mix`` of the sequences are synthetic tasks (passkey retrieval with 1 or 5
needles, variable binding) so that a small model can learn what the evaluations ask.
"""

from __future__ import annotations

import random
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import SupportsInt

import numpy as np
import torch
from torch import Tensor

FILLER_SENTENCES = (
    "The grass is green. ",
    "The sky is blue. ",
    "The sun is yellow. ",
    "Here we go. ",
    "There and back again. ",
)
CORPORA = ("pydoc", "pysource")
"""The named corpora every machine with Python has (``data.corpus``); anything else is a file path."""
NAMES = ("ada", "bob", "cyd", "dee", "eve", "fay", "gus", "hal", "ian", "joy", "kit", "lou")
TASKS = ("passkey", "binding")


@dataclass
class DataConfig:
    """Where the training text comes from and how much of it is synthetic tasks."""

    corpus: str = "pydoc"
    """pydoc (CPython's pydoc_data.topics), pysource (the standard library's own source) or a path to a text file."""
    val_fraction: float = 0.1
    """Tail of the corpus held out for validation and perplexity (seed 001: 10 %)."""
    task_mix: float = 0.0
    """Fraction of training sequences that are synthetic tasks (passkey, binding)."""

    def __post_init__(self) -> None:
        if not 0 < self.val_fraction < 0.5:
            raise ValueError(f"data.val_fraction must lie in (0, 0.5), got {self.val_fraction}")
        if not 0 <= self.task_mix <= 1:
            raise ValueError(f"data.task_mix must lie in [0, 1], got {self.task_mix}")
        if self.corpus not in CORPORA and not Path(self.corpus).is_file():
            raise ValueError(f"data.corpus={self.corpus!r} is neither one of {', '.join(CORPORA)} nor a readable file")


# --- tokenizer and corpus ------------------------------------------------------------------------


class ByteTokenizer:
    """UTF-8 bytes as tokens (vocabulary 256)."""

    vocab_size = 256

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def decode(self, ids: Iterable[SupportsInt]) -> str:
        return bytes(int(i) for i in ids).decode("utf-8", errors="replace")


def load_corpus(corpus: str) -> np.ndarray:
    """The corpus as a ``uint8`` array of byte tokens (memory-mapped for a file)."""
    if corpus == "pydoc":
        from pydoc_data.topics import topics

        text = "\n\n".join(topics[key].strip() for key in sorted(topics))
        return np.frombuffer(text.encode("utf-8"), dtype=np.uint8)
    if corpus == "pysource":
        import sysconfig

        files = sorted(Path(sysconfig.get_paths()["stdlib"]).glob("*.py"), key=lambda f: f.name)
        return np.frombuffer(b"\n\n".join(f.read_bytes().strip() for f in files), dtype=np.uint8)
    return np.memmap(corpus, dtype=np.uint8, mode="r")


# --- synthetic tasks -------------------------------------------------------------------------------


@dataclass
class TaskSample:
    """A token sequence and the spans ``[start, end)`` whose tokens are scored."""

    tokens: list[int]
    answers: list[tuple[int, int]]


def passkey_min_length(needles: int, digits: int = 5) -> int:
    key = "0" * digits
    return len(_passkey_needle("ada", key, needles)) * needles + len(_passkey_query("ada", key, needles))


def _passkey_needle(name: str, key: str, needles: int) -> str:
    return f"The pass key is {key}. " if needles == 1 else f"The pass key of {name} is {key}. "


def _passkey_query(name: str, key: str, needles: int) -> str:
    return (
        f"\nWhat is the pass key? The pass key is {key}"
        if needles == 1
        else f"\nWhat is the pass key of {name}? The pass key of {name} is {key}"
    )


def passkey(rng: random.Random, length: int, needles: int = 1, digits: int = 5) -> list[TaskSample]:
    """Passkey retrieval: needles hidden at random depths in filler, then one query per needle.

    Returns one sample per needle (same context, different query), each exactly ``length`` tokens,
    whose scored span is the key's digits at the end.
    """
    if length < passkey_min_length(needles, digits):
        raise ValueError(
            f"passkey with {needles} needle(s) needs at least {passkey_min_length(needles, digits)} "
            f"tokens, got {length}"
        )
    names = rng.sample(NAMES, needles)
    keys = ["".join(rng.choice("0123456789") for _ in range(digits)) for _ in names]
    inserts = [_passkey_needle(n, k, needles) for n, k in zip(names, keys, strict=True)]
    # one context (the same needle depths) for every query; queries of a context have equal length
    query_len = len(_passkey_query(names[0], keys[0], needles))
    budget = length - query_len - sum(len(s) for s in inserts)
    sentences: list[str] = []
    while True:  # whole filler sentences, then spaces up to the exact length
        sentence = FILLER_SENTENCES[len(sentences) % len(FILLER_SENTENCES)]
        if len(sentence) > budget:
            break
        sentences.append(sentence)
        budget -= len(sentence)
    depths = sorted(rng.randint(0, len(sentences)) for _ in inserts)  # needles go between sentences
    parts = list(sentences)
    for depth, needle in sorted(zip(depths, inserts, strict=True), key=lambda p: -p[0]):
        parts.insert(depth, needle)
    body = "".join(parts) + " " * budget
    out = []
    for name, key in zip(names, keys, strict=True):
        full = (body + _passkey_query(name, key, needles)).encode()
        out.append(TaskSample(list(full), [(len(full) - digits, len(full))]))
    return out


def binding(rng: random.Random, length: int, hops: int = 2) -> TaskSample:
    """Variable binding: ``hops`` assignments link a query variable to a digit across the context.

    Statements ``xy = 7.`` / ``zw = xy.`` of the target chain are spread at random depths among
    distractor statements; the query ``What is zw? zw = 7`` scores the final digit.
    """
    names = [a + b for a in "abcdefghijklmnopqrstuvwxyz" for b in "abcdefghijklmnopqrstuvwxyz"]
    rng.shuffle(names)
    chain = names[: hops + 1]
    value = rng.choice("0123456789")
    target = [f"{chain[0]} = {value}. "] + [f"{chain[i + 1]} = {chain[i]}. " for i in range(hops)]
    query = f"\nWhat is {chain[-1]}? {chain[-1]} = {value}"
    budget = length - len(query) - sum(len(s) for s in target)
    if budget < 0:
        raise ValueError(f"binding with {hops} hops needs at least {length - budget} tokens, got {length}")
    distractors, pool = [], iter(names[hops + 1 :])
    while True:
        stmt = f"{next(pool)} = {rng.choice('0123456789')}. "
        if len(stmt) > budget:
            break
        distractors.append(stmt)
        budget -= len(stmt)
    # interleave: keep the chain's order, spread it over the context
    slots = sorted(rng.sample(range(len(distractors) + len(target)), len(target)))
    statements, it_d, it_t = [], iter(distractors), iter(target)
    for i in range(len(distractors) + len(target)):
        statements.append(next(it_t) if i in slots else next(it_d))
    body = "".join(statements) + " " * budget
    full = body + query
    return TaskSample(list(full.encode()), [(len(full) - 1, len(full))])


def binding_min_length(hops: int) -> int:
    """Tokens a binding sample needs: the chain's statements and the query (two-letter names)."""
    return len("ab = 7. ") + hops * len("cd = ab. ") + len("\nWhat is cd? cd = 7")


def task_sequence(rng: random.Random, length: int) -> list[int]:
    """A random training task sequence of exactly ``length`` tokens (passkey 1 or 5 needles, binding)."""
    if length < binding_min_length(1):
        raise ValueError(f"synthetic tasks need sequences of at least {binding_min_length(1)} tokens, got {length}")
    kind = rng.choice(TASKS)
    if kind == "passkey":
        needles = 5 if length >= passkey_min_length(5) and rng.random() < 0.5 else 1
        if length >= passkey_min_length(needles):
            return rng.choice(passkey(rng, length, needles)).tokens
    hops = rng.randint(1, 3)
    while binding_min_length(hops) > length:
        hops -= 1
    return binding(rng, length, hops=hops).tokens


# --- batches ---------------------------------------------------------------------------------------


class TrainData:
    """Deterministic, per-rank sharded batches of ``seq_len + 1`` tokens (inputs and shifted targets)."""

    def __init__(self, config: DataConfig, seq_len: int, global_batch: int, seed: int) -> None:
        self.config = config
        self.seq_len = seq_len
        self.global_batch = global_batch
        self.seed = seed
        tokens = load_corpus(config.corpus)
        n_val = int(len(tokens) * config.val_fraction)
        if len(tokens) - n_val < seq_len + 2 or n_val < seq_len + 2:
            raise ValueError(f"corpus {config.corpus!r} has {len(tokens)} tokens: too few for seq_len={seq_len}")
        self.train, self.val = tokens[: len(tokens) - n_val], tokens[len(tokens) - n_val :]
        if config.task_mix > 0 and seq_len + 1 < binding_min_length(1):
            raise ValueError(
                f"data.task_mix > 0 needs sequences of at least {binding_min_length(1) - 1} tokens "
                f"(seq_len is {seq_len})"
            )

    @property
    def steps_per_epoch(self) -> int:
        return max(1, len(self.train) // (self.global_batch * self.seq_len))

    def batch(self, step: int, start: int, size: int) -> tuple[Tensor, Tensor]:
        """Rows ``[start, start + size)`` of step ``step``'s global batch: ``(inputs, targets)``, ``(size, T)``."""
        gen = torch.Generator().manual_seed(self.seed * 1_000_003 + step)
        offsets = torch.randint(len(self.train) - self.seq_len - 1, (self.global_batch,), generator=gen).numpy()
        is_task = (torch.rand(self.global_batch, generator=gen) < self.config.task_mix).numpy()
        rows = []
        for i in range(start, start + size):
            if is_task[i]:
                rng = random.Random(f"{self.seed}:{step}:{i}")
                rows.append(np.asarray(task_sequence(rng, self.seq_len + 1), dtype=np.uint8))
            else:
                rows.append(self.train[offsets[i] : offsets[i] + self.seq_len + 1])
        window = torch.from_numpy(np.stack(rows).astype(np.int64))  # (size, T+1)
        return window[:, :-1], window[:, 1:]

    def val_windows(self, n: int, length: int) -> Tensor:
        """``n`` fixed, evenly spaced validation windows of ``length + 1`` tokens, ``(n, length + 1)``."""
        span = len(self.val) - length - 1
        if span < 0:
            raise ValueError(f"the validation split ({len(self.val)} tokens) is shorter than {length + 1}")
        starts = np.linspace(0, span, num=n).astype(np.int64)
        return torch.from_numpy(np.stack([self.val[s : s + length + 1] for s in starts]).astype(np.int64))
