"""Each component against its own past: a trailing robust baseline, one compiled pass per metric.

For every (rank, component) and metric, the baseline at step t is the median and a robust scale
(interquartile range / 1.349, which equals the standard deviation for Gaussian noise) of the
metric's finite values over the `window` steps ending `lag` steps before t (the order statistics,
and the median, scale and z from them, come from one compiled pass per metric, `quantiles.py`;
sorting, the lr surge and a reference run's baseline are Polars and numpy). It is causal: step
t's baseline uses only steps < t - lag + 1, so an alarm at t is what a live monitor would raise.

Columns added per metric m: `m__med`, `m__scale`, `m__z`. Norms and ratios (`LOG_METRICS`) vary
multiplicatively, so their baseline is taken on log(value): a collapse to 1/10 scores as far
from baseline as a rise to 10×, and `m__scale` is then in log units (`m__med` stays in the
metric's units). The scale has floors, so a metric that never moved (a fraction stuck at 0) does
not turn float noise into huge z-scores.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import numpy as np
import polars as pl
from warninglight.forensics.judging.conditions import BaselineConfig
from warninglight.forensics.judging.kernels import compiled, quantiles
from warninglight.tracer import schema

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
                         "update_norm_l2", "update_ratio", "lr_surge"})
LR_SCALED = frozenset({"update_norm_l2", "update_ratio"})  # proportional to the lr in effect
DERIVED_METRICS = ("lr", "lr_surge")  # from the optimizer's schedule (`schedule.py`)
LOG_TINY = 1e-12  # log(0) stand-in: a norm of exactly 0 is a collapse, not a missing value
LOG_SCALE_FLOOR = 0.02  # log units: ±2%
LR_PEAK = "__lr_peak"  # the highest lr a series had before a window's rows (stream.Classifier)
POS = "__pos"  # a row's place in its (rank, component) series, from 0: what windows over rows need
HEAT = "__heat"  # a row's worst |z| over the metrics that have a baseline there (the heatmap's cell)


def transform(metric: str, x: pl.Expr) -> pl.Expr:
    """The scale the baseline is taken on: log for norms and ratios, identity otherwise."""
    return pl.max_horizontal(x, pl.lit(LOG_TINY)).log() if metric in LOG_METRICS else x


def z_numpy(metric: str, values: np.ndarray, med: float, scale: float) -> np.ndarray:
    """Robust z of raw `values` against a baseline (median in metric units, scale as stored)."""
    if metric in LOG_METRICS:
        return (np.log(np.maximum(values, LOG_TINY)) - np.log(max(med, LOG_TINY))) / scale
    return (values - med) / scale


def metrics_in(frame: pl.LazyFrame | pl.DataFrame | list[str]) -> list[str]:
    """The health metrics present as columns of `frame` (or among these column names)."""
    names = (frame if isinstance(frame, list) else
             frame.collect_schema().names() if isinstance(frame, pl.LazyFrame) else frame.columns)
    return [m for m in (*schema.HEALTH_METRICS, *DERIVED_METRICS) if m in names]


def _lr_factor() -> pl.Expr:
    """The step's lr where the update is judged relative to it, else 1 (no lr, or lr 0)."""
    lr = pl.col("lr").cast(pl.Float64)
    return pl.when(lr.is_finite() & (lr > 0)).then(lr).otherwise(1.0)


def lr_surge(lr: pl.Series, starts: np.ndarray, before: np.ndarray | None = None) -> pl.Series:
    """The lr's one-step rise where it exceeds every earlier lr of its series, else 1 (null where
    the lr is null); `lr` is series after series (`starts`), each in step order. `before`: per
    row, the highest lr its series had before these rows (read at each series' first row; NaN:
    none), so a window of a longer run judges a rise against the whole run.

    Comparisons follow Polars' order, in which NaN (the lr of a component no param group holds)
    is above every number: its rise is NaN, which no rule reads as a surge."""
    value = lr.cast(pl.Float64).fill_null(np.nan).to_numpy()
    missing = lr.is_null()
    rise = np.empty(len(value))
    compiled.pick(quantiles.lr_rise, len(value))(value, missing.to_numpy(), np.asarray(starts, dtype=np.int64),
                                                 before if before is not None else np.full(len(value), np.nan), rise)
    return pl.Series("lr_surge", rise).set(missing, None)


def lr_peaks(frame: pl.DataFrame, starts: np.ndarray, kept_from: np.ndarray) -> pl.DataFrame:
    """(rank, component, `LR_PEAK`): the highest lr of each series of `frame` (sorted by them and
    step) before row `kept_from[g]` of series g, counting the `LR_PEAK` it came with."""
    value = frame["lr"].cast(pl.Float64).fill_null(np.nan).to_numpy()
    before = (frame[LR_PEAK].fill_null(np.nan).to_numpy() if LR_PEAK in frame.columns
              else np.full(frame.height, np.nan))
    first = starts[:-1]
    peaks = np.empty(len(first))
    compiled.pick(quantiles.running_peak, len(value))(value, starts, before, np.asarray(kept_from, dtype=np.int64), peaks, False)
    return frame[first].select(*KEYS).with_columns(pl.Series(LR_PEAK, peaks, dtype=pl.Float64))


_STEP_BITS = 40  # `sort_series`: a step's share of the one integer key
SERIES_KEY = "__key"  # `sort_series`'s key: (series << _STEP_BITS) + step offset


def sort_series(frame: pl.DataFrame, names: pl.Series | None = None) -> pl.DataFrame:
    """`frame` sorted by rank, component and step, in the order `frame.sort([*KEYS, "step"])`
    gives, by one integer key: a sort on names compares strings, one integer key does not (names
    and ranks become their places among the window's own, sorted).
    The key stays as column `SERIES_KEY`, from which `series_starts` and `with_baseline` read
    the order without comparing names again. `names`: every component name the frame may hold,
    sorted (the trace's components, so a window's own need not be found again); a frame with a
    name outside them is sorted by its own."""
    keyed, order = series_order(frame, names)
    return keyed if order is None else keyed[order]


def series_order(frame: pl.DataFrame, names: pl.Series | None = None) -> tuple[pl.DataFrame, np.ndarray | None]:
    """(`frame` with `sort_series`' key, the rows in that order): what `sort_series` sorts by,
    without moving a row. The order is None where the frame came out sorted already (no key:
    too many series or steps for one integer, then sorted by names)."""
    frame = frame.drop(SERIES_KEY, strict=False)
    if frame.is_empty():
        return frame, None
    places = _places(frame["component"], names) if names is not None else None
    if places is None:  # no names given, or a name outside them: the frame's own
        places = _places(frame["component"], frame["component"].cast(pl.String).drop_nulls().unique().sort())
    if places is None or frame["rank"].null_count() or frame["step"].null_count():
        return _sorted_by_names(frame), None
    return _keyed(frame, *places)


def _places(component: pl.Series, names: pl.Series) -> tuple[np.ndarray, int] | None:
    """(each row's component as its place among `names`, sorted; how many names); None if a
    row's is not among them or is null. A Categorical column is read by its codes (no string
    compared), a String one through an Enum of the names."""
    if component.null_count():
        return None
    if component.dtype == pl.Categorical:
        codes = component.to_physical().to_numpy()
        known = names.cast(pl.Categorical).to_physical().to_numpy()
        place = np.full(int(max(codes.max(initial=0), known.max(initial=0))) + 1, -1, dtype=np.int64)
        place[known] = np.arange(len(names))
        places = place[codes]
        return None if (places < 0).any() else (places, len(names))
    try:
        return component.cast(pl.Enum(names)).to_physical().to_numpy().astype(np.int64), len(names)
    except (pl.exceptions.InvalidOperationError, TypeError):
        return None


def _sorted_by_names(frame: pl.DataFrame) -> pl.DataFrame:
    return frame.sort(["rank", pl.col("component").cast(pl.String), "step"])


def _keyed(frame: pl.DataFrame, places: np.ndarray, n_names: int) -> tuple[pl.DataFrame, np.ndarray | None]:
    rank, step = (frame[c].to_numpy().astype(np.int64, copy=False) for c in ("rank", "step"))
    low, first = rank.min(), step.min()
    n_ranks = int(rank.max() - low) + 1
    if n_ranks * n_names >= 1 << (62 - _STEP_BITS):  # ranks far apart: their places among the frame's
        ranks, rank = np.unique(rank, return_inverse=True)
        low, n_ranks = 0, len(ranks)
    if n_ranks * n_names >= 1 << (62 - _STEP_BITS) or step.max() - first >= 1 << _STEP_BITS:
        return _sorted_by_names(frame), None
    key, order = np.empty(len(step), dtype=np.int64), np.empty(len(step), dtype=np.int64)
    counting_order = compiled.pick(quantiles.counting_order, len(step))
    if not counting_order(rank, step, places, int(low), n_names, int(first), _STEP_BITS,
                          n_ranks * n_names, key, order):  # a series' rows out of step order
        order = np.argsort(key, kind="stable")
    spans = np.cumsum([0, *frame["step"].chunk_lengths()])  # the key in the frame's chunks: none copied
    return frame.with_columns(pl.concat([pl.Series(SERIES_KEY, key[a:b]) for a, b in zip(spans[:-1], spans[1:], strict=True)],
                                        rechunk=False)), order


def _sorted_by_key(frame: pl.DataFrame) -> bool:
    """Whether `frame` has rows, carries `sort_series`'s key and is (still) in its order."""
    if SERIES_KEY not in frame.columns or frame.is_empty():
        return False
    return increasing(frame[SERIES_KEY].to_numpy())


def increasing(key: np.ndarray) -> bool:
    """Whether the keys rise strictly (rows in `sort_series`' order, no (series, step) twice)."""
    return bool((key[1:] > key[:-1]).all())


def series_starts(frame: pl.DataFrame) -> np.ndarray:
    """The first row of each (rank, component) series of `frame` (sorted by them), then its height."""
    if _sorted_by_key(frame):
        series = frame[SERIES_KEY].to_numpy() >> _STEP_BITS
        return np.concatenate([[0], np.flatnonzero(series[1:] != series[:-1]) + 1, [frame.height]])
    new = pl.col("rank").ne_missing(pl.col("rank").shift(1)) | pl.col("component").ne_missing(pl.col("component").shift(1))
    return np.append(np.flatnonzero(frame.select(new.fill_null(True)).to_series().to_numpy()), frame.height)


def history_cut(frame: pl.DataFrame, starts: np.ndarray, judged: str, lead: int) -> np.ndarray | None:
    """Which rows of `frame` (sorted by rank, component, step; `starts`: `series_starts`) are
    worth a baseline when only the rows marked by the boolean column `judged` will be judged,
    and each reads the rule verdicts of at most `lead` rows before it (persistence): the rows
    from the earliest step any series needs on, in every series (a step keeps all its rows, so
    the peers' median at it is unchanged). None: all of them."""
    marked = frame[judged].to_numpy()
    first = np.empty(len(starts) - 1, dtype=np.int64)
    compiled.pick(quantiles.first_marked, len(marked))(marked, np.asarray(starts, dtype=np.int64), first)  # each series' first judged row
    has = first < frame.height
    if not has.any():
        return None
    need = np.maximum(starts[:-1][has], first[has] - lead)  # and the rows its persistence reads
    step = frame["step"].to_numpy()
    keep = step >= step[need].min()
    return None if keep.all() else keep


def with_series_values(frame: pl.DataFrame, values: pl.DataFrame) -> pl.DataFrame:
    """`frame` (sorted by rank, component, step) with the columns of `values` (one row per
    rank and component, null for a series it lacks) on every row of each series: a join of
    one row per series, spread over the rows (a join on names of every row hashes every row's
    name)."""
    starts = series_starts(frame)
    firsts = frame[starts[:-1]].select(*KEYS).join(values, on=list(KEYS), how="left", maintain_order="left")
    spread = np.repeat(np.arange(len(starts) - 1), np.diff(starts))
    return frame.with_columns(firsts.drop(*KEYS)[spread])


def column_of(frame: pl.DataFrame, metric: str, lr: bool, order: np.ndarray | None = None) -> quantiles.Column:
    """`quantiles.baseline`'s input for one metric of `frame`, or of `frame[order]` without
    sorting the frame (the metric's Arrow buffers read through the order once:
    `quantiles.gathered`, where filling the nulls, masking them and two gathers made four passes)."""
    values = frame[metric]
    if values.dtype not in (pl.Float32, pl.Float64):  # counts; float32 goes as it is stored
        values = values.cast(pl.Float64)
    if order is not None:
        raw, missing = quantiles.gathered([c.to_arrow() for c in values.get_chunks()], order)
    else:
        missing = None
        if values.null_count():  # NaN where null: filled by Polars, quicker than to_numpy's own fill
            missing = values.is_null().to_numpy()
            values = values.fill_null(np.nan)
        raw = values.to_numpy()
    return quantiles.Column(raw, missing, metric in LOG_METRICS, lr and metric in LR_SCALED,
                            ABS_FLOOR.get(metric, DEFAULT_ABS_FLOOR))


SCALES = quantiles.Scales(REL_FLOOR, LOG_SCALE_FLOOR, LOG_TINY, IQR_TO_SIGMA)


def _own_baseline(frame: pl.DataFrame, starts: np.ndarray, metrics: list[str], cfg: BaselineConfig,
                  lr: bool, keep: np.ndarray | None = None) -> pl.DataFrame:
    """`frame` (sorted by rank, component, step) with each row's place in its series (`POS`) and
    each metric's median, scale and z against its own trailing window, from one compiled pass
    per metric (`quantiles.baseline`: the window's quartiles and median on the baseline's scale,
    then the columns from them); metrics run as many at a time as the machine has cores.

    Median and scale: the scale is the interquartile range / `IQR_TO_SIGMA`, floored (log
    metrics: at `LOG_SCALE_FLOOR` log units; others: at `REL_FLOOR` of |median| and at the
    metric's `ABS_FLOOR`); a log metric's median is exp(the window's median of log values),
    times the step's lr for an `LR_SCALED` one (the update this step's lr intends). z = (value -
    median) / scale, on the log scale for log metrics; null where there is no baseline yet.

    `keep` (`history_cut`): the rows to return; every row still feeds the windows."""
    frame = frame.with_columns(pl.Series(POS, np.arange(frame.height) - np.repeat(starts[:-1], np.diff(starts))))
    kept = frame if keep is None else frame.filter(pl.Series(keep))
    rows = np.arange(frame.height) if keep is None else np.flatnonzero(keep)
    lr_values = frame["lr"].cast(pl.Float64).to_numpy() if lr else None
    meds: list[pl.Series] = []
    zs: list[pl.Series] = []
    heat = np.full(len(rows), np.nan)
    stats = quantiles.baseline_many([functools.partial(column_of, frame, m, lr) for m in metrics], lr_values, starts, rows,
                                    cfg.window, cfg.lag, cfg.min_samples, SCALES)
    for m, (med, scale, z, z_valid) in zip(metrics, stats, strict=True):
        meds += [pl.Series(f"{m}__med", med, dtype=pl.Float64, nan_to_null=True),
                 pl.Series(f"{m}__scale", scale, dtype=pl.Float64)]
        zs.append(_with_nulls(f"{m}__z", z, z_valid))
        compiled.pick(quantiles.fold_heat, len(heat))(heat, z, z_valid)  # the heatmap's cell: a finite z with a baseline
    return kept.with_columns(meds + zs).with_columns(pl.Series(HEAT, heat, dtype=pl.Float64, nan_to_null=True))


def _with_nulls(name: str, values: np.ndarray, valid: np.ndarray) -> pl.Series:
    """A float64 Series of `values`, null where not `valid` (a NaN where valid stays a NaN)."""
    if valid.all():
        return pl.Series(name, values, dtype=pl.Float64)
    import pyarrow as pa  # loaded already: DuckDB hands its rows to Polars through Arrow

    return pl.Series(name, pa.array(values, pa.float64(), mask=~valid))  # the values, not copied


REF = "__ref"  # suffix of a reference run's baseline columns joined beside a run's rows


class Given(NamedTuple):
    """A metric's baseline given row by row (a reference run's), at some rows."""

    med: np.ndarray  # in the metric's units, NaN: none
    z: np.ndarray
    z_valid: np.ndarray


def given_baseline(rows: pl.DataFrame, values: pl.Series, metric: str, lr: bool, at: np.ndarray,
                   suffix: str = REF) -> Given:
    """`metric`'s baseline at rows `at` of `rows`, taken from the reference columns joined to them
    (`{metric}__med{suffix}`, `{metric}__scale{suffix}`), with the metric's `values` at those rows:
    the median (at this run's lr for an `LR_SCALED` metric) and z, null where there is no
    baseline yet or no value."""
    med, scale = reference_exprs(metric, lr, suffix)
    taken = rows.select(f"{metric}__med{suffix}", f"{metric}__scale{suffix}", *(["lr"] if lr else []))[at]
    v = pl.col(metric)
    out = taken.with_columns(values.alias(metric)).select(
        med.alias("med"),
        pl.when(med.is_not_null() & v.is_not_null()).then(
            (transform(metric, v) - transform(metric, med)) / scale).alias("z"))
    z = out["z"]
    return Given(out["med"].fill_null(np.nan).to_numpy(), z.fill_null(np.nan).to_numpy(), z.is_not_null().to_numpy())


def reference_exprs(metric: str, lr: bool, suffix: str) -> list[pl.Expr]:
    """Median and scale of `metric` taken from a reference run's columns joined beside it."""
    med = pl.col(f"{metric}__med{suffix}")
    if lr and metric in LR_SCALED:  # the reference's update per unit lr, at this run's lr
        med = med * _lr_factor()
    return [med.alias(f"{metric}__med"), pl.col(f"{metric}__scale{suffix}").alias(f"{metric}__scale")]


class Prepared(NamedTuple):
    """Health rows made ready for their baseline (`prepare`)."""

    rows: pl.DataFrame  # sorted by rank, component and step, with `lr_surge` where there is an lr
    starts: np.ndarray  # `series_starts` of `rows`
    keep: np.ndarray | None  # `history_cut`: the rows worth a baseline (None: all)
    lr: bool  # whether the rows carry the lr (update metrics are then judged relative to it)


def prepare(rows: pl.DataFrame, judged: str | None = None, lead: int = 0) -> Prepared:
    """`rows` sorted by series (eager: quick when they come sorted), with the lr surge derived
    from the lr (against the `LR_PEAK` a window's series came with), and, given the boolean
    column `judged` (rows each reading at most `lead` rows before it), the rows worth a baseline."""
    if not _sorted_by_key(rows):
        rows = rows.sort([*KEYS, "step"])
    starts = series_starts(rows)
    lr = "lr" in rows.columns
    if lr:
        before = rows[LR_PEAK].fill_null(np.nan).to_numpy() if LR_PEAK in rows.columns else None
        rows = rows.with_columns(lr_surge(rows["lr"], starts, before))
    rows = rows.drop(LR_PEAK, strict=False)
    keep = history_cut(rows, starts, judged, lead) if judged is not None else None
    return Prepared(rows, starts, keep, lr)


def with_baseline(frame: pl.LazyFrame | pl.DataFrame, cfg: BaselineConfig, metrics: list[str] | None = None,
                  reference: pl.DataFrame | None = None, suffix: str = REF,
                  judged: str | None = None, lead: int = 0) -> pl.LazyFrame:
    """`frame` (health rows, sorted here by rank, component, step) with baseline columns added,
    and each row's place in its series (`POS`, which the persistence of rules reads).

    `reference`: a reference run's baseline columns by (component, step) (`reference.py`), used
    instead of each component's own past for every metric it has. `judged`: a boolean column
    marking the rows that will be judged, each reading at most `lead` rows before it; the rows
    before those are history only and are left out once their values fed the windows
    (`history_cut`: a live monitor's and an analysis window's carried rows).
    """
    given: set[str] = set()
    if reference is not None:  # joined first: a join does not keep the row order rolling windows need
        given = {m for m in metrics_in(frame) if f"{m}__med{suffix}" in reference.columns}
        frame = frame.lazy().join(reference.lazy(), on=["component", "step"], how="left")
    rows, starts, keep, lr = prepare(frame.lazy().collect(), judged, lead)
    metrics = metrics if metrics is not None else metrics_in(rows)
    given &= set(metrics)
    own = [m for m in metrics if m not in given]
    rows = _own_baseline(rows, starts, own, cfg, lr, keep)  # z and heatmap cells of its own metrics
    if not given:
        return rows.lazy()
    ref = [m for m in metrics if m in given]
    rows = rows.with_columns([e for m in ref for e in reference_exprs(m, lr, suffix)])
    rows = rows.drop([c for c in reference.columns if c.endswith(suffix)])  # type: ignore[union-attr]
    frame = rows.lazy().with_columns([  # null where there is no baseline yet, or no value
        pl.when(pl.col(f"{m}__med").is_not_null() & pl.col(m).is_not_null()).then(
            (transform(m, pl.col(m).cast(pl.Float64)) - transform(m, pl.col(f"{m}__med")))
            / pl.col(f"{m}__scale")).alias(f"{m}__z")
        for m in ref
    ]).with_columns(pl.max_horizontal(pl.col(HEAT), *(_heat_of_z(m) for m in ref)).alias(HEAT))
    # the columns in the order a run without a reference has: z after every median and scale
    return frame.select(*(c for c in rows.columns if not c.endswith("__z") and c != HEAT),
                        *(f"{m}__z" for m in metrics), HEAT)


def _heat_of_z(metric: str) -> pl.Expr:
    """|z| of `metric` where it is finite and has a baseline: what the heatmap shows of it."""
    z = pl.col(f"{metric}__z")
    return pl.when(z.is_finite() & pl.col(f"{metric}__med").is_not_null()).then(z.abs())


def band(frame: pl.DataFrame, metric: str, width_z: float = 3.0,
         hold: tuple[int, int] | None = None) -> pl.DataFrame:
    """step, value, median, lower, upper, held of one metric (rows of one component), for plotting.

    `hold` = (first, last): from step `first` to `last` (`held`) the median and scale stay as
    they stood at `first` (its row, else the last row before it): a fault's onset to its
    episode's end, against the baseline before it, which a trailing window would soon take in."""
    frame = frame.sort("step")
    med, scale = pl.col(f"{metric}__med"), pl.col(f"{metric}__scale")
    held = pl.lit(False)
    if hold is not None:
        held = pl.col("step").is_between(*hold)
        before = pl.col("step") <= hold[0]
        med, scale = (pl.when(held).then(c.filter(before).last()).otherwise(c) for c in (med, scale))
    if metric in LOG_METRICS:
        lower, upper = med * (-width_z * scale).exp(), med * (width_z * scale).exp()
    else:
        lower, upper = med - width_z * scale, med + width_z * scale
    return frame.select(
        "step", pl.col(metric).cast(pl.Float64).alias("value"), med.alias("median"),
        lower.alias("lower"), upper.alias("upper"), held.alias("held"),
    )
