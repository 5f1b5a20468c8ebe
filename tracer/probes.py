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

DEAD_EPS = 1e-6      # |output| at or below this counts as "no response" for the dead fraction
_MAX_IMAGES = 8      # channel-first outputs: images taken before striding over positions


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


def subsample(t: torch.Tensor, rows: int, channel_first: bool) -> tuple[torch.Tensor, int]:
    """A flat copy of at most `rows` strided rows of `t` viewed as (rows, units), and units."""
    t = t.detach()
    if t.dim() < 2:
        t = t.reshape(1, -1)
    if t.dim() >= 4 or (channel_first and t.dim() == 3):
        b = t.shape[0]
        t = t[:: max(1, b // _MAX_IMAGES)][:_MAX_IMAGES].movedim(1, -1)  # (b', *spatial, C)
    units = t.shape[-1]
    flat = t.reshape(-1, units)
    flat = flat[:: max(1, flat.shape[0] // rows)][:rows]
    return flat.clone(memory_format=torch.contiguous_format).view(-1), units


class _Layout:
    """Index tensors mapping concatenated subsample elements to units and components."""

    def __init__(self, key: tuple[tuple[int, int, int], ...], components: list[Component],
                 device: torch.device) -> None:
        comps = torch.tensor([k[0] for k in key], dtype=torch.long)
        numels = torch.tensor([k[1] for k in key], dtype=torch.long)
        units = torch.tensor([k[2] for k in key], dtype=torch.long)
        unit_offset = torch.cumsum(units, 0) - units
        per_elem_unit = [torch.arange(n) % u + o for n, u, o in
                         zip(numels.tolist(), units.tolist(), unit_offset.tolist(), strict=True)]
        centre = torch.zeros(len(components))
        half = torch.full((len(components),), math.inf)
        for c in components:
            if c.bound in SAT_RANGES:
                centre[c.index], half[c.index] = SAT_RANGES[c.bound]
        n = len(components)
        self.elem_comp = torch.repeat_interleave(comps, numels).to(device)
        self.elem_unit = torch.cat(per_elem_unit).to(device)
        self.unit_comp = torch.repeat_interleave(comps, units).to(device)
        self.elem_centre = centre[self.elem_comp.cpu()].to(device)
        self.elem_sat_at = (0.98 * half)[self.elem_comp.cpu()].to(device)
        self.n_elem = torch.zeros(n).index_add_(0, comps, numels.float()).clamp_min(1).to(device)
        self.n_unit = torch.zeros(n).index_add_(0, comps, units.float()).clamp_min(1).to(device)
        self.total_units = int(units.sum())


class ForwardProbe:
    """Forward-output statistics of every component, batched once per step."""

    def __init__(self, components: list[Component], rows: int) -> None:
        self.components = components
        self.rows = rows
        self.samples: list[tuple[int, torch.Tensor, int]] = []   # (component, flat sample, units)
        self.finite: list[tuple[int, torch.Tensor, int]] = []    # (component, finite count, numel)
        self.sampled = np.zeros(len(components), dtype=bool)
        self._layouts: dict[tuple[tuple[int, int, int], ...], _Layout] = {}

    def observe(self, comp: Component, out: object) -> None:
        """Hook body: count non-finite values of the whole output; subsample it once per step."""
        t = first_tensor(out)
        if t is None:
            return
        self.finite.append((comp.index, torch.isfinite(t.detach()).sum(), t.numel()))
        if not self.sampled[comp.index]:
            self.sampled[comp.index] = True
            sample, units = subsample(t, self.rows, comp.channel_first)
            self.samples.append((comp.index, sample, units))

    def reset(self) -> None:
        """Forget this step's observations."""
        self.samples.clear()
        self.finite.clear()
        self.sampled[:] = False

    def compute(self, device: torch.device) -> dict[str, torch.Tensor]:
        """The `out_*` and `pred_*` columns for all components (length C each; NaN where unseen)."""
        n = len(self.components)
        cols = {name: torch.full((n,), math.nan, device=device) for name in (
            "out_mean", "out_rms", "out_absmax", "out_zero_frac", "out_sat_frac",
            "out_dead_frac", "out_nonfinite_count", "pred_entropy_nats", "pred_maxprob")}
        if self.finite:
            idx = torch.tensor([f[0] for f in self.finite], device=device)
            numel = torch.tensor([f[2] for f in self.finite], device=device)
            bad = numel - torch.stack([f[1] for f in self.finite]).to(device)
            cols["out_nonfinite_count"] = torch.zeros(n, dtype=torch.long, device=device
                                                      ).index_add_(0, idx, bad).double()
        if self.samples:
            cols.update(self._sample_stats(device))
            cols.update(self._head_stats(device))
        return cols

    def _sample_stats(self, device: torch.device) -> dict[str, torch.Tensor]:
        key = tuple((c, s.numel(), u) for c, s, u in self.samples)
        lay = self._layouts.get(key)
        if lay is None:
            if len(self._layouts) > 8:  # shapes keep changing: do not grow without bound
                self._layouts.clear()
            lay = self._layouts[key] = _Layout(key, self.components, device)
        n = len(self.components)
        v = torch.cat([s.to(device=device, dtype=torch.float32) for _, s, _ in self.samples])
        fin = torch.isfinite(v)
        v0 = torch.where(fin, v, 0.0)
        a = v0.abs()
        sat = (v0 - lay.elem_centre).abs() >= lay.elem_sat_at
        per_elem = torch.stack([fin.float(), v0, v0 * v0, (v == 0).float(), sat.float()])
        sums = torch.zeros(5, n, device=device).index_add_(1, lay.elem_comp, per_elem)
        absmax = torch.zeros(n, device=device).scatter_reduce_(0, lay.elem_comp, a, "amax")
        unit_max = torch.zeros(lay.total_units, device=device).scatter_reduce_(
            0, lay.elem_unit, a, "amax")
        dead = torch.zeros(n, device=device).index_add_(0, lay.unit_comp, (unit_max <= DEAD_EPS).float())
        count = sums[0].clamp_min(1)
        return {"out_mean": sums[1] / count, "out_rms": (sums[2] / count).sqrt(),
                "out_absmax": absmax, "out_zero_frac": sums[3] / lay.n_elem,
                "out_sat_frac": sums[4] / lay.n_elem, "out_dead_frac": dead / lay.n_unit}

    def _head_stats(self, device: torch.device) -> dict[str, torch.Tensor]:
        n = len(self.components)
        entropy = torch.full((n,), math.nan, device=device)
        maxprob = torch.full((n,), math.nan, device=device)
        for c, s, units in self.samples:
            if not self.components[c].head:
                continue
            p = torch.softmax(s.view(-1, units).float(), dim=-1)
            entropy[c] = torch.special.entr(p).sum(-1).mean()  # entr(0) = 0; NaN stays NaN
            maxprob[c] = p.max(-1).values.mean()
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
            k = min(p.numel(), sketch_size)
            idx = None if k == p.numel() else torch.randperm(p.numel(), generator=gen)[:k].sort().values
            self.sketch_idx.append(None if idx is None else idx.to(device))
            scales.append(torch.full((k,), p.numel() / k))
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

    def _sketch(self) -> torch.Tensor:
        parts = [p.detach().reshape(-1) if idx is None else p.detach().reshape(-1)[idx]
                 for p, idx in zip(self.params, self.sketch_idx, strict=True)]
        return torch.cat([t.float() for t in parts])

    def _comp_norms(self, tensors: list[torch.Tensor], comp: torch.Tensor) -> torch.Tensor:
        norms = torch.stack([t.float() for t in torch._foreach_norm(tensors)])
        sq = torch.zeros(self.n, device=self.device).index_add_(0, comp, norms * norms)
        return sq.sqrt()

    def _weights(self) -> tuple[torch.Tensor, torch.Tensor]:
        return self._sketch(), self._comp_norms([p.detach() for p in self.params], self.param_comp)

    def _per_comp(self, coords: torch.Tensor) -> torch.Tensor:
        """Estimated per-component L2 norm of a sketched vector (sum of scaled squares)."""
        sq = torch.zeros(self.n, device=self.device).index_add_(0, self.coord_comp, self.scale * coords)
        return sq.clamp_min(0).sqrt()

    def begin(self) -> None:
        """First training forward of a step: remember the weights as the step found them."""
        if self.params:
            self._fwd = self._weights()
        self.begun = True

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
        grads = [p.grad.detach() for p in self.params if p.grad is not None]
        if not grads:
            self.grad_cols, self.total_grad_norm = {}, None
            return
        norms = torch.stack([t.float() for t in torch._foreach_norm(grads)])
        self.total_grad_norm = norms.double().square().sum().sqrt()
        sq = torch.zeros(self.n, device=self.device).index_add_(0, comp, norms * norms)
        bad = torch.zeros(self.n, dtype=torch.long, device=self.device)
        if self.device.type != "cpu" or not bool(torch.isfinite(self.total_grad_norm)):
            # on CPU reading the total is free, so the per-tensor counts run only when needed
            counts = torch.stack([g.numel() - torch.isfinite(g).sum() for g in grads])
            bad.index_add_(0, comp, counts)
        self.grad_cols = {"grad_norm_l2": sq.sqrt(), "grad_nonfinite_count": bad.double()}

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
            update = sketch - self._fwd[0]
            unorm = self._per_comp(update * update)
            cols["update_norm_l2"], cols["update_ratio"] = unorm, unorm / wnorm
            valid[:, 3:5] = self.is_param[:, None]
            if self._prev_update is not None:
                prev = self._prev_update
                dot = torch.zeros(n, device=self.device).index_add_(
                    0, self.coord_comp, self.scale * update * prev)
                cols["update_cos"] = dot / (unorm * self._per_comp(prev * prev))
                valid[:, 5] = self.is_param
            self._prev_update = update
            if self._prev_end is not None:
                d = self._fwd[0] - self._prev_end[0]
                cols["weight_drift_l2"] = torch.maximum(self._per_comp(d * d),
                                                        (self._fwd[1] - self._prev_end[1]).abs())
                valid[:, 6] = self.is_param
        self._prev_end = (sketch, wnorm)
        self.begun, self._fwd, self.grad_cols = False, None, {}
        self.has_grad = np.zeros(n, dtype=bool)
        return cols, valid
