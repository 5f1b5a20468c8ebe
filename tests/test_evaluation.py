"""The benchmark's arithmetic: scoring one run against its answer key, and the tables' aggregates."""

from __future__ import annotations

from pathlib import Path

import pytest
from warninglight.forensics.comparators.static_rules import StaticAlarm
from warninglight.forensics.explaining.analysis import FAULT, HEALTHY, Alarm, Detectors, Root
from warninglight.forensics.explaining.rollback import LossOnlyChoice, Rollback
from warninglight.lab import evaluation, results

SAMPLES = Path(__file__).resolve().parents[1] / "sample_traces"
TRUTH_ABRUPT = {"fault": "weight_corruption", "component": "2", "step": 150, "kind": "abrupt", "healthy": False}
TRUTH_GRADUAL = {"fault": "bias_drift", "component": "2", "step": 150, "kind": "gradual", "healthy": False}
TRUTH_CLEAN = {"scenario": "mlp_clean", "healthy": True, "faults": []}


def result(component: str | None = "2", onset: int = 151, alarm: int = 153, loss: int | None = 200,
           grad: int | None = None, alarms: int = 2) -> dict:
    """An `analyze --json` object built from the engine's own types and verdict values."""
    root = None if component is None else Root(
        attributed_to=component, observed_on=component, condition="exploding", onset_step=onset, alarm_step=alarm,
        magnitude=30.0, metric="weight_drift_l2", rank=0, ranks=[0], ranks_disagree=False, evidence="drift",
        scope="component")
    loss_only = LossOnlyChoice(loss, 200, True, 0) if root else LossOnlyChoice(None, None, None, None)
    rollback = (Rollback(100, None, 53, [onset, alarm], None, loss_only) if root else
                Rollback(None, None, None, None, None, loss_only))
    alarm_row = Alarm("x", "x", "exploding", alarm, onset, 30.0, "out_rms", 0, alarm, 9.0, 1.0)
    detectors = Detectors(loss, grad, loss, grad, int(loss is not None), int(grad is not None), None, None, None)
    return {"verdict": FAULT if root else HEALTHY, "root": root and root.to_dict(),
            "alarms": [alarm_row.to_dict()] * alarms, "rollback": rollback.to_dict(), "detectors": detectors.to_dict()}


def test_score_abrupt_fault_run() -> None:
    static = [StaticAlarm("dead_relu", "3", 90, 0.6, 3), StaticAlarm("exploding_tensor", "2", 160, 4.0, 1)]
    r = evaluation.score("mlp_x", 0, TRUTH_ABRUPT, result(), static, component_steps=2100)
    assert (r.root_correct, r.onset_error, r.onset_ok, r.latency) == (True, 1, True, 3)
    assert (r.lead_loss, r.lead_grad, r.grad_rule_step) == (47, None, None)
    assert (r.discarded_ours, r.discarded_loss_only, r.loss_only_contaminated) == (53, 0, True)
    # the static firing at step 90 predates the fault; the first at or after 150 counts
    assert (r.static_step, r.static_rule, r.static_correct) == (160, "exploding_tensor", True)
    # when other components fire at the same step, the fixed rule has not named the root
    both = [*static, StaticAlarm("exploding_tensor", "0", 160, 2.0, 1)]
    assert evaluation.score("mlp_x", 0, TRUTH_ABRUPT, result(), both, 2100).static_correct is False


@pytest.mark.parametrize("kind_truth, onset, ok", [
    (TRUTH_ABRUPT, 153, False),   # 3 steps off: outside the abrupt tolerance of 2
    (TRUTH_ABRUPT, 148, True),    # 2 steps early
    (TRUTH_GRADUAL, 160, True),   # 10 steps: inside the gradual tolerance
    (TRUTH_GRADUAL, 161, False),
])
def test_onset_tolerance_depends_on_kind(kind_truth: dict, onset: int, ok: bool) -> None:
    r = evaluation.score("s", 0, kind_truth, result(onset=onset, alarm=onset + 5), [], 100)
    assert r.onset_ok is ok
    assert r.onset_error == abs(onset - 150)


def test_comparators_count_from_the_injection_not_from_our_onset() -> None:
    comps = evaluation.Comparators(loss=(40, 190), grad=(149,))
    r = evaluation.score("s", 0, TRUTH_ABRUPT, result(alarm=153, loss=40), [], 100, comparators=comps)
    # the loss rule's firing at step 40 predates the fault: its first firing at/after 150 is 190
    assert (r.loss_rule_step, r.lead_loss) == (190, 37)
    assert (r.grad_rule_step, r.lead_grad) == (None, None)  # 149 is before the injection
    clean = evaluation.score("c", 0, TRUTH_CLEAN, result(component=None), [], 100, comparators=comps)
    assert (clean.loss_rule_step, clean.grad_rule_step) == (40, 149)  # on a clean run, any firing


def test_latency_counts_from_the_first_light_not_the_root_confirmation() -> None:
    res = result(onset=150, alarm=190, loss=200)
    res["detectors"]["first_alarm_step"] = 164  # an earlier alarm of another condition lit the light
    r = evaluation.score("g", 0, TRUTH_GRADUAL, res, [], 100)
    assert (r.latency, r.root_latency, r.lead_loss) == (14, 40, 36)


def test_alarm_before_the_fault_is_flagged() -> None:
    r = evaluation.score("s", 0, TRUTH_ABRUPT, result(onset=40, alarm=48), [], 100)
    assert (r.early_alarm, r.latency, r.onset_ok) == (True, -102, False)


def test_clean_twins_cover_set_ups_without_a_clean_scenario() -> None:
    from warninglight.lab.rehearsal import SCENARIOS

    twins = evaluation.clean_twins(list(SCENARIOS))
    assert twins and all(t.name.endswith("~clean") and t.drills() == [] for t in twins)
    clean_setups = {(s.model, s.optimizer, s.lr, s.momentum, s.activation, s.batch_size, s.steps)
                    for s in [*SCENARIOS.values(), *twins] if not s.drills()}
    for sc in SCENARIOS.values():  # every fault scenario's set-up now has a clean run
        assert (sc.model, sc.optimizer, sc.lr, sc.momentum, sc.activation, sc.batch_size, sc.steps) in clean_setups


def test_wrong_root_and_missed_fault() -> None:
    wrong = evaluation.score("s", 0, TRUTH_ABRUPT, result(component="4"), [], 100)
    missed = evaluation.score("s", 1, TRUTH_ABRUPT, result(component=None), [], 100)
    assert wrong.root_correct is False and wrong.fault_verdict is True
    assert missed.root_correct is False and missed.fault_verdict is False
    assert (missed.latency, missed.onset_ok, missed.discarded_ours) == (None, False, None)


def test_clean_run_counts_alarms_not_accuracy() -> None:
    r = evaluation.score("mlp_clean", 0, TRUTH_CLEAN, result(component=None, alarms=3), [], 3000)
    assert (r.kind, r.fault_verdict, r.root_correct, r.alarms) == ("clean", False, None, 3)


def test_whole_model_fault_is_right_only_when_the_whole_model_is_named() -> None:
    truth = {**TRUTH_ABRUPT, "fault": "lr_spike", "component": ""}
    assert evaluation.score("s", 0, truth, result(component="2"), [], 100).root_correct is False
    assert evaluation.score("s", 0, truth, result(component=""), [], 100).root_correct is True


def test_tables_aggregate_and_state_targets() -> None:
    runs = [
        evaluation.score("a", 0, TRUTH_ABRUPT, result(onset=150, alarm=151, loss=None), [], 1000),
        evaluation.score("a", 1, TRUTH_ABRUPT, result(component="9", onset=155, alarm=156, loss=171), [], 1000),
        evaluation.score("g", 0, TRUTH_GRADUAL, result(onset=152, alarm=170, loss=300), [], 1000),
        evaluation.score("c", 0, TRUTH_CLEAN, result(component=None, alarms=1), [], 4000),
        evaluation.score("c", 1, TRUTH_CLEAN, result(component="1", alarms=1), [], 6000),
    ]
    rows = evaluation.summarise_faults([r for r in runs if r.scenario == "a"])
    assert rows["root right"] == "1/2"
    assert rows["onset err med/max"] == "2.5/5"
    assert rows["lead vs loss rule"] == "+15 (never fired 1/2)"
    clean = evaluation.summarise_clean([r for r in runs if r.scenario == "c"])
    assert clean["fault verdicts"] == "1/2"
    assert clean["alarms per 10k comp-steps"] == "2.00"  # 2 alarms over 10,000 component-steps
    text = results.format_tables(runs)
    assert "root right in ≥ 97% of fault runs: 2/3 = 67% MISSED" in text
    assert "onset within tolerance (2 steps abrupt, 10 steps gradual) in ≥ 97% of fault runs: 2/3 = 67% MISSED" in text
    assert "- a seed 1: named '9' (exploding), truth '2'; onset 5 steps off (tolerance 2)" in text
    assert "gradual faults alarm ≥ 100 steps before the loss-spike rule (or it never fires): 1/1 MET" in text
    assert "zero fault verdicts on clean runs (every schedule): 1/2 MISSED" in text


def test_benchmark_rejects_zero_seeds() -> None:
    with pytest.raises(evaluation.EvaluationError, match="--seeds must be at least 1, got 0"):
        evaluation.run_benchmark(["mlp_clean"], 0)


def test_eval_command_runs_real_scenarios(tmp_path) -> None:
    """Two short real rehearsals (a fault and a clean run) through `warninglight eval`."""
    import json

    from typer.testing import CliRunner
    from warninglight.cli.main import app

    out = tmp_path / "runs.json"
    res = CliRunner().invoke(app, ["eval", "mlp_nan", "mlp_clean", "--seeds", "1", "--steps", "200",
                                   "--json", str(out), "--workdir", str(tmp_path / "w")])
    assert res.exit_code == 0, res.output
    runs = json.loads(out.read_text())
    assert [(r["scenario"], r["kind"], r["injected"]) for r in runs] == [
        ("mlp_nan", "abrupt", 150), ("mlp_clean", "clean", None)]
    assert runs[1]["component_steps"] == 200 * 7  # 4 Linear + 3 ReLU components, every step
    assert "| mlp_nan | 1 |" in res.output and "| mlp_clean | 1 |" in res.output
    # NaN in one module's output is exactly what the fixed NaN/Inf rule is for
    assert runs[0]["static_rule"] == "exploding_tensor" and runs[0]["static_step"] == 150


def test_benchmark_puts_torch_threads_back() -> None:
    import torch
    from conftest import torch_threads

    with torch_threads(3):
        assert evaluation.run_benchmark([], 1) == []  # runs on one thread, then restores
        assert torch.get_num_threads() == 3


def test_eval_json_into_a_missing_folder_fails_before_training(tmp_path) -> None:
    from typer.testing import CliRunner
    from warninglight.cli.main import app

    out = tmp_path / "nope" / "runs.json"
    res = CliRunner().invoke(app, ["eval", "mlp_clean", "--seeds", "1", "--json", str(out),
                                   "--workdir", str(tmp_path / "w")])
    assert res.exit_code == 2, res.output
    assert res.stderr.strip() == f"error: --json {out}: folder {out.parent} does not exist — create it or pass another path"
    assert not (tmp_path / "w").exists()  # nothing was trained


@pytest.mark.parametrize(("named_rank", "truth_rank", "right"), [
    (1, 1, True), (0, 1, False), (None, 1, False), (None, None, True), (1, None, False)])
def test_a_data_parallel_root_must_name_the_rank_too(named_rank: int | None, truth_rank: int | None,
                                                     right: bool) -> None:
    truth = {**TRUTH_ABRUPT, "rank": truth_rank, "world_size": 2}
    res = result()
    res["root"]["rank"] = named_rank
    r = evaluation.score("ddp", 0, truth, res, [], 100)
    assert (r.rank_correct, r.root_correct, r.truth_rank, r.root_rank) == (right, right, truth_rank, named_rank)
    assert evaluation.summarise_faults([r])["rank right"] == f"{int(right)}/1"


def test_single_rank_runs_have_no_rank_column_value() -> None:
    r = evaluation.score("s", 0, TRUTH_ABRUPT, result(), [], 100)
    assert r.rank_correct is None and evaluation.summarise_faults([r])["rank right"] == "—"


def _read_run(path: Path) -> tuple[int, evaluation.Comparators]:
    """The false-alarm denominator and the comparators' firings read from the trace on their own:
    every row the health view holds, and the two rules over the steps view's loss and norm."""
    import numpy as np
    from warninglight.forensics import open_trace
    from warninglight.forensics.comparators import detectors

    opened = open_trace(path)
    try:
        rows = int(opened.one("SELECT count(*) FROM health")[0])
        series = opened.sql("SELECT step, loss, grad_norm_total_l2 FROM steps ORDER BY step, rank").fetchall()
    finally:
        opened.close()
    step = np.array([r[0] for r in series], dtype=np.int64)
    loss, grad = (np.array([np.nan if r[i] is None else r[i] for r in series], dtype=np.float64) for i in (1, 2))
    return rows, evaluation.Comparators(tuple(detectors.loss_spikes(step, loss)),
                                        tuple(detectors.grad_norm_spikes(step, grad)))


@pytest.mark.parametrize("name", ["gpt_nan", "mlp_saturation_gradual", "cnn_clean", "cnn_corrupt_batches"])
def test_a_recorded_trace_scores_in_one_pass_as_in_two(name: str) -> None:
    # eval reads a trace once: analyze without the heatmap, the static rules, the denominator and
    # the comparators' firings from the same pass; the score is the one the separate passes (the
    # report's analysis, the static rules alone, the rows and the steps read again) gave
    from dataclasses import replace

    from warninglight.forensics import analyze
    from warninglight.forensics.comparators.static_rules import static_alarms

    path = SAMPLES / name
    truth = evaluation.read_truth(path)
    rows, comps = _read_run(path)
    static = static_alarms(path)
    want = evaluation.score(name, 0, truth, analyze(path).to_dict(), static, rows, 0.0, comps)
    got = evaluation.judge_trace(name, 0, path, truth)
    assert replace(got, seconds=0.0) == want
    assert rows > 0 and comps.grad  # the gradient-norm rule fires on each of them
    result = analyze(path, heat=False)
    assert result.static == static and evaluation.run_of(result) == (rows, comps)


def test_a_restarted_runs_denominator_counts_its_effective_timeline(tmp_path: Path) -> None:
    # a restart supersedes what the first incarnation recorded from its first step on: those rows
    # are not judged, so they are not counted (the footers would count them)
    from warninglight.forensics import analyze
    from warninglight.lab.rehearsal import rehearse

    out, ckpt = tmp_path / "restarted", tmp_path / "ckpt"
    rehearse("mlp_clean", out, steps=120, checkpoint_every=50, checkpoint_dir=ckpt)
    rehearse("mlp_clean", out, steps=160, checkpoint_every=50, checkpoint_dir=ckpt,
             resume_from=ckpt / "step-000100.pt", start_step=100)
    result = analyze(out, heat=False)
    assert result.health_rows is None  # restarted: not from the footers
    rows, comps = evaluation.run_of(result)
    assert (rows, comps) == _read_run(out) and rows == 160 * result.summary["components"]


def test_eval_scores_recorded_traces_without_training(tmp_path) -> None:
    import json
    import shutil

    from typer.testing import CliRunner
    from warninglight.cli.main import app

    out, bare = tmp_path / "runs.json", tmp_path / "no-key"
    shutil.copytree(SAMPLES / "mlp_clean", bare)
    (bare / "truth.json").unlink()
    res = CliRunner().invoke(app, ["eval", "--trace", str(SAMPLES / "gpt_nan"), "--trace", str(bare), "--json", str(out)])
    assert res.exit_code == 2 and not out.exists()  # every answer key is read before any trace is analysed
    assert res.stderr.strip() == (f"error: --trace {bare}: no truth.json there — eval scores a trace against its answer "
                                  "key (a rehearsal's); analyse a trace without one with `warninglight analyze`")
    res = CliRunner().invoke(app, ["eval", "--trace", str(SAMPLES / "gpt_nan"), "--trace", str(SAMPLES / "mlp_clean"),
                                   "--json", str(out)])
    assert res.exit_code == 0, res.output
    runs = json.loads(out.read_text())
    assert [(r["scenario"], r["root_component"], r["root_correct"], r["injected"]) for r in runs] == [
        ("gpt_nan", "h.0.mlp.c_fc", True, 150), ("mlp_clean", None, None, None)]
    assert "| gpt_nan | 1 | 1/1 |" in res.output
    res = CliRunner().invoke(app, ["eval", "mlp_clean", "--trace", str(SAMPLES / "gpt_nan")])
    assert res.exit_code == 2 and "pass one or the other" in res.stderr


def test_eval_runs_a_distributed_scenario_named_among_the_others(tmp_path: Path) -> None:
    """`warninglight eval` with no scenario named runs every one, the data-parallel ones too: each
    by its own rehearsal (spawned gloo ranks), scored against its truth."""
    (r,) = evaluation.run_one("ddp_weight_scale", 0, tmp_path)
    assert (r.scenario, r.truth_component) == ("ddp_weight_scale", "h.0.mlp.c_fc")
    assert r.fault_verdict and r.root_correct, r
