"""The heatmap at several steps a cell, computed the slow way from the Polars classifier's own
per-row baselines: the definition `forensics.heatbins` is held to.

Each (rank, component, bin of `width` steps): per metric, the baseline (median, scale) of the
bin's first judged row that has one; every judged row of the bin from that one on, not null,
gives z against it (each row's own lr for an lr-relative metric); the cell is the worst finite
|z| over the metrics, then over ranks. A bin with judged rows and no such z is a null cell.
"""

from __future__ import annotations

import numpy as np
import polars as pl
from warninglight.forensics.judging.baseline import LOG_METRICS, LOG_TINY, LR_SCALED, metrics_in


def bin_heat(scored: pl.DataFrame, width: int, judged: str | None = None) -> pl.DataFrame:
    """component, step (the bin's first), score: the cells of `scored` (rows sorted by rank,
    component and step, with each metric's `__med` and `__scale`; only `judged` rows count)."""
    keys = ["rank", "component", "_bin"]
    frame = scored.with_columns(((pl.col("step") - 1) // width).alias("_bin"),
                                (pl.col(judged) if judged else pl.lit(True)).alias("_judged"))
    lr = (pl.when(pl.col("lr").is_finite() & (pl.col("lr") > 0)).then(pl.col("lr")).otherwise(1.0)
          if "lr" in frame.columns else pl.lit(1.0))
    cells = []
    for m in metrics_in(frame):
        if f"{m}__med" not in frame.columns:
            continue
        base = pl.col("_judged") & pl.col(f"{m}__med").is_not_null()
        at = pl.col("step").filter(base).first().over(keys)
        med = pl.col(f"{m}__med").filter(base).first().over(keys)
        scale = pl.col(f"{m}__scale").filter(base).first().over(keys)
        x = pl.col(m).cast(pl.Float64)
        if m in LOG_METRICS:
            row_med = med / lr.filter(base).first().over(keys) * lr if m in LR_SCALED and "lr" in frame.columns else med
            z = (pl.max_horizontal(x, pl.lit(LOG_TINY)).log() - pl.max_horizontal(row_med, pl.lit(LOG_TINY)).log()) / scale
        else:
            z = (x - med) / scale
        counted = pl.col("_judged") & x.is_not_null() & (pl.col("step") >= at) & z.is_finite()
        cells.append(pl.when(counted).then(z.abs()))
    return (frame.filter(pl.col("_judged"))
            .select(pl.col("component").cast(pl.String), (pl.col("_bin") * width + 1).alias("step"),
                    pl.max_horizontal(cells).alias("score"))
            .group_by("component", "step").agg(pl.col("score").max()).sort("component", "step"))


def assert_same_cells(got: pl.DataFrame, want: pl.DataFrame) -> None:
    """The same cells, their scores equal to rounding (null where null): the kernel sorts an
    lr-relative metric's window by value / lr where the ring sorts log(value) - log(lr)."""
    got, want = got.sort("component", "step"), want.sort("component", "step")
    assert got.select("component", "step").equals(want.select("component", "step"))
    a, b = got["score"], want["score"]
    assert a.is_null().to_list() == b.is_null().to_list()
    a, b = a.drop_nulls().to_numpy(), b.drop_nulls().to_numpy()
    assert np.allclose(a, b, rtol=1e-9, atol=1e-9, equal_nan=True), np.abs(a - b).max()
