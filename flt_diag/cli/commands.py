"""The `flt-diag` command line: the commands, each a short function over option values.

Every training option is a field of a config section (flt_diag.config), every grid option a field of
SweepSpec, MapSpec or MapGrid; flt_diag.cli.options generates each command's parser from those fields, so
an option exists in every command that accepts it (its `commands`), with the same help, and is
validated in one place (`Option.check`). List options take space-separated values (`--loops 3 6 9 12`), commas
(`--loops 3,6`) or repetition. Errors a user can cause print one line (`error: ...`) and exit with
status 2; nothing already written is touched. Ctrl-C exits with 130.
"""
from __future__ import annotations

import argparse
import functools
import os
import sys
from pathlib import Path

from flt_diag.config import options_for
from flt_diag.cli.console import console_progress, print_eval_loops, print_run_summary, print_sweep_table, progress_bar
from flt_diag.cli.options import (FOLDER_OPTIONS, Parser, UserError, add_options, build_run_config, check_data, check_values,
                      cli_opt, command_options, load_study, map_spec, settled, sweep_spec)
from flt_diag.model.variants import MAX_LOOPS, VARIANT_DESCRIPTIONS


# ------------------------------------------------------------------ train

def cmd_train(v: dict) -> int:
    """Train one variant into one run folder, with diagnostics, and print its verdict."""
    cfg = build_run_config(v)
    out = v["out"] or Path("runs") / f"{cfg.model.variant}-K{cfg.model.loops}"
    cfg = settled(cfg)  # a tokenizer that cannot be loaded: one line now, before the run folder exists
    from flt_diag.training.trainer import Trainer

    trainer = Trainer(cfg, out, progress=console_progress(cfg.train.steps, f"{cfg.model.variant} K={cfg.model.loops}"))
    if trainer.is_main:
        print(trainer.describe(), flush=True)
    summary = trainer.fit()
    progress_bar.close()
    if summary:  # empty on DDP ranks other than 0
        print_run_summary(out, summary)
    return 0


# ------------------------------------------------------------------ sweeps and maps

def cmd_run_ablation(v: dict) -> int:
    """Train every variant at every loop count (x seeds x lr scales) and summarise how they collapse."""
    from flt_diag.grids.sweep import cell_status, run_sweep
    spec = sweep_spec(v)
    out = v["out"] or Path("runs") / f"ablation-{spec.base.preset}"
    cells, cell = spec.cells(), v["cell"]
    if _listed_or_picked(cells, v, lambda c: f"{c.index:4d}  {c.name:32s} {cell_status(out, c)}"):
        return 0
    from flt_diag.model.transformer import count_parameters
    n = count_parameters(settled(spec.base).model)
    m = spec.base.model
    print(f"model: L={m.n_layer} d={m.n_embd} heads={m.n_head}, {n:,} parameters ({n / 1e6:.1f}M) per cell", flush=True)
    df = run_sweep(spec, out, workers=v["workers"], only_cell=cell, show_progress=not v["quiet"])
    print_sweep_table(df)
    print(f"sweep folder: {out}  (plots: flt-diag plot all {out}; report: flt-diag report {out})")
    return _failed_cells(out, cells if cell is None else [cells[cell]])


def _listed_or_picked(items: list, v: dict, line) -> bool:
    """`--list`: print one line per cell (or map line) and say so; `--cell I` must name one of them."""
    if v["list"]:
        for item in items:
            print(line(item))
        return True
    from flt_diag.grids.sweep import only
    only(items, v["cell"])  # a bad --cell: the one check the sweep and the map also use
    return False


def _failed_cells(out: Path, cells) -> int:
    """One line and exit status 1 when any cell of the sweep did not finish: it failed (its error.txt
    says why), or it has no summary although the sweep ran it (a failure that could not even be
    recorded, e.g. on a full disk, or a cell refused before it started)."""
    from flt_diag.grids.sweep import cell_status
    status = {c.name: cell_status(out, c) for c in cells}
    failed = [n for n, s in status.items() if s == "failed"]
    missing = [n for n, s in status.items() if s not in ("done", "failed")]
    if failed or missing:
        names = failed + missing
        what = " and ".join(x for x in (f"{len(failed)} failed" if failed else "",
                                        f"{len(missing)} did not finish" if missing else "") if x)
        print(f"error: {len(names)} of {len(cells)} cells not done ({what}: {', '.join(names[:4])}"
              f"{', ...' if len(names) > 4 else ''}); see {out}/cells/<cell>/error.txt where it exists",
              file=sys.stderr)
        return 1
    return 0


def cmd_map(v: dict) -> int:
    """Where each variant's training breaks: bisection along lr scale or depth, per variant and K."""
    from flt_diag.grids.stability_map import critical_values, run_map
    from flt_diag.grids.sweep import auto_workers
    spec = map_spec(v)
    out = v["out"] or Path("runs") / f"map-{spec.axis}-{spec.base.preset}"
    if _listed_or_picked(spec.lines(), v, lambda line: f"{line.index:4d}  {line.name}"):
        return 0
    settled(spec.base)  # a tokenizer that cannot be loaded: one line now, before any probe
    ratio = v.get("ratio") or 1.41
    print(f"map: {len(spec.lines())} lines x {len(spec.criteria)} criteria; {spec.axis} grid "
          f"{', '.join(f'{x:g}' for x in spec.grid)} (each boundary within x{ratio:g})", flush=True)
    run_map(spec, out, workers=v["workers"] or auto_workers(spec.base.train.device), only_line=v["cell"],
            report=lambda text: print(text, flush=True))
    crit = critical_values(out)
    for criterion, g in crit.groupby("criterion", sort=False):
        print(f"{criterion}: " + "; ".join(f"{r.variant} K={r.loops}: {r.text}" for r in g.itertuples()))
    print(f"map folder: {out}  (figure: flt-diag plot map {out}; report: flt-diag report {out})")
    return 0


def cmd_study(v: dict) -> int:
    """Run a named study: the [ablation] (run-ablation options) or [map] (map options) table of a TOML file."""
    command, values = load_study(v["path"])
    values = check_values({**values, **{o.dest: v[o.dest] for o in FOLDER_OPTIONS}}, command_options(command))
    return (cmd_run_ablation if command == "run-ablation" else cmd_map)(values)


# ------------------------------------------------------------------ summaries

def cmd_summary(v: dict) -> int:
    """Print the summary table of a sweep (or the summary of one run)."""
    from flt_diag.analysis.storage import is_sweep, load_summary, run_dirs
    overrides = {o.name: v[o.dest] for o in options_for("summary") if v.get(o.dest) is not None}
    if overrides and not v["recompute"]:
        raise UserError("verdict thresholds need --recompute")
    path = v["path"]
    if v["recompute"]:
        from flt_diag.analysis.metrics import resummarize
        for d in run_dirs(path):
            if load_summary(d) is not None:
                resummarize(d, overrides)
        if is_sweep(path):
            from flt_diag.grids.sweep import write_summary
            write_summary(path)
    if is_sweep(path):
        from flt_diag.grids.sweep import sweep_summary
        print_sweep_table(sweep_summary(path))
        return 0
    for d in run_dirs(path):
        s = load_summary(d)
        if s is None:
            print(f"{d}: not finished")
        else:
            print_run_summary(d, s)
    return 0


# ------------------------------------------------------------------ evaluation, import, early warning

def cmd_eval_loops(v: dict) -> int:
    """Held-out loss and perplexity (and a task's accuracy) of each trained checkpoint at every inference loop count."""
    from flt_diag.training.trainer import resolve_device
    try:
        device = str(resolve_device(v["device"]))
    except ValueError as e:
        raise UserError(str(e)) from None
    from flt_diag.training.evaluation import eval_loops
    from flt_diag.analysis.storage import CHECKPOINT, StorageError, run_dirs
    if v["data"] is not None:
        check_data(v["data"], "bytes")
    failed = 0
    for d in run_dirs(v["path"]):
        if not (d / CHECKPOINT).exists():
            print(f"{d}: no final checkpoint yet, skipped")
            continue
        try:
            df = eval_loops(d, v["loops"], batches=v["batches"], data=v["data"], device=device)
        except (StorageError, ValueError, RuntimeError) as e:  # one bad cell does not stop the others
            print(f"{d}: error: {str(e).splitlines()[0] if str(e) else type(e).__name__}", file=sys.stderr)
            failed += 1
            continue
        print_eval_loops(d, df)
    return 1 if failed else 0


def cmd_import_reference(v: dict) -> int:
    """Import a reference-implementation checkpoint into a run folder."""
    if not v["checkpoint"].exists():
        raise UserError(f"no such checkpoint: {v['checkpoint']}")
    from flt_diag.model.reference import import_reference, write_imported_run
    model = import_reference(v["checkpoint"], v["variant"], v["loops"], n_head=v["heads"], vocab_size=v["vocab_size"])
    write_imported_run(model, v["out"], str(v["checkpoint"]))
    print(f"imported {v['checkpoint']} as {model.cfg.variant} (K={model.cfg.loops}) into {v['out']}")
    return 0


def cmd_predict(v: dict) -> int:
    """Early warning: P(collapse) of every cell at step s beside its final verdict, and the agreement
    (for each --predictor given: several compare on the same runs)."""
    import pandas as pd
    from flt_diag.analysis.early_warning import load_predictor
    from flt_diag.analysis.storage import run_dirs
    paths = v["paths"]
    for path in paths:
        run_dirs(path)  # a clear error for a path that is neither a run nor a sweep
    if v["online"] and v["figure"] is not None:
        raise UserError("--figure draws agreement against fixed steps (--at); it does not apply with --online")
    if v["figure"] is not None and v["figure"].suffix not in (".png", ".pdf", ".svg"):
        raise UserError(f"--figure must end in .png, .pdf or .svg, got {v['figure'].name}")
    given = v["predictor"] or [None]
    try:
        models = {("packaged" if p is None else str(p)): load_predictor(p) for p in given}
        tables = []
        report = _predict_online if v["online"] else _predict_at
        for name, model in models.items():
            if len(models) > 1:
                print(f"predictor {name}:")
            tables.append(report(paths, model, v["at"]).assign(predictor=name))
    except ValueError as e:
        raise UserError(str(e)) from None
    if v["csv"] is not None:
        from flt_diag.analysis.storage import atomic_write_text
        atomic_write_text(v["csv"], pd.concat(tables, ignore_index=True).to_csv(index=False))
    if v["figure"] is not None:
        from flt_diag.analysis.early_warning import agreement, draw_agreement
        from flt_diag.analysis.figures import save as save_figure
        where = " + ".join(p.name for p in paths) if len(paths) <= 3 else f"{len(paths)} folders"
        curves = {(where if len(models) == 1 else Path(name).stem):
                  [dict(step=s, **agreement(t[t.step == s])) for s in v["at"] if (t.step == s).any()]
                  for name, t in zip(models, tables)}
        print(save_figure(draw_agreement(curves, runs=None if len(models) == 1 else where), v["figure"]))
    return 0


def _verdict_word(r) -> str:
    return "agree" if r.agree else "FALSE ALARM" if r.false_alarm else "MISS"


def _predict_at(paths, model: dict, steps):
    """`predict --at`: the prediction at each step s beside the final verdict, and the agreement."""
    import pandas as pd
    from flt_diag.analysis.early_warning import agreement, predict_sweep
    target = model.get("target", "collapse")
    frames = []
    for s in steps:
        table = pd.concat([predict_sweep(path, s, model) for path in paths], ignore_index=True)
        frames.append(table.assign(step=s))
        if table.empty:
            print(f"step {s}: no finished cell has more than {s} steps")
            continue
        for r in table.itertuples():
            print(f"{r.cell:28s} step {s}: P({target}) {r.p_collapse:.2f} -> {'WARN' if r.predicted else 'ok':4s} | "
                  f"final: {r.verdict:9s} {_verdict_word(r)}  [{r.evidence}]")
        a = agreement(table)
        print(f"step {s}: agreement {a['accuracy']:.0%} over {a['cells']} cells ({a['positives']} with target "
              f"{target}); {a['false_alarms']} false alarms, {a['misses']} misses")
    return pd.concat(frames, ignore_index=True)


def _predict_online(paths, model: dict, steps=None):
    """`predict --online`: replay the --warn checks over each whole run."""
    import pandas as pd
    from flt_diag.analysis.early_warning import CHECK_EVERY, agreement, online_sweep
    table = pd.concat([online_sweep(path, model) for path in paths], ignore_index=True)
    target = model.get("target", "collapse")
    for r in table.itertuples():
        said = f"warned at step {int(r.warned_at)} (P={r.p_warn:.2f})" if pd.notna(r.warned_at) else "never warned"
        lead = f" (loss minimum at step {r.onset:.0f})" if pd.notna(r.onset) else ""
        print(f"{r.cell:28s} {said:30s} max P {r.p_max:.2f} | final: {r.verdict + lead:9s}  {_verdict_word(r)}"
              + (f"  [{r.evidence}]" if r.evidence else ""))
    if table.empty:
        print("no finished cell")
    else:
        a = agreement(table)
        print(f"online (checks every {CHECK_EVERY} steps, whole run): agreement {a['accuracy']:.0%} over {a['cells']} cells "
              f"({a['positives']} with target {target}); {a['false_alarms']} false alarms, {a['misses']} misses")
    return table


def cmd_fit_predictor(v: dict) -> int:
    """Fit the early-warning predictor (one logistic regression per step) on labelled runs."""
    from flt_diag.analysis.early_warning import DEFAULT_FEATURES, fit, training_examples
    from flt_diag.analysis.storage import run_dirs, write_json
    paths, out, at, l2, target, weight = v["paths"], v["out"], v["at"], v["l2"], v["target"], v["class_weight"]
    features = v["features"] or DEFAULT_FEATURES  # names and duplicates checked by the parser, again by fit
    for p in paths:
        run_dirs(p)
    command = "flt-diag fit-predictor " + " ".join(map(str, paths)) + f" --out {out} --at " + " ".join(map(str, at)) \
        + (f" --l2 {l2:g}" if l2 != 1.0 else "") + (f" --target {target}" if target != "fails" else "") \
        + (" --features " + " ".join(features) if features != DEFAULT_FEATURES else "") \
        + (f" --class-weight {weight}" if weight != "balanced" else "") \
        + (" --cross-validate" if v["cross_validate"] else "")
    try:
        examples = training_examples(paths, at, target)  # features computed once, for the fit and the CV
        model = fit(paths, at, l2, command, target, examples, features, weight)
    except ValueError as e:
        raise UserError(str(e)) from None
    if v["cross_validate"]:
        from flt_diag.analysis.early_warning import agreement, cross_validate
        table = cross_validate(paths, at, l2, target, examples, features, weight)
        model["cross_validation"] = {}
        if table.empty:
            print("cross-validation: nothing to leave out (it needs finished runs of at least two cells)")
        for s, t in table.groupby("step", sort=True):
            a = agreement(t)
            wrong = {"false_alarm": sorted(t.run[t.false_alarm]), "miss": sorted(t.run[t.miss])}
            model["cross_validation"][str(s)] = a | wrong
            print(f"step {s}: leave-one-cell-out agreement {a['accuracy']:.0%} over {a['cells']} runs "
                  f"({a['positives']} with target {target}); {a['false_alarms']} false alarms, {a['misses']} misses"
                  + "".join(f"\n  {kind.replace('_', ' ')}: {run}" for kind, runs in wrong.items() for run in runs))
    write_json(out, model)
    for s, m in model["models"].items():
        print(f"step {s}: {m['runs']} runs ({m['positives']} with target {model['target']}), training accuracy "
              f"{m['train_accuracy']:.0%}; " + ", ".join(f"{f} {c:+.2f}" for f, c in zip(model["features"], m["coef"])))
    print(f"predictor: {out}")
    return 0


def cmd_variants(v: dict) -> int:
    """List the five variants and what each does in loops t >= 2."""
    for name, text in VARIANT_DESCRIPTIONS.items():
        print(f"{name:6s} {text}")
    return 0


# ------------------------------------------------------------------ plots and report

def cmd_plot(v: dict) -> int:
    from flt_diag.analysis.figures import plot
    for p in plot(v["figure"], v["path"], v["out"], tuple(v["format"])):
        print(p)
    return 0


def cmd_report(v: dict) -> int:
    """One self-contained HTML report: table, every figure, spec and environment."""
    from flt_diag.analysis.report import write_report
    print(write_report(v["path"], v["out"]))
    return 0


# ------------------------------------------------------------------ the parser

def _positional(name: str, kind: type, help: str, many: bool = False) -> tuple:
    return name, dict(type=kind, help=help, **({"nargs": "+"} if many else {}))


RUN_OR_SWEEP = "A sweep folder or a run folder (also while it is running)."

# command -> (function, positional arguments, options)
def _fit_predictor_options() -> list:
    from flt_diag.analysis import early_warning as EW  # light (numpy/pandas, no torch): the choices come from its tables
    return [
        cli_opt("--out", Path, "Predictor JSON to write (flt_diag/early_warning.json is the packaged one).",
                optional=False),
        cli_opt("--at", int, "Steps to fit a model at.", [100, 200, 300, 500], many=True, low=1, optional=False),
        cli_opt("--l2", float, "L2 penalty of the logistic regression.", 1.0, above=0, optional=False),
        cli_opt("--target", str, "fails (final verdict unstable, collapsed or diverged), collapse (collapsed or "
                "diverged) or climbs (fails, or the loss climbed and recovered: the verdict's transient_rebound).",
                "fails", choices=tuple(EW.TARGETS), optional=False),
        cli_opt("--features", str, f"Features the model uses [default: {' '.join(EW.DEFAULT_FEATURES)}].",
                many=True, choices=EW.FEATURES),
        cli_opt("--class-weight", str, "balanced (each class weighs half of the fit, whatever share of the runs "
                "fails) or none (each run weighs 1).", "balanced", choices=EW.CLASS_WEIGHTS, optional=False),
        cli_opt("--cross-validate", bool, "Also report leave-one-cell-out agreement at each step (every run "
                "predicted by a model fitted without its cell) and store it in the predictor JSON.", False)]


COMMANDS: dict[str, tuple] = {
    "train": (cmd_train, [], lambda: command_options("train")),
    "run-ablation": (cmd_run_ablation, [], lambda: command_options("run-ablation")),
    "map": (cmd_map, [], lambda: command_options("map")),
    "study": (cmd_study, [_positional("path", Path, "A study file from experiments/ (TOML).")],
              lambda: FOLDER_OPTIONS),
    "summary": (cmd_summary, [_positional("path", Path, "A sweep or run folder.")], lambda: [
        cli_opt("--recompute", bool, "Recompute every finished run's verdict and figures from its stored metrics "
                "(e.g. with new verdict thresholds).", False), *options_for("summary")]),
    "eval-loops": (cmd_eval_loops, [_positional("path", Path, "A finished run folder or a sweep folder.")], lambda: [
        cli_opt("--loops", int, "Inference loop counts [default: 1 .. 2K, K the loops each run was trained with].",
                many=True, low=1, high=MAX_LOOPS),
        cli_opt("--batches", int, "Validation batches per count [default: the run's eval batches].", low=1),
        cli_opt("--data", str, "Evaluate on another corpus (e.g. wikitext2) [default: the run's]."),
        cli_opt("--device", str, "cpu, cuda or cuda:N.", "cpu", optional=False)]),
    "import-reference": (cmd_import_reference, [_positional("checkpoint", Path, "State dict (.pt) in the reference "
                                                            "(nanochat) layout.")], lambda: [
        cli_opt("--out", Path, "Run folder to create (usable by eval-loops).", optional=False),
        cli_opt("--variant", str, "LT, LT_i, LT_ia, FLT_res, FLT (or lt, ..., flt) [default: model_type of the "
                "meta_*.json beside the checkpoint]."),
        cli_opt("--loops", int, "Loop count the checkpoint was trained with [default: K of the meta_*.json].",
                low=1),
        cli_opt("--heads", int, "Attention heads (if no meta json).", low=1),
        cli_opt("--vocab-size", int, "True (unpadded) vocabulary size.", low=1)]),
    "predict": (cmd_predict, [_positional("paths", Path, "Sweep or run folders of finished runs.", many=True)],
                lambda: [
        cli_opt("--at", int, "Step(s) at which to predict.", [300], many=True, low=1, optional=False),
        cli_opt("--predictor", Path, "Predictor JSON(s) from `flt-diag fit-predictor`; several are compared on the "
                "same runs [default: the packaged one].", many=True),
        cli_opt("--csv", Path, "Also write the per-cell table (all steps; a predictor column) here."),
        cli_opt("--figure", Path, "Also draw agreement, false alarms and misses against the step (.png/.pdf/.svg)."),
        cli_opt("--online", bool, "Instead of fixed steps, replay what --warn says over each whole run: the first "
                "warning step (checks every 25 steps), its P and evidence, the largest P, beside the final verdict.",
                False)]),
    "fit-predictor": (cmd_fit_predictor, [_positional("paths", Path, "Sweep or run folders of finished runs (the "
                                                      "training set).", many=True)], _fit_predictor_options),
    "variants": (cmd_variants, [], lambda: []),
    "report": (cmd_report, [_positional("path", Path, "A sweep or map folder.")], lambda: [
        cli_opt("--out", Path, "HTML file [default: <sweep>/report.html].")]),
}


def build_parser() -> Parser:
    from flt_diag.analysis.figures import FIGURES
    parser = Parser(prog="flt-diag", description="Train looped-transformer variants, record why they collapse, "
                    "and plot it.", formatter_class=argparse.RawDescriptionHelpFormatter)
    subs = parser.add_subparsers(dest="command", metavar="COMMAND", parser_class=Parser)
    for name, (func, positionals, options) in COMMANDS.items():
        doc = func.__doc__.strip().splitlines()[0]
        usage = f"flt-diag {name} {' '.join(p[0].upper() for p in positionals)} [options]".replace("  ", " ")
        sub = subs.add_parser(name, help=doc, description=doc, usage=usage)
        for pname, kwargs in positionals:
            sub.add_argument(pname, **kwargs)
        add_options(sub, options())
        sub.set_defaults(_func=func, _options=options)
    plot = subs.add_parser("plot", help="Figures from run, sweep or map folders (PNG and PDF).",
                           description="Figures from run, sweep or map folders (PNG and PDF).")
    figures = plot.add_subparsers(dest="figure", metavar="FIGURE", parser_class=Parser)
    for name, fig in [*FIGURES.items(), ("all", None)]:
        help = fig.help if fig is not None else "Every figure that has data."
        f = figures.add_parser(name, help=help, description=help)
        f.add_argument("path", type=Path, help=RUN_OR_SWEEP)
        options = [cli_opt("--out", Path, "Folder for the figures [default: <path>/figures]."),
                   cli_opt("--format", str, "Formats.", ["png", "pdf"], many=True, choices=("png", "pdf", "svg"),
                           optional=False)]
        add_options(f, options)
        f.set_defaults(_func=cmd_plot, _options=lambda options=options: options)
    return parser


# ------------------------------------------------------------------ entry point

@functools.lru_cache(maxsize=4)
def _parser(figures: tuple[str, ...]) -> Parser:
    return build_parser()  # ~0.15 s: built once per process (per set of registered figures)


def run(argv: list[str]) -> int:
    from flt_diag.analysis.figures import FIGURES
    parser = _parser(tuple(FIGURES))
    if not argv:
        parser.print_help(sys.stderr)
        return 2
    args = parser.parse_args(argv)
    if getattr(args, "_func", None) is None:  # `flt-diag plot` without a figure
        from flt_diag.analysis.figures import FIGURES
        raise UserError(f"plot needs a figure: {', '.join([*FIGURES, 'all'])} (flt-diag plot --help)")
    values = check_values(vars(args), args._options())
    return args._func(values)


def main(argv: list[str] | None = None) -> int:
    from flt_diag.data.corpus import DataError
    from flt_diag.analysis.storage import StorageError

    try:
        return run(list(sys.argv[1:] if argv is None else argv))
    except SystemExit as e:  # --help
        return e.code if isinstance(e.code, int) else 0
    except KeyboardInterrupt:
        progress_bar.close()
        print("interrupted; finished work is kept (re-run the same command to resume)", file=sys.stderr)
        return 130
    except (UserError, StorageError, DataError, ValueError, FileNotFoundError, PermissionError) as e:
        if os.environ.get("FLT_DIAG_DEBUG"):
            raise
        print(f"error: {e}", file=sys.stderr)
        return 2
    except OSError as e:  # a full disk, a path that is a file, ...: files in flight were removed (atomic_path)
        if os.environ.get("FLT_DIAG_DEBUG"):
            raise
        where = f": {e.filename}" if e.filename else ""
        print(f"error: {e.strerror or type(e).__name__}{where}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
