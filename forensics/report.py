"""The forensic report: one self-contained HTML file (figures embedded as PNG), or the PNGs alone.

Reads the trace's tables, asks the engine (`forensics.analyze`) for the verdict and the static
rules for what fixed thresholds saw, and lays both out for a person: heatmap, root metric against
its baseline, loss and gradient norm with every detector's mark, the rollback, the alarm table.
"""

from __future__ import annotations

import html
import json
import math
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import polars as pl
from matplotlib.figure import Figure
from warninglight.forensics import plots
from warninglight.forensics.analysis import root_name
from warninglight.forensics.static_rules import StaticAlarm, static_alarms


@dataclass
class ReportData:
    """Everything the report shows, gathered once."""

    trace: Path
    result: dict[str, Any]  # Analysis.to_dict(): the `analyze --json` object
    steps: pl.DataFrame
    order: list[str]  # components in forward order
    kinds: dict[str, str]  # component -> module class, for axis labels
    scores: pl.DataFrame  # component, step, score (worst |robust z| over the metrics)
    root_band: pl.DataFrame | None
    static: list[StaticAlarm]
    truth: dict[str, Any] | None = None


def read_tables(trace: Path) -> tuple[pl.DataFrame, pl.DataFrame]:
    """(steps, components) of the trace's effective timeline."""
    from warninglight.forensics.store import open_trace

    opened = open_trace(trace)  # raises TraceError naming the path if it is not a trace
    try:
        return opened.frame("steps").collect().sort("step"), opened.frame("components").collect()
    finally:
        opened.close()


def component_order(components: pl.DataFrame) -> list[str]:
    """Components sorted by forward order (never-called ones last, by name); the root left out."""
    c = components.unique("component", keep="first").filter(pl.col("component") != "")
    c = c.sort([pl.col("forward_index").is_null(), "forward_index", "component"])
    return c["component"].to_list()


def heat_scores(analysis: Any) -> pl.DataFrame:
    """Worst |robust z| over all metrics per (component, step), from the engine's scored frame.

    Takes the largest over ranks too, so a rank whose replica disagrees still shows.
    """
    scored: pl.DataFrame | None = getattr(analysis, "scored", None)
    z_cols = [c for c in (scored.columns if scored is not None else []) if c.endswith("__z")]
    if not z_cols:
        return pl.DataFrame(schema={"component": pl.String, "step": pl.Int64, "score": pl.Float64})
    # a z before the metric's baseline exists (warm-up, median null) is not a departure: leave it blank
    finite = [pl.when(pl.col(c).is_finite() & pl.col(c.replace("__z", "__med")).is_not_null()).then(pl.col(c).abs())
              if c.replace("__z", "__med") in scored.columns else pl.when(pl.col(c).is_finite()).then(pl.col(c).abs())
              for c in z_cols]
    return (scored.select("component", "step", pl.max_horizontal(finite).alias("score"))
            .group_by("component", "step").agg(pl.col("score").max()))


def read_truth(trace: Path) -> dict[str, Any] | None:
    """The answer key a rehearsal left in the trace (truth.json), or None for a real run."""
    path = trace / "truth.json"
    return json.loads(path.read_text()) if path.exists() else None


def gather(trace: Path | str, analysis: Any = None) -> ReportData:
    """Read the trace and run (or take) the analysis; everything the report needs."""
    trace = Path(trace)
    if analysis is None:
        # the engine is imported late: it is the heavy part, and plots alone do not need it
        from warninglight.forensics import analyze

        analysis = analyze(trace)
    result = analysis.to_dict()
    steps, components = read_tables(trace)
    order = component_order(components)
    kinds = dict(zip(components["component"], components["kind"], strict=True))
    root = result.get("root") or {}
    band = None
    if root.get("attributed_to") is not None and root.get("metric"):
        # the metric was measured on `observed_on` (e.g. the ReLU after the root Linear)
        band = analysis.baseline_frame(root["observed_on"], root["metric"])
    return ReportData(trace, result, steps, order, kinds,
                      heat_scores(analysis), band, static_alarms(trace), read_truth(trace))


def marks(data: ReportData) -> list[plots.Mark]:
    """Every dated event the step-axis figures draw: onset, alarm, detectors, rollbacks, truth."""
    r = data.result
    root, det, rb = r.get("root") or {}, r.get("detectors") or {}, r.get("rollback") or {}
    loss_only = rb.get("loss_only") or {}
    first_static = data.static[0].step if data.static else None
    candidates = [
        ("injected", (data.truth or {}).get("step")),
        ("onset", root.get("onset_step")),
        ("first alarm", det.get("first_alarm_step") if det.get("first_alarm_step") != root.get("alarm_step") else None),
        ("alarm", root.get("alarm_step")),
        ("loss-spike rule", det.get("loss_spike_step")),
        ("grad-norm rule", det.get("grad_norm_spike_step")),
        ("static rules", first_static),
        ("rollback (ours)", rb.get("checkpoint_step")),
        ("rollback (loss-only)", loss_only.get("checkpoint_step")),
    ]
    return [plots.Mark(label, int(step)) for label, step in candidates if step is not None]


def never_fired(data: ReportData) -> list[str]:
    """The comparators that did not fire at all, named in the loss figure's legend."""
    det = data.result.get("detectors") or {}
    out = [label for label, key in (("loss-spike rule", "loss_spike_step"), ("grad-norm rule", "grad_norm_spike_step"))
           if det.get(key) is None]
    return out + ([] if data.static else ["static rules"])


def figures(data: ReportData) -> dict[str, Figure]:
    """The report's figures by file stem, in the order the report shows them."""
    m = marks(data)
    figs: dict[str, Figure] = {}
    if len(data.scores):
        figs["heatmap"] = plots.heatmap(data.scores, data.order, [x for x in m if x.label in ("onset", "first alarm", "alarm")],
                                        kinds=data.kinds)
    root = data.result.get("root") or {}
    if data.root_band is not None and len(data.root_band):
        observed = root["observed_on"]
        name = root_name(root) if observed == root["attributed_to"] else f"{root_name(root)}, seen on {observed}"
        figs["root_metric"] = plots.baseline_band(data.root_band, name, root["metric"],
                                                  [x for x in m if x.label in ("injected", "onset", "first alarm", "alarm")])
    figs["loss"] = plots.loss_and_grad(data.steps, m, never_fired(data))
    alarms = pl.DataFrame(data.result.get("alarms") or [], infer_schema_length=None)
    if len(alarms) and {"observed_on", "condition", "onset_step"} <= set(alarms.columns):
        figs["conditions"] = plots.condition_map(alarms, data.order, int(data.steps["step"].max()),
                                                 [x for x in m if x.label in ("onset", "first alarm", "alarm")],
                                                 kinds=data.kinds)
    return figs


def _fmt(v: Any) -> str:
    if v is None:
        return "—"
    if isinstance(v, float):
        return "—" if math.isnan(v) else f"{v:.3g}"
    if isinstance(v, list | tuple):
        return "–".join(_fmt(x) for x in v) if len(v) <= 2 else f"{len(v)} items"
    return str(v)


def summary_line(result: Mapping[str, Any]) -> str:
    """The verdict as one line an operator can act on: what, where, since when, and where to go back to."""
    root = result.get("root") or {}
    if root.get("attributed_to") is None:
        return f"{str(result.get('verdict', 'clean')).upper()}: no component left its baseline; no rollback needed."
    rb = result.get("rollback") or {}
    loss_only = rb.get("loss_only") or {}
    line = (f"ALARM {root_name(root)}: {root.get('condition')} "
            f"(|z| {_fmt(root.get('magnitude'))} on {root.get('metric')}), "
            f"onset step {root.get('onset_step')}, alarm step {root.get('alarm_step')}")
    first = (result.get("detectors") or {}).get("first_alarm_step")
    if first is not None and root.get("alarm_step") is not None and first < root["alarm_step"]:
        line += f" (the light first lit at step {first})"
    if rb.get("checkpoint_step") is None:
        return line + " — no checkpoint before the onset: restart from scratch."
    line += (f" — roll back to step {rb['checkpoint_step']} ({rb.get('checkpoint_path') or 'checkpoint'}), "
             f"discard {rb.get('steps_discarded')} steps")
    if rb.get("skip_step_range"):
        line += f", skip the batches of steps {_fmt(rb['skip_step_range'])}"
    if loss_only and loss_only.get("alarm_step") is None and loss_only.get("checkpoint_step") is None:
        line += "; the loss-spike rule never fired"
    elif loss_only.get("contaminated"):
        line += f"; the loss-only choice (step {loss_only.get('checkpoint_step')}) already held the damage"
    elif loss_only.get("steps_discarded") is not None and rb.get("steps_discarded") is not None:
        saved = loss_only["steps_discarded"] - rb["steps_discarded"]
        line += (f"; the loss-only choice (step {loss_only.get('checkpoint_step')}, clean) "
                 f"would discard {loss_only['steps_discarded']}: {saved} steps saved")
    return line + "."


_CSS = """body{font-family:system-ui,sans-serif;max-width:1150px;margin:2em auto;color:#222}
h1{font-size:1.5em}h2{font-size:1.15em;margin-top:1.6em;border-bottom:1px solid #ddd}
.verdict{font-size:1.05em;padding:.7em 1em;border-left:6px solid #d62728;background:#fbeaea}
.verdict.clean{border-color:#2ca02c;background:#eaf6ea}
table{border-collapse:collapse;font-size:.9em}td,th{border:1px solid #ccc;padding:.25em .6em;text-align:left}
th{background:#f3f3f3}img{max-width:100%;border:1px solid #eee}code{background:#f5f5f5}"""


def _table(rows: list[Mapping[str, Any]], columns: list[str]) -> str:
    if not rows:
        return "<p>none</p>"
    head = "".join(f"<th>{html.escape(c)}</th>" for c in columns)
    body = "".join("<tr>" + "".join(f"<td>{html.escape(_fmt(r.get(c)))}</td>" for c in columns) + "</tr>"
                   for r in rows)
    return f"<table><tr>{head}</tr>{body}</table>"


def _comparators(data: ReportData) -> list[dict[str, Any]]:
    det, root = data.result.get("detectors") or {}, data.result.get("root") or {}
    ours = det.get("first_alarm_step") or root.get("alarm_step")
    rows = [{"detector": "Warning Light", "first alarm step": ours, "names a component": root_name(root) if root else None}]
    for name, key in (("loss spike (mean + 6σ, 128 steps)", "loss_spike_step"),
                      ("gradient-norm spike", "grad_norm_spike_step")):
        rows.append({"detector": name, "first alarm step": det.get(key) or "never fired", "names a component": "no"})
    first = data.static[0] if data.static else None
    rows.append({"detector": "static rules (SageMaker-style)",
                 "first alarm step": first.step if first else "never fired",
                 "names a component": f"{first.component} ({first.rule})" if first else "—"})
    return rows


# alarm key in the `analyze --json` object -> column header in the report
ALARM_HEADERS = {"observed_on": "observed on", "attributed_to": "attributed to", "condition": "condition",
                 "metric": "metric", "onset_step": "onset step", "step": "alarm step",
                 "last_step": "last step", "magnitude": "|z|", "value": "value", "median": "baseline median"}


def alarm_rows(result: Mapping[str, Any]) -> list[dict[str, Any]]:
    """The alarm table's rows, earliest alarm first, with the report's column names."""
    alarms = sorted(result.get("alarms") or [], key=lambda a: (a.get("step") or 0, a.get("onset_step") or 0))
    return [{header: a.get(key) for key, header in ALARM_HEADERS.items()} for a in alarms]


_CAPTIONS = {  # figure stem -> (heading, note under the image)
    "heatmap": ("Where: every component at every step",
                "Each cell: the largest |robust z| of any recorded metric of that component at that step, "
                "against the component's own trailing baseline. Grey: no baseline yet (warm-up)."),
    "root_metric": ("The root component against its baseline", ""),
    "loss": ("When: the light against the loss and gradient-norm rules",
             "Vertical lines: the fault's onset and our alarm, the comparators' first firing at or after "
             "the onset, and the checkpoint each rollback would resume from."),
    "conditions": ("What: conditions by component", ""),
}
_ROLLBACK_HEADERS = {"choice": "choice", "alarm_step": "alarm step", "checkpoint_step": "resume from step",
                     "checkpoint_path": "checkpoint", "steps_discarded": "steps discarded",
                     "skip_step_range": "skip steps", "skip_batches": "skip batches", "contaminated": "holds the damage"}


def _header(data: ReportData) -> list[str]:
    r, root = data.result, data.result.get("root") or {}
    line = summary_line(r)
    parts = [f"<!doctype html><html><head><meta charset='utf-8'><title>Warning Light — {html.escape(data.trace.name)}</title>",
             f"<style>{_CSS}</style></head><body>",
             f"<h1>Warning Light report: <code>{html.escape(str(data.trace))}</code></h1>",
             f"<p class='{'verdict' if line.startswith('ALARM') else 'verdict clean'}'>{html.escape(line)}</p>"]
    if root.get("evidence"):
        seen = f" (first seen on <code>{html.escape(root['observed_on'])}</code>)" if root.get("observed_on") else ""
        parts.append(f"<p><b>Why this component:</b> {html.escape(root['evidence'])}{seen}</p>")
    if (r.get("rollback") or {}).get("note"):
        parts.append(f"<p><b>Rollback:</b> {html.escape(r['rollback']['note'])}</p>")
    if data.truth:
        parts.append(f"<p><b>Answer key</b> (truth.json of this rehearsal): <code>{html.escape(json.dumps(data.truth))}</code></p>")
    return parts


def _figures(images: Mapping[str, bytes]) -> list[str]:
    parts = []
    for name, png in images.items():
        heading, note = _CAPTIONS.get(name, (name, ""))
        parts.append(f"<h2>{html.escape(heading)}</h2><img alt='{name}' src='{plots.data_uri(png)}'>")
        if note:
            parts.append(f"<p><small>{html.escape(note)}</small></p>")
    return parts


def _rollback(result: Mapping[str, Any]) -> str:
    rb = dict(result.get("rollback") or {})
    loss_only = rb.pop("loss_only", None) or {}
    choices = [{"choice": "Warning Light", **rb, "alarm_step": (result.get("root") or {}).get("alarm_step")},
               {"choice": "loss-only operator", **loss_only}]
    rows = [{header: c.get(key) for key, header in _ROLLBACK_HEADERS.items()} for c in choices]
    return "<h2>Rollback</h2>" + _table(rows, list(_ROLLBACK_HEADERS.values()))


def render_html(data: ReportData, images: Mapping[str, bytes]) -> str:
    """The report as one HTML string with the PNGs inlined."""
    r = data.result
    parts = [*_header(data), *_figures(images), _rollback(r),
             "<h2>Detectors</h2>" + _table(_comparators(data), ["detector", "first alarm step", "names a component"]),
             f"<h2>Alarms ({len(r.get('alarms') or [])})</h2>" + _table(alarm_rows(r), list(ALARM_HEADERS.values())),
             f"<h2>Static-rule firings ({len(data.static)})</h2>"
             + _table([a.to_dict() for a in data.static], ["rule", "component", "step", "value", "steps_fired"]),
             "</body></html>"]
    return "\n".join(parts)


def write_html(trace: Path | str, out: Path | str, analysis: Any = None) -> Path:
    """Write the self-contained HTML report of `trace` to `out`; returns the path."""
    data = gather(trace, analysis)
    images = {name: plots.png_bytes(fig) for name, fig in figures(data).items()}
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(render_html(data, images), encoding="utf-8")
    return out


def write_pngs(trace: Path | str, out_dir: Path | str, analysis: Any = None) -> list[Path]:
    """Write the report's figures alone, one PNG each, into `out_dir`; returns their paths."""
    data = gather(trace, analysis)
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    paths = []
    for name, fig in figures(data).items():
        path = out_dir / f"{name}.png"
        path.write_bytes(plots.png_bytes(fig))
        paths.append(path)
    return paths
