"""Round six of the reliability work, its third hunt (2026-12-07): the less-read paths. A reference checkpoint
imported as a stabiliser, an imported model without its tokenizer, an eval_loops table edited by hand, an output
file that would replace a run's own data, two predictors of one file name, an archived cell given to eval-loops,
and the analysis scripts on an unfinished run: each one `error:` line (or one clear skip), nothing written."""
import json
import sys
from pathlib import Path

import pandas as pd
import pytest
import torch

from flt_diag.cli import main
from flt_diag.model.transformer import LoopedTransformer, ModelConfig
from flt_diag.training.reference import export_reference

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT / "analysis"), str(Path(__file__).resolve().parent)]
from cli_errors import one_error_line  # noqa: E402
from fake_runs import make_run  # noqa: E402

TRAIN = ["train", "--steps", "3", "--device", "cpu", "--preset", "tiny", "--loops", "2", "--depth", "1"]


@pytest.fixture(scope="module")
def finished_run(tmp_path_factory):
    run = tmp_path_factory.mktemp("done") / "run1"
    assert main([*TRAIN, "--out", str(run)]) == 0
    return run


def reference_checkpoint(folder: Path, vocab: int = 256) -> Path:
    torch.manual_seed(0)
    model = LoopedTransformer(ModelConfig(vocab_size=vocab, depth=1, width=32, heads=2, seq_len=32, loops=2))
    path = folder / "model_000001.pt"
    torch.save(export_reference(model), path)
    return path


# --------------------------------------------------------------------------- import-reference

@pytest.mark.parametrize("variant", ["parcae", "flt+residual-scale", "huginn"])
def test_a_reference_checkpoint_imported_as_a_stabiliser_is_one_line(tmp_path, capsys, variant):
    """The reference trains the paper's five only: a stabiliser's parameters are not in its checkpoints (before:
    load_state_dict's RuntimeError as a traceback)."""
    ckpt = reference_checkpoint(tmp_path)
    code = main(["import-reference", str(ckpt), "--out", str(tmp_path / "imp"), "--variant", variant,
                 "--loops", "2", "--heads", "2"])
    assert code == 2 and "not one the reference trains" in one_error_line(capsys)
    assert not (tmp_path / "imp").exists()
    assert main(["import-reference", str(ckpt), "--out", str(tmp_path / "ok"), "--variant", "FLT", "--loops", "2",
                 "--heads", "2"]) == 0


def _tokenizer(path: Path, size: int) -> Path:
    tokenizers = pytest.importorskip("tokenizers")
    from tokenizers import models, pre_tokenizers, trainers
    tok = tokenizers.Tokenizer(models.BPE(unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.train_from_iterator([f"word{i} other{i % 7} thing{i % 13}" for i in range(400)],
                            trainers.BpeTrainer(vocab_size=size, special_tokens=["[UNK]"]))
    tok.save(str(path))
    return path


def test_an_imported_model_without_its_tokenizer_is_one_line_at_eval_loops(tmp_path, capsys):
    """A 300-token reference imported without --tokenizer: eval-loops says what to set (before: `cannot load
    tokenizer None: stat: path should be string...`); given --tokenizer, config.json names it; a tokenizer larger
    than the checkpoint's vocabulary is refused before the folder is made."""
    ckpt = reference_checkpoint(tmp_path, vocab=300)
    common = ["--variant", "flt", "--loops", "2", "--heads", "2", "--vocab-size", "300"]
    assert main(["import-reference", str(ckpt), "--out", str(tmp_path / "bare"), *common]) == 0
    capsys.readouterr()
    assert main(["eval-loops", str(tmp_path / "bare"), "--loops", "1", "--batches", "1"]) == 1
    assert "train.tokenizer null" in capsys.readouterr().err
    small = _tokenizer(tmp_path / "small.json", 280)
    assert main(["import-reference", str(ckpt), "--out", str(tmp_path / "named"), *common,
                 "--tokenizer", str(small)]) == 0
    assert json.loads((tmp_path / "named" / "config.json").read_text())["train"]["tokenizer"] == str(small.resolve())
    big = _tokenizer(tmp_path / "big.json", 600)
    capsys.readouterr()
    assert main(["import-reference", str(ckpt), "--out", str(tmp_path / "wrong"), *common,
                 "--tokenizer", str(big)]) == 2
    assert "more than the checkpoint's vocabulary of 300" in one_error_line(capsys)
    assert not (tmp_path / "wrong").exists()


# --------------------------------------------------------------------------- eval_loops.csv edited by hand

@pytest.mark.parametrize("table, said", [
    ("loops,trained_loops,val_loss,data\n1,two,5,stdlib\n", "column trained_loops holds 'two'"),
    ("k,loss\n12,3\n", "no loops and val_loss column"),
    ("loops,val_loss\n0,3\n", "whole numbers >= 1"),
    ("loops,val_loss\n,3\n", "without its loop count"),
])
def test_a_hand_edited_eval_loops_table_is_one_line_in_plot_and_report(tmp_path, capsys, table, said):
    """Before: `plot loops` compared an int with a str (TypeError) or read a column that was not there."""
    runs = [make_run(tmp_path / name, "flt", 2) for name in ("a", "b")]
    pd.DataFrame(dict(loops=[1, 2], trained_loops=[2, 2], val_loss=[4.0, 3.0], data="stdlib")).to_csv(
        runs[0] / "eval_loops.csv", index=False)
    (runs[1] / "eval_loops.csv").write_text(table)
    for command in (["plot", "loops", str(runs[0]), str(runs[1]), "--out", str(tmp_path / "fig")],
                    ["report", str(runs[1]), "--out", str(tmp_path / "r.html")]):
        assert main(command) == 2, command
        assert said in one_error_line(capsys)
    assert not (tmp_path / "r.html").exists()


def test_the_benchmark_reader_names_a_damaged_eval_loops_table(tmp_path, capsys):
    import stabiliser_benchmark_2 as S
    run = make_run(tmp_path / "C" / "flt-1", "flt", 12, seed=1)
    (run / "eval_loops.csv").write_text("k,loss\n12,3\n")
    assert S.main([str(tmp_path)]) == 2
    assert "no loops and val_loss column" in one_error_line(capsys)


# --------------------------------------------------------------------------- an output over a run's own data

def test_an_output_file_that_is_a_runs_own_data_is_refused_and_kept(finished_run, tmp_path, capsys):
    """predict --csv, report --out and fit-predictor --out naming a config, a summary table or a sweep's spec: one
    line, the file unchanged (before: replaced by the output)."""
    sweep = tmp_path / "sweep"
    assert main(["run-ablation", "--variants", "lt", "flt", "--loops", "2", "--steps", "3", "--depth", "1",
                 "--device", "cpu", "--out", str(sweep)]) == 0
    capsys.readouterr()
    cases = [(["predict", str(finished_run), "--at", "2", "--csv"], finished_run / "config.json"),
             (["predict", str(sweep), "--at", "2", "--csv"], sweep / "summary.csv"),
             (["report", str(sweep), "--out"], sweep / "sweep.json"),
             (["fit-predictor", str(sweep), "--at", "2", "--out"], next((sweep / "cells").iterdir()) / "summary.json")]
    cases.append((["summary", str(sweep), "--sensitivity", "--sensitivity-csv"], sweep / "sweep.json"))
    for command, target in cases:
        before = target.read_bytes()
        assert main([*command, str(target)]) == 2, command
        assert "would replace it" in one_error_line(capsys)
        assert target.read_bytes() == before
    pending = finished_run / "eval_loops.csv"  # (not written yet: still the run's own name)
    assert main(["predict", str(finished_run), "--at", "2", "--csv", str(pending)]) == 2
    assert "(not written yet)" in one_error_line(capsys) and not pending.exists()
    assert main(["report", str(sweep), "--out", str(sweep / "report.html")]) == 0  # (its default name: allowed)


def test_archive_refuses_an_eval_loops_table_its_readers_would_refuse(finished_run, tmp_path, capsys):
    import shutil
    run = tmp_path / "run"
    shutil.copytree(finished_run, run)
    (run / "eval_loops.csv").write_text("loops,trained_loops,val_loss\n1,two,5\n")
    assert main(["archive", str(run), "--to", str(tmp_path / "arch")]) == 2
    assert "column trained_loops holds 'two'" in one_error_line(capsys)
    assert not list(tmp_path.glob("arch/**/*.parquet"))  # (nothing archived)


def test_two_outputs_naming_one_file_are_refused(finished_run, tmp_path, capsys):
    same = tmp_path / "p.json"
    assert main(["fit-predictor", str(finished_run), "--at", "2", "--out", str(same), "--examples-out",
                 str(same)]) == 2
    assert "name the same file" in one_error_line(capsys) and not same.exists()
    assert main(["predict", str(finished_run), "--at", "2", "--csv", str(tmp_path / "x.png"), "--figure",
                 str(tmp_path / "x.png")]) == 2
    assert "name the same file" in one_error_line(capsys)


# --------------------------------------------------------------------------- predict --figure

def test_two_predictors_of_one_file_name_are_two_curves(finished_run, tmp_path, monkeypatch):
    """a/p.json and b/p.json were one curve (keyed by the file's stem); now each is named by its path."""
    from flt_diag.results.figures import agreement
    from flt_diag.storage.predictor_names import PACKAGED
    drawn = {}
    real = agreement.draw_agreement
    monkeypatch.setattr(agreement, "draw_agreement", lambda curves, runs=None: drawn.update(curves) or real(curves, runs))
    paths = []
    for name in ("a", "b"):
        (tmp_path / name).mkdir()
        paths.append(tmp_path / name / "p.json")
        paths[-1].write_bytes(Path(PACKAGED).read_bytes())
    assert main(["predict", str(finished_run), "--at", "100", "--predictor", *map(str, paths),
                 "--figure", str(tmp_path / "f.png")]) == 0
    assert sorted(drawn) == sorted(map(str, paths)) and (tmp_path / "f.png").is_file()


def test_more_predictors_than_line_styles_are_refused_before_any_work(finished_run, tmp_path, capsys):
    from flt_diag.results.figures.agreement import STYLES
    from flt_diag.storage.predictor_names import PACKAGED
    names = []
    for i in range(len(STYLES) + 1):
        names.append(str(tmp_path / f"p{i}.json"))
        Path(names[-1]).write_bytes(Path(PACKAGED).read_bytes())
    assert main(["predict", str(finished_run), "--at", "100", "--predictor", *names, "--figure",
                 str(tmp_path / "f.png")]) == 2
    assert f"at most {len(STYLES)} predictors" in one_error_line(capsys)
    assert not (tmp_path / "f.png").exists()


# --------------------------------------------------------------------------- eval-loops on an archived cell

def test_eval_loops_names_an_archived_cell_as_a_record(tmp_path, capsys):
    """A sweep one of whose cells is kept as its record (as a campaign resumed from its archive holds them): the
    record is named as such and skipped, the other cell evaluated (before: "no final checkpoint yet")."""
    import shutil
    sweep = tmp_path / "sweep"
    assert main(["run-ablation", "--variants", "lt", "flt", "--loops", "2", "--steps", "3", "--depth", "1",
                 "--device", "cpu", "--out", str(sweep)]) == 0
    cell = sweep / "cells" / "lt_K02_seed0_lr1"
    assert main(["archive", str(cell), "--to", str(tmp_path / "rec")]) == 0
    shutil.move(str(tmp_path / "rec" / f"{cell.name}.parquet"), str(sweep / f"{cell.name}.parquet"))
    shutil.rmtree(cell)
    capsys.readouterr()
    assert main(["eval-loops", str(sweep), "--loops", "1", "--batches", "1"]) == 0
    out = capsys.readouterr().out
    assert "an archive record (no checkpoint kept), skipped" in out and "no final checkpoint yet" not in out
    assert (sweep / "cells" / "flt_K02_seed0_lr1" / "eval_loops.csv").is_file()


# --------------------------------------------------------------------------- the analysis scripts

def test_check_claims_names_an_unfinished_run_of_the_factorial(tmp_path, capsys):
    """A gradient-path run without its summary (unfinished, or damaged in a copy): one line naming it (before: an
    AttributeError from run_row)."""
    import check_claims as CC
    run = make_run(tmp_path / "runs" / "gradient-path" / "f-0", "lt", 3, finished=False)  # (a folder of one run)
    with pytest.raises(ValueError, match="has no summary"):
        CC.factorial_runs(tmp_path)
    assert (run / "config.json").is_file()


def test_a_checkpoint_that_still_does_not_load_is_one_line(tmp_path, monkeypatch, capsys):
    """Whatever load_state_dict still refuses after the name and shape checks is one line, no folder made."""
    def refuse(self, state, *a, **k):
        raise RuntimeError("Error(s) in loading state_dict for LoopedTransformer:\n\tsomething else")
    ckpt = reference_checkpoint(tmp_path)
    monkeypatch.setattr(LoopedTransformer, "load_state_dict", refuse)
    assert main(["import-reference", str(ckpt), "--out", str(tmp_path / "imp"), "--variant", "FLT", "--loops", "2",
                 "--heads", "2"]) == 2
    assert "reference checkpoint: Error(s) in loading state_dict" in one_error_line(capsys)
    assert not (tmp_path / "imp").exists()
