"""Findings of the training set-up (forensics/explaining/findings.py), on traces of real training."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from test_cli import documented_keys
from torch import nn
from typer.testing import CliRunner
from warninglight.cli.main import app
from warninglight.forensics import analyze
from warninglight.forensics.explaining.findings import FAULT, KINDS, WARNING
from warninglight.tracer import watch

STEPS = 40


def _train(path: Path, bug: str = "", steps: int = STEPS, rows: int = 32, ids: bool = True) -> Path:
    """A small MLP trained under watch with one bug of the set-up (none for "")."""
    torch.manual_seed(0)
    m = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Dropout(0.1), nn.Linear(16, 4))
    params = list(m[3].parameters()) if bug == "not_in_optimizer" else list(m.parameters())
    opt = torch.optim.Adam(params, lr=1e-3)
    if bug == "lr_zero":
        opt.param_groups[0]["lr"] = 0.0
    if bug == "eval_mode":
        m.eval()
    if bug == "detached":
        m[1].register_forward_hook(lambda mod, args, out: out.detach())
    g = torch.Generator().manual_seed(1)
    with watch(m, opt, path) as rec:
        for step in range(1, steps + 1):
            x, y = torch.randn(rows, 8, generator=g), torch.randint(0, 4, (rows,), generator=g)
            n = 1 if bug == "collapsed" or (bug == "collapsed_later" and step > 20) else rows
            loss = F.cross_entropy(m(x[:n]), y[:n])
            if bug != "no_zero_grad":
                opt.zero_grad()
            loss.backward()
            if bug == "zeroed_before_step":
                opt.zero_grad(set_to_none=False)
            opt.step()
            if bug == "warmup_from_zero":  # a schedule that starts at lr 0 for one step
                opt.param_groups[0]["lr"] = 1e-3
            if ids:
                rec.batch(list(range(rows * step, rows * step + rows)))
            rec.log(loss=loss)
    return path


@pytest.mark.parametrize(("bug", "kind", "step", "component"), [
    ("no_zero_grad", "grads_not_cleared", 2, ""),
    ("eval_mode", "eval_mode", 1, ""),
    ("collapsed", "batch_collapsed", 1, ""),
    ("lr_zero", "lr_zero", 1, ""),
    ("not_in_optimizer", "not_in_optimizer", 1, "0"),
    ("detached", "no_gradient", 1, "0"),
    ("zeroed_before_step", "zero_gradients", 1, ""),
])
def test_a_bug_of_the_set_up_is_the_root_from_the_step_it_held(tmp_path: Path, bug: str, kind: str, step: int,
                                                                 component: str) -> None:
    a = analyze(_train(tmp_path / "t", bug), heat=False)
    assert a.verdict == "fault"
    assert (a.root.scope, a.root.finding, a.root.onset_step, a.root.attributed_to) == ("setup", kind, step, component)
    got = a.to_dict()
    assert got["root"]["finding"] == kind
    assert any(f["kind"] == kind and f["severity"] == FAULT for f in got["findings"])
    assert got["rollback"]["skip_step_range"] is None  # the batches were sound


def test_clean_runs_have_no_finding(tmp_path: Path) -> None:
    for bug in ("", "warmup_from_zero"):
        a = analyze(_train(tmp_path / (bug or "clean"), bug), heat=False)
        assert (a.verdict, a.findings) == ("healthy", []), bug


def test_a_batch_that_collapses_mid_run_is_found_without_sample_ids(tmp_path: Path) -> None:
    a = analyze(_train(tmp_path / "t", "collapsed_later", ids=False), heat=False)
    assert (a.root.finding, a.root.onset_step) == ("batch_collapsed", 21)
    assert "held 1 row for 20 steps, where the run's earlier steps held 32" in a.root.evidence


def test_a_short_last_batch_of_an_epoch_is_no_finding(tmp_path: Path) -> None:
    """One small batch, then full ones again: a loader's remainder, not a collapse."""
    torch.manual_seed(0)
    m = nn.Linear(8, 4)
    opt = torch.optim.SGD(m.parameters(), lr=0.1)
    with watch(m, opt, tmp_path / "t"):
        for step in range(1, 41):
            n = 3 if step % 15 == 0 else 32
            opt.zero_grad()
            F.cross_entropy(m(torch.randn(n, 8)), torch.randint(0, 4, (n,))).backward()
            opt.step()
    assert analyze(tmp_path / "t", heat=False).findings == []


def test_a_sequence_first_input_is_not_a_collapsed_batch(tmp_path: Path) -> None:
    """(T, B) token ids, as nn.Transformer and nn.LSTM take them by default: fewer rows than ids."""
    torch.manual_seed(0)
    m = nn.Sequential(nn.Embedding(20, 8), nn.Linear(8, 20))
    opt = torch.optim.SGD(m.parameters(), lr=0.1)
    with watch(m, opt, tmp_path / "t") as rec:
        for step in range(1, 21):
            tokens = torch.randint(0, 20, (6, 16))  # T=6 rows, B=16 samples
            opt.zero_grad()
            F.cross_entropy(m(tokens).reshape(-1, 20), tokens.reshape(-1)).backward()
            opt.step()
            rec.batch(list(range(16 * step, 16 * step + 16)))
    assert analyze(tmp_path / "t", heat=False).findings == []


def test_optimizer_with_nothing_to_apply_is_a_fault(tmp_path: Path) -> None:
    """Everything frozen but the optimizer's own parameters, which are frozen too."""
    torch.manual_seed(0)
    m = nn.Sequential(nn.Linear(8, 16), nn.BatchNorm1d(16), nn.Linear(16, 4))
    for p in [*m[0].parameters(), *m[2].parameters()]:
        p.requires_grad_(False)
    opt = torch.optim.Adam(m[2].parameters())
    with watch(m, opt, tmp_path / "t"):
        for _ in range(12):
            opt.zero_grad()
            F.cross_entropy(m(torch.randn(32, 8)), torch.randint(0, 4, (32,))).backward()
            opt.step()
    kinds = {(f.kind, f.severity) for f in analyze(tmp_path / "t", heat=False).findings}
    assert kinds == {("optimizer_idle", FAULT), ("not_in_optimizer", FAULT)}


def test_frozen_batch_norm_is_a_warning_not_a_fault(tmp_path: Path) -> None:
    torch.manual_seed(0)
    m = nn.Sequential(nn.Linear(8, 16), nn.BatchNorm1d(16), nn.ReLU(), nn.Linear(16, 4))
    opt = torch.optim.SGD(m.parameters(), lr=0.05)
    with watch(m, opt, tmp_path / "t"):
        for _ in range(12):
            m.train()
            m[1].eval()
            opt.zero_grad()
            F.cross_entropy(m(torch.randn(32, 8)), torch.randint(0, 4, (32,))).backward()
            opt.step()
    a = analyze(tmp_path / "t", heat=False)
    assert a.verdict == "healthy"
    assert [(f.kind, f.severity, f.components) for f in a.findings] == [("component_eval_mode", WARNING, ["1"])]


def _cnn_run(path: Path, freeze_stem: bool, seed: int) -> Path:
    torch.manual_seed(seed)
    m = nn.Sequential(nn.Conv2d(1, 4, 3, padding=1), nn.BatchNorm2d(4), nn.ReLU(), nn.Flatten(),
                      nn.Linear(4 * 8 * 8, 3))
    if freeze_stem:
        for p in [*m[0].parameters(), *m[1].parameters()]:
            p.requires_grad_(False)
    opt = torch.optim.SGD([p for p in m.parameters() if p.requires_grad], lr=0.05, momentum=0.9)
    g = torch.Generator().manual_seed(seed)
    with watch(m, opt, path):
        for _ in range(80):
            m.train()
            if freeze_stem:
                m[1].eval()
            y = torch.randint(0, 3, (16,), generator=g)
            x = torch.randn(16, 1, 8, 8, generator=g) + y[:, None, None, None]
            opt.zero_grad()
            F.cross_entropy(m(x), y).backward()
            opt.step()
    return path


def test_against_a_reference_a_stage_meant_to_be_frozen_is_the_root_itself(tmp_path: Path) -> None:
    ref = _cnn_run(tmp_path / "ref", True, 1)
    a = analyze(_cnn_run(tmp_path / "run", False, 0), reference=ref, heat=False)
    assert (a.root.finding, a.root.attributed_to, a.root.onset_step) == ("trains_where_reference_frozen", "0", 1)
    assert a.findings[0].components == ["0", "1"]
    twin = analyze(_cnn_run(tmp_path / "twin", True, 2), reference=ref, heat=False)
    assert not any(f.kind == "trains_where_reference_frozen" for f in twin.findings)


def test_analyze_json_findings_are_the_documented_object(tmp_path: Path) -> None:
    got = CliRunner().invoke(app, ["analyze", str(_train(tmp_path / "t", "no_zero_grad")), "--json"])
    d = json.loads(got.stdout)
    documented = documented_keys()
    assert set(d["findings"][0]) == documented["`findings[]`"]
    assert set(KINDS) == documented["`findings[].kind`"]
    assert d["root"]["scope"] == "setup" and d["root"]["finding"] == "grads_not_cleared"


def test_a_fact_held_from_the_first_step_it_shows_is_the_root_of_an_earlier_onset() -> None:
    # against a reference the optimizer-wide root can begin at step 1, while gradients left
    # from a previous step can only show at the second step's backward
    from warninglight.forensics.explaining.analysis import Root, with_findings
    from warninglight.forensics.explaining.findings import Finding
    root = Root(attributed_to="", observed_on="h.0", condition="exploding", onset_step=1, alarm_step=3,
                magnitude=9.0, metric="grad_norm_l2", rank=0, ranks=[0], ranks_disagree=False,
                evidence="gradients grew", scope="optimizer")
    late = Finding("grads_not_cleared", FAULT, 2, 300, 299, ranks=[0], evidence="not cleared")
    assert with_findings(root, [late], 1) is root  # seen only after the onset: the root stands
    start = Finding("grads_not_cleared", FAULT, 2, 300, 299, ranks=[0], evidence="not cleared",
                    from_start=True)
    got = with_findings(root, [start], 1)
    assert (got.scope, got.finding, got.onset_step) == ("setup", "grads_not_cleared", 2)
