"""`analyze --reference`: faults present from the first step, found against a known-good run."""

from __future__ import annotations

import functools

import torch
from rehearsed import ROOT, trace
from typer.testing import CliRunner
from warninglight.cli.main import app
from warninglight.forensics import analyze
from warninglight.lab.rehearsal import rehearse

STEPS = 100


@functools.cache
def reference() -> str:
    """A clean run of the MLP set-up with another seed."""
    torch.set_num_threads(1)
    out = ROOT / "mlp-reference"
    rehearse("mlp_clean", out, seed=1000, steps=STEPS, checkpoint_every=0)
    return str(out)


def test_a_layer_frozen_from_step_one_is_invisible_alone_and_found_against_a_reference() -> None:
    path = trace("mlp_frozen_by_mistake", steps=STEPS)
    assert analyze(path).verdict == "healthy"  # no "before" to compare with
    root = analyze(path, reference=reference()).to_dict()["root"]
    assert (root["attributed_to"], root["condition"], root["onset_step"]) == ("2", "stagnant", 1)


def test_a_clean_run_is_healthy_against_a_reference_of_another_seed() -> None:
    assert analyze(trace("mlp_clean", steps=STEPS), reference=reference()).verdict == "healthy"


def test_parameters_no_optimizer_holds_are_found_without_a_reference() -> None:
    root = analyze(trace("mlp_not_in_optimizer", steps=STEPS)).to_dict()["root"]
    assert (root["attributed_to"], root["condition"], root["onset_step"], root["alarm_step"]) == ("2", "stagnant", 1, 1)
    assert "never applied" in root["evidence"]


def test_cli_reference_of_another_model_is_a_one_line_error() -> None:
    other = trace("cnn_clean", steps=70)
    result = CliRunner().invoke(app, ["analyze", str(trace("mlp_clean", steps=STEPS)), "--reference", str(other)])
    assert result.exit_code == 2
    assert "has no component" in result.output and "same model" in result.output
