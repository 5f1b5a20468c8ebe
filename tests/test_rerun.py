"""Re-running an incident: real recorded training, real checkpoints, an entry file, the CLI."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

import pytest
from typer.testing import CliRunner
from warninglight.cli.main import app
from warninglight.forensics.explaining import saved_rerun
from warninglight.lab import incidents
from warninglight.recovery import rerun as rr

ENTRY = '''
import math
from types import SimpleNamespace

import torch
from warninglight.lab import incidents


def entry(path):
    return incidents.entry(path)


def no_optimizer_state(path):
    state = torch.load(path, weights_only=True)
    model, optimizer = incidents.build(0)
    model.load_state_dict(state["model"])  # the optimizer's state is not loaded
    scheduler = incidents.scheduler(state["incident"], optimizer)
    scheduler.load_state_dict(state["scheduler"])
    return SimpleNamespace(model=model, optimizer=optimizer, scheduler=scheduler,
                           batch=incidents.entry(path).batch, step=incidents.train_step)


def wrong_shape(path):
    return {"model": incidents.entry(path).model}


def unknown_ids(path):
    e = incidents.entry(path)
    return SimpleNamespace(**{**vars(e), "batch": lambda ids: {}[ids[0]]})


def crashes(path):
    def step(model, optimizer, batch):
        raise RuntimeError("CUDA error: an illegal memory access")
    return SimpleNamespace(**{**vars(incidents.entry(path)), "step": step})


def nan_at_once(path):
    return SimpleNamespace(**{**vars(incidents.entry(path)), "step": lambda m, o, b: math.nan})
'''


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    base = tmp_path_factory.mktemp("rerun")
    (base / "entry.py").write_text(ENTRY)
    (base / "broken.py").write_text("def entry(path:\n")
    for name in ("transient", "poisoned", "lr_spike"):
        incidents.record(name, base / name)
    return {"base": base, "entry": base / "entry.py"}


def _hash(path: Path) -> str:
    return hashlib.sha256(b"".join(p.read_bytes() for p in sorted(path.rglob("*")) if p.is_file())).hexdigest()


def _cli(*args: str) -> Any:
    return CliRunner().invoke(app, ["rerun", *args])


def test_a_weight_corruption_in_the_step_is_transient_with_its_rank(runs: dict[str, Any]) -> None:
    trace = runs["base"] / "transient" / "trace"
    before = _hash(trace)
    r = rr.rerun(trace, incidents.entry)
    assert r.verdict == rr.TRANSIENT, r.reason
    assert (r.steps, r.checkpoint_step, r.onset_step) == ([101, r.alarm_step + rr.MARGIN], 100, incidents.FAULT)
    assert r.evidence is not None and r.evidence.component == "2" and r.evidence.swapped_z is None
    assert r.rank == 0 and r.host and f"rank 0, {r.host}" in r.reason
    assert r.pre_onset_divergence == 0.0 and r.diverged_at == incidents.FAULT  # CPU re-runs repeat bit for bit
    assert _hash(trace) == before and not (trace / "rerun.json").exists()
    assert saved_rerun.load(trace)["verdict"] == rr.TRANSIENT


def test_poisoned_samples_are_data_and_the_proofreader_names_them(runs: dict[str, Any]) -> None:
    trace = runs["base"] / "poisoned" / "trace"
    got = _cli(str(trace), "--entry", f"{runs['entry']}:entry", "--json")
    assert got.exit_code == 0, got.output
    d = json.loads(got.stdout)
    assert d["verdict"] == rr.DATA, d["reason"]
    assert d["evidence"]["component"] == "0" and d["evidence"]["swapped_z"] < rr.Z_MIN
    truth = set(incidents.poisoned_ids("poisoned", 0))
    listed = set(json.loads(Path(d["skip_ids_file"]).read_text()))
    assert listed == set(d["proofreader"]["skip_ids"])
    assert len(listed & truth) >= 0.9 * len(truth) and len(listed - truth) <= 0.1 * len(listed)
    proof = d["proofreader"]
    assert proof["backward_passes"] == proof["samples_judged"] + proof["reference_samples"]
    assert proof["samples_judged"] == (d["steps"][1] - incidents.FAULT + 1) * incidents.BATCH  # onset to the end


def test_an_lr_spike_in_the_schedule_is_recipe(runs: dict[str, Any]) -> None:
    r = rr.rerun(runs["base"] / "lr_spike" / "trace", incidents.entry)
    assert r.verdict == rr.RECIPE, r.reason
    assert r.evidence is not None and r.evidence.swapped_z >= rr.Z_MIN and r.proofreader is None
    assert Path(r.out, rr.SWAPPED).is_dir()


def test_a_checkpoint_without_optimizer_state_is_not_comparable(runs: dict[str, Any], tmp_path: Path) -> None:
    r = rr.rerun(runs["base"] / "transient" / "trace", f"{runs['entry']}:no_optimizer_state", out=tmp_path / "r")
    assert r.verdict == rr.NOT_COMPARABLE and "optimizer holds no state" in r.reason
    assert r.pre_onset_divergence > rr.AGREE_MAX


@pytest.mark.parametrize(("entry", "message"), [
    ("broken.py:entry", "importing"),
    ("entry.py:missing", "defines no function missing"),
    ("entry.py", "expected FILE.py:FUNC"),
    ("entry.py:wrong_shape", "optimizer, batch, step are missing"),
    ("entry.py:unknown_ids", "batch(ids) failed for step 101"),
    ("entry.py:crashes", "raised at step 101: RuntimeError"),
    ("entry.py:nan_at_once", "first step (step 101) gave a loss of nan"),
])
def test_bad_entries_are_one_line_errors_and_the_trace_is_untouched(runs: dict[str, Any], entry: str,
                                                                     message: str) -> None:
    trace = runs["base"] / "poisoned" / "trace"
    before = _hash(trace)
    out = runs["base"] / "bad.rerun"
    got = _cli(str(trace), "--entry", str(runs["base"] / entry), "--out", str(out))
    assert got.exit_code == 2, got.output
    assert got.stderr.startswith("error: ") and got.stderr.count("\n") == 1 and message in got.stderr, got.stderr
    assert _hash(trace) == before and not out.exists()


def test_a_missing_checkpoint_and_an_existing_rerun_are_refused(runs: dict[str, Any]) -> None:
    trace = runs["base"] / "lr_spike" / "trace"
    entry = f"{runs['entry']}:entry"
    ckpt = runs["base"] / "lr_spike" / "checkpoints" / "step-000100.pt"
    ckpt.rename(ckpt.with_suffix(".moved"))
    try:
        got = _cli(str(trace), "--entry", entry, "--out", str(runs["base"] / "m.rerun"))
    finally:
        ckpt.with_suffix(".moved").rename(ckpt)
    assert got.exit_code == 2 and "step-000100.pt) is missing" in got.stderr, got.output
    rr.rerun(trace, entry) if not rr.default_out(trace).exists() else None
    got = _cli(str(trace), "--entry", entry)
    assert got.exit_code == 2 and "already exists — pass --force" in got.stderr, got.output
    got = _cli(str(trace), "--entry", entry, "--steps", "60:150")
    assert got.exit_code == 2 and "no checkpoint recorded at step 59" in got.stderr, got.output


def test_the_lab_table_says_when_a_target_is_missed() -> None:
    right = incidents.Outcome("poisoned", 0, "data", "data", 12, 12, 12, 1.0)
    assert incidents.table([right]).endswith("met.") and "100%" in incidents.table([right])
    assert "**not met**" in incidents.table([right, incidents.Outcome("lr_spike", 0, "recipe", "data", 0, 0, 0, 1.0)])
    assert "**not met**" in incidents.table([incidents.Outcome("poisoned", 0, "data", "data", 12, 12, 10, 1.0)])


def test_analyze_and_rollback_show_the_saved_rerun(runs: dict[str, Any]) -> None:
    trace = runs["base"] / "poisoned" / "trace"
    if not saved_rerun.default_out(trace).exists():
        rr.rerun(trace, incidents.entry)
    for command in ("analyze", "rollback"):
        got = CliRunner().invoke(app, [command, str(trace)])
        assert got.exit_code == 0, got.output
        assert "rerun: data — " in got.stdout and "rerun: skip 12 samples instead of steps 120-" in got.stdout
    saved = json.loads(CliRunner().invoke(app, ["analyze", str(trace), "--json"]).stdout)["rerun"]
    assert saved["verdict"] == rr.DATA and len(saved["proofreader"]["skip_ids"]) == 12
    report = trace.parent / "report.html"
    assert CliRunner().invoke(app, ["report", str(trace), "-o", str(report), "--force"]).exit_code == 0
    page = report.read_text()
    assert "<b>Re-run:</b>" in page and "rerun: skip 12 samples instead of steps 120-" in page


def test_a_trace_without_a_rerun_says_none(runs: dict[str, Any]) -> None:
    trace = runs["base"] / "lr_spike" / "trace"
    saved = json.loads(CliRunner().invoke(app, ["analyze", str(trace), "--json"]).stdout)
    assert "rerun" in saved and (saved["rerun"] is None) == (not saved_rerun.default_out(trace).exists())
