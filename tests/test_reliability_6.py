"""Reliability, round six (issue 67, items 1, 2 and 7): a quantity derived from two options never overflows
into a traceback; every file an analysis script is named is read through the bounded, regular-file-only
reader; a refusal leaves nothing it created and names the path for what it is."""
import math
import os
import re
import sys
from pathlib import Path

import pytest

from cli_errors import one_error_line
from flt_diag.cli import main
from flt_diag.config.grid_options import geometric_grid

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "analysis"))


# ------------------------------------------------------------------ 1. derived from two options

# (normal floats: a run trained earlier in this process flushes subnormals to zero, --flush-denormal)
@pytest.mark.parametrize("lo, hi, ratio", [(1e-10, 1e300, 1.41), (1e-300, 1e300, 1.0000001), (1e-300, 1.0, 1.41)])
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
    ["map", "--variants", "parcae", "--loops", "2", "--lo", "1e-300", "--hi", "1e6", "--ratio", "1.0000001", "--list"],
    ["map", "--variants", "parcae", "--loops", "2", "--hi", "1e300", "--list"],  # beyond the axis bound (2**20),
    ["train", "--steps", "1" + "0" * 400],  # round(warm-down share x steps) overflowed a float
    ["train", "--threads", str(2**40)],  # torch's C int
])
def test_an_option_whose_derived_quantity_overflows_is_one_line(tmp_path, capsys, argv):
    assert main([*argv, "--out", str(tmp_path / "out")]) == 2
    line = one_error_line(capsys)
    assert "--hi" in line or "at most 65" in line or "--steps" in line or "--threads" in line  # what is wrong, named
    assert not (tmp_path / "out").exists()


def test_a_study_file_whose_grid_cannot_be_made_is_named(tmp_path, capsys):
    study = tmp_path / "s.toml"
    study.write_text('[map]\nvariants = ["parcae"]\nloops = [2]\nlo = 1e-300\nhi = 1e6\nratio = 1.0000001\n')
    assert main(["study", str(study), "--list"]) == 2
    line = one_error_line(capsys)
    assert str(study) in line and "at most 65" in line


# ------------------------------------------------------------------ 2. every named file through the bounded reader

def _script(name: str, argv: list) -> int:
    import importlib
    try:
        return importlib.import_module(name).main([str(a) for a in argv])
    except SystemExit as e:
        return e.code


def test_check_claims_reads_a_fifo_page_not_at_all(tmp_path):
    import subprocess
    import processes
    fifo = tmp_path / "page.md"
    os.mkfifo(fifo)
    try:  # a plain read blocks on the FIFO until the timeout
        done = processes.run([sys.executable, str(ROOT / "analysis" / "check_claims.py"), "--results", str(fifo)],
                             timeout=60, capture_output=True, env={**os.environ, "PYTHONPATH": str(ROOT)})
    except subprocess.TimeoutExpired:
        pytest.fail("check_claims blocked on a FIFO named by --results")
    err = done.stderr.decode().strip().splitlines()
    assert done.returncode == 2 and err == [f"error: {fifo} is a FIFO (named pipe), not a file; flt-diag reads only "
                                            "regular files there"]


@pytest.mark.parametrize("content, said", [(b"a,b\n1,\xff\n", "not text (UTF-8)"), (b"x" * 65, "over 64 bytes")])
def test_a_table_is_read_bounded_and_named(tmp_path, content, said):
    from flt_diag.storage.files import BadFile, read_table
    table = tmp_path / "t.csv"
    table.write_bytes(content)
    with pytest.raises(BadFile, match=f"^{re.escape(f'{table}: {said}')}"):
        read_table(table, limit=64)
    fifo = tmp_path / "f.csv"
    os.mkfifo(fifo)
    with pytest.raises(BadFile, match="is a FIFO"):
        read_table(fifo)
    (tmp_path / "ok.csv").write_text("a,b\n1,2\n")
    assert read_table(tmp_path / "ok.csv").to_dict("records") == [{"a": 1, "b": 2}]


# ------------------------------------------------------------------ 7. silence where a user erred

@pytest.mark.parametrize("name", ["factorial", "failure_rates", "sweep_table", "loop_dynamics_table", "regenerate",
                                  "gradient_path_2", "ablation_claims", "stabiliser_benchmark"])
def test_an_analysis_script_says_a_fifo_is_a_fifo(tmp_path, capsys, name):
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    assert _script(name, [fifo]) == 2
    assert f"{fifo} is a FIFO (named pipe), not a folder" in one_error_line(capsys)


def test_regenerate_refusing_leaves_no_out(tmp_path, capsys):
    (tmp_path / "empty").mkdir()
    out = tmp_path / "new" / "out"
    assert _script("regenerate", [tmp_path / "empty", "--out", out]) == 2
    assert "neither a run folder" in one_error_line(capsys)
    assert not (tmp_path / "new").exists()  # nothing it made is left, not even an empty folder


def test_a_library_warning_before_bad_input_is_not_printed(capsys):
    import warnings
    from script_exit import guarded

    @guarded
    def refuses(argv=None):
        warnings.warn("Mean of empty slice", RuntimeWarning)
        raise ValueError("no runs of the plan in x")

    @guarded
    def succeeds(argv=None):
        warnings.warn("said once it succeeded", UserWarning)
        return 0
    with warnings.catch_warnings(record=True) as shown:
        warnings.simplefilter("always")
        assert refuses() == 2
    assert shown == [] and capsys.readouterr().err.strip() == "error: no runs of the plan in x"
    with pytest.warns(UserWarning, match="said once it succeeded"):  # shown once main returned
        assert succeeds() == 0


def test_a_failed_write_names_the_file_asked_for_not_its_temporary_file(tmp_path):
    from flt_diag.storage.folders import atomic_path
    target = tmp_path / "table.csv"
    with pytest.raises(OSError) as failed:
        with atomic_path(target) as tmp:  # a full disk while the temporary file is written names it
            raise OSError(28, "No space left on device", str(tmp))
    assert failed.value.filename == str(target) and list(tmp_path.iterdir()) == []
