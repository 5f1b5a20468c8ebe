"""Parameter statistics per step: gradient, weight, update and drift norms of every component.

Three passes over memory per step (weight norms as the step found them, gradient norms, weight
norms after the step), each one fused `torch._foreach_norm`; everything else works on a fixed
sketch of a few hundred coordinates per parameter, read through views made once.
"""

from __future__ import annotations

import math

import numpy as np
import torch

from .components import Component
from .probes import PARAM_METRICS, to_device
from .replicas import local_shard


def _sketch_slice(p: torch.Tensor, k: int, gen: np.random.Generator) -> tuple[int, int]:
    """(offset, stride) of a k-coordinate strided sketch of `p`: the stride is coprime with the
    last dimension, so the coordinates visit every column of a matrix, not one."""
    n = p.numel()
    stride = n // k
    last = p.shape[-1] if p.dim() else 1
    while stride > 1 and math.gcd(stride, last) != 1:
        stride -= 1
    offset = int(gen.integers(0, n - (k - 1) * stride))
    return offset, stride


class ParamProbe:
    """Gradient, weight, update and drift statistics of the parameter-owning components.

    Weights are observed at three points: the first forward of a step (`begin`), optimizer.step's
    pre-hook (`grads`) and its post-hook (`end`). Update and drift come from a fixed sketch of
    coordinates per parameter (all coordinates when the tensor has at most `sketch_size`; else a
    strided slice at a random offset, read through a view made once, so a step's whole sketch is
    one concatenation), scaled by numel/k to estimate the full L2 norm; drift also takes the
    change of the exact weight norm, which catches a change outside the sketch (a scaled layer,
    a large flipped exponent).

    Gradient norms are taken at the optimizer's pre-hook, i.e. after anything the training loop
    did to the gradients (clipping, unscaling). The total norm as the last backward pass left it
    (`preclip_total`) is the same value when nothing modified the gradients in between (seen
    from their version counters); once a modification was seen, the norms are also taken at the
    end of every backward pass (one more pass over the gradients per micro-batch).
    """

    def __init__(self, components: list[Component], sketch_size: int, seed: int = 0) -> None:
        self.n = len(components)
        owned = [(c.index, p) for c in components for p in c.params]
        self.params = [p for _, p in owned]
        device = self.params[0].device if self.params else torch.device("cpu")
        self.device = device
        gen = np.random.default_rng(seed)  # own generator: the global RNGs are untouched
        self._sketch_spec: list[tuple[int, int, int] | None] = []  # (offset, stride, k); None: all
        scales, coord_comp = [], []
        for comp, p in owned:
            local = local_shard(p)  # a sharded (FSDP2) parameter: this rank's shard
            k = min(local.numel(), sketch_size)
            self._sketch_spec.append(None if k == local.numel() else (*_sketch_slice(local, k, gen), k))
            scales.append(np.full(k, local.numel() / k, dtype=np.float32))
            coord_comp.append(np.full(k, comp, dtype=np.int64))
        self.param_comp_np = np.array([c for c, _ in owned], dtype=np.int64)
        self.param_comp = to_device(self.param_comp_np, device)
        self.scale = to_device(np.concatenate(scales) if scales else np.zeros(0, np.float32), device)
        self.coord_comp = to_device(np.concatenate(coord_comp) if coord_comp else np.zeros(0, np.int64),
                                    device)
        self._no_grad = [local_shard(p).new_zeros(0) for p in self.params]
        self.is_param = np.zeros(self.n, dtype=bool)
        self.is_param[self.param_comp_np] = True
        self.begun = False
        self._fwd: tuple[torch.Tensor, torch.Tensor] | None = None
        self._prev_end: tuple[torch.Tensor, torch.Tensor] | None = None
        self._prev_update: torch.Tensor | None = None
        self.grad_cols: dict[str, torch.Tensor] = {}
        self.has_grad = np.zeros(self.n, dtype=bool)
        self.total_grad_norm: torch.Tensor | None = None
        self.grads_finite = True        # CPU only: the host verdict on the total gradient norm
        self.preclip_total: torch.Tensor | None = None
        self.modified_after_backward = False  # the loop was seen to change gradients after backward
        self._at_backward: tuple[tuple[object, ...], tuple[torch.Tensor, ...] | None] | None = None
        self.refresh()

    def refresh(self) -> None:
        """Re-take the views of the parameters (in case `p.data` was replaced)."""
        self._flat = [local_shard(p) for p in self.params]
        self._views: list[torch.Tensor] = []
        self._gathered: list[tuple[int, torch.Tensor]] = []  # non-contiguous: indexed each step
        for i, (p, spec) in enumerate(zip(self._flat, self._sketch_spec, strict=True)):
            if spec is None:
                self._views.append(p.reshape(-1))  # a copy if not contiguous: refreshed below
                if not p.is_contiguous():
                    self._gathered.append((i, torch.arange(p.numel(), device=p.device)))
                continue
            off, stride, k = spec
            if p.is_contiguous():
                self._views.append(p.view(-1)[off:off + (k - 1) * stride + 1:stride])
            else:
                idx = torch.arange(off, off + (k - 1) * stride + 1, stride, device=p.device)
                self._views.append(p.reshape(-1)[idx])
                self._gathered.append((i, idx))

    def _sketch(self) -> torch.Tensor:
        parts = self._views
        if self._gathered:
            parts = list(parts)
            for i, idx in self._gathered:
                parts[i] = self._flat[i].reshape(-1)[idx]
        return torch.cat(parts).float()

    def _comp_norms(self, tensors: list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        """(per-component L2 norms, per-tensor L2 norms): one fused pass over `tensors`."""
        norms = torch.stack(torch._foreach_norm(tensors)).float()
        sq = torch.zeros(self.n, device=self.device).index_add_(0, self.param_comp, norms * norms)
        return sq.sqrt(), norms

    def _weights(self) -> tuple[torch.Tensor, torch.Tensor]:
        return self._sketch(), self._comp_norms(self._flat)[0]

    @torch.no_grad()
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

    def _grads(self) -> list[torch.Tensor]:
        # a parameter without a gradient stands in as an empty tensor (norm 0): the list, and so
        # the per-tensor -> component index, is the same every step whatever has a gradient
        return [z if p.grad is None else local_shard(p.grad)
                for p, z in zip(self.params, self._no_grad, strict=True)]

    def _versions(self) -> tuple[object, ...]:
        return tuple(None if p.grad is None else (id(p.grad), p.grad._version) for p in self.params)

    @torch.no_grad()
    def after_backward(self) -> None:
        """End of a backward pass: note the gradients' versions (and norms, if the loop modifies them)."""
        norms = None
        if self.modified_after_backward and self.params:
            norms = self._comp_norms(self._grads())
        self._at_backward = (self._versions(), norms)

    @torch.no_grad()
    def grads(self) -> None:
        """optimizer.step pre-hook: per-component gradient norms and non-finite counts."""
        if not self.begun:
            self.begin()
        has = np.fromiter((p.grad is not None for p in self.params), dtype=bool, count=len(self.params))
        self.has_grad = np.zeros(self.n, dtype=bool)
        self.has_grad[self.param_comp_np[has]] = True
        self.preclip_total = None
        if not has.any():
            self.grad_cols, self.total_grad_norm = {}, None
            return
        grads = self._grads()
        at_bw = self._at_backward
        unchanged = at_bw is not None and at_bw[0] == self._versions()
        if unchanged and at_bw[1] is not None:
            comp_norms, norms = at_bw[1]
        else:
            comp_norms, norms = self._comp_norms(grads)
        self.total_grad_norm = norms.double().square().sum().sqrt()
        if unchanged:
            self.preclip_total = self.total_grad_norm
        elif at_bw is not None:
            self.modified_after_backward = True
            if at_bw[1] is not None:
                self.preclip_total = at_bw[1][1].double().square().sum().sqrt()
        self._at_backward = None
        bad = torch.zeros(self.n, dtype=torch.long, device=self.device)
        self.grads_finite = self.device.type != "cpu" or bool(torch.isfinite(self.total_grad_norm))
        if self.device.type != "cpu" or not self.grads_finite:
            # on CPU reading the total is free, so the per-tensor counts run only when needed
            counts = torch.stack([g.numel() - torch.isfinite(g).sum() for g in grads])
            bad.index_add_(0, self.param_comp, counts)
        self.grad_cols = {"grad_norm_l2": comp_norms, "grad_nonfinite_count": bad.double()}

    @torch.no_grad()
    def end(self) -> tuple[torch.Tensor, np.ndarray]:
        """optimizer.step post-hook: the (C, len(PARAM_METRICS)) block of this step and its validity."""
        n = self.n
        nan = torch.full((n,), math.nan, device=self.device)
        cols = dict.fromkeys(PARAM_METRICS, nan)
        valid = {m: np.zeros(n, dtype=bool) for m in PARAM_METRICS}
        if not self.params:
            return torch.stack([cols[m] for m in PARAM_METRICS], 1), _stack(valid)
        if not self.begun:
            self.begin()
        cols.update(self.grad_cols)
        valid["grad_norm_l2"] = valid["grad_nonfinite_count"] = self.has_grad
        sketch, wnorm = self._weights()
        cols["weight_norm_l2"] = wnorm
        valid["weight_norm_l2"] = self.is_param
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
            valid["update_norm_l2"] = valid["update_ratio"] = self.is_param
            if self._prev_update is not None:
                cols["update_cos"] = sums[1] / (unorm * sums[2].sqrt())
                valid["update_cos"] = self.is_param
            if self._prev_end is not None:
                cols["weight_drift_l2"] = torch.maximum(sums[3].sqrt(), (fwd_norm - self._prev_end[1]).abs())
                valid["weight_drift_l2"] = self.is_param
            self._prev_update = update
        self._prev_end = (sketch, wnorm)
        self.begun, self._fwd, self.grad_cols = False, None, {}
        self.has_grad = np.zeros(n, dtype=bool)
        return torch.stack([cols[m] for m in PARAM_METRICS], 1), _stack(valid)


def _stack(valid: dict[str, np.ndarray]) -> np.ndarray:
    return np.stack([valid[m] for m in PARAM_METRICS], 1)
