"""The report as one self-contained HTML file: figures inlined as PNG, tables, the verdict line.

Layout only: the words come from `wording`, the data from `report.gather`.
"""

from __future__ import annotations

import html
import json
from collections.abc import Mapping, Sequence
from dataclasses import asdict
from typing import Any

from warninglight.forensics.judging.conditions import Config
from warninglight.forensics.presenting import plots, wording
from warninglight.forensics.presenting.contents import ReportData
from warninglight.tracer import schema

_CSS = """body{font-family:system-ui,sans-serif;max-width:1150px;margin:2em auto;color:#222}
h1{font-size:1.5em}h2{font-size:1.15em;margin-top:1.6em;border-bottom:1px solid #ddd}
.verdict{font-size:1.05em;padding:.7em 1em;border-left:6px solid #d62728;background:#fbeaea}
.verdict.clean{border-color:#2ca02c;background:#eaf6ea}
.warnings{padding:.4em 1em;border-left:6px solid #e6a700;background:#fdf6e3}
table{border-collapse:collapse;font-size:.9em}td,th{border:1px solid #ccc;padding:.25em .6em;text-align:left}
th{background:#f3f3f3}img{max-width:100%;border:1px solid #eee}code{background:#f5f5f5}"""

# alarm field -> column header in the report
ALARM_HEADERS = {"observed_on": "observed on", "attributed_to": "attributed to", "condition": "condition",
                 "metric": "metric", "onset_step": "onset step", "step": "alarm step",
                 "last_step": "last step", "magnitude": "|z|", "value": "value", "median": "baseline median"}
_ROLLBACK_HEADERS = {"choice": "choice", "alarm_step": "alarm step", "checkpoint_step": "resume from step",
                     "checkpoint_path": "checkpoint", "steps_discarded": "steps discarded",
                     "skip_step_range": "skip steps", "skip_batches": "skip batches", "contaminated": "holds the damage"}
_CAPTIONS = {  # figure stem -> (heading, note under the image)
    "heatmap": ("Where: every component at every step",
                "Each cell: the largest |robust z| of any recorded metric of that component at that step, "
                "against the component's own trailing baseline (a cell of several steps: each against the "
                "baseline of its first). Orange to brown: the cell is in an alarm's episode on that "
                "component (its onset to its last alarming step). Blue: a departure no alarm counted, "
                "which the engine judged and set aside: a rule asks more than |z| (a fold of the baseline "
                "or a change in the metric's units too, held on consecutive steps, as warninglight "
                "conditions lists them){unread}. Grey: no baseline yet (warm-up)."),
    "root_metric": ("The root component against its baseline", ""),
    "loss": ("When: the light against the loss and gradient-norm rules",
             "Vertical lines: the fault's onset and our alarm, the comparators' first firing at or after "
             "the onset, and the checkpoint each rollback would resume from."),
    "conditions": ("What: conditions by component", ""),
    "ranks": ("Which rank: every rank at every step",
              "Colour: how far the rank's local gradient norm (before the all-reduce) strays from the "
              "ranks' median, in log units, the largest over components (red: above the others, blue: "
              "below). Black ticks: the rank's weights differ from the "
              "majority of ranks (every rank, when no majority exists)."),
}


def _table(rows: Sequence[Mapping[str, Any]], columns: Sequence[str]) -> str:
    if not rows:
        return "<p>none</p>"
    head = "".join(f"<th>{html.escape(c)}</th>" for c in columns)
    body = "".join("<tr>" + "".join(f"<td>{html.escape(wording.number(r.get(c)))}</td>" for c in columns) + "</tr>"
                   for r in rows)
    return f"<table><tr>{head}</tr>{body}</table>"


def alarm_rows(data: ReportData) -> list[dict[str, Any]]:
    """The alarm table's rows, earliest alarm first, with the report's column names."""
    alarms = sorted(data.analysis.alarm_list(), key=lambda a: (a.step, a.onset_step))
    return [{header: getattr(a, key) for key, header in ALARM_HEADERS.items()} for a in alarms]


def _comparator_rows(data: ReportData) -> list[dict[str, Any]]:
    root, det = data.analysis.root, data.analysis.detectors
    ours = det.first_alarm_step or (root.alarm_step if root else None)
    rows = [{"detector": "Warning Light", "first alarm step": ours, "names a component": root.name if root else None}]
    for name, step in (("loss spike (mean + 6σ, 128 steps)", det.loss_spike_step),
                       ("gradient-norm spike", det.grad_norm_spike_step)):
        rows.append({"detector": name, "first alarm step": step or "never fired", "names a component": "no"})
    first = data.static[0] if data.static else None
    rows.append({"detector": "static rules (SageMaker-style)",
                 "first alarm step": first.step if first else "never fired",
                 "names a component": f"{first.component} ({first.rule})" if first else "—"})
    return rows


def _header(data: ReportData) -> list[str]:
    a = data.analysis
    line = wording.analysis_summary_line(a)
    parts = [f"<!doctype html><html><head><meta charset='utf-8'><title>Warning Light — {html.escape(data.trace.name)}</title>",
             f"<style>{_CSS}</style></head><body>",
             f"<h1>Warning Light report: <code>{html.escape(str(data.trace))}</code></h1>",
             f"<p class='{'verdict' if a.root is not None else 'verdict clean'}'>{html.escape(line)}</p>"]
    if a.root is not None:
        seen = f" (first seen on <code>{html.escape(a.root.observed_on)}</code>)" if a.root.observed_on else ""
        parts.append(f"<p><b>Why this component:</b> {html.escape(a.root.evidence)}{seen}</p>")
    if a.rollback.note:
        parts.append(f"<p><b>Rollback:</b> {html.escape(a.rollback.note)}</p>")
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


def _figures(data: ReportData, images: Mapping[str, bytes]) -> list[str]:
    parts = []
    unread = unread_metrics(data.analysis.config)
    for name, png in images.items():
        heading, note = _CAPTIONS.get(name, (name, ""))
        note = note.replace("{unread}", f", and no rule reads {', '.join(unread)}" if unread else "")
        parts.append(f"<h2>{html.escape(heading)}</h2><img alt='{name}' src='{plots.data_uri(png)}'>")
        if note:
            parts.append(f"<p><small>{html.escape(note)}</small></p>")
    return parts


def _rollback(data: ReportData) -> str:
    a = data.analysis
    ours = {**a.rollback.to_dict(), "alarm_step": a.root.alarm_step if a.root else None}
    choices = [{"choice": "Warning Light", **ours}, {"choice": "loss-only operator", **asdict(a.rollback.loss_only)}]
    rows = [{header: c.get(key) for key, header in _ROLLBACK_HEADERS.items()} for c in choices]
    return "<h2>Rollback</h2>" + _table(rows, list(_ROLLBACK_HEADERS.values()))


def render_html(data: ReportData, images: Mapping[str, bytes]) -> str:
    """The report as one HTML string with the PNGs inlined."""
    parts = [*_header(data), *_figures(data, images), _rollback(data),
             "<h2>Detectors</h2>" + _table(_comparator_rows(data), ["detector", "first alarm step", "names a component"]),
             f"<h2>Alarms ({len(data.analysis.alarms)})</h2>" + _table(alarm_rows(data), list(ALARM_HEADERS.values())),
             f"<h2>Static-rule firings ({len(data.static)})</h2>"
             + _table([s.to_dict() for s in data.static], ["rule", "component", "step", "value", "steps_fired"]),
             "</body></html>"]
    return "\n".join(parts)
