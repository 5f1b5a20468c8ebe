"""Learning-rate schedules are not faults; a learning-rate spike is (real training, real traces)."""

from __future__ import annotations

import numpy as np
import polars as pl
import pytest
import torch
from rehearsed import analysed, trace
from rules_oracle import classify
from torch import nn
from warninglight.forensics import analyze, open_trace
from warninglight.forensics.judging.baseline import lr_surge, series_starts
from warninglight.forensics.judging.conditions import Config
from warninglight.forensics.trace.schedule import (
    component_lr,
    join_lr,
    lr_of_components,
    not_held,
    with_lr,
)
from warninglight.forensics.trace.store import health_frame
from warninglight.tracer import watch


def test_recorder_keeps_every_groups_lr_and_which_group_holds_each_component(tmp_path) -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 3), nn.Linear(3, 2))
    opt = torch.optim.SGD([{"params": model[0].parameters()},
                           {"params": model[2].parameters(), "lr": 0.5}], lr=0.1)  # model[3] left out
    with watch(model, opt, str(tmp_path / "t")) as rec:
        for step in range(3):
            opt.param_groups[0]["lr"] = 0.1 / (step + 1)
            loss = model(torch.randn(5, 4)).pow(2).mean()
            opt.zero_grad()
            loss.backward()
            opt.step()
            rec.log(loss=loss)
    t = open_trace(tmp_path / "t")
    try:
        groups = dict(t.con.sql("SELECT component, param_group FROM components").fetchall())
        lrs = t.con.sql("SELECT lr_groups FROM steps ORDER BY step").fetchall()
        per = component_lr(t).table()
        assert not_held(t) == ["3"]
    finally:
        t.close()
    assert groups == {"0": 0, "1": None, "2": 1, "3": None}
    assert [r[0] for r in lrs] == [[0.1, 0.5], [0.05, 0.5], pytest.approx([0.1 / 3, 0.5])]
    at2 = dict(per.filter(pl.col("step") == 2).select("component", "lr").iter_rows())
    assert at2["0"] == 0.05 and at2["2"] == 0.5
    assert at2["3"] != at2["3"]  # NaN: no group holds it


def test_lr_surge_is_a_rise_past_the_runs_own_history() -> None:
    warmup = [0.01 * (i + 1) for i in range(10)]
    decay = [0.1] * 5 + [0.01] * 5  # a step decay: never a surge
    restart = [0.1, 0.05, 0.01, 0.1]  # a warm restart back to the peak: not past the history
    spike = [0.01, 0.2]  # 20x in one step, above the peak 0.1
    lr = warmup + decay + restart + spike
    frame = pl.DataFrame({"rank": 0, "component": "a", "step": range(len(lr)), "lr": lr})
    got = lr_surge(frame["lr"], series_starts(frame)).to_list()
    assert max(got[:-1]) < 2.1  # warmup's second step doubles its lr; nothing else rises
    assert got[-1] == pytest.approx(20.0)


def test_scheduled_drops_move_the_update_baseline_instead_of_raising_alarms() -> None:
    """SGD + momentum with the lr cut ×0.1 twice (body) and a head group on its own constant lr."""
    path = trace("mlp_head_group_clean", steps=260)
    assert analysed("mlp_head_group_clean", steps=260).verdict == "healthy"
    t = open_trace(path)
    try:  # the same trace judged as if the lr were unknown: the drops look like collapses
        _, blind = classify(health_frame(t), Config())
        _, aware = classify(with_lr(health_frame(t), t), Config())
    finally:
        t.close()
    assert blind.filter(pl.col("metric").str.starts_with("update_")).height > 0
    assert aware.is_empty()


@pytest.mark.parametrize("scenario", ["mlp_adam_lr_spike", "mlp_lr_spike"])
def test_lr_spike_is_named_optimizer_wide_at_once_under_adam_and_momentum(scenario: str) -> None:
    root = analyze(trace(scenario, steps=170)).to_dict()["root"]
    assert (root["scope"], root["attributed_to"], root["onset_step"], root["alarm_step"]) == ("optimizer", "", 150, 150)
    assert root["metric"] == "lr_surge" and "spike, not a schedule" in root["evidence"]


def test_lr_looked_up_for_categorical_names_equals_the_lr_joined_for_strings() -> None:
    """`join_lr` takes a window read with Categorical names by table lookups, strings by joins:
    the same lr, null and NaN, on two ranks with param groups (one out of range, one unheld),
    steps the schedule lacks, components that own no parameter, and gradients null, 0 and > 0."""
    rng = np.random.default_rng(0)
    steps = pl.DataFrame({"rank": [r for r in (0, 1) for _ in range(12)],
                          "step": [s for _ in (0, 1) for s in range(12)],
                          "lr": rng.uniform(0.01, 0.1, 24),
                          "lr_groups": [None if s == 3 else [float(s), np.nan if s == 5 else 0.5 * s, None]
                                        for _ in (0, 1) for s in range(12)]}).filter(pl.col("step") != 7)
    components = pl.DataFrame({"rank": [0] * 6 + [1] * 6, "component": [*"abcdef"] * 2,
                               "param_count": [10, 10, 10, 10, 0, 10] * 2,
                               "param_group": [0, 1, 2, 5, None, None, 1, 0, 2, None, 0, 1]})
    schedule = lr_of_components(steps, components)
    assert schedule is not None
    n = 2 * 6 * 14  # steps 0..13: 12 and 13 beyond the schedule
    health = pl.DataFrame({"rank": np.repeat([0, 1], n // 2), "step": np.tile(np.repeat(np.arange(14), 6), 2),
                           "component": [*"abcdef"] * (n // 6),
                           "grad_norm_l2": rng.choice([None, 0.0, 1.5], n).tolist()},
                          schema_overrides={"grad_norm_l2": pl.Float32})
    joined = join_lr(health.lazy(), schedule).collect()
    looked = join_lr(health.with_columns(pl.col("component").cast(pl.Categorical)).lazy(), schedule).collect()
    assert looked["lr"].dtype == joined["lr"].dtype == pl.Float64
    assert looked["lr"].null_count() == joined["lr"].null_count() > 0
    assert looked["lr"].is_nan().sum() == joined["lr"].is_nan().sum() > 0
    assert looked["lr"].to_list() == pytest.approx(joined["lr"].to_list(), nan_ok=True)
    assert looked["lr"].is_not_null().sum() > n // 3
