"""`flt-diag map --baseline ARCHIVE --variants NEW` end to end at toy scale (issue 64 part 5): a small baseline map
archived by the real commands, a toy stabiliser registered in one file as a user would (docs/extending.md), the new
variant mapped against the baseline: canaries run and agree, a tampered archived metric makes it refuse, and
`summary`, `plot breaking` and map.csv read old and new lines pooled. Bad input: one line, exit 2."""
import json
import shutil
import sys
from pathlib import Path

import pyarrow.parquet as pq
import pytest
import torch

import flt_diag
from flt_diag.cli import main
from flt_diag.config.variants import unregister_stabiliser
from flt_diag.storage.archive import META_KEY

SMALL = ["--loops", "2", "--seeds", "1", "--lo", "1", "--hi", "16", "--ratio", "4", "--criteria", "training",
         "--preset", "tiny", "--steps", "20", "--width", "16", "--depth", "1", "--heads", "2", "--eval-batches", "1",
         "--device", "cpu", "--workers", "1"]
TOY = flt_diag.Stabiliser(name="toy-damp", description="x_in + (1/2)(F(x_in) - x_in)", source="this test",
                          composes=True, part="damp", update=lambda part, x_in, x_out, t: x_in + 0.5 * (x_out - x_in),
                          parameters=lambda cfg: torch.nn.ParameterDict({}))


@pytest.fixture(scope="module")
def baseline(tmp_path_factory):
    """The baseline: `flt-diag map --archive-to` of FLT, one line over lr 1, 4, 16 (archived as it goes)."""
    root = tmp_path_factory.mktemp("baseline")
    assert main(["map", "--variants", "flt", *SMALL, "--out", str(root / "work" / "m"),
                 "--archive-to", str(root / "arch")]) == 0
    return root / "arch" / "m"


@pytest.fixture
def toy():
    flt_diag.register_stabiliser(TOY)
    yield TOY
    unregister_stabiliser(TOY.name)


def archived(folder: Path) -> dict:
    """(variant, lr) -> verdict of every probe record in a folder, read from the records' metadata by hand."""
    out = {}
    for p in folder.glob("*.parquet"):
        meta = json.loads(pq.read_schema(p).metadata[META_KEY])
        out[(meta["config"]["model"]["variant"], meta["config"]["train"]["lr_scale"])] = meta["summary"]["verdict"]
    return out


def test_a_toy_stabiliser_is_mapped_against_the_archived_baseline_and_pooled(baseline, toy, tmp_path, capsys):
    out = tmp_path / "pooled"
    assert main(["map", "--baseline", str(baseline), "--variants", "toy-damp", "--out", str(out)]) == 0
    text = capsys.readouterr().out
    n = len(list(baseline.glob("*.parquet")))
    assert text.count("first 16 steps bit for bit: agrees") == min(3, n)  # (the same machine made the baseline)
    spec = json.loads((out / "sweep.json").read_text())
    assert spec["variants"] == ["flt", "toy-damp"] and spec["baseline"]["variants"] == ["flt"]
    assert spec["canaries"][-1]["agree"] and not spec["canaries"][-1]["drift_accepted"]
    base = json.loads((baseline / "sweep.json").read_text())
    assert {k: spec[k] for k in ("grid", "loops", "seeds", "axis", "criteria")} == \
        {k: base[k] for k in ("grid", "loops", "seeds", "axis", "criteria")}
    new = {json.loads((d / "config.json").read_text())["model"]["variant"] for d in (out / "cells").iterdir()}
    assert new == {"toy-damp"}  # only the new variant's probes were run
    table = __import__("pandas").read_csv(out / "map.csv")
    assert set(table.variant) == {"flt", "toy-damp"}
    lt = table[table.variant == "flt"].iloc[0]  # the baseline's bracket, recomputed by hand from its records
    held = sorted(lr for (v, lr), verdict in archived(baseline).items() if verdict == "stable")
    broke = sorted(lr for (v, lr), verdict in archived(baseline).items() if verdict != "stable")
    assert lt.first_broken == broke[0] and (lt.last_ok == held[-1] if held else lt.status == "below grid")
    assert main(["summary", str(out)]) == 0
    rows = [line for line in capsys.readouterr().out.splitlines() if line.startswith("│ ")]
    assert any(r.split("│")[1].strip() == "flt" for r in rows) and any(r.split("│")[1].strip() == "toy-damp" for r in rows)
    assert main(["plot", "breaking", str(out)]) == 0 and (out / "figures" / "breaking.png").is_file()
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "analysis"))
    import stabiliser_benchmark as B
    text = B.report(out)  # the analysis reads variants, seeds, grid and K from the pooled map's spec
    assert B.bench_of(out) == B.Bench(("flt", "toy-damp"), (1,), (1.0, 4.0, 16.0), 2, (("flt", "two-sided"),))
    rows = {r.split("|")[1].strip() for r in text.splitlines() if r.startswith("| ")}
    assert {"flt (paper)", "toy-damp"} <= rows and "lines finished: 2 of 2" in text


def test_a_pooled_map_archived_as_it_goes_resumes_and_its_archive_stays_valid(baseline, tmp_path, capsys):
    """`map --baseline --archive-to`, started twice (the second start a resume, and a fresh folder resuming from the
    archive a third): each start records its canaries, which the archive's check does not take for another map."""
    out, arch = tmp_path / "work" / "pooled", tmp_path / "arch"
    for folder in (out, out, tmp_path / "fresh" / "pooled"):
        assert main(["map", "--baseline", str(baseline), "--variants", "lt", "--out", str(folder),
                     "--archive-to", str(arch)]) == 0, capsys.readouterr().err
    capsys.readouterr()
    assert len(json.loads((out / "sweep.json").read_text())["canaries"]) == 2
    assert {v for v, _ in archived(arch / "pooled")} == {"lt"}  # only the new runs archived
    assert main(["summary", str(arch / "pooled")]) == 0


def test_a_pooled_map_goes_to_lease_workers_with_submit(baseline, tmp_path, capsys):
    """`--submit local` with --baseline: canaries here, then the pooled map's lines claimed by lease workers
    (submitit's local executor); `--submit` with `--cell` is refused in one line."""
    pytest.importorskip("submitit")
    out = tmp_path / "pooled"
    code = main(["map", "--baseline", str(baseline), "--variants", "lt", "--out", str(out), "--cell", "0",
                 "--submit", "local"])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1 and "--cell" in err[0] and not out.exists()
    assert main(["map", "--baseline", str(baseline), "--variants", "lt", "--out", str(out), "--submit", "local",
                 "--workers", "1"]) == 0, capsys.readouterr().err
    assert "canar" in capsys.readouterr().out
    table = __import__("pandas").read_csv(out / "map.csv")
    assert set(table.variant) == {"flt", "lt"} and (table.status != "open").all()
    assert (out / "jobs").is_dir()  # (submitit's folder: the workers ran as its tasks)


def tamper(record: Path, step: int) -> None:
    """Add 1e-6 to the archived loss at one step (metadata kept)."""
    table = pq.read_table(record)
    df = table.to_pandas()
    df.loc[(df.metric == "loss") & (df.step == step), "value"] += 1e-6
    import pyarrow as pa
    pq.write_table(pa.Table.from_pandas(df, schema=table.schema, preserve_index=False), record)


def test_a_tampered_archived_metric_makes_it_refuse_unless_drift_is_accepted(baseline, toy, tmp_path, capsys):
    copy = tmp_path / "arch" / "m"
    shutil.copytree(baseline, copy)
    for record in sorted(copy.glob("*.parquet"))[:1]:
        tamper(record, 5)
    out = tmp_path / "pooled"
    assert main(["map", "--baseline", str(copy), "--variants", "toy-damp", "--out", str(out)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "does not reproduce" in err[0] and "loss at step 5" in err[0]
    assert not out.exists()  # refused before any new line
    assert main(["map", "--baseline", str(copy), "--variants", "toy-damp", "--out", str(out),
                 "--accept-baseline-drift"]) == 0
    last = json.loads((out / "sweep.json").read_text())["canaries"][-1]
    assert last["drift_accepted"] and not last["agree"]


def test_on_another_cpu_kind_the_outcome_at_the_boundary_is_compared(baseline, toy, tmp_path, capsys, monkeypatch):
    import flt_diag.grids.canaries as C
    monkeypatch.setattr(C, "cpu_info", lambda: {"model": "another CPU", "simd": ["sse2"]})
    out = tmp_path / "pooled"
    assert main(["map", "--baseline", str(baseline), "--variants", "toy-damp", "--out", str(out)]) == 0
    lines = [t for t in capsys.readouterr().out.splitlines() if t.startswith("canary ")]
    assert all("training outcome (another CPU kind): agrees" in t for t in lines)
    verdicts = archived(baseline)
    found = any(v != "stable" for v in verdicts.values()) and any(v == "stable" for v in verdicts.values())
    assert found and len(lines) == 2


@pytest.mark.parametrize("case", ["missing", "sweep", "no-spec", "half-written", "work-folder", "contradicts", "taken"])
def test_bad_baselines_are_one_line_and_exit_2(baseline, toy, tmp_path, capsys, case):
    arch, extra = tmp_path / "a" / "m", []
    if case != "missing":
        shutil.copytree(baseline, arch)
    if case == "sweep":
        spec = json.loads((arch / "sweep.json").read_text())
        (arch / "sweep.json").write_text(json.dumps({**spec, "kind": "sweep"}))
    if case == "no-spec":
        (arch / "sweep.json").unlink()
    if case == "half-written":
        record = sorted(arch.glob("*.parquet"))[0]
        record.write_bytes(record.read_bytes()[:200])
    if case == "work-folder":
        arch = baseline.parents[1] / "work" / "m"
    if case == "contradicts":
        extra = ["--seeds", "2"]
    variants = "flt" if case == "taken" else "toy-damp"
    code = main(["map", "--baseline", str(arch), "--variants", variants, *extra, "--out", str(tmp_path / "o")])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1 and "Traceback" not in err[0], err
    assert not (tmp_path / "o").exists()


def test_another_cpu_kinds_canary_is_the_training_outcome_and_a_changed_one_differs(baseline, tmp_path):
    from flt_diag.grids.canaries import boundary_probes, outcome_differs
    probes = boundary_probes(baseline)
    verdicts = archived(baseline)
    held = max(lr for (v, lr), verdict in verdicts.items() if verdict == "stable")
    broke = min(lr for (v, lr), verdict in verdicts.items() if verdict != "stable")
    assert [p.name for p in probes] == [f"flt_K02_seed1_lr{held:g}.parquet", f"flt_K02_seed1_lr{broke:g}.parquet"]
    assert outcome_differs(probes[1], tmp_path / "a") is None
    copy = tmp_path / probes[1].name  # the archived broken probe said to have held
    table = pq.read_table(probes[1])
    meta = json.loads(table.schema.metadata[META_KEY])
    meta["summary"]["verdict"] = "stable"
    pq.write_table(table.replace_schema_metadata({**table.schema.metadata, META_KEY: json.dumps(meta).encode()}), copy)
    assert "training held in the archive, broke here" in outcome_differs(copy, tmp_path / "b")
