"""Finished steps waiting for the writer, and how they become the rows of one segment.

Everything here runs on the training thread only at flush time (every K steps): it is the one
place where device values (stats, logged tensors, learning rates) are copied to the host, in as
few transfers as possible.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from . import schema
from .components import Component, component_rows
from .writer import Segment


@dataclass
class StepRecord:
    """One finished step: its health stats still on the device, and its step-level values."""

    step: int
    stats: torch.Tensor                 # (C, M) float64 on the model's device
    valid: np.ndarray                   # (C, M) bool; False = null
    grad_total: torch.Tensor | None
    wall_time_s: float
    step_time_s: float
    micro_batches: int
    lr: float | torch.Tensor | None


class StepBuffer:
    """Step records, logged values, batch ids and events not yet handed to the writer."""

    def __init__(self, components: list[Component]) -> None:
        self.components = components
        self.records: list[StepRecord] = []
        self.events: list[dict[str, Any]] = []
        self._logs: dict[int, dict[str, list[Any]]] = {}
        self._batches: dict[int, list[Any]] = {}
        self._components_written = False

    def log(self, step: int, values: dict[str, Any]) -> None:
        """Keep logged values of `step` (tensors detached, not copied: no sync)."""
        slot = self._logs.setdefault(step, {})
        for name, value in values.items():
            slot.setdefault(name, []).append(value.detach() if isinstance(value, torch.Tensor) else value)

    def batch(self, step: int, ids: Any) -> None:
        """Keep sample ids consumed in `step`."""
        self._batches.setdefault(step, []).append(ids.detach() if isinstance(ids, torch.Tensor) else ids)

    def take_segment(self, final: bool) -> Segment:
        """The rows of every finished step (all steps when `final`: the last may still get logs)."""
        recs = self.records if final else self.records[:-1]
        self.records = [] if final else self.records[-1:]
        steps = [r.step for r in recs]
        n_c, n_m = len(self.components), len(schema.HEALTH_METRICS)
        if recs:
            stats = torch.stack([r.stats for r in recs]).cpu().numpy()  # the one copy to the host
            valid = np.stack([r.valid for r in recs])
        else:
            stats, valid = np.zeros((0, n_c, n_m)), np.zeros((0, n_c, n_m), dtype=bool)
        tables = {"steps": self._step_rows(recs), "scalars": self._scalar_rows(steps),
                  "events": {c.name: [e.get(c.name) for e in self.events] for c in schema.EVENT_COLUMNS}}
        self.events = []
        if not self._components_written:
            tables["components"] = component_rows(self.components)
            self._components_written = True
        return Segment(np.asarray(steps, dtype=np.int64), [c.name for c in self.components],
                       stats, valid, tables)

    def _step_rows(self, recs: list[StepRecord]) -> dict[str, list[Any]]:
        loss = _means([self._logs.get(r.step, {}).get("loss") for r in recs])
        return {"step": [r.step for r in recs], "wall_time_s": [r.wall_time_s for r in recs],
                "step_time_s": [r.step_time_s for r in recs], "loss": loss,
                "lr": _floats([r.lr for r in recs]),
                "grad_norm_total_l2": _floats([r.grad_total for r in recs]),
                "micro_batches": [r.micro_batches for r in recs],
                "batch_ids": [_ids(self._batches.pop(r.step, None)) for r in recs]}

    def _scalar_rows(self, steps: list[int]) -> dict[str, list[Any]]:
        rows: dict[str, list[Any]] = {"step": [], "name": [], "value": []}
        groups = []
        for s in steps:
            for name, values in self._logs.pop(s, {}).items():
                if name != "loss":
                    rows["step"].append(s)
                    rows["name"].append(name)
                    groups.append(values)
        rows["value"] = _means(groups)
        return rows


def _floats(values: list[Any]) -> list[float | None]:
    """Python floats from a mix of numbers, tensors and None, with one device copy for tensors."""
    tensors = [(i, v) for i, v in enumerate(values) if isinstance(v, torch.Tensor)]
    out: list[float | None] = [None if v is None or isinstance(v, torch.Tensor) else float(v)
                               for v in values]
    if tensors:
        try:
            host = torch.stack([v.float().mean() for _, v in tensors]).cpu().tolist()
        except RuntimeError:  # tensors on several devices: one copy each
            host = [float(v.float().mean()) for _, v in tensors]
        for (i, _), x in zip(tensors, host, strict=True):
            out[i] = x
    return out


def _means(groups: list[list[Any] | None]) -> list[float | None]:
    """The mean of each group of logged values, converting all of them in one `_floats` call."""
    flat = _floats([v for g in groups for v in (g or [])])
    out: list[float | None] = []
    i = 0
    for g in groups:
        xs = [x for x in flat[i:i + len(g or [])] if x is not None]
        i += len(g or [])
        out.append(sum(xs) / len(xs) if xs else None)
    return out


def _ids(chunks: list[Any] | None) -> list[int] | None:
    if not chunks:
        return None
    out: list[int] = []
    for c in chunks:
        out += c.reshape(-1).tolist() if isinstance(c, torch.Tensor) else [int(i) for i in c]
    return out
