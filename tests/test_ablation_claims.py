"""analysis/ablation_claims.py (part 2 of issue 56's plan): the climb tests against FLT by a full enumeration of the
splits and Holm by hand, the plan's reading of each outcome, no primary before the 30 runs are in, the L = 2 counts
against the archive read by pandas alone, and bad input as one line."""
import itertools
import sys
from pathlib import Path

import numpy as np
import pandas as pd
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "analysis"))
import ablation_claims as C  # noqa: E402

ROOT = Path(__file__).resolve().parents[1] / "docs" / "data" / "runs"


def depth_runs(climbs: dict) -> pd.DataFrame:
    rows = [dict(variant=v, loops=12, seed=11 + i, verdict="collapsed" if c > 0.25 else "stable", failed=c > 0.25,
                 climb=c, val_loss=1.6 + c, peak_any=10.0, peak=8.0, run=f"{v}{i}")
            for v, cs in climbs.items() for i, c in enumerate(cs)]
    return pd.DataFrame(rows)


def enumerated_p(x, y):
    ranks = pd.Series(np.concatenate([x, y])).rank().to_numpy()
    sums = np.array([ranks[list(c)].sum() for c in itertools.combinations(range(len(ranks)), len(x))])
    return np.mean(sums >= ranks[:len(x)].sum() - 1e-9)


def test_the_climb_tests_against_an_enumeration_and_holm_by_hand():
    flt = [0.02, 0.05, 0.01, 0.03, 0.04, 0.02]
    climbs = {"lt": [0.9, 0.8, 1.1, 0.7, 0.95, np.nan], "lt-ii": [0.03, 0.02, 0.05, 0.01, 0.04, 0.03],
              "lt-ai": [0.1, 0.02, 0.5, 0.01, 0.2, 0.03], "fla": [0.8, 0.6, 0.05, 0.9, 0.7, 0.75], "flt": flt}
    tests = C.climb_tests(depth_runs(climbs)).set_index("variant")
    for v in C.AGAINST_FLT:
        x = np.nan_to_num(np.array(climbs[v]), nan=np.inf)
        assert tests.loc[v, "p"] == pytest.approx(enumerated_p(x, np.array(flt)), rel=1e-9)
    p = tests.p.sort_values()
    assert tests.loc[p.index[0], "p_holm"] == pytest.approx(4 * p.iloc[0])
    assert tests.loc["lt", "reading"].endswith("reproduced") and "climbs more" in tests.loc["lt", "reading"]
    assert tests.loc["lt-ii", "reading"].startswith("no climb")  # interval below the partial effect
    assert tests.loc["lt-ai", "reading"] == "inconclusive at this power"


def test_no_primary_before_every_depth_run_is_in():
    climbs = {v: [0.02] * 6 for v in C.AGAINST_FLT + ["flt"]}
    runs = depth_runs(climbs)
    text = "\n".join(C.depth_section(runs.iloc[:-1], final=False))
    assert "not read yet (29 of 30" in text and "Holm" not in text
    assert "Holm over 4" in "\n".join(C.depth_section(runs, final=False))
    assert "Holm over 4" in "\n".join(C.depth_section(runs.iloc[:-1], final=True))


def test_the_shallow_counts_against_the_archive_read_by_pandas():
    import pyarrow.parquet as pq
    import json
    verdicts = []
    for f in sorted((ROOT / "gradient-path" / "f-0").glob("lt_*.parquet")):
        meta = json.loads(pq.read_schema(f).metadata[b"flt_diag.archive"])
        verdicts.append(meta["summary"]["verdict"])
    text = "\n".join(C.shallow_section(ROOT))
    failed = sum(v != "stable" for v in verdicts)
    assert f"| K = 9 | lt | {failed}/{len(verdicts)} " in text


def test_bad_input_is_one_line(tmp_path, capsys):
    assert C.main([str(tmp_path / "missing")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("error:")
