"""Round two's stage-D reading as check_claims recomputes it (analysis/benchmark_2_claims.py stage_d_claims), on a
table written by hand: margins sorted, a variant with no finished line named instead of a "nan", a line that held at
the grid's top left out of the kinds, the breaking lr below the best lr, and censored lines read from the probes."""
from __future__ import annotations

import sys
from pathlib import Path
from types import SimpleNamespace

import pandas as pd
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "analysis"))
import benchmark_2_claims as C  # noqa: E402
import benchmark_2_cpu as CPU  # noqa: E402


def _table():
    return pd.DataFrame([
        dict(variant="flt", lines=3, breaking=64.0, margin=64.0, kinds="stalled stalled held", stopped="", open=0),
        dict(variant="lt", lines=3, breaking=1.0, margin=2.0, kinds="unstable collapsed unstable", stopped="", open=0),
        dict(variant="stars", lines=2, breaking=0.125, margin=0.25, kinds="unstable unstable", stopped="", open=0),
        dict(variant="parcae", lines=0, breaking=float("nan"), margin=float("nan"), kinds="", stopped="", open=2),
    ])


def _probes():
    """(variant, seed, lr, verdict): flt seed 1 held at 256 (the grid's top); stars seed 2 broke at 1/16."""
    rows = [("flt", 1, 128.0, "stable"), ("flt", 1, 256.0, "stable"), ("stars", 2, 0.0625, "unstable"),
            ("lt", 1, 0.5, "stable"), ("lt", 1, 1.0, "unstable"), ("parcae", 1, 4.0, "stable")]
    return pd.DataFrame([dict(variant=v, seed=s, lr=lr, verdict=vd, path=f"{v}-{s}-{lr:g}", val_loss=1.7)
                         for v, s, lr, vd in rows])


STOPS = {"stars-2-0.0625": "decided at step 200: training broken (a closed gradient-oscillation window fired at "
                           "step 200)", "lt-1-1": "decided at step 300: training broken (the smoothed loss climbed "
                           "past the spike threshold at step 300)"}


def test_the_stage_d_sentences_from_a_table_by_hand(monkeypatch):
    monkeypatch.setattr(C, "stage_d", lambda data: (_table(), _probes()))
    monkeypatch.setattr(CPU, "mixed_lines", lambda probes: ["lt seed 1"])
    monkeypatch.setattr(C, "load_summary", lambda path: SimpleNamespace(stop_reason=STOPS.get(str(path))))
    said = C.stage_d_claims(Path("unused"))
    assert said == [
        "8 lines of stage D are finished and 2 open, with 6 probes",
        "by median margin (breaking lr over best lr, seeds 1-3): flt 64, lt 2, stars 0.25; no margin yet (no line "
        "finished): parcae",
        "every breaking probe of flt is `stalled`",
        "those of lt and stars are `unstable`, `collapsed` or `diverged`",
        "the breaking lr is below the best lr for stars (0.25)",
        "censored: broke at the grid's lowest lr (× 1/16): stars seed 2; held at its highest (× 256): flt seed 1",
        "of the 2 breaking probes, the gradient-oscillation window decided 1 and the climb past the spike threshold 1",
        "× 0.5 held on every line of lt",
        "the median val loss of the runs at that lr: × 0.5: lt 1.700",
        "lines with probes of both CPU kinds: lt seed 1",
    ]


def test_no_stage_d_is_a_lookup_error_not_a_traceback(tmp_path):
    with pytest.raises(LookupError):
        C.stage_d(tmp_path)


def test_the_2000_step_sentences_from_runs_by_hand(monkeypatch):
    """flt seeds 1-2 at 1.50 and 1.60 (seed 2 `unstable`), parcae seed 1 at 1.40; stage C's medians at 600 steps
    1.66 and 1.64: the runs in, medians lowest first with ranges, the gaps to 600 steps, the run not stable."""
    runs = pd.DataFrame([dict(variant="flt", seed=2, val_loss=1.60, verdict="unstable"),
                         dict(variant="flt", seed=1, val_loss=1.50, verdict="stable"),
                         dict(variant="parcae", seed=1, val_loss=1.40, verdict="stable")])
    c_runs = pd.DataFrame([dict(variant="flt", val_loss=x) for x in (1.65, 1.67)]
                          + [dict(variant="parcae", val_loss=1.64)])
    monkeypatch.setattr(C.B2, "read_archive", lambda root: {"L2000": (runs, 0)})
    monkeypatch.setattr(C, "stage_c", lambda data: (None, c_runs))
    assert C.long_run_claims(Path("unused")) == [
        "3 of the 16 runs of 2,000 steps are archived (parcae: seeds 1; flt: seeds 1 2)",
        "median val loss at 2,000 steps, lowest first: parcae 1.400 (1.400-1.400, 1 seed), flt 1.550 (1.500-1.600, "
        "2 seeds)",
        "below its stage-C median at 600 steps by parcae 0.240, flt 0.110",
        "1 of them not `stable` (flt seed 2: `unstable`)",
    ]
    monkeypatch.setattr(C.B2, "read_archive", lambda root: {"L2000": None})
    with pytest.raises(LookupError):
        C.long_run_claims(Path("unused"))


def test_a_script_that_refuses_in_its_own_main_shows_no_held_warnings(capsys, monkeypatch):
    """script_exit.guarded holds a library's warnings back; a main that said its own one error line and returned 2
    must not have them shown after it (before: the error line, then the warnings: three lines)."""
    import warnings
    from script_exit import guarded

    def main_that(code):
        @guarded
        def main(argv=None):
            warnings.warn("invalid value encountered", RuntimeWarning)
            if code:
                print("error: refused", file=sys.stderr)
            return code
        return main
    shown = []  # (what guarded shows, recorded here: pytest's own warnings capture may stand in for stderr)
    monkeypatch.setattr(warnings, "showwarning", lambda message, *rest, **kw: shown.append(str(message)))
    assert main_that(2)() == 2 and capsys.readouterr().err.strip().splitlines() == ["error: refused"] and shown == []
    assert main_that(0)() == 0 and shown == ["invalid value encountered"]


@pytest.mark.parametrize("raised, said", [(AttributeError("'DataFrame' object has no attribute 'set'"), "lacks a column"),
                                          (KeyError("gain_last"), "lacks the column 'gain_last'")])
def test_check_claims_on_a_table_without_a_column_is_one_line(monkeypatch, capsys, raised, said):
    import check_claims as CC

    def fails(data):
        raise raised
    monkeypatch.setattr(CC, "all_claims", fails)
    assert CC.main([]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: a data table under ") and said in err[0]
