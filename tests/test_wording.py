"""The verdict's words: one line for an operator, the analyze text, a live alarm's line."""

from __future__ import annotations

import dataclasses

import pytest
from rehearsed import analysed
from warninglight.forensics.explaining.analysis import Alarm, Detectors, Root
from warninglight.forensics.explaining.rollback import LossOnlyChoice, Rollback
from warninglight.forensics.presenting import wording
from warninglight.forensics.presenting.texttable import text_table

ROOT = Root(attributed_to="h.0.mlp.c_fc", observed_on="h.0.mlp.c_fc", condition="exploding", onset_step=150,
            alarm_step=151, magnitude=41.27, metric="weight_drift_l2", rank=0, ranks=[0], ranks_disagree=False,
            evidence="weight drift", scope="component")
DETECTORS = Detectors(None, None, None, None, 0, 0, None, None, first_alarm_step=151)


def rollback(loss_only: LossOnlyChoice) -> Rollback:
    return Rollback(100, "ck/step-000100.pt", 51, [150, 151], None, loss_only, note="resume")


def test_summary_line_says_what_where_since_when_and_where_to_go_back() -> None:
    held = rollback(LossOnlyChoice(180, 200, True, 12))
    assert wording.summary_line(ROOT, held, DETECTORS, "fault") == (
        "ALARM h.0.mlp.c_fc: exploding (|z| 41.3 on weight_drift_l2), onset step 150, alarm step 151"
        " — roll back to step 100 (ck/step-000100.pt), discard 51 steps, skip the batches of steps 150–151;"
        " the loss-only choice (step 200) already held the damage.")
    clean = rollback(LossOnlyChoice(180, 0, False, 212))
    assert wording.summary_line(ROOT, clean, DETECTORS, "fault").endswith(
        "the loss-only choice (step 0, clean) would discard 212: 161 steps saved.")
    silent = rollback(LossOnlyChoice(None, None, None, None))
    assert wording.summary_line(ROOT, silent, DETECTORS).endswith("150–151; the loss-spike rule never fired.")
    early = dataclasses.replace(DETECTORS, first_alarm_step=149)
    assert "alarm step 151 (the light first lit at step 149) — roll back" in wording.summary_line(ROOT, held, early)


def test_summary_line_of_a_healthy_run_and_of_an_optimizer_wide_root() -> None:
    nothing = Rollback(None, None, None, None, None, LossOnlyChoice(None, None, None, None))
    assert wording.summary_line(None, nothing, DETECTORS, "healthy") == (
        "HEALTHY: no component left its baseline; no rollback needed.")
    wide = dataclasses.replace(ROOT, attributed_to="", scope="optimizer")
    assert wording.summary_line(wide, nothing, DETECTORS).startswith(
        "ALARM optimizer-wide (every component's update): exploding (|z| 41.3 on weight_drift_l2), onset step 150")
    assert wording.summary_line(wide, nothing, DETECTORS).endswith("no checkpoint before the onset: restart from scratch.")


def test_a_one_step_skip_is_said_as_one_step() -> None:
    one = dataclasses.replace(rollback(LossOnlyChoice(None, None, None, None)), skip_step_range=[150, 150])
    assert ", skip the batches of step 150;" in wording.summary_line(ROOT, one, DETECTORS)
    assert wording.rollback_lines(one)[0].endswith("discarded; skip step 150")
    assert wording.step_range([150, 151]) == "steps 150–151"


def test_summary_line_of_a_root_with_no_z_says_no_dash() -> None:
    # a NaN/Inf value or a checksum finding has no |z|: the line names the metric alone
    nothing = Rollback(None, None, None, None, None, LossOnlyChoice(None, None, None, None))
    checksum = dataclasses.replace(ROOT, magnitude=None, metric="weight_checksum")
    assert wording.summary_line(checksum, nothing, DETECTORS).startswith(
        "ALARM h.0.mlp.c_fc: exploding (on weight_checksum), onset step 150")


def test_root_and_alarm_lines_name_where_it_was_seen_when_that_differs() -> None:
    seen = dataclasses.replace(ROOT, attributed_to="2", observed_on="3", magnitude=None, ranks=[1], ranks_disagree=True)
    assert wording.root_line(seen) == ("root: 2 (observed on 3) on rank 1 only exploding: onset step 150, "
                                       "alarm step 151 on weight_drift_l2; weight drift")
    alarm = Alarm("3", "2", "dead", 207, 150, 2.38, "out_dead_frac", 0, 210, 0.9, 0.1)
    assert wording.alarm_line(alarm) == "step 207: 2 (observed on 3) dead on out_dead_frac z=2.4, onset step 150"
    assert wording.alarm_line(dataclasses.replace(alarm, observed_on="2", magnitude=None)) == (
        "step 207: 2 dead on out_dead_frac, onset step 150")


def test_analysis_text_of_a_real_fault() -> None:
    a = analysed("mlp_weight_corruption")
    lines = wording.analysis_text(a).splitlines()
    assert lines[0] == "verdict: fault"
    assert lines[1].startswith(f"root: 2 exploding: onset step {a.root.onset_step}, alarm step {a.root.alarm_step}")
    assert lines[3] == "alarms:" and lines[4].split() == list(wording.ALARM_TABLE_COLUMNS)
    assert len([x for x in lines if x.startswith("  ") and x.split()[0].isdigit()]) == len(a.alarms)
    assert any(x.startswith(f"rollback: checkpoint at step {a.rollback.checkpoint_step}") for x in lines)
    assert wording.warmup_note(a) is None


def test_timeline_lines_of_the_light_and_the_rules() -> None:
    from warninglight.forensics.explaining.replay import Event

    events = [Event(151, "light", "2", "exploding", 150, 41.27, "weight_drift_l2"), Event(190, "loss_spike")]
    assert wording.timeline_lines(events) == [
        "step    151  LIGHT  2 exploding (weight_drift_l2 z=41.3), onset 150",
        "step    190  loss-spike rule fires"]
    assert wording.timeline_lines([]) == ["no alarm: the light never lit"]


@pytest.mark.parametrize(("n", "said"), [(0, "0 steps"), (1, "1 step"), (2, "2 steps")])
def test_step_counts_agree_with_their_number(n: int, said: str) -> None:
    assert wording.steps(n) == said


def test_a_timestamp_prints_every_whole_digit_and_a_loss_four_figures() -> None:
    table = text_table([{"wall_time_s": 1796005072.00802, "loss": 2.30258}], ["wall_time_s", "loss"])
    assert table.splitlines()[1].split() == ["1796005072.00802", "2.303"]
