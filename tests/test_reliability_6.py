"""Reliability, round six (issue 67, items 1, 2 and 7): a quantity derived from two options never overflows
into a traceback; every file an analysis script is named is read through the bounded, regular-file-only
reader; a refusal leaves nothing it created and names the path for what it is."""
import math
import os
import sys
from pathlib import Path

import pytest

from flt_diag.cli import main
from flt_diag.config.grid_options import geometric_grid

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "analysis"))


def _one_error_line(capsys) -> str:
    err = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    assert len(err) == 1 and err[0].startswith("error: "), err
    return err[0]


# ------------------------------------------------------------------ 1. derived from two options

@pytest.mark.parametrize("lo, hi, ratio", [(1e-10, 1e300, 1.41), (1e-308, 1e308, 1.0000001), (5e-324, 1.0, 1.41)])
def test_a_grid_whose_bounds_overflow_their_ratio_is_one_line(lo, hi, ratio):
    # by hand: ln(hi) - ln(lo) over ln(ratio) steps, far above the 65 values a grid may have
    count = (math.log(hi) - math.log(lo)) / math.log(ratio) + 1
    assert count > 65
    with pytest.raises(ValueError, match=r"has .* values; at most 65"):
        geometric_grid(lo, hi, ratio)


def test_a_grid_of_a_tiny_lo_and_a_huge_ratio_is_made_without_overflow():
    # lo = 1e-300, ratio 1e100: 1e-300, 1e-200, ..., 1e100 (ratio^4 = 1e400 overflows alone; lo * ratio^4 does not)
    assert geometric_grid(1e-300, 1e100, 1e100) == [1e-300, 1e-200, 1e-100, 1.0, 1e100]


@pytest.mark.parametrize("argv", [
    ["map", "--variants", "parcae", "--loops", "2", "--lo", "1e-10", "--hi", "1e300", "--list"],
    ["map", "--variants", "parcae", "--loops", "2", "--lo", "1e-308", "--hi", "1e15", "--ratio", "1.0000001", "--list"],
    ["train", "--steps", "1" + "0" * 400],  # round(warm-down share x steps) overflowed a float
    ["train", "--threads", str(2**40)],  # torch's C int
])
def test_an_option_whose_derived_quantity_overflows_is_one_line(tmp_path, capsys, argv):
    assert main([*argv, "--out", str(tmp_path / "out")]) == 2
    line = _one_error_line(capsys)
    assert "--hi" in line or "at most 65" in line or "--steps" in line or "--threads" in line  # what is wrong, named
    assert not (tmp_path / "out").exists()


def test_a_study_file_whose_grid_cannot_be_made_is_named(tmp_path, capsys):
    study = tmp_path / "s.toml"
    study.write_text('[map]\nvariants = ["parcae"]\nloops = [2]\nlo = 1e-300\nhi = 1e15\nratio = 1.0000001\n')
    assert main(["study", str(study), "--list"]) == 2
    line = _one_error_line(capsys)
    assert str(study) in line and "at most 65" in line
