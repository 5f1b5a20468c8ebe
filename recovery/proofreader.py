"""The Proofreader: which samples of a bad-data window did it, scored one by one against clean ones.

Each sample of the window (and each reference sample, drawn from steps before the onset) is put
through the entry's own `step` alone, as a batch of one, on a copy of the model and optimizer in
the state just before the onset, with every learning rate set to 0 so the copy never moves. A
hook on the root component's parameters reads the gradient backward leaves there (before any
clipping the step does), a forward hook the rms of the component's output, and the step returns
the loss. Each sample's score is the largest of its robust z (median and MAD of the reference
samples, on log values) of that gradient norm, that output rms and its loss; a sample with a
score above `THRESHOLD` is listed to skip.

The cost is one forward and backward pass per sample judged plus the steps replayed from the
checkpoint to the onset, both stated in the result; `max_samples` bounds the window's samples.
torch is imported inside the functions that use it.
"""

from __future__ import annotations

import copy
import math
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

THRESHOLD = 6.0  # robust z above which a sample is listed: far outside the clean samples' spread
MAX_SAMPLES = 4096  # window samples judged at most (each one forward and backward pass)
REFERENCE_SAMPLES = 256  # clean samples the z is taken against
_MAD_TO_SIGMA = 1.4826
_SCALE_FLOOR = 1e-3  # log units: a reference with no spread still gives a finite z


@dataclass(frozen=True)
class Proofread:
    """The samples of a bad-data window, judged: what was flagged and what it cost."""

    component: str  # whose parameters' gradient was read ("" = the whole model's)
    steps: list[int]  # [first, last] step whose samples were judged
    samples_judged: int
    samples_not_judged: int  # the window's samples past max_samples
    reference_samples: int
    replayed_steps: int  # steps re-run from the checkpoint to reach the state before the onset
    backward_passes: int  # samples judged + reference samples, one pass each
    wall_s: float
    threshold: float
    skip_ids: list[int]  # flagged, highest score first
    flagged: list[dict[str, Any]] = field(default_factory=list)  # id, step, score, each z and value

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def proofread(open_entry: Callable[[], Any], replay: Sequence[tuple[int, list[int]]],
              window: Sequence[tuple[int, list[int]]], reference_ids: Sequence[int], component: str, *,
              max_samples: int = MAX_SAMPLES, threshold: float = THRESHOLD) -> Proofread:
    """Score every sample of `window` ((step, ids) pairs) against `reference_ids` on `component`.

    `open_entry()` returns a fresh entry object at the clean checkpoint (rerun's `Entry`);
    `replay` are the recorded steps that take it to the state just before the window.
    """
    t0 = time.perf_counter()
    entry = open_entry()
    for _, ids in replay:
        entry.step(entry.model, entry.optimizer, entry.batch(ids))
        if entry.scheduler is not None:
            entry.scheduler.step()
    model, optimizer = _frozen_copy(entry.model, entry.optimizer)
    samples = [(step, i) for step, ids in window for i in dict.fromkeys(ids)]
    judged, skipped = samples[:max_samples], max(0, len(samples) - max_samples)
    score = _scorer(entry, model, optimizer, component)
    reference = [score(i) for i in list(dict.fromkeys(reference_ids))[:REFERENCE_SAMPLES]]
    bands = [_band([r[k] for r in reference]) for k in range(3)]
    flagged = []
    for step, i in judged:
        values = score(i)
        gz, oz, lz = (_z(v, b) for v, b in zip(values, bands, strict=True))
        if max(gz, oz, lz) > threshold:
            flagged.append({"id": i, "step": step, "score": round(max(gz, oz, lz), 2), "grad_z": round(gz, 2),
                            "output_z": round(oz, 2), "loss_z": round(lz, 2), "grad_norm": values[0],
                            "output_rms": values[1], "loss": values[2]})
    flagged.sort(key=lambda f: -f["score"])
    steps = [window[0][0], window[-1][0]] if window else []
    return Proofread(component, steps, len(judged), skipped, len(reference), len(replay),
                     len(judged) + len(reference), round(time.perf_counter() - t0, 3), threshold,
                     [int(f["id"]) for f in flagged], flagged)


def _frozen_copy(model: Any, optimizer: Any) -> tuple[Any, Any]:
    """A copy of the model and its optimizer (one deepcopy, so the copy steps the copied
    parameters) with every learning rate 0: the user's step runs as written and moves nothing."""
    model, optimizer = copy.deepcopy((model, optimizer))
    for group in optimizer.param_groups:
        group["lr"] = 0.0
    return model, optimizer


def _scorer(entry: Any, model: Any, optimizer: Any, component: str) -> Callable[[int], tuple[float, float, float]]:
    """A function: sample id -> (gradient norm on the component's parameters, rms of its output,
    loss), one pass each."""
    import torch

    owner = model.get_submodule(component) if component else model
    params = list(owner.parameters(recurse=False)) or list(model.parameters())
    squares: list[Any] = []
    outputs: list[Any] = []
    for p in params:  # the gradient as backward leaves it, before any clipping in the step
        p.register_hook(lambda g: squares.append(g.detach().float().pow(2).sum()))
    owner.register_forward_hook(lambda m, args, out: outputs.append(
        out.detach().float().pow(2).mean().sqrt()) if torch.is_tensor(out) else None)

    def score(sample: int) -> tuple[float, float, float]:
        squares.clear()
        outputs.clear()
        for p in model.parameters():
            p.grad = None
        loss = entry.step(model, optimizer, entry.batch([sample]))
        norm = float(torch.stack(squares).sum().sqrt()) if squares else 0.0
        rms = float(outputs[0]) if outputs else 0.0
        return norm, rms, float(loss)
    return score


def _band(values: Sequence[float]) -> tuple[float, float]:
    """Median and robust scale of log values (MAD, as a standard deviation)."""
    logs = sorted(_log(v) for v in values if math.isfinite(_log(v)))
    if not logs:
        return 0.0, 1.0
    median = _median(logs)
    mad = _median(sorted(abs(v - median) for v in logs))
    return median, max(_MAD_TO_SIGMA * mad, _SCALE_FLOOR)


def _z(value: float, band: tuple[float, float]) -> float:
    if not math.isfinite(value):
        return math.inf
    return (_log(value) - band[0]) / band[1]


def _log(v: float) -> float:
    return math.log(v) if v > 0 else -math.inf


def _median(sorted_values: Sequence[float]) -> float:
    n = len(sorted_values)
    return sorted_values[n // 2] if n % 2 else 0.5 * (sorted_values[n // 2 - 1] + sorted_values[n // 2])
