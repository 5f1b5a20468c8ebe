"""The trailing robust baseline: each component against its own past, causal, robust to outliers."""

from __future__ import annotations

import math

import numpy as np
import polars as pl
import pytest
from warninglight.forensics.judging import baseline
from warninglight.forensics.judging.baseline import band, with_baseline
from warninglight.forensics.judging.conditions import BaselineConfig

CFG = BaselineConfig(window=20, lag=2, min_samples=10)


def frame(values_a: list[float], values_b: list[float]) -> pl.DataFrame:
    n = len(values_a)
    return pl.DataFrame({
        "rank": [0] * 2 * n, "component": ["a"] * n + ["b"] * n,
        "step": list(range(1, n + 1)) * 2,
        "out_mean": values_a + values_b, "grad_norm_l2": [1.0] * n + [100.0] * n,
    })


def scored(df: pl.DataFrame) -> pl.DataFrame:
    return with_baseline(df.lazy(), CFG, ["out_mean", "grad_norm_l2"]).collect().sort("component", "step")


def test_baseline_is_causal_and_lagged() -> None:
    a = [float(i % 3) for i in range(60)]
    base = scored(frame(a, a))
    changed = a[:40] + [1e6] * 20                      # the future changes...
    after = scored(frame(changed, a))
    cols = ["out_mean__med", "out_mean__scale"]
    past = pl.col("step") <= 42                        # ...the baseline up to step 40 + lag does not
    assert base.filter(past).select(cols).equals(after.filter(past).select(cols))
    later = (pl.col("step") == 55) & (pl.col("component") == "a")  # most of its window changed
    assert after.filter(later)["out_mean__med"][0] == 1e6 != base.filter(later)["out_mean__med"][0]
    assert base.filter(pl.col("step") < CFG.min_samples + CFG.lag)["out_mean__med"].is_null().all()


def test_each_component_has_its_own_baseline() -> None:
    s = scored(frame([0.0] * 50, [0.0] * 50))
    med = dict(s.filter(pl.col("step") == 50).select("component", "grad_norm_l2__med").iter_rows())
    assert med == {"a": pytest.approx(1.0), "b": pytest.approx(100.0)}


def test_one_outlier_does_not_move_the_baseline() -> None:
    a = [1.0 + 0.1 * (i % 5) for i in range(50)]
    spiked = list(a)
    spiked[30] = 1000.0
    s0, s1 = scored(frame(a, a)), scored(frame(spiked, a))
    row = (pl.col("component") == "a") & (pl.col("step") == 40)
    assert s1.filter(row)["out_mean__med"][0] == pytest.approx(s0.filter(row)["out_mean__med"][0])
    assert s1.filter(row)["out_mean__scale"][0] == pytest.approx(s0.filter(row)["out_mean__scale"][0], rel=0.35)
    assert s1.filter((pl.col("component") == "a") & (pl.col("step") == 31))["out_mean__z"][0] > 1000


def test_norms_are_judged_in_log_units_and_band_brackets_the_median() -> None:
    s = scored(frame([0.0] * 50, [0.0] * 50)).filter(pl.col("component") == "b")
    row = s.filter(pl.col("step") == 45)
    assert row["grad_norm_l2__scale"][0] == pytest.approx(0.02)   # a constant norm: the log floor
    b = band(s, "grad_norm_l2", width_z=3.0).filter(pl.col("step") == 45)
    assert b["lower"][0] == pytest.approx(100 * math.exp(-0.06))
    assert b["upper"][0] == pytest.approx(100 * math.exp(0.06))


def test_a_held_band_stays_as_it_stood_at_its_first_step() -> None:
    # a jump at step 30 that lasts: the trailing band climbs to it, the held one does not
    s = scored(frame([1.0 + 0.01 * (i % 3) for i in range(30)] + [50.0] * 30, [0.0] * 60)).filter(
        pl.col("component") == "a").filter(pl.col("step") != 30)  # the onset's own row not recorded
    trailing, held = band(s, "out_mean"), band(s, "out_mean", hold=(30, 45))
    before = trailing.filter(step=29)
    inside = held.filter(pl.col("step").is_between(30, 45))
    assert len(inside) == 15 and inside["held"].all() and not held.filter(step=46)["held"].item()
    for column in ("median", "lower", "upper"):
        assert (inside[column] == before[column].item()).all(), column
    assert trailing.filter(step=45)["median"].item() == pytest.approx(50.0)  # taken in
    assert held.filter(step=46).equals(trailing.filter(step=46))  # trailing again after it


@pytest.mark.parametrize(("step_span", "ranks", "dtype", "given", "shuffled"), [
    (1_000, [0, 3, 17], pl.String, None, True),
    (1 << 41, [0, 3, 17], pl.String, None, True),  # too wide for the one integer key: the plain sort
    (1_000, [0, 3, 17], pl.Categorical, "all", True),
    (1_000, [0, 3, 17], pl.Categorical, "all", False),  # step after step, as recorded: counted in place
    (1_000, [0, 3, 17], pl.String, "all", False),
    (1_000, [0, 3, 17], pl.Categorical, "one less", False),  # a name outside those given: its own
    (1_000, [0, 1 << 21, 1 << 40], pl.Categorical, "all", False),  # ranks far apart: by their places
])
def test_sort_series_orders_rows_as_the_sort_on_names_does(step_span: int, ranks: list[int], dtype: pl.DataType,
                                                           given: str | None, shuffled: bool) -> None:
    # names that share prefixes, differ in case or are not ASCII; ranks with gaps; names as
    # strings or Categorical, given (the trace's) or not
    rng = np.random.default_rng(3)
    names = ["a", "a.b", "a.b.c", "B", "h.10.mlp", "h.2.mlp", "é", "z"]
    steps = np.unique(rng.integers(1, step_span, size=200))
    frame = (pl.DataFrame({"rank": ranks}).join(pl.DataFrame({"component": names[::-1]}), how="cross")
             .join(pl.DataFrame({"step": steps}), how="cross").sample(fraction=0.7, shuffle=True, seed=1))
    frame = frame.with_columns(pl.Series("x", rng.normal(size=frame.height)), pl.col("component").cast(dtype))
    if not shuffled:
        frame = frame.sort("step", maintain_order=True)
    known = None if given is None else pl.Series(sorted(names)[: len(names) - (given == "one less")])
    ordered = baseline.sort_series(frame, known)
    assert ordered.drop(baseline.SERIES_KEY, strict=False).equals(
        frame.sort(["rank", pl.col("component").cast(pl.String), "step"]))
    # the series it finds from the key are those the names give
    assert np.array_equal(baseline.series_starts(ordered),
                          baseline.series_starts(ordered.drop(baseline.SERIES_KEY, strict=False)))
    assert baseline.sort_series(frame.head(0)).is_empty()
    assert list(baseline.series_starts(ordered.head(0))) == [0]  # no series, as without the key


def test_a_step_without_a_value_is_no_departure() -> None:
    # a parameter that gets a gradient every other step (an expert not routed to, a branch not
    # taken): the steps without one have no gradient norm, so no z and no heatmap cell, while a
    # NaN norm is still scored as far off its baseline
    n = 80
    norms: list[float | None] = [1.0 + 0.01 * (i % 7) if i % 2 == 0 else None for i in range(n)]
    norms[70] = math.nan
    df = pl.DataFrame({"rank": [0] * n, "component": ["expert"] * n, "step": list(range(1, n + 1)),
                       "grad_norm_l2": norms}, schema_overrides={"grad_norm_l2": pl.Float64})
    s = with_baseline(df.lazy(), CFG, ["grad_norm_l2"]).collect().sort("step")
    judged = s.filter(pl.col("grad_norm_l2__med").is_not_null())
    assert judged.height > 30
    absent = judged.filter(pl.col("grad_norm_l2").is_null())
    assert absent["grad_norm_l2__z"].is_null().all() and absent[baseline.HEAT].is_null().all()
    present = judged.filter(pl.col("grad_norm_l2").is_not_null() & (pl.col("step") != 71))
    assert present[baseline.HEAT].max() < 3  # type: ignore[operator]
    assert judged.filter(pl.col("step") == 71)["grad_norm_l2__z"][0] < -100


def test_the_history_cut_keeps_the_rows_from_the_earliest_step_a_judged_row_reads() -> None:
    # each series' first judged row and the `lead` rows before it (persistence): the rows from the
    # earliest such step on, in every series; None where that is all of them
    from warninglight.forensics.judging.baseline import history_cut

    rng = np.random.default_rng(0)
    cut = 0
    for _ in range(400):
        lengths = rng.integers(0, 30, size=rng.integers(1, 8))
        n = int(lengths.sum())
        if n == 0:
            continue
        starts = np.concatenate([[0], np.cumsum(lengths)])
        step = np.concatenate([np.arange(k) + rng.integers(0, 5) for k in lengths])
        marked = rng.random(n) < rng.choice([0.0, 0.1, 0.9])
        lead = int(rng.integers(0, 4))
        got = history_cut(pl.DataFrame({"step": step, "j": marked}), starts, "j", lead)
        if not marked.any():
            assert got is None
            continue
        series = np.repeat(np.arange(len(starts) - 1), np.diff(starts))
        need = [max(starts[g], int(np.flatnonzero(marked & (series == g))[0]) - lead)
                for g in range(len(starts) - 1) if (marked & (series == g)).any()]
        keep = step >= step[need].min()
        assert (got is None) == keep.all()
        if got is not None:
            assert np.array_equal(got, keep)
            cut += 1
    assert cut > 50
