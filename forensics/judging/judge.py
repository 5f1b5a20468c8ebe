"""The one evaluator of the rules: what `analyze`, `replay`, a reference run and live alarms run.

The rules of a metric are judged on the worker that takes its baseline, straight from the
kernel's arrays, with their persistence, and only the rows that fired leave it: no column is
made per metric or rule. A metric's baseline comes from one of two sources:

- the series' own trailing window (`quantiles.baseline_at`), taken only at the rows where one
  of its rules may fire (`screen.wanted`, from bounds of the median);
- a reference run's, joined to the rows by (component, step) (`baseline.given_baseline`), for
  the metrics the reference has.

What a rule means is `kernels.rules` (its exact test, and the loosened one the screen uses), read
from the registry's table; the hits become alarms in `hits`. The one rule input that is not per
component, the peers' median (the median component's value/baseline at a step), is taken only at
the steps where a rule that reads it held otherwise.

The heatmap (`report`) needs every row's |z| of every metric: folded into its cells by a pass of
its own (`quantiles.fold_baseline`) that keeps no column either; at several steps a cell, each bin
is judged against its first row's own baseline (`heatbins`), and a given baseline's rows fold
their own |z| into their cell.
"""

from __future__ import annotations

import functools
import threading
from typing import NamedTuple

import numpy as np
import polars as pl
from warninglight.forensics.judging.baseline import (
    KEYS,
    REF,
    SCALES,
    Given,
    column_of,
    given_baseline,
    metrics_in,
    prepare,
)
from warninglight.forensics.judging.conditions import NONFINITE, Condition, Config, Rule
from warninglight.forensics.judging.hits import finish_hits
from warninglight.forensics.judging.kernels import compiled, heatbins, quantiles, screen
from warninglight.forensics.judging.kernels import rules as rt
from warninglight.tracer.schema import COUNT_METRICS


class _Fired(NamedTuple):
    """Where one rule fired (kept rows, ascending), with the metric's median and z there."""

    rows: np.ndarray
    med: np.ndarray  # NaN: null
    z: np.ndarray
    z_valid: np.ndarray


def _fired(rows: np.ndarray, taken: np.ndarray, med: np.ndarray, z: np.ndarray, z_valid: np.ndarray) -> _Fired:
    """`_Fired` at kept rows `rows`, with the baseline of the rows `taken` (none where a row was
    not taken: a non-finite rule's, which reads none)."""
    pos = np.searchsorted(taken, rows)
    has = np.zeros(len(rows), dtype=np.bool_)
    inside = pos < len(taken)
    has[inside] = taken[pos[inside]] == rows[inside]
    at = pos[has]
    fired = _Fired(rows, np.full(len(rows), np.nan), np.full(len(rows), np.nan), np.zeros(len(rows), dtype=np.bool_))
    fired.med[has], fired.z[has], fired.z_valid[has] = med[at], z[at], z_valid[at]
    return fired


class _Judged(NamedTuple):
    """What one metric's worker hands back (its |z| went into the worker's heat cells, `quantiles.fold_heat`)."""

    fired: list[_Fired]  # per rule of the metric (a peers rule: where the rest of it held)
    value: pl.Series | None  # the metric and its median on every kept row, where a peers rule held
    med: pl.Series | None


class _Metrics:
    """Where a window's metric columns are: in its sorted rows, or in `source`, whose rows in
    `order` are the sorted ones."""

    def __init__(self, rows: pl.DataFrame, source: pl.DataFrame | None, order: np.ndarray | None) -> None:
        self.rows, self.source, self.order = rows, source, order

    def _where(self, metric: str) -> tuple[pl.DataFrame, np.ndarray | None]:
        if metric in self.rows.columns or self.source is None:
            return self.rows, None
        return self.source, self.order

    def names(self) -> list[str]:
        """Every column's name."""
        return [*self.rows.columns, *(c for c in (self.source.columns if self.source is not None else [])
                                      if c not in self.rows.columns)]

    def column(self, metric: str, lr: bool) -> quantiles.Column:
        """`baseline.column_of` of the metric, in the sorted rows' order."""
        frame, order = self._where(metric)
        return column_of(frame, metric, lr, order)

    def values(self, metric: str, at: np.ndarray) -> pl.Series:
        """The metric as float64 at sorted rows `at` (null where null)."""
        frame, order = self._where(metric)
        return frame[metric].cast(pl.Float64).gather(at if order is None else order[at])


def judge(window: pl.DataFrame, config: Config, judged: str, lead: int, heat_width: int | None = None,
          components: pl.DataFrame | None = None, source: pl.DataFrame | None = None,
          order: np.ndarray | None = None, opened: heatbins.Open | None = None) -> tuple[pl.DataFrame, pl.DataFrame | None]:
    """(hits, heat) of the rows of `window` marked by the boolean column `judged`, each reading
    at most `lead` rows before it. A metric with a reference run's baseline columns beside it
    (`baseline.REF`) is judged against those; the others against their own past. A window
    without a `role` column takes each component's from `components` (one join per series).

    `source` and `order`: the window's metrics are `source`'s columns, its rows `source`'s in
    that order (`window`, sorted by series, is `source[order]` less the metrics): each metric is
    read through the order by the worker that judges it, instead of the whole frame sorted.

    A heatmap of `heat_width` > 1 steps a cell is `heatbins`': `opened` holds the statistics
    the last window's open bins were judged against, read and replaced here (a fresh one if
    None: the window's first bin of each series is then judged from its own first row)."""
    rows, starts, keep, lr = prepare(window, judged, lead)
    metric_of = _Metrics(rows, source, order)
    kept = np.arange(rows.height) if keep is None else np.flatnonzero(keep)
    kstarts = np.searchsorted(kept, starts).astype(np.int64)  # each series' first kept row
    marked = rows[judged].to_numpy()[kept]
    metrics = metrics_in(metric_of.names())
    by_metric: dict[str, list[tuple[Condition, Rule]]] = {}
    for c in config.conditions:
        for r in c.rules:
            if r.metric in metrics:
                by_metric.setdefault(r.metric, []).append((c, r))
    role_sets = sorted({r.roles for rules in by_metric.values() for _, r in rules
                        if r.roles and r.direction != NONFINITE})
    roles = np.zeros((max(1, len(role_sets)), len(kept)), dtype=np.bool_)
    if role_sets:
        role, per_series = _roles(rows, starts, kept, components)
        for k, names in enumerate(role_sets):
            held = role.is_in(list(names)).fill_null(False).to_numpy()
            roles[k] = np.repeat(held, np.diff(kstarts)) if per_series else held
    cfg = config.baseline
    lr_values = rows["lr"].cast(pl.Float64).to_numpy() if lr else None

    # a metric gets a baseline only where a rule compares with one (and, for a heatmap, every
    # row's |z| in a pass of its own that keeps no column)
    compared = {r.metric for rules in by_metric.values() for _, r in rules if r.direction != NONFINITE}
    given = {m for m in metrics if f"{m}__med{REF}" in rows.columns}
    if heat_width is None:
        metrics = [m for m in metrics if m in by_metric]
    slot = quantiles.slots(rows.height, kept) if heat_width == 1 else None
    where = None
    if heat_width is not None and heat_width > 1:  # a cell holds several steps: `heatbins`
        where = heatbins.bins(rows["step"].cast(pl.Int64).to_numpy(), rows[judged].to_numpy(), starts, heat_width)
        opened = opened if opened is not None else heatbins.Open()
        names = _series_names(rows, starts[:-1])
        ranks = rows["rank"].gather(starts[:-1]).to_list() if "rank" in rows.columns else [0] * len(names)
        keys = list(zip(ranks, names.to_list(), strict=True))
        places, carry_bin = opened.places(keys)
        open_q: dict[str, np.ndarray] = {}
    n_cells = len(kept) if where is None else int(where.cell_start[-1])

    def one(metric: str) -> _Judged:
        col = metric_of.column(metric, lr)
        ref = given_baseline(rows, metric_of.values(metric, kept), metric, lr, kept) if metric in given else None
        if heat_width is not None:
            cells = heat.get(threading.get_ident())
            if cells is None:
                cells = heat[threading.get_ident()] = np.full(n_cells, np.nan)
            if ref is not None:
                _fold_given(ref, kept, where, rows.height, cells)
            elif where is None:
                quantiles.fold_baseline(col, lr_values, starts, slot, cfg.window, cfg.lag, cfg.min_samples, SCALES,
                                        cells)
            else:
                open_q[metric] = heatbins.fold(col, lr_values, starts, where, carry_bin, opened.stats(places, metric),
                                               cfg.window, cfg.lag, cfg.min_samples, SCALES, cells)
        rules = by_metric.get(metric, [])
        if not rules:
            return _Judged([], None, None)
        table = rt.table(rules, role_sets)
        raw, missing, _, _ = col.arrays(lr_values)

        def rules_on(want: np.ndarray | None) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray, np.ndarray, bool]:
            """(rows taken, their median, z and z valid, `rules.hits`' out, whether a peers rule held)."""
            if metric not in compared:  # non-finite rules read the values alone
                taken, med, z, z_valid = np.empty(0, dtype=np.int64), np.empty(0), np.empty(0), np.empty(0, np.bool_)
            elif ref is not None:
                taken, (med, z, z_valid) = np.arange(len(kept)), ref
            elif want is None:
                taken = np.arange(len(kept))
                med, _, z, z_valid = quantiles.baseline(col, lr_values, starts, kept, cfg.window, cfg.lag,
                                                        cfg.min_samples, SCALES)
            else:
                taken, med, _, z, z_valid = quantiles.baseline_at(col, lr_values, starts, kept, cfg.window, cfg.lag,
                                                                  cfg.min_samples, SCALES, want, whole)
            out = np.zeros((len(rules), len(kept)), dtype=np.uint8)
            compiled.pick(rt.hits, len(raw))(raw, missing, med, z, z_valid, kept, kstarts, marked, table, roles, out, taken)
            return taken, med, z, z_valid, out, bool(out[table[:, rt.PEERS] > 0].any())  # a peers rule held somewhere

        want, whole = None, None
        if metric in compared and ref is None:  # its own baseline only where a rule may fire
            want, whole = screen.wanted(col, lr_values, starts, kept, cfg.window, cfg.lag, cfg.min_samples,
                                        SCALES, table, roles)
        taken, med, z, z_valid, out, peers_held = rules_on(want)
        if want is not None and peers_held:
            # the peers' median reads the median of every component at the steps where the rest
            # of a rule held: taken again for every row (rare: a collapse of the update)
            taken, med, z, z_valid, out, peers_held = rules_on(None)
        fired = [_fired(np.flatnonzero(row), taken, med, z, z_valid) for row in out]
        if not peers_held:
            return _Judged(fired, None, None)
        value = metric_of.values(metric, kept)
        return _Judged(fired, value, pl.Series(med, dtype=pl.Float64, nan_to_null=True))

    heat: dict[int, np.ndarray] = {}  # the heatmap's cells, one array per thread that folds into it
    found: list[tuple[int, pl.DataFrame]] = []
    rule_order = {id(r): k for k, r in enumerate(r for c in config.conditions for r in c.rules)}
    work = quantiles.in_order([functools.partial(one, m) for m in metrics])
    for metric, got in zip(metrics, work, strict=True):
        for (c, r), fired in zip(by_metric.get(metric, []), got.fired, strict=True):
            if r.peers_fold is not None and r.direction != NONFINITE and len(fired.rows):
                fired = _with_peers(rows, kept, kstarts, marked, c, r, fired, got)
            if len(fired.rows):
                found.append((rule_order[id(r)], _hit_rows(rows, kept, c, r, fired, metric_of)))
    parts = [frame for _, frame in sorted(found, key=lambda kv: kv[0])]
    hits = finish_hits(pl.concat(parts) if parts else None)
    if heat_width is None:
        return hits, None
    cells = functools.reduce(np.fmax, heat.values()) if heat else np.full(n_cells, np.nan)
    if where is None:
        return hits, _heat(rows, kept, kstarts, marked, cells, heat_width)
    opened.update(keys, where.last_bin, open_q)
    return hits, heatbins.frame(names, where, cells).group_by("component", "step").agg(pl.col("score").max())


def _fold_given(ref: Given, kept: np.ndarray, where: heatbins.Bins | None, height: int, cells: np.ndarray) -> None:
    """A given baseline's |z| folded into the heatmap's cells: a kept row's cell at one step a
    cell, else the cell of the bin it is in (`heatbins.fold_rows`)."""
    if where is None:
        compiled.pick(quantiles.fold_heat, len(cells))(cells, ref.z, ref.z_valid)
        return
    z = np.full(height, np.nan)
    z[kept[ref.z_valid]] = ref.z[ref.z_valid]
    heatbins.fold_rows(where, z, cells)


def _roles(rows: pl.DataFrame, starts: np.ndarray, kept: np.ndarray,
           components: pl.DataFrame | None) -> tuple[pl.Series, bool]:
    """(roles, whether one per series): the kept rows' own `role` column where the window has
    one (each row's, as the Polars classifier reads it), else each series' role in `components`,
    joined once per series (`stream.Classifier` joins it to every row there)."""
    if "role" in rows.columns or components is None or "role" not in components.columns:
        return rows["role"].gather(kept), False  # no role anywhere: fails here, as `score` fails
    on = [k for k in KEYS if k in components.columns]
    series = rows.select(*KEYS)[starts[:-1]]
    roles = components.select(*on, "role").unique(on, keep="last").with_columns(
        pl.col("component").cast(rows.schema["component"]))
    return series.join(roles, on=on, how="left", maintain_order="left")["role"], True


def _with_peers(rows: pl.DataFrame, kept: np.ndarray, kstarts: np.ndarray, marked: np.ndarray,
                c: Condition, r: Rule, held: _Fired, got: _Judged) -> _Fired:
    """Where a rule that reads the peers' median fired: `held` (where the rest of it held), at
    the steps whose peers' median (a Polars median over the kept rows of those
    steps) reaches the rule's `peers_fold`, held for its persistence."""
    keys = rows.select("rank", "step")[kept]
    wanted = keys[held.rows].unique()
    at = np.flatnonzero(keys.join(wanted.with_columns(pl.lit(True).alias("__w")), on=["rank", "step"],
                                  how="left", maintain_order="left")["__w"].fill_null(False).to_numpy())
    assert got.value is not None and got.med is not None
    peers = keys[at].with_columns(got.value.gather(at).alias("v"), got.med.gather(at).alias("m")).select(
        ((pl.col("v") / pl.col("m")).median().over(["rank", "step"]) >= r.peers_fold).fill_null(False)).to_series()
    ok = np.zeros(len(kept), dtype=np.bool_)
    ok[at] = peers.to_numpy()
    now = np.zeros(len(kept), dtype=np.uint8)
    now[held.rows] = ok[held.rows]
    compiled.pick(rt.persist, len(now))(now, kstarts, marked, c.persistence_of(r))
    fired = np.flatnonzero(now)
    pick = np.searchsorted(held.rows, fired)
    return _Fired(fired, held.med[pick], held.z[pick], held.z_valid[pick])


def _hit_rows(rows: pl.DataFrame, kept: np.ndarray, c: Condition, r: Rule, fired: _Fired,
              metric_of: _Metrics) -> pl.DataFrame:
    """The hits of one rule (`hits.HIT_COLUMNS`): where it fired, with the metric's value, median and z."""
    at = kept[fired.rows]
    where = rows.select(*KEYS, "step")[at].with_columns(metric_of.values(r.metric, at).alias("value"))
    if r.direction == NONFINITE:  # a count has baseline 0 and scale 1: its z is the count
        median = pl.Series("median", [None] * where.height, dtype=pl.Float64)
        magnitude = where["value"] if r.metric in COUNT_METRICS else median
    else:
        median = pl.Series("median", fired.med, dtype=pl.Float64, nan_to_null=True)
        magnitude = pl.Series("magnitude", fired.z, dtype=pl.Float64)
        if not fired.z_valid.all():
            magnitude = magnitude.scatter(np.flatnonzero(~fired.z_valid), None)
    return where.select("rank", pl.col("component").cast(pl.String), "step", pl.lit(c.name).alias("condition"),
                        pl.lit(r.metric).alias("metric"),
                        "value", median.alias("median"), magnitude.alias("magnitude"))


def _heat(rows: pl.DataFrame, kept: np.ndarray, kstarts: np.ndarray, marked: np.ndarray, heat: np.ndarray,
          width: int) -> pl.DataFrame:
    """The heatmap of the judged rows: the worst |z| per (component, bin of `width` steps)."""
    n = len(kept)
    series, start, worst = np.empty(n, dtype=np.int64), np.empty(n, dtype=np.int64), np.empty(n)
    step = rows["step"].cast(pl.Int64).to_numpy()[kept]
    k = compiled.pick(heatbins.worst_per_bin, n)(heat, step, kstarts, marked, width, series, start, worst)
    names = _series_names(rows, kept[np.minimum(kstarts[:-1], n - 1)])
    return (pl.DataFrame({"component": names.gather(series[:k]), "step": start[:k],
                          "score": pl.Series(worst[:k], dtype=pl.Float64, nan_to_null=True)})
            .group_by("component", "step").agg(pl.col("score").max()))


def _series_names(rows: pl.DataFrame, at: np.ndarray) -> pl.Series:
    """The components of rows `at` (one per series), made afresh: a gather of the window's own
    would keep the window's string buffers alive in every heat frame kept."""
    return pl.Series(rows["component"].gather(at).to_list(), dtype=pl.String)
