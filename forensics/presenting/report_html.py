"""The report as one self-contained HTML file: figures inlined as PNG, tables, the verdict line.

Layout only: the words come from `wording`, the data from `report.gather`.
"""

from __future__ import annotations

import html
import json
from collections.abc import Mapping, Sequence
from typing import Any

from warninglight.forensics.explaining import saved_rerun
from warninglight.forensics.judging.conditions import Config
from warninglight.forensics.presenting import plots, tables, wording
from warninglight.forensics.presenting.contents import ReportData
from warninglight.tracer import schema

_CSS = """body{font-family:system-ui,sans-serif;max-width:1150px;margin:2em auto;color:#222}
h1{font-size:1.5em}h2{font-size:1.15em;margin-top:1.6em;border-bottom:1px solid #ddd}
.verdict{font-size:1.05em;padding:.7em 1em;border-left:6px solid #d62728;background:#fbeaea}
.verdict.clean{border-color:#2ca02c;background:#eaf6ea}
.warnings{padding:.4em 1em;border-left:6px solid #e6a700;background:#fdf6e3}
table{border-collapse:collapse;font-size:.9em}td,th{border:1px solid #ccc;padding:.25em .6em;text-align:left}
th{background:#f3f3f3}img{max-width:100%;border:1px solid #eee}code{background:#f5f5f5}"""

_CAPTIONS = {  # figure stem -> (heading, note under the image)
    "heatmap": ("Where: every component at every step",
                "Each cell: the largest |robust z| of any recorded metric of that component at that step, "
                "against the component's own trailing baseline (a cell of several steps: each against the "
                "baseline of its first). Orange to brown: the cell is in an alarm's episode on that "
                "component (its onset to its last alarming step). Blue: a departure no alarm counted, "
                "which the engine judged and set aside: a rule asks more than |z| (a fold of the baseline "
                "or a change in the metric's units too, held on consecutive steps, as warninglight "
                "conditions lists them){unread}. Grey: no baseline yet (warm-up)."),
    "root_metric": ("The root component against its baseline",
                    "Black: the root metric. Blue: its baseline, the median ± 3 robust scales of its trailing "
                    "window. From the onset to the alarm's last step the band is held as it stood at the onset "
                    "(hatched), so the fault shows against the baseline before it; after that it is the trailing "
                    "window again, which spans both levels while it holds steps from before and after the fault."),
    "loss": ("When: the light against the loss and gradient-norm rules",
             "Vertical lines, those that apply: the fault's onset and our alarm, each comparator's first "
             "firing (at or after the onset when there is one), and the checkpoint each rollback would "
             "resume from."),
    "conditions": ("What: conditions by component", ""),
    "ranks": ("Which rank: every rank at every step",
              "Colour: how far the rank's local gradient norm (before the all-reduce) strays from the "
              "ranks' median, in log units, the largest over components (red: above the others, blue: "
              "below). Black ticks: the rank's weights differ from the "
              "majority of ranks (every rank, when no majority exists)."),
}


def _table(rows: Sequence[Mapping[str, Any] | str], columns: Sequence[str], empty: str) -> str:
    """An HTML table of `rows` (a str row: one cell across the table, a sentence), or `empty`."""
    if not rows:
        return f"<p>{html.escape(empty)}</p>"
    head = "".join(f"<th>{html.escape(c)}</th>" for c in columns)
    body = "".join(f"<tr><td colspan='{len(columns)}'>{html.escape(r)}</td></tr>" if isinstance(r, str) else
                   "<tr>" + "".join(f"<td>{html.escape(wording.number(r.get(c)))}</td>" for c in columns) + "</tr>"
                   for r in rows)
    return f"<table><tr>{head}</tr>{body}</table>"


def _header(data: ReportData) -> list[str]:
    a = data.analysis
    line = wording.analysis_summary_line(a)
    parts = [f"<!doctype html><html><head><meta charset='utf-8'><title>Warning Light — {html.escape(data.trace.name)}</title>",
             f"<style>{_CSS}</style></head><body>",
             f"<h1>Warning Light report: <code>{html.escape(str(data.trace))}</code></h1>",
             f"<p class='{'verdict' if a.root is not None else 'verdict clean'}'>{html.escape(line)}</p>"]
    if a.root is not None:
        seen = f" (first seen on <code>{html.escape(a.root.observed_on)}</code>)" if a.root.observed_on else ""
        why = "What the recorder saw" if a.root.scope == "setup" else "Why this component"
        parts.append(f"<p><b>{why}:</b> {html.escape(a.root.evidence)}{seen}</p>")
    if a.rollback.note:
        parts.append(f"<p><b>Rollback:</b> {html.escape(a.rollback.note)}</p>")
    if a.rerun:  # a re-run saved beside the trace: why, and the samples to skip
        said = "<br>".join(html.escape(line) for line in saved_rerun.lines(a.rerun))
        parts.append(f"<p><b>Re-run:</b> {said}</p>")
    if data.warnings:  # what `analyze` printed as `warning:` lines: the report says it too
        items = "".join(f"<li>{html.escape(' '.join(w.split()))}</li>" for w in data.warnings)
        parts.append(f"<div class='warnings'><b>Warnings</b> (what the analysis went past):<ul>{items}</ul></div>")
    if data.truth:
        parts.append(f"<p><b>Answer key</b> (truth.json of this rehearsal): <code>{html.escape(json.dumps(data.truth))}</code></p>")
    return parts


def unread_metrics(config: Config) -> list[str]:
    """The health metrics no rule of `config` reads: the heatmap shows their departures, which never alarm."""
    read = {r.metric for c in config.conditions for r in c.rules}
    return [m for m in schema.HEALTH_METRICS if m not in read]


def _no_heatmap(data: ReportData) -> str:
    """Why there is no heatmap: no components table, or every step in the baseline's warm-up."""
    a = data.analysis
    if not data.order:
        return "No map: the trace has no components table, so there are no component rows to draw."
    return (f"No map: no component was judged against its baseline. A component is first judged at its "
            f"recorded step {a.warmup_steps} (baseline.min_samples + baseline.lag) and this run recorded "
            f"{a.summary.get('steps', 0)} steps; only non-finite values"
            + (" and the ranks' comparison" if (a.summary.get("ranks") or 1) > 1 else "") + " could alarm.")


def _figures(data: ReportData, images: Mapping[str, bytes]) -> list[str]:
    parts = []
    if "heatmap" not in images:
        parts.append(f"<h2>{html.escape(_CAPTIONS['heatmap'][0])}</h2><p>{html.escape(_no_heatmap(data))}</p>")
    unread = unread_metrics(data.analysis.config)
    for name, png in images.items():
        heading, note = _CAPTIONS.get(name, (name, ""))
        note = note.replace("{unread}", f", and no rule reads {', '.join(unread)}" if unread else "")
        parts.append(f"<h2>{html.escape(heading)}</h2><img alt='{name}' src='{plots.data_uri(png)}'>")
        if note:
            parts.append(f"<p><small>{html.escape(note)}</small></p>")
    return parts


def render_html(data: ReportData, images: Mapping[str, bytes]) -> str:
    """The report as one HTML string with the PNGs inlined."""
    a = data.analysis
    found = ([f"<h2>Set-up findings ({len(a.findings)})</h2>"
              + _table(tables.finding_rows(a), tables.FINDING_HEADERS, "")] if a.findings else [])
    parts = [*_header(data), *found, *_figures(data, images),
             "<h2>Rollback</h2>" + (_table(tables.rollback_rows(a), tables.ROLLBACK_HEADERS, "") if a.root else
                                    "<p>none: no alarm, so nothing to roll back</p>"),
             "<h2>Detectors</h2>" + _table(tables.detector_rows(a), tables.DETECTOR_HEADERS, ""),
             f"<h2>Alarms ({len(a.alarms)})</h2>"
             + _table(tables.alarm_rows(a), list(tables.ALARM_HEADERS.values()),
                      "none: no component left its baseline the way a rule asks"),
             f"<h2>Static-rule firings ({len(data.static)})</h2>"
             + _table(tables.static_rows(a), tables.STATIC_HEADERS, "none: no fixed-threshold rule fired"),
             "</body></html>"]
    return "\n".join(parts)
