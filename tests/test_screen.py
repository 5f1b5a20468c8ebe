"""The rows a metric's rules are tested at (`screen.candidates`): every row where a rule's tests
other than z hold under the exact median is one, whatever the bounds and the blocks passed over."""

from __future__ import annotations

import numpy as np
import pytest
from test_bounds import SCALES, _series  # the series the bounds are held on
from warninglight.forensics.judging.conditions import Condition, Rule
from warninglight.forensics.judging.kernels import bounds, quantiles, screen
from warninglight.forensics.judging.kernels import rules as rt


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
                table = rt.table([(cond, r) for r in rules], [])
                work = bounds.Workspace(n, len(starts) - 1)
                want = np.empty(len(kept), dtype=np.bool_)
                screen.candidates(x, missing, lr, starts, kept, window, lag, min_samples, log, scaled, SCALES.tiny,
                                  table, np.ones((1, len(kept)), dtype=np.bool_), want, work.blocks, work.count,
                                  work.finite, work.base, work.plain, work.quiet)
                for rule in rules:
                    may = _exact_may_fire(v, missing[kept], med, rule)
                    assert not (may & ~want).any(), (shape, window, log, scaled, rule)


@pytest.mark.parametrize("seed", range(3))
def test_rows_at_a_fold_of_their_median_relative_to_the_lr_are_candidates(seed: int) -> None:
    # an update judged relative to the lr: steady per unit lr, with rows moved to within 0.1% of
    # a rule's fold of the median either way, among stretches passed over a block at a time
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
    table = rt.table([(cond, r) for r in rules], [])
    kept = np.arange(n)
    col = quantiles.Column(x, None, True, True, 1e-8)
    med = quantiles.baseline(col, lr, starts, kept, 64, 3, 64, SCALES)[0]
    work = bounds.Workspace(n, len(starts) - 1)
    want = np.empty(n, dtype=np.bool_)
    screen.candidates(x, np.zeros(n, dtype=np.bool_), lr, starts, kept, 64, 3, 64, True, True, SCALES.tiny, table,
                      np.ones((1, n), dtype=np.bool_), want, work.blocks, work.count, work.finite, work.base,
                      work.plain, work.quiet)
    assert work.quiet[:n].mean() > 0.3  # most rows passed over a block at a time
    fired = np.zeros(n, dtype=np.bool_)
    for rule in rules:
        fired |= _exact_may_fire(x, np.zeros(n, dtype=np.bool_), med, rule)
    assert fired.sum() > 20
    assert not (fired & ~want).any()
