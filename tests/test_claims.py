"""analysis/check_claims.py (issue 53): the claims of docs/results.md and docs/early-warning.md against the run
archive and the committed CSVs. On the committed pages and data every claim passes; a planted wrong number, a
retracted statement said again, or a changed data file fails it (exit 1, the claim named); bad input is one
error line. The main corrections are also recomputed here from the archive's Parquet files alone (pyarrow and
json, not flt_diag's readers)."""
from __future__ import annotations

import json
import sys
from pathlib import Path

import pyarrow.parquet as pq
import pytest

ROOT = Path(__file__).resolve().parents[1]
RESULTS, EARLY = ROOT / "docs" / "results.md", ROOT / "docs" / "early-warning.md"
ARCHIVE = ROOT / "docs" / "data" / "runs" / "gradient-path"


sys.path.insert(0, str(ROOT / "analysis"))
import check_claims as CC  # noqa: E402


@pytest.fixture(scope="module")
def claims():
    return CC.all_claims(ROOT / "docs" / "data")


def pages(results: str | None = None) -> dict[str, str]:
    return {"results": RESULTS.read_text(encoding="utf-8") if results is None else results,
            "early-warning": EARLY.read_text(encoding="utf-8")}


def planted(old: str, new: str) -> str:
    text = RESULTS.read_text(encoding="utf-8")
    assert text.count(old) == 1
    return text.replace(old, new)


def failures(lines) -> list[str]:
    return [line for ok, line in lines if not ok]


def test_every_claim_of_the_committed_pages_passes(claims):
    assert failures(CC.check(pages(), claims)) == []
    assert len(claims["results"]) > 40 and len(claims["early-warning"]) > 15


def test_the_exit_status_is_1_on_any_failure(claims, monkeypatch, tmp_path, capsys):
    monkeypatch.setattr(CC, "all_claims", lambda data: claims)  # computed once (the fixture)
    assert CC.main([]) == 0
    page = tmp_path / "results.md"
    page.write_text(planted("(median 0.83, effective rank 19)", "(median 0.85, effective rank 19)"), encoding="utf-8")
    assert CC.main(["--results", str(page)]) == 1
    out = capsys.readouterr().out
    assert "FAIL results: (median 0.83, effective rank 19)" in out and out.rstrip().endswith("1 failed")


def test_a_planted_wrong_number_fails(claims):
    page = planted("every truncated LT run climbed 0.27-0.56", "every truncated LT run climbed 0.27-0.60")
    assert failures(CC.check(pages(page), claims)) == [
        "results: none is `unstable` by the gradient-oscillation rule; every truncated LT run climbed 0.27-0.56 nats"]


def test_a_retracted_statement_said_again_fails(claims):
    page = planted("These are medians, not every run:",
                   "The spectral radius of the loop map at the stream is above 1 in every arm. These are medians:")
    assert [line.split(" (")[0] for line in failures(CC.check(pages(page), claims))] == [
        "results: not said again: 'spectral radius of the loop map at the stream is above 1 in every arm'"]


def test_a_changed_data_file_fails(tmp_path):
    data = tmp_path / "data"
    data.mkdir()
    text = (ROOT / "docs" / "data" / "loop-dynamics-w4.csv").read_text()
    changed = text.replace(",3.697248697280884,", ",1.697248697280884,", 1)  # LT-AI's smallest gain at L = 6
    assert changed != text
    (data / "loop-dynamics-w4.csv").write_text(changed)
    assert failures(CC.check(pages(), {"results": CC.w4_claims(data)})) == [
        "results: gain over the loops of 5.4-9.7, far above 1, and LT-AI at L = 6 (all stable at 600 steps) at "
        "1.7-8.1; LT-II's stays at 0.04-0.17"]
    assert not failures(CC.check(pages(), {"results": CC.w4_claims(ROOT / "docs" / "data")}))


@pytest.mark.parametrize("args", [["--results", "/nonexistent/results.md"], ["--data", "/nonexistent"],
                                  ["--bogus"]])
def test_bad_input_is_one_error_line(args, capsys):
    try:
        rc = CC.main(args)
    except SystemExit as e:  # argparse's refusal
        rc = e.code
    err = capsys.readouterr().err
    assert rc == 2
    assert err.count("\n") == 1 and err.startswith("error: "), err


# ----------------------------------------------------------------------------- the corrections, from Parquet alone
def records():
    for path in sorted(ARCHIVE.glob("f-*/*.parquet")):
        f = pq.ParquetFile(path)
        meta = json.loads(f.schema_arrow.metadata[b"flt_diag.archive"])
        yield meta, f.read().to_pandas()


def arm(meta) -> str:
    k, K = meta["config"]["train"].get("grad_loops", 0), meta["config"]["model"]["loops"]
    return meta["config"]["model"]["variant"].upper() + (" full" if k in (0, K) else f" k={k}")


def test_the_corrections_hold_in_the_archive():
    runs = []
    for meta, df in records():
        K = meta["config"]["model"]["loops"]
        last = df[df.metric == "loop_spectral_radius"].step.max()
        at = df[(df.step == last) & (df.loop == K)].set_index("metric").value
        ev = meta["summary"]["evidence"]
        runs.append(dict(arm=arm(meta), verdict=meta["summary"]["verdict"], spike=ev["transient_rebound"],
                         climb=ev["climb"], osc=ev["osc_dlog_median"], rho=at["loop_spectral_radius"],
                         residual=at["loop_spectral_residual"]))
    truncated = [r for r in runs if r["arm"] == "LT k=2"]
    full = [r for r in runs if r["arm"] == "LT full"]
    flt = [r for r in runs if r["arm"] == "FLT k=2"]
    assert len(truncated) == len(full) == len(flt) == 10
    unstable = [r for r in truncated if r["verdict"] == "unstable"]
    assert len(unstable) == 8 and all(r["spike"] for r in unstable)  # recovered spikes, not oscillation
    assert (round(min(r["climb"] for r in truncated), 2), round(max(r["climb"] for r in truncated), 2)) == (0.27, 0.56)
    assert max(r["osc"] for r in truncated) < 0.405465 < max(r["osc"] for r in full)  # log 1.5
    assert max(r["osc"] for r in truncated) < min(r["osc"] for r in full)  # no overlap
    assert sum(r["rho"] < 1 for r in flt) == 4 and all(r["rho"] > 1 for r in full + truncated)
    assert [sum(r["residual"] < 0.01 for r in g) for g in (full, truncated, flt)] == [7, 3, 7]
    said = " ".join(RESULTS.read_text(encoding="utf-8").split())
    for text in ("The 8 truncated `unstable` runs are all recovered loss spikes", "climbed 0.27-0.56 nats",
                 "in FLT k=2 ρ is below 1 in 4 of 10 runs", "in 7 of 10 LT full, 3 of 10 LT k=2 and 7 of 10 FLT k=2 runs"):
        assert text in said, text


# ----------------------------------------------------------------------------- the paper's claims at L = 6 (issue 56)
DEPTH = ROOT / "docs" / "data" / "runs" / "ablation-claims-depth"


def depth_records() -> dict[str, list[dict]]:
    """Per variant: verdict, climb, val loss and the two peaks recomputed from the recorded norms (Parquet alone)."""
    out: dict[str, list[dict]] = {}
    for path in sorted(DEPTH.glob("*.parquet")):
        f = pq.ParquetFile(path)
        meta = json.loads(f.schema_arrow.metadata[b"flt_diag.archive"])
        df, s, K = f.read().to_pandas(), meta["summary"], meta["config"]["model"]["loops"]
        out.setdefault(s["variant"], []).append(dict(
            verdict=s["verdict"], climb=s["evidence"]["climb"], val=s["val_loss"],
            any=df[df.metric == "resid_norm"].value.max(),
            final=df[(df.metric == "resid_norm_loop_end") & (df.loop == K)].value.max()))
    return out


def exact_greater_p(x: list[float], y: list[float]) -> float:
    """One-sided exact Mann-Whitney p by enumerating every split of the pooled values into the groups' sizes."""
    from itertools import combinations
    pooled = x + y
    assert len(set(pooled)) == len(pooled)  # no ties (else U needs half counts)
    def u(idx):
        rest = [j for j in range(len(pooled)) if j not in idx]
        return sum(pooled[i] > pooled[j] for i in idx for j in rest)
    observed = u(range(len(x)))
    splits = list(combinations(range(len(pooled)), len(x)))
    return sum(u(c) >= observed for c in splits) / len(splits)


def test_the_depth_reading_holds_in_the_archive():
    runs = depth_records()
    assert {v: len(r) for v, r in runs.items()} == {v: 6 for v in ("lt", "lt-ii", "lt-ai", "fla", "flt")}
    verdicts = {v: sorted(r["verdict"] for r in rs) for v, rs in runs.items()}
    assert verdicts["lt"] == ["collapsed"] * 2 + ["stalled"] * 4
    assert verdicts["fla"] == ["collapsed"] * 5 + ["unstable"]
    assert all(verdicts[v] == ["stable"] * 6 for v in ("lt-ii", "lt-ai", "flt"))
    climbs = {v: [r["climb"] for r in rs] for v, rs in runs.items()}
    p = {v: exact_greater_p(climbs[v], climbs["flt"]) for v in ("lt", "fla")}
    assert p == pytest.approx({"lt": 1 / 924, "fla": 1 / 924})  # every LT and FLA climb above every FLT climb
    said = " ".join(RESULTS.read_text(encoding="utf-8").split())
    assert "| lt | 6 vs 6 | 0.071 (0.037) | 0.00108 (0.00433) |" in said  # Holm: 4 x 1/924, the smallest p
    assert "| fla | 6 vs 6 | 0.760 (0.037) | 0.00108 (0.00433) |" in said
    fla_any, lt_any = [r["any"] for r in runs["fla"]], [r["any"] for r in runs["lt"]]
    assert min(lt_any) < min(fla_any) and max(fla_any) < max(lt_any)  # "inside LT's range"
    assert max(r["final"] for r in runs["fla"]) < min(r["final"] for r in runs["lt"])  # below LT's at the final loop
    rng = lambda xs: f"{min(xs):.0f}-{max(xs):.0f}"  # noqa: E731
    assert (f"at any loop is {rng(fla_any)}," in said and f"inside LT's range ({rng(lt_any)})" in said
            and f"({rng([r['final'] for r in runs['fla']])} against {rng([r['final'] for r in runs['lt']])})" in said)


def test_a_planted_wrong_depth_number_fails(claims):
    page = planted("6 of 6 FLA runs failed (5 collapsed, 1 unstable)", "6 of 6 FLA runs failed (6 collapsed)")
    assert failures(CC.check(pages(page), claims)) == [
        "results: (p_Holm 0.0043, shift +0.724 [+0.415, +0.961] nats): 6 of 6 FLA runs failed (5 collapsed, 1 unstable),"
        " FLT 0 of 6 (one-sided Fisher p = 0.00108)"]


# ---------------------------------------------------------------- round two's stage B, from Parquet alone
BENCH_2 = ROOT / "docs" / "data" / "runs" / "stabiliser-bench-2"


def stage_b_records() -> dict[tuple[str, float, int], tuple[str, float]]:
    """(variant, lr, seed) -> (verdict, val loss) of every archived run at lr x 0.5-4 on the selection seeds at the
    strength stage A chose (parcae-source x 2, every other x 1: the page's stage-A reading), read with pyarrow."""
    out = {}
    for path in sorted(BENCH_2.glob("[AB]*/**/*.parquet")):
        meta = json.loads(pq.ParquetFile(path).schema_arrow.metadata[b"flt_diag.archive"])
        model, train, summary = meta["config"]["model"], meta["config"]["train"], meta["summary"]
        chosen = 2.0 if model["variant"] == "parcae-source" else 1.0
        if float(model.get("strength") or 1.0) == chosen and train["seed"] in (101, 102):
            out[(model["variant"], float(train["lr_scale"]), int(train["seed"]))] = (summary["verdict"],
                                                                                    summary["val_loss"])
    return out


def test_the_stage_b_reading_holds_in_the_archive():
    """The best lrs of results.md's stage-B reading, by the plan's rule written out: the lowest mean val loss over
    both seeds among the lrs where both are `stable`."""
    runs = stage_b_records()
    variants = sorted({v for v, _, _ in runs})
    assert len(variants) == 12 and all((v, lr, s) in runs for v in variants for lr in (0.5, 1, 2, 4)
                                       for s in (101, 102))
    best = {}
    for v in variants:
        means = {lr: (runs[(v, lr, 101)][1] + runs[(v, lr, 102)][1]) / 2 for lr in (0.5, 1.0, 2.0, 4.0)
                 if runs[(v, lr, 101)][0] == runs[(v, lr, 102)][0] == "stable"}
        best[v] = min(means, key=means.get) if means else None
    assert best == {"lt": 0.5, "lt-ii": 0.5, "lt-ai": 1.0, "fla": 0.5, "flt": 1.0, "parcae-source": 1.0,
                    "huginn": 1.0, "stars-source": None, "jacobian-fro-source": None, "residual-scale": 1.0,
                    "deeploop": 1.0, "loop-embed": 0.5}
    said = " ".join(RESULTS.read_text(encoding="utf-8").split())
    assert ("stage B chose lr × 1 for lt-ai, flt, parcae-source, huginn, residual-scale and deeploop and × 0.5 for "
            "lt, lt-ii, fla and loop-embed") in said


def test_a_planted_wrong_stage_b_number_fails(claims):
    page = planted("(ended at step 481, index 0.439)", "(ended at step 481, index 0.349)")
    assert failures(CC.check(pages(page), claims)) == [
        "results: at × 0.5 jacobian-fro-source was `unstable` on seed 101 (ended at step 481, index 0.439) and "
        "`stable` on seed 102 (index 0.396)"]


def test_a_planted_wrong_stage_d_number_fails_and_only_a_first_letter_may_change_case(claims):
    """Stage D's reading (2026-12-07): a planted margin fails; a claim at a sentence's start matches with its first
    letter upper-case, and with no other change of case."""
    page = planted("lt-ai 64, flt 64, huginn 64, residual-scale 8", "lt-ai 64, flt 64, huginn 32, residual-scale 8")
    assert [line[:60] for line in failures(CC.check(pages(page), claims))] == [
        "results: by median margin (breaking lr over best lr, seeds 1-3): lt-ii 128"[:60]]
    said = {"results": "Abc def. x", "early-warning": ""}
    assert failures(CC.check(said, {"results": ["abc def"], "early-warning": []})) == []
    assert failures(CC.check({"results": "ABC def", "early-warning": ""}, {"results": ["abc def"], "early-warning": []}))
