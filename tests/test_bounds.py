"""The cheap bounds of a trailing median hold the exact median on every row, and the baseline
taken only at some rows equals the one taken at every row there: what lets `judge` skip the
rows where no rule can fire without changing a hit."""

from __future__ import annotations

import itertools

import numpy as np
import pytest
from warninglight.forensics import bounds, quantiles

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


def _exact_may_fire(v: np.ndarray, missing: np.ndarray, med: np.ndarray, rule) -> np.ndarray:  # noqa: ANN001
    """Where the rule's tests other than z hold, its median known exactly (`judge._hits`' arithmetic)."""
    ok = np.isfinite(v) & ~missing & ~np.isnan(med)
    with np.errstate(all="ignore"):
        up, down = np.full(len(v), rule.direction in ("up", "either")), np.full(len(v), rule.direction in ("down", "either"))
        if rule.fold is not None:
            up &= (med > 0) & (v >= med * rule.fold)
            down &= (med > 0) & (med * (1.0 / rule.fold) >= v)
        if rule.delta is not None:
            up &= v - med >= rule.delta
            down &= med - v >= rule.delta
        if rule.level is not None:
            up &= v >= rule.level
            down &= rule.level >= v
    return ok & (up | down)


@pytest.mark.parametrize("seed", range(3))
@pytest.mark.parametrize("shape", ["noise", "up", "signed", "spiky", "ties", "tight"])
def test_every_row_a_rule_can_fire_at_is_a_candidate(seed: int, shape: str) -> None:
    # thresholds just past the data's own spread, so that many rows sit near them: a bound a rank
    # too tight, or a threshold from the wrong bound, leaves out a row where a rule holds
    from warninglight.forensics import judge
    from warninglight.forensics.conditions import Condition, Rule

    rng = np.random.default_rng(50 + seed)
    lengths = rng.integers(50, 600, size=4)
    n = int(lengths.sum())
    starts = np.concatenate([[0], np.cumsum(lengths)])
    lr = 1e-3 * np.exp(rng.normal(scale=0.3, size=n))
    missing = rng.random(n) < 0.02
    x = np.where(missing, np.nan, _series(rng, shape, n))  # a null is NaN in a column's values
    for window, lag, min_samples in ((64, 3, 64), (40, 3, 20), (16, 1, 16)):
        kept = np.arange(int(rng.integers(0, n // 4)), n)
        for log, scaled in ((False, False), (True, False), (True, True)):
            col = quantiles.Column(x, missing, log, scaled, 1e-8)
            med = quantiles.baseline(col, lr, starts, kept, window, lag, min_samples, SCALES)[0]
            v = x[kept]
            spread = float(np.nanstd(v[np.isfinite(v)])) or 1.0
            middle = float(np.nanmedian(v[np.isfinite(v)]))
            mixed = [[Rule("m", "up", fold=fold), Rule("m", "down", fold=fold), Rule("m", "either", delta=0.3 * spread),
                      Rule("m", "down", level=middle, delta=0.1 * spread), Rule("m", "up", z=3.0, fold=fold, delta=0.05 * spread)]
                     for fold in (1.02, 1.3)]
            # folds alone: a metric judged relative to the lr is then passed over a block at a time too
            folds = [[Rule("m", "up", fold=fold), Rule("m", "down", fold=fold * 1.1), Rule("m", "either", z=2.0, fold=fold)]
                     for fold in (1.02, 1.3, 2.0)]
            for rules in mixed + folds:
                cond = Condition("c", "", "", tuple(rules), persistence=1, ceiling=0.1, precedence=1)
                table = judge._table([(cond, r) for r in rules], [])
                work = bounds.Workspace(n, len(starts) - 1)
                want = np.empty(len(kept), dtype=np.bool_)
                judge._candidates(x, missing, lr, starts, kept, window, lag, min_samples, log, scaled, SCALES.tiny,
                                  table, np.ones((1, len(kept)), dtype=np.bool_), want, work.blocks, work.count,
                                  work.finite, work.base, work.plain, work.quiet)
                for rule in rules:
                    may = _exact_may_fire(v, missing[kept], med, rule)
                    assert not (may & ~want).any(), (shape, window, log, scaled, rule)


@pytest.mark.parametrize("seed", range(3))
def test_rows_at_a_fold_of_their_median_relative_to_the_lr_are_candidates(seed: int) -> None:
    # an update judged relative to the lr: steady per unit lr, with rows moved to within 0.1% of
    # a rule's fold of the median either way, among stretches passed over a block at a time
    from warninglight.forensics import judge
    from warninglight.forensics.conditions import Condition, Rule

    rng = np.random.default_rng(seed)
    n = 6000
    starts = np.array([0, 2500, 6000])
    lr = 1e-3 * np.exp(np.cumsum(rng.normal(scale=0.01, size=n)))  # a schedule that moves every step
    fold = 2.0
    per_lr = np.exp(rng.normal(scale=0.01, size=n))
    near = rng.random(n) < 0.02
    per_lr[near] *= rng.choice([fold, 1 / (fold * 1.1)], size=int(near.sum())) * (1 + rng.uniform(-1e-3, 1e-3, size=int(near.sum())))
    x = per_lr * lr
    rules = [Rule("m", "up", fold=fold), Rule("m", "down", fold=fold * 1.1), Rule("m", "either", z=3.0, fold=fold)]
    cond = Condition("c", "", "", tuple(rules), persistence=1, ceiling=0.1, precedence=1)
    table = judge._table([(cond, r) for r in rules], [])
    kept = np.arange(n)
    col = quantiles.Column(x, None, True, True, 1e-8)
    med = quantiles.baseline(col, lr, starts, kept, 64, 3, 64, SCALES)[0]
    work = bounds.Workspace(n, len(starts) - 1)
    want = np.empty(n, dtype=np.bool_)
    judge._candidates(x, np.zeros(n, dtype=np.bool_), lr, starts, kept, 64, 3, 64, True, True, SCALES.tiny, table,
                      np.ones((1, n), dtype=np.bool_), want, work.blocks, work.count, work.finite, work.base,
                      work.plain, work.quiet)
    assert work.quiet[:n].mean() > 0.3  # most rows passed over a block at a time
    fired = np.zeros(n, dtype=np.bool_)
    for rule in rules:
        fired |= _exact_may_fire(x, np.zeros(n, dtype=np.bool_), med, rule)
    assert fired.sum() > 20
    assert not (fired & ~want).any()
