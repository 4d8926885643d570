"""Synthetic tasks with answers (`--data phop`, `--data addition`): small problems that need depth,
generated on the fly, offline and deterministically, and fed to the Trainer like a corpus.

The token layout, the two tasks (with examples), the answer-only loss, the held-out split (crc32 of a problem's
text % HELD_OUT_EVERY == 0) and the SHAKE-256 draws that make every row the same on every machine (so resuming
at any step is exact): docs/DESIGN.md section 8. A problem is a text and its targets (aligned with the text:
the token to predict at each position, or NO_TARGET); an answer is `answer_len` consecutive targets.
"""
from __future__ import annotations

import hashlib
import math
import zlib
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from flt_diag.config.run_config import TASKS
from flt_diag.data.corpus import DataError, entropy

IGNORE_INDEX = -100  # a target that is not an answer token (F.cross_entropy's default ignore_index)
NO_TARGET = " "  # in a problem's targets: nothing to predict at this position
HELD_OUT_EVERY = 20  # a problem is held out when crc32(text) % HELD_OUT_EVERY == 0
PAD = "."  # fills a row after its last whole problem
LETTERS = "abcdefghijklmnopqrstuvwxyz"
MAX_ATTEMPTS = 1000  # draws per problem before giving up (the build check keeps this out of reach)
MIN_ACCEPTANCE = 0.2  # phop: the share of contexts whose last position must have a complete chain


@dataclass(frozen=True)
class Problem:
    text: str  # what the model reads, one character per token
    targets: str  # aligned with text: the token to predict at each position, or NO_TARGET


def draws(key: str, n: int) -> np.ndarray:
    """n uniform 64-bit numbers from SHAKE-256 of `key` (stable across machines and versions)."""
    return np.frombuffer(hashlib.shake_256(key.encode()).digest(8 * n), dtype="<u8")


def held_out(problem: Problem) -> bool:
    return zlib.crc32(problem.text.encode()) % HELD_OUT_EVERY == 0


class PHop:
    """p-hop induction over a context of `context` letters, a target at every position (DESIGN section 8)."""

    name = "phop"
    answer_len = 1

    def __init__(self, hops: int, alphabet: int, context: int):
        self.hops, self.alphabet, self.context = hops, alphabet, context
        self.ident = f"phop/h{hops}/a{alphabet}/n{context}"
        self.problem_len = context

    def draw(self, key: str) -> Problem | None:
        """A context with no equal neighbours and its targets; None where the last position has no chain."""
        r = draws(key, self.context)
        steps = np.concatenate([[r[0] % self.alphabet], 1 + r[1:] % (self.alphabet - 1)])
        tokens = (np.cumsum(steps) % self.alphabet).tolist()  # each token differs from the one before it
        ends = self.follow(tokens)
        if ends[-1] is None:
            return None
        return Problem("".join(LETTERS[t] for t in tokens),
                       "".join(NO_TARGET if e is None else LETTERS[tokens[e]] for e in ends))

    def follow(self, tokens: list[int]) -> list[int | None]:
        """For every position, where its p hops end (None if a hop has nowhere to go)."""
        last_seen: dict[int, int] = {}
        hop: list[int | None] = []  # hop[i]: the position one hop from i
        for i, t in enumerate(tokens):
            hop.append(last_seen[t] + 1 if t in last_seen else None)
            last_seen[t] = i
        ends: list[int | None] = list(range(len(tokens)))
        for _ in range(self.hops):
            ends = [None if e is None else hop[e] for e in ends]
        return ends

    def answer_entropy(self) -> float:
        """ln a: the generator treats every letter alike (any relabelling of the alphabet maps
        contexts to equally likely contexts), so every target is uniform over the alphabet."""
        return math.log(self.alphabet)

    def check(self) -> None:
        """Refuse dials whose chains rarely fit the context (most draws would be redrawn)."""
        accepted = sum(self.draw(f"{self.ident}/check/{i}") is not None for i in range(200)) / 200
        if accepted < MIN_ACCEPTANCE:
            raise DataError(f"phop: {self.hops} hops over {self.alphabet} letters fit a context of "
                            f"{self.context} tokens in only {accepted:.0%} of draws; lower --hops or "
                            "--alphabet, or raise --seq-len")


class Addition:
    """n-operand addition of d-digit numbers, least significant digit first (DESIGN section 8)."""

    name = "addition"

    def __init__(self, operands: int, digits: int):
        self.operands, self.digits = operands, digits
        self.ident = f"addition/o{operands}/d{digits}"
        self.answer_len = len(str(operands * (10 ** digits - 1)))
        self.problem_len = operands * (digits + 1) + self.answer_len  # digits, n-1 "+", "=", answer

    def draw(self, key: str) -> Problem:
        values = [int(v) for v in draws(key, self.operands) % (10 ** self.digits)]
        prompt = "+".join(str(v).zfill(self.digits)[::-1] for v in values) + "="
        answer = str(sum(values)).zfill(self.answer_len)[::-1]
        return Problem(prompt + answer, NO_TARGET * (len(prompt) - 1) + answer + NO_TARGET)

    def answer_entropy(self) -> float:
        """Mean over the answer's digit positions of the entropy of that digit of the sum: the loss
        of the best predictor that ignores the operands. The sum's distribution is the n-fold
        convolution of the uniform distribution on 0 .. 10^d - 1 (a running box sum)."""
        box = 10 ** self.digits
        p = np.full(box, 1.0 / box)
        for _ in range(self.operands - 1):
            c = np.concatenate([[0.0], np.cumsum(np.concatenate([np.zeros(box - 1), p, np.zeros(box - 1)]))])
            p = (c[box:] - c[:-box]) / box  # P(S + V = s) = sum over v < box of P(S = s - v) / box
        sums = np.arange(len(p))
        per_digit = [entropy(np.bincount((sums // 10 ** q) % 10, weights=p, minlength=10))
                     for q in range(self.answer_len)]
        return float(np.mean(per_digit))

    def check(self) -> None:
        pass  # every draw is a problem; whether one fits the sequence is make_task's check


def bytes_only(task: str, tokenizer: str | None) -> None:
    """A task is written in bytes: DataError (one line) for another tokenizer."""
    if tokenizer != "bytes":
        raise DataError(f"--data {task} is written in bytes; use --tokenizer bytes (got {tokenizer})")


def make_task(train, seq_len: int) -> PHop | Addition:
    """The task of a TrainConfig (`train.data` one of TASKS) at this sequence length; DataError
    (one line) when it cannot be used as configured."""
    bytes_only(train.data, train.tokenizer)
    task: PHop | Addition
    if train.data == "phop":
        task = PHop(train.hops, train.alphabet, seq_len)
    elif train.data == "addition":
        task = Addition(train.operands, train.digits)
    else:
        raise DataError(f"unknown task {train.data!r}; choose from {', '.join(TASKS)}")
    if task.problem_len > seq_len:
        raise DataError(f"{task.name}: a problem takes {task.problem_len} tokens ({task.ident}); --seq-len must be "
                        f"at least {task.problem_len}")
    task.check()
    return task


@dataclass
class TaskData:
    """One split of a task, in the place of a corpus's TokenData: rows drawn by id (the ids of a batch
    drawn by a torch generator: `flt_diag.data.batches.get_batch`)."""

    task: PHop | Addition
    split: str  # "train" or "val"
    seq_len: int
    vocab_size: int = 256  # bytes
    path: Path | None = None  # nothing is cached on disk: rows are made when drawn
    kept: dict[int, Problem] = field(default_factory=dict, repr=False)  # held-out rows made so far

    @property
    def unigram_entropy(self) -> float:
        """The answer tokens' entropy (the verdict's "learned nothing" line for a task)."""
        return self.task.answer_entropy()

    @property
    def per_row(self) -> int:
        return self.seq_len // self.task.problem_len

    def problem(self, row_id: int, j: int) -> Problem:
        """Problem j of row `row_id`: the first draw that exists and belongs to this split."""
        for attempt in range(MAX_ATTEMPTS):
            p = self.task.draw(f"{self.task.ident}/{self.split}/{row_id}/{j}/{attempt}")
            if p is not None and held_out(p) == (self.split == "val"):
                return p
        raise DataError(f"{self.task.ident}: no {self.split} problem in {MAX_ATTEMPTS} draws")

    def row(self, row_id: int) -> Problem:
        """Row `row_id`: its problems side by side, padded to seq_len. Held-out rows are kept once
        made (every evaluation draws the same ones, and each costs ~HELD_OUT_EVERY draws)."""
        if row_id in self.kept:
            return self.kept[row_id]
        problems = [self.problem(row_id, j) for j in range(self.per_row)]
        row = Problem("".join(p.text for p in problems).ljust(self.seq_len, PAD),
                      "".join(p.targets for p in problems).ljust(self.seq_len, NO_TARGET))
        if self.split == "val":
            self.kept[row_id] = row
        return row

    def arrays(self, row_ids: list[int]) -> tuple[np.ndarray, np.ndarray]:
        """x (B, T) and y (B, T) as int64 arrays: y is IGNORE_INDEX except at answer tokens."""
        x = np.empty((len(row_ids), self.seq_len), dtype=np.int64)
        y = np.empty((len(row_ids), self.seq_len), dtype=np.int64)
        for b, row_id in enumerate(row_ids):
            row = self.row(row_id)
            x[b] = np.frombuffer(row.text.encode("ascii"), dtype=np.uint8)
            y[b] = np.frombuffer(row.targets.encode("ascii"), dtype=np.uint8)
        y[y == ord(NO_TARGET)] = IGNORE_INDEX
        return x, y

    def facts(self) -> dict:
        """What config.json's "corpus" records of a task: its name, dials, layout and an example."""
        p = self.problem(0, 0)
        return {"task": self.task.ident, "problems_per_row": self.per_row, "answer_tokens": self.task.answer_len,
                "unigram_entropy": self.unigram_entropy, "example": {"text": p.text, "targets": p.targets}}


def load_task(train, seq_len: int, split: str) -> TaskData:
    if split not in ("train", "val"):
        raise DataError(f"split must be train or val, got {split!r}")
    return TaskData(make_task(train, seq_len), split, seq_len)
