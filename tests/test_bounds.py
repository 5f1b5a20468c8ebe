"""The cheap bounds of a trailing median hold the exact median on every row, and the baseline
taken only at some rows equals the one taken at every row there: what lets `judge` skip the
rows where no rule can fire without changing a hit."""

from __future__ import annotations

import itertools

import numpy as np
import pytest
from warninglight.forensics.judging.kernels import bounds, quantiles

SCALES = quantiles.Scales(rel_floor=0.02, log_floor=0.02, tiny=1e-12, iqr_to_sigma=1.349)


def test_the_sorting_network_sorts_every_input() -> None:
    # the 0-1 principle: a comparator network that sorts every 0/1 input sorts every input
    for bits in itertools.product((0.0, 1.0), repeat=8):
        b = np.array([*bits, 5.0])
        bounds.sort_blocks(np.array(bits), np.ones(8), np.array([0, 8]), False, False, 1e-12,
                           b, np.empty(1, dtype=np.int64), np.empty(9, dtype=np.int64),
                           np.empty(1, dtype=np.int64), np.empty(1, dtype=np.bool_))
        assert list(b[:8]) == sorted(bits)
    rng = np.random.default_rng(0)
    for _ in range(200):  # with values that are not finite, sorted last and not counted
        x = rng.choice([rng.normal(), np.nan, np.inf, -np.inf, 0.0], size=int(rng.integers(1, 20)))
        n = len(x)
        blocks, count = np.empty((n // 8 + 2) * 8), np.empty(n // 8 + 2, dtype=np.int64)
        finite = np.empty(n + 1, dtype=np.int64)
        bounds.sort_blocks(x, np.ones(n), np.array([0, n]), False, False, 1e-12, blocks, count, finite,
                           np.empty(1, dtype=np.int64), np.empty(1, dtype=np.bool_))
        for k in range(0, n, 8):
            chunk = x[k:k + 8]
            kept = np.sort(chunk[np.isfinite(chunk)])
            assert count[k // 8] == len(kept)
            assert np.array_equal(blocks[k:k + len(kept)], kept)
        assert list(finite) == [0, *np.cumsum(np.isfinite(x))]


def _series(rng: np.random.Generator, shape: str, n: int) -> np.ndarray:
    t = np.arange(n, dtype=float)
    x = {"noise": np.exp(rng.normal(size=n)),
         "up": 1 + t + rng.normal(scale=0.3, size=n),
         "down": 1000 - t + rng.normal(scale=0.3, size=n),
         "ties": rng.integers(0, 3, size=n).astype(float),
         "signed": rng.normal(size=n) * rng.choice([1.0, 1e-3, 1e3], size=n),
         "spiky": np.where(rng.random(n) < 0.05, 1e6, 1.0) * np.exp(rng.normal(scale=0.1, size=n)),
         # blocks of four 1s, a 2 and three 100s: windows whose median is the bound itself
         "tight": np.concatenate([rng.permutation([1.0, 1, 1, 1, 2, 100, 100, 100]) for _ in range(n // 8 + 1)])[:n]}[shape]
    gaps = rng.random(n) < rng.choice([0.0, 0.02, 0.3])
    return np.where(gaps, rng.choice([np.nan, np.inf, -np.inf], size=n), x)


@pytest.mark.parametrize("seed", range(3))
@pytest.mark.parametrize("shape", ["noise", "up", "down", "ties", "signed", "spiky", "tight"])
def test_the_median_lies_within_its_bounds_on_every_row(seed: int, shape: str) -> None:
    rng = np.random.default_rng(seed)
    lengths = rng.integers(0, 400, size=4)
    n = int(lengths.sum())
    starts = np.concatenate([[0], np.cumsum(lengths)])
    lr = np.where(rng.random(n) < 0.9, 1e-3 * np.exp(rng.normal(size=n)), rng.choice([np.nan, 0.0], size=n))
    x = _series(rng, shape, n)
    informative = 0
    for window, lag, min_samples in ((64, 3, 64), (64, 3, 20), (16, 2, 8), (7, 0, 1), (33, 1, 33), (100, 5, 50)):
        kept = np.flatnonzero(rng.random(n) < 0.7)  # any rows: the bounds are of those asked for
        for log, scaled, dtype in ((False, False, np.float64), (True, False, np.float32), (True, True, np.float32)):
            col = quantiles.Column(x.astype(dtype), None, log, scaled, 1e-8)
            med = quantiles.baseline(col, lr, starts, kept, window, lag, min_samples, SCALES)[0]
            lo, hi, plain = bounds.median_bounds(col, lr, starts, kept, window, lag, min_samples, SCALES)
            assert np.array_equal(np.isnan(lo), np.isnan(med)) and np.array_equal(np.isnan(hi), np.isnan(med))
            has = ~np.isnan(med)
            assert (lo[has] <= med[has]).all() and (med[has] <= hi[has]).all(), (window, lag, min_samples, log, scaled)
            informative += int(np.isfinite(lo[has]).sum())
    assert informative > 0.3 * n  # not a vacuous bound: most full windows have one


def test_a_series_with_a_negative_zero_is_marked() -> None:
    x = np.array([1.0, 0.0, 2.0, 3.0, -0.0, 1.0, 5.0])
    starts = np.array([0, 3, 7])
    col = quantiles.Column(x, None, False, False, 1e-8)
    _, _, plain = bounds.median_bounds(col, None, starts, np.arange(7), 2, 0, 1, SCALES)
    assert plain.tolist() == [True, False]
    log = quantiles.Column(x, None, True, False, 1e-8)  # floored at tiny before its log: no zero at all
    assert bounds.median_bounds(log, None, starts, np.arange(7), 2, 0, 1, SCALES)[2].all()


@pytest.mark.parametrize("seed", range(4))
def test_the_baseline_of_some_rows_equals_the_baseline_of_every_row_there(seed: int) -> None:
    rng = np.random.default_rng(10 + seed)
    lengths = rng.integers(0, 500, size=5)
    n = int(lengths.sum())
    starts = np.concatenate([[0], np.cumsum(lengths)])
    lr = 1e-3 * np.exp(rng.normal(size=n))
    for shape in ("noise", "signed", "ties", "up"):
        x = _series(rng, shape, n)
        x[rng.random(n) < 0.02] = -0.0  # zeros of both signs: the series that hold one are taken whole
        missing = rng.random(n) < 0.03
        for window, lag, min_samples in ((64, 3, 64), (16, 2, 4), (5, 0, 5)):
            kept = np.arange(int(rng.integers(0, n // 3 + 1)), n)  # history rows first, as a window carries them
            for log, scaled in ((False, False), (True, True)):
                col = quantiles.Column(x, missing, log, scaled, 1e-8)
                every = quantiles.baseline(col, lr, starts, kept, window, lag, min_samples, SCALES)
                plain = bounds.median_bounds(col, lr, starts, kept, window, lag, min_samples, SCALES)[2]
                for density in (0.001, 0.05, 0.5):
                    clustered = np.convolve(rng.random(len(kept)) < density / 8, np.ones(8), mode="same") > 0
                    for want in (rng.random(len(kept)) < density, clustered):
                        taken, *some = quantiles.baseline_at(col, lr, starts, kept, window, lag, min_samples, SCALES,
                                                             want, None if plain.all() else ~plain)
                        expected = want.copy()
                        for g in np.flatnonzero(~plain):  # a series with a -0.0: every row of it
                            expected |= (kept >= starts[g]) & (kept < starts[g + 1])
                        assert np.array_equal(taken, np.flatnonzero(expected))
                        for a, b in zip(every, some, strict=True):
                            assert np.array_equal(a[taken], b, equal_nan=True), (shape, window, log)
