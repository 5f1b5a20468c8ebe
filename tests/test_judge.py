"""The compiled rules (`judge`) are the Polars classifier: the same hits, alarms and heatmap, row
for row, on frames made to make every rule fire and to hit every edge of Polars' arithmetic."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import polars as pl
import pytest
from binheat import assert_same_cells, bin_heat
from rules_oracle import classify, heat_of, hits, score
from warninglight.forensics.judging.baseline import sort_series
from warninglight.forensics.judging.classifier import Classifier
from warninglight.forensics.judging.conditions import NONFINITE, Config
from warninglight.forensics.judging.hits import lead
from warninglight.forensics.judging.judge import judge
from warninglight.tracer import schema

ROLES = ["param", "activation", "head", None, "param", "activation", "head"]
JUDGED = "__judged"


def _frame(seed: int, steps: int = 150, ranks: int = 2) -> pl.DataFrame:
    """Health rows of `len(ROLES)` components on `ranks` ranks: noisy metrics with jumps,
    collapses, NaN, ±inf, nulls, zeros of both signs and negative values; float32 columns as the
    recorder stores them, counts as integers with nulls, and an lr that one component lacks (NaN)."""
    rng = np.random.default_rng(seed)
    n_comp = len(ROLES)
    n = ranks * n_comp * steps
    rank = np.repeat(np.arange(ranks), n_comp * steps)
    comp = np.tile(np.repeat(np.arange(n_comp), steps), ranks)
    step = np.tile(np.arange(1, steps + 1), ranks * n_comp)
    cols: dict[str, pl.Series] = {}
    for m in schema.HEALTH_METRICS:
        level = np.exp(rng.normal(0, 2))
        x = level * np.exp(rng.normal(0, rng.choice([0.01, 0.1, 0.5]), size=n))
        if m in ("out_mean", "update_cos"):
            x = x - level * rng.uniform(0.5, 1.5)  # negative values too
        if m.endswith("_frac") or m in ("pred_maxprob",):
            x = rng.uniform(0, 0.2, size=n) + (step > 120) * (comp == 1) * 0.6  # a jump to judge
        if m == "update_cos":  # component 2 flips back and forth late in the run
            x = np.where((comp == 2) & (step > 110), -0.8, rng.uniform(-0.3, 0.9, size=n))
        jumps = rng.random(n) < 0.02
        x = np.where(jumps, x * rng.choice([1e-3, 1e3, 30.0, 0.05], size=n), x)
        x = np.where(rng.random(n) < 0.01, rng.choice([np.nan, np.inf, -np.inf, 0.0, -0.0], size=n), x)
        if m in schema.COUNT_METRICS:
            counts = (rng.random(n) < 0.02) * rng.integers(1, 5, size=n)
            cols[m] = pl.Series(m, counts, dtype=pl.Int64).set(pl.Series(rng.random(n) < 0.03), None)
            continue
        if m == "update_norm_l2":  # component 4 stops learning while the others go on
            x = np.where((comp == 4) & (step > 100), x * 1e-3, x)
        if m == "grad_norm_l2":  # component 5's gradient vanishes
            x = np.where((comp == 5) & (step > 115), x * 1e-3, x)
        cols[m] = pl.Series(m, x.astype(np.float32)).set(pl.Series(rng.random(n) < 0.04), None)
    lr = np.where(comp == 3, np.nan, 1e-3 * np.where(step > 90, 0.1, 1.0) * np.where(step == 130, 50.0, 1.0))
    frame = pl.DataFrame({"rank": rank, "component": [f"c{c}" for c in comp], "step": step,
                          "role": pl.Series([ROLES[c] for c in comp], dtype=pl.String), **cols, "lr": lr})
    return frame.sample(fraction=1.0, shuffle=True, seed=seed)  # rows come in any order


def _eager(config: Config, factor: float, persistence: int | None) -> Config:
    """`config` with every threshold multiplied by `factor` (fold: its excess over 1), so that
    every rule fires on the frames above; `persistence` for every condition when given."""
    def rule(r):  # noqa: ANN001, ANN202
        if r.direction == NONFINITE:
            return r
        return replace(r, z=None if r.z is None else r.z * factor,
                       fold=None if r.fold is None else 1 + (r.fold - 1) * factor,
                       delta=None if r.delta is None else r.delta * factor,
                       peers_fold=None if r.peers_fold is None else r.peers_fold * factor)
    conditions = tuple(replace(c, rules=tuple(rule(r) for r in c.rules),
                               persistence=persistence or c.persistence) for c in config.conditions)
    return Config(baseline=replace(config.baseline, window=16, min_samples=8, lag=2), conditions=conditions)


def _polars(window: pl.DataFrame, config: Config, width: int) -> tuple[pl.DataFrame, pl.DataFrame]:
    scored = score(window.lazy(), config, judged=JUDGED).collect().lazy().filter(pl.col(JUDGED))
    return hits(scored, config), heat_of(scored, width)


@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize(("factor", "persistence"), [(1.0, None), (0.3, 1), (0.15, 3)])
def test_judge_gives_the_polars_classifiers_hits_and_heat(seed: int, factor: float, persistence: int | None) -> None:
    config = _eager(Config(), factor, persistence)
    window = sort_series(_frame(seed)).with_columns((pl.col("step") > 40).alias(JUDGED))
    for width in (1, 7):
        want_hits, want_heat = _polars(window, config, width)
        got_hits, got_heat = judge(window, config, JUDGED, lead(config), width)
        assert got_hits.equals(want_hits)
        assert got_heat is not None
        if width == 1:  # each row's own worst |z|, cell for cell
            assert got_heat.sort("component", "step").equals(want_heat.sort("component", "step"))
        else:  # each bin against its first row's baseline (`heatbins`), from the Polars baselines
            assert_same_cells(got_heat, bin_heat(score(window.lazy(), config, judged=JUDGED).collect(), width, JUDGED))
    # without a heatmap the metrics no rule compares with a baseline get none: the same hits
    plain_hits, no_heat = judge(window, config, JUDGED, lead(config))
    assert no_heat is None and plain_hits.equals(want_hits)
    if factor < 1:  # the frames make every condition fire, the peers' rule included
        fired = set(want_hits.select("condition", "metric").unique().iter_rows())
        assert {c.name for c in config.conditions} <= {condition for condition, _ in fired}
        assert ("stagnant", "update_norm_l2") in fired
        assert len(fired) >= 15, fired


def _fed_alike(frame: pl.DataFrame, heat_width: int | None, chunk: int) -> Classifier:
    """The classifier fed `frame` (its roles from a components table) in chunks of `chunk` steps:
    its alarms held to the oracle's on the whole frame, each raised once, in the chunk where its
    episode begins; the classifier, fed."""
    config = _eager(Config(), 0.3, None)
    components = frame.select("component", "role").unique()
    clf = Classifier(config, components, heat_width=heat_width)
    fed = []
    for start in range(1, frame["step"].max() + 1, chunk):  # type: ignore[operator]
        rows = frame.filter(pl.col("step").is_between(start, start + chunk - 1)).drop("role")
        new = clf.feed(rows)
        assert new.is_empty() or new["step"].min() >= start, start
        fed.append(new)
    want = classify(sort_series(frame).lazy(), config)[1]
    assert clf.alarms().equals(want)
    assert len(want) > 20
    assert sorted(pl.concat(fed)["step"].to_list()) == want["step"].to_list()
    return clf


@pytest.mark.parametrize("chunk", [1, 9, 60, 1000])
def test_the_compiled_classifier_raises_the_same_alarms_fed_in_any_chunks(chunk: int) -> None:
    clf = _fed_alike(_frame(7), 5, chunk)
    # the heatmap of 5 steps a cell: each bin against the baseline of its first row, however the
    # rows came (a bin fed in two calls is judged against the statistics the first call took)
    whole = score(sort_series(_frame(7)).lazy(), _eager(Config(), 0.3, None)).collect()
    assert_same_cells(clf.heat(), bin_heat(whole, 5))


def test_a_role_is_read_row_by_row_however_the_rows_bring_it() -> None:
    # a rule only for heads; the role is null on the first rows of the series, "head" later
    config = replace(Config(), conditions=(replace(Config().conditions[0], name="flat", persistence=1,
                                                   rules=(replace(Config().conditions[0].rules[4], metric="out_mean",
                                                                  z=None, fold=None, level=5.0, roles=("head",)),)),))
    rows = pl.DataFrame({"rank": [0] * 20, "component": ["c"] * 20, "step": list(range(1, 21)),
                         "role": [None] * 10 + ["head"] * 10, "out_mean": [1.0] * 15 + [10.0] * 5})
    window = sort_series(rows).with_columns(pl.lit(True).alias(JUDGED))
    want, _ = _polars(window, config, 1)
    assert want["step"].to_list() == [16, 17, 18, 19, 20]
    assert judge(window, config, JUDGED, lead(config))[0].equals(want)
    # roles fed with some windows only: each row keeps its own, the carried ones included (with
    # a persistence of 3, the alarm at step 11 reads the hits of steps 9 and 10, carried)
    config = replace(config, conditions=(replace(config.conditions[0], persistence=3),))
    components = pl.DataFrame({"component": ["c"], "role": ["head"]})
    rows = rows.with_columns(pl.lit("head").alias("role"), (pl.col("step") >= 9).cast(pl.Float64).mul(9).add(1).alias("out_mean"))
    want = classify(sort_series(rows).lazy(), config)[1]
    assert want["step"].to_list() == [11]
    for first_with_role in (False, True):
        clf = Classifier(config, components)
        early, late = rows.filter(pl.col("step") <= 10), rows.filter(pl.col("step") > 10)
        clf.feed(early if first_with_role else early.drop("role"))
        clf.feed(late.drop("role") if first_with_role else late)
        assert clf.alarms().equals(want), first_with_role


def test_a_components_table_with_a_nameless_row_is_read_as_before() -> None:
    rows = pl.DataFrame({"component": ["a", "b"] * 80, "step": np.repeat(np.arange(1, 81), 2),
                         "out_mean": np.r_[np.ones(150), np.full(10, 50.0)]})
    components = pl.DataFrame({"component": ["a", "b", None], "role": ["param", "param", "head"]})
    got = Classifier(Config(), components, heat_width=1).feed(rows)
    roles = components.drop_nulls("component")
    want = classify(rows.join(roles, on="component", how="left").with_columns(pl.lit(0, pl.Int64).alias("rank")).lazy(),
                    Config())[1]
    assert got.equals(want) and len(want) > 0


@pytest.mark.parametrize("seed", range(3))
@pytest.mark.parametrize(("factor", "persistence"), [(1.0, None), (0.3, 1), (0.15, 3)])
@pytest.mark.parametrize("window", [16, 40])
def test_the_rows_no_rule_can_fire_at_are_passed_over_without_changing_a_hit(
        seed: int, factor: float, persistence: int | None, window: int, monkeypatch: pytest.MonkeyPatch) -> None:
    # without a heatmap a metric's baseline is taken only where its median's bounds let a rule
    # fire (`screen.candidates`); forced on every metric however many rows may, the hits are the
    # Polars classifier's, the peers' rule (which reads every component's median) included.
    # A window of 40 holds whole blocks enough for rows to be passed over a block at a time.
    from warninglight.forensics.judging.kernels import screen

    monkeypatch.setattr(screen, "SPARSE", 0)
    config = _eager(Config(), factor, persistence)
    config = replace(config, baseline=replace(config.baseline, window=window, min_samples=window // 2, lag=3))
    window = sort_series(_frame(seed, steps=220)).with_columns((pl.col("step") > 40).alias(JUDGED))
    want_hits, _ = _polars(window, config, 1)
    got_hits, heat = judge(window, config, JUDGED, lead(config))
    assert heat is None and got_hits.equals(want_hits)
    assert len(want_hits) > 0


@pytest.mark.parametrize("chunk", [1, 37, 1000])
def test_the_compiled_classifier_without_a_heatmap_raises_the_polars_alarms(chunk: int) -> None:
    # windows carry history rows before the judged ones: the rows passed over and the rows kept
    # meet in every way a stream feeds them
    _fed_alike(_frame(11, steps=200), None, chunk)
