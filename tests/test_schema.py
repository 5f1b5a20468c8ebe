"""The schema declares what each health metric measures; recorder and engine ask it."""

from __future__ import annotations

import pyarrow as pa
import pytest
from warninglight.forensics.judging.hits import signal_of
from warninglight.tracer import schema


def test_every_metric_has_one_kind_and_the_kinds_partition_the_metrics() -> None:
    by_kind = [schema.metrics_of(k) for k in schema.METRIC_KINDS]
    assert sorted(m for ms in by_kind for m in ms) == sorted(schema.HEALTH_METRICS)
    assert schema.metrics_of() == schema.HEALTH_METRICS
    assert schema.metrics_of(schema.HEAD) == ("pred_entropy_nats", "pred_maxprob")
    assert schema.metrics_of(schema.GRADIENT) == ("grad_norm_l2", "grad_nonfinite_count")
    assert schema.metrics_of(schema.FORWARD, count=False) == (
        "out_mean", "out_rms", "out_absmax", "out_zero_frac", "out_sat_frac", "out_dead_frac")


def test_counts_are_the_integer_metrics() -> None:
    ints = tuple(c.name for c in schema.HEALTH_COLUMNS if c.kind and c.type == pa.int64())
    assert schema.COUNT_METRICS == ints == ("out_nonfinite_count", "grad_nonfinite_count")
    assert schema.is_count("grad_nonfinite_count") and not schema.is_count("grad_norm_l2")


@pytest.mark.parametrize(("metric", "kind", "signal"), [
    ("out_rms", "forward", "forward"), ("pred_maxprob", "head", "forward"),
    ("grad_norm_l2", "gradient", "gradient"), ("update_cos", "weights", "weights"),
    ("weight_drift_l2", "weights", "weights"),
])
def test_kind_and_signal_of_a_metric(metric: str, kind: str, signal: str) -> None:
    assert (schema.kind_of(metric), signal_of(metric)) == (kind, signal)


def test_unknown_names_are_errors_that_list_the_right_ones() -> None:
    with pytest.raises(ValueError, match="'gradients'.*expected one of forward, head, gradient, weights"):
        schema.metrics_of("gradients")
    with pytest.raises(ValueError, match="'out_rmss' is not a health metric"):
        schema.kind_of("out_rmss")
    with pytest.raises(ValueError, match="step"):
        schema.is_count("step")  # a key column, not a metric
