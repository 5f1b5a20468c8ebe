"""Onset and root: the layer that was harmed, not the downstream layers whose numbers moved more."""

from __future__ import annotations

from pathlib import Path

import numpy as np
from rehearsed import analysed, trace, truth
from warninglight.forensics.explaining.localise import Located, Series, drift_run_start, root_cause
from warninglight.forensics.judging.conditions import Config


def test_middle_layer_corruption_is_attributed_to_that_layer() -> None:
    result = analysed("mlp_weight_corruption")
    d = result.to_dict()
    assert d["root"]["attributed_to"] == "2"
    assert d["root"]["onset_step"] == truth(trace("mlp_weight_corruption"))["step"]
    assert "weight drift" in d["root"]["evidence"]
    # Downstream layers felt it, and their numbers moved more than the harmed layer's did.
    assert {"4", "6"} <= set(d["affected"])

    def fold(component: str, metric: str) -> float:
        row = result.baseline_frame(component, metric).filter(step=150)
        return row["value"][0] / row["median"][0]

    assert max(fold(c, "out_rms") for c in ("4", "6")) > fold("2", "out_rms") > 5
    assert max(fold(c, "grad_norm_l2") for c in ("4", "6")) > fold("2", "grad_norm_l2")


def test_nan_is_traced_to_the_module_whose_output_went_non_finite() -> None:
    d = analysed("mlp_nan").to_dict()
    assert (d["root"]["attributed_to"], d["root"]["condition"]) == ("2", "exploding")
    assert d["root"]["metric"] == "out_nonfinite_count"
    assert d["root"]["onset_step"] == d["root"]["alarm_step"] == 150  # non-finite alarms at once
    # Upstream layers got NaN gradients in the same step: affected through the backward pass.
    assert "0" in d["affected"]


def test_dead_activation_is_reported_on_the_layer_feeding_it() -> None:
    d = analysed("mlp_dying_layer").to_dict()
    assert d["root"]["attributed_to"] == "2"          # the Linear whose bias drifted
    assert d["root"]["condition"] == "dead"
    observed = {a["observed_on"] for a in d["alarms"] if a["attributed_to"] == "2"}
    assert "3" in observed                         # seen on the ReLU after it


def test_corrupt_batches_are_rooted_on_the_data_seen_first_at_the_first_layer() -> None:
    d = analysed("mlp_corrupt_batches").to_dict()
    assert (d["root"]["scope"], d["root"]["attributed_to"], d["root"]["onset_step"]) == ("data", "", 150)
    assert d["root"]["observed_on"] == "0"


def test_drift_run_start_walks_back_over_consecutive_drift() -> None:
    steps = np.arange(1, 21)
    drift = np.zeros(20)
    drift[9:15] = 0.1  # steps 10..15
    s = Series(steps, drift)
    assert drift_run_start(s, 13) == 10
    assert drift_run_start(s, 17) == 10   # within reach of the run's end
    assert drift_run_start(s, 19) is None


def test_a_fault_on_one_rank_names_that_rank() -> None:
    from rehearsed import ROOT
    from warninglight.forensics import analyze
    from warninglight.lab.rehearsal import rehearse

    out = ROOT / "two-ranks"
    rehearse("mlp_clean", out, steps=220, rank=0, world_size=2)
    rehearse("mlp_weight_corruption", out, steps=220, rank=1, world_size=2)
    d = analyze(out).to_dict()
    assert d["trace_info"]["ranks"] == 2
    assert (d["root"]["attributed_to"], d["root"]["rank"], d["root"]["onset_step"]) == ("2", 1, 150)
    assert d["root"]["ranks"] == [1] and d["root"]["ranks_disagree"] is True
    assert {a["rank"] for a in d["alarms"]} == {1}


def test_lr_spike_is_optimizer_wide_but_a_one_layer_fault_is_not() -> None:
    d = analysed("mlp_lr_spike").to_dict()
    assert (d["root"]["attributed_to"], d["root"]["scope"]) == ("", "optimizer")
    assert d["root"]["onset_step"] == d["root"]["alarm_step"] == 150 and d["root"]["metric"] == "lr_surge"
    assert "optimizer-wide" in d["root"]["evidence"]
    # The same many-component disturbance from corrupted data is the data's, not the optimizer's.
    assert analysed("mlp_corrupt_batches").to_dict()["root"]["scope"] == "data"
    for scenario in ("mlp_weight_corruption", "mlp_nan"):
        assert analysed(scenario).to_dict()["root"]["scope"] == "component", scenario


def _located(comp: str, signal: str = "forward", fi: int | None = 0, onset: int = 150, **kw: object) -> Located:
    base = dict(rank=0, observed_on=comp, condition="exploding", step=onset + 1, last_step=onset + 1,
                metric="out_rms", value=9.0, median=1.0, magnitude=8.0, onset_step=onset, attributed_to=comp,
                nonfinite=False, drift=False, signal=signal, forward_index=fi)
    return Located(**{**base, **kw})


def test_root_order_nonfinite_then_drift_then_upstream_and_never_called_runs_last() -> None:
    cfg = Config()
    late = _located("never_called", fi=None)
    early = _located("first", fi=0)
    root, affected = root_cause([late, early], cfg)
    assert (root.alarm.attributed_to, affected) == ("first", ["never_called"])  # a None index is downstream
    # on another rank nothing explains it: the tie at the onset goes to direct evidence, not order
    drifted = _located("second", fi=1, rank=1, drift=True, signal="weights", metric="weight_norm_l2")
    assert root_cause([early, drifted], cfg)[0].alarm.attributed_to == "second"
    nan = _located("third", fi=2, rank=2, nonfinite=True, value=None, median=None, magnitude=None)
    root, _ = root_cause([early, drifted, nan], cfg)
    assert (root.alarm.attributed_to, root.scope) == ("third", "component")
    assert root_cause([], cfg) == (None, [])


SAMPLES = Path(__file__).resolve().parents[1] / "sample_traces"


def test_localisation_read_from_near_the_first_alarm_gives_what_the_whole_run_gives(monkeypatch) -> None:
    """Localisation reads the alarmed components from `LOCATE_REACH` steps before the first alarm,
    and again from the run's first step where an onset or a drift run reaches rows whose trailing
    window that read did not hold whole: at every reach, the alarms, onsets, root and rollback
    of the read from the first step."""
    import warninglight.forensics.explaining.analysis as analysis

    kept: list[bool] = []
    held = analysis.onsets_held
    monkeypatch.setattr(analysis, "onsets_held", lambda *a: kept.append(held(*a)) or kept[-1])
    for name in ("mlp_dying_layer", "mlp_creeping_corruption", "gpt_nan", "cnn_corrupt_batches"):
        monkeypatch.setattr(analysis, "LOCATE_REACH", 1 << 40)  # never past the first step: read whole
        whole = analysis.analyze(SAMPLES / name, heat=False)
        assert whole.root is not None
        for reach in (1, 20, 70, 100, 130):
            monkeypatch.setattr(analysis, "LOCATE_REACH", reach)
            got = analysis.analyze(SAMPLES / name, heat=False)
            assert (got.root, got.affected, got.rollback) == (whole.root, whole.affected, whole.rollback), (name, reach)
            assert got.alarms.equals(whole.alarms), (name, reach)
    assert True in kept and False in kept  # the near read kept where it held, read again where not
