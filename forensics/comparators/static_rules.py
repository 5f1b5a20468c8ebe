"""Fixed-threshold rules in the style of SageMaker Debugger's built-ins: the comparator we beat.

These rules know nothing of a component's own past; each compares one recorded statistic with
one constant, at every step. They are here so the benchmark can show what fixed rules catch and
what they miss, not to alarm on anyone's run.

How each maps onto our trace (SageMaker's rule reads raw tensors; we read the recorded health):

- ``vanishing_gradient`` — SageMaker: mean |grad| < 1e-7. The trace records no mean |grad|, so we
  use the per-component gradient RMS, ``grad_norm_l2 / sqrt(param_count)``, as its proxy
  (RMS >= mean |g|, so the proxy fires no earlier than the original would).
- ``exploding_tensor`` — SageMaker: any NaN/Inf. Ours: any non-finite value in a component's
  forward output or parameter gradients.
- ``dead_relu`` — SageMaker: more than 50% of a ReLU layer's units active on under 1% of inputs.
  Ours: ``out_dead_frac > 0.5``, where a unit is dead if it was zero on every sampled row (active on
  none of the sample, a slightly stricter test than 1%).
- ``saturated_activation`` — SageMaker: more than 50% of a tanh/sigmoid layer's inputs beyond
  fixed bounds (|x| > 9.5 for tanh). We record outputs, not inputs: ``out_sat_frac > 0.5``, where
  an output is saturated within 1% of the activation's bound (|x| > ~2.6 for tanh), a looser test
  that fires earlier than SageMaker's.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import polars as pl
from warninglight.tracer.schema import HEALTH_METRICS

VANISHING_GRAD_RMS = 1e-7  # SageMaker VanishingGradient default threshold
LAYER_FRACTION = 0.5  # SageMaker threshold_layer default: 50% of the layer's units


@dataclass(frozen=True)
class StaticRule:
    """One fixed rule: which components it reads and the boolean test on their health rows."""

    name: str
    doc: str
    applies: Callable[[pl.DataFrame], pl.Expr]  # components frame -> row filter
    fires: pl.Expr  # on health joined with components
    value: pl.Expr  # the number the rule compared, for the alarm record


def _grad_rms() -> pl.Expr:
    return pl.col("grad_norm_l2") / pl.col("param_count").cast(pl.Float64).sqrt()


RULES: tuple[StaticRule, ...] = (
    StaticRule(
        "vanishing_gradient", "gradient RMS of a parameter-owning component < 1e-7",
        lambda c: pl.col("param_count") > 0,
        _grad_rms() < VANISHING_GRAD_RMS, _grad_rms(),
    ),
    StaticRule(
        "exploding_tensor", "any NaN/Inf in a component's output or gradients",
        lambda c: pl.lit(True),
        (pl.col("out_nonfinite_count").fill_null(0) + pl.col("grad_nonfinite_count").fill_null(0)) > 0,
        (pl.col("out_nonfinite_count").fill_null(0) + pl.col("grad_nonfinite_count").fill_null(0)).cast(pl.Float64),
    ),
    StaticRule(
        "dead_relu", "more than 50% of a ReLU's units dead on the whole sample",
        lambda c: pl.col("bound") == "relu",
        pl.col("out_dead_frac") > LAYER_FRACTION, pl.col("out_dead_frac"),
    ),
    StaticRule(
        "saturated_activation", "more than 50% of a tanh/sigmoid's outputs at their bounds",
        lambda c: pl.col("bound").is_in(["tanh", "sigmoid"]),
        pl.col("out_sat_frac") > LAYER_FRACTION, pl.col("out_sat_frac"),
    ),
)


@dataclass(frozen=True)
class StaticAlarm:
    """The first step at which one rule fired on one component."""

    rule: str
    component: str
    step: int
    value: float
    steps_fired: int  # how many steps the rule held on this component, in all

    def to_dict(self) -> dict[str, object]:
        """Plain JSON-ready dict."""
        d = asdict(self)
        d["value"] = None if not math.isfinite(self.value) else self.value
        return d


class StaticScan:
    """Static firings accumulated over health rows fed in step order (one window at a time)."""

    def __init__(self, components: pl.DataFrame) -> None:
        self.components = components.unique("component", keep="first")
        self._found: dict[tuple[str, str], list[Any]] = {}  # (rule, component) -> [step, value, n]
        # Rows where some rule may fire, judged on the health columns alone (the rules' own tests,
        # the gradient's against the largest component's size, with room to spare): firings are
        # rare, so only these rows are joined with the components and judged exactly.
        counts = self.components["param_count"].cast(pl.Float64) if "param_count" in self.components.columns else None
        largest = counts.filter(counts > 0).max() if counts is not None else None
        small_grad = (pl.col("grad_norm_l2").cast(pl.Float64) < 2 * VANISHING_GRAD_RMS * math.sqrt(largest)
                      if isinstance(largest, float) else pl.lit(False))
        nonfinite = next(r.fires for r in RULES if r.name == "exploding_tensor")
        self._maybe = pl.any_horizontal(small_grad, nonfinite, pl.col("out_dead_frac") > LAYER_FRACTION,
                                        pl.col("out_sat_frac") > LAYER_FRACTION).fill_null(False)

    def feed(self, health: pl.DataFrame, since: int | None = None) -> StaticScan:
        """Add the firings in `health` (rows of steps after any fed before; extra columns
        ignored); with `since`, of its steps from `since` on."""
        # a metric the trace lacks is null here: the rules that read it cannot fire (a warning says so)
        health = health.select("step", "component", *[pl.col(m) if m in health.columns else pl.lit(None, pl.Float32).alias(m)
                                                      for m in HEALTH_METRICS]).filter(
            self._maybe if since is None else self._maybe & (pl.col("step") >= since))
        health = health.with_columns(pl.col("component").cast(pl.String))  # the rows a rule may fire at, named
        health = health.join(self.components.select("component", "param_count", "bound"), on="component", how="inner")
        for rule in RULES:
            names = self.components.filter(rule.applies(self.components))["component"]
            hits = (
                health.filter(pl.col("component").is_in(names.implode()) & rule.fires.fill_null(False))
                .with_columns(rule.value.alias("_value"))
                .sort("step")
                .group_by("component", maintain_order=True)
                .agg(pl.col("step").first(), pl.col("_value").first(), pl.len().alias("n"))
            )
            for row in hits.iter_rows(named=True):  # an earlier window's first firing is kept
                seen = self._found.setdefault((rule.name, row["component"]), [row["step"], row["_value"], 0])
                seen[2] += row["n"]
        return self

    def alarms(self) -> list[StaticAlarm]:
        """Every (rule, component) that fired, with its first step, earliest first."""
        found = [StaticAlarm(rule, component, int(step), float("nan") if value is None else float(value), int(n))
                 for (rule, component), (step, value, n) in self._found.items()]
        return sorted(found, key=lambda a: (a.step, a.rule, a.component))


def static_alarms(trace: Path | str) -> list[StaticAlarm]:
    """Every (rule, component) that fired in the trace, with its first step, earliest first.

    The trace is read one step window at a time, so memory does not grow with its length.
    """
    from warninglight.forensics.trace.store import (
        CHUNK_ROWS,
        health_window,
        open_trace,
        require_health,
    )

    opened = open_trace(trace)  # raises TraceError naming the path if it is not a trace
    try:
        scan = StaticScan(opened.frame("components").collect())
        first, last = require_health(opened)
        width = max(1, CHUNK_ROWS // max(1, len(scan.components)))
        for start in range(first, last + 1, width):
            scan.feed(health_window(opened, start, min(start + width - 1, last)))
    finally:
        opened.close()
    return scan.alarms()


def static_alarms_in(components: pl.DataFrame, health: pl.DataFrame) -> list[StaticAlarm]:
    """`static_alarms` of frames already read: the components table and health rows."""
    return StaticScan(components).feed(health).alarms()


def first_static_alarm(trace: Path | str, after_step: int = 0) -> StaticAlarm | None:
    """The earliest rule firing at or after `after_step` (1 = any), or None if no rule fired."""
    return next((a for a in static_alarms(trace) if a.step >= after_step), None)
