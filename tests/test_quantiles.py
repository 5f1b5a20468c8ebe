"""The compiled trailing-window order statistics equal Polars' rolling functions, bit for bit."""

from __future__ import annotations

import numpy as np
import polars as pl
import pytest
from warninglight.forensics import quantiles


def _polars(values: np.ndarray, valid: np.ndarray, series: np.ndarray, window: int, lag: int,
            min_samples: int) -> np.ndarray:
    frame = pl.DataFrame({"g": series, "x": values}).with_columns(
        pl.when(pl.Series(valid)).then(pl.col("x")).alias("x"))
    past = pl.col("x").shift(lag)
    roll = {"window_size": window, "min_samples": min_samples}
    return frame.select(past.rolling_quantile(0.25, **roll).over("g"), past.rolling_median(**roll).over("g").alias("m"),
                        past.rolling_quantile(0.75, **roll).over("g").alias("u")).to_numpy().T


@pytest.mark.parametrize("seed", range(6))
def test_trailing_equals_polars_rolling_with_ties_gaps_and_short_series(seed: int) -> None:
    rng = np.random.default_rng(seed)
    for _ in range(40):
        lengths = rng.integers(0, 160, size=rng.integers(1, 6))
        window = int(rng.integers(1, 70))
        min_samples, lag = int(rng.integers(1, window + 1)), int(rng.integers(0, 5))
        n = int(lengths.sum())
        values = rng.normal(size=n).round(int(rng.integers(0, 3)))  # rounding makes ties
        valid = rng.random(n) > rng.choice([0.0, 0.1, 0.5, 0.95])  # gaps: missing or non-finite values
        series = np.repeat(np.arange(len(lengths)), lengths)
        starts = np.concatenate([[0], np.cumsum(lengths)])
        got = quantiles.trailing(np.where(valid, values, np.nan), starts, window, lag, min_samples)
        want = _polars(values, valid, series, window, lag, min_samples)
        assert np.array_equal(got, want, equal_nan=True), (window, lag, min_samples)


@pytest.mark.parametrize("shape", ["up", "down", "steps", "zigzag"])
def test_trailing_equals_polars_rolling_on_trending_series(shape: str) -> None:
    # values that enter at one end of the sorted window and leave from the other (norms over
    # training), with ties, gaps and lags: the kernel moves values from either side
    rng = np.random.default_rng(len(shape))
    n = 900
    base = {"up": np.arange(n, dtype=float), "down": -np.arange(n, dtype=float),
            "steps": np.repeat(np.arange(n // 30, dtype=float), 30),
            "zigzag": np.abs((np.arange(n) % 200) - 100).astype(float)}[shape]
    values = base + rng.normal(scale=0.3, size=n).round(1)
    valid = rng.random(n) > 0.05
    lengths = np.array([300, 5, 595])
    series = np.repeat(np.arange(3), lengths)
    starts = np.concatenate([[0], np.cumsum(lengths)])
    for window, lag, min_samples in ((64, 3, 64), (7, 0, 1), (33, 2, 10)):
        got = quantiles.trailing(np.where(valid, values, np.nan), starts, window, lag, min_samples)
        want = _polars(values, valid, series, window, lag, min_samples)
        assert np.array_equal(got, want, equal_nan=True), (window, lag, min_samples)


def test_trailing_many_spreads_columns_and_keeps_their_order() -> None:
    rng = np.random.default_rng(7)
    columns = [rng.normal(size=500) * (k + 1) for k in range(5)]
    starts = np.array([0, 200, 500])
    many = quantiles.trailing_many(columns, starts, window=16, lag=2, min_samples=8)
    for column, got in zip(columns, many, strict=True):
        assert np.array_equal(got, quantiles.trailing(column, starts, 16, 2, 8), equal_nan=True)
    assert np.isnan(many[0][:, :2 + 8 - 1]).all() and not np.isnan(many[0][:, 2 + 8 - 1]).any()
