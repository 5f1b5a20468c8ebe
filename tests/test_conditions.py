"""Each of the eight conditions, produced by a drill that causes it, is named on the right component."""

from __future__ import annotations

import pytest
from rehearsed import analysed, trace, truth
from warninglight.forensics.judging.conditions import (
    CONDITIONS,
    Config,
    ConfigError,
    apply,
    load_config,
    registry_rows,
)

ONSET_TOLERANCE = {"abrupt": 2, "gradual": 10}

# scenario -> (condition, component it must be reported on); each drill genuinely causes it.
EIGHT = {
    "mlp_weight_corruption": ("exploding", "2"),        # weights ×10 outside the optimizer
    "mlp_dying_layer": ("dead", "2"),                   # bias pushed down until the ReLU after it is dead
    "mlp_oscillating": ("oscillating", "2"),            # its gradient flips sign every step
    "mlp_saturation": ("saturated", "3"),               # tanh input ×30
    "mlp_frozen": ("stagnant", "2"),                    # its learning rate set to 0
    "mlp_head_shrink": ("losing_confidence", "6"),      # head weights shrink, predictions flatten
    "mlp_vanishing_gradient": ("losing_gradient", "2"),  # gradient into its output ×1e-4
    "mlp_bias_shift": ("unclassified", "2"),            # output mean shifted: no named condition
}


def test_registry_holds_the_eight_conditions() -> None:
    assert [c.name for c in CONDITIONS] == [
        "exploding", "dead", "saturated", "losing_confidence", "oscillating", "stagnant",
        "losing_gradient", "unclassified"]
    assert all(0 < c.ceiling <= 1 and c.persistence >= 1 and c.rules for c in CONDITIONS)


@pytest.mark.parametrize("scenario", sorted(EIGHT))
def test_drill_produces_its_condition_on_its_component(scenario: str) -> None:
    condition, component = EIGHT[scenario]
    t = truth(trace(scenario))
    assert (t["condition"], t["component"]) == (condition, component), "drill truth and test disagree"
    result = analysed(scenario)
    root = result.to_dict()["root"]
    assert result.verdict == "fault"
    assert (root["attributed_to"], root["condition"]) == (component, condition), root
    assert abs(root["onset_step"] - t["step"]) <= ONSET_TOLERANCE[t["kind"]], root
    assert root["alarm_step"] >= root["onset_step"]


def test_toml_file_and_overrides_change_thresholds(tmp_path) -> None:
    f = tmp_path / "t.toml"
    f.write_text("[baseline]\nwindow = 32\nmin_samples = 16\n\n[exploding]\npersistence = 4\n\n"
                 "[exploding.out_rms]\nz = 11.5\n")
    cfg = load_config(f, ["dead.out_dead_frac.level=0.7"])
    assert cfg.baseline.window == 32 and cfg.baseline.min_samples == 16
    exploding = cfg.condition("exploding")
    assert exploding.persistence == 4
    assert [r.z for r in exploding.rules if r.metric == "out_rms"] == [11.5]
    assert [r.level for r in cfg.condition("dead").rules if r.metric == "out_dead_frac"] == [0.7]
    assert Config().condition("exploding").persistence == 2  # defaults untouched
    with pytest.raises(ConfigError, match="exploding.persistence must be a whole number, got 1.5"):
        load_config(None, ["exploding.persistence=1.5"])
    nan_first = load_config(None, ["exploding.grad_norm_l2.persistence=3"]).condition("exploding")
    assert [(r.direction, r.persistence) for r in nan_first.rules if r.metric == "grad_norm_l2"] == [
        ("nonfinite", 1), ("up", 3)]  # a NaN gradient still alarms at once
    short = load_config(None, ["baseline.window=20"])
    assert (short.baseline.window, short.baseline.min_samples) == (20, 20)


@pytest.mark.parametrize(("table", "message"), [
    ({"explodng": {"persistence": 2}}, "unknown setting [explodng]"),
    ({"dead": {"out_rms": {"zz": 1}}}, "dead.out_rms.zz is not a threshold"),
    ({"dead": {"grad_norm_l2": {"z": 1}}}, "condition dead has no rule on 'grad_norm_l2'"),
    ({"dead": {"persistence": 0}}, "dead.persistence must be >= 1"),
    ({"baseline": {"window": "many"}}, "baseline.window must be a number"),
    ({"baseline": {"min_samples": 500}}, "must not exceed baseline.window"),
    ({"baseline": 3}, "baseline must be a table like [baseline]"),
    ({"baseline": {"lag": 1.7}}, "baseline.lag must be a whole number, got 1.7"),
])
def test_bad_settings_are_named(table: dict, message: str) -> None:
    with pytest.raises(ConfigError, match=message.replace("[", r"\[").replace("]", r"\]")):
        apply(Config(), table)


def test_registry_rows_cover_every_rule() -> None:
    rows = registry_rows()
    assert len(rows) == sum(len(c.rules) for c in CONDITIONS)
    osc = next(r for r in rows if r["condition"] == "oscillating")
    assert osc["metric"] == "update_cos" and "level <= -0.5" in osc["thresholds"]


def test_docs_are_generated_from_the_registry() -> None:
    from pathlib import Path

    from warninglight.forensics.judging.conditions import markdown

    doc = Path(__file__).parents[1] / "docs" / "conditions.md"
    assert doc.read_text() == markdown(), "regenerate: python -m warninglight.forensics.judging.conditions > docs/conditions.md"
