"""The `flt-diag` commands (`COMMANDS`): each a short function of its typed options (flt_diag.cli.options)
that calls into the layers below and prints through flt_diag.cli.console and .output. A training command
settles its config once (docs/DESIGN.md §7, "Settling"); nothing below settles or validates it again.
"""
from __future__ import annotations

import sys
from pathlib import Path
from typing import Callable

from flt_diag.cli.grid_commands import cmd_map, cmd_run_ablation, cmd_status, cmd_study
from flt_diag.cli.options import (ArchiveOptions, EvalLoopsOptions, FitPredictorOptions, ImportReferenceOptions,
                                  Options, PlotOptions, PredictOptions, ReportOptions, SummaryOptions, TrainOptions,
                                  UserError)
from flt_diag.storage.errors import first_line
from flt_diag.config.variants import VARIANT_DESCRIPTIONS

# Each command imports what it needs (torch, pandas, matplotlib, the layers below) when it runs, so that
# `flt-diag --help` and the command line's parsing import none of them (tests/test_cli_forms.py checks).


def cmd_train(o: TrainOptions) -> int:
    """Train one variant into one run folder, with diagnostics, and print its verdict."""
    from flt_diag.cli.console import console_progress, print_run_summary, progress_bar
    from flt_diag.training.settle import run_config
    from flt_diag.storage.file_models import Summary
    from flt_diag.training.trainer import Trainer
    cfg = run_config(o.config)
    out = o.out or Path("runs") / f"{cfg.model.variant}-K{cfg.model.loops}"
    trainer = Trainer(cfg, out, progress=console_progress(cfg.train.steps, f"{cfg.model.variant} K={cfg.model.loops}"))
    if trainer.is_main:
        print(trainer.describe(), flush=True)
    summary = trainer.fit()
    progress_bar.close()
    if isinstance(summary, Summary):  # ({}, empty, on DDP ranks other than 0)
        print_run_summary(out, summary)
    return 0


def cmd_summary(o: SummaryOptions) -> int:
    """Print the summary table of a sweep (or the summary of one run; or of several sweeps pooled)."""
    from flt_diag.cli.console import print_run_summary, print_sweep_table
    from flt_diag.judge.summary_table import sweep_summary, write_summary
    from flt_diag.judge.verdict import rejudged, write_rejudged
    from flt_diag.results.tables import folders_summary
    from flt_diag.storage.folders import is_archive, is_sweep, load_config, load_summary, run_dirs
    overrides = o.config
    if overrides and not (o.recompute or o.sensitivity):
        raise UserError("verdict thresholds need --recompute or --sensitivity")
    if o.sensitivity_csv is not None and not o.sensitivity:
        raise UserError("--sensitivity-csv needs --sensitivity")
    _output_file("--sensitivity-csv", o.sensitivity_csv, make_folder=True)
    paths = o.paths
    if o.sensitivity:
        return _sensitivity(paths, overrides, o.sensitivity_csv)
    if o.recompute:
        finished = [(path, d) for path in paths for d in run_dirs(path) if load_summary(d) is not None]
        new = [rejudged(d, overrides) for _, d in finished]  # (all judged before any is written: a refusal, e.g.
        for (path, d), summary in zip(finished, new):        # a run without metrics, leaves every one as it was)
            write_rejudged(d, summary, root=path)
        for path in paths:
            if is_sweep(path) and not is_archive(path):
                write_summary(path)
    if len(paths) > 1:
        print_sweep_table(folders_summary(paths))
        return 0
    path = paths[0]
    if is_sweep(path):
        print_sweep_table(sweep_summary(path))
    else:
        for d in run_dirs(path):
            s = load_summary(d)
            if s is None:
                print(f"{d}: not finished")
            else:
                load_config(d)  # (a half-written config.json is one error line, as every other command says it)
                print_run_summary(d, s)
    if is_archive(path):  # the code behind the records (issue 53: a result traced to its plan's commit)
        from flt_diag.results.archiving import code_lines
        for line in code_lines(path):
            print(f"code: {line}")
    return 0


def _sensitivity(paths: list[Path], overrides: dict, csv: Path | None) -> int:
    """`summary --sensitivity`: the table of verdicts and flags that change when each threshold moves."""
    from flt_diag.cli.console import print_sensitivity
    from flt_diag.results.sensitivity import sensitivity
    from flt_diag.storage.folders import atomic_write_text
    from flt_diag.storage.pooling import check_poolable
    if len(paths) > 1:  # several folders pool as the summary table pools them: sweeps of one setting, no map
        check_poolable(paths)
    table = sensitivity(paths, overrides)
    if not table.runs.any():
        raise UserError("no finished runs to judge")
    print_sensitivity(table)
    if csv is not None:
        csv.parent.mkdir(parents=True, exist_ok=True)
        atomic_write_text(csv, table.to_csv(index=False))
        print(f"sensitivity table: {csv}")
    return 0


def cmd_eval_loops(o: EvalLoopsOptions) -> int:
    """Held-out loss and perplexity of each trained checkpoint at every inference loop count."""
    from flt_diag.cli.output import print_eval_loops
    from flt_diag.storage.archive import is_record
    from flt_diag.storage.folders import CHECKPOINT, StorageError, is_archive, run_dirs
    from flt_diag.training.evaluation import eval_loops
    from flt_diag.training.settle import check_data, choose_device
    device = choose_device(o.device)
    if o.data is not None:
        check_data(o.data, "bytes")
    failed = 0
    if is_archive(o.path):
        raise UserError(f"{o.path} is a run archive: it keeps no checkpoints, and eval-loops needs the trained "
                        "weights (run it on the run folders, then archive them again)")
    for d in run_dirs(o.path):
        if is_record(d):  # (a cell of a sweep archived as it went: its record keeps no weights)
            print(f"{d}: an archive record (no checkpoint kept), skipped; evaluate its run folder before archiving")
            continue
        if not (d / CHECKPOINT).exists():
            print(f"{d}: no final checkpoint yet, skipped")
            continue
        try:
            print_eval_loops(d, eval_loops(d, o.loops, batches=o.batches, data=o.data, device=device,
                                           root=o.path))
        except (StorageError, ValueError, RuntimeError) as e:  # one bad cell does not stop the others
            print(f"{d}: error: {first_line(e)}", file=sys.stderr)
            failed += 1
    return 1 if failed else 0


def cmd_import_reference(o: ImportReferenceOptions) -> int:
    """Import a reference-implementation checkpoint into a run folder."""
    from flt_diag.training.reference import import_reference, write_imported_run
    if not o.checkpoint.exists():
        raise UserError(f"no such checkpoint: {o.checkpoint}")
    model = import_reference(o.checkpoint, o.variant, o.loops, n_head=o.heads, vocab_size=o.vocab_size)
    if o.tokenizer is not None:  # (loaded now: a wrong name is one line before the folder is made)
        from flt_diag.data.corpus import get_tokenizer
        if (n := get_tokenizer(o.tokenizer).vocab_size) > model.cfg.vocab_size:
            raise UserError(f"--tokenizer {o.tokenizer} has {n} tokens, more than the checkpoint's vocabulary of "
                            f"{model.cfg.vocab_size}: not the tokenizer it was trained with")
    tokenizer = o.tokenizer  # (a local file kept by its absolute path: eval-loops may run from elsewhere)
    if tokenizer is not None and Path(tokenizer).exists():
        tokenizer = str(Path(tokenizer).resolve())
    write_imported_run(model, o.out, str(o.checkpoint), tokenizer=tokenizer)
    print(f"imported {o.checkpoint} as {model.cfg.variant} (K={model.cfg.loops}) into {o.out}")
    return 0


def cmd_predict(o: PredictOptions) -> int:
    """Early warning: P(collapse) of every cell at step s beside its final verdict, and the agreement
    (for each --predictor given: several compare on the same runs)."""
    import pandas as pd
    from flt_diag.cli.output import PACKAGED_CAVEAT, print_detectors
    from flt_diag.judge import early_warning as EW
    from flt_diag.judge.spike_detectors import detector_sweep
    from flt_diag.results.figures import save as save_figure
    from flt_diag.results.figures.agreement import STYLES as AGREEMENT_STYLES, draw_agreement
    from flt_diag.storage.files import load_predictor
    from flt_diag.storage.folders import atomic_write_text, run_dirs
    from flt_diag.storage.output_paths import refuse_same_file
    from flt_diag.storage.predictor_names import PACKAGED
    paths = o.paths
    for path in paths:
        run_dirs(path)  # a clear error for a path that is neither a run nor a sweep
    if o.online and o.figure is not None:
        raise UserError("--figure draws agreement against fixed steps (--at); it does not apply with --online")
    if o.figure is not None and o.figure.suffix not in (".png", ".pdf", ".svg"):
        raise UserError(f"--figure must end in .png, .pdf or .svg, got {o.figure.name}")
    for flag, file in (("--csv", o.csv), ("--figure", o.figure)):
        _output_file(flag, file)
    refuse_same_file({**{f"--predictor {p}": Path(p) for p in o.predictor or []}, "--csv": o.csv,
                      "--figure": o.figure})
    if o.figure is not None and len(o.predictor or []) > len(AGREEMENT_STYLES):
        raise UserError(f"--figure draws at most {len(AGREEMENT_STYLES)} predictors (one line style each); "
                        f"{len(o.predictor or [])} given: draw them in groups")
    models = {("packaged" if p is None else str(p)): load_predictor(p)
              for p in o.predictor or [None]}  # type: ignore[list-item]  # (None: the packaged predictor)
    tables = []
    for name, model in models.items():
        if len(models) > 1:
            print(f"predictor {name}:")
        tables.append((_predict_online(paths, model) if o.online else _predict_at(paths, model, o.at))
                      .assign(predictor=name))
    if o.online:
        print_detectors(pd.concat([detector_sweep(path) for path in paths], ignore_index=True))
    if "packaged" in models or any(Path(p).resolve() == Path(PACKAGED).resolve() for p in o.predictor or []):
        print(PACKAGED_CAVEAT)
    if o.csv is not None:
        atomic_write_text(o.csv, pd.concat(tables, ignore_index=True).to_csv(index=False))
    if o.figure is not None:
        where = " + ".join(p.name for p in paths) if len(paths) <= 3 else f"{len(paths)} folders"
        stems = [Path(name).stem for name in models]
        labels = [stem if stems.count(stem) == 1 else name for stem, name in zip(stems, models)]  # (a/p, b/p: paths)
        curves = {(where if len(models) == 1 else label):
                  [dict(step=s, **EW.agreement(t[t.step == s])) for s in o.at if (t.step == s).any()]
                  for label, t in zip(labels, tables)}
        print(save_figure(draw_agreement(curves, runs=None if len(models) == 1 else where), o.figure))
    return 0


def _predict_at(paths, model, steps):
    import pandas as pd
    from flt_diag.cli.output import print_predictions_at
    from flt_diag.judge import early_warning as EW
    from flt_diag.storage.folders import load_summary, run_dirs
    frames = []
    longest = max((x.steps_done for path in paths for d in run_dirs(path) if (x := load_summary(d))), default=0)
    fitted = [k for k in sorted(model.models) if k < longest]  # (steps the predictor has a model at)
    for s in steps:
        table = pd.concat([EW.predict_sweep(path, s, model) for path in paths], ignore_index=True)
        print_predictions_at(table, s, model.target, longest, fitted[-1] if fitted else None)
        frames.append(table.assign(step=s))
    return pd.concat(frames, ignore_index=True)


def _predict_online(paths, model):
    import pandas as pd
    from flt_diag.cli.output import print_online
    from flt_diag.judge import early_warning as EW
    table = pd.concat([EW.online_sweep(path, model) for path in paths], ignore_index=True)
    print_online(table, model.target)
    return table


def cmd_fit_predictor(o: FitPredictorOptions) -> int:
    """Fit the early-warning predictor (one logistic regression per step) on labelled runs."""
    from flt_diag.cli.output import fit_command, print_fitted
    from flt_diag.storage.output_paths import refuse_same_file
    from flt_diag.results import predictor_fit as FIT
    from flt_diag.storage.folders import run_dirs, write_json
    paths, at, l2, target, weight, features = o.paths, o.at, o.l2, o.target, o.class_weight, o.features
    for p in paths:
        if Path(p).suffix != ".csv":
            run_dirs(p)
    for flag, path in (("--out", o.out), ("--examples-out", o.examples_out)):
        _output_file(flag, path)  # both, before either is written
    refuse_same_file({**{f"the input {p}": Path(p) for p in paths if Path(p).suffix == ".csv"},
                      "--out": o.out, "--examples-out": o.examples_out})
    examples = FIT.training_examples(paths, at, target)  # features computed once, for the fit and the CV
    older = sum(FIT.judged_before_v3(e["summary"]) for e in examples)
    if older:
        print(f"note: {older} of the {len(examples)} runs were judged before verdict v3 and keep their verdict "
              "(a recovered loss climb counts as unstable); v3's stall and oscillation rules need the run folders: "
              "flt-diag summary FOLDER --recompute")
    model = FIT.fit(paths, at, l2, fit_command(o, features), target, examples, features, weight)
    if o.cross_validate:
        model["cross_validation"] = _cross_validate(paths, o, examples, features)
    if o.examples_out is not None:  # only once the fit succeeded, and only a table that reads back
        FIT.write_examples(o.examples_out, examples)
        print(f"fit examples: {o.examples_out}")
    write_json(o.out, model)
    print_fitted(model, o.out)
    return 0


def _output_file(flag: str, path: Path | None, make_folder: bool = False) -> None:
    """A file a command is to write, refused (one line) before any work if it is a link, a FIFO, a device, a
    folder, one of flt-diag's own data files (a run's config, a sweep's spec, a record: output_paths), or has no
    folder to hold it (unless the command makes it: `make_folder`)."""
    from flt_diag.storage.folders import refuse_links
    from flt_diag.storage.output_paths import refuse_data_file
    from flt_diag.storage.safe_files import new_file
    if path is None:
        return
    refuse_links(new_file(path))
    refuse_data_file(flag, path)
    if not make_folder and not path.parent.is_dir():
        raise UserError(f"{flag} {path}: there is no folder {path.parent} to write it into")


def _cross_validate(paths, o: FitPredictorOptions, examples, features) -> dict:
    from flt_diag.cli.output import print_cross_validation
    from flt_diag.judge import early_warning as EW
    from flt_diag.results import predictor_fit as FIT
    table = FIT.cross_validate(paths, o.at, o.l2, o.target, examples, features, o.class_weight)
    if table.empty:
        print("cross-validation: nothing to leave out (it needs finished runs of at least two cells)")
    result = {}
    for s, t in table.groupby("step", sort=True):
        a = EW.agreement(t)
        wrong = {"false_alarm": sorted(t.run[t.false_alarm]), "miss": sorted(t.run[t.miss])}
        result[str(s)] = a | wrong
        print_cross_validation(s, a, wrong, o.target)
    return result


def cmd_variants(o: Options) -> int:
    """List the variants: the paper's five, the field's stabilisers (with the parameters each adds, its source and
    the values that are flt-diag's own choice, "ours") and the compositions base+stabiliser."""
    from flt_diag.config.variants import COMPOSED, PAPER_VARIANTS, SOURCES, STABILISERS, base_of
    from flt_diag.model.transformer import ModelConfig, extra_parameters
    shape = ModelConfig()  # the tiny preset's shape (d = 64, L = 2, K = 12): the extra parameters at that shape
    print("the paper's five (no parameters added):")
    for name in PAPER_VARIANTS:
        print(f"  {name:15s} {VARIANT_DESCRIPTIONS[name]}")
    print(f"the field's stabilisers (+ parameters at d = {shape.width}, K = {shape.loops}; builds on):")
    for name in STABILISERS:
        extra = extra_parameters(shape.model_copy(update=dict(variant=name)))
        print(f"  {name:15s} {VARIANT_DESCRIPTIONS[name]}\n  {'':15s} +{extra:,} parameters; on {base_of(name)}; "
              f"{SOURCES[name]}")
        stab = STABILISERS[name]
        if not stab.module.startswith("flt_diag."):
            print(f"  {'':15s} from {stab.module} (not flt-diag's own)")
        if stab.strength:  # what --strength multiplies
            most = f" (S at most {stab.strength_max:g})" if stab.strength_max < 100 else ""
            print(f"  {'':15s} strength scales: {stab.strength}{most}")
        for what, why in stab.ours.items():  # values the source leaves open, chosen by flt-diag (or the author)
            print(f"  {'':15s} ours: {what}: {why}")
    print("compositions (a stabiliser that composes, on any other of the five): " + ", ".join(COMPOSED))
    return 0


def cmd_plot(o: PlotOptions) -> int:
    """Figures from run, sweep or map folders (PNG and PDF)."""
    from flt_diag.results.figures import plot
    from flt_diag.storage.archive import is_record
    if o.out is None and is_record(o.paths[0]):  # (its default, <path>/figures, cannot be below a file)
        raise UserError(f"{o.paths[0]} is an archive record (a file); give --out, the folder for the figures")
    for p in plot(o.figure, o.paths, o.out, tuple(o.format)):
        print(p)
    return 0


def cmd_archive(o: ArchiveOptions) -> int:
    """Keep finished runs as compact records (one Parquet file each) that every reading command reads."""
    from flt_diag.results.archiving import archive_sources
    done = archive_sources(o.paths, o.to, replace=o.replace)
    total = sum(a.bytes for a in done)
    whole = sum(a.whole for a in done)
    print(f"{len(done)} run(s) archived into {o.to}: {total / 1024:.1f} KB"
          + (f"; {whole} kept whole (thinning would have changed their summary)" if whole else ""))
    return 0 if done else 1


def cmd_report(o: ReportOptions) -> int:
    """One self-contained HTML report: table, every figure, spec and environment."""
    from flt_diag.results.report import write_report
    from flt_diag.storage.archive import is_record
    if o.out is None and is_record(o.paths[0]):  # (its default, <path>/report.html, cannot be below a file)
        raise UserError(f"{o.paths[0]} is an archive record (a file); give --out, the report's HTML file")
    _output_file("--out", o.out, make_folder=True)  # (its folder is made, as before)
    print(write_report(o.paths, o.out))
    return 0


COMMANDS: dict[str, Callable[..., int]] = {  # (each takes its command's options)
            "train": cmd_train, "run-ablation": cmd_run_ablation, "map": cmd_map, "study": cmd_study,
            "status": cmd_status, "summary": cmd_summary, "eval-loops": cmd_eval_loops, "import-reference": cmd_import_reference,
            "predict": cmd_predict, "fit-predictor": cmd_fit_predictor, "variants": cmd_variants,
            "report": cmd_report, "plot": cmd_plot, "archive": cmd_archive}
