"""`analyze --reference GOOD_TRACE`: judge a run against a known-good run of the same model.

A trailing baseline cannot see a fault present from the first step: there is no "before". A
reference run of the same model and schedule supplies one. Every component of the run is then
judged, step by step, against the reference's own trailing baseline at the same step (its median
and robust scale over the same window) instead of its own past: the same rules of the same
registry fire (a layer's mean output excepted: it differs from seed to seed, see `SEED_SPECIFIC`),
so a missing `zero_grad` shows as gradients exploding, a layer frozen by mistake or
left out of the optimizer as stagnant, a wrong initialisation scale as weights far from the
reference's. Update metrics stay relative to each run's own learning rate, and the learning rate's
surge is judged against the run's own history.

The runs need the same components (the same model); their seeds and batches may differ.
"""

from __future__ import annotations

from pathlib import Path

import polars as pl
from warninglight.forensics.judging.baseline import LR_SCALED, REF, metrics_in, with_baseline
from warninglight.forensics.judging.conditions import BaselineConfig
from warninglight.forensics.trace.schedule import with_lr
from warninglight.forensics.trace.store import TraceError, health_frame, open_trace


class ReferenceError(TraceError):
    """A reference trace that cannot serve as one for this run."""


# Metrics that are a property of one run's random draw, not of the model and recipe: a layer's
# mean output is a random projection's mean, different for every seed, so another run says
# nothing about it. They stay judged against the component's own past.
SEED_SPECIFIC = frozenset({"out_mean"})
# an update median at or below this is an update of zero (the baseline keeps a zero at a floor)
FROZEN_UPDATE = 1e-9


def reference_baseline(path: str | Path, cfg: BaselineConfig) -> pl.DataFrame:
    """component, step and, per metric, the reference's median and scale (update medians per unit lr)."""
    trace = open_trace(path)
    try:
        frame = with_lr(health_frame(trace), trace)
        names = frame.collect_schema().names()
        scored = with_baseline(frame.filter(pl.col("rank") == pl.col("rank").min()), cfg).collect()
    finally:
        trace.close()
    metrics = [m for m in metrics_in(scored) if m not in ("lr", "lr_surge") and m not in SEED_SPECIFIC]
    cols = []
    for m in metrics:
        med = pl.col(f"{m}__med")
        if m in LR_SCALED and "lr" in names:  # back to per unit lr: each run applies its own
            lr = pl.col("lr").cast(pl.Float64)
            med = med / pl.when(lr.is_finite() & (lr > 0)).then(lr).otherwise(1.0)
        cols += [med.alias(f"{m}__med{REF}"), pl.col(f"{m}__scale").alias(f"{m}__scale{REF}")]
    return scored.select("component", "step", *cols)


def check_components(run: pl.DataFrame | pl.LazyFrame, reference: pl.DataFrame, path: str | Path) -> None:
    """Raise `ReferenceError` unless every component of the run is in the reference."""
    run_comps = set((run.lazy() if isinstance(run, pl.DataFrame) else run).select("component").unique()
                    .collect()["component"].to_list())
    missing = sorted(run_comps - set(reference["component"].unique().to_list()))
    if missing:
        raise ReferenceError(f"reference trace {path} has no component {missing[0]!r} "
                             f"({len(missing)} of the run's {len(run_comps)} missing) — pass a "
                             "trace of the same model, recorded with the same schedule")


def frozen_in(reference: pl.DataFrame) -> list[str]:
    """Components the reference run keeps frozen: no gradient at any step, and no update (its
    update median never above the floor a zero is kept at)."""
    grad, update = f"grad_norm_l2__med{REF}", f"update_norm_l2__med{REF}"
    if grad not in reference.columns or update not in reference.columns:
        return []
    per = reference.group_by("component").agg(
        pl.col(grad).is_not_null().any().alias("grads"),
        (pl.col(update).fill_null(0.0) > FROZEN_UPDATE).any().alias("updates"),
        pl.col(update).is_not_null().any().alias("weights"))
    return sorted(per.filter(~pl.col("grads") & ~pl.col("updates") & pl.col("weights"))["component"].to_list())
