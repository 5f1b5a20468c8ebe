"""Hugging Face Trainer with the one-line callback: a tiny GPT-2 trained on CPU, no downloads."""

from __future__ import annotations

import json
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch

transformers = pytest.importorskip("transformers")
pytest.importorskip("accelerate")

from accelerate.optimizer import AcceleratedOptimizer  # noqa: E402
from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainingArguments  # noqa: E402
from warninglight.forensics import analyze, open_trace  # noqa: E402
from warninglight.integrations.transformers import WarningLightCallback  # noqa: E402
from warninglight.lab import zoo  # noqa: E402
from warninglight.lab.drills import WeightCorruption  # noqa: E402
from warninglight.tracer import RecorderConfig, watch  # noqa: E402

STEPS, ACCUM, BATCH, SAVE_EVERY, LOG_EVERY = 120, 2, 8, 40, 5


class CharWindows(torch.utils.data.Dataset):
    """Windows of the standard library's source as characters, each with its sample id."""

    def __init__(self, n: int = 2048, block: int = 32) -> None:
        tokens = zoo.char_corpus(max_bytes=200_000, vocab_size=64)
        self.windows = tokens[: n * block].reshape(n, block)

    def __len__(self) -> int:
        return len(self.windows)

    def __getitem__(self, i: int) -> dict[str, Any]:
        return {"input_ids": self.windows[i], "labels": self.windows[i], "sample_id": i}


@pytest.fixture(scope="module")
def trained(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    root = tmp_path_factory.mktemp("hf")
    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config(vocab_size=64, n_positions=32, n_embd=32, n_layer=2, n_head=2))
    args = TrainingArguments(
        output_dir=str(root / "out"), max_steps=STEPS, per_device_train_batch_size=BATCH,
        gradient_accumulation_steps=ACCUM, learning_rate=3e-3, warmup_steps=10,
        lr_scheduler_type="cosine", max_grad_norm=1.0, logging_steps=LOG_EVERY,
        save_strategy="steps", save_steps=SAVE_EVERY, report_to=[], use_cpu=True,
        disable_tqdm=True, seed=0, dataloader_num_workers=0)
    callback = WarningLightCallback(root / "trace")  # the one line
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        Trainer(model=model, args=args, train_dataset=CharWindows(), callbacks=[callback]).train()
    ours = [str(w.message) for w in caught if "warninglight" in str(w.message)]
    return {"trace": root / "trace", "out": root / "out", "warnings": ours}


def test_one_health_step_per_optimizer_step(trained: dict[str, Any]) -> None:
    assert trained["warnings"] == []
    trace = open_trace(trained["trace"])
    try:
        steps = trace.con.execute("SELECT step, micro_batches, lr, batch_ids FROM steps ORDER BY step").fetchall()
        loss_steps = [s for (s,) in trace.con.execute(
            "SELECT step FROM steps WHERE loss IS NOT NULL ORDER BY step").fetchall()]
        ckpts = trace.con.execute("SELECT step, path FROM checkpoints ORDER BY step").fetchall()
        heads = trace.con.execute("SELECT component, tied_to FROM components WHERE role = 'head'").fetchall()
    finally:
        trace.close()
    assert [s for s, *_ in steps] == list(range(1, STEPS + 1))
    assert {m for _, m, _, _ in steps} == {ACCUM}
    lrs = [lr for _, _, lr, _ in steps]
    assert lrs[0] < lrs[9] and lrs[-1] < lrs[STEPS // 2]  # warm-up, then cosine decay
    assert loss_steps == list(range(LOG_EVERY, STEPS + 1, LOG_EVERY))
    # every micro-batch's sample ids, on the step that consumed them (remove_unused_columns on)
    assert all(len(ids) == ACCUM * BATCH for *_, ids in steps)
    assert all(0 <= i < 2048 for *_, ids in steps for i in ids)
    assert [s for s, _ in ckpts] == list(range(SAVE_EVERY, STEPS + 1, SAVE_EVERY))
    for step, path in ckpts:
        assert Path(path) == trained["out"] / f"checkpoint-{step}" and Path(path).is_dir()
    # GPT-2 ties its lm_head to the token embedding: the logits head is the head all the same
    assert heads == [("lm_head", "transformer.wte")]


def test_clean_warmup_cosine_clipped_run_is_healthy(trained: dict[str, Any]) -> None:
    result = analyze(trained["trace"])
    assert result.summary["steps"] == STEPS
    assert result.verdict == "healthy", result.to_dict()["alarms"]
    assert json.loads((trained["trace"] / "manifest" / "rank=0.json").read_text())[
        "config"]["loss_logged_every"] == LOG_EVERY


def test_a_config_object_reaches_the_trace_and_keeps_what_it_sets(tmp_path: Path) -> None:
    # the callback's defaults (the trainer's step, its logging interval) fill in only what
    # neither keywords nor config say
    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config(vocab_size=64, n_positions=32, n_embd=32, n_layer=2, n_head=2))
    args = TrainingArguments(output_dir=str(tmp_path / "out"), max_steps=3, per_device_train_batch_size=BATCH,
                             logging_steps=LOG_EVERY, save_strategy="no", report_to=[], use_cpu=True,
                             disable_tqdm=True, seed=0, dataloader_num_workers=0)
    config = RecorderConfig(start_step=50, run_config={"loss_logged_every": 1})
    callback = WarningLightCallback(tmp_path / "trace", config=config)
    Trainer(model=model, args=args, train_dataset=CharWindows(n=64), callbacks=[callback]).train()
    trace = open_trace(tmp_path / "trace")
    try:
        steps = [s for (s,) in trace.con.execute("SELECT step FROM steps ORDER BY step").fetchall()]
    finally:
        trace.close()
    assert steps == [51, 52, 53]
    assert json.loads((tmp_path / "trace" / "manifest" / "rank=0.json").read_text())[
        "config"]["loss_logged_every"] == 1


def test_watch_unwraps_acceleratedoptimizer(tmp_path: Path) -> None:
    model = zoo.mlp()
    opt = AcceleratedOptimizer(torch.optim.SGD(model.parameters(), 0.1), device_placement=False)
    with watch(model, opt, tmp_path) as rec:
        for _ in range(3):
            model(torch.randn(4, 32)).sum().backward()
            opt.step()
            opt.zero_grad()
    assert rec.step_count == 3


class Drill(transformers.TrainerCallback):
    """Runs a fault drill (`lab.drills`) at the end of each optimizer step."""

    def __init__(self, drill: WeightCorruption) -> None:
        self.drill, self.model = drill, None

    def on_train_begin(self, args: Any, state: Any, control: Any, model: Any = None, **kwargs: Any) -> None:
        self.model = model

    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self.drill.before_step(state.global_step, self.model, None)  # type: ignore[arg-type]


def test_stop_on_alarm_ends_training_at_the_step_the_alarm_arrives_and_saves(tmp_path: Path) -> None:
    fault, max_steps = 90, 1000
    delivered: list[int] = []  # the optimizer step at which each live alarm reached the callback
    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config(vocab_size=64, n_positions=32, n_embd=32, n_layer=2, n_head=2))
    args = TrainingArguments(
        output_dir=str(tmp_path / "out"), max_steps=max_steps, per_device_train_batch_size=BATCH,
        learning_rate=1e-3, logging_steps=LOG_EVERY, save_strategy="no", report_to=[], use_cpu=True,
        disable_tqdm=True, seed=0, dataloader_num_workers=0)
    trainer = Trainer(model=model, args=args, train_dataset=CharWindows())
    callback = WarningLightCallback(tmp_path / "trace", stop_on_alarm=True,
                                    on_alarm=lambda alarm: delivered.append(trainer.state.global_step))
    trainer.add_callback(Drill(WeightCorruption("transformer.h.0.mlp.c_fc", fault)))  # weights x10
    trainer.add_callback(callback)
    state = trainer.train()
    assert callback.alarms and min(a["step"] for a in callback.alarms) > fault
    # live alarms arrive a segment or so after their step; the run ends at the step that got one
    assert delivered and delivered[0] <= state.global_step <= delivered[0] + 1 < max_steps
    saved = sorted(p.name for p in (tmp_path / "out").glob("checkpoint-*"))
    assert saved == [f"checkpoint-{state.global_step}"]  # and saves where it stopped
