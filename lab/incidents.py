"""Incidents to re-run: small recorded MLP runs whose fault lives in the hardware, the data or the recipe.

Each incident trains the zoo MLP for one epoch of a teacher task (every sample is drawn once, so
a poisoned sample is seen once, at a known step), saves a checkpoint every `CHECKPOINT_EVERY`
steps (model, optimizer, scheduler, step) and records its batches with `rec.batch(ids)`:

- `transient`: one module's weights scaled inside the training step, as memory corruption would
  (the data and the recipe are clean: a re-run does not reproduce it);
- `poisoned`: a few samples of the dataset with inputs blown up, mixed into clean batches;
- `bad_batch`: every sample of two consecutive steps' batches corrupted;
- `lr_spike`: the scheduler (the recipe) multiplies the lr for a few steps.

`entry(checkpoint)` is the re-run entry function for all of them (docs/rerun.md): the checkpoint
names its incident and seed, so the dataset and the recipe are rebuilt from it.
"""

from __future__ import annotations

import json
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from . import zoo
from .drills import WeightCorruption

INCIDENTS = ("transient", "poisoned", "bad_batch", "lr_spike")
EXPECTED = {"transient": "transient", "poisoned": "data", "bad_batch": "data", "lr_spike": "recipe"}
STEPS, FAULT, CHECKPOINT_EVERY, BATCH = 200, 120, 50, 32
POISON_STEPS, POISON_PER_BATCH = 4, 3  # poisoned: this many samples in each of this many batches
POISON_FACTOR = 25.0  # inputs scaled by this, plus noise of the same scale (a bad shard's samples)
LR_FACTOR, LR_DURATION = 20.0, 10
BAD_BATCHES = 2  # bad_batch: this many consecutive whole batches (one alone is a blip no rule holds)
TRUTH = "incident.json"


def batch_order(seed: int) -> list[list[int]]:
    """The sample ids of steps 1..STEPS (one epoch of a dataset of STEPS * BATCH samples)."""
    x, y = zoo.teacher_classification(n=STEPS * BATCH, seed=seed)
    stream = zoo.batches(x, y, BATCH, seed=seed)
    return [next(stream)[0].tolist() for _ in range(STEPS)]


def poisoned_ids(incident: str, seed: int) -> list[int]:
    """The ids of the dataset's corrupted samples (none for transient and lr_spike)."""
    order = batch_order(seed)
    if incident == "poisoned":
        return [i for s in range(FAULT, FAULT + POISON_STEPS) for i in order[s - 1][:POISON_PER_BATCH]]
    if incident == "bad_batch":
        return [i for s in range(FAULT, FAULT + BAD_BATCHES) for i in order[s - 1]]
    return []


def dataset(incident: str, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The incident's dataset, poisoned samples included: (inputs (N, 32), labels (N,))."""
    x, y = zoo.teacher_classification(n=STEPS * BATCH, seed=seed)
    bad = torch.tensor(poisoned_ids(incident, seed), dtype=torch.long)
    if len(bad):
        g = torch.Generator().manual_seed(seed + 1)
        x = x.clone()
        x[bad] = x[bad] * POISON_FACTOR + torch.randn(len(bad), x.shape[1], generator=g) * POISON_FACTOR
    return x, y


def scheduler(incident: str, optimizer: torch.optim.Optimizer) -> torch.optim.lr_scheduler.LambdaLR:
    """The recipe's schedule: constant, or (lr_spike) LR_FACTOR times for LR_DURATION steps from FAULT."""
    def factor(epoch: int) -> float:  # epoch: scheduler steps taken = optimizer steps done
        spiking = incident == "lr_spike" and FAULT - 1 <= epoch < FAULT - 1 + LR_DURATION
        return LR_FACTOR if spiking else 1.0
    return torch.optim.lr_scheduler.LambdaLR(optimizer, factor)


def build(seed: int) -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(seed)
    model = zoo.mlp()
    return model, torch.optim.Adam(model.parameters(), lr=1e-3)


def train_step(model: nn.Module, optimizer: torch.optim.Optimizer, batch: tuple[torch.Tensor, torch.Tensor]) -> float:
    """One optimizer step on (inputs, labels); the loss."""
    x, y = batch
    loss = F.cross_entropy(model(x), y)
    optimizer.zero_grad(set_to_none=True)
    loss.backward()
    optimizer.step()
    return loss.item()


def entry(checkpoint: str) -> SimpleNamespace:
    """The re-run entry function of every incident (docs/rerun.md's plain-PyTorch example)."""
    state = torch.load(checkpoint, weights_only=True)
    model, optimizer = build(int(state["seed"]))
    model.load_state_dict(state["model"])
    optimizer.load_state_dict(state["optimizer"])
    sched = scheduler(state["incident"], optimizer)
    sched.load_state_dict(state["scheduler"])
    x, y = dataset(state["incident"], int(state["seed"]))

    def batch(ids: Sequence[int]) -> tuple[torch.Tensor, torch.Tensor]:
        index = torch.tensor(list(ids), dtype=torch.long)
        return x[index], y[index]

    return SimpleNamespace(model=model, optimizer=optimizer, scheduler=sched, batch=batch, step=train_step)


def record(incident: str, run_dir: str | Path, *, seed: int = 0) -> dict[str, Any]:
    """Train the incident under `watch` into `run_dir/trace`, checkpoints in `run_dir/checkpoints`;
    return (and write as `run_dir/incident.json`) what was done."""
    from warninglight.tracer import watch

    if incident not in INCIDENTS:
        raise ValueError(f"unknown incident {incident!r}; expected one of {', '.join(INCIDENTS)}")
    run = Path(run_dir)
    (run / "checkpoints").mkdir(parents=True, exist_ok=True)
    model, optimizer = build(seed)
    sched = scheduler(incident, optimizer)
    x, y = dataset(incident, seed)
    drill = WeightCorruption("2", FAULT, mode="scale", factor=10.0) if incident == "transient" else None
    with watch(model, optimizer, str(run / "trace"), heads=["6"]) as rec:
        for step, ids in enumerate(batch_order(seed), start=1):
            if drill is not None:
                drill.before_step(step, model, optimizer)
            index = torch.tensor(ids)
            rec.log(loss=train_step(model, optimizer, (x[index], y[index])))
            sched.step()
            rec.batch(ids)
            if step % CHECKPOINT_EVERY == 0:
                path = run / "checkpoints" / f"step-{step:06d}.pt"
                torch.save({"model": model.state_dict(), "optimizer": optimizer.state_dict(),
                            "scheduler": sched.state_dict(), "step": step, "incident": incident,
                            "seed": seed}, path)
                rec.checkpoint(str(path))
    truth = {"incident": incident, "seed": seed, "expected": EXPECTED[incident], "fault_step": FAULT,
             "poisoned_ids": poisoned_ids(incident, seed), "component": "2" if drill else "0"}
    (run / TRUTH).write_text(json.dumps(truth, indent=2))
    return truth


@dataclass(frozen=True)
class Outcome:
    """One incident recorded, re-run and scored against what was done."""

    incident: str
    seed: int
    expected: str
    verdict: str
    poisoned: int  # ids the dataset corrupted
    listed: int  # ids the Proofreader listed to skip
    found: int  # of those, poisoned
    seconds: float

    @property
    def right(self) -> bool:
        return self.verdict == self.expected

    @property
    def recall(self) -> float | None:
        return self.found / self.poisoned if self.poisoned else None

    @property
    def clean_share(self) -> float | None:
        return (self.listed - self.found) / self.listed if self.listed else None


def rehearse_rerun(incident: str, workdir: str | Path, *, seed: int = 0) -> Outcome:
    """Record `incident` in `workdir`, re-run it with `entry`, score the verdict and the skip list."""
    from warninglight.recovery.rerun import rerun

    t0 = time.perf_counter()
    truth = record(incident, workdir, seed=seed)
    result = rerun(Path(workdir) / "trace", entry)
    listed = set(result.proofreader.skip_ids) if result.proofreader is not None else set()
    bad = set(truth["poisoned_ids"])
    return Outcome(incident, seed, truth["expected"], result.verdict, len(bad), len(listed), len(listed & bad),
                   round(time.perf_counter() - t0, 1))


def run_reruns(workdir: str | Path, seeds: int = 1) -> list[Outcome]:
    """Every incident over `seeds` seeds, each in `workdir/<incident>-<seed>`."""
    return [rehearse_rerun(name, Path(workdir) / f"{name}-{seed}", seed=seed)
            for seed in range(seeds) for name in INCIDENTS]


def table(outcomes: Sequence[Outcome]) -> str:
    """The rehearsed re-runs as a markdown table, and the targets' verdict."""
    def share(x: float | None) -> str:
        return "—" if x is None else f"{x:.0%}"
    lines = ["| incident | seed | expected | verdict | poisoned ids | listed | recall | clean in list | s |",
             "|---|---|---|---|---|---|---|---|---|"]
    lines += [f"| {o.incident} | {o.seed} | {o.expected} | {o.verdict if o.right else f'**{o.verdict}**'} | "
              f"{o.poisoned or '—'} | {o.listed if o.poisoned else '—'} | {share(o.recall)} | "
              f"{share(o.clean_share)} | {o.seconds} |" for o in outcomes]
    met = all(o.right for o in outcomes) and all((o.recall or 0) >= 0.9 and (o.clean_share or 0) <= 0.1
                                                 for o in outcomes if o.poisoned)
    return "\n".join(lines + ["", f"Targets (every verdict right; recall >= 90%, <= 10% of the list clean): "
                              f"{'met' if met else '**not met**'}."])
