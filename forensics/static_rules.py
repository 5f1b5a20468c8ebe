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


def _tables(trace: Path) -> tuple[pl.DataFrame, pl.DataFrame]:
    """(components, health) of the trace's effective timeline (latest incarnation per step)."""
    from warninglight.forensics.store import open_trace

    opened = open_trace(trace)  # raises TraceError naming the path if it is not a trace
    try:
        components = opened.frame("components").collect().unique("component", keep="first")
        return components, opened.frame("health").collect()
    finally:
        opened.close()


def static_alarms(trace: Path | str) -> list[StaticAlarm]:
    """Every (rule, component) that fired in the trace, with its first step, earliest first."""
    return static_alarms_in(*_tables(Path(trace)))


def static_alarms_in(components: pl.DataFrame, health: pl.DataFrame) -> list[StaticAlarm]:
    """`static_alarms` of frames already read: the components table and health rows (any extra
    columns of an analysis' scored frame are ignored)."""
    components = components.unique("component", keep="first")
    health = health.select("step", "component", *[m for m in HEALTH_METRICS if m in health.columns])
    health = health.join(components.select("component", "param_count", "bound"), on="component", how="inner")
    alarms: list[StaticAlarm] = []
    for rule in RULES:
        names = components.filter(rule.applies(components))["component"]
        hits = (
            health.filter(pl.col("component").is_in(names.implode()) & rule.fires.fill_null(False))
            .with_columns(rule.value.alias("_value"))
            .sort("step")
            .group_by("component", maintain_order=True)
            .agg(pl.col("step").first(), pl.col("_value").first(), pl.len().alias("n"))
        )
        alarms += [
            StaticAlarm(rule.name, row["component"], int(row["step"]),
                        float("nan") if row["_value"] is None else float(row["_value"]), int(row["n"]))
            for row in hits.iter_rows(named=True)
        ]
    return sorted(alarms, key=lambda a: (a.step, a.rule, a.component))


def first_static_alarm(trace: Path | str, after_step: int = 0) -> StaticAlarm | None:
    """The earliest rule firing at or after `after_step` (1 = any), or None if no rule fired."""
    return next((a for a in static_alarms(trace) if a.step >= after_step), None)
