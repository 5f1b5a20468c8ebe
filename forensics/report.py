"""The forensic report: what it shows, gathered from one analysis, and its figures.

`gather` takes an `Analysis` (or runs one) and collects what the report shows, reading back only
the root component's metric: the components in forward order, the heatmap scores, the root metric
against its baseline, what fixed-threshold rules saw, and the rehearsal's answer key if the trace
has one. `images` draws and renders them (plots.py); `report_html` lays them out; `write_html` /
`write_pngs` write.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import polars as pl
from matplotlib.figure import Figure

from . import plots
from .analysis import Analysis, band_of
from .static_rules import StaticAlarm

# marks drawn on the component figures (the step-axis figures draw them all)
_ALARM_MARKS = ("onset", "first alarm", "alarm")


@dataclass
class ReportData:
    """Everything the report shows, gathered once from one analysis."""

    analysis: Analysis
    order: list[str]  # components in forward order
    kinds: dict[str, str]  # component -> module class, for axis labels
    scores: pl.DataFrame  # component, step (bin start), score (worst |robust z| over the metrics)
    band: Future[pl.DataFrame | None] = field(repr=False)  # the root metric's band, read beside the drawing
    static: list[StaticAlarm] = field(default_factory=list)
    truth: dict[str, Any] | None = None

    @property
    def root_band(self) -> pl.DataFrame | None:
        """The root metric against its baseline over the run (None: no such root), once read."""
        return self.band.result()

    @property
    def trace(self) -> Path:
        return self.analysis.trace_dir


def component_order(components: pl.DataFrame) -> list[str]:
    """Components sorted by forward order (never-called ones last, by name); the root left out."""
    c = components.unique("component", keep="first").filter(pl.col("component") != "")
    c = c.sort([pl.col("forward_index").is_null(), "forward_index", "component"])
    return c["component"].to_list()


def read_truth(trace: Path) -> dict[str, Any] | None:
    """The answer key a rehearsal left in the trace (truth.json), or None for a real run."""
    path = trace / "truth.json"
    return json.loads(path.read_text()) if path.exists() else None


def gather(analysis: Analysis) -> ReportData:
    """Everything the report needs, from one analysis: only the root component's metric is read
    back from the trace, unless the analysis read it (`analyze(band=True)`), on a thread of its
    own while the other figures are drawn (the read waits on DuckDB, which holds no lock the
    drawing needs: ~1.4 s of a 1e8 component-step trace, the trace opened again)."""
    components = analysis.components
    which = band_of(analysis.root)
    band: Future[pl.DataFrame | None] = Future()
    if analysis.root_band is not None or which is None:
        band.set_result(analysis.root_band)
    else:
        pool = ThreadPoolExecutor(1, thread_name_prefix="warninglight-band")
        band = pool.submit(analysis.baseline_frame, *which)
        pool.shutdown(wait=False)  # the thread ends with the read
    return ReportData(analysis, component_order(components),
                      dict(zip(components["component"], components["kind"], strict=True)),
                      analysis.heat, band, analysis.static, read_truth(analysis.trace_dir))


def marks(data: ReportData) -> list[plots.Mark]:
    """Every dated event the step-axis figures draw: onset, alarm, detectors, rollbacks, truth."""
    a = data.analysis
    root, det = a.root, a.detectors
    first = det.first_alarm_step
    candidates = [
        ("injected", (data.truth or {}).get("step")),
        ("onset", root.onset_step if root else None),
        ("first alarm", first if root is None or first != root.alarm_step else None),
        ("alarm", root.alarm_step if root else None),
        ("loss-spike rule", det.loss_spike_step),
        ("grad-norm rule", det.grad_norm_spike_step),
        ("static rules", data.static[0].step if data.static else None),
        ("rollback (ours)", a.rollback.checkpoint_step),
        ("rollback (loss-only)", a.rollback.loss_only.checkpoint_step),
    ]
    return [plots.Mark(label, int(step)) for label, step in candidates if step is not None]


def never_fired(data: ReportData) -> list[str]:
    """The comparators that did not fire at all, named in the loss figure's legend."""
    det = data.analysis.detectors
    out = [label for label, step in (("loss-spike rule", det.loss_spike_step),
                                     ("grad-norm rule", det.grad_norm_spike_step)) if step is None]
    return out + ([] if data.static else ["static rules"])


_SHOWN = ("heatmap", "root_metric", "loss", "ranks", "conditions")  # the order the report shows them in


def _drawers(data: ReportData) -> list[tuple[str, Callable[[], Figure | None]]]:
    """Each figure's stem and what draws it (None: nothing to draw); the root metric's last, so
    the others are drawn while its band is read."""
    m = marks(data)
    near = [x for x in m if x.label in _ALARM_MARKS]
    a = data.analysis

    def root_metric() -> Figure | None:
        root, band = a.root, data.root_band
        if root is None or band is None or not len(band):
            return None
        name = root.name if root.observed_on == root.attributed_to else f"{root.name}, seen on {root.observed_on}"
        return plots.baseline_band(band, name, root.metric, [x for x in m if x.label in ("injected", *_ALARM_MARKS)])

    return [
        ("heatmap", lambda: plots.heatmap(data.scores, data.order, near, kinds=data.kinds, step_width=a.heat_width)
         if len(data.scores) and data.order else None),  # no components table: no rows to draw
        ("loss", lambda: plots.loss_and_grad(a.steps, m, never_fired(data))),
        ("ranks", lambda: plots.rank_panel(a.ranks_panel, near) if len(a.ranks_panel) else None),
        ("conditions", lambda: plots.condition_map(a.alarms, data.order, int(a.steps["step"].max()), near,
                                                   kinds=data.kinds) if len(a.alarms) and data.order else None),
        ("root_metric", root_metric),
    ]


def images(data: ReportData) -> dict[str, bytes]:
    """The figures as PNG bytes by file stem, each rendered as soon as it is drawn (a figure is
    freed before the next is made), in the order the report shows them."""
    drawn = {name: plots.png_bytes(fig) for name, draw in _drawers(data) if (fig := draw()) is not None}
    return {name: drawn[name] for name in _SHOWN if name in drawn}


def _analysis(trace: Path | str, analysis: Analysis | None) -> Analysis:
    """The analysis given, or one made here with the root's band read beside it, as `report`'s."""
    if analysis is not None:
        return analysis
    from .analysis import analyze

    return analyze(trace, band=True)


def write_html(trace: Path | str, out: Path | str, analysis: Analysis | None = None) -> Path:
    """Write the self-contained HTML report of `trace` (its `analysis`, if given) to `out`."""
    from .report_html import render_html

    data = gather(_analysis(trace, analysis))
    drawn = images(data)
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(render_html(data, drawn), encoding="utf-8")
    return out


def write_pngs(trace: Path | str, out_dir: Path | str, analysis: Analysis | None = None) -> list[Path]:
    """Write the report's figures alone, one PNG each, into `out_dir`; returns their paths."""
    data = gather(_analysis(trace, analysis))
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    paths = []
    for name, png in images(data).items():
        path = out_dir / f"{name}.png"
        path.write_bytes(png)
        paths.append(path)
    return paths
