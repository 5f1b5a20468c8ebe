"""Rehearsals: small training runs on the zoo models, recorded with `watch`, with fault drills.

`rehearse("mlp_weight_corruption", "runs/r1")` trains, records the trace, and returns (and
writes as `truth.json` beside the trace) what the drills did, so forensics can be checked
against the truth. `SCENARIOS` names the runs the tests, the benchmark and the demo use; each
runs in a few seconds on a CPU.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from . import zoo
from .drills import (
    BiasDrift,
    BiasShift,
    CollapsedBatch,
    CorruptBatches,
    DetachedOutput,
    Drill,
    EvalModeTraining,
    FreezeModule,
    FrozenByMistake,
    GradientAttenuation,
    GradientSignFlip,
    LRSpike,
    MissingZeroGrad,
    NaNInjection,
    NotInOptimizer,
    PoisonedSamples,
    PreActivationScale,
    WeightCorruption,
    WeightGrowth,
    WeightShrink,
    WrongInitScale,
    ZeroedBeforeStep,
    ZeroLearningRate,
)

TRUTH_FILE = "truth.json"


class ScenarioError(KeyError):
    """An unknown scenario name."""

    def __str__(self) -> str:
        return str(self.args[0])


@dataclass(frozen=True)
class Scenario:
    """A rehearsal: which model, how long, which optimizer, which drills."""

    name: str
    model: str  # one of MODELS
    steps: int = 300
    optimizer: str = "adam"  # "adam" | "adamw" | "sgd"
    lr: float = 1e-3
    momentum: float = 0.0
    activation: str = "relu"  # mlp hidden activation
    drills: Callable[[], list[Drill]] = field(default=list)  # a factory: fresh drills per run
    batch_size: int = 32
    schedule: str = "constant"  # a SCHEDULES key, or "manual" (the loop scales the lr at mid-run)
    weight_decay: float = 0.0
    head_group: bool = False  # the head in its own param group: lr ×0.1, no schedule
    reference: bool = False  # scored with `analyze --reference` against a clean run of its set-up


def _step_decay(step: int, n: int) -> float:
    """×0.1 at 40% and again at 70% of the run (the ResNet recipe, shortened)."""
    return 0.1 ** sum(step >= m for m in (int(0.4 * n), int(0.7 * n)))


def _warmup_cosine(step: int, n: int) -> float:
    """Linear warmup over the first 10%, then cosine to 0 (the LLM recipe)."""
    warm = max(1, n // 10)
    if step < warm:
        return (step + 1) / warm
    return 0.5 * (1 + math.cos(math.pi * (step - warm) / max(1, n - warm)))


def _one_cycle(step: int, n: int) -> float:
    """From 1/25 up to 1 over the first 30% (cosine), then down to 1/2500 (one-cycle's shape)."""
    up = max(1, int(0.3 * n))
    if step < up:
        return 1 / 25 + (1 - 1 / 25) * 0.5 * (1 - math.cos(math.pi * step / up))
    return 1 / 2500 + (1 - 1 / 2500) * 0.5 * (1 + math.cos(math.pi * (step - up) / max(1, n - up)))


def _restarts(step: int, n: int) -> float:
    """Cosine annealing with warm restarts every 100 steps (SGDR)."""
    return 0.5 * (1 + math.cos(math.pi * (step % 100) / 100))


SCHEDULES: dict[str, Callable[[int, int], float]] = {
    "constant": lambda step, n: 1.0, "step": _step_decay, "warmup_cosine": _warmup_cosine,
    "one_cycle": _one_cycle, "linear": lambda step, n: 1.0 - 0.95 * step / n, "restarts": _restarts,
}
MANUAL_FACTOR = 0.3  # "manual": the loop multiplies every group's lr by this at mid-run

def build_model(scenario: Scenario, seed: int) -> tuple[nn.Module, str | None]:
    """The scenario's model (seeded) and the name of its output head (a head tied to the token
    embedding is named as any other)."""
    torch.manual_seed(seed)
    if scenario.model == "mlp":
        return zoo.mlp(activation=scenario.activation), "6"
    if scenario.model == "cnn":
        return zoo.cnn(), "6"
    if scenario.model == "cnn_bn":
        return zoo.cnn(batchnorm=True), "8"
    if scenario.model == "gpt":
        return zoo.TinyGPT(_GPT), "lm_head"
    if scenario.model == "gpt_parallel":
        return zoo.ParallelGPT(_GPT), "lm_head"
    if scenario.model == "llama":
        return zoo.TinyLlama(_GPT), "lm_head"
    raise ScenarioError(f"unknown model {scenario.model!r}; expected one of {', '.join(MODELS)}")


_GPT = zoo.GPTConfig(vocab_size=96, block_size=32, n_layer=2, n_head=2, n_embd=32)
MODELS = ("mlp", "cnn", "cnn_bn", "gpt", "gpt_parallel", "llama")


def _data(scenario: Scenario, seed: int) -> Iterator[zoo.Batch]:
    if scenario.model == "mlp":
        x, y = zoo.teacher_classification(seed=seed)
        return zoo.batches(x, y, scenario.batch_size, seed=seed)
    if scenario.model in ("cnn", "cnn_bn"):
        x, y = zoo.blob_images(seed=seed)
        return zoo.batches(x, y, scenario.batch_size, seed=seed)
    tokens = zoo.char_corpus(max_bytes=100_000)
    return zoo.text_batches(tokens, scenario.batch_size // 2, _GPT.block_size, seed=seed)


def _optimizer(scenario: Scenario, model: nn.Module, head: str | None) -> torch.optim.Optimizer:
    params: Any = list(model.parameters())
    if scenario.head_group and head is not None:
        own = {id(p) for p in dict(model.named_modules())[head].parameters()}
        params = [{"params": [p for p in params if id(p) not in own]},
                  {"params": [p for p in params if id(p) in own], "lr": scenario.lr * 0.1}]
    wd = scenario.weight_decay
    if scenario.optimizer == "sgd":
        return torch.optim.SGD(params, lr=scenario.lr, momentum=scenario.momentum, weight_decay=wd)
    if scenario.optimizer == "adamw":
        return torch.optim.AdamW(params, lr=scenario.lr, weight_decay=wd)
    return torch.optim.Adam(params, lr=scenario.lr, weight_decay=wd)


def _scheduler(sc: Scenario, optimizer: torch.optim.Optimizer, n_steps: int) -> Any:
    """The scenario's lr schedule as a LambdaLR (made after the drills regrouped the params)."""
    if sc.schedule in ("constant", "manual"):
        return None
    if sc.schedule not in SCHEDULES:
        raise ScenarioError(f"unknown schedule {sc.schedule!r}; expected manual or one of {', '.join(SCHEDULES)}")
    shape = SCHEDULES[sc.schedule]
    lambdas = [lambda s: shape(s, n_steps)] * len(optimizer.param_groups)
    if sc.head_group:  # the head's group keeps its own, constant lr
        lambdas[-1] = lambda s: 1.0
    return torch.optim.lr_scheduler.LambdaLR(optimizer, lambdas)


def _checkpoint(rec: Any, model: nn.Module, optimizer: torch.optim.Optimizer, step: int,
                checkpoint_dir: Path | None, trace_dir: Path) -> None:
    """Save (or only announce) a checkpoint holding the state after `step` steps."""
    if checkpoint_dir is not None:
        path = checkpoint_dir / f"step-{step:06d}.pt"
        torch.save({"model": model.state_dict(), "optimizer": optimizer.state_dict(), "step": step}, path)
        rec.checkpoint(str(path))
        return
    path = trace_dir / "checkpoints" / f"step-{step:06d}.pt"
    rec.checkpoint(str(path), detail="rehearsal: no file was written")


def rehearse(scenario: str | Scenario, trace_dir: str | Path, *, seed: int = 0,
             steps: int | None = None, checkpoint_every: int = 100,
             checkpoint_dir: str | Path | None = None,
             drills: Sequence[Drill] | None = None,
             resume_from: str | Path | None = None, start_step: int = 0,
             rank: int = 0, world_size: int = 1) -> dict[str, Any]:
    """Train the scenario's model with its drills under `watch`; return (and save) the truth.

    `resume_from` (a checkpoint this function saved) and `start_step` (the step it holds) restart
    a run: the trace gets a new incarnation that continues at step `start_step + 1`. `rank` and
    `world_size` record the run as one rank of a data-parallel job (each rank trains on its own).
    """
    from warninglight.tracer import watch  # imported here: drills and scenarios need no recorder

    sc = SCENARIOS[scenario] if isinstance(scenario, str) else scenario
    n_steps = steps if steps is not None else sc.steps
    trace_dir = Path(trace_dir)
    ckpt_dir = Path(checkpoint_dir) if checkpoint_dir is not None else None
    if ckpt_dir is not None:
        ckpt_dir.mkdir(parents=True, exist_ok=True)
    model, head, optimizer = _start(sc, seed, resume_from)
    active = list(drills) if drills is not None else sc.drills()
    for d in active:
        d.attach(model, optimizer)
    scheduler = _scheduler(sc, optimizer, n_steps)
    for _ in range(start_step if scheduler is not None else 0):
        scheduler.step()
    data = _data(sc, seed)
    for _ in range(start_step):  # the batches the checkpointed steps consumed
        next(data)
    losses: list[float] = []
    try:
        with watch(model, optimizer, str(trace_dir), heads=[head] if head else None, start_step=start_step,
                   rank=rank, world_size=world_size) as rec:
            for step in range(start_step + 1, n_steps + 1):
                ids, x, y = next(data)
                if sc.schedule == "manual" and step == n_steps // 2:
                    for group in optimizer.param_groups:
                        group["lr"] *= MANUAL_FACTOR
                losses.append(_train_step(step, model, optimizer, active, x, y))
                if scheduler is not None:
                    scheduler.step()
                rec.log(loss=losses[-1])
                rec.batch(ids)
                if checkpoint_every and step % checkpoint_every == 0:
                    _checkpoint(rec, model, optimizer, step, ckpt_dir, trace_dir)
    finally:
        for d in active:
            d.detach()
    return _write_truth(trace_dir, sc, seed, n_steps, active, losses)


def _start(sc: Scenario, seed: int, resume_from: str | Path | None
           ) -> tuple[nn.Module, str | None, torch.optim.Optimizer]:
    """The model, its head's name and the optimizer: fresh, or restored from a checkpoint."""
    model, head = build_model(sc, seed)
    optimizer = _optimizer(sc, model, head)
    if resume_from is not None:
        state = torch.load(resume_from, weights_only=True)
        model.load_state_dict(state["model"])
        optimizer.load_state_dict(state["optimizer"])
    return model, head, optimizer


def restored(sc: Scenario, seed: int, checkpoint: str | Path | None) -> tuple[nn.Module, torch.optim.Optimizer]:
    """The scenario's model and optimizer with a checkpoint's state (one this module saved; None:
    as initialised)."""
    model, _, optimizer = _start(sc, seed, checkpoint)
    return model, optimizer


def batches_of(sc: Scenario, seed: int) -> Iterator[zoo.Batch]:
    """The scenario's batch stream: the n-th batch is the one step n of a rehearsal trains on."""
    return _data(sc, seed)


def train_step(model: nn.Module, optimizer: torch.optim.Optimizer, x: torch.Tensor, y: torch.Tensor) -> float:
    """One optimizer step with no drill; the loss."""
    return _train_step(0, model, optimizer, (), x, y)


def _train_step(step: int, model: nn.Module, optimizer: torch.optim.Optimizer,
                drills: Sequence[Drill], x: torch.Tensor, y: torch.Tensor) -> float:
    """One optimizer step with the drills applied; the loss."""
    for d in drills:
        d.before_step(step, model, optimizer)
        x, y = d.corrupt_batch(step, x, y)
    logits = model(x)  # (B, C) or (B, T, vocab)
    loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1))
    optimizer.zero_grad(set_to_none=True)
    loss.backward()
    optimizer.step()
    return loss.item()


def _write_truth(trace_dir: Path, sc: Scenario, seed: int, n_steps: int,
                 active: Sequence[Drill], losses: list[float]) -> dict[str, Any]:
    faults = [d.truth() for d in active if d.step <= n_steps]
    first = min(faults, key=lambda f: f["step"]) if faults else None
    truth = {
        "scenario": sc.name, "model": sc.model, "seed": seed, "steps": n_steps,
        "healthy": first is None, "faults": faults,
        **({k: first[k] for k in ("fault", "component", "step", "kind", "condition", "scope", "last_step",
                                  "finding")
            if k in first} if first else {}),
        "final_loss": losses[-1] if losses else None,
    }
    (trace_dir / TRUTH_FILE).write_text(json.dumps(truth, indent=2))  # the last rank's, if several
    return truth


def _scenarios() -> dict[str, Scenario]:
    s: list[Scenario] = []
    for model, mid, first, head in (("mlp", "2", "0", "6"), ("cnn", "2", "0", "6"),
                                    ("gpt", "h.0.mlp.c_fc", "wte", "lm_head")):
        s += [
            Scenario(f"{model}_clean", model),
            Scenario(f"{model}_weight_corruption", model,
                     drills=lambda mid=mid: [WeightCorruption(mid, 150, mode="scale", factor=10.0)]),
            Scenario(f"{model}_bitflip", model,
                     drills=lambda mid=mid: [WeightCorruption(mid, 150, mode="bitflip", fraction=0.002)]),
            Scenario(f"{model}_lr_spike", model, optimizer="sgd", lr=0.02, momentum=0.9,
                     drills=lambda: [LRSpike("", 150, factor=20.0)]),
            Scenario(f"{model}_nan", model,
                     drills=lambda mid=mid: [NaNInjection(mid, 150)]),
            Scenario(f"{model}_corrupt_batches", model,
                     drills=lambda first=first: [CorruptBatches(first, 150, duration=20)]),
            Scenario(f"{model}_frozen", model,
                     drills=lambda mid=mid: [FreezeModule(mid, 150)]),
            Scenario(f"{model}_head_shrink", model,
                     drills=lambda head=head: [WeightShrink(head, 150, rate=0.1, duration=40)]),
            Scenario(f"{model}_vanishing_gradient", model,
                     drills=lambda mid=mid: [GradientAttenuation(mid, 150)]),
            Scenario(f"{model}_bias_shift", model,
                     drills=lambda mid=mid, off=1.0 if model == "mlp" else 0.5: [BiasShift(mid, 150, offset=off)]),
        ]
        # GELU needs a deeper push than ReLU before its outputs are ~0 (GELU(-6) ~ -6e-9).
        s.append(Scenario(f"{model}_dying_layer", model,
                          drills=lambda mid=mid, rate=0.2 if model == "gpt" else 0.05:
                          [BiasDrift(mid, 150, rate=rate, duration=100)]))
    s += [
        Scenario("mlp_saturation", "mlp", activation="tanh",
                 drills=lambda: [PreActivationScale("3", 150, factor=30.0)]),
        Scenario("mlp_saturation_gradual", "mlp", activation="tanh",
                 drills=lambda: [PreActivationScale("3", 150, factor=30.0, ramp=30)]),
        # Plain SGD on large batches: consecutive gradients agree, so flipped ones show at once.
        Scenario("mlp_oscillating", "mlp", optimizer="sgd", lr=0.05, batch_size=512,
                 drills=lambda: [GradientSignFlip("2", 150)]),
        Scenario("mlp_clean_tanh", "mlp", activation="tanh"),
        Scenario("mlp_creeping_corruption", "mlp",
                 drills=lambda: [WeightGrowth("2", 150, rate=0.03, duration=150)]),
    ]
    return {sc.name: sc for sc in s + _recipes() + _from_step_one() + _bad_data()}


_BN_SGD = {"optimizer": "sgd", "lr": 0.05, "momentum": 0.9, "weight_decay": 5e-4}


def _recipes() -> list[Scenario]:
    """Real training recipes: each schedule clean, and learning-rate spikes on top of them."""
    spike = lambda: [LRSpike("", 150, factor=20.0)]  # noqa: E731
    return [
        Scenario("cnn_bn_step_clean", "cnn_bn", schedule="step", **_BN_SGD),
        Scenario("cnn_bn_restarts_clean", "cnn_bn", schedule="restarts", **_BN_SGD),
        Scenario("cnn_bn_one_cycle_clean", "cnn_bn", schedule="one_cycle", **_BN_SGD),
        Scenario("mlp_warmup_cosine_clean", "mlp", optimizer="adamw", weight_decay=0.01, schedule="warmup_cosine"),
        Scenario("gpt_warmup_cosine_clean", "gpt", optimizer="adamw", lr=3e-3, weight_decay=0.1,
                 schedule="warmup_cosine"),
        Scenario("mlp_linear_clean", "mlp", optimizer="sgd", lr=0.02, momentum=0.9, schedule="linear"),
        Scenario("mlp_manual_clean", "mlp", schedule="manual"),
        Scenario("mlp_head_group_clean", "mlp", optimizer="sgd", lr=0.02, momentum=0.9, schedule="step",
                 head_group=True),
        Scenario("cnn_bn_step_lr_spike", "cnn_bn", schedule="step", drills=spike, **_BN_SGD),
        Scenario("gpt_warmup_cosine_lr_spike", "gpt", optimizer="adamw", lr=3e-3, weight_decay=0.1,
                 schedule="warmup_cosine", drills=spike),
        Scenario("mlp_adam_lr_spike", "mlp", drills=spike),
    ]


def _from_step_one() -> list[Scenario]:
    """Faults present from the first step: bugs of the set-up, found as facts without any
    reference; and faults of the model's numbers, and a clean run, judged against a reference run."""
    s = [
        Scenario("cnn_bn_eval_mode", "cnn_bn", drills=lambda: [EvalModeTraining()], **_BN_SGD),
        Scenario("mlp_collapsed_batch", "mlp", drills=lambda: [CollapsedBatch()]),
        Scenario("gpt_collapsed_batch", "gpt", drills=lambda: [CollapsedBatch()]),
        Scenario("mlp_lr_zero", "mlp", drills=lambda: [ZeroLearningRate()]),
        Scenario("gpt_detached_block", "gpt", drills=lambda: [DetachedOutput("h.0")]),
        Scenario("cnn_zeroed_before_step", "cnn", drills=lambda: [ZeroedBeforeStep()]),
    ]
    for model, mid in (("mlp", "2"), ("gpt", "h.0.mlp.c_fc")):
        s += [
            Scenario(f"{model}_missing_zero_grad", model, reference=True, drills=lambda: [MissingZeroGrad()]),
            Scenario(f"{model}_frozen_by_mistake", model, reference=True,
                     drills=lambda mid=mid: [FrozenByMistake(mid)]),
            Scenario(f"{model}_not_in_optimizer", model, reference=True,
                     drills=lambda mid=mid: [NotInOptimizer(mid)]),
            Scenario(f"{model}_wrong_init_scale", model, reference=True,
                     drills=lambda mid=mid: [WrongInitScale(mid, factor=10.0)]),
            Scenario(f"{model}_reference_clean", model, reference=True),
        ]
    return s


def _bad_data() -> list[Scenario]:
    """Bad data beyond the models above: garbage of the data's own range (random tokens, noise
    images), in whole batches or in a few samples of each, on other architectures."""
    window = {"step": 150, "duration": 30, "mode": "random"}
    return [
        Scenario("gpt_parallel_clean", "gpt_parallel"),
        Scenario("gpt_parallel_corrupt_batches", "gpt_parallel",
                 drills=lambda: [CorruptBatches("wte", vocab_size=_GPT.vocab_size, **window)]),
        Scenario("llama_clean", "llama", optimizer="adamw", lr=1e-3, weight_decay=0.1,
                 schedule="warmup_cosine"),
        # three times the lr: once warmup ends, attention sharpens and the gradient moves onto its
        # projections (one projection's gradient norm several times its past) while the model's
        # total gradient norm and the loss stay in their course: a healthy run
        Scenario("llama_high_lr_clean", "llama", optimizer="adamw", lr=3e-3, weight_decay=0.1,
                 schedule="warmup_cosine"),
        Scenario("llama_corrupt_batches", "llama", optimizer="adamw", lr=1e-3, weight_decay=0.1,
                 schedule="warmup_cosine",
                 drills=lambda: [CorruptBatches("model.embed_tokens", vocab_size=_GPT.vocab_size, **window)]),
        Scenario("cnn_noise_batches", "cnn", drills=lambda: [CorruptBatches("0", **window)]),
        # a quarter of each batch's samples, the rest sound
        Scenario("gpt_poisoned_samples", "gpt", batch_size=16,
                 drills=lambda: [PoisonedSamples("wte", count=2, vocab_size=_GPT.vocab_size, **window)]),
        Scenario("gpt_clean_small_batch", "gpt", batch_size=16),
    ]


class _Registry(dict[str, Scenario]):
    def __missing__(self, key: str) -> Scenario:
        raise ScenarioError(f"unknown scenario {key!r}; expected one of: {', '.join(sorted(self))}")


SCENARIOS: dict[str, Scenario] = _Registry(_scenarios())
