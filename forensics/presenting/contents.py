"""What the report shows, gathered once from one analysis (`gather`).

It reads back only the root component's metric: the components in forward order, the heatmap
scores, the root metric against its baseline, what fixed-threshold rules saw, the dated marks the
step-axis figures draw, and the rehearsal's answer key if the trace has one.
"""

from __future__ import annotations

import json
import math
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import polars as pl
from warninglight.forensics.comparators.static_rules import StaticAlarm
from warninglight.forensics.explaining.analysis import Analysis, band_of, root_episode
from warninglight.forensics.presenting import plots

# marks drawn on the component figures (the step-axis figures draw them all)
ALARM_MARKS = ("onset", "first alarm", "alarm")


@dataclass
class ReportData:
    """Everything the report shows, gathered once from one analysis."""

    analysis: Analysis
    order: list[str]  # components in forward order
    kinds: dict[str, str]  # component -> module class, for axis labels
    scores: pl.DataFrame  # component, step (bin start), score (worst |robust z| over the metrics)
    band: Future[pl.DataFrame | None] = field(repr=False)  # the root metric's band (held through its episode), read beside the drawing
    static: list[StaticAlarm] = field(default_factory=list)
    truth: dict[str, Any] | None = None
    warnings: list[str] = field(default_factory=list)  # the analysis' and the report's own

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


def per_step(steps: pl.DataFrame) -> tuple[pl.DataFrame, int]:
    """(the steps table with one row a step, how many ranks it was over): each rank logs its own
    loss and gradient norm, and their rows one after another drew a saw-tooth; a step's is the
    ranks' mean, as the comparators read it (a NaN on one rank stays a NaN)."""
    ranks = steps["rank"].n_unique() if "rank" in steps.columns and len(steps) else 1
    if ranks <= 1:
        return steps, 1
    cols = [c for c in ("loss", "grad_norm_total_l2") if c in steps.columns]
    return steps.group_by("step").agg(pl.col(c).cast(pl.Float64).mean() for c in cols).sort("step"), ranks


def alarmed_order(order: list[str], alarms: pl.DataFrame) -> list[str]:
    """The components of `order` (in its order) that an alarm was observed on: the condition
    map's rows, which draws nothing on the others."""
    seen = set(alarms["observed_on"].to_list()) if len(alarms) else set()
    return [c for c in order if c in seen]


def read_truth(trace: Path) -> tuple[dict[str, Any] | None, str | None]:
    """(the answer key a rehearsal left in the trace (truth.json), a warning where it cannot be
    read); (None, None) for a real run, which has none."""
    path = trace / "truth.json"
    if not path.exists():
        return None, None
    try:
        truth = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        return None, (f"unreadable answer key: {path} is not JSON ({exc}); the report leaves the injected "
                      "fault out — fix or delete the file")
    if not isinstance(truth, dict):
        return None, (f"unreadable answer key: {path} holds a JSON {type(truth).__name__}, not an object; "
                      "the report leaves the injected fault out — fix or delete the file")
    return truth, None


def gather(analysis: Analysis) -> ReportData:
    """Everything the report needs, from one analysis: only the root component's metric is read
    back from the trace, unless the analysis read it (`analyze(band=True)`), on a thread of its
    own while the other figures are drawn (the read waits on DuckDB, which holds no lock the
    drawing needs; the trace is opened again for it)."""
    components = analysis.components
    which = band_of(analysis.root)
    band: Future[pl.DataFrame | None] = Future()
    if analysis.root_band is not None or which is None:
        band.set_result(analysis.root_band)
    else:
        pool = ThreadPoolExecutor(1, thread_name_prefix="warninglight-band")
        band = pool.submit(analysis.baseline_frame, *which, hold=root_episode(analysis.root, analysis.alarms))
        pool.shutdown(wait=False)  # the thread ends with the read
    truth, problem = read_truth(analysis.trace_dir)
    return ReportData(analysis, component_order(components),
                      dict(zip(components["component"], components["kind"], strict=True)),
                      analysis.heat, band, analysis.static, truth, [*analysis.warnings, *([problem] if problem else [])])


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
    if a.rollback.checkpoint_step is not None and a.rollback.checkpoint_step == a.rollback.loss_only.checkpoint_step:
        candidates[-2:] = [(plots.SAME_ROLLBACK, a.rollback.checkpoint_step)]  # one line drawn over the other hid it
    return [plots.Mark(label, int(step)) for label, step in candidates
            if isinstance(step, int | float) and not isinstance(step, bool) and math.isfinite(step)]


def never_fired(data: ReportData) -> list[str]:
    """The comparators that did not fire at all, named in the loss figure's legend."""
    det = data.analysis.detectors
    out = [label for label, step in (("loss-spike rule", det.loss_spike_step),
                                     ("grad-norm rule", det.grad_norm_spike_step)) if step is None]
    return out + ([] if data.static else ["static rules"])
