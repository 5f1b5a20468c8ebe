"""The heatmap where a cell holds several steps (`forensics.heatbins`): each bin against the
baseline of its first judged row, the same fed in any chunks, and each row's own z at one step
a cell."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import polars as pl
import pytest
from binheat import assert_same_cells, bin_heat
from rules_oracle import score
from warninglight.forensics.explaining.analysis import classify_trace
from warninglight.forensics.judging.baseline import SCALES
from warninglight.forensics.judging.conditions import Config
from warninglight.forensics.judging.kernels import heatbins, quantiles
from warninglight.forensics.trace.schedule import with_lr
from warninglight.forensics.trace.store import health_frame, open_trace

SAMPLES = Path(__file__).resolve().parent.parent / "sample_traces"


@pytest.mark.parametrize("name", ["gpt_nan", "mlp_creeping_corruption"])
def test_a_cell_of_several_steps_is_its_bins_rows_against_the_first_ones_baseline(name: str) -> None:
    cfg = Config()
    trace = open_trace(SAMPLES / name)
    try:
        components = trace.frame("components").collect()
        whole = score(with_lr(health_frame(trace), trace).lazy(), cfg).collect()
        for width in (5, 50):
            want = bin_heat(whole, width)
            # the warm-up's bins have no baseline (null cells), the fault's are far out
            assert want["score"].null_count() > 0 and want["score"].max() > 12  # type: ignore[operator]
            for chunk in (7, 500):  # a bin of 50 steps spans up to eight windows of 7
                got = classify_trace(trace, cfg, components, heat_width=width, chunk_steps=chunk).heat()
                assert_same_cells(got, want)
    finally:
        trace.close()


def _series(rng: np.random.Generator, kind: str, n: int) -> np.ndarray:
    if kind in ("rising", "falling", "still"):  # windows in order, reversed, or all equal: no sort
        x = np.exp(np.linspace(-3, 2, n)) if kind != "still" else np.full(n, 0.25)
        x[rng.random(n) < 0.01] = np.nan
        return x if kind != "falling" else x[::-1].copy()
    if kind == "norm":  # a positive norm with zeros (log's floor), NaN, +inf and ties
        x = np.exp(rng.normal(0, 0.4, n))
        x[rng.random(n) < 0.05] = 0.0
        x[rng.random(n) < 0.01] = np.nan
        x[rng.random(n) < 0.01] = np.inf
        x[rng.random(n) < 0.1] = 1.5
        return x
    x = rng.normal(0, 1, n).round(1)  # signed, many ties, ±inf and NaN
    x[rng.random(n) < 0.01] = -np.inf
    x[rng.random(n) < 0.01] = np.nan
    return x


@pytest.mark.parametrize("window", [16, 64, 100])  # a window of more than 64 values is sorted otherwise
@pytest.mark.parametrize(("log", "scaled"), [(False, False), (False, True), (True, False), (True, True)])
def test_at_one_step_a_cell_each_row_has_its_own_z(window: int, log: bool, scaled: bool) -> None:
    rng = np.random.default_rng(window + 2 * log + scaled)
    noisy = "norm" if log else "signed"
    kinds, lengths = [noisy, noisy, "rising", noisy, "falling", "still", noisy], [260, 3, 150, 120, 150, 100, 400]
    starts = np.r_[0, np.cumsum(lengths)].astype(np.int64)
    n = int(starts[-1])
    raw = np.concatenate([_series(rng, kind, k) for kind, k in zip(kinds, lengths, strict=True)])
    raw = raw.astype(np.float32) if window == 64 else raw  # float32 columns go as they are stored
    missing = rng.random(n) < 0.01
    raw[missing] = np.nan  # a null reaches the kernels as NaN, marked
    lr = np.exp(rng.normal(-7, 1, n))
    lr[rng.random(n) < 0.05] = np.nan  # no lr, or 0: judged as if 1
    lr[rng.random(n) < 0.05] = 0.0
    step = np.concatenate([np.arange(1, k + 1) for k in lengths]).astype(np.int64)
    col = quantiles.Column(raw, missing, log, scaled, 1e-3)
    for min_samples in (1, window // 4):
        rows = np.full(n, np.nan)
        quantiles.fold_baseline(col, lr, starts, quantiles.slots(n, np.arange(n)), window, 3, min_samples, SCALES,
                                rows)
        where = heatbins.bins(step, np.ones(n, dtype=np.bool_), starts, 1)
        cells = np.full(int(where.cell_start[-1]), np.nan)
        series = len(lengths)
        heatbins.fold(col, lr, starts, where, np.full(series, heatbins.NONE), np.full((series, 3), np.nan), window,
                      3, min_samples, SCALES, cells)
        assert where.seen.all() and len(cells) == n
        assert np.isnan(rows).sum() > 0 and np.isfinite(rows).sum() > n // 2
        # the same z; an lr-relative metric's statistics only to rounding (sorted by value / lr)
        assert np.allclose(cells, rows, rtol=1e-9 if scaled else 1e-13, atol=0, equal_nan=True)


def test_the_statistics_of_a_bin_left_open_go_to_the_next_window() -> None:
    opened = heatbins.Open()
    keys = [(0, "a"), (0, "b"), (1, "a")]
    opened.update(keys, np.array([4, heatbins.NONE, 7]), {"m": np.arange(9.0).reshape(3, 3)})
    at, bins = opened.places([(1, "a"), (0, "b"), (0, "c"), (0, "a")])
    assert bins.tolist() == [7, heatbins.NONE, heatbins.NONE, 4]
    stats = opened.stats(at, "m")
    assert stats[0].tolist() == [6.0, 7.0, 8.0] and stats[3].tolist() == [0.0, 1.0, 2.0]
    assert np.isnan(stats[1:3]).all() and np.isnan(opened.stats(at, "other")).all()
    # a later window: a series seen again moves on, a metric it lacks carries nothing, the rest stay
    opened.update([(0, "a"), (0, "c")], np.array([5, 2]), {})
    at, bins = opened.places([(0, "a"), (0, "c"), (1, "a")])
    assert bins.tolist() == [5, 2, 7]
    assert np.isnan(opened.stats(at, "m")[:2]).all() and opened.stats(at, "m")[2].tolist() == [6.0, 7.0, 8.0]


def test_the_cells_are_the_bins_that_hold_a_judged_row() -> None:
    starts = np.array([0, 6, 6, 9])  # the middle series has no rows
    step = np.array([1, 2, 3, 11, 12, 40, 5, 6, 7])
    judged = np.array([False, True, True, True, False, True, False, False, False])
    where = heatbins.bins(step, judged, starts, 5)
    assert where.first_bin.tolist() == [0, heatbins.NONE, heatbins.NONE]
    assert where.cell_start.tolist() == [0, 8, 8, 8]  # bins 0..7 of the first series
    assert np.flatnonzero(where.seen).tolist() == [0, 2, 7] and where.last_bin.tolist() == [7, heatbins.NONE,
                                                                                              heatbins.NONE]
    # each cell's rows from the series' first judged row on, and whether all of them are judged
    held = [(int(where.row0[c]), int(where.row1[c]), bool(where.plain[c])) for c in (0, 2, 7)]
    assert held == [(1, 3, True), (3, 5, False), (5, 6, True)]
    assert (where.row0[[1, 3, 4, 5, 6]] == where.row1[[1, 3, 4, 5, 6]]).all()  # bins with no row
    cells = np.array([1.0, np.nan, 2.0, np.nan, np.nan, np.nan, np.nan, np.nan])
    frame = heatbins.frame(pl.Series(["a", "b", "c"]), where, cells)
    assert frame.rows() == [("a", 1, 1.0), ("a", 11, 2.0), ("a", 36, None)]
    # rows after a series' last judged one, in later bins, have no cell: none is laid out for them
    tail = heatbins.bins(np.array([1, 2, 9, 14]), np.array([True, True, False, False]), np.array([0, 4]), 5)
    assert tail.cell_start.tolist() == [0, 1] and (tail.row0[0], tail.row1[0], tail.plain[0]) == (0, 2, True)


def test_a_series_with_no_value_in_a_window_is_judged_against_a_baseline_carried_into_it() -> None:
    # a log metric gone NaN (floored to its log's tiny: far below any baseline) in every row of
    # a window: without a baseline carried in it has no z; with its open bin's baseline, a huge one
    n, width = 10, 20
    col = quantiles.Column(np.full(n, np.nan), None, True, False, 1e-3)
    step = np.arange(41, 41 + n, dtype=np.int64)  # bin 2 (steps 41..60), opened in an earlier window
    starts = np.array([0, n], dtype=np.int64)
    where = heatbins.bins(step, np.ones(n, dtype=np.bool_), starts, width)
    carried = np.log([[0.9, 1.0, 1.1]])
    for carry_bin, carry_q, expect in ((heatbins.NONE, np.full((1, 3), np.nan), False), (2, carried, True),
                                       (1, carried, False)):  # baseline of another bin: not this one's
        cells = np.full(int(where.cell_start[-1]), np.nan)
        open_q = heatbins.fold(col, None, starts, where, np.array([carry_bin]), carry_q, 64, 1, 16, SCALES, cells)
        assert len(cells) == 1 and (cells[0] > 100 if expect else np.isnan(cells[0]))
        assert np.array_equal(open_q, carry_q if expect else np.full((1, 3), np.nan), equal_nan=True)
