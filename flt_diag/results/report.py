"""A self-contained HTML report of a sweep (or a run folder), from its folder alone (no torch).

One file, no external resources: the results table (tables.results_table), every figure with data as an
embedded base64 PNG, the sweep's spec (sweep.json) and the environment of its first run.
"""
from __future__ import annotations

import base64
import html
import io
import json
import sys
from pathlib import Path

import pandas as pd

from flt_diag.results.figures import FIGURES, render
from flt_diag.results.figures.style import BEHIND_COLOR, VERDICT_COLORS, style
from flt_diag.judge.map_boundaries import critical_table
from flt_diag.results.tables import Study, collect, results_table
from flt_diag.storage.folders import atomic_write_text

REPORT = "report.html"
COMPARISON_NOTE = ("Gap to best: the cell's val loss minus the lowest among the variants at the same loops K, lr scale, "
                   "depth and width, in nats (best: that lowest). Flags: behind = the gap exceeds the margin "
                   "max(0.02, 2 s_p sqrt(1/n + 1/n_best)), s_p the pooled seed spread of the other cells with 2 or "
                   "more seeds (0.10 nats without any), a stable cell so flagged is shown amber, not green; "
                   "no loop gain = not better than the same setting at K = 1 by that margin. "
                   "Peak ÷ FLT: its peak final-loop residual norm over FLT's "
                   "there (– where the sweep has no FLT). Failed (with several seeds): k/n, k of the cell's n finished "
                   "seeds ended with a verdict other than stable; unfinished seeds are not in n.")
REPORT_DPI = 110

CSS = """
body { font-family: -apple-system, 'Segoe UI', Helvetica, Arial, sans-serif; margin: 2em auto; max-width: 1200px;
       color: #222; padding: 0 1em; }
h1 { font-size: 1.6em; } h2 { font-size: 1.25em; margin-top: 2em; border-bottom: 1px solid #ddd; }
table { border-collapse: collapse; font-size: 0.9em; margin: 0.5em 0; }
th, td { padding: 0.3em 0.7em; border-bottom: 1px solid #e4e4e4; text-align: right; }
th { background: #f6f6f6; } td.l, th.l { text-align: left; }
figure { margin: 1.5em 0; } figure img { max-width: 100%; height: auto; border: 1px solid #eee; }
figcaption { font-size: 0.9em; color: #555; margin-top: 0.3em; }
pre { background: #f6f6f6; padding: 0.8em; overflow-x: auto; font-size: 0.8em; }
.note { color: #777; font-size: 0.9em; }
"""


def markdown(df: pd.DataFrame) -> str:
    """A GitHub-flavoured markdown table of a text table."""
    def line(cells) -> str:
        return "| " + " | ".join(str(c).replace("|", "\\|") for c in cells) + " |"
    rows = [line(df.columns), "|" + "|".join("---" for _ in df.columns) + "|"]
    return "\n".join(rows + [line(row) for row in df.itertuples(index=False)]) + "\n"


def _html_table(df: pd.DataFrame, verdict_column: str | None = "Verdict") -> str:
    left = {"Variant", "Verdict", "key"}
    head = "".join(f'<th class="{"l" if c in left else ""}">{html.escape(str(c))}</th>' for c in df.columns)
    body = []
    for row in df.itertuples(index=False):
        cells = []
        behind = "behind" in str(dict(zip(df.columns, row)).get("Flags", ""))
        for col, value in zip(df.columns, row):
            style = ""
            if col == verdict_column:
                verdict = str(value).split(" ")[0]
                color = BEHIND_COLOR if behind and verdict == "stable" else VERDICT_COLORS.get(verdict, "#ffffff")
                style = f' style="background:{color}"'
            cells.append(f'<td class="{"l" if col in left else ""}"{style}>{html.escape(str(value))}</td>')
        body.append("<tr>" + "".join(cells) + "</tr>")
    return f"<table><thead><tr>{head}</tr></thead><tbody>{''.join(body)}</tbody></table>"


def _png_base64(fig) -> str:
    buf = io.BytesIO()
    with style():
        fig.savefig(buf, format="png", dpi=REPORT_DPI, bbox_inches="tight")
    return base64.b64encode(buf.getvalue()).decode("ascii")


def _caption(kind: str) -> str:
    figure = FIGURES[kind]
    doc = sys.modules[figure.draw.__module__].__doc__ or figure.help
    return " ".join(doc.split())


def render_html(study: Study, figures: dict, skipped: dict[str, str]) -> str:
    """The report page of a collected study and its rendered figures."""
    title = f"flt-diag report: {study.path.name}"
    done = sum(r.summary is not None for r in study.runs)
    parts = [f"<h1>{html.escape(title)}</h1>",
             f'<p class="note">{html.escape(str(study.path))}: {len(study.runs)} run folders, {done} finished, '
             f"{len(study.runs) - done} running. Numbers are means over a cell's finished seeds; the verdict is "
             "their majority.</p>",
             "<h2>Results</h2>", f'<p class="note">{html.escape(COMPARISON_NOTE)}</p>', _html_table(results_table(study))]
    if study.kind == "map":
        parts += ["<h2>Stability map: critical values</h2>",
                  '<p class="note">Boundary (geometric mean of the last value that held and the first that broke; '
                  "median [min-max] over seeds); &gt; x: held up to the grid's top; &lt; x: broke at its bottom.</p>",
                  _html_table(critical_table(study.path), verdict_column=None)]
    parts.append("<h2>Figures</h2>")
    for kind, fig in figures.items():
        parts.append(f'<figure id="{kind}"><img alt="{kind}" src="data:image/png;base64,{_png_base64(fig)}">'
                     f"<figcaption><b>{kind}</b>: {html.escape(_caption(kind))}</figcaption></figure>")
    for kind, why in skipped.items():
        parts.append(f'<p class="note">Figure {kind} left out: {html.escape(why)}</p>')
    spec = study.spec.as_written() if study.spec is not None else \
        {k: v for k, v in study.runs[0].config.as_written().items() if k != "env"}
    parts += ["<h2>Sweep spec</h2>" if study.spec is not None else "<h2>Configuration</h2>",
              f"<pre>{html.escape(json.dumps(spec, indent=1))}</pre>"]
    env = study.runs[0].config.env or {}
    env_df = pd.DataFrame({"key": list(env), "value": [str(v) for v in env.values()]})
    parts += [f"<h2>Environment</h2><p class=\"note\">of {html.escape(study.runs[0].name)}</p>",
              _html_table(env_df, verdict_column=None)]
    return (f'<!DOCTYPE html>\n<html lang="en"><head><meta charset="utf-8"><title>{html.escape(title)}</title>'
            f"<style>{CSS}</style></head><body>\n" + "\n".join(parts) + "\n</body></html>\n")


def write_report(sweep_path, out=None) -> Path:
    """Write the HTML report of a sweep (or a run folder, or several sweeps of one setting pooled: a list);
    default <sweep>/report.html (of the first sweep)."""
    study = collect(sweep_path)
    figures, skipped = render(study)
    return write_html(study, figures, skipped, Path(out) if out is not None else study.path / REPORT,
                      root=None if out is not None else study.path)


def write_html(study: Study, figures: dict, skipped: dict[str, str], out: Path, root=None) -> Path:
    """`root`: the folder the report is written into by default (no link below it is written through)."""
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    atomic_write_text(out, render_html(study, figures, skipped), root)
    return out
