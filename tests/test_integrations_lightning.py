"""Lightning with the one-line callback: a small MLP trained on CPU with accumulation and clipping."""

from __future__ import annotations

import json
import math
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F

L = pytest.importorskip("lightning.pytorch")

from lightning.pytorch.callbacks import ModelCheckpoint  # noqa: E402
from warninglight.forensics import analyze, open_trace  # noqa: E402
from warninglight.integrations.lightning import WarningLightCallback  # noqa: E402
from warninglight.lab import zoo  # noqa: E402
from warninglight.lab.drills import WeightCorruption  # noqa: E402
from warninglight.tracer import RecorderConfig, watch  # noqa: E402

STEPS, ACCUM, BATCH, SAVE_EVERY, WARMUP = 120, 2, 32, 40, 10


class Teacher(torch.utils.data.Dataset):
    def __init__(self) -> None:
        self.x, self.y = zoo.teacher_classification(n=4096)

    def __len__(self) -> int:
        return len(self.y)

    def __getitem__(self, i: int) -> dict[str, Any]:
        return {"x": self.x[i], "y": self.y[i], "sample_id": i}


class Classifier(L.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.net = zoo.mlp()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)

    def training_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> torch.Tensor:
        return F.cross_entropy(self(batch["x"]), batch["y"])

    def configure_optimizers(self) -> Any:
        opt = torch.optim.AdamW(self.parameters(), lr=3e-3)

        def warmup_cosine(step: int) -> float:
            if step < WARMUP:
                return (step + 1) / WARMUP
            return 0.5 * (1 + math.cos(math.pi * (step - WARMUP) / (STEPS - WARMUP)))

        sched = torch.optim.lr_scheduler.LambdaLR(opt, warmup_cosine)
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}


@pytest.fixture(scope="module")
def trained(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    root = tmp_path_factory.mktemp("pl")
    torch.manual_seed(0)
    ckpt = ModelCheckpoint(dirpath=root / "ckpt", every_n_train_steps=SAVE_EVERY, save_top_k=-1)
    trainer = L.Trainer(max_steps=STEPS, accumulate_grad_batches=ACCUM, gradient_clip_val=1.0,
                        accelerator="cpu", devices=1, logger=False, enable_progress_bar=False,
                        enable_model_summary=False, num_sanity_val_steps=0,
                        callbacks=[ckpt, WarningLightCallback(root / "trace")])  # the one line
    loader = torch.utils.data.DataLoader(Teacher(), batch_size=BATCH, shuffle=True)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer.fit(Classifier(), loader)
    ours = [str(w.message) for w in caught if "warninglight" in str(w.message)]
    return {"trace": root / "trace", "ckpt": root / "ckpt", "warnings": ours}


def test_one_health_step_per_optimizer_step(trained: dict[str, Any]) -> None:
    assert trained["warnings"] == []
    trace = open_trace(trained["trace"])
    try:
        steps = trace.con.execute(
            "SELECT step, micro_batches, lr, loss, batch_ids FROM steps ORDER BY step").fetchall()
        ckpts = trace.con.execute("SELECT step, path FROM checkpoints ORDER BY step").fetchall()
    finally:
        trace.close()
    assert [s for s, *_ in steps] == list(range(1, STEPS + 1))
    assert {m for _, m, *_ in steps} == {ACCUM}
    lrs = [lr for _, _, lr, _, _ in steps]
    assert lrs[0] < lrs[WARMUP - 1] and lrs[-1] < lrs[STEPS // 2]
    assert all(loss is not None and 0 < loss < 10 for *_, loss, _ in steps)
    assert all(len(ids) == ACCUM * BATCH and len(set(ids)) == len(ids) for *_, ids in steps)
    assert [s for s, _ in ckpts] == list(range(SAVE_EVERY, STEPS + 1, SAVE_EVERY))
    for step, path in ckpts:
        assert Path(path).parent == trained["ckpt"] and f"step={step}" in Path(path).name
        assert Path(path).is_file()


def test_clean_warmup_cosine_clipped_run_is_healthy(trained: dict[str, Any]) -> None:
    result = analyze(trained["trace"])
    assert result.summary["steps"] == STEPS
    assert result.verdict == "healthy", result.to_dict()["alarms"]


def test_a_config_object_reaches_the_trace_and_keeps_its_start_step(tmp_path: Path) -> None:
    # the callback starts at the trainer's step only where neither keywords nor config say
    config = RecorderConfig(start_step=50, run_id="pl-7", run_config={"team": "a"})
    trainer = L.Trainer(max_steps=3, accelerator="cpu", devices=1, logger=False,
                        enable_progress_bar=False, enable_model_summary=False,
                        enable_checkpointing=False, num_sanity_val_steps=0,
                        callbacks=[WarningLightCallback(tmp_path / "trace", config=config)])
    trainer.fit(Classifier(), torch.utils.data.DataLoader(Teacher(), batch_size=BATCH))
    trace = open_trace(tmp_path / "trace")
    try:
        steps = [s for (s,) in trace.con.execute("SELECT step FROM steps ORDER BY step").fetchall()]
    finally:
        trace.close()
    assert steps == [51, 52, 53]
    manifest = json.loads((tmp_path / "trace" / "manifest" / "rank=0.json").read_text())
    assert (manifest["run_id"], manifest["config"]["team"]) == ("pl-7", "a")


def test_watch_unwraps_lightningoptimizer(tmp_path: Path) -> None:
    from lightning.pytorch.core.optimizer import LightningOptimizer

    model = zoo.mlp()
    inner = torch.optim.SGD(model.parameters(), 0.1)
    with watch(model, LightningOptimizer(inner), tmp_path) as rec:
        for _ in range(3):
            model(torch.randn(4, 32)).sum().backward()
            inner.step()  # what LightningOptimizer.step does through its strategy
            inner.zero_grad()
    assert rec.step_count == 3  # the wrapper shares the optimizer's hook tables: steps are seen


def test_watch_warns_on_an_optimizer_like_object_it_cannot_hook(tmp_path: Path) -> None:
    class Opaque:  # an optimizer-like wrapper that holds no torch optimizer where we can see it
        param_groups = [{"lr": 0.1}]

        def step(self) -> None:
            pass

    model = zoo.mlp()
    with pytest.warns(RuntimeWarning, match="not a torch optimizer"), watch(model, Opaque(), tmp_path) as rec:
        model(torch.randn(4, 32)).sum().backward()
        rec.step()
    assert rec.step_count == 1


class Drill(L.Callback):
    """Runs a fault drill (`lab.drills`) at the end of each optimizer step."""

    def __init__(self, drill: WeightCorruption) -> None:
        self.drill = drill

    def on_train_batch_end(self, trainer: Any, pl_module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
        if (batch_idx + 1) % ACCUM == 0:  # the micro-batch that completed an optimizer step
            self.drill.before_step(trainer.global_step, pl_module, None)


def test_stop_on_alarm_ends_training_at_the_step_the_alarm_arrives(tmp_path: Path) -> None:
    fault, max_steps = 90, 2000
    delivered: list[int] = []  # the optimizer step at which each live alarm reached the callback
    torch.manual_seed(0)
    callback = WarningLightCallback(tmp_path / "trace", stop_on_alarm=True,
                                    on_alarm=lambda alarm: delivered.append(trainer.global_step))
    trainer = L.Trainer(max_steps=max_steps, accumulate_grad_batches=ACCUM, accelerator="cpu", devices=1,
                        logger=False, enable_progress_bar=False, enable_model_summary=False,
                        enable_checkpointing=False, callbacks=[Drill(WeightCorruption("net.0", fault)), callback])
    trainer.fit(Classifier(), torch.utils.data.DataLoader(Teacher(), batch_size=BATCH, shuffle=True))
    assert callback.alarms and min(a["step"] for a in callback.alarms) > fault
    # live alarms arrive a segment or so after their step; the run ends within a step of the first
    assert delivered and delivered[0] <= trainer.global_step <= delivered[0] + 1 < max_steps


class _Validated(Classifier):
    """The classifier with a validation loop, noting how many forward hooks its first layer has
    at each forward, and in which mode."""

    def __init__(self) -> None:
        super().__init__()
        self.seen: list[tuple[bool, int]] = []

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.seen.append((self.training, len(self.net[0]._forward_hooks)))
        return self.net(x)

    def validation_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> torch.Tensor:
        return F.cross_entropy(self(batch["x"]), batch["y"])


def test_validation_runs_without_the_hooks_and_training_keeps_them(tmp_path: Path) -> None:
    # Lightning validates under inference_mode: the components' hooks are out of their modules
    # for those passes and back for training; every training step is recorded whole
    torch.manual_seed(0)
    model = _Validated()
    data = Teacher()
    train = torch.utils.data.DataLoader(data, batch_size=BATCH, shuffle=True)
    val = torch.utils.data.DataLoader(torch.utils.data.Subset(data, range(64)), batch_size=BATCH)
    trainer = L.Trainer(max_steps=40, val_check_interval=20, accelerator="cpu", devices=1, logger=False,
                        enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0,
                        enable_checkpointing=False, callbacks=[WarningLightCallback(tmp_path / "trace")])
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer.fit(model, train, val)
    assert [str(w.message) for w in caught if "warninglight" in str(w.message)] == []
    assert [n for training, n in model.seen if training] == [1] * 40
    assert [n for training, n in model.seen if not training] == [0] * 4  # two validations of 2 batches
    trace = open_trace(tmp_path / "trace")
    rows = trace.sql("select step, count(*) filter (where out_rms is not null) from health group by step "
                     "order by step").fetchall()
    assert [s for s, _ in rows] == list(range(1, 41)) and len({n for _, n in rows}) == 1 and rows[0][1] > 0
