"""Trailing-window order statistics in one compiled pass: the baseline's hot loop.

The baseline needs, for every row, the median and the 25th and 75th percentiles of the finite
values among the `window` rows of its series that end `lag` rows before it. Polars computes each
order statistic in its own rolling pass over a grouped column; here one pass keeps each series'
window sorted (a count of the values below the one entering or leaving, and a shift of the
values on its shorter side) and reads all three statistics from it, with Polars' exact
definitions, bit for bit:

- the median interpolates linearly between the two middle values (`rolling_median`);
- the quartiles take the nearest rank, round((n - 1) q) rounding halves up
  (`rolling_quantile`'s default `nearest`).

A row whose window holds fewer than `min_samples` finite values gets NaN (no baseline yet).
tests/test_quantiles.py holds the kernel to Polars' rolling functions on random and trending series.

`baseline` runs the same pass over one metric's raw values and writes, for the rows asked for,
the median, robust scale and z the baseline reports (`baseline.py` owns their definitions);
`baseline_many` runs metrics on all cores. `fold_baseline` runs it for the heatmap, folding each
row's |z| into the row's cell as it comes: no column is written and read back.
"""

from __future__ import annotations

import collections
import functools
import math
import os
import threading
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor, wait
from dataclasses import dataclass
from typing import TYPE_CHECKING, NamedTuple, TypeVar

import numba
import numpy as np
from warninglight.forensics.judging.kernels import compiled

if TYPE_CHECKING:
    import pyarrow as pa

QUANTILES = (0.25, 0.5, 0.75)  # columns of `trailing`'s result
WORKERS = os.cpu_count() or 1  # columns computed at once by `trailing_many`
T = TypeVar("T")


@numba.njit(nogil=True, inline="always")
def _rank(buf: np.ndarray, x: float) -> int:  # pragma: no cover - compiled
    """How many of the window's values are below `x`: a count over the whole ring (its free
    places hold +inf), which compiles to vector compares with no branch to mispredict, where a
    binary search over a few dozen values mispredicted about every other step."""
    count = 0
    for v in buf:
        count += v < x
    return count


@numba.njit(nogil=True, inline="always")
def _rank2(buf: np.ndarray, a: float, b: float) -> tuple[int, int]:  # pragma: no cover - compiled
    """`_rank` of two values in one pass over the ring."""
    count_a = count_b = 0
    for v in buf:
        count_a += v < a
        count_b += v < b
    return count_a, count_b


@numba.njit(cache=True, nogil=True)
def _trailing(values: np.ndarray, starts: np.ndarray, window: int, lag: int, min_samples: int,
              out: np.ndarray, wanted: np.ndarray, skip: bool, fold: bool,
              heat: tuple) -> None:  # pragma: no cover - compiled
    """`out[:, i]` = (q25, median, q75) of the series window ending `lag` rows before row i; with
    `fold`, nothing is written: each row's |z| (`z_of`) goes into its heatmap cell instead, as
    the statistics come (`heat`: raw, missing, lr, logged, each row's cell (-1: none), the cells,
    then `z_of`'s constants).

    With `skip`, only rows `wanted` (ascending) are sure to be written: where the next wanted
    row of a series is a window or more ahead, the ring is emptied and filled again from the
    `window` rows before it (the rows between are not visited, their values not read). The
    statistics of a wanted row are the same values either way: the window's values are.

    The window's finite values stay sorted in a ring, so a value leaves or enters by moving the
    values on whichever side of it is shorter: a series that trends (every new value the
    largest, the oldest the smallest: norms over training) moves almost nothing, where a flat
    array moved the whole window each row. When a value leaves and another enters, the values
    between the two places move instead if that is fewer. A value that leaves as an equal one
    enters changes nothing: the row takes the statistics of the row before (a series that holds
    still, as counts of non-finite values and many learning rates do, costs a comparison a row).

    Helpers are inlined at compile time: one cached function to load when a command starts."""
    # the heatmap's inputs, taken out of their tuple once (per row, each array taken out of it
    # was counted in and out again)
    h_raw, h_missing, h_lr, h_logged, h_slot, h_cells, h_log, h_scaled, h_floor, h_rel, h_log_floor, h_tiny, \
        h_per_iqr = heat
    m_q50 = m_exp = m_log = np.nan  # the last unscaled log median's exp and log (`z_of`)
    cap = 1
    while cap < window:  # a window holds at most `window` values, and a place opens only after one left
        cap <<= 1
    mask = cap - 1
    buf = np.empty(cap)
    p = 0  # the next of `wanted` to reach
    for g in range(len(starts) - 1):
        first, end = starts[g], starts[g + 1]
        n, head = 0, 0
        buf[:] = np.inf
        signed_zero = False  # has a -0.0 entered (then an equal value may be a zero of the other sign)
        since = first  # the first row whose value may be in the ring: none before it leaves
        q25 = q50 = q75 = np.nan  # the last row's statistics
        i = first
        while i < end:
            if skip:
                while p < len(wanted) and wanted[p] < i:
                    p += 1
                if p == len(wanted) or wanted[p] >= end:
                    break  # nothing more wanted of this series
                fill = wanted[p] - window + 1  # from here the ring holds the wanted row's window
                if fill > i:
                    i, n, head, signed_zero = fill, 0, 0, False
                    buf[:] = np.inf
                    since = max(fill - lag, first)
            x_in = values[i - lag] if i - lag >= since else np.nan
            x_out = values[i - lag - window] if i - lag - window >= since else np.nan
            entering, leaving = not math.isnan(x_in), not math.isnan(x_out)
            if entering and x_in == 0.0 and math.copysign(1.0, x_in) < 0:
                signed_zero = True
            # the same values leaving and entering (and row i - 1 had a whole window: one left):
            # the statistics of row i - 1
            if not (entering and leaving and x_in == x_out and (x_in != 0.0 or not signed_zero)):
                at = lo = 0
                if entering and leaving:
                    at, lo = _rank2(buf, x_in, x_out)  # lo: the leaving value's place (the first holding it)
                elif entering:
                    at = _rank(buf, x_in)
                elif leaving:
                    lo = _rank(buf, x_out)
                if leaving:
                    if entering:
                        if at > lo:
                            at -= 1  # its place once the leaving value is gone
                        between = at - lo if at > lo else lo - at
                        if between <= min(lo, n - 1 - lo) + min(at, n - 1 - at):
                            # fewer moves: shift the values between the two places by one
                            if at > lo:
                                for k in range(lo, at):
                                    buf[(head + k) & mask] = buf[(head + k + 1) & mask]
                            else:
                                for k in range(lo, at, -1):
                                    buf[(head + k) & mask] = buf[(head + k - 1) & mask]
                            buf[(head + at) & mask] = x_in
                            leaving = entering = False  # both done
                    if leaving:  # close the gap from its shorter side
                        if lo < n - 1 - lo:
                            for k in range(lo, 0, -1):
                                buf[(head + k) & mask] = buf[(head + k - 1) & mask]
                            buf[head] = np.inf  # free again
                            head = (head + 1) & mask
                        else:
                            for k in range(lo, n - 1):
                                buf[(head + k) & mask] = buf[(head + k + 1) & mask]
                            buf[(head + n - 1) & mask] = np.inf
                        n -= 1
                if entering:  # open a place at `at` from its shorter side
                    if at < n - at:
                        head = (head - 1) & mask
                        for k in range(at):
                            buf[(head + k) & mask] = buf[(head + k + 1) & mask]
                    else:
                        for k in range(n, at, -1):
                            buf[(head + k) & mask] = buf[(head + k - 1) & mask]
                    buf[(head + at) & mask] = x_in
                    n += 1
                if n >= min_samples and n > 0:
                    r25, lo_i, hi_i, part, r75 = ranks(n)
                    q25 = buf[(head + r25) & mask]
                    m_lo = buf[(head + lo_i) & mask]
                    q50 = m_lo if lo_i == hi_i else m_lo + (buf[(head + hi_i) & mask] - m_lo) * part
                    q75 = buf[(head + r75) & mask]
                else:
                    q25 = q50 = q75 = np.nan
            if not fold:
                out[0, i], out[1, i], out[2, i] = q25, q50, q75
            elif h_slot[i] >= 0 and not math.isnan(q50) and not h_missing[i]:  # a kept row with a baseline, not null
                _, _, z, m_q50, m_exp, m_log = z_of(q25, q50, q75, np.float64(h_raw[i]), h_logged[i], h_lr[i], h_log,
                                                     h_scaled, h_floor, h_rel, h_log_floor, h_tiny, h_per_iqr,
                                                     m_q50, m_exp, m_log)
                h_cells[h_slot[i]] = worse(h_cells[h_slot[i]], z)
            i += 1


@numba.njit(nogil=True, inline="always")
def ranks(n: int) -> tuple[int, int, int, float, int]:  # pragma: no cover - compiled
    """Where the statistics of n sorted values lie, with Polars' definitions: the 25th percentile's
    rank (the nearest, round((n - 1) q) rounding halves up), the two middle ranks and the share of
    the way from the first to the second the median lies (it interpolates linearly), the 75th's."""
    mid_at = (n - 1) * 0.5
    lo_i = int(math.floor(mid_at))
    return (min(int(math.floor((n - 1) * 0.25 + 0.5)), n - 1), lo_i, int(math.ceil(mid_at)), mid_at - lo_i,
            min(int(math.floor((n - 1) * 0.75 + 0.5)), n - 1))


@numba.njit(nogil=True, inline="always")
def log_floored(x: float, tiny: float) -> float:  # pragma: no cover - compiled
    """log(max(x, tiny)) with Polars' `max_horizontal`, which passes over a NaN: log(tiny)."""
    return math.log(x if x > tiny else tiny)


@numba.njit(nogil=True, inline="always")
def _transform(raw: np.ndarray, lr: np.ndarray, i: int, log: bool, scaled: bool, tiny: float,
               values: np.ndarray, logged: np.ndarray) -> None:  # pragma: no cover - compiled
    """Row i's value on the baseline's scale into `values` (NaN where not finite), and for a log
    metric log(max(x, tiny)) into `logged` (z reads it again)."""
    x = np.float64(raw[i])  # float32 columns are read as they are stored: widening is exact
    v = x
    if log:
        v = logged[i] = log_floored(x, tiny)
    if math.isfinite(x):
        if scaled:
            f = lr[i]
            v = v - math.log(f if math.isfinite(f) and f > 0 else 1.0)
        values[i] = v
    else:
        values[i] = np.nan


@numba.njit(nogil=True, inline="always")
def z_of(q25: float, q50: float, q75: float, x: float, logged_x: float, f: float, log: bool, scaled: bool,
          floor: float, rel_floor: float, log_floor: float, tiny: float, per_iqr: float, memo_q50: float,
          memo_exp: float, memo_log: float) -> tuple[float, float, float, float, float, float]:  # pragma: no cover - compiled
    """(median, scale, z, memo) of a row whose window has a median (`q50` not NaN): its value `x`
    (`logged_x`: log(max(x, tiny)) of a log metric) and lr `f`. The memo: the last unscaled log
    median's q50, exp and log, kept while it holds (a still series costs no exp); NaN at first."""
    if log:
        if scaled:
            m = math.exp(q50) * (f if math.isfinite(f) and f > 0 else 1.0)
            log_m = log_floored(m, tiny)
        else:
            if q50 != memo_q50:
                memo_q50, memo_exp = q50, math.exp(q50)
                memo_log = log_floored(memo_exp, tiny)
            m, log_m = memo_exp, memo_log
        s = max((q75 - q25) * per_iqr, log_floor)
        # a NaN is floored like any other value (far below its baseline); a null has no z
        return m, s, (logged_x - log_m) / s, memo_q50, memo_exp, memo_log
    s = max((q75 - q25) * per_iqr, abs(q50) * rel_floor, floor)
    return q50, s, (x - q50) / s, memo_q50, memo_exp, memo_log


@numba.njit(cache=True, nogil=True)
def _baseline(raw: np.ndarray, missing: np.ndarray, lr: np.ndarray, starts: np.ndarray, kept: np.ndarray,
              window: int, lag: int, min_samples: int, log: bool, scaled: bool, floor: float,
              rel_floor: float, log_floor: float, tiny: float, iqr_to_sigma: float,
              med: np.ndarray, scale: np.ndarray, z: np.ndarray, z_valid: np.ndarray,
              scratch: np.ndarray, taken: np.ndarray, wanted: np.ndarray, skip: bool) -> None:  # pragma: no cover - compiled
    """One metric's baseline columns for kept rows `taken` (ascending places in `kept`; output t
    is row kept[taken[t]]), from its raw values (see `baseline`); `scratch` holds at least 5
    floats per row. With `skip`, only the windows of rows `wanted` (ascending; those rows and
    any the ring must visit) are read (`_trailing`)."""
    n = len(raw)
    per_iqr = 1.0 / iqr_to_sigma  # Polars divides by a constant as a product with its inverse
    values = scratch[:n]
    logged = scratch[n:2 * n]
    q = scratch[2 * n:5 * n].reshape((3, n))
    if skip:
        done = 0  # rows below this are transformed
        for w in wanted:  # each wanted row's window and the row itself
            for i in range(max(done, w - lag - window + 1), w + 1):
                _transform(raw, lr, i, log, scaled, tiny, values, logged)
            done = max(done, w + 1)
    else:
        for i in range(n):
            _transform(raw, lr, i, log, scaled, tiny, values, logged)
    _trailing(values, starts, window, lag, min_samples, q, wanted, skip, False, _no_heat())
    m_q50 = m_exp = m_log = np.nan
    for j in range(len(taken)):
        i = kept[taken[j]]
        q25, q50, q75 = q[0, i], q[1, i], q[2, i]
        if math.isnan(q50):  # no baseline yet: the scale is its floor, the rest null
            med[j], scale[j], z[j], z_valid[j] = np.nan, log_floor if log else floor, np.nan, False
        else:
            med[j], scale[j], z[j], m_q50, m_exp, m_log = z_of(q25, q50, q75, np.float64(raw[i]), logged[i], lr[i],
                                                                log, scaled, floor, rel_floor, log_floor, tiny,
                                                                per_iqr, m_q50, m_exp, m_log)
            z_valid[j] = not missing[i]


@numba.njit(cache=True, nogil=True)
def _no_heat() -> tuple:  # pragma: no cover - compiled
    """`_trailing`'s `heat` where it writes the statistics (`fold` False): typed, never read."""
    none = np.empty(0)
    return (none, np.empty(0, dtype=np.bool_), none, none, np.empty(0, dtype=np.int64), none,
            False, False, 0.0, 0.0, 0.0, 0.0, 0.0)


@numba.njit(cache=True, nogil=True)
def _fold_baseline(raw: np.ndarray, missing: np.ndarray, lr: np.ndarray, starts: np.ndarray, slot: np.ndarray,
                   window: int, lag: int, min_samples: int, log: bool, scaled: bool, floor: float,
                   rel_floor: float, log_floor: float, tiny: float, iqr_to_sigma: float, scratch: np.ndarray,
                   cells: np.ndarray) -> None:  # pragma: no cover - compiled
    """`_baseline`'s z of every row, folded into the heatmap's `cells` (row i's is cells[slot[i]];
    -1: none) as the window's statistics come: no column per row is written. `scratch` holds at
    least 2 floats per row."""
    n = len(raw)
    values, logged = scratch[:n], scratch[n:2 * n]
    for i in range(n):
        _transform(raw, lr, i, log, scaled, tiny, values, logged)
    heat = (raw, missing, lr, logged, slot, cells, log, scaled, floor, rel_floor, log_floor, tiny, 1.0 / iqr_to_sigma)
    _trailing(values, starts, window, lag, min_samples, np.empty((3, 0)), np.empty(0, dtype=np.int64), False, True,
              heat)


@numba.njit(nogil=True, inline="always")
def worse(cell: float, z: float) -> float:  # pragma: no cover - compiled
    """A heatmap cell after a z of its row: the larger of the cell and |z| where z is finite (a
    NaN cell, none yet, takes the first)."""
    if math.isfinite(z):
        a = abs(z)
        if not cell >= a:
            return a
    return cell


@numba.njit(cache=True, nogil=True)
def fold_heat(heat: np.ndarray, z: np.ndarray, z_valid: np.ndarray) -> None:  # pragma: no cover - compiled
    """heat = fmax(heat, |z|) where z is valid and finite, in place: the heatmap's cell, the
    worst |z| of a row over its metrics (NaN where none has one yet)."""
    for j in range(len(heat)):
        if z_valid[j]:
            heat[j] = worse(heat[j], z[j])


@numba.njit(nogil=True, inline="always")
def _fmax(a: float, b: float) -> float:  # pragma: no cover - compiled
    """numpy's fmax: the larger, a NaN passed over."""
    if math.isnan(a) or b > a:
        return b if not math.isnan(b) else a
    return a


@numba.njit(cache=True, nogil=True)
def running_peak(values: np.ndarray, starts: np.ndarray, before: np.ndarray, upto: np.ndarray,
                 out: np.ndarray, per_row: bool) -> None:  # pragma: no cover - compiled
    """Per series g (rows `starts[g]`..`starts[g + 1]`): the highest of `before[starts[g]]` and the
    series' values before row `upto[g]`, NaN passed over (numpy's fmax): `out[g]`, or with
    `per_row` `out[i]` for each of those rows i, the highest up to it."""
    for g in range(len(starts) - 1):
        a = starts[g]
        peak = before[a]
        for i in range(a, upto[g]):
            peak = _fmax(peak, values[i])
            if per_row:
                out[i] = peak
        if not per_row:
            out[g] = peak


@numba.njit(cache=True, nogil=True)
def lr_rise(value: np.ndarray, missing: np.ndarray, starts: np.ndarray, before: np.ndarray,
            out: np.ndarray) -> None:  # pragma: no cover - compiled
    """`baseline.lr_surge`'s arithmetic in one pass: per row, value / the row before's value where
    the value is above the highest of `before[series start]` and every earlier value of its
    series (NaN passed over, numpy's fmax; a NaN value counts as above a number) and the row
    before holds an lr that is positive or NaN; else 1. `missing`: null lr."""
    for g in range(len(starts) - 1):
        a = starts[g]
        peak = before[a]
        for i in range(a, starts[g + 1]):
            out[i] = 1.0
            if i == a or missing[i - 1]:
                continue  # nothing before it
            prev = value[i - 1]
            peak = _fmax(peak, prev)
            v = value[i]
            if missing[i]:
                continue
            above = v > peak or (math.isnan(v) and not math.isnan(peak))
            if above and (prev > 0 or math.isnan(prev)):
                out[i] = v / prev


@numba.njit(cache=True, nogil=True)
def counting_order(rank: np.ndarray, step: np.ndarray, place: np.ndarray, low: int, n_names: int, first: int,
                   bits: int, n_series: int, key: np.ndarray, out: np.ndarray) -> bool:  # pragma: no cover - compiled
    """Each row's series, (rank - low) * n_names + place, and key, series << bits + (step -
    first); `out` = the rows ordered by series, the rows of one series in the order they come:
    a counting sort, one pass to count and one to place (a general sort compares keys; here the
    series are known, so two passes place every row). Whether each series' rows came in step
    order (keys not falling), so that `out` orders the keys too."""
    first_row = np.zeros(n_series + 1, dtype=np.int64)
    for i in range(len(step)):
        s = (rank[i] - low) * n_names + place[i]
        key[i] = (s << bits) + (step[i] - first)
        first_row[s + 1] += 1
    for g in range(n_series):
        first_row[g + 1] += first_row[g]
    in_order = True
    last = np.full(n_series, -1, dtype=np.int64)  # each series' last key placed
    for i in range(len(step)):
        s = key[i] >> bits
        in_order &= key[i] >= last[s]
        last[s] = key[i]
        out[first_row[s]] = i
        first_row[s] += 1
    return in_order


@numba.njit(cache=True, nogil=True)
def first_marked(marked: np.ndarray, starts: np.ndarray, out: np.ndarray) -> None:  # pragma: no cover - compiled
    """out[g] = the first marked row of series g (rows `starts[g]`..`starts[g + 1]`), or the
    number of rows where it has none: a walk from each series' start, which stops at its first
    mark (it passes only the rows a window carried from the last, which come first in their
    series), where finding every marked row reads them all."""
    n = starts[len(starts) - 1]
    for g in range(len(starts) - 1):
        out[g] = n
        for i in range(starts[g], starts[g + 1]):
            if marked[i]:
                out[g] = i
                break


@numba.njit(cache=True, nogil=True)
def _gather(data: np.ndarray, validity: np.ndarray, offset: int, nullable: bool, data2: np.ndarray,
            validity2: np.ndarray, offset2: int, nullable2: bool, split: int, order: np.ndarray,
            out: np.ndarray, missing: np.ndarray) -> int:  # pragma: no cover - compiled
    """out[k] = the value of row order[k], NaN where that row is null, and missing[k] = whether
    it is; how many are. Rows below `split` are `data`'s, the rest `data2`'s from 0 (two Arrow
    chunks: validity bitmaps from bit `offset`, read when `nullable`). (Scattering rows in the
    order they are read, to where `order` sends them, writes at random places; a gather reads
    at random and writes in order.)"""
    nulls = 0
    for k in range(len(order)):
        o = order[k]
        if o < split:
            null = nullable and (validity[(offset + o) >> 3] >> ((offset + o) & 7)) & 1 == 0
            v = data[o]
        else:
            o -= split
            null = nullable2 and (validity2[(offset2 + o) >> 3] >> ((offset2 + o) & 7)) & 1 == 0
            v = data2[o]
        missing[k] = null
        out[k] = np.nan if null else v
        nulls += null
    return nulls


def gathered(chunks: list[pa.Array], order: np.ndarray) -> tuple[np.ndarray, np.ndarray | None]:
    """(values at rows `order`, NaN where null; where null, None if nowhere) of a float column
    given as its Arrow chunks (rows numbered across them), in one pass over their buffers
    (`_gather`): what a fill of the nulls, a mask of them and two gathers made in four. A step
    window comes in two chunks (the rows carried, the rows read), gathered from where they
    are; more are joined first."""
    import pyarrow as pa  # loaded already: DuckDB hands its rows to Polars through Arrow

    if len(chunks) > 2 or not chunks:
        chunks = [pa.concat_arrays(chunks)] if chunks else [pa.array([], pa.float64())]
    first, second = chunks[0], chunks[-1]
    dtype = np.float32 if first.type == pa.float32() else np.float64
    out, missing = np.empty(len(order), dtype=dtype), np.empty(len(order), dtype=np.bool_)
    gather = compiled.pick(_gather, len(order))
    nulls = gather(*_buffers(first, dtype), *_buffers(second, dtype), len(first), np.asarray(order, dtype=np.int64),
                   out, missing)
    return out, missing if nulls else None


def _buffers(values: pa.Array, dtype: type) -> tuple[np.ndarray, np.ndarray, int, bool]:
    """A float Arrow array's values, validity bitmap, offset into it and whether it has nulls."""
    validity, data = values.buffers()[:2]
    raw = np.frombuffer(data, dtype=dtype)[values.offset:values.offset + len(values)] if data is not None \
        else read_only(np.empty(0, dtype=dtype))
    # read-only as Arrow's own buffers are: one array type for `_gather` to compile
    bits = np.frombuffer(validity, dtype=np.uint8) if validity is not None else read_only(np.zeros(1, np.uint8))
    return raw, bits, values.offset, validity is not None and values.null_count > 0


def trailing(values: np.ndarray, starts: np.ndarray, window: int, lag: int, min_samples: int) -> np.ndarray:
    """(3, rows) float64: `QUANTILES` of each row's trailing window; NaN where none yet (one
    contiguous row per quantile: a Polars column is made from it without a copy).

    `values`: float64, NaN where a value is missing or non-finite, series after series, each in
    step order; `starts`: the first row of every series, then the number of rows.
    """
    out = np.empty((3, len(values)))
    values = np.ascontiguousarray(values, dtype=np.float64)
    _trailing(values, np.asarray(starts, dtype=np.int64), window, lag, min_samples, out, np.empty(0, dtype=np.int64),
              False, False, _no_heat())
    return out


class Column(NamedTuple):
    """One metric's baseline inputs for `baseline_many`: raw float32 or float64 values (NaN
    where null or NaN), where they are null (None: nowhere), and how the metric is judged."""

    raw: np.ndarray
    missing: np.ndarray | None
    log: bool      # on log(max(value, tiny)) (norms and ratios)
    scaled: bool   # relative to the step's lr
    floor: float   # the scale's absolute floor (metric units; not used on log metrics)

    def arrays(self, lr: np.ndarray | None) -> tuple[np.ndarray, np.ndarray, np.ndarray, bool]:
        """What the kernels take of the column: its values contiguous (float32 as stored, else
        float64), where they are null (nowhere: all False), the lr (none: this thread's ones)
        and whether the metric is judged relative to it. The values and the lr are read-only
        views: a kernel compiles once per array type, and Arrow's buffers come read-only."""
        n = len(self.raw)
        raw = self.raw if self.raw.dtype == np.float32 else self.raw.astype(np.float64, copy=False)
        missing = self.missing if self.missing is not None else np.zeros(n, dtype=np.bool_)
        return (read_only(np.ascontiguousarray(raw)), missing, read_only(lr if lr is not None else ones(n)),
                self.scaled and lr is not None)


@dataclass(frozen=True)
class Scales:
    """The constants of the baseline's scale (`baseline.py` owns them)."""

    rel_floor: float
    log_floor: float
    tiny: float
    iqr_to_sigma: float


def baseline(col: Column, lr: np.ndarray | None, starts: np.ndarray, kept: np.ndarray, window: int,
             lag: int, min_samples: int, scales: Scales) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """(median, scale, z, z valid) of rows `kept` of one metric against its trailing window.

    The median is NaN where the window holds fewer than `min_samples` finite values (no
    baseline: null), the scale then its floor; z is valid where the median is and the value is
    not null. Log metrics are judged on log(max(value, tiny)) (minus log(lr) when `scaled`),
    their median given back in the metric's units (times the lr when `scaled`) and their scale
    in log units: the arithmetic of the Polars expressions this replaced, bit for bit
    (tests/test_quantiles.py)."""
    return _run(col, lr, starts, kept, window, lag, min_samples, scales, np.arange(len(kept)), None)


def baseline_at(col: Column, lr: np.ndarray | None, starts: np.ndarray, kept: np.ndarray, window: int,
                lag: int, min_samples: int, scales: Scales, want: np.ndarray,
                whole: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """(taken, median, scale, z, z valid): `baseline` of the kept rows marked in `want` only, the
    places in `kept` of the rows taken (ascending) and their columns, reading only their
    windows (`bounds` says which rows a rule can need). `whole` (one per series): series taken
    at every row, from their first, whatever `want` says: those holding a -0.0
    (`bounds.median_bounds`' plain), whose median could otherwise be a zero of the other sign."""
    starts, kept = np.asarray(starts, dtype=np.int64), np.asarray(kept, dtype=np.int64)
    wanted = kept[want]
    if whole is not None and whole.any():
        rows = np.concatenate([np.arange(starts[g], starts[g + 1]) for g in np.flatnonzero(whole)])
        want = want | np.isin(kept, rows)
        wanted = np.union1d(kept[want], rows)  # the ring reads these series from their first row
    taken = np.flatnonzero(want)
    return (taken, *_run(col, lr, starts, kept, window, lag, min_samples, scales, taken, wanted))


def fold_baseline(col: Column, lr: np.ndarray | None, starts: np.ndarray, slot: np.ndarray, window: int, lag: int,
                  min_samples: int, scales: Scales, cells: np.ndarray) -> None:
    """`fold_heat(cells, z, z_valid)` of `baseline`'s z of the kept rows, in one pass that keeps no
    column per row (a large window's median, scale, z and order statistics, written for every
    metric and read back, cost more than the pass that made them). `slot`: each row's place
    among the kept rows, -1 where not kept (`slots`)."""
    raw, missing, lr_values, scaled = col.arrays(lr)
    fold = compiled.pick(_fold_baseline, len(raw))
    fold(raw, missing, lr_values, np.asarray(starts, dtype=np.int64), slot, window, lag, min_samples,
         col.log, scaled, col.floor, scales.rel_floor, scales.log_floor, scales.tiny, scales.iqr_to_sigma,
         scratch_array(2 * len(raw)), cells)


def slots(n: int, kept: np.ndarray) -> np.ndarray:
    """Each of `n` rows' place among `kept` (ascending rows), -1 where it is not among them."""
    slot = np.full(n, -1, dtype=np.int64)
    slot[kept] = np.arange(len(kept))
    return slot


def ones(n: int) -> np.ndarray:
    """n ones (float64), read only: this thread's, kept from call to call (an lr of 1 for every
    row of a metric not judged against the lr; a fresh one per metric and window faulted its
    pages in each time)."""
    buf = getattr(_local, "ones", None)
    if buf is None or len(buf) < n:
        buf = _local.ones = np.ones(n)
    return read_only(buf[:n])


def read_only(a: np.ndarray) -> np.ndarray:
    """A read-only view of `a` (no copy)."""
    view = a.view()
    view.flags.writeable = False
    return view


def _run(col: Column, lr: np.ndarray | None, starts: np.ndarray, kept: np.ndarray, window: int, lag: int,
         min_samples: int, scales: Scales, taken: np.ndarray,
         wanted: np.ndarray | None) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """`_baseline` of kept rows `taken`; with `wanted` (the rows the ring must visit), only their windows."""
    k = len(taken)
    med, scale, z = np.empty(k), np.empty(k), np.empty(k)
    z_valid = np.empty(k, dtype=np.bool_)
    raw, missing, lr_values, scaled = col.arrays(lr)
    run = compiled.pick(_baseline, len(raw))
    run(raw, missing, lr_values, np.asarray(starts, dtype=np.int64),
        np.asarray(kept, dtype=np.int64), window, lag, min_samples, col.log, scaled,
        col.floor, scales.rel_floor, scales.log_floor, scales.tiny, scales.iqr_to_sigma, med, scale, z,
        z_valid, scratch_array(5 * len(raw)), np.asarray(taken, dtype=np.int64),
        wanted if wanted is not None else np.empty(0, dtype=np.int64), wanted is not None)
    return med, scale, z, z_valid


_local = threading.local()


def scratch_array(size: int, name: str = "baseline", dtype: type = np.float64) -> np.ndarray:
    """This thread's working array `name`, at least `size` long: kept from call to call, since
    fresh multi-MB arrays for every metric of every window cost page faults when the allocator
    hands their pages back and takes them again."""
    buf = getattr(_local, name, None)
    if buf is None or len(buf) < size:
        buf = np.empty(size, dtype=dtype)
        setattr(_local, name, buf)
    return buf


def baseline_many(columns: Sequence[Column | Callable[[], Column]], lr: np.ndarray | None, starts: np.ndarray,
                  kept: np.ndarray, window: int, lag: int, min_samples: int,
                  scales: Scales) -> Iterator[tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]]:
    """`baseline` of each column, in order, computed on all the machine's cores (no GIL held).
    A column may be given as a function that makes it: it is then made on the worker too (the
    caller does not make every column before the first starts)."""
    def one(col: Column | Callable[[], Column]) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        return baseline(col if isinstance(col, Column) else col(), lr, starts, kept, window, lag,
                        min_samples, scales)
    return in_order([functools.partial(one, c) for c in columns])


def in_order(tasks: Sequence[Callable[[], T]]) -> Iterator[T]:
    """Each task's result, in order, the tasks run on all the machine's cores (compiled loops
    hold no GIL).

    At most two tasks per core are computed ahead of the one the caller takes, so the arrays
    held stay bounded however many tasks there are, and a slow task does not leave the other
    cores idle (as batches of one task per core did)."""
    workers = min(len(tasks), WORKERS)
    if workers <= 1:
        yield from (task() for task in tasks)
        return
    pool = _pool()
    ahead: collections.deque[Future[T]] = collections.deque()
    try:
        for task in tasks:
            ahead.append(pool.submit(task))
            if len(ahead) >= 2 * workers:
                yield ahead.popleft().result()
        while ahead:
            yield ahead.popleft().result()
    finally:  # a caller that stops early (or fails) leaves no task running
        for future in ahead:
            future.cancel()
        wait(ahead)


_pools: dict[int, ThreadPoolExecutor] = {}  # by process id: a forked child has none of the threads
_pool_lock = threading.Lock()


def _pool() -> ThreadPoolExecutor:
    """The process's baseline workers, one per core, made once: their scratch (`scratch_array`) is
    kept from window to window."""
    with _pool_lock:
        pid = os.getpid()
        if pid not in _pools:
            _pools.clear()
            _pools[pid] = ThreadPoolExecutor(WORKERS, thread_name_prefix="warninglight-baseline")
        return _pools[pid]


def warm() -> None:
    """Compile the kernels the classifier runs, for both widths its metric columns come in (or
    load them from numba's cache: compiling happens once a machine, loading at every start). A
    live monitor calls it before the first segment arrives, so that segment is not the one to
    wait."""
    starts, kept, lr = np.array([0, 2]), np.array([0, 1]), np.ones(2)
    with compiled.mode("compiled"):  # two rows would otherwise run as Python, compiling nothing
        for dtype in (np.float32, np.float64):  # the kernels take either read-only (`Column.arrays`)
            col, scales = Column(np.ones(2, dtype=dtype), None, True, True, 0.0), Scales(0.1, 0.1, 1e-12, 1.349)
            baseline(col, lr, starts, kept, 1, 0, 1, scales)  # any values: only the types compile
            fold_baseline(col, lr, starts, slots(2, kept), 1, 0, 1, scales, np.zeros(2))
    fold_heat(np.zeros(2), np.zeros(2), np.ones(2, dtype=np.bool_))


def trailing_many(columns: list[np.ndarray], starts: np.ndarray, window: int, lag: int,
                  min_samples: int) -> list[np.ndarray]:
    """`trailing` of each column, the columns spread over the machine's cores (the loop holds no GIL)."""
    workers = min(len(columns), WORKERS)
    if workers <= 1:
        return [trailing(c, starts, window, lag, min_samples) for c in columns]
    with ThreadPoolExecutor(workers) as pool:
        return list(pool.map(lambda c: trailing(c, starts, window, lag, min_samples), columns))
