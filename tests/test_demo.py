"""The demo's library side: train, record, analyse, report into one folder; safe to re-run."""

from __future__ import annotations

from pathlib import Path

import pytest
from typer.testing import CliRunner
from warninglight.cli.main import app
from warninglight.lab import demo


def test_demo_writes_trace_checkpoints_and_report(tmp_path: Path) -> None:
    # the MLP scenario keeps the test short; the command's default is the GPT one
    first = demo.run_demo(tmp_path, scenario="mlp_weight_corruption", steps=200)
    again = demo.run_demo(tmp_path, scenario="mlp_weight_corruption", steps=200)  # re-run replaces
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == ["step-000100.pt", "step-000200.pt"]
    assert [p.name for p in (tmp_path / "trace" / "health" / "rank=0").iterdir()] == ["incarnation=1"]
    assert again.report == tmp_path / "report.html" and again.report.stat().st_size > 10_000
    assert first.truth["component"] == "2" and first.truth["step"] == 150
    assert again.line == first.line  # same seed, same run, same verdict
    root = again.result["root"]  # the injected fault is found, on the layer it was injected into
    assert (root["attributed_to"], root["condition"]) == ("2", "exploding"), root
    assert abs(root["onset_step"] - 150) <= 2, root
    assert again.line.startswith("ALARM 2: exploding (|z| ")
    assert f"onset step {root['onset_step']}" in again.line
    assert "weight_corruption on 2 at step 150" in demo.describe_truth(again.truth)


def test_demo_refuses_to_delete_a_folder_it_did_not_make(tmp_path: Path) -> None:
    (tmp_path / "trace").mkdir()
    (tmp_path / "trace" / "notes.txt").write_text("mine")
    with pytest.raises(demo.DemoError, match="holds files the demo did not write"):
        demo.run_demo(tmp_path, scenario="mlp_clean", steps=10)
    assert (tmp_path / "trace" / "notes.txt").read_text() == "mine"


def test_demo_cli_unknown_scenario_is_one_line(tmp_path: Path) -> None:
    res = CliRunner().invoke(app, ["demo", "--out", str(tmp_path), "--scenario", "nope"])
    assert res.exit_code == 2
    assert "unknown scenario 'nope'" in res.output and "Traceback" not in res.output


def test_demo_cli_out_naming_a_file_is_one_line(tmp_path: Path) -> None:
    out = tmp_path / "notes.txt"
    out.write_text("mine")
    res = CliRunner().invoke(app, ["demo", "--out", str(out)])
    assert res.exit_code == 2, res.output
    assert res.stderr.strip().startswith(f"error: --out {out} is a file; the demo writes a folder")
    assert out.read_text() == "mine"


def test_demo_puts_torch_threads_back_even_when_it_fails(tmp_path: Path) -> None:
    import torch
    from conftest import torch_threads
    from warninglight.lab.rehearsal import ScenarioError

    with torch_threads(3):
        with pytest.raises(ScenarioError):
            demo.run_demo(tmp_path / "out", scenario="no_such_scenario", threads=1)
        assert torch.get_num_threads() == 3
