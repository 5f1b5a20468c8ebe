"""Where a trailing median can lie: bounds taken once a block of rows, so rules skip the rows
where they cannot fire.

The exact baseline (`quantiles.baseline`) keeps each series' window sorted, a move of values at
every row and metric; on a healthy run nearly every row is far from every threshold,
and a rule that compares a value with its median (`fold`, `delta`) cannot fire where no median
the window allows would make it. So the classifier first bounds the median (`window_of`,
`block_range`), tests the rules against the bounds (`screen.candidates`, a block of rows at a
time where it can), and takes the exact baseline only at the rows left, reading only their
windows (`quantiles.baseline_at`): the same hits, at a fraction of the work.

The bound: each series is cut into blocks of `BLOCK` rows, each sorted once (`sort_blocks`). A
window of n finite values has its median between the values of ranks (n - 1) // 2 and
n - 1 - (n - 1) // 2 (from 0). If it holds k whole blocks and p finite values outside them,
each block has at most r values below its r-th smallest; with k * r + p <= (n - 1) // 2, at most
(n - 1) // 2 values lie below the least of the blocks' r-th smallest, so neither middle value
does: it bounds the median from below, and the greatest r-th largest from above. For a full
window of 64 that is the least and greatest of the blocks' 4th values from each end.

Blocks hold a log metric's values raw (log keeps their order) and an lr-scaled one's as
value / lr; the bounds go back to the metric's units times the row's lr, a little wider
(`widened`) for the rounding of the median's log, exp and lr arithmetic. tests/test_bounds.py
holds them to the exact median on random, trending, tied, gapped, signed, spiky and
bound-tight series.
"""

from __future__ import annotations

import math

import numba
import numpy as np
from warninglight.forensics.judging.kernels.quantiles import Column, Scales, scratch_array

BLOCK = 8  # rows per block (`sort8`)
SHIFT = 3  # log2(BLOCK)
_SLACK = 1e-9  # relative: far beyond the few ulps the median's arithmetic can round by
_HUGE = 1e300  # beyond this the median's arithmetic may overflow: no bound


@numba.njit(nogil=True, inline="always")
def sort8(b: np.ndarray, at: int) -> None:  # pragma: no cover - compiled
    """b[at:at + 8] sorted in place by a 19-comparator network: no branch on the data, where an
    insertion sort mispredicted about every value."""
    a0, a1, a2, a3, a4, a5, a6, a7 = b[at], b[at + 1], b[at + 2], b[at + 3], b[at + 4], b[at + 5], b[at + 6], b[at + 7]
    a0, a2 = min(a0, a2), max(a0, a2)
    a1, a3 = min(a1, a3), max(a1, a3)
    a4, a6 = min(a4, a6), max(a4, a6)
    a5, a7 = min(a5, a7), max(a5, a7)
    a0, a4 = min(a0, a4), max(a0, a4)
    a1, a5 = min(a1, a5), max(a1, a5)
    a2, a6 = min(a2, a6), max(a2, a6)
    a3, a7 = min(a3, a7), max(a3, a7)
    a0, a1 = min(a0, a1), max(a0, a1)
    a2, a3 = min(a2, a3), max(a2, a3)
    a4, a5 = min(a4, a5), max(a4, a5)
    a6, a7 = min(a6, a7), max(a6, a7)
    a2, a4 = min(a2, a4), max(a2, a4)
    a3, a5 = min(a3, a5), max(a3, a5)
    a1, a4 = min(a1, a4), max(a1, a4)
    a3, a6 = min(a3, a6), max(a3, a6)
    a1, a2 = min(a1, a2), max(a1, a2)
    a3, a4 = min(a3, a4), max(a3, a4)
    a5, a6 = min(a5, a6), max(a5, a6)
    b[at], b[at + 1], b[at + 2], b[at + 3], b[at + 4], b[at + 5], b[at + 6], b[at + 7] = a0, a1, a2, a3, a4, a5, a6, a7


@numba.njit(nogil=True, inline="always")
def lr_factor(lr: np.ndarray, i: int) -> float:  # pragma: no cover - compiled
    """Row i's lr where it scales the metric (finite and positive), else 1."""
    f = lr[i]
    return f if math.isfinite(f) and f > 0 else 1.0


@numba.njit(nogil=True, inline="always")
def log_key(x: float, lr: np.ndarray, i: int, scaled: bool, tiny: float) -> float:  # pragma: no cover - compiled
    """Row i's value x of a log metric in an order its log scale keeps: max(x, tiny) (a NaN:
    tiny), / the row's lr where the metric is judged relative to it."""
    y = x if x > tiny else tiny
    return y / lr_factor(lr, i) if scaled else y


@numba.njit(nogil=True, inline="always")
def sort_blocks(raw: np.ndarray, lr: np.ndarray, starts: np.ndarray, log: bool, scaled: bool, tiny: float,
                blocks: np.ndarray, count: np.ndarray, finite: np.ndarray, base: np.ndarray,
                plain: np.ndarray) -> None:  # pragma: no cover - compiled
    """Each series' blocks sorted (`blocks`, `BLOCK` values each, the series' last padded with
    +inf; `count`: the finite values of each; `base`: each series' first block), `finite[i]`:
    the finite values before row i, and `plain[g]`: series g holds no -0.0.

    A log metric's values are bounded raw (its log scale orders them as they are ordered), one
    judged relative to the lr as value / lr (its median is exp(median of log(value / lr)) * lr)."""
    total = 0
    block = 0
    for g in range(len(starts) - 1):
        first, end = starts[g], starts[g + 1]
        plain[g] = True
        base[g] = block
        for b0 in range(first, end, BLOCK):
            c = 0
            for k in range(BLOCK):
                i = b0 + k
                y = np.inf  # a padded place, or a value that is not finite: sorted last
                if i < end:
                    finite[i] = total
                    x = np.float64(raw[i])
                    if math.isfinite(x):
                        y = x
                        if log:
                            y = log_key(x, lr, i, scaled, tiny)
                        elif x == 0.0 and math.copysign(1.0, x) < 0:
                            plain[g] = False
                        c += 1
                        total += 1
                blocks[block * BLOCK + k] = y
            sort8(blocks, block * BLOCK)
            count[block] = c
            block += 1
    finite[len(raw)] = total


@numba.njit(nogil=True, inline="always")
def widened(low: float, high: float) -> tuple[float, float]:  # pragma: no cover - compiled
    """`low`..`high` widened by the rounding the median's arithmetic may add; no bound beyond `_HUGE`."""
    if abs(low) > _HUGE or abs(high) > _HUGE:
        return -np.inf, np.inf
    return low - abs(low) * _SLACK - 1e-300, high + abs(high) * _SLACK + 1e-300


@numba.njit(nogil=True, inline="always")
def window_of(i: int, first: int, base: int, window: int, lag: int, finite: np.ndarray) -> tuple[int, int, int]:  # pragma: no cover - compiled
    """(n, k0, k1) of row i's window (its series starts at row `first`, its blocks at `base`):
    its finite values, and the whole blocks k0..k1 - 1 that bound its median; n is 0 where it
    has no rows yet.

    The blocks are those inside the window's last `spanned(window)` rows: as many whatever
    the window's place (a full window of 64 holds 7 or 8 whole blocks, its last 63 rows always
    7), so the rows of one block share them, and their bounds are taken once per block."""
    e = i - lag  # the window: rows a..e
    if e < first:
        return 0, 0, 0
    a = max(e - window + 1, first)
    inner = max(e - spanned(window) + 1, first)
    return (finite[e + 1] - finite[a], base + ((inner - first + BLOCK - 1) >> SHIFT),
            base + ((e + 1 - first) >> SHIFT))


@numba.njit(nogil=True, inline="always")
def spanned(window: int) -> int:  # pragma: no cover - compiled
    """The longest span of at most `window` rows that always holds the same number of whole blocks:
    BLOCK * q + BLOCK - 1 rows hold q wherever they start."""
    return window if window < BLOCK else window - (window - (BLOCK - 1)) % BLOCK


@numba.njit(nogil=True, inline="always")
def block_rank(n: int, blocks: int, part: int) -> int:  # pragma: no cover - compiled
    """r: in a window of n finite values, `part` of them outside its `blocks` whole blocks, the
    least of the blocks' r-th smallest and the greatest of their r-th largest (from 0) bound its
    median; -1: they bound nothing (no whole block, or too many values outside them)."""
    lower = (n - 1) >> 1  # the median lies between the values of ranks lower and n - 1 - lower
    if blocks <= 0 or part > lower:
        return -1
    return (lower - part) // blocks


@numba.njit(nogil=True, inline="always")
def block_bounds(k0: int, k1: int, r: int, blocks: np.ndarray, count: np.ndarray) -> tuple[float, float]:  # pragma: no cover - compiled
    """(least r-th smallest, greatest r-th largest) of blocks k0..k1 - 1 (`block_rank`'s r)."""
    if r < 0:
        return -np.inf, np.inf
    low, high = np.inf, -np.inf
    for blk in range(k0, k1):
        c = count[blk]
        if c > r:  # a block with r or fewer values bounds nothing (and adds at most r)
            low = min(low, blocks[blk * BLOCK + r])
            high = max(high, blocks[blk * BLOCK + c - 1 - r])
    return low, high


@numba.njit(nogil=True, inline="always")
def block_range(n: int, k0: int, k1: int, first: int, base: int, blocks: np.ndarray, count: np.ndarray,
                finite: np.ndarray) -> tuple[float, float]:  # pragma: no cover - compiled
    """Bounds of the median of a window of n finite values that holds blocks k0..k1 - 1 whole
    (`window_of`), on the scale `sort_blocks` sorted them on, unwidened; -inf, inf: no bound.
    Rows of one block share them: callers keep the last (n, k0, k1) and call again on a change
    (in the caller's locals, which stay in registers: in an array the memo is a load and a store
    a row)."""
    if k1 <= k0:
        return -np.inf, np.inf
    part = n - (finite[first + ((k1 - base) << SHIFT)] - finite[first + ((k0 - base) << SHIFT)])
    return block_bounds(k0, k1, block_rank(n, k1 - k0, part), blocks, count)


class Workspace:
    """`sort_blocks`' arrays for `n` rows in `series` series: this thread's, reused call to call."""

    def __init__(self, n: int, series: int) -> None:
        blocks = n // BLOCK + series + 1  # each series' last block padded to a whole one
        ints = scratch_array(blocks + n + 1 + series, "bounds_ints", np.int64)
        self.blocks = scratch_array(blocks * BLOCK, "bounds_blocks")
        self.count, self.finite = ints[:blocks], ints[blocks:blocks + n + 1]
        self.base = ints[blocks + n + 1:blocks + n + 1 + series]
        self.plain = np.empty(series, dtype=np.bool_)
        self.quiet = scratch_array(n, "bounds_quiet", np.bool_)[:n]  # a row's flag (`screen.candidates`)


@numba.njit(cache=True, nogil=True)
def _median_bounds(raw: np.ndarray, lr: np.ndarray, starts: np.ndarray, kept: np.ndarray, window: int,
                   lag: int, min_samples: int, log: bool, scaled: bool, tiny: float, lo: np.ndarray,
                   hi: np.ndarray, blocks: np.ndarray, count: np.ndarray, finite: np.ndarray,
                   base: np.ndarray, plain: np.ndarray) -> None:  # pragma: no cover - compiled
    sort_blocks(raw, lr, starts, log, scaled, tiny, blocks, count, finite, base, plain)
    g = 0
    key = (-1, -1, -1)
    low = high = np.nan
    for j in range(len(kept)):
        i = kept[j]
        while starts[g + 1] <= i:
            g += 1
        n, k0, k1 = window_of(i, starts[g], base[g], window, lag, finite)
        if n < min_samples or n == 0:
            lo[j] = hi[j] = np.nan  # no baseline
            continue
        if (n, k0, k1) != key:
            key = (n, k0, k1)
            low, high = block_range(n, k0, k1, starts[g], base[g], blocks, count, finite)
            if not scaled:
                low, high = widened(low, high)
        lo[j], hi[j] = widened(low * lr_factor(lr, i), high * lr_factor(lr, i)) if scaled else (low, high)


def median_bounds(col: Column, lr: np.ndarray | None, starts: np.ndarray, kept: np.ndarray, window: int,
                  lag: int, min_samples: int, scales: Scales) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(lo, hi, plain): for each kept row, lo <= the median `quantiles.baseline` gives it <= hi
    (NaN: it has none; ±inf: no bound); `plain` (per series): holds no -0.0 (`baseline`'s
    `whole`). What `screen.candidates` computes row by row, as arrays."""
    n, k = len(col.raw), len(kept)
    work = Workspace(n, len(starts) - 1)
    lo, hi = np.empty(k), np.empty(k)
    raw, _, lr_values, scaled = col.arrays(lr)
    _median_bounds(raw, lr_values, np.asarray(starts, dtype=np.int64), np.asarray(kept, dtype=np.int64), window, lag,
                   min_samples, col.log, scaled, scales.tiny, lo, hi, work.blocks, work.count, work.finite,
                   work.base, work.plain)
    return lo, hi, work.plain
