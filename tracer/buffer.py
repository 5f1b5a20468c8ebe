"""Finished steps waiting for the writer: their values on the device, and how they become rows.

Each step's health block (C x M) and step scalars go into preallocated device tensors, one row
per step, written with device-side copies (no host sync). At flush, the training thread gathers
everything the segment needs from the device into one tensor and starts one non-blocking copy
into pinned host memory, recording an event; the writer thread waits on that event and does every
host conversion (`numpy`, `tolist`, floats). On CPU the "copy" is the gathered tensor itself.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, fields
from typing import Any

import numpy as np
import torch

from . import schema
from .components import Component, component_rows
from .writer import Segment

# columns of the per-step scalar block, in order
SCALARS = ("grad_norm_total_l2", "grad_norm_preclip_l2", "lr")


@dataclass(frozen=True)
class LoopFacts:
    """A step's facts about the training loop (tracer/loopfacts.py), host values."""

    eval_forwards: int = 0
    grads_not_cleared: int | None = None
    params_with_grad: int = 0
    input_rows: int | None = None
    input_shape: list[int] | None = None


@dataclass
class StepRecord:
    """One finished step: where its values sit in the buffer, and what is known on the host."""

    step: int
    slot: int                            # row in StepBuffer.stats / .scalars
    valid: np.ndarray                    # (C, M) bool; False = null
    wall_time_s: float
    step_time_s: float
    micro_batches: int
    present: tuple[bool, bool, bool]     # which of SCALARS this step has (else null)
    lr: float | None = None              # a host learning rate (a tensor one sits in .scalars)
    group_lrs: list[float | None] | None = None  # every param group's lr (host values)
    loop: LoopFacts = LoopFacts()


class StepBuffer:
    """Step records, logged values, batch ids and events not yet handed to the writer."""

    def __init__(self, components: list[Component], device: torch.device, capacity: int) -> None:
        self.components = components
        self.device = device
        n_c, n_m = len(components), len(schema.HEALTH_METRICS)
        self.stats = torch.full((capacity, n_c, n_m), float("nan"), dtype=torch.float64, device=device)
        self.scalars = torch.full((capacity, len(SCALARS)), float("nan"), dtype=torch.float64,
                                  device=device)
        self.records: list[StepRecord] = []
        self.events: list[dict[str, Any]] = []
        self._logs: dict[int, dict[str, list[Any]]] = {}
        self._batches: dict[int, list[Any]] = {}
        self._components_written = False

    def next_slot(self) -> int:
        """The buffer row of the next step (the buffer doubles if the writer falls behind)."""
        slot = len(self.records)
        if slot >= self.stats.shape[0]:
            self.stats = torch.cat([self.stats, torch.full_like(self.stats, float("nan"))])
            self.scalars = torch.cat([self.scalars, torch.full_like(self.scalars, float("nan"))])
        return slot

    def put(self, slots: slice | int, runs: list[tuple[slice, slice]], block: torch.Tensor) -> None:
        """Copy metric columns of `block` (last dim) into the health rows `slots`: (dst, src) runs."""
        for dst, src in runs:
            self.stats[slots, :, dst].copy_(block[..., src])

    def log(self, step: int, values: dict[str, Any]) -> None:
        """Keep logged values of `step` (tensors reduced to one value on their device: no sync)."""
        slot = self._logs.setdefault(step, {})
        for name, value in values.items():
            if isinstance(value, torch.Tensor):
                value = value.detach()
                if value.numel() != 1 or not value.is_floating_point():
                    value = value.float().mean()
            slot.setdefault(name, []).append(value)

    def batch(self, step: int, ids: Any) -> None:
        """Keep sample ids consumed in `step`."""
        self._batches.setdefault(step, []).append(ids.detach() if isinstance(ids, torch.Tensor) else ids)

    def take_segment(self, final: bool) -> Segment:
        """The finished steps as a segment (all steps when `final`: the last may still get logs).

        Its host values are filled in by `Segment.finish`, on the writer thread. The buffer
        gives the steps up only once the segment holds them: an interrupt on the way
        (KeyboardInterrupt) leaves them in it.
        """
        recs = self.records if final else self.records[:-1]
        logs = [self._logs.get(r.step, {}) for r in recs]
        batches = [self._batches.get(r.step) for r in recs]
        n = len(recs)
        assert all(r.slot == i for i, r in enumerate(recs)), "step rows out of order"
        transfer = _Transfer(self.device)
        stats_at = transfer.add(self.stats[:n].reshape(-1))
        scal_at = transfer.add(self.scalars[:n].reshape(-1))
        log_vals = [[transfer.value(v) for v in vs] for step_logs in logs for vs in step_logs.values()]
        id_vals = [[transfer.ids(c) for c in chunks] if chunks else None for chunks in batches]
        fetch = transfer.start()
        events = {c.name: [e.get(c.name) for e in self.events] for c in schema.EVENT_COLUMNS}
        tables: dict[str, dict[str, list[Any]]] = {"events": events}
        if not self._components_written:
            tables["components"] = component_rows(self.components)
        steps = np.asarray([r.step for r in recs], dtype=np.int64)
        valid = np.stack([r.valid for r in recs]) if recs else np.zeros(
            (0, len(self.components), len(schema.HEALTH_METRICS)), dtype=bool)
        seg = Segment(steps, [c.name for c in self.components], np.zeros(valid.shape), valid, tables)
        names = [list(step_logs) for step_logs in logs]
        # the segment holds the steps: the buffer gives them up
        self.records = [] if final else self.records[-1:]
        for r in recs:
            self._logs.pop(r.step, None)
            self._batches.pop(r.step, None)
        self.events, self._components_written = [], True
        if self.records:  # the kept step moves to row 0 (after the copy above, in stream order)
            kept = self.records[0]
            if kept.slot != 0:
                self.stats[0].copy_(self.stats[kept.slot])
                self.scalars[0].copy_(self.scalars[kept.slot])
                kept.slot = 0

        def finish() -> None:  # on the writer thread
            host = fetch()
            seg.stats = stats_at(host).reshape(valid.shape)
            scal = scal_at(host).reshape(n, len(SCALARS))
            vals = iter([_mean([read(host) for read in group]) for group in log_vals])
            per_step = [dict(zip(step_names, vals, strict=False)) for step_names in names]
            seg.tables["steps"] = _step_rows(recs, scal, per_step,
                                             [_ids(host, chunk) for chunk in id_vals])
            seg.tables["scalars"] = _scalar_rows(recs, per_step)
        seg.finish = finish
        return seg


Reader = Callable[[np.ndarray], Any]


class _Transfer:
    """Values gathered for one device-to-host copy; each `add` returns how to read it back."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.parts: list[torch.Tensor] = []
        self.size = 0

    def add(self, flat: torch.Tensor) -> Reader:
        """A float64 (or int64) 1-D tensor on the device: read back as a numpy slice."""
        start, self.size = self.size, self.size + flat.numel()
        is_int = flat.dtype == torch.int64
        self.parts.append(flat.view(torch.float64) if is_int else flat.to(torch.float64))
        end = self.size
        return (lambda h: h[start:end].view(np.int64)) if is_int else (lambda h: h[start:end])

    def value(self, v: Any) -> Reader:
        """A logged value: a number, or a one-element tensor (copied with the rest if on the device)."""
        if not isinstance(v, torch.Tensor):
            x = None if v is None else float(v)
            return lambda h: x
        if v.device == self.device:
            read = self.add(v.reshape(1))
            return lambda h: float(read(h)[0])
        return lambda h: float(v)  # another device: its own copy, on the writer thread

    def ids(self, chunk: Any) -> Reader:
        if not isinstance(chunk, torch.Tensor):
            return lambda h: [int(i) for i in chunk]
        flat = chunk.reshape(-1).to(torch.int64)
        if flat.device == self.device:
            read = self.add(flat)
            return lambda h: read(h).tolist()
        return lambda h: flat.tolist()

    def start(self) -> Callable[[], np.ndarray]:
        """Start the copy; the returned function (writer thread) waits for it and gives the array."""
        if not self.parts:
            return lambda: np.zeros(0)
        flat = torch.cat(self.parts) if len(self.parts) > 1 else self.parts[0]
        if self.device.type != "cuda":
            if self.device.type == "cpu":
                return flat.numpy
            return lambda: flat.cpu().numpy()  # other accelerators: a plain copy, off-thread
        host = torch.empty(flat.shape, dtype=flat.dtype, pin_memory=True)
        host.copy_(flat, non_blocking=True)
        done = torch.cuda.Event()
        done.record()

        def wait() -> np.ndarray:
            while not done.query():  # polled, not Event.synchronize: nothing here blocks the device
                time.sleep(0.0005)
            return host.numpy()
        return wait


def _mean(values: list[float | None]) -> float | None:
    xs = [x for x in values if x is not None]
    return sum(xs) / len(xs) if xs else None


def _ids(host: np.ndarray, chunk: list[Reader] | None) -> list[int] | None:
    if not chunk:
        return None
    out: list[int] = []
    for read in chunk:
        out += read(host)
    return out


_LOOP_FIELDS = tuple(f.name for f in fields(LoopFacts))


def _step_rows(recs: list[StepRecord], scal: np.ndarray, logs: list[dict[str, float | None]],
               ids: list[list[int] | None]) -> dict[str, list[Any]]:
    def column(j: int) -> list[float | None]:
        return [float(scal[i, j]) if r.present[j] else None for i, r in enumerate(recs)]
    lr = [r.lr if r.lr is not None else x for r, x in zip(recs, column(2), strict=True)]
    return {"step": [r.step for r in recs], "wall_time_s": [r.wall_time_s for r in recs],
            "step_time_s": [r.step_time_s for r in recs], "loss": [lg.get("loss") for lg in logs],
            "lr": lr, "grad_norm_total_l2": column(0), "grad_norm_preclip_l2": column(1),
            "micro_batches": [r.micro_batches for r in recs], "batch_ids": ids,
            "lr_groups": [r.group_lrs for r in recs],
            **{f: [getattr(r.loop, f) for r in recs] for f in _LOOP_FIELDS}}


def _scalar_rows(recs: list[StepRecord], logs: list[dict[str, float | None]]) -> dict[str, list[Any]]:
    rows: dict[str, list[Any]] = {"step": [], "name": [], "value": []}
    for r, step_logs in zip(recs, logs, strict=True):
        for name, value in step_logs.items():
            if name != "loss":
                rows["step"].append(r.step)
                rows["name"].append(name)
                rows["value"].append(value)
    return rows
