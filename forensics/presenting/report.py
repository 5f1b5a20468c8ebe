"""The forensic report: its figures drawn from what `contents.gather` collected, and written.

`images` draws and renders the figures (`plots`); `report_html` lays them out; `write_html` /
`write_pngs` write.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from matplotlib.figure import Figure
from warninglight.forensics.explaining.analysis import Analysis, analyze
from warninglight.forensics.presenting import plots
from warninglight.forensics.presenting.contents import (
    ALARM_MARKS,
    ReportData,
    alarmed_order,
    gather,
    marks,
    never_fired,
    per_step,
)
from warninglight.forensics.presenting.report_html import render_html

__all__ = ["ReportData", "gather", "images", "write_html", "write_pngs"]

_SHOWN = ("heatmap", "root_metric", "loss", "ranks", "conditions")  # the order the report shows them in


def _drawers(data: ReportData) -> list[tuple[str, Callable[[], Figure | None]]]:
    """Each figure's stem and what draws it (None: nothing to draw); the root metric's last, so
    the others are drawn while its band is read."""
    m = marks(data)
    near = [x for x in m if x.label in ALARM_MARKS]
    a = data.analysis

    def root_metric() -> Figure | None:
        root, band = a.root, data.root_band
        if root is None or band is None or not len(band):
            return None
        name = root.name if root.observed_on == root.attributed_to else f"{root.name}, seen on {root.observed_on}"
        return plots.baseline_band(band, name, root.metric, [x for x in m if x.label in ("injected", *ALARM_MARKS)])

    def loss() -> Figure:
        steps, ranks = per_step(a.steps)
        return plots.loss_and_grad(steps, m, never_fired(data), ranks=ranks)

    return [
        ("heatmap", lambda: plots.heatmap(data.scores, data.order, near, kinds=data.kinds, step_width=a.heat_width,
                                          episodes=a.alarms)
         if judged(data) else None),
        ("loss", loss),
        ("ranks", lambda: plots.rank_panel(a.ranks_panel, near) if len(a.ranks_panel) else None),
        ("conditions", lambda: plots.condition_map(a.alarms, rows, last_step(a), near, kinds=data.kinds)
         if (rows := alarmed_order(data.order, a.alarms)) else None),  # no alarm on a component: no rows
        ("root_metric", root_metric),
    ]


def judged(data: ReportData) -> bool:
    """Whether the heatmap has a cell to colour: a component (no components table: no rows) and
    a step judged against its baseline (a run shorter than the warm-up has none)."""
    if not data.order or data.scores.is_empty():
        return False
    return bool(data.scores["score"].is_not_null().any())


def last_step(a: Analysis) -> int:
    """The run's last step: the steps table's, else the health rows' (a trace without a steps
    table), else the last alarm's."""
    for last in (a.steps["step"].max() if len(a.steps) else None, a.summary.get("last_step"),
                 a.alarms["last_step"].max() if len(a.alarms) else None):
        if isinstance(last, int):
            return last
    return 1


def images(data: ReportData) -> dict[str, bytes]:
    """The figures as PNG bytes by file stem, each rendered as soon as it is drawn (a figure is
    freed before the next is made), in the order the report shows them."""
    drawn = {name: plots.png_bytes(fig) for name, draw in _drawers(data) if (fig := draw()) is not None}
    return {name: drawn[name] for name in _SHOWN if name in drawn}


def _analysis(trace: Path | str, analysis: Analysis | None) -> Analysis:
    """The analysis given, or one made here with the root's band read beside it, as `report`'s."""
    if analysis is not None:
        return analysis
    return analyze(trace, band=True)


def write_html(trace: Path | str, out: Path | str, analysis: Analysis | None = None) -> Path:
    """Write the self-contained HTML report of `trace` (its `analysis`, if given) to `out`."""
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
