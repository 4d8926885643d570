"""Synthetic tasks (flt_diag.data.tasks): determinism, a held-out split disjoint from training, answers
computable from the context by an independent solver, the difficulty dials, answer-only loss, exact-
match accuracy against a hand count, resumption, and the command line from training to figures."""
from __future__ import annotations

import itertools
import math
import re
import zlib

import numpy as np
import pandas as pd
import pytest
import torch
import torch.nn.functional as F

from conftest import tiny_config
from flt_diag.storage.folders import load_metrics, load_summary
from flt_diag.cli import main
from flt_diag.config.run_config import ModelConfig, build_config
from flt_diag.data.batches import batch_generator, get_batch
from flt_diag.data.corpus import DataError
from flt_diag.data.sources import load_split
from flt_diag.data.tasks import Addition, IGNORE_INDEX, PHop, load_task
from flt_diag.model.transformer import LoopedTransformer
from flt_diag.training.evaluation import VAL_SEED, exact_match
from flt_diag.training.trainer import Callback, Trainer, comparable, train


def task_data(split="train", seq_len=64, **train):
    cfg = build_config("tiny", model=dict(seq_len=seq_len), train=train)
    return load_task(cfg.train, seq_len, split)


def rows(data, ids) -> list[tuple[str, list]]:
    """(text, targets) of rows as the batches hold them: targets[i] is a character or None."""
    x, y = data.arrays(list(ids))
    return [(bytes(xr.astype(np.uint8)).decode(), [None if t == IGNORE_INDEX else chr(t) for t in yr])
            for xr, yr in zip(x, y)]


def solve_phop(text: str, hops: int) -> list:
    """The p-hop target of every position, read off the text by its definition: from position i, find
    the last earlier position j holding the same letter and move to j + 1; after `hops` such moves, the
    letter there (None when some move finds no earlier occurrence)."""
    out = []
    for start in range(len(text)):
        i = start
        for _ in range(hops):
            earlier = [j for j in range(i) if text[j] == text[i]]
            if not earlier:
                i = None
                break
            i = earlier[-1] + 1
        out.append(None if i is None else text[i])
    return out


def addition_problems(text: str, operands: int, digits: int, width: int) -> list[tuple[list[int], str]]:
    """(operands, written answer) of every problem in an addition row (numbers least significant digit first)."""
    problem = rf"((?:\d{{{digits}}}\+){{{operands - 1}}}\d{{{digits}}})=(\d{{{width}}})"
    return [([int(o[::-1]) for o in ops.split("+")], answer) for ops, answer in re.findall(problem, text)]


# ------------------------------------------------------------------ the generators

def test_the_same_seed_gives_the_same_rows_and_another_seed_other_rows():
    for task in ("phop", "addition"):
        a, b = task_data(data=task), task_data(data=task)  # built independently
        xa, ya = get_batch(a, 8, 64, batch_generator(3, 5))
        xb, yb = get_batch(b, 8, 64, batch_generator(3, 5))
        assert torch.equal(xa, xb) and torch.equal(ya, yb)
        xc, _ = get_batch(a, 8, 64, batch_generator(4, 5))
        assert not torch.equal(xa, xc)
        val = task_data("val", data=task)
        first = get_batch(val, 8, 64, batch_generator(VAL_SEED, 0))  # held-out rows are kept once made ...
        again = get_batch(val, 8, 64, batch_generator(VAL_SEED, 0))
        fresh = get_batch(task_data("val", data=task), 8, 64, batch_generator(VAL_SEED, 0))
        assert all(torch.equal(p, q) and torch.equal(p, r) for p, q, r in zip(first, again, fresh))  # ... unchanged


def test_rows_do_not_depend_on_the_machine():
    """Every random number is SHAKE-256 of a key: the first rows are fixed strings."""
    data = task_data(data="addition", operands=2, digits=2, seq_len=9)
    # 66 + 9 = 75, 91 + 92 = 183, 92 + 3 = 95, every number least significant digit first
    assert [data.row(i).text for i in range(3)] == ["66+90=570", "19+29=381", "29+30=590"]
    phop = task_data(data="phop", hops=1, alphabet=3, seq_len=8).row(0)
    assert (phop.text, phop.targets) == ("bcbacaca", "  c bcac")


@pytest.mark.parametrize("task,dials", [("addition", dict(operands=2, digits=1)), ("phop", dict(hops=1, alphabet=3))])
def test_the_held_out_split_shares_no_problem_with_training(task, dials):
    """Each split keeps the problems whose text hashes (crc32, computed here) to its side of 0 mod 20."""
    seq_len = 6 if task == "addition" else 10
    train_rows = rows(task_data("train", seq_len, data=task, **dials), range(600))
    val_rows = rows(task_data("val", seq_len, data=task, **dials), range(300))
    train_texts, val_texts = {t for t, _ in train_rows}, {t for t, _ in val_rows}
    assert not train_texts & val_texts
    assert all(zlib.crc32(t.encode()) % 20 == 0 for t in val_texts)
    assert all(zlib.crc32(t.encode()) % 20 != 0 for t in train_texts)
    if task == "addition":  # 100 problems a+b of one digit: the held-out ones are exactly those hashing to 0
        every = {f"{a}+{b}=" + f"{a + b:02d}"[::-1] for a, b in itertools.product(range(10), repeat=2)}
        assert val_texts == {t for t in every if zlib.crc32(t.encode()) % 20 == 0}
        assert len(train_texts) > 80  # nearly all of the other 95 were drawn


@pytest.mark.parametrize("hops,alphabet", [(1, 4), (3, 4), (2, 8)])
def test_every_phop_target_is_the_letter_its_hops_reach(hops, alphabet):
    for text, targets in rows(task_data(data="phop", hops=hops, alphabet=alphabet), range(40)):
        assert set(text) <= set("abcdefgh"[:alphabet]) and all(a != b for a, b in zip(text, text[1:]))
        assert targets == solve_phop(text, hops)
        assert targets[-1] is not None  # the last position always has an answer


def test_every_addition_answer_is_the_sum_of_its_operands():
    for text, targets in rows(task_data(data="addition", operands=3, digits=2), range(40)):
        problems = addition_problems(text, 3, 2, 3)
        assert len(problems) == 64 // (3 * 3 + 3)  # as many as fit: 5 problems of 12 tokens
        assert text.endswith("." * (64 - 5 * 12))
        for operands, answer in problems:
            assert int(answer[::-1]) == sum(operands) and len(answer) == 3
        predicted = [t for t in targets if t is not None]  # each answer digit is predicted one position early
        assert "".join(predicted) == "".join(answer for _, answer in problems)
        assert all(text[p + 1] == t for p, t in enumerate(targets) if t is not None)


def test_the_dials_change_what_the_task_asks():
    three = rows(task_data(data="phop", hops=3, alphabet=4), range(30))
    differs = [t != s for text, targets in three for t, s in zip(targets, solve_phop(text, 2)) if t is not None]
    assert sum(differs) > 0.5 * len(differs)  # three hops are not two
    five = "".join(text for text, _ in rows(task_data(data="phop", hops=1, alphabet=5), range(20)))
    assert set(five) == set("abcde")
    for text, _ in rows(task_data(data="addition", operands=5, digits=3), range(10)):
        first, second, pad = text[:24], text[24:48], text[48:]  # 5 numbers of 3 digits, a sum of 4 (<= 4995)
        for problem in (first, second):
            numbers, answer = problem.split("=")
            assert [len(n) for n in numbers.split("+")] == [3] * 5 and len(answer) == 4
        assert pad == "." * 16


def test_answer_entropy_is_that_of_the_answer_digits():
    """Addition: the mean over answer digits of each digit's entropy, by enumerating every problem;
    phop: ln a, and the targets' letters are indeed near uniform."""
    sums = [sum(v) for v in itertools.product(range(10), repeat=3)]
    per_digit = []
    for q in range(2):
        counts = np.bincount([(s // 10 ** q) % 10 for s in sums], minlength=10) / len(sums)
        per_digit.append(-sum(p * math.log(p) for p in counts if p > 0))
    assert Addition(3, 1).answer_entropy() == pytest.approx(np.mean(per_digit), rel=1e-12)
    assert PHop(2, 6, 64).answer_entropy() == pytest.approx(math.log(6))
    letters = [t for _, targets in rows(task_data(data="phop", hops=2, alphabet=6), range(200)) for t in targets if t]
    freq = np.bincount([ord(t) - ord("a") for t in letters], minlength=6) / len(letters)
    assert np.abs(freq - 1 / 6).max() < 0.02


@pytest.mark.parametrize("train,seq_len,message", [
    (dict(data="addition", operands=4, digits=3), 16, "--seq-len must be at least 20"),
    (dict(data="phop", hops=16, alphabet=26), 64, "lower --hops or --alphabet"),
    (dict(data="phop", tokenizer="gpt2"), 64, "use --tokenizer bytes"),
])
def test_a_task_that_cannot_be_made_is_one_line(train, seq_len, message):
    with pytest.raises(DataError, match=re.escape(message)):
        task_data(seq_len=seq_len, **train)


def test_stream_sampling_and_out_of_range_dials_are_refused():
    with pytest.raises(ValueError, match="--sampling stream reads a corpus in order"):
        build_config("tiny", train=dict(data="phop", sampling="stream"))
    with pytest.raises(ValueError, match="--hops must be in 1..16"):
        build_config("tiny", train=dict(data="phop", hops=0))


def test_a_run_folder_ignores_the_dials_its_data_does_not_read():
    """Text runs (and folders written before the dials existed) compare without them; a phop run
    compares its own dials only."""
    text = comparable(build_config("tiny", train=dict(hops=7)).to_dict())["train"]
    assert not {"hops", "alphabet", "operands", "digits"} & set(text)
    phop = comparable(build_config("tiny", train=dict(data="phop", hops=7)).to_dict())["train"]
    assert phop["hops"] == 7 and "alphabet" in phop and "operands" not in phop


# ------------------------------------------------------------------ loss and accuracy

def test_exact_match_counts_answers_right_by_hand():
    """Two rows, answers of two tokens: row 0 holds answers at 1-2 (right) and 4-5 (5 wrong); row 1 at
    0-1 (right) and 3-4 (3 wrong). Two of four are right."""
    targets = torch.full((2, 6), IGNORE_INDEX)
    targets[0, [1, 2, 4, 5]] = torch.tensor([3, 1, 2, 2])
    targets[1, [0, 1, 3, 4]] = torch.tensor([0, 0, 1, 4])
    predicted = torch.tensor([[9, 3, 1, 9, 2, 0], [0, 0, 9, 2, 4, 9]])
    logits = F.one_hot(predicted, 10).float()
    assert exact_match(logits, targets, 2) == (2, 4)
    assert exact_match(logits, targets, 1) == (6, 8)  # one-token answers: 6 of the 8 tokens are right


def test_the_training_loss_is_over_answer_tokens_only():
    """The model's loss on a task batch equals the float64 cross-entropy of the answer positions alone,
    and differs from the mean over every position (answer-only loss: docs/DESIGN.md, Synthetic tasks)."""
    cfg = tiny_config(variant="flt", loops=2, data="addition")
    torch.manual_seed(0)
    model = LoopedTransformer(cfg.model).double()
    with torch.no_grad():
        model.head.weight.normal_()  # logits that are not all alike
    data = load_split(cfg.train, 64, "train")
    x, y = get_batch(data, 4, 64, batch_generator(0, 0))
    logits, loss = model(x, y)
    logp = torch.log_softmax(logits.double(), -1)
    answer = [(b, t) for b in range(4) for t in range(64) if y[b, t] != IGNORE_INDEX]
    by_hand = -sum(logp[b, t, y[b, t]] for b, t in answer) / len(answer)
    assert len(answer) == 4 * 4 * 3  # 4 problems of 3 answer digits per row
    # the model's logits are float32 (its soft cap casts them), so its cross-entropy is rounded in float32
    torch.testing.assert_close(loss.double(), by_hand, rtol=1e-6, atol=0)
    every = F.cross_entropy(logits.flatten(0, 1).double(), x.roll(-1, 1).flatten())
    assert abs(every.item() - loss.item()) > 0.1


# ------------------------------------------------------------------ training, resuming, command line

class Interrupt(Callback):
    def after_step(self, trainer, step):
        if step == 4:
            raise KeyboardInterrupt


def test_a_resumed_task_run_sees_the_same_batches_as_an_uninterrupted_one(tmp_path):
    def cfg():
        return tiny_config(variant="flt", loops=2, steps=7, checkpoint_every=3, eval_every=3, data="phop", hops=2,
                           alphabet=4, seed=2, diagnostics=dict(diagnostics=False))
    train(cfg(), tmp_path / "straight")
    with pytest.raises(KeyboardInterrupt):
        Trainer(cfg(), tmp_path / "resumed", callbacks=[Interrupt()]).fit()
    assert load_summary(tmp_path / "resumed") is None
    train(cfg(), tmp_path / "resumed")
    a, b = load_metrics(tmp_path / "straight"), load_metrics(tmp_path / "resumed")
    assert a.equals(b) and (a.metric == "val_accuracy").sum() == 3  # evaluations at steps 3, 6 and the end


def _accuracy_by_hand(run_dir, loops: int, batches: int) -> float:
    """The share of held-out phop answers (one letter each) the checkpoint gets right, counted here."""
    ckpt = torch.load(run_dir / "checkpoint.pt", weights_only=False)
    model = LoopedTransformer(ModelConfig(**ckpt["model_config"]))
    model.load_state_dict(ckpt["model"])
    cfg = tiny_config(data="phop")
    val = load_split(cfg.train, 64, "val")
    right = total = 0
    for i in range(batches):
        x, y = get_batch(val, 16, 64, batch_generator(VAL_SEED, i))
        with torch.no_grad():
            predicted = model(x, loops=loops).argmax(-1)
        for b, t in itertools.product(range(16), range(64)):
            if y[b, t] != IGNORE_INDEX:
                right, total = right + int(predicted[b, t] == y[b, t]), total + 1
    return right / total


def test_run_ablation_on_a_task_reports_accuracy_from_training_to_figures(tmp_path, capsys):
    out = tmp_path / "sweep"
    assert main(["run-ablation", "--data", "phop", "--loops", "1", "2", "--variants", "lt", "flt", "--steps", "3",
                 "--eval-batches", "2", "--no-diagnostics", "--device", "cpu", "--workers", "1", "--quiet",
                 "--out", str(out)]) == 0
    assert "val acc" in capsys.readouterr().out
    table = pd.read_csv(out / "summary.csv")
    assert table.val_accuracy.between(0, 1).all() and len(table) == 4
    cell = out / "cells" / "flt_K02_seed0_lr1"
    assert main(["eval-loops", str(cell)]) == 0
    printed = capsys.readouterr().out
    assert "best accuracy" in printed
    ev = pd.read_csv(cell / "eval_loops.csv")
    assert list(ev.loops) == [1, 2, 3, 4]  # 1 .. 2K by default
    assert ev.accuracy.iloc[1] == pytest.approx(_accuracy_by_hand(cell, 2, 2), abs=1e-12)
    assert ev.accuracy.iloc[1] == pytest.approx(table.set_index("cell").val_accuracy["flt_K02_seed0_lr1"])
    for figure in ("accuracy", "loops"):
        assert main(["plot", figure, str(out), "--out", str(tmp_path / "fig"), "--format", "png"]) == 0
    assert {p.name for p in (tmp_path / "fig").iterdir()} >= {"accuracy.png", "loops.png"}


def test_a_task_that_does_not_fit_the_sequence_is_refused_before_training(tmp_path, capsys):
    assert main(["run-ablation", "--data", "addition", "--operands", "10", "--digits", "5", "--loops", "1",
                 "--steps", "1", "--device", "cpu", "--out", str(tmp_path / "s")]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: addition: a problem takes") and len(err.splitlines()) == 1
    assert not (tmp_path / "s").exists()
