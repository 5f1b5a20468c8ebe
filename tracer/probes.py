"""Per-step statistics, computed without a host-device sync and in a handful of batched ops.

Forward hooks do at most three small things per call (a finite count over the whole output, and
on a component's first call of the step a copy of a fixed-size strided row subsample); everything
else runs once per step over all components together, as segment reductions over the
concatenated subsamples and `torch._foreach_norm` over the parameters. Small eager ops are what
cost time on small models (dispatch overhead), not arithmetic, hence this shape.
"""

from __future__ import annotations

import math

import numpy as np
import torch

from .components import SAT_RANGES, Component
from .replicas import local_shard

DEAD_EPS = 1e-6      # |output| at or below this counts as "no response" for the dead fraction
_MAX_IMAGES = 8      # channel-first outputs: images taken before striding over positions
_MAX_VALUES = 65536  # sampled values per component and step: very wide outputs get fewer rows ...
_MIN_ROWS = 4        # ... but never fewer than this (a unit is "dead" only if all rows are ~0)


def first_tensor(out: object) -> torch.Tensor | None:
    """The forward output's first floating tensor (outputs may be tuples, lists or dicts)."""
    if isinstance(out, torch.Tensor):
        return out if out.is_floating_point() else None
    if isinstance(out, (tuple, list)):
        items = out
    elif isinstance(out, dict):
        items = list(out.values())
    else:
        return None
    for item in items:
        if isinstance(item, torch.Tensor) and item.is_floating_point():
            return item
    return None


def subsample(t: torch.Tensor, rows: int, channel_first: bool) -> torch.Tensor:
    """An (r, units) copy of r <= `rows` evenly strided rows of `t` viewed as (rows, units).

    `t` must be detached. Each op here costs ~10-20 us inside a forward pass (cold caches), far
    more than its arithmetic, so the usual case (a contiguous output, units last) is one strided
    view and one copy.
    """
    if t.dim() >= 2 and t.is_contiguous() and not (t.dim() >= 4 or (channel_first and t.dim() == 3)):
        units = t.shape[-1]
        n = t.numel() // units
        r = min(rows, max(_MIN_ROWS, _MAX_VALUES // units), n)
        step = max(1, n // r)
        return t.as_strided((r, units), (step * units, 1)).clone()
    if t.dim() < 2:
        t = t.reshape(1, -1)
    if t.dim() >= 4 or (channel_first and t.dim() == 3):
        b = t.shape[0]
        t = t[:: max(1, b // _MAX_IMAGES)][:_MAX_IMAGES].movedim(1, -1)  # (b', *spatial, C)
    flat = t.reshape(-1, t.shape[-1])
    rows = min(rows, max(_MIN_ROWS, _MAX_VALUES // flat.shape[1]))
    flat = flat[:: max(1, flat.shape[0] // rows)][:rows]
    return flat.clone(memory_format=torch.contiguous_format)  # row by row: a cheap copy


class _Layout:
    """Where each sampled unit lives: samples grouped by row count, unit -> component maps."""

    def __init__(self, key: tuple[tuple[int, int, int], ...], components: list[Component],
                 device: torch.device) -> None:
        by_rows: dict[int, list[int]] = {}
        for pos, (_, r, _) in enumerate(key):
            by_rows.setdefault(r, []).append(pos)
        self.groups = list(by_rows.values())
        order = [pos for g in self.groups for pos in g]
        comps = torch.tensor([key[p][0] for p in order], dtype=torch.long)
        units = torch.tensor([key[p][2] for p in order], dtype=torch.long)
        self.unit_comp = torch.repeat_interleave(comps, units).to(device)
        self.n_unit = torch.zeros(len(components)).index_add_(0, comps, units.float()
                                                               ).clamp_min(1).to(device)
        offsets = (torch.cumsum(units, 0) - units).tolist()
        group_of = {pos: g for g, members in enumerate(self.groups) for pos in members}
        group_start = {g: offsets[order.index(members[0])] for g, members in enumerate(self.groups)}
        # bounded activations: (group, unit offset, units, centre, |x - centre| where it saturates)
        self.sat_blocks = [
            (group_of[p], off, off - group_start[group_of[p]], key[p][2],
             *SAT_RANGES[components[key[p][0]].bound or ""])
            for p, off in zip(order, offsets, strict=True)
            if components[key[p][0]].bound in SAT_RANGES]
        self.total_units = int(units.sum())


def _unit_stats(m: torch.Tensor) -> list[torch.Tensor]:
    """Per unit (column of m): finite count, sum, sum of squares, zeros, absmax; m with NaN/Inf -> 0.

    The ops are picked for speed on CPU (one thread, a (16, 11264) sample): sum 12 us, square-sum
    and abs().amax ~35 us, sign().abs().sum ~85 us, where vector_norm(dim=0) takes 1.2 ms, (m == 0)
    .sum 250 us and `isfinite` more: it runs only when a column sum says a value is not finite.
    """
    r = m.shape[0]
    usum = m.sum(0)
    if m.device.type != "cpu" or not bool(torch.isfinite(usum).all()):
        fin = torch.isfinite(m)  # on a device: always take this branch, a sync-free path
        nfin = fin.sum(0).float()
        m = torch.where(fin, m, 0.0)
        usum = m.sum(0)
    else:
        nfin = torch.full_like(usum, r)
    usq = (m * m).sum(0)
    uabs = m.abs().amax(0)
    zeros = nfin - m.sign().abs().sum(0)  # replaced non-finite values count as neither
    return [nfin, usum, usq, zeros, uabs, m]


class ForwardProbe:
    """Forward-output statistics of every component, batched once per step."""

    def __init__(self, components: list[Component], rows: int) -> None:
        self.components = components
        self.rows = rows
        self.samples: list[tuple[int, torch.Tensor]] = []   # (component, (rows, units) sample)
        self.bad: list[tuple[int, torch.Tensor | int]] = []  # (component, non-finite count)
        self.held: list[tuple[int, torch.Tensor]] = []       # CPU outputs awaiting the verdict
        self.sampled = np.zeros(len(components), dtype=bool)
        self._layouts: dict[tuple[tuple[int, int, int], ...], _Layout] = {}

    def observe(self, comp: Component, out: object) -> None:
        """Hook body: subsample the output once per step; count its non-finite values.

        On an accelerator the count is two sync-free ops over the whole output. On CPU a full
        pass over every output (cold memory) measured ~7% of a small GPT's step, so the output
        is only held until the gradients exist: `settle` counts it if they are not finite.
        """
        t = first_tensor(out)
        if t is None or t.numel() == 0:
            return
        t = t.detach()
        if t.device.type == "cpu":
            self.held.append((comp.index, t))
        else:
            self.bad.append((comp.index, t.numel() - torch.isfinite(t).sum()))
        if not self.sampled[comp.index]:
            self.sampled[comp.index] = True
            self.samples.append((comp.index, subsample(t, self.rows, comp.channel_first)))

    def settle(self, suspect: bool) -> None:
        """Count non-finite values in the held outputs if `suspect`, then let them go."""
        if suspect:
            for idx, t in self.held:
                if not math.isfinite(float(t.sum())):  # one pass; the exact count only if needed
                    self.bad.append((idx, t.numel() - int(torch.isfinite(t).sum())))
        self.held.clear()

    def reset(self) -> None:
        """Forget this step's observations."""
        self.samples.clear()
        self.bad.clear()
        self.held.clear()
        self.sampled[:] = False

    def compute(self, device: torch.device) -> dict[str, torch.Tensor]:
        """The `out_*` and `pred_*` columns for all components (length C each; NaN where unseen)."""
        n = len(self.components)
        cols = {name: torch.full((n,), math.nan, device=device) for name in (
            "out_mean", "out_rms", "out_absmax", "out_zero_frac", "out_sat_frac",
            "out_dead_frac", "pred_entropy_nats", "pred_maxprob")}
        bad = torch.zeros(n, dtype=torch.float64, device=device)
        if self.bad:
            idx = torch.tensor([b[0] for b in self.bad], device=device)
            counts = torch.stack([torch.as_tensor(b[1], device=device) for b in self.bad])
            bad.index_add_(0, idx, counts.double())
        cols["out_nonfinite_count"] = bad
        if self.samples:
            cols.update(self._sample_stats(device))
            cols.update(self._head_stats())
        return cols

    def _sample_stats(self, device: torch.device) -> dict[str, torch.Tensor]:
        key = tuple((c, s.shape[0], s.shape[1]) for c, s in self.samples)  # (comp, rows, units)
        lay = self._layouts.get(key)
        if lay is None:
            if len(self._layouts) > 8:  # shapes keep changing: do not grow without bound
                self._layouts.clear()
            lay = self._layouts[key] = _Layout(key, self.components, device)
        sat = torch.zeros(lay.total_units, device=device)
        per_unit = []
        for g, group in enumerate(lay.groups):
            blocks = [self.samples[p][1].to(device=device, dtype=torch.float32) for p in group]
            *stats, m = _unit_stats(torch.cat(blocks, 1) if len(blocks) > 1 else blocks[0])
            per_unit.append(torch.stack(stats, 1))   # (units, 5)
            for sg, off, local, units, centre, half in lay.sat_blocks:
                if sg == g:
                    block = m[:, local:local + units]
                    sat[off:off + units] = ((block - centre).abs() >= 0.98 * half).sum(0).float()
        unit = torch.cat(per_unit) if len(per_unit) > 1 else per_unit[0]
        dead = (unit[:, 4] <= DEAD_EPS).float()
        unit = torch.cat([unit, sat[:, None], dead[:, None]], 1)
        n = len(self.components)
        sums = torch.zeros(n, 7, device=device).index_add_(0, lay.unit_comp, unit)
        absmax = torch.zeros(n, device=device).scatter_reduce_(0, lay.unit_comp, unit[:, 4], "amax")
        count = sums[:, 0].clamp_min(1)
        return {"out_mean": sums[:, 1] / count, "out_rms": (sums[:, 2] / count).sqrt(),
                "out_absmax": absmax, "out_zero_frac": sums[:, 3] / count,
                "out_sat_frac": sums[:, 5] / count, "out_dead_frac": sums[:, 6] / lay.n_unit}

    def _head_stats(self) -> dict[str, torch.Tensor]:
        n = len(self.components)
        device = self.samples[0][1].device
        entropy = torch.full((n,), math.nan, device=device)
        maxprob = torch.full((n,), math.nan, device=device)
        for c, s in self.samples:
            if self.components[c].head:
                p = torch.softmax(s.float(), dim=1)  # s is (rows, classes)
                entropy[c] = torch.special.entr(p).sum(1).mean()  # entr(0) = 0; NaN stays NaN
                maxprob[c] = p.amax(1).mean()
        return {"pred_entropy_nats": entropy, "pred_maxprob": maxprob}


class ParamProbe:
    """Gradient, weight, update and drift statistics of the parameter-owning components.

    Weights are observed at three points: the first forward of a step (`begin`), optimizer.step's
    pre-hook (`grads`) and its post-hook (`end`). Update and drift come from a fixed random sketch
    of coordinates per parameter (all coordinates when the tensor has at most `sketch_size`), scaled
    by numel/k to estimate the full L2 norm; drift also takes the change of the exact weight norm,
    which catches a change outside the sketch (a scaled layer, a large flipped exponent).
    """

    def __init__(self, components: list[Component], sketch_size: int, seed: int = 0) -> None:
        self.n = len(components)
        owned = [(c.index, p) for c in components for p in c.params]
        self.params = [p for _, p in owned]
        device = self.params[0].device if self.params else torch.device("cpu")
        self.device = device
        gen = torch.Generator().manual_seed(seed)  # own generator: the global RNG is untouched
        self.sketch_idx: list[torch.Tensor | None] = []
        scales, coord_comp = [], []
        for comp, p in owned:
            numel = local_shard(p).numel()  # a sharded (FSDP2) parameter: this rank's shard
            k = min(numel, sketch_size)
            idx = None if k == numel else torch.randperm(numel, generator=gen)[:k].sort().values
            self.sketch_idx.append(None if idx is None else idx.to(device))
            scales.append(torch.full((k,), numel / k))
            coord_comp.append(torch.full((k,), comp, dtype=torch.long))
        self.param_comp = torch.tensor([c for c, _ in owned], dtype=torch.long, device=device)
        self.scale = torch.cat(scales).to(device) if scales else torch.zeros(0, device=device)
        self.coord_comp = torch.cat(coord_comp).to(device) if coord_comp else self.param_comp
        self.is_param = np.zeros(self.n, dtype=bool)
        self.is_param[[c for c, _ in owned]] = True
        self._grad_cache: dict[tuple[bool, ...], tuple[torch.Tensor, np.ndarray]] = {}
        self.begun = False
        self._fwd: tuple[torch.Tensor, torch.Tensor] | None = None
        self._prev_end: tuple[torch.Tensor, torch.Tensor] | None = None
        self._prev_update: torch.Tensor | None = None
        self.grad_cols: dict[str, torch.Tensor] = {}
        self.has_grad = np.zeros(self.n, dtype=bool)
        self.total_grad_norm: torch.Tensor | None = None
        self.refresh()

    def refresh(self) -> None:
        """Re-take the flat views of the parameters (in case `p.data` was replaced)."""
        self._flat = [local_shard(p).reshape(-1) for p in self.params]

    def _sketch(self) -> torch.Tensor:
        parts = [f if idx is None else f[idx] for f, idx in zip(self._flat, self.sketch_idx, strict=True)]
        return torch.cat(parts).float()

    def _comp_norms(self, tensors: list[torch.Tensor], comp: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(per-component L2 norms, per-tensor L2 norms): one fused pass over `tensors`."""
        norms = torch.stack(torch._foreach_norm(tensors)).float()
        sq = torch.zeros(self.n, device=self.device).index_add_(0, comp, norms * norms)
        return sq.sqrt(), norms

    def _weights(self) -> tuple[torch.Tensor, torch.Tensor]:
        return self._sketch(), self._comp_norms(self._flat, self.param_comp)[0]

    def begin(self) -> None:
        """First training forward of a step: remember the weights as the step found them."""
        if self.params:
            self._fwd = self._weights()
        self.begun = True

    def grads_suspect(self) -> bool:
        """True unless the gradients accumulated so far exist and are all finite (CPU: cheap)."""
        grads = [local_shard(p.grad) for p in self.params if p.grad is not None]
        if not grads:
            return True
        return not bool(torch.isfinite(torch.stack(torch._foreach_norm(grads)).sum()))

    def grads(self) -> None:
        """optimizer.step pre-hook: per-component gradient norms and non-finite counts."""
        if not self.begun:
            self.begin()
        has = tuple(p.grad is not None for p in self.params)
        if has not in self._grad_cache:
            sel = [i for i, h in enumerate(has) if h]
            comp_mask = np.zeros(self.n, dtype=bool)
            comp_mask[self.param_comp[sel].tolist()] = True
            self._grad_cache[has] = (self.param_comp[sel], comp_mask)
        comp, self.has_grad = self._grad_cache[has]
        grads = [local_shard(p.grad) for p in self.params if p.grad is not None]
        if not grads:
            self.grad_cols, self.total_grad_norm = {}, None
            return
        comp_norms, norms = self._comp_norms(grads, comp)
        self.total_grad_norm = norms.double().square().sum().sqrt()
        bad = torch.zeros(self.n, dtype=torch.long, device=self.device)
        if self.device.type != "cpu" or not bool(torch.isfinite(self.total_grad_norm)):
            # on CPU reading the total is free, so the per-tensor counts run only when needed
            counts = torch.stack([g.numel() - torch.isfinite(g).sum() for g in grads])
            bad.index_add_(0, comp, counts)
        self.grad_cols = {"grad_norm_l2": comp_norms, "grad_nonfinite_count": bad.double()}

    def end(self) -> tuple[dict[str, torch.Tensor], np.ndarray]:
        """optimizer.step post-hook: weight, update and drift columns, and their validity."""
        n = self.n
        nan = torch.full((n,), math.nan, device=self.device)
        cols = {k: nan for k in ("grad_norm_l2", "grad_nonfinite_count", "weight_norm_l2",
                                 "update_norm_l2", "update_ratio", "update_cos", "weight_drift_l2")}
        valid = np.zeros((n, 7), dtype=bool)  # same order as the keys above
        if not self.params:
            return cols, valid
        if not self.begun:
            self.begin()
        cols.update(self.grad_cols)
        valid[:, 0:2] = self.has_grad[:, None]
        sketch, wnorm = self._weights()
        cols["weight_norm_l2"] = wnorm
        valid[:, 2] = self.is_param
        if self._fwd is not None:
            fwd_sketch, fwd_norm = self._fwd
            update = sketch - fwd_sketch
            prev = self._prev_update if self._prev_update is not None else update
            drift = fwd_sketch - (self._prev_end[0] if self._prev_end is not None else fwd_sketch)
            # the four per-component sums of scaled sketch products in one segment reduction
            terms = torch.stack([update * update, update * prev, prev * prev, drift * drift])
            sums = torch.zeros(4, n, device=self.device).index_add_(1, self.coord_comp, terms * self.scale)
            unorm = sums[0].sqrt()
            cols["update_norm_l2"], cols["update_ratio"] = unorm, unorm / wnorm
            valid[:, 3:5] = self.is_param[:, None]
            if self._prev_update is not None:
                cols["update_cos"] = sums[1] / (unorm * sums[2].sqrt())
                valid[:, 5] = self.is_param
            if self._prev_end is not None:
                cols["weight_drift_l2"] = torch.maximum(sums[3].sqrt(), (fwd_norm - self._prev_end[1]).abs())
                valid[:, 6] = self.is_param
            self._prev_update = update
        self._prev_end = (sketch, wnorm)
        self.begun, self._fwd, self.grad_cols = False, None, {}
        self.has_grad = np.zeros(n, dtype=bool)
        return cols, valid
