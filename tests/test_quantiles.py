"""The compiled trailing-window order statistics equal Polars' rolling functions, and the baseline
columns computed from them equal the Polars expressions they replaced, bit for bit."""

from __future__ import annotations

import numpy as np
import polars as pl
import pytest
from warninglight.forensics.judging.kernels import quantiles


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


def test_trailing_equals_polars_rolling_on_series_that_hold_still() -> None:
    # counts of non-finite values (zero but for a burst) and a stepped learning rate: a value
    # leaves as an equal one enters on most rows, and the kernel keeps the row before's statistics
    rng = np.random.default_rng(7)
    n = 1200
    counts = np.zeros(n)
    counts[500:520] = rng.integers(1, 4, size=20)
    lr = np.repeat([1e-3, 5e-4, 5e-4, 1e-4], n // 4)
    # zeros of both signs, and a few ones: the shortcut stays off for zeros once a -0.0 entered
    signs = np.where(rng.random(n) < 0.02, 1.0, np.where(rng.random(n) < 0.5, -0.0, 0.0))
    lengths = np.array([400, 3, 797])
    series = np.repeat(np.arange(3), lengths)
    starts = np.concatenate([[0], np.cumsum(lengths)])
    assert np.signbit(signs).any() and (~np.signbit(signs) & (signs == 0)).any()
    for values in (counts, lr, signs):
        valid = rng.random(n) > 0.02
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


def _polars_baseline(frame: pl.DataFrame, metric: str, starts: np.ndarray, window: int, lag: int,
                     min_samples: int) -> pl.DataFrame:
    """The baseline columns as Polars expressions over the kernel's order statistics: how the
    engine computed them before they moved into the compiled pass (the reference it is held to),
    except that a null value now has no z (a log metric's null used to score as log(1e-12))."""
    from warninglight.forensics.judging import baseline as b

    lr = "lr" in frame.columns
    scaled = lr and metric in b.LR_SCALED
    log = metric in b.LOG_METRICS
    lrf = pl.when(pl.col("lr").is_finite() & (pl.col("lr") > 0)).then(pl.col("lr")).otherwise(1.0)
    x = pl.col(metric).cast(pl.Float64)
    value = b.transform(metric, x) - (lrf.log() if scaled else 0.0)
    values = frame.select(pl.when(x.is_finite()).then(value)).to_series().fill_null(np.nan).to_numpy()
    q = quantiles.trailing(values, starts, window, lag, min_samples)
    q25, med, q75 = (pl.lit(pl.Series(v, dtype=pl.Float64, nan_to_null=True)) for v in q)
    iqr = q75 - q25
    if log:
        scale = pl.max_horizontal(iqr / b.IQR_TO_SIGMA, pl.lit(b.LOG_SCALE_FLOOR))
        med = med.exp() * lrf if scaled else med.exp()
    else:
        scale = pl.max_horizontal(iqr / b.IQR_TO_SIGMA, med.abs() * b.REL_FLOOR,
                                  pl.lit(b.ABS_FLOOR.get(metric, b.DEFAULT_ABS_FLOOR)))
    out = frame.with_columns(med.alias("med"), scale.alias("scale"))
    return out.select("med", "scale", pl.when(pl.col("med").is_not_null() & x.is_not_null()).then(
        (b.transform(metric, x) - b.transform(metric, pl.col("med"))) / pl.col("scale")).alias("z"))


@pytest.mark.parametrize("seed", range(4))
def test_baseline_columns_equal_the_polars_expressions_bit_for_bit(seed: int) -> None:
    from warninglight.forensics.judging import baseline as b
    from warninglight.forensics.judging.conditions import BaselineConfig

    rng = np.random.default_rng(100 + seed)
    lengths = rng.integers(1, 300, size=4)
    n = int(lengths.sum())
    odd = np.array([np.nan, np.inf, -np.inf, 0.0, -1.0, 1e-300, 1e30])
    def column(scale: float) -> pl.Series:  # positive noisy values with every kind of odd one
        v = np.exp(rng.normal(size=n)) * scale
        pick = rng.random(n) < 0.05
        v[pick] = rng.choice(odd, size=int(pick.sum()))
        return pl.Series(v).set(pl.Series(rng.random(n) < 0.05), None)  # type: ignore[arg-type]
    lr = np.where(rng.random(n) < 0.9, 1e-3 * np.exp(rng.normal(size=n)), rng.choice([np.nan, 0.0, -1.0], size=n))
    frame = pl.DataFrame({
        "rank": np.zeros(n, dtype=np.int64), "component": np.repeat([f"c{i}" for i in range(len(lengths))], lengths),
        "step": np.concatenate([np.arange(1, k + 1) for k in lengths]),
        "out_rms": column(1.0), "update_norm_l2": column(1e-3), "out_mean": column(0.1),
        "out_zero_frac": column(0.01), "lr": pl.Series(lr).set(pl.Series(rng.random(n) < 0.05), None),  # type: ignore[arg-type]
    })
    starts = np.concatenate([[0], np.cumsum(lengths)])
    window = int(rng.integers(8, 70))
    cfg = BaselineConfig(window=window, lag=int(rng.integers(0, 4)), min_samples=min(window, int(rng.integers(1, 40))))
    metrics = ["out_rms", "update_norm_l2", "out_mean", "out_zero_frac"]
    for with_lr, dtype in ((True, pl.Float64), (False, pl.Float64), (True, pl.Float32)):  # float32: as stored
        rows = (frame if with_lr else frame.drop("lr")).with_columns(pl.col(metrics).cast(dtype))
        got = b.with_baseline(rows.lazy(), cfg, metrics).collect()
        for m in metrics:
            want = _polars_baseline(rows, m, starts, cfg.window, cfg.lag, cfg.min_samples)
            for c in ("med", "scale", "z"):
                g, w = got[f"{m}__{c}"], want[c]
                assert g.is_null().to_list() == w.is_null().to_list(), (m, c, with_lr)
                assert np.array_equal(g.to_numpy(), w.to_numpy(), equal_nan=True), (m, c, with_lr)
        assert got.columns[-len(metrics) - 1:] == [*(f"{m}__z" for m in metrics), b.HEAT]
        # each row's heatmap cell: the worst finite |z| among the metrics with a baseline there
        cells = [pl.when(pl.col(f"{m}__z").is_finite() & pl.col(f"{m}__med").is_not_null())
                 .then(pl.col(f"{m}__z").abs()) for m in metrics]
        want_heat = got.select(pl.max_horizontal(cells)).to_series()
        assert got[b.HEAT].is_null().to_list() == want_heat.is_null().to_list()
        assert np.array_equal(got[b.HEAT].to_numpy(), want_heat.to_numpy(), equal_nan=True)


@pytest.mark.skipif(not hasattr(__import__("os"), "fork"), reason="needs fork")
def test_baseline_runs_in_a_forked_child_after_the_parent_used_its_workers() -> None:
    import multiprocessing

    from warninglight.forensics.judging import baseline as b

    rng = np.random.default_rng(3)
    columns = [quantiles.Column(rng.normal(size=400), None, False, False, 1e-8) for _ in range(4)]
    starts, kept = np.array([0, 150, 400]), np.arange(400)
    def run() -> list[np.ndarray]:
        return [z for _, _, z, _ in quantiles.baseline_many(columns, None, starts, kept, 16, 2, 8, b.SCALES)]
    parent = run()  # the parent's worker threads exist now; a forked child inherits none of them
    ctx = multiprocessing.get_context("fork")
    with ctx.Pool(1) as pool:
        child = pool.apply_async(_zs_in_child, (columns, starts, kept)).get(timeout=60)
    for a, c in zip(parent, child, strict=True):
        assert np.array_equal(a, c, equal_nan=True)


def _zs_in_child(columns: list[quantiles.Column], starts: np.ndarray, kept: np.ndarray) -> list[np.ndarray]:
    from warninglight.forensics.judging import baseline as b
    return [z for _, _, z, _ in quantiles.baseline_many(columns, None, starts, kept, 16, 2, 8, b.SCALES)]


def test_warm_compiles_every_kernel_the_classifier_runs() -> None:
    # a live monitor calls warm() before the first segment: after it, analysing real traces
    # (float32 and float64 metric columns, each given read-only: `Column.arrays`) must not
    # compile anything more. In a fresh process,
    # so that nothing this test session ran has compiled them already.
    import subprocess
    import sys
    from pathlib import Path

    samples = Path(__file__).resolve().parents[1] / "sample_traces"
    code = f"""
from warninglight.forensics.explaining import analysis
from warninglight.forensics.judging.kernels import quantiles
kernels = (quantiles._baseline, quantiles.fold_heat)
assert all(len(k.signatures) == 0 for k in kernels)
quantiles.warm()
warmed = [list(k.signatures) for k in kernels]
assert len(warmed[0]) == 2 and len(warmed[1]) == 1, warmed
for name in ("gpt_nan", "cnn_dying_layer"):
    analysis.analyze({str(samples)!r} + "/" + name)
assert [list(k.signatures) for k in kernels] == warmed, [list(k.signatures) for k in kernels]
"""
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]


def _random_series(rng: np.random.Generator, longest: int, most: int) -> tuple[np.ndarray, int]:
    """(starts, rows) of 1 to `most` - 1 series of 1 to `longest` - 1 rows each."""
    starts = np.concatenate([[0], np.cumsum(rng.integers(1, longest, size=rng.integers(1, most)))]).astype(np.int64)
    return starts, int(starts[-1])


def _fmax_per_series(values: np.ndarray, starts: np.ndarray, before: np.ndarray | None) -> np.ndarray:
    """Each series' running numpy fmax of `values`, with `before` at its first row (the reference)."""
    out = values.copy()
    for a, b in zip(starts[:-1], starts[1:], strict=True):
        np.fmax.accumulate(out[a:b], out=out[a:b])
        if before is not None:
            np.fmax(out[a:b], before[a], out=out[a:b])
    return out


def test_running_peak_equals_numpys_fmax_over_each_series() -> None:
    rng = np.random.default_rng(0)
    for _ in range(200):
        starts, n = _random_series(rng, 30, 6)
        values = np.where(rng.random(n) < 0.3, np.nan, rng.normal(size=n).round(1))
        before = np.where(rng.random(n) < 0.5, np.nan, rng.normal(size=n))
        want = _fmax_per_series(values, starts, before)
        got = values.copy()
        quantiles.running_peak(got, starts, before, starts[1:], got, True)
        assert np.array_equal(got, want, equal_nan=True)
        upto = np.array([rng.integers(a, b + 1) for a, b in zip(starts[:-1], starts[1:], strict=True)])
        peaks = np.empty(len(upto))
        quantiles.running_peak(values, starts, before, upto, peaks, False)
        assert np.array_equal(peaks, [np.fmax.reduce(values[a:k], initial=before[a]) for a, k in
                                      zip(starts[:-1], upto, strict=True)], equal_nan=True)


def _lr_surge_numpy(lr: pl.Series, starts: np.ndarray, before: np.ndarray | None) -> pl.Series:
    """`baseline.lr_surge` as numpy passes (what `quantiles.lr_rise` replaced)."""
    value = lr.cast(pl.Float64).fill_null(np.nan).to_numpy()
    missing = lr.is_null().to_numpy()
    prev, no_prev = np.roll(value, 1), np.roll(missing, 1)
    no_prev[starts[:-1]] = True
    peak = _fmax_per_series(np.where(no_prev, np.nan, prev), starts, before)
    above = ~missing & ~no_prev & ((value > peak) | (np.isnan(value) & ~np.isnan(peak)))
    with np.errstate(divide="ignore", invalid="ignore"):
        rise = np.where(above & ((prev > 0) | np.isnan(prev)), value / prev, 1.0)
    return pl.Series("lr_surge", rise).set(lr.is_null(), None)


def test_the_compiled_lr_surge_equals_its_numpy_passes() -> None:
    from warninglight.forensics.judging.baseline import lr_surge

    rng = np.random.default_rng(5)
    for _ in range(300):
        starts, n = _random_series(rng, 25, 5)
        lr = pl.Series(rng.choice([0.0, 1e-3, 2e-3, 1e-4, 5e-2, np.nan, -1e-3, np.inf], size=n)).set(
            pl.Series(rng.random(n) < 0.15), None)
        before = (np.where(rng.random(n) < 0.5, np.nan, rng.choice([1e-3, 5e-3, np.nan], size=n))
                  if rng.random() < 0.7 else None)
        got, want = lr_surge(lr, starts, before), _lr_surge_numpy(lr, starts, before)
        assert got.is_null().equals(want.is_null())
        assert np.array_equal(got.fill_null(-7.0).to_numpy(), want.fill_null(-7.0).to_numpy(), equal_nan=True)


@pytest.mark.parametrize("seed", range(3))
def test_a_column_read_through_an_order_equals_the_column_of_the_sorted_frame(seed: int) -> None:
    # Arrow buffers with nulls, NaN, several chunks and an offset (a sliced frame), float32,
    # float64 and integer counts: the one-pass gather gives what sorting the frame first gave
    from warninglight.forensics.judging import baseline as b

    rng = np.random.default_rng(seed)
    n = int(rng.integers(50, 3000))

    def part(k: int) -> pl.DataFrame:
        x = rng.normal(size=k)
        x[rng.random(k) < 0.05] = np.nan
        cols = {"out_rms": pl.Series(x.astype(np.float32)), "out_mean": pl.Series(x),
                "out_nonfinite_count": pl.Series(rng.integers(0, 3, size=k))}
        nulls = pl.Series(rng.random(k) < rng.choice([0.0, 0.1, 0.9]))
        return pl.DataFrame({m: c.set(nulls, None) for m, c in cols.items()})  # type: ignore[arg-type]
    frame = pl.concat([part(n // 3), part(n - n // 3)], rechunk=False)  # two chunks, as a window and its carry
    for sliced in (frame, frame.slice(7, n - 20), frame.rechunk().slice(5, n - 9)):  # the last read at an offset
        order = rng.permutation(sliced.height)
        for m in ("out_rms", "out_mean", "out_nonfinite_count"):
            got = b.column_of(sliced, m, True, order)
            want = b.column_of(sliced[order], m, True)
            assert got.raw.dtype == want.raw.dtype and np.array_equal(got.raw, want.raw, equal_nan=True), m
            assert (got.missing is None) == (want.missing is None), m
            if got.missing is not None:
                assert np.array_equal(got.missing, want.missing), m
            assert got[2:] == want[2:]


@pytest.mark.parametrize("seed", range(4))
def test_the_counting_order_of_series_is_the_stable_sort_of_their_keys(seed: int) -> None:
    # rows of each series keep the order they come in (a step window's, step after step), and
    # it says whether that orders each series' steps too
    rng = np.random.default_rng(seed)
    n = int(rng.integers(0, 3000))
    ranks, names = int(rng.integers(1, 4)), int(rng.integers(1, 40))
    rank, place = rng.integers(5, 5 + ranks, size=n), rng.integers(0, names, size=n)
    step = np.sort(rng.integers(100, 400, size=n)) if seed % 2 else rng.integers(100, 400, size=n)
    key, out = np.empty(n, dtype=np.int64), np.empty(n, dtype=np.int64)
    in_order = quantiles.counting_order(rank, step, place, 5, names, 100, 40, (ranks + 1) * names, key, out)
    series = (rank - 5) * names + place
    assert np.array_equal(key, (series << 40) + step - 100)
    assert np.array_equal(out, np.argsort(series, kind="stable"))
    assert in_order == bool((np.diff(key[out]) >= 0).all())
    assert in_order if seed % 2 else (n < 200 or not in_order)  # steps sorted: in order; shuffled: not
