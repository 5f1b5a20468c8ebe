"""The SageMaker-style fixed-threshold rules, on real Parquet traces."""

from __future__ import annotations

import math
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from warninglight.forensics import TraceError
from warninglight.forensics.comparators.static_rules import first_static_alarm, static_alarms
from warninglight.tracer import schema

COMPONENTS = {
    "component": ["fc", "relu", "fc2", "tanh"],
    "kind": ["Linear", "ReLU", "Linear", "Tanh"],
    "forward_index": [0, 1, 2, 3],
    "param_count": [100, 0, 400, 0],
    "role": ["param", "activation", "param", "activation"],
    "bound": [None, "relu", None, "tanh"],
    "parent_param": [None, "fc", None, "fc2"],
}


def write_table(root: Path, table: str, columns: dict[str, list]) -> None:
    """One segment of `table`, every schema column present (missing ones null)."""
    n = len(next(iter(columns.values())))
    data = {c.name: pa.array(columns.get(c.name, [None] * n), type=c.type) for c in schema.COLUMNS[table]}
    path = schema.segment_path(root, table, rank=0, incarnation=1, seq=0)
    path.parent.mkdir(parents=True, exist_ok=True)
    pq.write_table(pa.table(data), path)


def health_rows(steps: int, overrides: dict[tuple[int, str], dict[str, float]]) -> dict[str, list]:
    """Healthy rows for every (step, component), with some cells overridden."""
    rows: dict[str, list] = {k: [] for k in ("step", "component", "grad_norm_l2", "out_dead_frac",
                                              "out_sat_frac", "out_nonfinite_count", "grad_nonfinite_count")}
    for s in range(1, steps + 1):
        for comp, role in zip(COMPONENTS["component"], COMPONENTS["role"], strict=True):
            row = {"step": s, "component": comp, "grad_norm_l2": 0.1 if role == "param" else None,
                   "out_dead_frac": 0.05 if comp == "relu" else None, "out_sat_frac": 0.1 if comp == "tanh" else None,
                   "out_nonfinite_count": 0, "grad_nonfinite_count": 0 if role == "param" else None}
            row.update(overrides.get((s, comp), {}))
            for k in rows:
                rows[k].append(row[k])
    return rows


@pytest.fixture
def trace(tmp_path: Path) -> Path:
    write_table(tmp_path, "components", COMPONENTS)
    overrides = {
        (4, "fc2"): {"grad_norm_l2": 1e-6},      # RMS = 1e-6 / sqrt(400) = 5e-8 < 1e-7: vanishing
        (5, "fc2"): {"grad_norm_l2": 1e-6},
        (3, "fc"): {"grad_norm_l2": 2e-6},       # RMS = 2e-7: small, but not below the threshold
        (6, "relu"): {"out_dead_frac": 0.51},
        (7, "tanh"): {"out_sat_frac": 0.9},
        (2, "fc"): {"grad_nonfinite_count": 3},
        (8, "relu"): {"out_nonfinite_count": 1},
    }
    write_table(tmp_path, "health", health_rows(8, overrides))
    return tmp_path


def test_each_rule_fires_first_where_its_threshold_is_crossed(trace: Path) -> None:
    got = [(a.rule, a.component, a.step, a.steps_fired) for a in static_alarms(trace)]
    assert got == [
        ("exploding_tensor", "fc", 2, 1),
        ("vanishing_gradient", "fc2", 4, 2),
        ("dead_relu", "relu", 6, 1),
        ("saturated_activation", "tanh", 7, 1),
        ("exploding_tensor", "relu", 8, 1),
    ]
    vanishing = static_alarms(trace)[1]
    assert math.isclose(vanishing.value, 1e-6 / 20, rel_tol=1e-5)


def test_first_alarm_after_a_step(trace: Path) -> None:
    assert first_static_alarm(trace).step == 2
    assert first_static_alarm(trace, after_step=5).rule == "dead_relu"
    assert first_static_alarm(trace, after_step=9) is None


def test_healthy_trace_fires_nothing(tmp_path: Path) -> None:
    write_table(tmp_path, "components", COMPONENTS)
    write_table(tmp_path, "health", health_rows(20, {}))
    assert static_alarms(tmp_path) == []


def test_not_a_trace(tmp_path: Path) -> None:
    with pytest.raises(TraceError, match="is this a trace directory"):
        static_alarms(tmp_path)
