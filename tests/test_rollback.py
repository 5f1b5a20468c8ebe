"""Rollback: never to a checkpoint holding the damage; on a gradual fault, earlier than loss-only."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch
from rehearsed import analysed, trace, truth
from warninglight.forensics import analyze
from warninglight.forensics.explaining.rollback import CheckpointError, every, from_glob

FAULTS = ["mlp_weight_corruption", "mlp_nan", "mlp_corrupt_batches", "mlp_dying_layer",
          "mlp_frozen", "mlp_saturation", "mlp_head_shrink", "mlp_vanishing_gradient",
          "mlp_creeping_corruption"]


@pytest.mark.parametrize("scenario", FAULTS)
def test_checkpoint_is_before_the_true_onset(scenario: str) -> None:
    r = analysed(scenario).to_dict()["rollback"]
    onset = truth(trace(scenario))["step"]
    assert r["checkpoint_step"] is not None and r["checkpoint_step"] < onset
    assert r["checkpoint_step"] == max(s for s in range(50, 301, 50) if s < onset)  # the latest clean one
    assert r["steps_discarded"] == 300 - r["checkpoint_step"]


def test_skip_window_and_batches_span_onset_to_alarm() -> None:
    d = analysed("mlp_weight_corruption").to_dict()
    first, last = d["rollback"]["skip_step_range"]
    assert (first, last) == (d["root"]["onset_step"], d["root"]["alarm_step"])
    assert len(d["rollback"]["skip_batches"]) == 32 * (last - first + 1)  # batch_size ids per step


def test_gradual_fault_loss_only_never_fires_and_report_says_so() -> None:
    d = analysed("mlp_dying_layer").to_dict()
    assert d["rollback"]["loss_only"]["alarm_step"] is None
    assert "loss-spike rule never fired" in d["rollback"]["note"]
    assert d["rollback"]["checkpoint_step"] < truth(trace("mlp_dying_layer"))["step"]


def test_creeping_fault_loss_only_is_later_and_already_damaged() -> None:
    d = analysed("mlp_creeping_corruption").to_dict()
    onset = truth(trace("mlp_creeping_corruption"))["step"]
    ours, loss_only = d["rollback"]["checkpoint_step"], d["rollback"]["loss_only"]
    assert abs(d["root"]["onset_step"] - onset) <= 10 and d["root"]["attributed_to"] == "2"
    assert ours < onset
    assert loss_only["alarm_step"] > d["root"]["alarm_step"]          # the light lit first
    assert loss_only["checkpoint_step"] > ours and loss_only["contaminated"] is True
    assert loss_only["steps_discarded"] < d["rollback"]["steps_discarded"]
    assert "already held the damage" in d["rollback"]["note"]
    assert d["detectors"]["light_lead_over_loss_spike"] > 0


def test_loss_only_checkpoint_after_onset_is_marked_contaminated() -> None:
    # Checkpoints every 10 steps: the loss-only choice (before the loss spike) is later than the onset.
    d = analyze(trace("mlp_weight_corruption"), checkpoint_every=1).to_dict()
    r = d["rollback"]
    assert r["checkpoint_step"] == d["root"]["onset_step"] - 1
    n = r["loss_only"]
    assert n["alarm_step"] is not None and n["alarm_step"] > d["root"]["onset_step"]
    assert n["checkpoint_step"] == n["alarm_step"] - 1 and n["contaminated"] is True
    assert "already held the damage" in r["note"]


def test_checkpoints_from_a_glob_parse_the_step(tmp_path) -> None:
    for s in (40, 120, 160):
        (tmp_path / f"ckpt-step{s}.pt").write_bytes(b"")
    found = from_glob(str(tmp_path / "*.pt"))
    assert [c.step for c in found] == [40, 120, 160]
    d = analyze(trace("mlp_weight_corruption"), checkpoints_glob=str(tmp_path / "*.pt")).to_dict()
    assert d["rollback"]["checkpoint_step"] == 120
    assert d["rollback"]["checkpoint_path"].endswith("ckpt-step120.pt")


def test_bad_checkpoint_options_are_named(tmp_path) -> None:
    with pytest.raises(CheckpointError, match="matched no file"):
        from_glob(str(tmp_path / "*.pt"))
    with pytest.raises(CheckpointError, match="--checkpoint-every must be >= 1"):
        every(0, 100)
    with pytest.raises(CheckpointError, match="pass one of them"):  # the glob used to win silently
        analyze(trace("mlp_weight_corruption"), checkpoints_glob=str(tmp_path / "*.pt"), checkpoint_every=50)


def _unrecorded_run(tmp_path: Path, layout: str) -> Path:
    """A faulty run whose script saved checkpoints every 50 steps without `rec.checkpoint`, in
    one framework's layout beside its trace; the trace's path."""
    run = tmp_path / layout
    shutil.copytree(trace("mlp_weight_corruption", checkpoint_every=0), run / "trace")
    state = {"model": torch.nn.Linear(2, 2).state_dict()}  # the engine reads names, never weights
    for step in range(50, 301, 50):
        path = {"script": run / "checkpoints" / f"step-{step:06d}.pt",
                "trainer": run / f"checkpoint-{step}" / "pytorch_model.bin",
                "lightning": run / "lightning_logs" / "version_0" / "checkpoints" / f"epoch=0-step={step}.ckpt"}[layout]
        path.parent.mkdir(parents=True, exist_ok=True)
        torch.save(state, path)
    return run / "trace"


@pytest.mark.parametrize("layout", ["script", "trainer", "lightning"])
def test_checkpoints_beside_a_trace_that_recorded_none_are_found_and_said(tmp_path: Path, layout: str) -> None:
    path = _unrecorded_run(tmp_path, layout)
    onset = truth(path)["step"]
    a = analyze(path)
    r = a.to_dict()["rollback"]
    assert r["checkpoint_source"] == "found"
    assert r["checkpoint_step"] == max(s for s in range(50, 301, 50) if s < onset)
    assert str(r["checkpoint_step"]) in Path(r["checkpoint_path"]).name
    said = [w for w in a.warnings if w.startswith("no checkpoint recorded in the trace")]
    assert len(said) == 1 and "rec.checkpoint(path)" in said[0] and "--checkpoints" in said[0]


def test_a_trace_without_checkpoints_anywhere_says_why_it_restarts(tmp_path: Path) -> None:
    shutil.copytree(trace("mlp_weight_corruption", checkpoint_every=0), tmp_path / "trace")
    r = analyze(tmp_path / "trace").to_dict()["rollback"]
    assert (r["checkpoint_step"], r["checkpoint_source"]) == (0, "trace")
    assert "no checkpoint was recorded (rec.checkpoint(path)) or found beside the trace" in r["note"]


def test_a_one_step_skip_is_said_as_one_step_in_the_note() -> None:
    from warninglight.forensics.explaining.rollback import Checkpoint, recommend

    one = recommend(None, [Checkpoint(100, "ck/100.pt")], "trace", 150, 150, None, 200)
    assert one.skip_step_range == [150, 150] and "; skip step 150;" in one.note + ";"
    two = recommend(None, [Checkpoint(100, "ck/100.pt")], "trace", 150, 151, None, 200)
    assert "; skip steps 150-151" in two.note
