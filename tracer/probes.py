"""Per-step statistics, computed without a host-device sync and in a handful of batched ops.

Forward hooks do at most three small things per call (on an accelerator a non-finite count over
the whole output, and on a component's first call of the step a copy of a fixed-size strided row
subsample); the statistics of those subsamples are computed for several steps at once
(`ForwardProbe.compute`, every `FORWARD_BATCH_STEPS` steps and before every flush): on the CPU
in one compiled pass per group of samples (`kernels.forward_sums`), on an accelerator as segment
reductions over the concatenated subsamples. Small eager ops are what cost time on small models
(dispatch overhead), not arithmetic, hence this shape.
"""

from __future__ import annotations

import ctypes
import functools
import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, TypeVar

import numpy as np
import torch

from . import graphops, kernels, schema
from .components import SAT_RANGES, Component

DEAD_EPS = 1e-6      # |output| at or below this counts as "no response" for the dead fraction
_MAX_IMAGES = 8      # channel-first outputs: images taken before striding over positions
_MAX_VALUES = 65536  # sampled values per component and step: very wide outputs get fewer rows ...
_MIN_ROWS = 4        # ... but never fewer than this (a unit is "dead" only if all rows are ~0)
FORWARD_BATCH_STEPS = 8  # steps whose subsamples are reduced together (memory: 8 steps of samples)
_MAX_LAYOUTS = 8     # distinct sample layouts kept; shapes that keep changing rebuild instead
_UNIT_STATS = 7     # per-unit statistics: finite count, sum, square sum, zeros, absmax, saturated, dead
FORWARD_METRICS = schema.metrics_of(schema.FORWARD, schema.HEAD)  # what `compute` returns, in order
PARAM_METRICS = schema.metrics_of(schema.GRADIENT, schema.WEIGHTS)  # what `ParamProbe.end` returns


def first_tensor(out: object) -> torch.Tensor | None:
    """The forward output's first floating tensor (outputs may be tuples, lists or dicts); a
    DTensor's local part (a tensor-parallel layer's output: this rank's shard or replica)."""
    t = None
    if isinstance(out, torch.Tensor):
        t = out
    elif isinstance(out, (tuple, list, dict)):
        for item in (list(out.values()) if isinstance(out, dict) else out):
            if isinstance(item, torch.Tensor) and item.is_floating_point():
                t = item
                break
    if t is None or not t.is_floating_point():
        return None
    return t.to_local() if type(t) is not torch.Tensor and callable(getattr(t, "to_local", None)) else t


def _no_graph_task() -> int:
    """The id of the backward pass this thread is running, -1 outside one (always -1 where
    torch does not say). A checkpointed module runs its forward again inside the backward pass,
    hooks and all: no new forward call of the step."""
    return -1


graph_task = getattr(torch._C, "_current_graph_task_id", _no_graph_task)

_F = TypeVar("_F", bound=Callable[..., Any])


def without_grad(f: _F) -> _F:
    """`f` run with gradients off, as under `@torch.no_grad()`: a probe's entry point, called
    several times a step between the training's own ops (the context-manager decorator costs
    each call several times what setting the mode costs)."""
    @functools.wraps(f)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        if not torch.is_grad_enabled():
            return f(*args, **kwargs)
        torch._C._set_grad_enabled(False)
        try:
            return f(*args, **kwargs)
        finally:
            torch._C._set_grad_enabled(True)
    return wrapper  # type: ignore[return-value]


def to_device(a: np.ndarray, device: torch.device) -> torch.Tensor:
    """A host array on `device` without a host sync (pinned staging, non-blocking copy)."""
    t = torch.from_numpy(np.ascontiguousarray(a))
    if device.type == "cpu":
        return t
    if device.type == "cuda":
        t = t.pin_memory()  # the caching host allocator keeps it until the copy has run
    return t.to(device, non_blocking=True)


def rows_view(t: torch.Tensor, rows: int, channel_first: bool) -> tuple[tuple[int, int], tuple[int, int]] | None:
    """(size, stride) of the strided-rows view `subsample` copies from a contiguous, units-last
    output; None for other outputs (images, non-contiguous), which take its general path."""
    if t.dim() >= 2 and t.is_contiguous() and not (t.dim() >= 4 or (channel_first and t.dim() == 3)):
        units = t.shape[-1]
        n = t.numel() // units
        r = min(rows, max(_MIN_ROWS, _MAX_VALUES // units), n)
        return (r, units), (max(1, n // r) * units, 1)
    return None


def _fits(out: torch.Tensor | None, src: torch.Tensor) -> bool:
    """`out` (a staging-buffer slot) can take a copy of `src`."""
    return out is not None and out.shape == src.shape and out.dtype == src.dtype


def _copy(src: torch.Tensor, out: torch.Tensor | None) -> torch.Tensor:
    if _fits(out, src):
        return out.copy_(src)
    return src.clone(memory_format=torch.contiguous_format)  # row by row: a cheap copy


def subsample(t: torch.Tensor, rows: int, channel_first: bool,
              out: torch.Tensor | None = None) -> torch.Tensor:
    """An (r, units) copy of r <= `rows` evenly strided rows of `t` viewed as (rows, units).

    `t` must be detached. The copy goes into `out` when it has the sample's shape and dtype (a
    slot of the staging buffer, see `_Plan`), else into a new tensor. Each op here runs inside a
    forward pass (cold caches) and costs far more than its arithmetic, so the usual case (a
    contiguous output, units last) is one strided view and one copy.
    """
    view = rows_view(t, rows, channel_first)
    if view is not None:
        return _copy(t.as_strided(*view), out)
    if t.dim() < 2:
        t = t.reshape(1, -1)
    if t.dim() >= 4 or (channel_first and t.dim() == 3):
        b = t.shape[0]
        t = t[:: max(1, b // _MAX_IMAGES)][:_MAX_IMAGES].movedim(1, -1)  # (b', *spatial, C)
    flat = t.reshape(-1, t.shape[-1])
    rows = min(rows, max(_MIN_ROWS, _MAX_VALUES // flat.shape[1]))
    return _copy(flat[:: max(1, flat.shape[0] // rows)][:rows], out)


Key = tuple[tuple[int, int, int], ...]  # (component, rows, units) of each sample, in hook order


class _Layout:
    """Where each sampled unit of K steps lives: samples grouped by row count, unit -> (step, comp)."""

    def __init__(self, key: Key, steps: int, components: list[Component], device: torch.device) -> None:
        n = len(components)
        by_rows: dict[int, list[int]] = {}
        for pos, (_, r, _) in enumerate(key):
            by_rows.setdefault(r, []).append(pos)
        self.groups = list(by_rows.values())
        slot, centre, half, n_unit = [], [], [], np.zeros(n)
        seg_len, seg_slot = [], []  # runs of units of one (step, component), in unit order
        self.bounded: list[bool] = []
        for group in self.groups:
            g_slot, g_centre, g_half = [], [], []
            for k in range(steps):  # units of a group are concatenated step-major
                for p in group:
                    c, _, units = key[p]
                    g_slot.append(np.full(units, k * n + c))
                    seg_len.append(units)
                    seg_slot.append(k * n + c)
                    cen, hal = SAT_RANGES.get(components[c].bound or "", (0.0, math.inf))
                    g_centre.append(np.full(units, cen))
                    g_half.append(np.full(units, 0.98 * hal))  # within 1% of the bound (|x| >= 0.98 half-range)
                    n_unit[c] += units if k == 0 else 0
            slot.append(np.concatenate(g_slot))
            self.bounded.append(bool(np.isfinite(np.concatenate(g_half)).any()))
            centre.append(np.concatenate(g_centre))
            half.append(np.concatenate(g_half))
        # host copies for the compiled CPU pass (`ForwardProbe._sample_stats_compiled`)
        self.unit_slot_np = np.concatenate(slot).astype(np.int64)
        self.centre_np = [c.astype(np.float32) for c in centre]
        self.half_np = [h.astype(np.float32) for h in half]
        self.unit_slot = to_device(self.unit_slot_np, device)
        self.centre = [to_device(c, device) for c in self.centre_np]
        self.half = [to_device(h, device) for h in self.half_np]
        self.n_unit = to_device(np.maximum(n_unit, 1).astype(np.float32), device)
        lengths = np.broadcast_to(np.asarray(seg_len, dtype=np.int64), (_UNIT_STATS, len(seg_len)))
        self.seg_lengths = to_device(lengths, device)
        self.seg_slot = to_device(np.asarray(seg_slot, dtype=np.int64), device)


class _Plan:
    """Staging buffers for the samples of up to `steps` steps shaped like `key`.

    A step whose hooks see the shapes of the step before writes each sample straight into its
    columns here, laid out as `torch.cat` of the samples would lay them out (per row group:
    step-major, then hook order), so the reduction reads the buffer and nothing is concatenated.
    A sample of another shape or dtype goes into a tensor of its own, and a batch of steps with
    any such sample is concatenated as before: the values are the same either way.
    """

    def __init__(self, key: Key, steps: int, dtype: torch.dtype, device: torch.device,
                 scratch: bool = True) -> None:
        self.key, self.steps = key, steps
        self.views: list[dict[int, torch.Tensor]] = [{} for _ in range(steps)]
        # float32 slots as a compiled copy takes them: (view, its address, its row stride, its shape)
        self.slots: list[dict[int, tuple[torch.Tensor, int, int, tuple[int, int]]]] = [{} for _ in range(steps)]
        self.buffers: list[tuple[torch.Tensor, int]] = []  # per row group: (buffer, units a step)
        by_rows: dict[int, list[int]] = {}
        for pos, (_, r, _) in enumerate(key):
            by_rows.setdefault(r, []).append(pos)
        for r, group in by_rows.items():
            units = sum(key[p][2] for p in group)
            buf = torch.empty(r, steps * units, dtype=dtype, device=device)
            off = 0
            for p in group:
                c, _, u = key[p]
                for k in range(steps):
                    view = self.views[k][c] = buf[:, k * units + off:k * units + off + u]
                    if dtype == torch.float32 and device.type == "cpu":
                        self.slots[k][c] = (view, view.data_ptr(), view.stride(0), (r, u))
                off += u
            self.buffers.append((buf, units))
        # room for the eager reduction's element-wise temporaries (float32, like the reduced
        # samples) and for its per-unit statistics (`_unit_stats`, every group's columns side by
        # side); the compiled pass needs neither (`scratch=False`)
        self.scratch = [torch.empty(b.shape, dtype=torch.float32, device=device)
                        for b, _ in self.buffers] if scratch else []
        width = sum(b.shape[1] for b, _ in self.buffers) if scratch else 0
        self.units = torch.empty(_UNIT_STATS * width, dtype=torch.float32, device=device)

    def holds(self, k: int, samples: list[tuple[int, torch.Tensor]]) -> bool:
        """Whether `samples` (step `k` of the batch) all sit in their places here."""
        if k >= self.steps:
            return False
        views = self.views[k]
        return all(views.get(c) is s for c, s in samples)


class _Copies:
    """The samples of a forward pass whose hooks noted the outputs the last pass's noted, in the
    same order and shapes, copied by one compiled call (`kernels.rows_copier`) where `drain`
    would make one call each: the components, their outputs' shapes and row views, and per step
    index of `plan` the table of those copies (source row stride, destination address and row
    stride, rows, values a row) with the samples it leaves."""

    def __init__(self, plan: _Plan, comps: list[Component], shapes: list[torch.Size],
                 views: list[tuple[tuple[int, int], tuple[int, int]]]) -> None:
        self.plan, self.comps, self.shapes, self.views = plan, comps, shapes, views
        self.srcs = (ctypes.c_int64 * len(comps))()
        self.src_at = ctypes.addressof(self.srcs)
        self._tables: dict[int, tuple[np.ndarray, int, list[tuple[int, torch.Tensor]]] | None] = {}

    def table(self, k: int) -> tuple[np.ndarray, int, list[tuple[int, torch.Tensor]]] | None:
        """Step index `k`'s copies (the table, its address, the samples); None if a component
        has no staging place of its sample's shape there."""
        if k not in self._tables:
            slots, rows = self.plan.slots[k], []
            for c, (size, stride) in zip(self.comps, self.views, strict=True):
                slot = slots.get(c.index)
                if slot is None or slot[3] != size:
                    self._tables[k] = None
                    return None
                rows.append((stride[0], slot[1], slot[2], *size))
            table = np.array(rows, dtype=np.int64)
            self._tables[k] = (table, table.ctypes.data, [(c.index, slots[c.index][0]) for c in self.comps])
        return self._tables[k]


def _unit_stats(m: torch.Tensor, out: torch.Tensor, scratch: torch.Tensor) -> torch.Tensor:
    """Per unit (column of m), into the rows of `out` (_UNIT_STATS, m's columns): finite count,
    sum, sum of squares, zeros, absmax (the last two rows, saturated and dead, are the caller's);
    returns m with NaN/Inf -> 0.

    The ops are the ones fastest on CPU for each statistic (one thread, a wide sample): a sum of
    squares rather than vector_norm(dim=0); max |x| as amax and amin, with no |m| temporary
    (abs().amax and aminmax are slower); zeros as sign().abs().sum rather than (m == 0).sum; and
    `isfinite`, slow too, on CPU only when a column sum says a value is not finite (one host
    read per row group and batch of steps; free on CPU). `scratch` (m's shape and dtype) takes the
    element-wise temporaries and `out` the per-unit ones: fresh sample-sized tensors each time
    cost page faults, in the training's own ops too (the allocator's thresholds move).
    """
    r = m.shape[0]
    nfin, usum, usq, zeros, uabs = out[:5]
    torch.sum(m, 0, out=usum)
    if m.device.type != "cpu" or not bool(torch.isfinite(usum).all()):
        fin = torch.isfinite(m)  # on a device: always take this branch, a sync-free path
        torch.sum(fin, 0, out=nfin)
        m = torch.where(fin, m, 0.0)
        torch.sum(m, 0, out=usum)
    else:
        nfin.fill_(r)
    torch.sum(torch.mul(m, m, out=scratch), 0, out=usq)
    # max |x| as max(max x, -min x): two reductions, no |m| temporary; abs_ turns a -0.0 into 0.0
    torch.amin(m, 0, out=zeros)  # `zeros` is free until the last line
    torch.maximum(torch.amax(m, 0, out=uabs), zeros.neg_(), out=uabs).abs_()
    torch.sum(torch.sign(m, out=scratch).abs_(), 0, out=zeros)
    torch.sub(nfin, zeros, out=zeros)  # replaced non-finite values count as neither
    return m


def _metrics_of_sums(sums: torch.Tensor, absmax: torch.Tensor, n_unit: torch.Tensor) -> dict[str, torch.Tensor]:
    """The forward metrics from per-(step, component) sums (_UNIT_STATS, K, C) of the per-unit
    statistics, the (K, C) max |x|, and each component's unit count."""
    count = sums[0].clamp_min(1)
    return {"out_mean": sums[1] / count, "out_rms": (sums[2] / count).sqrt(), "out_absmax": absmax,
            "out_zero_frac": sums[3] / count, "out_sat_frac": sums[5] / count,
            "out_dead_frac": sums[6] / n_unit}


@dataclass
class _StepSamples:
    """One finished step's forward observations, waiting to be reduced with the next few."""

    slot: int                             # the step's row in the step buffer
    samples: list[tuple[int, torch.Tensor]]  # (component, (rows, units) sample)
    bad: torch.Tensor | None              # (C,) float64 non-finite counts; None = none seen
    plan: _Plan | None = None             # the staging buffers holding all its samples, if any
    k: int = 0                            # its step index in those buffers

    @functools.cached_property
    def key(self) -> Key:  # its samples are fixed once the step is taken
        return tuple((c, s.shape[0], s.shape[1]) for c, s in self.samples)


# the magnitude from which a float32 value rounds to infinity in a 16-bit float (halfway past
# the largest finite value: ties round to the even significand, infinity's)
_OVERFLOW_FROM = {torch.float16: 65520.0, torch.bfloat16: 2.0**128 * (1 - 2.0**-9)}


def nonfinite_count(t: torch.Tensor) -> torch.Tensor:
    """How many values of output `t` are not finite, as a traced hook counts them (one op
    sequence the compiled graph fuses). A 16-bit output is compared in float32 against the
    magnitude that rounds to infinity: inductor computes such an output in float32 and may hand
    it over unrounded, where a value past the type's range is still finite (the output, once
    stored, holds infinity). For float32 and float64, x - x is 0 exactly when x is finite: a
    subtraction and a comparison a value where `isfinite` takes four. Counted in int32 below
    2**31 values (exact; twice as wide a vector as int64)."""
    top = _OVERFLOW_FROM.get(t.dtype)
    if top is not None:
        bad = (t.float().abs() < top).logical_not()  # NaN compares false: counted
    elif t.dtype in (torch.float32, torch.float64):
        bad = (t - t).ne(0)
    else:
        bad = torch.isfinite(t).logical_not()
    return bad.sum(dtype=torch.int32) if t.numel() < 2**31 else bad.sum()


class ForwardProbe:
    """Forward-output statistics of every component, reduced for several steps at once."""

    def __init__(self, components: list[Component], rows: int, device: torch.device) -> None:
        self.components = components
        self.n = len(components)
        self.rows = rows
        self.device = device
        self.samples: list[tuple[int, torch.Tensor]] = []  # this step's (component, sample)
        self.bad: torch.Tensor | None = None                 # this step's non-finite counts
        self.held: list[tuple[int, torch.Tensor]] = []       # CPU outputs awaiting the verdict
        # CPU: outputs of a forward pass whose output was finite were let go uncounted (judged
        # by the gradients later: not finite, and the step's counts are unknown, i.e. null);
        # a forward pass of this step had a non-finite output (the rest of the step's outputs
        # are held and counted, as are its own)
        self.released = False
        self.unknown = False
        self.tainted = False
        # the model output's address and length, and its norm: `end_forward`'s compiled check
        self._check = (np.zeros(1, np.int64), np.zeros(1, np.int64), np.zeros(1, np.float32))
        self._checked = (0, 0)  # what `_check` holds
        self.sampled = [False] * self.n  # per component: sampled this step (a list: read in every hook)
        self.pending: list[_StepSamples] = []                # finished steps not yet reduced
        # what compiled graphs handed over this step (`take_from_graph`, at their run time):
        # (component, sample, non-finite count) of each component's first call, the components
        # among them, and the (component, count) of their later calls (micro-batches); and
        # whether a compiled forward of the step ran
        # (a count is a number where the graph ran on the host, else a tensor)
        self.from_graph: list[tuple[int, torch.Tensor, int | torch.Tensor]] = []
        self.graph_first: set[int] = set()
        self.graph_later: list[tuple[int, int | torch.Tensor]] = []
        self.graph_sampled = False
        self.tokens = graphops.Tokens(self.take_from_graph)  # given to the modules by the recorder
        self.first_seen: Callable[[int], None] | None = None  # told each component's first call
        self._layouts: dict[tuple[Key, int], _Layout] = {}
        self._plan: _Plan | None = None   # where this step's samples go (shaped like the last)
        # per component: the shape of its last output and the rows view of such an output
        self._views: dict[int, tuple[torch.Size, tuple[tuple[int, int], tuple[int, int]] | None]] = {}
        # (position in `samples`, output, its version, rows view): copies left for the end of the pass
        self._deferred: list[tuple[int, torch.Tensor, int, tuple[tuple[int, int], tuple[int, int]]]] = []
        self._copy_now: set[int] = set()    # components whose output was seen written in place
        self._copy_later: set[int] = set()  # ... seen not written in place: their copy may wait
        self._unverified: list[tuple[int, torch.Tensor, int]] = []  # copied in the hook, to check
        # (component, output, its version) the hooks of `_copy_later` components only noted during
        # a forward pass on CPU (`Recorder._make_hook`): observed together at its end (`drain`)
        self.noted: list[tuple[Component, torch.Tensor, int]] = []
        self._copies: _Copies | None = None  # the last pass's noted outputs, as one compiled call
        self._last_key: Key | None = None
        # CPU: the per-unit statistics in one compiled pass (tracer/kernels.py), the eager ops
        # until the kernels are loaded (`kernels.ready`; checked at each step's end)
        self._compiled = device.type == "cpu" and kernels.ready()
        self._may_compile = device.type == "cpu" and not self._compiled

    def observe(self, comp: Component, out: object) -> None:
        """Hook body: subsample the output once per step; count its non-finite values.

        On an accelerator the count is a few sync-free ops over the whole output. On CPU a full
        pass over every output (cold memory) is a large share of a small model's step, so the
        output is held instead: let go at the end of the forward pass if the model's output is
        finite (`end_forward`), else until the gradients exist (`settle` counts it if they are
        not finite).
        """
        t = first_tensor(out)
        if t is None:
            return
        idx, shape = comp.index, t.shape
        known = self._views.get(idx)  # (output shape, its rows view) of the last call
        if known is None or known[0] != shape:
            if t.numel() == 0:
                return
            known = self._views[idx] = (shape, rows_view(t, self.rows, comp.channel_first))
        on_cpu = t.is_cpu
        if on_cpu:
            self.held.append((idx, t))  # detached only if it is ever counted
        else:
            # numel minus the finite count: two kernels over the output, not three
            self._bad_counts()[idx].add_((t.numel() - torch.isfinite(t.detach()).sum()).to(self.device))
        if self.sampled[idx]:
            return
        self.sampled[idx] = True
        view = known[1]
        if view is not None and self._compiled and on_cpu and t.dtype is torch.float32 and t.is_contiguous():
            plan, k = self._plan, len(self.pending)
            slot = plan.slots[k].get(idx) if plan is not None and k < plan.steps else None
            if slot is not None and slot[3] == view[0]:
                # compiled: the rows copied now by one call that is no tensor op (the staging
                # slot is a row-major buffer's columns)
                kernels.row_copier()(t.data_ptr(), view[1][0], slot[1], slot[2], *view[0])
                self.samples.append((idx, slot[0]))
                return
        if view is not None and t.is_contiguous() and idx in self._copy_later:
            # the usual case: the copy waits for the end of the forward pass, where all of them
            # are one op (no tensor op in the hook); the version counter says if it was overwritten
            self._deferred.append((len(self.samples), t, t._version, known[1]))
            self.samples.append((idx, t))  # replaced by its copy in `copy_deferred`
            return
        plan, k = self._plan, len(self.pending)
        dest = plan.views[k].get(idx) if plan is not None and k < plan.steps else None
        self.samples.append((idx, subsample(t.detach(), self.rows, comp.channel_first, dest)))
        if known[1] is not None and idx not in self._copy_now:  # may its copy wait, next time?
            self._unverified.append((idx, t, t._version))

    def notable(self) -> set[int]:
        """The components whose hook may only note its output (`noted`), observed at the end of the
        forward pass (`drain`): those a pass showed nothing writes in place after the hook. The
        set itself, kept up to date: a hook holds it."""
        return self._copy_later

    def drain(self) -> None:
        """Observe the outputs the hooks noted, in their order, as their hooks would have.

        A hook that runs the whole observation costs several times what the same work costs in
        one loop at the end of the forward pass (each hook runs between the forward's own ops,
        with cold caches), so the hooks of components whose output nothing writes in place only
        note it. An output written in place after its hook all the same has lost the values its
        hook saw: it is counted for non-finite values, it is no sample of this pass (a later call
        of a shared module does not stand in for it; a later forward pass of the step may give
        the step's sample), and its component is observed in its hook from then on."""
        if self._copy_noted():
            return
        seen = list(self.noted) if self._compiled else None
        sampled, held = self.sampled, self.held
        lost: list[int] = []
        try:
            for comp, t, version in self.noted:
                if t._version == version:
                    if sampled[comp.index]:  # a later call, or micro-batch: held, as `observe` would
                        held.append((comp.index, t))
                    else:
                        self.observe(comp, t)
                    continue
                self._copy_later.discard(comp.index)
                self._copy_now.add(comp.index)
                held.append((comp.index, t))
                if not sampled[comp.index]:  # its first call of the pass: the later ones only held
                    sampled[comp.index] = True
                    lost.append(comp.index)
        finally:
            for idx in lost:
                sampled[idx] = False
            self.noted.clear()  # the list the hooks hold
        self._copies = self._copies_of(seen) if seen and not lost else None

    def _copies_of(self, noted: list[tuple[Component, torch.Tensor, int]]) -> _Copies | None:
        """The noted outputs `drain` just observed as one compiled call for the next pass, if
        each was a component's first call, copied by the compiled row copy into its staging place."""
        plan, comps, shapes, views, seen = self._plan, [], [], [], set()
        if plan is None:
            return None
        for comp, t, _ in noted:
            known = self._views.get(comp.index)
            if (known is None or known[1] is None or known[0] != t.shape or comp.index in seen
                    or t.dtype is not torch.float32 or not t.is_cpu or not t.is_contiguous()):
                return None
            seen.add(comp.index)
            comps.append(comp)
            shapes.append(t.shape)
            views.append(known[1])
        return _Copies(plan, comps, shapes, views)

    def _copy_noted(self) -> bool:
        """`drain` for a pass whose hooks noted what the last pass's noted (`_copies`): each
        output unchanged since its hook, of the same shape and layout, its component's first
        call of the step, copied into its staging place by one compiled call. False, with
        nothing done, for any other pass."""
        copies, noted, plan, k = self._copies, self.noted, self._plan, len(self.pending)
        if copies is None or copies.plan is not plan or len(noted) != len(copies.comps) or k >= plan.steps:
            return False
        sampled, srcs, comps, shapes = self.sampled, copies.srcs, copies.comps, copies.shapes
        f32 = torch.float32
        for i, (comp, t, version) in enumerate(noted):
            if (comp is not comps[i] or t._version != version or sampled[comp.index] or t.shape != shapes[i]
                    or t.dtype is not f32 or not t.is_cpu or not t.is_contiguous()):
                return False
            srcs[i] = t.data_ptr()
        table = copies.table(k)
        if table is None:
            return False
        kernels.rows_copier()(copies.src_at, table[1], len(noted))
        self.held.extend((comp.index, t) for comp, t, _ in noted)
        self.samples.extend(table[2])
        for comp in comps:
            sampled[comp.index] = True
        noted.clear()
        return True

    @without_grad
    def copy_deferred(self) -> None:
        """Copy the samples the hooks left for later (end of the forward pass, or of the step).

        A component's copy waits only after one pass showed that nothing wrote its output in
        place after its hook (`nn.ReLU(inplace=True)` after a layer does); if that changes
        later, that step's sample of it is lost (its forward values null) and it is copied in
        its hook from then on."""
        if self.noted:
            self.drain()
        for idx, t, version in self._unverified:
            (self._copy_later if t._version == version else self._copy_now).add(idx)
        self._unverified = []
        deferred, self._deferred = self._deferred, []
        if not deferred:
            return
        plan, k = self._plan, len(self.pending)
        views = plan.views[k] if plan is not None and k < plan.steps else {}
        srcs, dests, done = [], [], {}  # done: position in `samples` -> its copy
        try:
            for pos, t, version, view in deferred:
                idx = self.samples[pos][0]
                if t._version != version:  # written in place after the hook: the values are gone
                    self._copy_later.discard(idx)
                    self._copy_now.add(idx)
                    continue
                src = t.as_strided(*view)  # under no_grad: a plain view
                dest = views.get(idx)
                if not _fits(dest, src):
                    dest = torch.empty(src.shape, dtype=src.dtype, device=src.device)
                srcs.append(src)
                dests.append(dest)
                done[pos] = dest
            if srcs:
                torch._foreach_copy_(dests, srcs)
        except Exception:
            done = {}  # nothing is known to be copied
            raise
        finally:  # what was not copied is not a sample of this step
            for pos, dest in done.items():
                self.samples[pos] = (self.samples[pos][0], dest)
            lost = {pos for pos, *_ in deferred} - done.keys()
            if lost:
                for pos in lost:
                    self.sampled[self.samples[pos][0]] = False
                self.samples = [s for i, s in enumerate(self.samples) if i not in lost]

    def observe_in_graph(self, module: torch.nn.Module, out: object) -> None:
        """The hook body traced by torch.compile: tensor ops, and the op that hands their results
        to `take_from_graph` when the graph runs (tracer/graphops.py). Nothing here depends on
        which component it is but the module's token, a graph input."""
        t = first_tensor(out)
        given = self.tokens.of(module)  # None: a shallow copy made before watch() (hooks, no token)
        # (another tensor subclass is not read here: the op has no rule for one)
        if t is None or t.numel() == 0 or given is None or type(t) is not torch.Tensor:
            return
        t = t.detach()
        token, channel_first = given
        graphops.hand_over(token, "", [subsample(t, self.rows, channel_first), nonfinite_count(t)])

    def take_from_graph(self, idx: int, what: str, values: list[torch.Tensor]) -> None:
        """A compiled graph's observation of component `idx`, `[sample, count]`: copies of the
        sample of the component's first call in the step and of the counts of every call (the
        graph may reuse their memory)."""
        if idx in self.graph_first and graph_task() != -1:
            return  # a checkpointed block's forward run again in the backward pass: no new call
        sample, bad = values
        # on the host the count is read now (a number: no tensor op, no sync); elsewhere a copy
        count = bad.item() if bad.is_cpu else bad.to(torch.float64, copy=True)
        if idx in self.graph_first:
            self.graph_later.append((idx, count))
            return
        self.graph_first.add(idx)
        self.from_graph.append((idx, self._graph_sample(idx, sample), count))
        if self.first_seen is not None:
            self.first_seen(idx)

    def _graph_sample(self, idx: int, sample: torch.Tensor) -> torch.Tensor:
        """A copy of component `idx`'s sample from a compiled graph: on CPU, straight into its
        place in the staging buffers by the compiled row copy, as `observe` copies an eager
        one (unless the component was sampled eagerly this step: that place is taken); else a
        tensor of its own."""
        plan, k = self._plan, len(self.pending)
        if (self._compiled and plan is not None and k < plan.steps and not self.sampled[idx]
                and type(sample) is torch.Tensor and sample.dtype is torch.float32 and sample.is_cpu
                and sample.dim() == 2 and sample.is_contiguous()):
            slot = plan.slots[k].get(idx)
            if slot is not None and slot[3] == tuple(sample.shape):
                kernels.row_copier()(sample.data_ptr(), slot[3][1], slot[1], slot[2], *slot[3])
                return slot[0]
        return sample.clone()

    def absorb_graph_samples(self) -> None:
        """Take the compiled graphs' observations into this step (the first sample per component,
        every count)."""
        counted = [(idx, bad) for idx, _, bad in self.from_graph] + self.graph_later
        for idx, sample, _ in self.from_graph:
            if not self.sampled[idx]:
                self.sampled[idx] = True
                self.samples.append((idx, sample))
        counts = []  # those left on the device
        for idx, bad in counted:
            if not isinstance(bad, int):
                counts.append((idx, bad))
            elif bad:  # read on the host: nothing to add unless one is not 0
                self._bad_counts()[idx] += bad
        if counts:
            at = to_device(np.array([idx for idx, _ in counts], dtype=np.int64), self.device)
            self._bad_counts().index_add_(0, at, torch.stack([bad.to(self.device) for _, bad in counts]))
        self.from_graph.clear()
        self._forget_graph_step()

    def _forget_graph_step(self) -> None:
        """The compiled graphs' per-step state back to a step's start."""
        self.graph_first.clear()
        self.graph_later.clear()
        self.graph_sampled = False

    def _bad_counts(self) -> torch.Tensor:
        if self.bad is None:
            self.bad = torch.zeros(self.n, dtype=torch.float64, device=self.device)
        return self.bad

    def end_forward(self, out: torch.Tensor | None, grads_finite: Callable[[], bool | None]) -> None:
        """End of a forward pass on CPU: let the held outputs go now if the model's output `out`
        is finite, judged by the parameters' compiled norm pass (`kernels.tensor_norms`: its
        float64 sum of squares is finite exactly when every value is; a norm past float32's
        range reads as not finite, which only keeps the outputs held). No tensor is read.

        Held until the optimizer step, the outputs kept memory that the backward pass would
        have freed, and freeing it all at once after the step made the allocator hand pages
        back and fault them in again in the next step's ops (the recorder's largest cost on a
        CPU GPT). A NaN or infinity reaches the model's output in nearly every fault: then this
        pass's outputs, and those of the step's later micro-batches, stay held and are counted
        as before, and outputs let go by its earlier micro-batches are judged at once by the
        gradients they left (`grads_finite()`: None if there are none; a pass over them that
        only a broken step pays). A value that reaches the gradients but not the model's output
        leaves the step's counts unknown (`settle`).

        An output that is more than a third of the values held (itself among them when it is a
        component's: a language model's logits over a large vocabulary) is not read: its pass
        would cost more than holding the outputs to the step does."""
        if not self.held or not self._compiled or self.tainted:
            return
        if not (type(out) is torch.Tensor and out.is_cpu and out.dtype is torch.float32
                and out.is_contiguous() and out.numel()):
            return  # not judged here: held to the step
        if 3 * out.numel() > sum(t.numel() for _, t in self.held):
            return  # as wide as what it would let go: held to the step
        at = (out.data_ptr(), out.numel())
        if at != self._checked:  # the output often lands where the last one was
            self._check[0][0], self._check[1][0] = self._checked = at
        if kernels.tensor_norms(*self._check):
            self.held.clear()
            self.released = True
            return
        self.tainted = True
        if self.released:
            self.unknown = self.unknown or grads_finite() is False
            self.released = False

    def settle(self, grads_finite: bool | None) -> None:
        """Count non-finite values in the held outputs unless the gradients are all finite
        (`grads_finite`; None: there are none) and no forward pass of the step had a non-finite
        output (`tainted`: a NaN there need not reach the gradients, as in masked logits), then
        let them go. Outputs let go uncounted earlier make the step's counts unknown if
        gradients exist and are not all finite."""
        if grads_finite is not True or self.tainted:
            for idx, t in self.held:
                t = t.detach()
                if not math.isfinite(float(t.sum())):  # one pass; the exact count only if needed
                    self._bad_counts()[idx] += t.numel() - int(torch.isfinite(t).sum())
        if self.released:
            self.unknown = self.unknown or grads_finite is False
            self.released = False
        self.held.clear()

    def take(self, slot: int) -> None:
        """The step is finished: queue its observations for `compute` under buffer row `slot`."""
        self.copy_deferred()
        if self._may_compile and kernels.ready():
            # a staging plan made for the eager ops serves the compiled pass too (not the reverse)
            self._compiled, self._may_compile = True, False
        step = _StepSamples(slot, self.samples, self.bad)
        k, plan = len(self.pending), self._plan
        if plan is not None and plan.holds(k, step.samples):
            step.plan, step.k = plan, k
        if self.samples:
            key = step.key
            # a shape seen on two steps in a row gets staging buffers (alternating shapes do not)
            if (plan is None or plan.key != key) and key == self._last_key:
                dtypes = {s.dtype for _, s in self.samples}
                self._plan = _Plan(key, FORWARD_BATCH_STEPS, dtypes.pop(), self.device, not self._compiled) \
                    if len(dtypes) == 1 else None
            self._last_key = key
        self.pending.append(step)
        self.samples, self.bad = [], None

    def reset(self) -> None:
        """Forget the current step's observations (queued steps stay)."""
        self.samples, self.bad, self._deferred, self._unverified = [], None, [], []
        self.noted.clear()
        self.from_graph.clear()
        self._forget_graph_step()
        self.held.clear()
        self.released = self.unknown = self.tainted = False
        self.sampled = [False] * self.n

    def compute(self) -> list[tuple[int, torch.Tensor]]:
        """Reduce every queued step: [(first slot, (K, C, len(FORWARD_METRICS)) float64)], K >= 1.

        Consecutive steps with the same sample shapes are reduced together (one concatenation,
        a few reductions, one segment sum for all of them); rows of components a step did not
        see hold arbitrary values (the recorder marks them null).
        """
        out = []
        run: list[_StepSamples] = []
        pending, self.pending = self.pending, []  # a failure below must not repeat every step
        for s in pending:
            if run and s.key != run[0].key:
                out.append((run[0].slot, self._reduce(run)))
                run = []
            run.append(s)
        if run:
            out.append((run[0].slot, self._reduce(run)))
        return out

    def _reduce(self, steps: list[_StepSamples]) -> torch.Tensor:
        k, n = len(steps), self.n
        nan = torch.full((k, n), math.nan, dtype=torch.float64, device=self.device)
        cols = dict.fromkeys(FORWARD_METRICS, nan)
        if all(s.bad is None for s in steps):  # nothing counted: one op, not one a step
            cols["out_nonfinite_count"] = torch.zeros((k, n), dtype=torch.float64, device=self.device)
        else:
            zero = torch.zeros(n, dtype=torch.float64, device=self.device)
            cols["out_nonfinite_count"] = torch.stack([zero if s.bad is None else s.bad for s in steps])
        if steps[0].samples:
            cols.update(self._sample_stats(steps))
            cols.update(self._head_stats(steps))
        return torch.stack([cols[m] for m in FORWARD_METRICS], 2).double()

    def _layout(self, key: Key, k: int) -> _Layout:
        lay = self._layouts.get((key, k))
        if lay is None:
            if len(self._layouts) >= _MAX_LAYOUTS:  # shapes keep changing: do not grow without bound
                self._layouts.clear()
            lay = self._layouts[(key, k)] = _Layout(key, k, self.components, self.device)
        return lay

    @staticmethod
    def _staged(steps: list[_StepSamples]) -> _Plan | None:
        """The staging buffers that hold all of these consecutive steps' samples, if any."""
        plan, k0 = steps[0].plan, steps[0].k
        if plan is not None and plan.key == steps[0].key and all(
                s.plan is plan and s.k == k0 + i for i, s in enumerate(steps)):
            return plan
        return None

    @staticmethod
    def _group_matrix(steps: list[_StepSamples], plan: _Plan | None, g: int,
                      group: list[int]) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Row group `g` of the steps' samples as one (rows, K * units) matrix, step-major, and
        scratch room of its shape if there is some."""
        if plan is not None:
            buf, units = plan.buffers[g]  # the hooks wrote the samples in place: a view, no copy
            cols = slice(steps[0].k * units, (steps[0].k + len(steps)) * units)
            return buf[:, cols], (plan.scratch[g][:, cols] if plan.scratch else None)
        blocks = [s.samples[p][1] for s in steps for p in group]
        return (torch.cat(blocks, 1) if len(blocks) > 1 else blocks[0]), None

    def _sample_stats(self, steps: list[_StepSamples]) -> dict[str, torch.Tensor]:
        k, n = len(steps), self.n
        lay = self._layout(steps[0].key, k)
        plan = self._staged(steps)
        if self._compiled:
            return self._sample_stats_compiled(steps, lay, plan)
        width = len(lay.unit_slot)  # K steps' units, group after group
        unit = (plan.units[:_UNIT_STATS * width] if plan is not None else torch.empty(
            _UNIT_STATS * width, dtype=torch.float32, device=self.device)).view(_UNIT_STATS, width)  # contiguous for fewer steps too
        col = 0
        for g, group in enumerate(lay.groups):
            m, scratch = self._group_matrix(steps, plan, g, group)
            out = unit[:, col:col + m.shape[1]]
            col += m.shape[1]
            m = m.float()
            if scratch is None:  # samples not staged: room for the element-wise temporaries
                scratch = torch.empty_like(m)
            m = _unit_stats(m, out, scratch)
            if lay.bounded[g]:
                torch.sum(torch.ge(torch.sub(m, lay.centre[g], out=scratch).abs_(), lay.half[g], out=scratch), 0,
                          out=out[5])
            else:
                out[5].zero_()
            torch.le(out[4], DEAD_EPS, out=out[6])
        # per (step, component): its units are one run, so a segment sum (in unit order, as an
        # index_add would add them) gives its totals; absent components stay 0 (null rows)
        seg = torch.segment_reduce(unit, "sum", lengths=lay.seg_lengths, axis=1)
        sums = torch.zeros(_UNIT_STATS, k * n, device=self.device).index_copy_(1, lay.seg_slot, seg)
        absmax = torch.zeros(k * n, device=self.device).scatter_reduce_(0, lay.unit_slot, unit[4], "amax")
        return _metrics_of_sums(sums.view(_UNIT_STATS, k, n), absmax.view(k, n), lay.n_unit)

    def _sample_stats_compiled(self, steps: list[_StepSamples], lay: _Layout,
                               plan: _Plan | None) -> dict[str, torch.Tensor]:
        """`_sample_stats` on the CPU: one compiled pass over each row group's samples (the eager
        path passes over them once per statistic), sums in float64."""
        k, n = len(steps), self.n
        sums = np.zeros((_UNIT_STATS, k * n))
        absmax = np.zeros(k * n, dtype=np.float32)
        col = 0
        for g, group in enumerate(lay.groups):
            m = self._group_matrix(steps, plan, g, group)[0].float().numpy()  # a view: CPU memory
            kernels.forward_sums(m, lay.unit_slot_np[col:col + m.shape[1]], lay.centre_np[g], lay.half_np[g],
                                 lay.bounded[g], DEAD_EPS, sums, absmax)
            col += m.shape[1]
        return _metrics_of_sums(torch.from_numpy(sums).view(_UNIT_STATS, k, n),
                                torch.from_numpy(absmax).view(k, n), lay.n_unit)

    def _head_stats(self, steps: list[_StepSamples]) -> dict[str, torch.Tensor]:
        k, n = len(steps), self.n
        heads = [p for p, (c, _) in enumerate(steps[0].samples) if self.components[c].head]
        if not heads:
            return {}
        entropy = torch.full((k, n), math.nan, device=self.device)
        maxprob = torch.full((k, n), math.nan, device=self.device)
        for p in heads:
            c = steps[0].samples[p][0]
            s = torch.stack([st.samples[p][1] for st in steps]).float()  # (K, rows, classes)
            prob = torch.softmax(s, dim=2)
            entropy[:, c] = torch.special.entr(prob).sum(2).mean(1)  # entr(0) = 0; NaN stays NaN
            maxprob[:, c] = prob.amax(2).mean(1)
        return {"pred_entropy_nats": entropy, "pred_maxprob": maxprob}
