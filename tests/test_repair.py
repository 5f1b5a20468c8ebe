"""Component repair: real rehearsed training, real checkpoints in every format, the CLI."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

import polars as pl
import pytest
import torch
from typer.testing import CliRunner
from warninglight.cli.main import app
from warninglight.forensics import analyze
from warninglight.forensics.explaining import repairable
from warninglight.forensics.judging.conditions import Config
from warninglight.lab.rehearsal import SCENARIOS, build_model, rehearse
from warninglight.recovery.repair import RepairError, RepairRefused, repair
from warninglight.tracer import watch

ROOT_KEYS = ("2.weight", "2.bias")  # mlp_weight_corruption scales module "2" at step 150


@pytest.fixture(scope="module")
def run(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """mlp_weight_corruption, checkpoints at steps 100 (clean), 200 and 300 (damaged)."""
    base = tmp_path_factory.mktemp("repair")
    rehearse("mlp_weight_corruption", base / "trace", checkpoint_dir=base / "ckpt", checkpoint_every=100)
    return {"base": base, "trace": base / "trace", "analysis": analyze(base / "trace"),
            "clean": base / "ckpt" / "step-000100.pt", "mid": base / "ckpt" / "step-000200.pt",
            "latest": base / "ckpt" / "step-000300.pt"}


def _hash(path: Path) -> str:
    files = sorted(path.rglob("*")) if path.is_dir() else [path]
    return hashlib.sha256(b"".join(f.read_bytes() for f in files if f.is_file())).hexdigest()


def _fresh() -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    sc = SCENARIOS["mlp_weight_corruption"]
    model, head = build_model(sc, 0)
    return model, torch.optim.Adam(model.parameters(), lr=sc.lr)


def _index(run: dict[str, Any], component: str) -> list[int]:
    comps = run["analysis"].components.filter(pl.col("component") == component)
    return comps["optimizer_index"].to_list()[0]


def test_the_recorder_writes_each_parameters_name_and_optimizer_index(tmp_path: Path) -> None:
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2))
    # the optimizer's order is not the model's: the head first, in a group of its own
    opt = torch.optim.Adam([{"params": list(model[2].parameters())}, {"params": list(model[0].parameters())}])
    with watch(model, opt, tmp_path / "t") as rec:
        for _ in range(2):
            loss = model(torch.randn(8, 4)).pow(2).mean()
            opt.zero_grad()
            loss.backward()
            opt.step()
            rec.log(loss=loss.item())
    from warninglight.forensics import open_trace

    trace = open_trace(tmp_path / "t")
    rows = trace.sql("SELECT component, param_names, optimizer_index FROM components ORDER BY component").fetchall()
    trace.close()
    assert rows == [("0", ["0.weight", "0.bias"], [2, 3]), ("1", None, None), ("2", ["2.weight", "2.bias"], [0, 1])]
    groups = opt.state_dict()["param_groups"]
    assert [g["params"] for g in groups] == [[0, 1], [2, 3]]


def test_repair_takes_only_the_root_component_from_the_clean_checkpoint(run: dict[str, Any]) -> None:
    out = run["base"] / "repaired.pt"
    result = repair(run["trace"], run["latest"], out, analysis=run["analysis"])
    new, clean, latest = (torch.load(p, weights_only=True) for p in (out, run["clean"], run["latest"]))
    assert [c.component for c in result.components] == ["2"]
    for key, value in new["model"].items():
        expected = clean if key in ROOT_KEYS else latest
        assert torch.equal(value, expected["model"][key]), key
    root_index = set(_index(run, "2"))
    assert root_index == {2, 3}  # Adam's state keys of 2.weight, 2.bias
    for i, state in new["optimizer"]["state"].items():
        expected = clean if i in root_index else latest
        for name, tensor in state.items():
            assert torch.equal(tensor, expected["optimizer"]["state"][i][name]), (i, name)
    assert new["optimizer"]["param_groups"] == latest["optimizer"]["param_groups"]
    assert new["step"] == 300
    model, opt = _fresh()
    model.load_state_dict(new["model"], strict=True)
    opt.load_state_dict(new["optimizer"])
    x = torch.randn(16, model[0].in_features)
    model(x).sum().backward()
    opt.step()  # it trains on


def test_repair_says_what_it_changed_and_kept(run: dict[str, Any]) -> None:
    result = repair(run["trace"], run["latest"], run["base"] / "said.pt", analysis=run["analysis"])
    clean, latest = (torch.load(p, weights_only=True)["model"] for p in (run["clean"], run["latest"]))
    diff = sum(float((latest[k].double() - clean[k].double()).pow(2).sum()) for k in ROOT_KEYS)
    base = sum(float(clean[k].double().pow(2).sum()) for k in ROOT_KEYS)
    (change,) = result.components
    assert change.relative_change == pytest.approx((diff / base) ** 0.5)
    assert change.relative_change > 5  # scaled ×10 at step 150
    assert change.ceiling == Config().condition("exploding").ceiling
    assert change.tensors == list(ROOT_KEYS) and change.optimizer_states == [2, 3]
    assert (result.latest_step, result.clean_step, result.steps_kept) == (300, 100, 200)
    assert result.components_kept == 3 and result.format == "torch" and result.optimizer_state


def test_cli_repair_prints_the_change_and_writes_the_checkpoint(run: dict[str, Any]) -> None:
    out = run["base"] / "cli.pt"
    got = CliRunner().invoke(app, ["repair", str(run["trace"]), "--from", str(run["latest"]), "-o", str(out), "--json"])
    assert got.exit_code == 0, got.output
    said = json.loads(got.stdout)
    assert said["components"][0]["component"] == "2" and said["steps_kept"] == 200
    assert said["clean"] == run["analysis"].rollback.checkpoint_path and out.exists()
    text = CliRunner().invoke(app, ["repair", str(run["trace"]), "--from", str(run["latest"]), "-o", str(out) + "x"])
    assert text.exit_code == 0
    assert "kept: 200 steps of learning (step 300 - step 100) in each of 3 other components" in text.stdout


def test_analyze_json_says_whether_to_repair(run: dict[str, Any]) -> None:
    said = run["analysis"].to_dict()["repair"]
    assert said["sound"] and said["components"] == ["2"]
    assert (said["clean_step"], said["latest_step"], said["steps_kept"]) == (100, 300, 200)
    assert said["recommended"] == ("exploding" in repairable.RECOMMENDED)


# --- refusals --------------------------------------------------------------------------------

def _alarms(rows: list[tuple[str, str, int]]) -> pl.DataFrame:
    return pl.DataFrame({"attributed_to": [r[0] for r in rows], "metric": [r[1] for r in rows],
                         "onset_step": [r[2] for r in rows]}, schema={"attributed_to": pl.String,
                                                                    "metric": pl.String, "onset_step": pl.Int64})


_OWNERS = pl.DataFrame({"component": ["a", "b", "c", "d", "e", "f", "g", "relu"],
                        "param_count": [10, 10, 10, 10, 10, 10, 10, 0]})


@pytest.mark.parametrize(("scope", "root", "clean", "latest", "alarms", "why"), [
    ("data", "", 100, 300, [], "the root is the data"),
    ("optimizer", "", 100, 300, [], "the root is the optimizer"),
    ("replicas", "", 100, 300, [], "no single component"),
    ("component", "relu", 100, 300, [], "owns no parameters"),
    ("component", "a", 200, 300, [], "older than the clean checkpoint (step 200)"),
    ("component", "a", 100, 140, [], "no checkpoint since the onset"),
    ("component", "a", None, 300, [], "no clean checkpoint"),
    ("component", "a", 100, 300, [("b", "weight_norm_l2", 160), ("c", "update_ratio", 170), ("d", "update_cos", 180)],
     "the damage has spread: 3 other components"),
])
def test_judge_refuses_what_is_not_one_components_damage(scope: str, root: str, clean: int | None, latest: int,
                                                         alarms: list[tuple[str, str, int]], why: str) -> None:
    got = repairable.judge(scope, root, "exploding", 150, _alarms(alarms), _OWNERS, clean, latest)
    assert not got.sound and why in got.reason, got.reason


def test_judge_repairs_components_damaged_in_their_weights_and_passes_over_effects() -> None:
    alarms = _alarms([("a", "out_rms", 150), ("b", "grad_norm_l2", 151), ("c", "out_rms", 152),
                      ("d", "weight_norm_l2", 155), ("e", "update_ratio", 400), ("f", "update_ratio", 120)])
    got = repairable.judge("component", "a", "exploding", 150, alarms, _OWNERS, 100, 300)
    # b, c: gradient and forward effects; e: after the latest checkpoint; f: before the onset
    assert got.sound and got.components == ["a", "d"] and got.steps_kept == 200


def test_a_fault_older_than_the_clean_checkpoint_is_refused_and_nothing_written(run: dict[str, Any]) -> None:
    out = run["base"] / "refused.pt"
    got = CliRunner().invoke(app, ["repair", str(run["trace"]), "--from", str(run["latest"]),
                                   "--clean", str(run["mid"]), "-o", str(out)])
    assert got.exit_code == 1 and not out.exists()
    assert got.stderr.count("\n") == 1 and "refused:" in got.stderr and "older than the clean checkpoint" in got.stderr
    with pytest.raises(RepairRefused, match="onset step 150"):
        repair(run["trace"], run["latest"], out, run["mid"], analysis=run["analysis"])


def test_a_healthy_run_is_refused(tmp_path: Path) -> None:
    rehearse("mlp_clean", tmp_path / "t", steps=60, checkpoint_dir=tmp_path / "c", checkpoint_every=30)
    with pytest.raises(RepairRefused, match="healthy"):
        repair(tmp_path / "t", tmp_path / "c" / "step-000060.pt", tmp_path / "out.pt")
    assert not (tmp_path / "out.pt").exists()


# --- bad input -------------------------------------------------------------------------------

def _other_model(base: Path) -> Path:
    path = base / "other-step-000300.pt"
    model, _ = build_model(SCENARIOS["cnn_clean"], 0)
    torch.save({"model": model.state_dict(), "optimizer": torch.optim.Adam(model.parameters()).state_dict(),
                "step": 300}, path)
    return path


def _no_optimizer(run: dict[str, Any]) -> Path:
    path = run["base"] / "bare-step-000300.pt"
    torch.save(torch.load(run["latest"], weights_only=True)["model"], path)
    return path


def _unknown(run: dict[str, Any]) -> Path:
    path = run["base"] / "notes-000300.txt"
    path.write_text("not a checkpoint")
    return path


@pytest.mark.parametrize(("make", "args", "message"), [
    (lambda run: _other_model(run["base"]), [], "does not hold this trace's model"),
    (_no_optimizer, [], "holds no optimizer state; repair the weights only with --weights-only"),
    (_unknown, [], "not a torch.save file"),
    (lambda run: run["latest"], ["--clean", "LATEST"], "is an input"),
    (lambda run: run["clean"], ["--clean", "LATEST"], "not older than the latest"),
    (lambda run: run["latest"], ["--model-key", "weights"], "no key 'weights' (--model-key)"),
])
def test_bad_input_is_one_line_exit_2_and_writes_nothing(run: dict[str, Any], make: Any, args: list[str],
                                                         message: str) -> None:
    given = make(run)
    args = [str(run["latest"]) if a == "LATEST" else a for a in args]
    out = run["base"] / "bad" / "out.pt"
    out.parent.mkdir(exist_ok=True)
    if "is an input" in message:
        out = run["latest"]
    inputs = [given, run["latest"], run["clean"]]
    before = [_hash(p) for p in inputs]
    got = CliRunner().invoke(app, ["repair", str(run["trace"]), "--from", str(given), "-o", str(out), *args])
    assert got.exit_code == 2, got.output
    assert got.stderr.startswith("error: ") and got.stderr.count("\n") == 1 and message in got.stderr, got.stderr
    assert [_hash(p) for p in inputs] == before
    assert not any((run["base"] / "bad").iterdir()), "nothing written"


def test_weights_only_repairs_a_bare_state_dict(run: dict[str, Any]) -> None:
    bare = _no_optimizer(run)
    clean = run["base"] / "bare-clean-step-000100.pt"
    torch.save(torch.load(run["clean"], weights_only=True)["model"], clean)
    out = run["base"] / "bare-repaired.pt"
    result = repair(run["trace"], bare, out, clean, weights_only=True, analysis=run["analysis"])
    new = torch.load(out, weights_only=True)
    assert set(new) == set(torch.load(bare, weights_only=True)) and result.format == "state_dict"
    assert torch.equal(new["2.weight"], torch.load(clean, weights_only=True)["2.weight"])
    assert not result.optimizer_state and "weights only" in result.note
    with pytest.raises(RepairError, match="no optimizer state"):
        repair(run["trace"], bare, run["base"] / "bare-2.pt", clean, analysis=run["analysis"])


# --- the frameworks' formats -----------------------------------------------------------------

def _trainer_folder(src: Path, at: Path, step: int) -> Path:
    """A transformers Trainer checkpoint-N/ folder of a rehearsal checkpoint, as Trainer lays it out."""
    from safetensors.torch import save_file

    state = torch.load(src, weights_only=True)
    at.mkdir(parents=True)
    save_file(state["model"], at / "model.safetensors", metadata={"format": "pt"})
    torch.save(state["optimizer"], at / "optimizer.pt")
    torch.save({"last_epoch": step}, at / "scheduler.pt")
    (at / "trainer_state.json").write_text(json.dumps({"global_step": step, "epoch": 1.0}))
    return at


def _lightning_ckpt(src: Path, at: Path, step: int) -> Path:
    """A Lightning .ckpt: the LightningModule holds the model as `self.net`."""
    state = torch.load(src, weights_only=True)
    torch.save({"epoch": 0, "global_step": step, "pytorch-lightning_version": "2.4.0",
                "state_dict": {f"net.{k}": v for k, v in state["model"].items()},
                "optimizer_states": [state["optimizer"]], "lr_schedulers": [],
                "loops": {"fit_loop": {"state_dict": {}}}}, at)
    return at


def test_trainer_checkpoint_folder_is_repaired_in_its_own_format(run: dict[str, Any]) -> None:
    pytest.importorskip("transformers")
    from safetensors.torch import load_file

    base = run["base"] / "trainer"
    latest = _trainer_folder(run["latest"], base / "checkpoint-300", 300)
    clean = _trainer_folder(run["clean"], base / "checkpoint-100", 100)
    before = _hash(latest), _hash(clean)
    out = base / "checkpoint-300-repaired"
    result = repair(run["trace"], latest, out, clean, analysis=run["analysis"])
    assert result.format == "trainer" and (result.latest_step, result.clean_step) == (300, 100)
    assert sorted(p.name for p in out.iterdir()) == sorted(p.name for p in latest.iterdir())
    new, old, last = (load_file(p / "model.safetensors") for p in (out, clean, latest))
    for key, value in new.items():
        assert torch.equal(value, (old if key in ROOT_KEYS else last)[key]), key
    model, opt = _fresh()
    model.load_state_dict(new, strict=True)
    opt.load_state_dict(torch.load(out / "optimizer.pt", weights_only=True))
    assert torch.equal(opt.state_dict()["state"][2]["exp_avg"],
                       torch.load(clean / "optimizer.pt", weights_only=True)["state"][2]["exp_avg"])
    assert (_hash(latest), _hash(clean)) == before


def test_lightning_checkpoint_is_repaired_under_its_attribute_prefix(run: dict[str, Any]) -> None:
    pytest.importorskip("lightning")
    latest = _lightning_ckpt(run["latest"], run["base"] / "epoch=0-step=300.ckpt", 300)
    clean = _lightning_ckpt(run["clean"], run["base"] / "epoch=0-step=100.ckpt", 100)
    out = run["base"] / "repaired.ckpt"
    result = repair(run["trace"], latest, out, clean, analysis=run["analysis"])
    assert result.format == "lightning" and result.prefix == "net."
    new, old, last = (torch.load(p, weights_only=True) for p in (out, clean, latest))
    assert set(new) == set(last) and new["global_step"] == 300
    for key, value in new["state_dict"].items():
        assert torch.equal(value, (old if key.removeprefix("net.") in ROOT_KEYS else last)["state_dict"][key]), key
    model, opt = _fresh()
    model.load_state_dict({k.removeprefix("net."): v for k, v in new["state_dict"].items()}, strict=True)
    opt.load_state_dict(new["optimizer_states"][0])
