"""The classifier on real runs: clean runs stay dark; non-finite values alarm at once; causal."""

from __future__ import annotations

import polars as pl
import pytest
from rehearsed import analysed, trace
from rules_oracle import classify
from warninglight.forensics.judging.conditions import Config
from warninglight.forensics.trace.store import health_frame, open_trace

CLEAN = [("mlp_clean", 1000), ("cnn_clean", 400), ("gpt_clean", 600)]


@pytest.mark.parametrize(("scenario", "steps"), CLEAN)
def test_clean_run_is_healthy(scenario: str, steps: int) -> None:
    result = analysed(scenario, steps)
    assert result.summary["steps"] == steps
    assert result.verdict == "healthy", result.to_dict()["alarms"]
    assert result.alarms.is_empty() and result.root is None
    assert result.rollback.checkpoint_step is None


def test_clean_runs_stay_dark_over_at_least_2000_recorded_steps() -> None:
    # Counted from the traces (steps the recorder wrote and the classifier read), not from CLEAN.
    recorded = [analysed(scenario, steps) for scenario, steps in CLEAN]
    assert all(r.verdict == "healthy" for r in recorded)
    assert sum(r.summary["steps"] for r in recorded) >= 2000
    # every step was judged: the heatmap's bins reach from the first recorded step to the last
    assert all(r.heat["step"].min() == 1 and r.heat["step"].max() + r.heat_width > r.summary["steps"]  # type: ignore[operator]
               for r in recorded)


def test_non_finite_values_alarm_at_once() -> None:
    alarms = analysed("mlp_nan").alarms
    nan = alarms.filter(pl.col("metric") == "out_nonfinite_count")
    assert not nan.is_empty()
    assert nan["step"].min() == 150 and (nan["step"] == nan["onset_step"]).all()


def test_alarms_do_not_depend_on_the_future() -> None:
    t = open_trace(trace("mlp_weight_corruption"))
    try:
        frame = health_frame(t).collect()
    finally:
        t.close()
    cfg = Config()
    _, full = classify(frame.lazy(), cfg)
    _, cut = classify(frame.filter(pl.col("step") <= 160).lazy(), cfg)
    keys = ["component", "condition", "step", "metric"]
    assert cut.select(keys).equals(full.filter(pl.col("step") <= 160).select(keys))
    assert not cut.is_empty()
