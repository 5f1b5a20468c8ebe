"""Which rows a metric's rules can fire at, knowing only bounds of the median (`bounds.py`).

Without a heatmap the classifier needs a metric's median, scale and z only where one of its
rules can fire. Each rule's fold, delta and level is loosened to the bound of the median that
makes it likeliest to hold (`rules.thresholds`, beside the exact test it loosens); a block of rows whose values lie between every
rule's thresholds is passed over at once (`_quiet_rows`), the other rows are tested one by one
(`candidates`), and `judge` takes the exact baseline (`quantiles.baseline_at`) only at the rows
left: the same hits (tests/test_judge.py forces the screen on every metric and holds it to the
rules' oracle; tests/test_bounds.py holds every row a rule can fire at to be a candidate).
"""

from __future__ import annotations

import math

import numba
import numpy as np
from warninglight.forensics.judging.kernels import bounds, compiled
from warninglight.forensics.judging.kernels import rules as rt
from warninglight.forensics.judging.kernels.quantiles import Column, Scales

# A metric's baseline is taken only at the rows where one of its rules may fire, unless more
# than one row in this many may: each such row reads its whole window, and the rows between
# two close ones are visited anyway.
SPARSE = 16


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
    between every rule's thresholds (`rules.thresholds`), none can fire. The other rows are left to
    the test of each row (`quiet` comes all False).

    A metric judged relative to the lr is bounded on value / lr (its blocks' scale): a rule's
    fold reads the same there (v >= m * fold is v / lr >= m / lr * fold, within the bounds'
    room for rounding), its delta and level do not; a metric with one of those is left to each
    row."""
    q = bounds.spanned(window) >> bounds.SHIFT  # whole blocks of a full window, wherever it ends
    rank = bounds.block_rank(window, q, window - (q << bounds.SHIFT))  # the same for every full, finite window
    if rank < 0:
        return
    held_low = held_high = np.nan  # the bounds the thresholds below were taken for
    all_up, all_down = np.inf, -np.inf
    if scaled:
        for r in range(rules.shape[0]):
            if rules[r, rt.DIR] != 3 and not (math.isnan(rules[r, rt.DELTA]) and math.isnan(rules[r, rt.LEVEL])):
                return
    for g in range(len(starts) - 1):
        first, end, bs = starts[g], starts[g + 1], base[g]
        # group m: rows i0..i1 whose window's last whole block is the series' block m - 1
        for m in range(q, ((end - first) >> bounds.SHIFT) + 1):
            opens = first + lag - 1 + (m << bounds.SHIFT)  # e + 1 - first = BLOCK * m
            i0 = max(opens, first + lag + window - 1)  # full windows only
            i1 = min(opens + bounds.BLOCK - 1, end - 1)
            if i0 > i1:
                continue
            a0, e1 = i0 - lag - window + 1, i1 - lag  # every window of the group lies in a0..e1
            if finite[e1 + 1] - finite[a0] != e1 + 1 - a0:
                continue  # a value that is not finite in some window: each row's own count
            low, high = bounds.block_bounds(bs + m - q, bs + m, rank, blocks, count)
            if low != held_low or high != held_high:  # a series' bounds often hold from block to block
                held_low, held_high = low, high
                lower, upper = bounds.widened(low, high)
                all_up, all_down = rt.thresholds(rules, lower, upper, up, down)
            least, greatest = np.inf, -np.inf  # the group's own finite values
            if scaled:  # each value / its own lr (the blocks hold max(value, tiny) / lr)
                for i in range(i0, i1 + 1):
                    v = np.float64(raw[i])
                    if math.isfinite(v):
                        y = v / bounds.lr_factor(lr, i)
                        least, greatest = min(least, y), max(greatest, y)
            else:
                for blk in range(bs + ((i0 - first) >> bounds.SHIFT), bs + ((i1 - first) >> bounds.SHIFT) + 1):
                    c = count[blk]
                    if c > 0:
                        least = min(least, blocks[blk * bounds.BLOCK])
                        greatest = max(greatest, blocks[blk * bounds.BLOCK + c - 1])
                if log and least <= tiny:
                    least = -np.inf  # a log metric's blocks hold max(value, tiny): a value below is not bounded
            if all_down < least and greatest < all_up:
                quiet[i0:i1 + 1] = True


@numba.njit(cache=True, nogil=True)
def candidates(raw: np.ndarray, missing: np.ndarray, lr: np.ndarray, starts: np.ndarray, kept: np.ndarray,
                window: int, lag: int, min_samples: int, log: bool, scaled: bool, tiny: float,
                rules: np.ndarray, roles: np.ndarray, want: np.ndarray, blocks: np.ndarray, count: np.ndarray,
                finite: np.ndarray, base: np.ndarray, plain: np.ndarray, quiet: np.ndarray) -> int:  # pragma: no cover - compiled
    """`want[j]` = whether a threshold rule of one metric may fire at kept row j, knowing only
    bounds of its median (`bounds.block_range`, `rules.thresholds`; a block of rows at a time where
    it can, `_quiet_rows`); how many may. `plain[g]`: series g holds no -0.0 (`quantiles.baseline`'s
    `whole`). `quiet`: a bool per row, working space."""
    bounds.sort_blocks(raw, lr, starts, log, scaled, tiny, blocks, count, finite, base, plain)
    k = rules.shape[0]
    up, down = np.empty(k), np.empty(k)
    role = np.empty(k, dtype=np.int64)
    for r in range(k):
        role[r] = int(rules[r, rt.ROLE])
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
                rt.thresholds(rules, lower, upper, up, down)
                any_up, any_down = np.inf, -np.inf
                for r in range(k):
                    if role[r] < 0:
                        any_up, any_down = min(any_up, up[r]), max(any_down, down[r])
        hit = v >= any_up or v <= any_down
        if some_roles and not hit:
            for r in range(k):  # rules of some roles only
                if role[r] >= 0 and roles[role[r], j] and (v >= up[r] or v <= down[r]):
                    hit = True
                    break
        want[j] = hit
        found += hit
    return found


def wanted(col: Column, lr: np.ndarray | None, starts: np.ndarray, kept: np.ndarray, window: int, lag: int,
           min_samples: int, scales: Scales, rules: np.ndarray,
           roles: np.ndarray) -> tuple[np.ndarray | None, np.ndarray | None]:
    """(want, whole): the kept rows where a rule of the table `rules` may fire (`candidates`;
    None: more than one in `SPARSE`, take every row), and the series to take whole (None: none),
    what `quantiles.baseline_at` takes."""
    n = len(col.raw)
    work = bounds.Workspace(n, len(starts) - 1)
    want = np.empty(len(kept), dtype=np.bool_)
    raw, missing, lr_values, scaled = col.arrays(lr)
    screen = compiled.pick(candidates, n)
    may = screen(raw, missing, lr_values, np.asarray(starts, dtype=np.int64), np.asarray(kept, dtype=np.int64),
                 window, lag, min_samples, col.log, scaled, scales.tiny, rules, roles, want, work.blocks,
                 work.count, work.finite, work.base, work.plain, work.quiet)
    return (None if may * SPARSE > len(kept) else want), (None if work.plain.all() else ~work.plain)
