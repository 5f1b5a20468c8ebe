"""The report's heatmap where one cell holds several steps: each bin against its first row's baseline.

A run longer than the heatmap has columns (`analysis.HEAT_BINS`) gets bins of `width` steps.
A cell is then, for each metric, the worst |z| of the bin's judged rows against the baseline
the classifier gives the bin's first judged row (its first with a baseline, in warm-up): the
window's median and quartiles, on the metric's scale (log, lr-relative), each row's z taken
with its own lr. The cell is the worst over the metrics and ranks. At one step per bin that is
each row's own z, the definition `quantiles.fold_baseline` computes; over a bin it asks how far
the component went within the bin from where it stood when the bin opened.

It costs a fraction of every row's z: one window's order statistics per bin (`_stats_at`: a
window sorted by a network and gathered; one that holds still or trends is read as it is) and a
pass that keeps each bin's largest and smallest value, since against one baseline the worst |z|
is at one of them, where every row's z reads its own window (the sorted ring), at every row and
metric. The rows are split into bins once a window (`layout`), not once per metric, a series
with no value of a metric (a prediction metric on a hidden layer) is passed over whole, and one
that holds one value through the window (a count that stays 0) has its one z folded into each
cell with a baseline, its windows neither read nor sorted (`_still`). `python
bench/engine_breakdown.py --trace TRACE --heat` times the pass for all metrics, on a GPT grown
to the size of a real run.

A bin can span two step windows of the classifier: the baseline of each series' last bin goes
out with the window's cells (`Open`) and the next window's rows of that bin are judged against
it, so fed in any chunks the cells are the same. tests/test_heatbins.py holds the cells to the
definition, computed from the classifier's own per-row baselines, and the kernel at one step
per bin to `quantiles.fold_baseline`.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import numba
import numpy as np
import polars as pl
from warninglight.forensics.judging.kernels import compiled
from warninglight.forensics.judging.kernels.bounds import log_key, lr_factor, sort8
from warninglight.forensics.judging.kernels.quantiles import (
    Column,
    Scales,
    log_floored,
    ranks,
    scratch_array,
    worse,
    z_of,
)

NONE = np.iinfo(np.int64).min  # no bin open


@numba.njit(nogil=True, inline="always")
def _merge_runs(a: np.ndarray, size: int) -> None:  # pragma: no cover - compiled
    """a[:64]'s sorted runs of `size` merged into sorted runs of twice that: each pair made one
    bitonic run (the second reversed) and sorted by half-cleaners, no branch on the data."""
    for s0 in range(0, 64, 2 * size):
        for k in range(size // 2):
            p, q = s0 + size + k, s0 + 2 * size - 1 - k
            a[p], a[q] = a[q], a[p]
        d = size
        while d >= 1:
            for blk in range(s0, s0 + 2 * size, 2 * d):
                for k in range(blk, blk + d):
                    x, y = a[k], a[k + d]
                    a[k] = min(x, y)
                    a[k + d] = max(x, y)
            d >>= 1


@numba.njit(nogil=True, inline="always")
def _sort(buf: np.ndarray, n: int) -> None:  # pragma: no cover - compiled
    """buf[:n] sorted in place (up to 64 values by a network: buf[n:64] padded with +inf)."""
    if n > 64:
        buf[:n].sort()
        return
    for k in range(n, 64):
        buf[k] = np.inf
    for q in range(8):
        sort8(buf, 8 * q)
    _merge_runs(buf, 8)
    _merge_runs(buf, 16)
    _merge_runs(buf, 32)


@numba.njit(nogil=True, inline="always")
def _value(k: float, log: bool) -> float:  # pragma: no cover - compiled
    """A sorted key on the baseline's scale: a log metric's keys are max(value, tiny) (/ lr)."""
    return math.log(k) if log else k


@numba.njit(nogil=True)
def _stats_at(raw: np.ndarray, lr: np.ndarray, i: int, first: int, window: int, lag: int, min_samples: int,
              log: bool, scaled: bool, tiny: float, buf: np.ndarray) -> tuple[bool, float, float, float]:  # pragma: no cover - compiled
    """(whether row i has a baseline, q25, median, q75 of its window) on the baseline's scale,
    read as `quantiles._trailing` reads its sorted ring: the quartiles at the nearest rank, the
    median between the two middle values. The values are sorted by a key in the same order (a
    log metric's max(value, tiny), / its lr where judged relative to it; log taken after): an
    lr-relative one's statistics can differ from the ring's in the last bits."""
    e = i - lag
    if e < first:
        return False, np.nan, np.nan, np.nan
    n = 0
    rises = falls = 0  # neighbours in order and out of it: a window that holds still or trends needs no sort
    last = np.nan
    for r in range(max(e - window + 1, first), e + 1):
        x = np.float64(raw[r])
        if math.isfinite(x):
            if log:
                k = log_key(x, lr, r, scaled, tiny)
            elif scaled:
                k = x - math.log(lr_factor(lr, r))
            else:
                k = x
            buf[n] = k
            rises += k > last
            falls += k < last
            last = k
            n += 1
    if n < min_samples or n == 0:
        return False, np.nan, np.nan, np.nan
    if falls == 0:
        pass  # in order already (equal values: any order of them is the same values)
    elif rises == 0:
        for k in range(n // 2):
            buf[k], buf[n - 1 - k] = buf[n - 1 - k], buf[k]
    else:
        _sort(buf, n)
    r25, lo_i, hi_i, part, r75 = ranks(n)
    m_lo = _value(buf[lo_i], log)
    q50 = m_lo if lo_i == hi_i else m_lo + (_value(buf[hi_i], log) - m_lo) * part
    return True, _value(buf[r25], log), q50, _value(buf[r75], log)


@numba.njit(nogil=True, inline="always")
def _finite(raw: np.ndarray, a: int, b: int) -> int:  # pragma: no cover - compiled
    """How many of rows a..b - 1 hold a finite value (none where b <= a)."""
    n = 0
    for r in range(a, b):
        n += math.isfinite(np.float64(raw[r]))
    return n


@numba.njit(nogil=True, inline="always")
def _any_finite(raw: np.ndarray, a: int, b: int) -> bool:  # pragma: no cover - compiled
    """Whether one of rows a..b - 1 holds a finite value: read up to the first (counting them all
    was a whole pass over every metric's rows)."""
    for r in range(a, b):  # noqa: SIM110 - compiled: no generator for any()
        if math.isfinite(np.float64(raw[r])):
            return True
    return False


@numba.njit(nogil=True, inline="always")
def _still(raw: np.ndarray, a: int, b: int) -> bool:  # pragma: no cover - compiled
    """Whether rows a..b - 1 all hold one finite value (a count that stays 0, a fraction that
    never leaves 0; a null row is NaN in `raw`, so none is null): read up to the first that differs."""
    v = np.float64(raw[a])
    if not math.isfinite(v):
        return False
    for r in range(a, b):  # noqa: SIM110 - compiled: no generator for all()
        if np.float64(raw[r]) != v:
            return False
    return True


@numba.njit(nogil=True)
def _z_at(x: float, f: float, q25: float, q50: float, q75: float, log: bool, scaled: bool, floor: float,
          rel_floor: float, log_floor: float, tiny: float, per_iqr: float) -> float:  # pragma: no cover - compiled
    """The z of a value x at lr f against the statistics given (`quantiles.z_of`)."""
    logged = log_floored(x, tiny) if log else np.nan
    return z_of(q25, q50, q75, x, logged, f, log, scaled, floor, rel_floor, log_floor, tiny, per_iqr,
                 np.nan, np.nan, np.nan)[2]


@numba.njit(nogil=True)
def _first_baseline(raw: np.ndarray, judged: np.ndarray, lr: np.ndarray, r: int, i1: int, first: int, window: int,
                    lag: int, min_samples: int, log: bool, scaled: bool, tiny: float,
                    buf: np.ndarray) -> tuple[int, bool, float, float, float]:  # pragma: no cover - compiled
    """(row, whether found, its statistics): the first judged row of r..i1 - 1 whose window holds
    `min_samples` finite values. The first judged row is tried as it is (a bin past warm-up has
    its baseline there); past it the values are counted as the row moves, so a bin in warm-up or
    after a run of NaN costs a count a row, not a window's sort."""
    while r < i1 and not judged[r]:
        r += 1
    if r == i1:
        return r, False, np.nan, np.nan, np.nan
    have, q25, q50, q75 = _stats_at(raw, lr, r, first, window, lag, min_samples, log, scaled, tiny, buf)
    if have:
        return r, have, q25, q50, q75
    r += 1
    n = _finite(raw, max(r - lag - window + 1, first), r - lag + 1)
    while r < i1:
        if judged[r] and n >= min_samples and n > 0:
            have, q25, q50, q75 = _stats_at(raw, lr, r, first, window, lag, min_samples, log, scaled, tiny, buf)
            return r, have, q25, q50, q75
        r += 1
        n += _finite(raw, max(r - lag, first), r - lag + 1) - _finite(raw, max(r - lag - window, first),
                                                                     r - lag - window + 1)
    return r, False, np.nan, np.nan, np.nan


@numba.njit(cache=True, nogil=True)
def layout(starts: np.ndarray, step: np.ndarray, judged: np.ndarray, width: int, first_bin: np.ndarray,
           cell_start: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:  # pragma: no cover - compiled
    """Each series' cells: its bins from the one of its first judged row to its last's
    (`first_bin`, `NONE` where it has none; from cell `cell_start[g]`, `cell_start[-1]` of them),
    and per cell (seen, row0, row1, plain): whether it holds a judged row, its rows (row0..row1 - 1,
    from the series' first judged row on; none: row0 == row1) and whether every one is judged.
    A bin is (step - 1) // width: its first step bin * width + 1."""
    total = 0
    for g in range(len(starts) - 1):
        cell_start[g] = total
        first_bin[g] = NONE
        for i in range(starts[g], starts[g + 1]):
            if judged[i]:
                b = (step[i] - 1) // width
                if first_bin[g] == NONE:
                    first_bin[g] = b
                total = cell_start[g] + b - first_bin[g] + 1
    cell_start[len(starts) - 1] = total
    seen = np.zeros(total, dtype=np.bool_)
    row0 = np.zeros(total, dtype=np.int64)
    row1 = np.zeros(total, dtype=np.int64)
    plain = np.ones(total, dtype=np.bool_)
    for g in range(len(starts) - 1):
        if first_bin[g] == NONE:
            continue
        i = starts[g]
        while not judged[i]:
            i += 1
        last = -1
        for r in range(i, starts[g + 1]):
            c = cell_start[g] + (step[r] - 1) // width - first_bin[g]
            if c >= cell_start[g + 1]:
                break  # past the series' last judged row: no cell of its own
            if c != last:
                row0[c] = r
                last = c
            row1[c] = r + 1
            seen[c] |= judged[r]
            plain[c] &= judged[r]
    return seen, row0, row1, plain


@numba.njit(nogil=True, inline="always")
def _extremes(raw: np.ndarray, missing: np.ndarray, judged: np.ndarray, lr: np.ndarray, i0: int, i1: int,
              log: bool, scaled: bool, tiny: float) -> tuple[int, int]:  # pragma: no cover - compiled
    """The rows of rows i0..i1 - 1 (judged, not null, with a finite z) whose value is largest and
    smallest on the baseline's scale (-1, -1: none): against one baseline the worst |z| is at one
    of them. A log metric's z reads log(max(x, tiny)): a NaN is floored like any value, +inf has none."""
    hi, lo = -np.inf, np.inf
    hi_row = lo_row = -1
    for i in range(i0, i1):
        if not judged[i] or missing[i]:
            continue
        x = np.float64(raw[i])
        if log:
            if x == np.inf:
                continue
            k = log_key(x, lr, i, scaled, tiny)
        elif not math.isfinite(x):
            continue
        else:
            k = x  # off the log scale z is (x - median) / scale, whatever the lr
        if k > hi:
            hi, hi_row = k, i
        if k < lo:
            lo, lo_row = k, i
    return hi_row, lo_row


@numba.njit(nogil=True, inline="always")
def _span(raw: np.ndarray, missing: np.ndarray, i0: int, i1: int, log: bool, tiny: float,
          nulls: bool) -> tuple[float, float]:  # pragma: no cover - compiled
    """`_extremes` where every row of i0..i1 - 1 is judged and the metric is not judged relative
    to the lr: the largest and smallest value on the baseline's scale (a log metric's max(x,
    tiny): its z reads nothing else) of the rows not null (`missing`, read where `nulls`), -inf
    and inf where none has a z. No branch on the data: it keeps the values alone, where finding
    their rows (`_extremes`) branches at each."""
    hi, lo = -np.inf, np.inf
    for i in range(i0, i1):
        x = np.float64(raw[i])
        if log:
            k = x if x > tiny else tiny
            ok = x != np.inf
        else:
            k = x
            ok = math.isfinite(x)
        if nulls:
            ok = ok and not missing[i]
        hi = max(hi, k if ok else -np.inf)
        lo = min(lo, k if ok else np.inf)
    return hi, lo


@numba.njit(cache=True, nogil=True)
def _fold_bins(raw: np.ndarray, missing: np.ndarray, lr: np.ndarray, starts: np.ndarray, judged: np.ndarray,
               row0: np.ndarray, row1: np.ndarray, plain: np.ndarray, window: int, lag: int, min_samples: int,
               log: bool, scaled: bool, floor: float, rel_floor: float, log_floor: float, tiny: float,
               per_iqr: float, carry_bin: np.ndarray, carry_q: np.ndarray, first_bin: np.ndarray,
               cell_start: np.ndarray, cells: np.ndarray, open_q: np.ndarray, buf: np.ndarray,
               nulls: bool) -> None:  # pragma: no cover - compiled
    """One metric's worst |z| per (series, bin) folded into `cells` (`worse`), each bin's rows
    (`row0`, `row1`: `layout`) against the statistics of its first judged row with a baseline;
    a series' first bin takes `carry_q[g]` where it is the bin `carry_bin[g]` the statistics
    were taken for (NaN: none yet). `open_q[g]`: the statistics of series g's last bin (NaN:
    none). `nulls`: whether `missing` marks any row."""
    for g in range(len(starts) - 1):
        open_q[g, 0] = open_q[g, 1] = open_q[g, 2] = np.nan
        if first_bin[g] == NONE:
            continue
        first = starts[g]
        carried = first_bin[g] == carry_bin[g] and not math.isnan(carry_q[g, 1])
        if not carried and not _any_finite(raw, first, starts[g + 1]):
            continue  # no value, so no baseline (a metric the component does not have)
        have = False
        q25 = q50 = q75 = np.nan
        # a series that holds one value throughout (not judged relative to the lr): every window
        # full enough has it as its statistics, and every row its one z: no window read, no sort
        still = not scaled and min_samples <= window and _still(raw, first, starts[g + 1])
        if still:
            x = np.float64(raw[first])
            k = (x if x > tiny else tiny) if log else x  # its key, as `_stats_at` and `_span` take it
            q_still = _value(k, log)
            z_still = _z_at(k, 1.0, q_still, q_still, q_still, log, False, floor, rel_floor, log_floor, tiny, per_iqr)
            ready = first + lag + max(min_samples, 1) - 1  # the first row whose window holds min_samples
        for c in range(cell_start[g], cell_start[g + 1]):
            i, i1 = row0[c], row1[c]
            if i == i1:
                continue  # no row in this bin
            have = carried and c == cell_start[g]
            r = i
            if still and not have:  # `_first_baseline`: the first judged row from `ready` on
                r = max(i, ready)
                while r < i1 and not judged[r]:
                    r += 1
                have = r < i1
                if have:
                    q25 = q50 = q75 = q_still
                    cells[c] = worse(cells[c], z_still)
                continue
            if have:
                q25, q50, q75 = carry_q[g, 0], carry_q[g, 1], carry_q[g, 2]
            else:  # the bin's first judged row with a baseline
                r, have, q25, q50, q75 = _first_baseline(raw, judged, lr, i, i1, first, window, lag, min_samples,
                                                         log, scaled, tiny, buf)
            if not have:
                continue
            if plain[c] and not scaled:  # the values alone: z reads no row's lr here
                hi, lo = _span(raw, missing, r, i1, log, tiny, nulls)
                for k in (hi, lo):
                    if math.isfinite(k):
                        cells[c] = worse(cells[c], _z_at(k, 1.0, q25, q50, q75, log, False, floor, rel_floor,
                                                          log_floor, tiny, per_iqr))
            else:
                hi_row, lo_row = _extremes(raw, missing, judged, lr, r, i1, log, scaled, tiny)
                if hi_row >= 0:
                    for row in (hi_row, lo_row):
                        cells[c] = worse(cells[c], _z_at(np.float64(raw[row]), lr[row], q25, q50, q75, log, scaled,
                                                          floor, rel_floor, log_floor, tiny, per_iqr))
        if have:
            open_q[g, 0], open_q[g, 1], open_q[g, 2] = q25, q50, q75


class Bins(NamedTuple):
    """A step window's heatmap cells (`layout`): its rows' judged marks, each series' first bin
    and first cell, per cell whether it holds a judged row, its rows and whether all are judged;
    and the bin each series' last judged row is in, whose statistics go to the next window.
    Every metric's pass reads them: the rows are split into bins once."""

    judged: np.ndarray
    width: int
    first_bin: np.ndarray
    cell_start: np.ndarray
    seen: np.ndarray
    row0: np.ndarray
    row1: np.ndarray
    plain: np.ndarray

    @property
    def last_bin(self) -> np.ndarray:
        """The bin each series' last judged row is in (`NONE`: it has none)."""
        counts = np.diff(self.cell_start)
        return np.where(counts > 0, self.first_bin + counts - 1, NONE)


def bins(step: np.ndarray, judged: np.ndarray, starts: np.ndarray, width: int) -> Bins:
    """`Bins` of a window's rows (sorted by series, then step) in bins of `width` steps."""
    step = np.ascontiguousarray(step, dtype=np.int64)
    judged = np.ascontiguousarray(judged, dtype=np.bool_)
    starts = np.asarray(starts, dtype=np.int64)
    series = len(starts) - 1
    first_bin, cell_start = np.empty(series, dtype=np.int64), np.empty(series + 1, dtype=np.int64)
    seen, row0, row1, plain = compiled.pick(layout, len(step))(starts, step, judged, width, first_bin, cell_start)
    return Bins(judged, width, first_bin, cell_start, seen, row0, row1, plain)


def fold(col: Column, lr: np.ndarray | None, starts: np.ndarray, where: Bins, carry_bin: np.ndarray,
         carry_q: np.ndarray, window: int, lag: int, min_samples: int, scales: Scales,
         cells: np.ndarray) -> np.ndarray:
    """One metric's worst |z| per cell of `where` folded into `cells` (`_fold_bins`); the
    statistics of each series' last bin, (series, 3), NaN where none, for the next window."""
    raw, missing, lr_values, scaled = col.arrays(lr)
    open_q = np.empty((len(starts) - 1, 3))
    fold_bins = compiled.pick(_fold_bins, len(raw))
    fold_bins(raw, missing, lr_values, np.asarray(starts, dtype=np.int64), where.judged, where.row0, where.row1,
              where.plain, window, lag, min_samples, col.log, scaled, col.floor, scales.rel_floor, scales.log_floor,
              scales.tiny, 1.0 / scales.iqr_to_sigma, carry_bin, np.ascontiguousarray(carry_q), where.first_bin,
              where.cell_start, cells, open_q, scratch_array(max(64, window), "heat_window"), col.missing is not None)
    return open_q


def fold_rows(where: Bins, z: np.ndarray, cells: np.ndarray) -> None:
    """Each cell of `where` takes the worst finite |z| of its judged rows, from `z`, one per row of
    the window (NaN: none): a baseline given row by row, which no bin's first row stands for."""
    counts = where.row1 - where.row0
    offsets = np.cumsum(counts) - counts
    rows = np.repeat(where.row0 - offsets, counts) + np.arange(int(counts.sum()))
    cell = np.repeat(np.arange(len(counts)), counts)
    worst = np.abs(z[rows])
    take = np.isfinite(worst) & where.judged[rows]
    np.fmax.at(cells, cell[take], worst[take])


def frame(names: pl.Series, where: Bins, cells: np.ndarray) -> pl.DataFrame:
    """The cells that hold a judged row as the heatmap's frame: component, step (the bin's
    first), score (null: no metric had a z there). `names`: each series' component."""
    counts = np.diff(where.cell_start)
    series = np.repeat(np.arange(len(counts)), counts)
    start = (where.first_bin[series] + np.arange(len(series)) - where.cell_start[series]) * where.width + 1
    keep = where.seen
    return pl.DataFrame({"component": names.gather(series[keep]), "step": start[keep],
                         "score": pl.Series(cells[keep], dtype=pl.Float64, nan_to_null=True)})


class Open:
    """The statistics each series' last bin was judged against, handed from one step window to
    the next (`judge` reads and replaces them: the windows are judged one after another)."""

    def __init__(self) -> None:
        self.keys: dict[tuple[int, str], int] = {}  # (rank, component) -> place in `bin`, `q`
        self.bin = np.empty(0, dtype=np.int64)
        self.q: dict[str, np.ndarray] = {}  # metric -> (places, 3)

    def places(self, keys: list[tuple[int, str]]) -> tuple[np.ndarray, np.ndarray]:
        """(places, bins): where each of `keys` is held (-1: nowhere) and the bin its statistics
        were taken for (`NONE`: none)."""
        at = np.array([self.keys.get(k, -1) for k in keys], dtype=np.int64)
        carry_bin = np.full(len(keys), NONE, dtype=np.int64)
        carry_bin[at >= 0] = self.bin[at[at >= 0]]
        return at, carry_bin

    def stats(self, at: np.ndarray, metric: str) -> np.ndarray:
        """The statistics of `metric` held at places `at` (`places`), (len(at), 3); NaN: none."""
        out = np.full((len(at), 3), np.nan)
        q = self.q.get(metric)
        if q is not None:
            out[at >= 0] = q[at[at >= 0]]
        return out

    def update(self, keys: list[tuple[int, str]], last_bin: np.ndarray, q: dict[str, np.ndarray]) -> None:
        """Each series with a judged row in the window: its last bin and that bin's statistics."""
        fresh = [k for k, b in zip(keys, last_bin, strict=True) if b != NONE]
        rows = np.flatnonzero(last_bin != NONE)
        places = [self.keys.setdefault(k, len(self.keys)) for k in fresh]
        grow = len(self.keys) - len(self.bin)
        if grow > 0:
            self.bin = np.concatenate([self.bin, np.full(grow, NONE, dtype=np.int64)])
            self.q = {m: np.concatenate([v, np.full((grow, 3), np.nan)]) for m, v in self.q.items()}
        self.bin[places] = last_bin[rows]
        for m, stats in q.items():
            if m not in self.q:
                self.q[m] = np.full((len(self.keys), 3), np.nan)
            self.q[m][places] = stats[rows]
        for m in self.q.keys() - q.keys():  # a metric the window did not have: nothing carried for it
            self.q[m][places] = np.nan


@numba.njit(cache=True, nogil=True)
def worst_per_bin(heat: np.ndarray, step: np.ndarray, starts: np.ndarray, judged: np.ndarray, width: int,
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
