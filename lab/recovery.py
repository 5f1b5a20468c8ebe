"""Rehearsed recoveries: after a component fault, is the repaired checkpoint worth training on?

For each fault family that writes one component's weights (`FAMILIES`), the run is rehearsed
with real checkpoints every `CHECKPOINT_EVERY` steps, analysed and repaired (`warninglight
repair` of the last checkpoint). Then the same `ON_STEPS` batches (the ones the run would have
trained on next) train on from three starts, with no drill:

- (a) the repaired checkpoint (the latest, with the root component from the clean one);
- (b) the full rollback: the clean checkpoint the rollback names;
- (c) no action: the latest checkpoint, damage and all.

Equal compute: each start trains the same `ON_STEPS` optimizer steps on the same batches; the
repair (a) also keeps the learning of every other component since the clean checkpoint (its
`steps_kept`), which the rollback (b) throws away. The clean twin (the same seed with no drill)
trains the same batches from its own checkpoint at the last step. Each is scored by its mean
loss on `EVAL_BATCHES` batches after those, which none of them trained on in that stretch.

`recommended(recoveries)` is the rule `forensics/explaining/repairable.RECOMMENDED` states: the
root conditions for which every rehearsed repair ended no worse than the full rollback.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass, replace
from itertools import islice
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from warninglight.forensics import analyze
from warninglight.recovery.repair import RepairRefused, repair

from .rehearsal import SCENARIOS, Scenario, batches_of, rehearse, restored, train_step

# Faults that write one component's weights: the case a component repair is for.
FAMILIES = ("mlp_weight_corruption", "mlp_bitflip", "mlp_dying_layer", "mlp_head_shrink",
            "mlp_creeping_corruption")
CHECKPOINT_EVERY = 50
ON_STEPS = 100  # steps trained on from each start: small, so `eval` stays a CPU run of minutes
EVAL_BATCHES = 16


@dataclass(frozen=True)
class Recovery:
    """One family's rehearsed recovery: the losses after `ON_STEPS` more steps from each start."""

    scenario: str
    seed: int
    condition: str | None  # the analysed root's condition
    root: str | None
    refused: str | None  # why the repair was refused (then loss_repaired is None)
    steps_kept: int | None
    relative_change: float | None  # of the root's weights, latest against clean
    loss_repaired: float | None
    loss_rollback: float
    loss_no_action: float
    loss_clean: float

    @property
    def repair_no_worse(self) -> bool | None:
        """The repair trained on to a loss no worse than the full rollback's (None: refused)."""
        if self.loss_repaired is None:
            return None
        return math.isfinite(self.loss_repaired) and self.loss_repaired <= self.loss_rollback

    def to_dict(self) -> dict[str, Any]:
        return {**asdict(self), "repair_no_worse": self.repair_no_worse}


def _eval_loss(model: nn.Module, batches: Sequence[tuple[Any, torch.Tensor, torch.Tensor]]) -> float:
    model.eval()
    with torch.no_grad():
        losses = [F.cross_entropy(_logits(model, x), y.reshape(-1)).item() for _, x, y in batches]
    return sum(losses) / len(losses)


def _logits(model: nn.Module, x: torch.Tensor) -> torch.Tensor:
    out = model(x)  # (B, C) or (B, T, vocab)
    return out.reshape(-1, out.shape[-1])


def _train_on(sc: Scenario, seed: int, start: Path | None, train: Sequence[Any], held: Sequence[Any]) -> float:
    """Train `train`'s batches from `start` (None: the initialisation); the held-out loss."""
    if start is None:
        model, optimizer = restored(sc, seed, None)
    else:
        model, optimizer = restored(sc, seed, start)
    model.train()
    for _, x, y in train:
        train_step(model, optimizer, x, y)
    return _eval_loss(model, held)


def rehearse_recovery(scenario: str, seed: int, workdir: Path, on_steps: int = ON_STEPS) -> Recovery:
    """Rehearse one family, repair its last checkpoint, and train on from each start."""
    sc = SCENARIOS[scenario]
    run = Path(workdir) / f"{scenario}-seed{seed}"
    truth = rehearse(sc, run / "trace", seed=seed, checkpoint_every=CHECKPOINT_EVERY, checkpoint_dir=run / "ckpt")
    last = truth["steps"]
    latest = run / "ckpt" / f"step-{last:06d}.pt"
    found = analyze(run / "trace", heat=False)
    done, refused = None, None
    try:
        done = repair(run / "trace", latest, run / "repaired.pt", analysis=found)
    except RepairRefused as exc:
        refused = str(exc)
    stream = islice(batches_of(sc, seed), last, last + on_steps + EVAL_BATCHES)  # after the run's own
    after = list(stream)
    train, held = after[:on_steps], after[on_steps:]
    clean = found.rollback.checkpoint_path
    rehearse(replace(sc, drills=list), run / "twin", seed=seed, checkpoint_every=last, checkpoint_dir=run / "twin_ckpt")
    twin = run / "twin_ckpt" / f"step-{last:06d}.pt"
    root = found.root
    return Recovery(
        scenario, seed, root.condition if root else None, root.attributed_to if root else None, refused,
        done.steps_kept if done else None, done.components[0].relative_change if done else None,
        _train_on(sc, seed, run / "repaired.pt", train, held) if done else None,
        _train_on(sc, seed, Path(clean) if clean else None, train, held),
        _train_on(sc, seed, latest, train, held), _train_on(sc, seed, twin, train, held))


def run_recoveries(workdir: Path, seeds: int = 1, families: Iterable[str] = FAMILIES) -> list[Recovery]:
    """Every family's recovery, for seeds 0..seeds-1."""
    return [rehearse_recovery(f, s, workdir) for f in families for s in range(seeds)]


def recommended(recoveries: Iterable[Recovery]) -> frozenset[str]:
    """Root conditions whose every rehearsed repair trained on no worse than the full rollback."""
    by: dict[str, list[bool | None]] = {}
    for r in recoveries:
        if r.condition is not None:
            by.setdefault(r.condition, []).append(r.repair_no_worse)
    return frozenset(c for c, oks in by.items() if oks and all(ok is True for ok in oks))
