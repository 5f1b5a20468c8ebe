"""The classifier's rules in one compiled pass per metric: what `analyze` and `replay` run.

`classify.score` writes every metric's median, scale and z as columns of a Polars frame, then a
boolean column per rule, then filters the rows where any fired: on a large run's step window
that is ~55 float columns and ~30 boolean ones made and read again for a handful of hits. Here
the rules of a metric are judged on the worker that computed its baseline, straight from the
kernel's arrays (`quantiles.baseline`), with their persistence, and only the rows that fired
leave it. The heatmap's cells are binned from the same arrays. No column is made.

The two are one classifier: the rules here read `conditions.Rule` exactly as `classify._rule_expr`
does, with Polars' arithmetic (a division by a constant is a product with its inverse) and
comparisons (a NaN is above every number), and null where a Polars column would be null. Tests
hold the hits, alarms and heatmap of both to each other, row for row, on every sample trace and on
frames with NaN, ±inf, nulls, roles and peers. `classify.score` stays the reference, and what a
caller that wants the scored rows (a live monitor localising) or a reference run's baseline uses.

The one rule input that is not per component, the peers' median (the median component's
value/baseline at a step), is taken only at the steps where a rule that reads it held otherwise,
by the Polars expression `classify.score` uses.
"""

from __future__ import annotations

import functools
import math
import threading
from typing import NamedTuple

import numba
import numpy as np
import polars as pl
from warninglight.tracer.schema import COUNT_METRICS

from . import bounds, quantiles
from .baseline import _SCALES, KEYS, _column, gathered_column, metrics_in, prepare
from .classify import finish_hits
from .conditions import DOWN, EITHER, NONFINITE, UP, Condition, Config, Rule

_DIRECTIONS = {UP: 0, DOWN: 1, EITHER: 2, NONFINITE: 3}
# Without a heatmap, a metric's baseline is taken only at the rows where one of its rules may
# fire (`_candidates`), unless more than one row in this many may: each such row reads its
# whole window, and the rows between two close ones are visited anyway.
SPARSE = 16
# `_hits`'s rule table, one row per rule: these columns, NaN where a threshold is unset
_DIR, _Z, _FOLD, _INV_FOLD, _DELTA, _LEVEL, _COUNT, _PERSIST, _ROLE, _PEERS = range(10)


@numba.njit(nogil=True, inline="always")
def _ge(a: float, b: float) -> bool:  # pragma: no cover - compiled
    """a >= b in Polars' order of floats: a NaN is above every number and equal to a NaN."""
    if math.isnan(a):
        return True
    if math.isnan(b):
        return False
    return a >= b


@numba.njit(cache=True, nogil=True)
def _hits(raw: np.ndarray, missing: np.ndarray, med: np.ndarray, z: np.ndarray, z_valid: np.ndarray,
          kept: np.ndarray, starts: np.ndarray, judged: np.ndarray, rules: np.ndarray, roles: np.ndarray,
          out: np.ndarray, visit: np.ndarray) -> None:  # pragma: no cover - compiled
    """`out[r, j]` = 1 where rule r of one metric fired at kept row j: the rule held on this and
    the rows before it its persistence asks (in the row's series: `starts`, over kept rows) and
    the row is judged; for a rule that reads the peers' median, 1 wherever the rest of it held
    (the peers and persistence come after, `_persist`). `raw`, `missing`: the metric's values
    and nulls on every row. `visit`: the kept rows (ascending) where a threshold rule may fire
    (`_candidates`), and `med` (NaN: null), `z`, `z_valid`: the metric's baseline there (one per
    row of `visit`); `out` comes zeroed, and is left so at the other rows."""
    every = np.arange(len(kept))
    for r in range(rules.shape[0]):
        direction = int(rules[r, _DIR])
        rz, fold, inv_fold = rules[r, _Z], rules[r, _FOLD], rules[r, _INV_FOLD]
        delta, level = rules[r, _DELTA], rules[r, _LEVEL]
        has_z, has_fold, has_delta, has_level = (not math.isnan(rz), not math.isnan(fold),
                                                 not math.isnan(delta), not math.isnan(level))
        count, peers, persist, role = rules[r, _COUNT] > 0, rules[r, _PEERS] > 0, rules[r, _PERSIST], int(rules[r, _ROLE])
        can_up, can_down = direction == 0 or direction == 2, direction == 1 or direction == 2
        rows = every if direction == 3 else visit
        g, run, last = 0, 0, -2
        for t in range(len(rows)):
            j = rows[t]
            while starts[g + 1] <= j:
                g += 1
            if j != last + 1 or j == starts[g]:
                run = 0  # a new series, or rows passed over (where it cannot have held)
            last = j
            if has_z and direction != 3:  # most rows: |z| below the threshold, or no z
                zj = z[t]
                if not z_valid[t] or not ((can_up and _ge(zj, rz)) or (can_down and _ge(-rz, zj))):
                    run = 0
                    out[r, j] = 0
                    continue
            i = kept[j]
            v = np.float64(raw[i])
            if direction == 3:  # non-finite: a count above 0, or a value that is NaN or ±inf
                hit = not missing[i] and (_ge(v, 0.0) and v != 0.0 if count else not math.isfinite(v))
            elif missing[i] or not math.isfinite(v) or (has_z and not z_valid[t]) \
                    or ((has_fold or has_delta) and math.isnan(med[t])):
                hit = False  # a null operand: the Polars expression is null, then false
            else:
                m, zj = med[t], z[t]
                up, down = can_up, can_down
                if has_z:
                    up = up and _ge(zj, rz)
                    down = down and _ge(-rz, zj)
                if has_fold:
                    up = up and m > 0 and _ge(v, m * fold)
                    down = down and m > 0 and _ge(m * inv_fold, v)
                if has_delta:
                    up = up and _ge(v - m, delta)
                    down = down and _ge(m - v, delta)
                if has_level:
                    up = up and _ge(v, level)
                    down = down and _ge(level, v)
                hit = (up or down) and (role < 0 or roles[role, j])
            if peers:
                out[r, j] = hit
            else:
                run = run + 1 if hit else 0
                out[r, j] = judged[j] and run >= persist


@numba.njit(nogil=True, inline="always")
def _thresholds(rules: np.ndarray, lower: float, upper: float, up: np.ndarray,
                down: np.ndarray) -> tuple[float, float]:  # pragma: no cover - compiled
    """Per rule: a value below `up[r]` and above `down[r]` cannot fire it, its median known only to
    lie in `lower`..`upper` (NaN: no baseline); and the least `up` and greatest `down`, below and
    above which no rule fires. Each test of `_hits` is loosened to the bound that makes it
    likeliest to hold (a rounding is monotone: m >= lower gives m * fold >= lower * fold); a z,
    which also reads the scale, is not tested."""
    least_up, most_down = np.inf, -np.inf
    for r in range(rules.shape[0]):
        direction = rules[r, _DIR]
        fold, delta, level = rules[r, _FOLD], rules[r, _DELTA], rules[r, _LEVEL]
        u = -np.inf if direction == 0 or direction == 2 else np.inf
        d = np.inf if direction == 1 or direction == 2 else -np.inf
        if direction == 3 or (math.isnan(lower) and not (math.isnan(rules[r, _Z]) and math.isnan(fold)
                                                         and math.isnan(delta))):
            u, d = np.inf, -np.inf  # not a threshold rule; or it reads a baseline the row has not
        if not math.isnan(fold):
            if upper > 0:
                u, d = max(u, lower * fold), min(d, upper * rules[r, _INV_FOLD])
            else:
                u, d = np.inf, -np.inf
        if not math.isnan(delta):  # v - m >= delta: room for the rounding of the subtraction
            room = (abs(lower) + abs(upper) + delta) * 1e-12
            u, d = max(u, lower + delta - room), min(d, upper - delta + room)
        if not math.isnan(level):
            u, d = max(u, level), min(d, level)
        up[r], down[r] = u, d
        least_up, most_down = min(least_up, u), max(most_down, d)
    return least_up, most_down


@numba.njit(nogil=True, inline="always")
def _quiet_rows(raw: np.ndarray, lr: np.ndarray, starts: np.ndarray, window: int, lag: int, log: bool,
                scaled: bool, tiny: float, rules: np.ndarray, blocks: np.ndarray, count: np.ndarray,
                finite: np.ndarray, base: np.ndarray, up: np.ndarray, down: np.ndarray,
                quiet: np.ndarray) -> None:  # pragma: no cover - compiled
    """`quiet[i]`: row i fires no rule of the metric, found a block of rows at a time
    (`bounds.sort_blocks` done). The rows whose windows end in the same block have the same
    whole blocks (`bounds.window_of`); where those windows are full and hold only finite values,
    their median's bounds are the least r-th smallest and greatest r-th largest of those blocks
    (r the same for all: `bounds.block_range`), and where every value of the rows lies strictly
    between every rule's thresholds (`_thresholds`), none can fire. The other rows are left to
    the test of each row (`quiet` comes all False).

    A metric judged relative to the lr is bounded on value / lr (its blocks' scale): a rule's
    fold reads the same there (v >= m * fold is v / lr >= m / lr * fold, within the bounds'
    room for rounding), its delta and level do not; a metric with one of those is left to each
    row."""
    q = bounds.spanned(window) >> bounds._SHIFT  # whole blocks of a full window, wherever it ends
    rank = bounds.block_rank(window, q, window - (q << bounds._SHIFT))  # the same for every full, finite window
    if rank < 0:
        return
    held_low = held_high = np.nan  # the bounds the thresholds below were taken for
    all_up, all_down = np.inf, -np.inf
    if scaled:
        for r in range(rules.shape[0]):
            if rules[r, _DIR] != 3 and not (math.isnan(rules[r, _DELTA]) and math.isnan(rules[r, _LEVEL])):
                return
    for g in range(len(starts) - 1):
        first, end, bs = starts[g], starts[g + 1], base[g]
        # group m: rows i0..i1 whose window's last whole block is the series' block m - 1
        for m in range(q, ((end - first) >> bounds._SHIFT) + 1):
            i0 = max(first + lag - 1 + (m << bounds._SHIFT), first + lag + window - 1)  # full windows only
            i1 = min(first + lag + 6 + (m << bounds._SHIFT), end - 1)
            if i0 > i1:
                continue
            a0, e1 = i0 - lag - window + 1, i1 - lag  # every window of the group lies in a0..e1
            if finite[e1 + 1] - finite[a0] != e1 + 1 - a0:
                continue  # a value that is not finite in some window: each row's own count
            low, high = bounds.block_bounds(bs + m - q, bs + m, rank, blocks, count)
            if low != held_low or high != held_high:  # a series' bounds often hold from block to block
                held_low, held_high = low, high
                lower, upper = bounds.widened(low, high)
                all_up, all_down = _thresholds(rules, lower, upper, up, down)
            least, greatest = np.inf, -np.inf  # the group's own finite values
            if scaled:  # each value / its own lr (the blocks hold max(value, tiny) / lr)
                for i in range(i0, i1 + 1):
                    v = np.float64(raw[i])
                    if math.isfinite(v):
                        y = v / bounds.lr_factor(lr, i)
                        least, greatest = min(least, y), max(greatest, y)
            else:
                for blk in range(bs + ((i0 - first) >> bounds._SHIFT), bs + ((i1 - first) >> bounds._SHIFT) + 1):
                    c = count[blk]
                    if c > 0:
                        least = min(least, blocks[blk * bounds.BLOCK])
                        greatest = max(greatest, blocks[blk * bounds.BLOCK + c - 1])
                if log and least <= tiny:
                    least = -np.inf  # a log metric's blocks hold max(value, tiny): a value below is not bounded
            if all_down < least and greatest < all_up:
                quiet[i0:i1 + 1] = True


@numba.njit(cache=True, nogil=True)
def _candidates(raw: np.ndarray, missing: np.ndarray, lr: np.ndarray, starts: np.ndarray, kept: np.ndarray,
                window: int, lag: int, min_samples: int, log: bool, scaled: bool, tiny: float,
                rules: np.ndarray, roles: np.ndarray, want: np.ndarray, blocks: np.ndarray, count: np.ndarray,
                finite: np.ndarray, base: np.ndarray, plain: np.ndarray, quiet: np.ndarray) -> int:  # pragma: no cover - compiled
    """`want[j]` = whether a threshold rule of one metric may fire at kept row j, knowing only
    bounds of its median (`bounds.block_range`, `_thresholds`; a block of rows at a time where
    it can, `_quiet_rows`); how many may. `plain[g]`: series g holds no -0.0 (`quantiles.baseline`'s
    `whole`). `quiet`: a bool per row, working space."""
    bounds.sort_blocks(raw, lr, starts, log, scaled, tiny, blocks, count, finite, base, plain)
    k = rules.shape[0]
    up, down = np.empty(k), np.empty(k)
    role = np.empty(k, dtype=np.int64)
    for r in range(k):
        role[r] = int(rules[r, _ROLE])
    some_roles = (role >= 0).any()
    last_n = last_k0 = last_k1 = -2  # the last row's window (`bounds.window_of`; n -1: none)
    low = high = np.nan  # its bounds, on the blocks' scale
    held_low = held_high = np.inf  # the bounds the thresholds hold for
    any_up, any_down = np.inf, -np.inf  # the rules of every role, together
    quiet[:] = False
    _quiet_rows(raw, lr, starts, window, lag, log, scaled, tiny, rules, blocks, count, finite, base, up, down, quiet)
    found = 0
    g = 0
    for j in range(len(kept)):
        i = kept[j]
        want[j] = False
        v = np.float64(raw[i])
        if quiet[i] or missing[i] or not math.isfinite(v):
            continue  # no threshold rule fires on a null or non-finite value
        while starts[g + 1] <= i:
            g += 1
        n, k0, k1 = bounds.window_of(i, starts[g], base[g], window, lag, finite)
        if n < min_samples or n == 0:
            n, k0, k1 = -1, -1, -1  # no baseline
        fresh = n != last_n or k0 != last_k0 or k1 != last_k1
        if fresh:
            last_n, last_k0, last_k1 = n, k0, k1
            low, high = (np.nan, np.nan) if n < 0 else bounds.block_range(
                n, k0, k1, starts[g], base[g], blocks, count, finite)
        if fresh or scaled:
            lower, upper = bounds.widened(low * bounds.lr_factor(lr, i), high * bounds.lr_factor(lr, i)) \
                if scaled else bounds.widened(low, high)
            if not (lower == held_low and upper == held_high):  # (a NaN never equals: taken again)
                held_low, held_high = lower, upper
                _thresholds(rules, lower, upper, up, down)
                any_up, any_down = np.inf, -np.inf
                for r in range(k):
                    if role[r] < 0:
                        any_up, any_down = min(any_up, up[r]), max(any_down, down[r])
        hit = v >= any_up or v <= any_down
        if some_roles and not hit:
            for r in range(k):  # rules of some roles only
                if not hit and role[r] >= 0 and roles[role[r], j]:
                    hit = v >= up[r] or v <= down[r]
        want[j] = hit
        found += hit
    return found


@numba.njit(cache=True, nogil=True)
def _persist(held: np.ndarray, starts: np.ndarray, judged: np.ndarray, steps: int) -> None:  # pragma: no cover - compiled
    """In place: `held[j]` = 1 where it held on this and the `steps - 1` rows before it in its
    series and row j is judged."""
    for g in range(len(starts) - 1):
        run = 0
        for j in range(starts[g], starts[g + 1]):
            run = run + 1 if held[j] else 0
            held[j] = judged[j] and run >= steps


@numba.njit(cache=True, nogil=True)
def _bins(heat: np.ndarray, step: np.ndarray, starts: np.ndarray, judged: np.ndarray, width: int,
          series: np.ndarray, start: np.ndarray, worst: np.ndarray) -> int:  # pragma: no cover - compiled
    """The worst `heat` (NaN: none) of each run of judged rows of one series in one bin of
    `width` steps: its series, the bin's first step and the worst, written from 0; how many."""
    k = 0
    for g in range(len(starts) - 1):
        open_ = False
        for j in range(starts[g], starts[g + 1]):
            if not judged[j]:
                continue
            b = step[j] if width == 1 else (step[j] - 1) // width * width + 1
            if not open_ or b != start[k - 1]:
                series[k], start[k], worst[k] = g, b, np.nan
                k += 1
                open_ = True
            h = heat[j]
            if not math.isnan(h) and not worst[k - 1] >= h:
                worst[k - 1] = h
    return k


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
        """`baseline._column` of the metric, in the sorted rows' order."""
        frame, order = self._where(metric)
        return _column(frame, metric, lr) if order is None else gathered_column(frame, metric, lr, order)

    def values(self, metric: str, at: np.ndarray) -> pl.Series:
        """The metric as float64 at sorted rows `at` (null where null)."""
        frame, order = self._where(metric)
        return frame[metric].cast(pl.Float64).gather(at if order is None else order[at])


def _table(rules: list[tuple[Condition, Rule]], role_sets: list[tuple[str, ...]]) -> np.ndarray:
    """`_hits`' rule table."""
    nan = math.nan
    table = np.full((len(rules), 10), nan)
    for k, (c, rule) in enumerate(rules):
        threshold = rule.direction != NONFINITE  # `classify._rule_expr` returns before roles and peers
        table[k, _DIR] = _DIRECTIONS[rule.direction]
        table[k, _Z] = nan if rule.z is None else rule.z
        table[k, _FOLD] = nan if rule.fold is None else rule.fold
        table[k, _INV_FOLD] = nan if rule.fold is None else 1.0 / rule.fold  # Polars' x / c is x * (1 / c)
        table[k, _DELTA] = nan if rule.delta is None else rule.delta
        table[k, _LEVEL] = nan if rule.level is None else rule.level
        table[k, _COUNT] = rule.metric in COUNT_METRICS
        table[k, _PERSIST] = c.persistence_of(rule)
        table[k, _ROLE] = role_sets.index(rule.roles) if rule.roles and threshold else -1
        table[k, _PEERS] = rule.peers_fold is not None and threshold
    return table


def judge(window: pl.DataFrame, config: Config, judged: str, lead: int, heat_width: int | None = None,
          components: pl.DataFrame | None = None, source: pl.DataFrame | None = None,
          order: np.ndarray | None = None) -> tuple[pl.DataFrame, pl.DataFrame | None]:
    """(hits, heat) of the rows of `window` marked by the boolean column `judged`, each reading
    at most `lead` rows before it: what `classify.hits(classify.score(window, config, judged=
    judged))` and `stream.heat_of` of its judged rows give, without the scored frame. A window
    without a `role` column takes each component's from `components` (one join per series).

    `source` and `order`: the window's metrics are `source`'s columns, its rows `source`'s in
    that order (`window`, sorted by series, is `source[order]` less the metrics): each metric is
    read through the order by the worker that judges it, instead of the whole frame sorted."""
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

    # without a heatmap, a metric gets a baseline only where a rule compares with one
    compared = {r.metric for rules in by_metric.values() for _, r in rules if r.direction != NONFINITE}
    if heat_width is None:
        metrics = [m for m in metrics if m in by_metric]

    def one(metric: str) -> _Judged:
        col = metric_of.column(metric, lr)
        rules = by_metric.get(metric, [])
        table = _table(rules, role_sets)
        raw = np.ascontiguousarray(col.raw)
        missing = col.missing if col.missing is not None else np.zeros(len(col.raw), dtype=np.bool_)

        def rules_on(want: np.ndarray | None) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray, np.ndarray, bool]:
            """(rows taken, their median, z and z valid, `_hits`' out, whether a peers rule held)."""
            if heat_width is None and metric not in compared:  # non-finite rules read the values alone
                taken, med, z, z_valid = np.empty(0, dtype=np.int64), np.empty(0), np.empty(0), np.empty(0, np.bool_)
            elif want is None:
                taken = np.arange(len(kept))
                med, _, z, z_valid = quantiles.baseline(col, lr_values, starts, kept, cfg.window, cfg.lag,
                                                        cfg.min_samples, _SCALES)
            else:
                taken, med, _, z, z_valid = quantiles.baseline_at(col, lr_values, starts, kept, cfg.window, cfg.lag,
                                                                  cfg.min_samples, _SCALES, want, whole)
            out = np.zeros((len(rules), len(kept)), dtype=np.uint8)
            _hits(raw, missing, med, z, z_valid, kept, kstarts, marked, table, roles, out, taken)
            return taken, med, z, z_valid, out, bool(out[table[:, _PEERS] > 0].any())  # a peers rule held somewhere

        want, whole = None, None
        if heat_width is None and metric in compared:  # a baseline only where a rule may fire
            work = bounds.Workspace(len(raw), len(starts) - 1)
            want = np.empty(len(kept), dtype=np.bool_)
            may = _candidates(raw, missing, lr_values if lr_values is not None else np.ones(len(raw)), starts,
                              kept, cfg.window, cfg.lag, cfg.min_samples, col.log, col.scaled and lr_values is not None,
                              _SCALES.tiny, table, roles, want, work.blocks, work.count, work.finite, work.base,
                              work.plain, work.quiet)
            if may * SPARSE > len(kept):
                want = None  # too many: every row's window is read anyway
            whole = None if work.plain.all() else ~work.plain
        taken, med, z, z_valid, out, peers_held = rules_on(want)
        if want is not None and peers_held:
            # the peers' median reads the median of every component at the steps where the rest
            # of a rule held: taken again for every row (rare: a collapse of the update)
            taken, med, z, z_valid, out, peers_held = rules_on(None)
        if heat_width is not None:
            cells = heat.get(threading.get_ident())
            if cells is None:
                cells = heat[threading.get_ident()] = np.full(len(kept), np.nan)
            quantiles.fold_heat(cells, z, z_valid)  # every row taken (a heatmap is drawn only without `want`)
        if not rules:
            return _Judged([], None, None)
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
    cells = functools.reduce(np.fmax, heat.values()) if heat else np.full(len(kept), np.nan)
    return hits, _heat(rows, kept, kstarts, marked, cells, heat_width)


def _roles(rows: pl.DataFrame, starts: np.ndarray, kept: np.ndarray,
           components: pl.DataFrame | None) -> tuple[pl.Series, bool]:
    """(roles, whether one per series): the kept rows' own `role` column where the window has
    one (each row's, as the Polars classifier reads it), else each series' role in `components`,
    joined once per series (`stream.Classifier` joins it to every row there)."""
    if "role" in rows.columns or components is None or "role" not in components.columns:
        return rows["role"].gather(kept), False  # no role anywhere: fails here, as `score` fails
    on = [k for k in KEYS if k in components.columns]
    series = rows.select(*KEYS)[starts[:-1]]
    return series.join(components.select(*on, "role").unique(on, keep="last"), on=on, how="left",
                       maintain_order="left")["role"], True


def _with_peers(rows: pl.DataFrame, kept: np.ndarray, kstarts: np.ndarray, marked: np.ndarray,
                c: Condition, r: Rule, held: _Fired, got: _Judged) -> _Fired:
    """Where a rule that reads the peers' median fired: `held` (where the rest of it held), at
    the steps whose peers' median (`classify.score`'s expression, over the kept rows of those
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
    _persist(now, kstarts, marked, c.persistence_of(r))
    fired = np.flatnonzero(now)
    pick = np.searchsorted(held.rows, fired)
    return _Fired(fired, held.med[pick], held.z[pick], held.z_valid[pick])


def _hit_rows(rows: pl.DataFrame, kept: np.ndarray, c: Condition, r: Rule, fired: _Fired,
              metric_of: _Metrics) -> pl.DataFrame:
    """`classify.hits`' rows of one rule: where it fired, with the metric's value, median and z."""
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
    return where.select(*KEYS, "step", pl.lit(c.name).alias("condition"), pl.lit(r.metric).alias("metric"),
                        "value", median.alias("median"), magnitude.alias("magnitude"))


def _heat(rows: pl.DataFrame, kept: np.ndarray, kstarts: np.ndarray, marked: np.ndarray, heat: np.ndarray,
          width: int) -> pl.DataFrame:
    """`stream.heat_of` of the judged rows: the worst |z| per (component, bin of `width` steps)."""
    n = len(kept)
    series, start, worst = np.empty(n, dtype=np.int64), np.empty(n, dtype=np.int64), np.empty(n)
    step = rows["step"].cast(pl.Int64).to_numpy()[kept]
    k = _bins(heat, step, kstarts, marked, width, series, start, worst)
    # the names made afresh, one per series: a gather of the window's own would keep the
    # window's string buffers alive in every heat frame kept (~30 MB a window on a large run)
    names = pl.Series(rows["component"].gather(kept[np.minimum(kstarts[:-1], n - 1)]).to_list(), dtype=pl.String)
    return (pl.DataFrame({"component": names.gather(series[:k]), "step": start[:k],
                          "score": pl.Series(worst[:k], dtype=pl.Float64, nan_to_null=True)})
            .group_by("component", "step").agg(pl.col("score").max()))
