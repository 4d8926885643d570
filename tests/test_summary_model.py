"""summary.json is one model (flt_diag.storage.file_models.Summary): what summarize builds is written and read
back unchanged, against a summary worked out by hand; an older summary (verdict v1/v2: fewer fields) still
reads; a key no version wrote is one line."""
import json
import math

import pandas as pd
import pytest

from conftest import tiny_config
from flt_diag.cli import main
from flt_diag.judge.verdict import summarize
from flt_diag.storage import metric_names as M
from flt_diag.storage.folders import SUMMARY, load_summary, write_json

NAN = math.nan


def _run(tmp_path):
    """A 2-step run of width 16: loss 2.0 then NaN, nothing else recorded."""
    cfg = tiny_config(steps=2, loops=2, width=16, heads=1)
    df = pd.DataFrame(dict(step=[0, 1], metric=[M.LOSS, M.LOSS], loop=[-1, -1], layer=[-1, -1], value=[2.0, NAN]))
    return cfg, summarize(df, cfg, unigram_entropy=None, wall_time=4.0, tokens_per_step=8)


def _expected(cfg) -> dict:
    """By hand: the NaN at step 1 is rule 1 (diverged); no gradient norm, so no oscillation window (span end
    2 - round(0.2 * 2) = 2); no residual norm; milestones at steps 0 and 1 (the warm-down start, min(2, 1)):
    std of [2.0] = 0, of [NaN] = NaN; throughput 8 tokens * 2 steps / 4 s; no loops_run: v3's verdict is v4's."""
    return {"verdict": "diverged", "verdict_version": 4, "verdict_v3": "diverged",
            "evidence": {"nonfinite_step": 1, "reason": "non-finite loss", "osc_dlog_median": NAN,
                         "osc_alternation": NAN, "osc_dlog_window": None, "osc_dlog_threshold": math.log(1.5),
                         "osc_windows_judged": 0, "osc_span_end": 2, "osc_loop_count": "fixed",
                         "osc_loop_slope": NAN},
            "residual_explosion": False, "peak_resid_norm": NAN, "peak_resid_norm_any": NAN, "peak_resid_loop": None,
            "residual_explosion_any": False, "peak_resid_step": None, "final_resid_norm": NAN, "resid_ratio": NAN,
            "explosion_threshold": 100.0 * 4.0, "variant": cfg.model.variant, "loops": 2, "seed": cfg.train.seed,
            "lr_scale": cfg.train.lr_scale, "final_loss": 2.0, "best_loss": NAN, "val_loss": NAN, "val_ppl": NAN,
            "val_accuracy": NAN, "osc_cv": NAN, "osc_mean_abs_dlog": NAN, "osc_sign_alternation": NAN,
            "osc_neg_cosine_share": NAN, "osc_dlog_median": NAN, "osc_alternation": NAN, "osc_dlog_median_v3": NAN,
            "stall_reference": None,
            "stall_margin": None, "loss_std": NAN, "grad_norm_std": NAN, "loss_std_warmdown": NAN,
            "grad_norm_std_warmdown": NAN,
            "milestones": [{"step": 0, "loss_std": 0.0, "grad_norm_std": NAN},
                           {"step": 1, "loss_std": NAN, "grad_norm_std": NAN}],
            "oscillation_windows": [], "osc_dlog_windows": [], "steps_done": 2, "steps": 2, "wall_time": 4.0,
            "stop_reason": None, "prediction": None, "tokens_per_s": 4.0}


def test_a_summary_written_and_read_back_is_the_one_worked_out_by_hand(tmp_path):
    cfg, summary = _run(tmp_path)
    write_json(tmp_path / SUMMARY, summary)
    text = json.dumps(_expected(cfg), indent=1, allow_nan=True)  # (text: NaN == NaN, and the keys' order)
    assert (tmp_path / SUMMARY).read_text() == text
    read = load_summary(tmp_path)
    assert json.dumps(read.as_written(), indent=1, allow_nan=True) == text
    assert read.verdict == "diverged" and read.evidence.nonfinite_step == 1 and read.milestones[0].loss_std == 0.0


def test_an_older_summary_reads_and_its_missing_fields_are_none(tmp_path):
    cfg, _ = _run(tmp_path)
    v2 = {k: v for k, v in _expected(cfg).items() if k not in ("verdict_version", "val_accuracy", "osc_dlog_median",
                                                                "verdict_v3", "osc_dlog_median_v3",
                                                                "osc_alternation", "stall_reference", "stall_margin",
                                                                "osc_dlog_windows", "peak_resid_norm_any")}
    v2["evidence"] = {"nonfinite_step": 1, "reason": "non-finite loss"}
    (tmp_path / SUMMARY).write_text(json.dumps(v2))
    read = load_summary(tmp_path)
    assert read.verdict_version is None and read.val_accuracy is None and read.osc_dlog_windows is None
    assert not {"verdict_version", "val_accuracy"} & read.model_fields_set  # absent from the file, not null there
    assert json.dumps(read.as_written()) == json.dumps(v2)  # written back as it was


@pytest.mark.parametrize("change", [{"no_such_key": 1}, {"steps_done": "2"}, {"evidence": {"climb": "high"}}])
def test_a_summary_with_an_unknown_key_or_a_wrong_type_is_one_line(tmp_path, capsys, change):
    cfg, summary = _run(tmp_path)
    (tmp_path / SUMMARY).write_text(json.dumps(summary.as_written() | change, allow_nan=True))
    (tmp_path / "config.json").write_text(json.dumps(cfg.to_dict()))
    assert main(["summary", str(tmp_path)]) != 0
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and str(tmp_path / SUMMARY) in err and next(iter(change)) in err
