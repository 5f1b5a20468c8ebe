"""Each component against its own past: a trailing robust baseline, vectorised with Polars.

For every (rank, component) and metric, the baseline at step t is the median and a robust scale
(interquartile range / 1.349, which equals the standard deviation for Gaussian noise) of the
metric's finite values over the `window` steps ending `lag` steps before t. It is causal: step
t's baseline uses only steps < t - lag + 1, so an alarm at t is what a live monitor would raise.

Columns added per metric m: `m__med`, `m__scale`, `m__z`. Norms and ratios (`LOG_METRICS`) vary
multiplicatively, so their baseline is taken on log(value): a collapse to 1/10 scores as far
from baseline as a rise to 10×, and `m__scale` is then in log units (`m__med` stays in the
metric's units). The scale has floors, so a metric that never moved (a fraction stuck at 0) does
not turn float noise into huge z-scores.
"""

from __future__ import annotations

import numpy as np
import polars as pl
from warninglight.tracer import schema

from .conditions import BaselineConfig

KEYS = ("rank", "component")
IQR_TO_SIGMA = 1.349  # IQR of a unit Gaussian
REL_FLOOR = 0.02      # scale >= 2% of |median|: weight norms barely move step to step
ABS_FLOOR: dict[str, float] = {  # metric units; below these, changes are noise or rounding
    **{m: 1.0 for m in schema.COUNT_METRICS},  # one value
    "out_zero_frac": 0.01, "out_sat_frac": 0.01, "out_dead_frac": 0.01,
    "update_cos": 0.05, "out_mean": 1e-3, "pred_maxprob": 0.005, "pred_entropy_nats": 0.01,
}
DEFAULT_ABS_FLOOR = 1e-8
LOG_METRICS = frozenset({"out_rms", "out_absmax", "grad_norm_l2", "weight_norm_l2",
                         "update_norm_l2", "update_ratio"})
LOG_TINY = 1e-12  # log(0) stand-in: a norm of exactly 0 is a collapse, not a missing value
LOG_SCALE_FLOOR = 0.02  # log units: ±2%


def transform(metric: str, x: pl.Expr) -> pl.Expr:
    """The scale the baseline is taken on: log for norms and ratios, identity otherwise."""
    return pl.max_horizontal(x, pl.lit(LOG_TINY)).log() if metric in LOG_METRICS else x


def z_numpy(metric: str, values: np.ndarray, med: float, scale: float) -> np.ndarray:
    """Robust z of raw `values` against a baseline (median in metric units, scale as stored)."""
    if metric in LOG_METRICS:
        return (np.log(np.maximum(values, LOG_TINY)) - np.log(max(med, LOG_TINY))) / scale
    return (values - med) / scale


def metrics_in(frame: pl.LazyFrame | pl.DataFrame) -> list[str]:
    """The health metrics present as columns of `frame`."""
    names = frame.collect_schema().names() if isinstance(frame, pl.LazyFrame) else frame.columns
    return [m for m in schema.HEALTH_METRICS if m in names]


def _finite(metric: str) -> pl.Expr:
    x = pl.col(metric).cast(pl.Float64)
    return pl.when(x.is_finite()).then(transform(metric, x))


def baseline_exprs(metric: str, cfg: BaselineConfig) -> list[pl.Expr]:
    """Median, robust scale and z of `metric` against its trailing window, per component."""
    past = _finite(metric).shift(cfg.lag)
    roll = {"window_size": cfg.window, "min_samples": cfg.min_samples}
    med = past.rolling_median(**roll).over(KEYS)
    iqr = (past.rolling_quantile(0.75, **roll) - past.rolling_quantile(0.25, **roll)).over(KEYS)
    if metric in LOG_METRICS:
        scale = pl.max_horizontal(iqr / IQR_TO_SIGMA, pl.lit(LOG_SCALE_FLOOR))
        return [med.exp().alias(f"{metric}__med"), scale.alias(f"{metric}__scale")]
    floor = ABS_FLOOR.get(metric, DEFAULT_ABS_FLOOR)
    scale = pl.max_horizontal(iqr / IQR_TO_SIGMA, med.abs() * REL_FLOOR, pl.lit(floor))
    return [med.alias(f"{metric}__med"), scale.alias(f"{metric}__scale")]


def with_baseline(frame: pl.LazyFrame, cfg: BaselineConfig,
                  metrics: list[str] | None = None) -> pl.LazyFrame:
    """`frame` (health rows, sorted here by rank, component, step) with baseline columns added."""
    metrics = metrics if metrics is not None else metrics_in(frame)
    frame = frame.sort([*KEYS, "step"])
    frame = frame.with_columns([e for m in metrics for e in baseline_exprs(m, cfg)])
    return frame.with_columns([
        ((transform(m, pl.col(m).cast(pl.Float64)) - transform(m, pl.col(f"{m}__med")))
         / pl.col(f"{m}__scale")).alias(f"{m}__z")
        for m in metrics
    ])


def band(frame: pl.DataFrame, metric: str, width_z: float = 3.0) -> pl.DataFrame:
    """step, value, median, lower, upper of one metric (rows of one component), for plotting."""
    med, scale = pl.col(f"{metric}__med"), pl.col(f"{metric}__scale")
    if metric in LOG_METRICS:
        lower, upper = med * (-width_z * scale).exp(), med * (width_z * scale).exp()
    else:
        lower, upper = med - width_z * scale, med + width_z * scale
    return frame.select(
        "step", pl.col(metric).cast(pl.Float64).alias("value"), med.alias("median"),
        lower.alias("lower"), upper.alias("upper"),
    ).sort("step")
