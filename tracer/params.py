"""Parameter statistics per step: gradient, weight, update and drift norms of every component.

Two passes over memory per step (gradient norms, weight norms after the step), and a third (the
weight norms as the step found them) when something may have written the weights between steps,
and every 8th step; each is one fused `torch._foreach_norm` (on the CPU, BLAS dot products) whose per-tensor norms go
straight into the step's row of a preallocated buffer, beside a fixed sketch of a few hundred coordinates
per parameter (read through views made once: one `torch.cat` into the same row). Everything
derived from those rows (per-component norms, update, cosine, drift, the total gradient norm) is
computed by `reduce` for a batch of steps at once, with the same arithmetic as one step at a
time: on a small model each eager op costs more than its arithmetic, so a step does a handful
of ops here and the derivation's many ops run once per batch of steps.
"""

from __future__ import annotations

import collections
import math
from dataclasses import dataclass
from typing import NamedTuple

import numpy as np
import torch

from . import kernels
from .components import Component
from .loopfacts import versions_of
from .probes import FORWARD_BATCH_STEPS, PARAM_METRICS, to_device, without_grad
from .replicas import grad_values, local_shard, lost_storage

_PM = {m: i for i, m in enumerate(PARAM_METRICS)}
# a CPU dot product's norm below this may have lost entries to float32 underflow: taken exactly
_DOT_SMALLEST = 1e-15
# CPU: a tensor of at least this many values has its norm taken by a BLAS dot product (which
# reads a large vector on all of torch's threads) rather than by the compiled pass, where that
# pass runs on one thread (`ParamProbe._share_blas`)
BLAS_FROM = 131_072
# steps between exact weight-norm checks at the first forward when no version counter moved
EXACT_DRIFT_EVERY = 8
# steps whose numbers of backward passes say which backward pass of a step takes the pre-clip norms
BACKWARD_COUNT_STEPS = 8
# steps between exact pre-clip norm passes once the loop is known to rescale its gradients
EXACT_PRECLIP_EVERY = 8
# how far apart two scale factors, or a value and its rescaled copy, may be and still be one
# factor: a few float32 roundings of the values and their norms
_ONE_FACTOR = 2.0**-20
# coordinates per parameter of the gradients' sketch that shows the factor (a share of the
# weights' sketch: each is a cache line the backward end reads)
FACTOR_SKETCH = 16
# a backward end's sketch whose norm is at or past this (or not finite) takes the exact pass
# instead: the loop's float32 total norm of such gradients may overflow, and a clip by an
# infinite total multiplies them by zero, a factor the sketch cannot undo
_SKETCH_LARGEST = 2.0**40
_MAX_FACTOR_SKETCHES = 8  # patterns of which parameters have a gradient kept at once
# where a step's pre-clip total gradient norm comes from (`_BY_FACTOR`: the total over its factor)
_NO_PRECLIP, _SAME_AS_TOTAL, _AT_BACKWARD, _BY_FACTOR = 0, 1, 2, 3
# what the end of a backward pass took of the gradients for the pre-clip norms
_TOOK_NORMS, _TOOK_SKETCH = 1, 2


_NARROW = (torch.bfloat16, torch.float16)
_NORM_DTYPE = [True]  # torch._foreach_norm takes a dtype (older torch: without it)


def _fused_norms(tensors: list[torch.Tensor], wide: bool) -> list[torch.Tensor]:
    """`torch._foreach_norm`, summed and returned in float32 if `wide` (16-bit tensors: in their
    own precision a norm keeps three significant digits, and a step's change is lost in them)."""
    if wide and _NORM_DTYPE[0]:
        try:
            return torch._foreach_norm(tensors, 2, dtype=torch.float32)
        except (TypeError, RuntimeError):
            _NORM_DTYPE[0] = False
    return torch._foreach_norm(tensors)


def _written_once(before: list[int], now: list[int]) -> bool:
    """Between two `versions_of` readings, was every gradient there in both the same tensor,
    written exactly once (a parameter without one in both aside)?"""
    return before[0::2] == now[0::2] and all(
        b == -1 or n - b == 1 for b, n in zip(before[1::2], now[1::2], strict=True))


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


def _refuse_lost(grads: list[torch.Tensor]) -> None:
    """Raise (a probe failure, caught by the recorder) if a gradient lost its storage."""
    for i, g in enumerate(grads):
        if lost_storage(g):
            raise RuntimeError(f"the gradient of parameter {i} has lost its storage (freed in place?): "
                               "its norms are not taken this step")


class _Row(NamedTuple):
    """Views of one step's row in `ParamProbe.rows`."""

    fwd_sketch: torch.Tensor
    end_sketch: torch.Tensor
    fwd_norms: torch.Tensor
    grad_norms: torch.Tensor
    end_norms: torch.Tensor
    pre_norms: torch.Tensor


class _FactorSketch(NamedTuple):
    """The gradients' sketch that shows the loop's factor, for one pattern of which parameters
    have a gradient: the gather's (offsets, strides, counts), the gradients' lengths it was made
    for, views of the sketch at the backward end and at the optimizer step, and the compiled
    norm pass's (address, length, norm) arrays for the one at the backward end."""

    at: tuple[np.ndarray, np.ndarray, np.ndarray]
    lens: list[int]
    before: np.ndarray
    after: np.ndarray
    norm_of_before: tuple[np.ndarray, np.ndarray, np.ndarray]


@dataclass
class _Step:
    """A finished step whose row waits for `reduce`."""

    slot: int                   # its row in the step buffer
    preclip: int                # _NO_PRECLIP, _SAME_AS_TOTAL, _AT_BACKWARD or _BY_FACTOR
    bad: torch.Tensor | None    # (C,) float64 non-finite gradient counts; None: all finite
    exact_fwd: bool             # the weight norms at its first forward were taken (else: the last end's)
    factor: float               # _BY_FACTOR: what the loop rescaled the gradients by


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
    end of the backward pass that may be the step's last: from the fewest backward passes any of
    the last `BACKWARD_COUNT_STEPS` steps made on (a loop that accumulates gradients over m
    micro-batches takes one more pass over them a step, not m). A step that ends with fewer
    backward passes than that has no pre-clip norm (null), as a run's first step has none.
    """

    def __init__(self, components: list[Component], sketch_size: int, seed: int = 0) -> None:
        self.n = len(components)
        owned = [(c.index, p) for c in components for p in c.params]
        self.params = [p for _, p in owned]
        device = self.params[0].device if self.params else torch.device("cpu")
        self.device = device
        gen = np.random.default_rng(seed)  # own generator: the global RNGs are untouched
        self._sketch_spec: list[tuple[int, int, int] | None] = []  # (offset, stride, k); None: all
        scales, coord_comp, numels = [], [], []
        for comp, p in owned:
            local = local_shard(p)  # a sharded (FSDP2) parameter: this rank's shard
            k = min(local.numel(), sketch_size)
            self._sketch_spec.append(None if k == local.numel() else (*_sketch_slice(local, k, gen), k))
            numels.append(local.numel())
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
        # the usual step, every parameter with a gradient, reuses arrays made once (a numpy op
        # costs the step far more than it costs in a loop, its code cold between the training's
        # ops): they are shared, so read-only
        self._every_param = np.ones(len(self.params), dtype=bool)
        self._every_param.flags.writeable = self.is_param.flags.writeable = False
        # a step's row: the sketch at its first forward and after it, then four per-tensor norm
        # vectors (weights at the first forward, gradients, weights after, gradients at backward end)
        k, n_p = len(self.scale), len(self.params)
        self._fwd_sketch, self._end_sketch = slice(0, k), slice(k, 2 * k)
        self._norms = slice(2 * k, 2 * k + 4 * n_p)
        self._fwd_n, self._grad_n, self._end_n, self._pre_n = (
            slice(2 * k + i * n_p, 2 * k + (i + 1) * n_p) for i in range(4))
        self.rows = torch.zeros(FORWARD_BATCH_STEPS, 2 * k + 4 * n_p, device=device, dtype=torch.float32)
        self._row_views = self._views_of(self.rows)  # made once: a slice in every hook is dispatch
        # CPU float32 parameters: norms and sketches in compiled passes over the tensors' memory
        # (tracer/kernels.py), written through numpy views of the same rows
        # (until the kernels are loaded, `kernels.ready`, the eager ops take every pass; the
        # compiled passes take over at a step's end, `_take_compiled`)
        self._may_compile = bool(self.params) and all(p.device.type == "cpu" for p in self.params)
        self._compiled = self._may_compile and kernels.ready()
        self._numel = np.array(numels, dtype=np.int64)
        # offsets, strides, counts: three arrays made once (a kernel's wrapper knows their addresses)
        self._sketch_at = tuple(np.array([(0, 1, n) if spec is None else spec
                                          for spec, n in zip(self._sketch_spec, numels, strict=True)],
                                         dtype=np.int64).reshape(-1, 3).T.copy())
        for spec in self._sketch_at:
            spec.flags.writeable = False
        # the rows as numpy (`_rows_np`, None until the kernels are loaded), and views of them
        self._rows_np: np.ndarray | None = self.rows.numpy() if self._compiled else None
        self._np_views = self._views_of(self._rows_np) if self._rows_np is not None else []
        self._grad_addrs = np.zeros(n_p, dtype=np.int64)
        self._grad_lens = np.zeros(n_p, dtype=np.int64)
        self._grad_numel = np.zeros(n_p, dtype=np.int64)  # every length, the BLAS-sized ones too
        self._local_norms = np.zeros(n_p, dtype=np.float32)  # `local_norms`'s output
        # the addresses and lengths those three hold (set by `_share_blas`, empty: taken again)
        self._grad_lists: tuple[list[int], list[int]] = ([], [])
        # the ids, addresses and lengths of the gradients `_grad_addresses` last checked this step
        self._checked_grads: tuple[list[int], list[int], list[int]] | None = None
        self._scratch = np.zeros(n_p, dtype=np.float32)  # grads_so_far_finite's norms (and a tensor view)
        self._scratch_t = torch.from_numpy(self._scratch)
        self._share_blas()
        self._weight_addrs: np.ndarray | None = None  # set by refresh() when the weights qualify
        self._weight_ptrs: list[int] = []                # the same addresses, to compare with
        self._sharded = any(callable(getattr(p, "to_local", None)) for p in self.params)
        self.pending: list[_Step] = []
        # `reduce`'s working rows, kept (fresh sketch-sized temporaries every few steps cost page
        # faults in the training's own ops): [0] the last reduced step's update then the queued
        # steps' updates, [1] their drift sketches; the four sketch products per step; and the last
        # reduced step's weight sketch and per-component weight norms
        self._work = torch.empty(2, FORWARD_BATCH_STEPS + 1, k, device=device)
        self._prods = torch.empty(4, FORWARD_BATCH_STEPS, k, device=device)
        self._scaled = torch.empty(k * 4 * FORWARD_BATCH_STEPS, device=device)  # them, scaled, coordinate-major
        self._carry_sketch = torch.empty(k, device=device)
        self._carry_wnorm: torch.Tensor | None = None  # None: no step reduced yet
        # CPU, compiled: `reduce`'s sketch sums (n, 4, steps), float32, and numpy views of what the
        # kernel reads and carries (`_kernel_views`)
        self._sketch_out = torch.empty(self.n * 4 * FORWARD_BATCH_STEPS, device=device)
        if self._compiled:
            self._kernel_views()
        self._ends = 0  # steps ended so far: update cosine and drift need a step before
        self._valid = np.zeros((2, self.n, len(PARAM_METRICS)), dtype=bool)  # [first step, later]
        for m in ("weight_norm_l2", "update_norm_l2", "update_ratio"):
            self._valid[:, :, _PM[m]] = self.is_param
        for m in ("update_cos", "weight_drift_l2"):
            self._valid[1, :, _PM[m]] = self.is_param
        # `end`'s validity when every parameter had a gradient: (first step, later), read-only
        all_grads = self._valid.copy()
        for m in ("grad_norm_l2", "grad_nonfinite_count"):
            all_grads[:, :, _PM[m]] = self.is_param
        all_grads.flags.writeable = False
        self._valid_all_grads = (all_grads[0], all_grads[1])
        self.begun = False
        self._exact_fwd = True
        self._end_versions: list[int] | None = None  # the parameters' versions at the last end
        # per kind of tensor: are its norms dot products (CPU float32)? weights: set by refresh()
        self._dot = {"weights": False, "grads": device.type == "cpu" and all(
            p.dtype == torch.float32 for p in self.params)}
        dtypes = {p.dtype for p in self.params}
        self._wide = bool(dtypes & set(_NARROW)) and torch.float64 not in dtypes  # `_fused_norms`
        self._compiled_grads = self._compiled and self._dot["grads"]  # else never tried
        self._may_compile = self._may_compile and not self._compiled
        self.has_grad: np.ndarray | None = None  # this step's components with a gradient
        self.param_has_grad: np.ndarray | None = None  # this step's parameters with a gradient
        self.grads_finite = True        # CPU only: the host verdict on the gradient norms
        self._preclip, self._factor = _NO_PRECLIP, 1.0
        self._bad: torch.Tensor | None = None
        self.modified_after_backward = False  # the loop was seen to change gradients after backward
        self._uncounted = False  # ... by writes no version counter saw: never "unchanged" again
        self._at_backward: tuple[list[int], int] | None = None  # versions, what was taken (or 0)
        # the loop rescales the gradients after the backward pass: the pre-clip norms come from
        # the optimizer step's pass (`_rescaled`); how many steps in a row showed one factor by
        # exact passes, and whether one of them was not 1
        self._by_factor = False
        self._rescales, self._rescaled_once = 0, False
        # the gradients' sketch that shows the factor: every (k // FACTOR_SKETCH)-th coordinate
        # of the weights' sketch, at the backward end and at the optimizer step
        offsets, strides, ks = self._sketch_at
        few = np.minimum(ks, FACTOR_SKETCH)
        self._factor_at = tuple(np.ascontiguousarray(a) for a in (offsets, strides * (ks // np.maximum(few, 1)), few))
        self._bw_sketch = np.zeros(int(few.sum()), dtype=np.float32)
        self._step_sketch = np.zeros(int(few.sum()), dtype=np.float32)
        self._numel_list = numels
        # per pattern of gradient lengths (0: no gradient), the sketch's coordinates without the
        # parameters that have none, and the two sketches' views of its length (`_factor_sketch`)
        self._factor_sketches: dict[tuple[int, ...], _FactorSketch | None] = {}
        self._bw_factor: _FactorSketch | None = None  # the one the backward end took
        self._backwards = 0  # backward passes ended in this step so far
        # backward passes of each of the last few steps (the step's last one takes the norms)
        self._backward_counts: collections.deque[int] = collections.deque(maxlen=BACKWARD_COUNT_STEPS)
        # the weights' checksums (tracer/replicas.py) wanted after each step: taken in the pass
        # that takes their norms once its kernel is loaded (switched on at a step's `end`), and
        # then every weight-norm pass takes them, so that the norms drift compares come from one
        # kernel
        self.checksums_wanted = False
        self._with_sums = False
        self._sums = np.zeros(len(self.params), dtype=np.int64)
        self._summed = False  # the last weight-norm pass took `_sums`
        self.end_sums: np.ndarray | None = None  # this step's end's, per parameter, else None
        # the parameters' version counters and addresses as the last `begin` or `end` read them
        # (unsharded parameters only; else None): what the replicas' checks compare
        self.weights_seen: tuple[list[int], list[int]] | None = None
        self.refresh()

    def refresh(self) -> None:
        """Re-take the views of the parameters (in case `p.data` was replaced)."""
        self._flat = [local_shard(p) for p in self.params]
        self._dot["weights"] = self.device.type == "cpu" and all(
            p.dtype == torch.float32 and p.is_contiguous() and not p.is_sparse for p in self._flat)
        # the compiled passes read the weights through addresses: `_flat` holds the tensors, so
        # the memory stays theirs while their storage keeps it (checked at each pass: a storage
        # freed in place, as sharding wrappers do, moves the address). Sharded parameters, and
        # a shape other than the one the sketch was laid out for, are read by the eager ops
        # (which then fail loudly, caught like any recorder fault). A weight whose storage is
        # freed is read by neither: the eager ops would read freed memory too
        self._weight_ptrs = [p.data_ptr() for p in self._flat]
        self._weight_sizes = [p.numel() for p in self._flat]
        self._lost_weights = [i for i, p in enumerate(self._flat) if lost_storage(p)]
        usable = self._compiled and self._dot["weights"] and not self._sharded and all(
            type(p) is torch.Tensor and p.numel() == n and n > 0 and not lost_storage(p)
            for p, n in zip(self._flat, self._numel, strict=True))
        self._weight_addrs = np.array(self._weight_ptrs, dtype=np.int64) if usable else None

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

    def _kernel_views(self) -> None:
        """numpy views of the tensors `reduce`'s compiled arithmetic reads and writes besides the
        rows (`_rows_np`), taken again whenever one of them is made anew."""
        self._carry_np = (self._work[0, 0].numpy(), self._carry_sketch.numpy())
        self._scale_np, self._comp_np = self.scale.numpy(), self.coord_comp.numpy()
        self._sketch_out_np = self._sketch_out.numpy()

    @property
    def off_compiled(self) -> bool:
        """Whether the weights could take the compiled passes and do not (a storage freed, a
        layout the views did not expect): `refresh` may give them back."""
        return self._compiled and self._weight_addrs is None and not self._sharded

    def _share_blas(self) -> None:
        """The tensors whose norms are BLAS dot products, not the compiled pass: those of
        `BLAS_FROM` values or more, unless the compiled pass runs in parts on torch's threads
        (`kernels.parts_on_threads`) and so reads them on as many. Decided when the compiled
        passes are taken, for the rest of the run."""
        split = (self._compiled and int(self._numel.sum()) >= kernels.SPLIT_FROM
                 and kernels.parts_on_threads())
        self._blas = (self._numel >= BLAS_FROM) & (not split)
        self._blas_list = np.flatnonzero(self._blas).tolist()
        self._by_kernel = np.flatnonzero(~self._blas)  # the tensors whose norms the kernel takes
        self._blas_idx = torch.tensor(self._blas_list, dtype=torch.long)
        self._compiled_numel = np.where(self._blas, 0, self._numel)  # 0: not in the compiled pass
        self._grad_lists = ([], [])  # the gradients' lengths in the compiled pass are taken again

    def _take_compiled(self) -> None:
        """The kernels are loaded: the compiled passes from now on. Called at a step's end,
        before its weights are read: drift compares a step's first-forward weight norms with the
        last step's end's, and those two then come from the same kind of pass."""
        self._may_compile = False
        self._compiled = True
        self._share_blas()
        self._rows_np = self.rows.numpy()
        self._np_views = self._views_of(self._rows_np)
        self._kernel_views()
        self._compiled_grads = self._dot["grads"]
        self.refresh()

    def _weight_memory(self) -> np.ndarray | None:
        """The weights' addresses for the compiled passes, if they still hold their memory
        (else the views are taken again; None: the eager ops read them). Checked once per hook:
        its sketch and norms read the same answer. Read through the parameters themselves: an
        optimizer that puts a new tensor under one (`p.data = ...`) leaves the views on the old;
        a prefix of the old one (`p.data = p.data[:k]`) keeps its address, not its size."""
        if not self._sharded and ([p.data_ptr() for p in self.params] != self._weight_ptrs
                                  or [p.numel() for p in self.params] != self._weight_sizes):
            self.refresh()
        if self._lost_weights:
            self._refuse_lost_weights()
        return self._weight_addrs

    def _refuse_lost_weights(self) -> None:
        """Raise (a probe failure, caught by the recorder) while a weight's storage is freed. Once
        it is back the eager ops read it (the views hold its storage), until the next `refresh`
        (at a flush) gives the compiled passes its address again."""
        self._lost_weights = [i for i in self._lost_weights if lost_storage(self._flat[i])]
        if self._lost_weights:
            raise RuntimeError(f"the weights of parameter {self._lost_weights[0]} have lost their "
                               "storage (freed in place?): their norms are not taken this step")

    def _views_of(self, rows: torch.Tensor | np.ndarray) -> list[_Row]:
        return [_Row(*(r[sl] for sl in (self._fwd_sketch, self._end_sketch, self._fwd_n,
                                         self._grad_n, self._end_n, self._pre_n))) for r in rows]

    def _row_index(self) -> int:
        """The row of the step in progress (the buffer grows if `reduce` was not called in time)."""
        j = len(self.pending)
        if j >= self.rows.shape[0]:
            self.rows = torch.cat([self.rows, torch.zeros_like(self.rows)])
            self._row_views = self._views_of(self.rows)
            if self._compiled:
                self._rows_np = self.rows.numpy()
                self._np_views = self._views_of(self._rows_np)
        return j

    def _row(self) -> _Row:
        return self._row_views[self._row_index()]

    def _sketch_into(self, field: str, addrs: np.ndarray | None) -> None:
        """The weights' sketch into `field` (fwd_sketch or end_sketch) of the step's row, through
        their addresses `addrs` (`_weight_memory`) if given, else by the eager ops."""
        j = self._row_index()
        if addrs is not None:
            kernels.gather_sketch(addrs, *self._sketch_at, getattr(self._np_views[j], field))
            return
        out = getattr(self._row_views[j], field)
        parts = self._views
        if self._gathered:
            parts = list(parts)
            for i, idx in self._gathered:
                parts[i] = self._flat[i].reshape(-1)[idx]
        torch.cat(parts, out=out)  # float32 whatever the parameters' dtype

    def _grad_addresses(self, grads: list[torch.Tensor]) -> bool:
        """Addresses and lengths of `grads` (one per parameter) into `_grad_addrs`/`_grad_lens`,
        the BLAS-sized ones' lengths 0 (not in the compiled pass); False if one of them is not a
        plain, contiguous float32 CPU tensor (then the eager ops take this pass). Raises if a
        gradient's storage does not hold its values (`lost_storage`, its contiguous case inlined).

        The same tensors as this step's last call's (a loop that clips: the backward-end and the
        optimizer-step passes), at the same addresses and of the same lengths, are taken as
        checked then, but for their storage. (Known by their ids: holding the tensors would keep
        gradients alive that the loop sets to None.)"""
        last, ids = self._checked_grads, [id(g) for g in grads]
        self._checked_grads = None
        if last is not None and ids == last[0]:
            ptrs, ns = [g.data_ptr() for g in grads], [g.numel() for g in grads]
            if ptrs == last[1] and ns == last[2]:
                if not all(n == 0 or g.untyped_storage().nbytes() >= (g.storage_offset() + n) * 4
                           for g, n in zip(grads, ns, strict=True)):
                    _refuse_lost(grads)
                self._checked_grads = last
                return True  # `_grad_addrs` and `_grad_lens` hold them already
        ptrs, ns = [], []
        f32, plain = torch.float32, torch.Tensor
        try:
            for g in grads:
                if type(g) is not plain or g.dtype is not f32 or not g.is_cpu or not g.is_contiguous():
                    return False
                n, ptr = g.numel(), g.data_ptr()
                if n and (ptr == 0 or g.untyped_storage().nbytes() < (g.storage_offset() + n) * 4):
                    _refuse_lost(grads)
                ptrs.append(ptr)
                ns.append(n)
        except (NotImplementedError, TypeError):  # sparse gradients have no contiguity
            return False
        lens = ns
        if self._blas_list:  # their norms are BLAS dot products: length 0 in the compiled pass
            lens = list(ns)
            for i in self._blas_list:
                lens[i] = 0
        if (ptrs, ns) != self._grad_lists:  # new gradients often land where the last ones were
            self._grad_addrs[:] = ptrs
            self._grad_lens[:] = lens
            self._grad_numel[:] = ns
            self._grad_lists = (ptrs, ns)
        self._checked_grads = (ids, ptrs, ns)
        return True

    def _norms_into(self, field: str, tensors: list[torch.Tensor], kind: str,
                    weight_addrs: np.ndarray | None = None) -> bool | None:
        """Per-tensor L2 norms of `tensors` ("weights" or "grads") into `field` (fwd_norms,
        grad_norms, end_norms or pre_norms) of the step's row: one pass over their memory.

        On an accelerator, one fused `torch._foreach_norm`. On the CPU, float32 tensors go
        through one compiled pass over all of them (float64 sums of squares: no float32 range
        to leave; the same value for the same memory every time, which weight drift relies on),
        which also says whether every norm is finite (returned; None: not known). Without the
        compiled kernels that pass is a BLAS dot product per tensor (float32 sums of squares),
        and a tensor whose sum of squares overflowed or underflowed float32 (an entry beyond
        ~1e19 or all entries below ~1e-19; an all-zero tensor looks the same) is taken again by
        the exact kernel: on the host, reading that verdict (one read per pass) costs nothing.
        Weights take one path for as long as their memory stays where it was when their views
        were taken (drift compares two of their norms): `weight_addrs`, from `_weight_memory`,
        None for the eager ops."""
        j = self._row_index()
        out = getattr(self._row_views[j], field)
        # the compiled pass: weights while their memory stays put, gradients each pass (one of
        # another layout takes the eager ops for that pass only)
        if kind == "weights" and weight_addrs is not None and self._with_sums:
            self._summed = True  # every weight (no BLAS share): one kernel for every weight pass
            return kernels.norms_word_sums(weight_addrs, self._numel, getattr(self._np_views[j], field),
                                           self._sums)
        if kind == "weights" and weight_addrs is not None:
            return self._compiled_norms(self._flat, weight_addrs, self._compiled_numel,
                                        getattr(self._np_views[j], field), out)
        if kind == "grads" and self._compiled_grads and self._grad_addresses(tensors):
            return self._compiled_norms(tensors, self._grad_addrs, self._grad_lens,
                                        getattr(self._np_views[j], field), out)
        if kind == "grads" and self.device.type == "cpu":
            _refuse_lost(tensors)
        if not self._dot[kind]:
            torch.stack(_fused_norms(tensors, self._wide), out=out)
            return None
        try:
            torch.stack([torch.dot(v, v) for v in (t.view(-1) for t in tensors)], out=out).sqrt_()
        except RuntimeError:  # a non-contiguous or sparse gradient: the exact kernel from now on
            self._dot[kind] = False
            torch.stack(_fused_norms(tensors, self._wide), out=out)
            return None
        suspect = (out < _DOT_SMALLEST) | (out == math.inf)
        if bool(suspect.any()):  # rare (a zero tensor, a huge entry): all again, exactly
            torch.where(suspect, torch.stack(_fused_norms(tensors, self._wide)), out, out=out)
        return None

    def _compiled_norms(self, tensors: list[torch.Tensor], addrs: np.ndarray, lens: np.ndarray,
                        out_np: np.ndarray, out: torch.Tensor) -> bool:
        """The compiled pass over the tensors `lens` counts (0: not these), BLAS dot products for
        the large ones (`BLAS_FROM`: taken exactly again if a float32 sum of squares may have
        left its range); whether every norm is finite."""
        finite = kernels.tensor_norms(addrs, lens, out_np)
        if not self._blas_list:
            return finite
        where, idx = self._blas_list, self._blas_idx
        large = [tensors[i] for i in where]
        if not all(t.numel() for t in large):  # a large parameter without a gradient: norm 0 above
            where = [i for i, t in zip(where, large, strict=True) if t.numel()]
            if not where:
                return finite
            large, idx = [tensors[i] for i in where], torch.tensor(where, dtype=torch.long)
        vals = torch.stack([torch.dot(v, v) for v in (t.view(-1) for t in large)]).sqrt_()
        if not bool(((vals >= _DOT_SMALLEST) & (vals < math.inf)).all()):  # rare: one read a pass
            suspect = (vals < _DOT_SMALLEST) | (vals == math.inf)
            vals = torch.where(suspect, torch.stack(torch._foreach_norm(large)), vals)
            finite = finite and bool(torch.isfinite(vals).all())
        out.index_copy_(0, idx, vals)
        return finite

    def _weight_versions(self) -> list[int]:
        """The parameters' version counters (every in-place write PyTorch sees moves one)."""
        return [p._version for p in self._flat]

    @without_grad
    def begin(self) -> None:
        """First training forward of a step: note the weights as the step found them.

        The exact weight norms (drift outside the sketch) are taken again only when a parameter's
        version counter or tensor changed since the last step's end, and every `EXACT_DRIFT_EVERY`-th step
        whatever the counters say (writes into `.data` and memory faults move none); in the
        other steps the weights are those the last step left, so their norms are those of `end`."""
        self.weights_seen = None
        if self.params:
            # `p.data = other` moves no counter: the memory check takes the views again
            # (`refresh` makes a new address list), and the norms are taken exactly
            before = self._weight_ptrs
            addrs = self._weight_memory()
            swapped = self._weight_ptrs is not before
            self._sketch_into("fwd_sketch", addrs)
            versions = self._weight_versions()
            self._exact_fwd = (swapped or self._end_versions is None or self._ends % EXACT_DRIFT_EVERY == 0
                               or versions != self._end_versions)
            if self._exact_fwd:
                self._norms_into("fwd_norms", self._flat, "weights", addrs)
            if not self._sharded:
                self.weights_seen = (versions, self._weight_ptrs)
        self.begun = True

    def grads_so_far_finite(self) -> bool | None:
        """Are the gradients accumulated so far all finite? None if there are none. A pass over
        them (CPU: cheap)."""
        if all(p.grad is None for p in self.params):
            return None
        if self._compiled_grads and self._grad_addresses(everything := self._grads()):
            return self._compiled_norms(everything, self._grad_addrs, self._grad_lens, self._scratch,
                                        self._scratch_t)
        grads = [grad_values(local_shard(p.grad)) for p in self.params if p.grad is not None]
        if self.device.type == "cpu":
            _refuse_lost(grads)
        return bool(torch.isfinite(torch.stack(torch._foreach_norm(grads)).sum()))

    def _grads(self, raw: list[torch.Tensor | None] | None = None) -> list[torch.Tensor]:
        """The gradients to read, from the parameters' `.grad` (`raw`, if already read)."""
        if raw is None:
            raw = [p.grad for p in self.params]
        # a parameter without a gradient stands in as an empty tensor (norm 0): the list, and so
        # the per-tensor -> component index, is the same every step whatever has a gradient
        if self._sharded:
            return [z if g is None else grad_values(local_shard(g)) for g, z in zip(raw, self._no_grad, strict=True)]
        # plain tensors are read as they are (no detach: this runs under no_grad)
        return [z if g is None else (grad_values(g) if g.is_sparse else g)
                for g, z in zip(raw, self._no_grad, strict=True)]

    @without_grad
    def local_norms(self) -> tuple[list[torch.Tensor | None], np.ndarray | None]:
        """The parameters' `.grad` as they are now, and, where one compiled pass can read them all,
        their per-parameter norms (0 for a parameter without one; an array this probe reuses);
        else None. The gradients' address check stands for this step's next pass over the same
        tensors (`_grad_addresses`): under DDP, the pre-clip and optimizer-step passes over the
        gradients it copies the all-reduced values into."""
        raw = [p.grad for p in self.params]
        grads = self._grads(raw)  # held through the pass: a sparse gradient's values are a new tensor
        if not self._compiled_grads or not self._grad_addresses(grads):
            return raw, None
        kernels.tensor_norms(self._grad_addrs, self._grad_numel, self._local_norms)
        return raw, self._local_norms

    @property
    def backward_versions(self) -> list[int] | None:
        """The gradients' versions (`grad_versions`) at the end of this step's last backward pass;
        None before the step's first."""
        return None if self._at_backward is None else self._at_backward[0]

    @without_grad
    def after_backward(self) -> None:
        """End of a backward pass: note the gradients' versions (and norms, if the loop modifies them)."""
        self._backwards += 1
        taken = 0
        raw = [p.grad for p in self.params]
        if self.params and self._backwards >= min(self._backward_counts, default=0):
            if not self.modified_after_backward:
                # the witness of "unchanged" beside the version counters: a write that moves
                # none (into `.data`, or a new tensor at a freed one's id) changes the sketch
                taken = _TOOK_SKETCH if self._sketch_grads(raw, for_factor=False) else 0
            elif (self._by_factor and self._ends % EXACT_PRECLIP_EVERY
                  and self._sketch_grads(raw, for_factor=True)):
                taken = _TOOK_SKETCH
            else:
                self._norms_into("pre_norms", self._grads(raw), "grads")
                taken = _TOOK_NORMS
        self._at_backward = (versions_of(raw), taken)

    def _sketch_grads(self, raw: list[torch.Tensor | None], for_factor: bool) -> bool:
        """The gradients' sketch (`_factor_at`, less the parameters without a gradient) into
        `_bw_sketch` by the compiled gather; False where it cannot be taken (a gradient that is
        not a plain contiguous float32 CPU tensor of its parameter's size) or, `for_factor`, must
        not be relied on (its norm, by the compiled pass, past `_SKETCH_LARGEST` or not finite).
        A witness of "unchanged" compares it bit for bit whatever its values."""
        if not self._compiled_grads or not self._grad_addresses(self._grads(raw)):
            return False
        sketch = self._bw_factor = self._factor_sketch(self._checked_grads[2])
        if sketch is None:
            return False
        kernels.gather_sketch(self._grad_addrs, *sketch.at, sketch.before)
        if not for_factor:
            return True
        return bool(kernels.tensor_norms(*sketch.norm_of_before) and sketch.norm_of_before[2][0] < _SKETCH_LARGEST)

    def _factor_sketch(self, lens: list[int]) -> _FactorSketch | None:
        """The factor's sketch for gradients of lengths `lens` (0: none), made once per pattern;
        None if a gradient is not of its parameter's size (a sparse one's values)."""
        key = tuple(lens)
        if key not in self._factor_sketches:
            if len(self._factor_sketches) >= _MAX_FACTOR_SKETCHES:
                self._factor_sketches.clear()
            self._factor_sketches[key] = None
            if all(n in (0, m) for n, m in zip(lens, self._numel_list, strict=True)):
                offsets, strides, ks = self._factor_at
                ks = np.where(np.array(lens) > 0, ks, 0)
                k = int(ks.sum())
                before = self._bw_sketch[:k]
                norm_of = (np.array([before.ctypes.data], dtype=np.int64), np.array([k], dtype=np.int64),
                           np.zeros(1, dtype=np.float32))
                self._factor_sketches[key] = _FactorSketch((offsets, strides, ks), list(lens), before,
                                                           self._step_sketch[:k], norm_of)
        return self._factor_sketches[key]

    def _learn_rescale(self, finite: bool | None, once: bool) -> None:
        """A step whose gradients changed after the backward pass, with exact norms before and
        after: was every gradient written once (`_written_once`), and does the change look like
        one factor on every tensor? (The tensors of BLAS dot products aside: float32 sums are
        too coarse to tell; the sketch checks them later.)"""
        row = self._np_views[self._row_index()] if self._rows_np is not None else None
        factor = None
        if row is not None and finite is True and once:
            pre, post = row.pre_norms, row.grad_norms
            if self._blas_list:
                pre, post = pre[self._by_kernel], post[self._by_kernel]
            factor = kernels.one_factor(pre, post, _ONE_FACTOR)
        if factor is None:
            self._forget_rescale()
            return
        self._rescales += 1
        self._rescaled_once = self._rescaled_once or abs(factor - 1.0) > _ONE_FACTOR
        self._by_factor = self._rescales >= BACKWARD_COUNT_STEPS and self._rescaled_once

    def _forget_rescale(self) -> None:
        self._by_factor, self._rescales, self._rescaled_once = False, 0, False

    def _sketch_again(self) -> _FactorSketch | None:
        """The backward end's sketch with its `after` read now; None where this step's pass did
        not check the gradients it was taken from (their addresses, left by that pass)."""
        checked, sketch = self._checked_grads, self._bw_factor
        if checked is None or sketch is None or checked[2] != sketch.lens:
            return None
        kernels.gather_sketch(self._grad_addrs, *sketch.at, sketch.after)
        return sketch

    def _sketch_kept(self) -> bool:
        """Whether the gradients' sketch the backward end took reads the same now, bit for bit
        (a NaN left as it was is kept); True where it cannot be read again (then the counters
        alone say)."""
        sketch = self._sketch_again()
        return sketch is None or sketch.before.tobytes() == sketch.after.tobytes()

    def _rescaled(self, finite: bool | None, once: bool) -> float | None:
        """The factor by which the loop rescaled the gradients of a step whose backward end took
        only their sketch, as the sketch then and now shows it (`reduce` divides the step's
        total by it). None (the step has no pre-clip norm; the exact passes resume) where the
        gradients are not all finite, were not each written once (`once`), or the sketch shows
        no single factor."""
        if finite is True and once and (sketch := self._sketch_again()) is not None:
            factor = kernels.one_factor(sketch.before, sketch.after, _ONE_FACTOR)
            if factor is not None:
                return factor
        self._forget_rescale()
        return None

    @without_grad
    def grads(self) -> None:
        """optimizer.step pre-hook: per-tensor gradient norms (and non-finite counts if needed)."""
        if not self.begun:
            self.begin()
        self._backward_counts.append(self._backwards)
        self._backwards = 0
        raw = [p.grad for p in self.params]
        every = all(g is not None for g in raw)
        has = self._every_param if every else np.fromiter((g is not None for g in raw), dtype=bool,
                                                          count=len(raw))
        self.param_has_grad = has
        self._preclip, self._bad, self._factor = _NO_PRECLIP, None, 1.0
        at_bw, self._at_backward = self._at_backward, None
        self.has_grad = None  # set last: a pass that fails leaves the step without gradient norms
        if not raw or not (every or has.any()):
            return
        if every:
            has_grad = self.is_param
        else:
            has_grad = np.zeros(self.n, dtype=bool)
            has_grad[self.param_comp_np[has]] = True
        grads = self._grads(raw)
        # always a pass of its own, even when no version counter moved since the backward-end
        # pass: some writes move none (GradScaler's unscale), so copying those norms could be
        # off by the scale
        finite = self._norms_into("grad_norms", grads, "grads")
        now = versions_of(raw) if at_bw is not None else []
        if at_bw is not None and at_bw[0] == now and not self._uncounted:
            if at_bw[1] == _TOOK_NORMS:  # taken exactly: no counter needs trusting
                self._preclip = _AT_BACKWARD
            elif at_bw[1] == _TOOK_SKETCH and not self._sketch_kept():
                # changed by writes no counter saw: null now, the exact passes from now on
                self.modified_after_backward = self._uncounted = True
                self._forget_rescale()
            else:
                self._preclip = _SAME_AS_TOTAL
        elif at_bw is not None:
            self.modified_after_backward = True
            # the factor needs one write to every gradient since the backward end (a clip's one
            # multiply): a tensor's 16 sketched coordinates cannot vouch for a second one elsewhere
            once = _written_once(at_bw[0], now)
            if at_bw[1] == _TOOK_NORMS:
                self._preclip = _AT_BACKWARD
                self._learn_rescale(finite, once)
            elif (at_bw[1] == _TOOK_SKETCH and self._by_factor
                  and (factor := self._rescaled(finite, once)) is not None):
                self._preclip, self._factor = _BY_FACTOR, factor
        # on CPU reading the verdict is free, so the per-tensor counts run only when needed (the
        # total norm is finite exactly when every per-tensor norm is)
        self.grads_finite = self.device.type != "cpu" or (
            finite if finite is not None else bool(torch.isfinite(self._row().grad_norms).all()))
        if not self.grads_finite or self.device.type != "cpu":
            counts = torch.stack([g.numel() - torch.isfinite(g).sum() for g in grads])
            self._bad = torch.zeros(self.n, dtype=torch.long, device=self.device).index_add_(
                0, self.param_comp, counts).double()
        self.has_grad = has_grad

    @without_grad
    def end(self, slot: int) -> tuple[np.ndarray, bool, bool]:
        """optimizer.step post-hook: note the weights after the step; the step's values go to buffer
        row `slot` at `reduce`. Returns their (C, len(PARAM_METRICS)) validity (read-only: it may
        be shared with other steps), and whether the step has a total and a pre-clip gradient norm."""
        if not self.params:
            return np.zeros((self.n, len(PARAM_METRICS)), dtype=bool), False, False
        if not self.begun:
            self.begin()
        if self._may_compile and kernels.ready():
            self._take_compiled()
        if self.checksums_wanted and not self._with_sums and self._compiled:
            self._with_sums = True  # here: the next forward's norms come from the same kernel
        addrs = self._weight_memory()
        self._sketch_into("end_sketch", addrs)
        self._summed, self.end_sums = False, None
        self._norms_into("end_norms", self._flat, "weights", addrs)
        if self._summed:
            self.end_sums = self._sums
        self._end_versions = self._weight_versions()
        self.weights_seen = None if self._sharded else (self._end_versions, self._weight_ptrs)
        self._checked_grads = None  # the next step's gradients are checked afresh
        has_total = self.has_grad is not None
        if self.has_grad is self.is_param:  # every parameter had a gradient (read-only)
            valid = self._valid_all_grads[min(self._ends, 1)]
        else:
            valid = self._valid[min(self._ends, 1)].copy()
            if has_total:
                valid[:, _PM["grad_norm_l2"]] = valid[:, _PM["grad_nonfinite_count"]] = self.has_grad
        preclip = self._preclip if has_total else _NO_PRECLIP
        self.pending.append(_Step(slot, preclip, self._bad, self._exact_fwd, self._factor))
        self._ends += 1
        self.begun, self.has_grad, self._bad, self._preclip = False, None, None, _NO_PRECLIP
        return valid, has_total, preclip != _NO_PRECLIP

    @without_grad
    def reduce(self) -> tuple[list[int], torch.Tensor, torch.Tensor, torch.Tensor] | None:
        """The queued steps' values, computed together: (their buffer rows, (K, C, len(PARAM_METRICS))
        block, (K,) float64 total gradient norms, (K,) pre-clip totals); None if none are queued.

        Values of rows the validity marks null are arbitrary (a step without gradients). If it
        fails, the steps are lost, and with them the update and the weights that the next step's
        update cosine and drift compare with: that step starts again as a run's first step does
        (neither value; its weight norms at the first forward taken exactly)."""
        steps, self.pending = self.pending, []
        if not steps:
            return None
        try:
            return self._reduce(steps)
        except BaseException:
            self._carry_wnorm, self._ends = None, 0
            raise

    def _reduce(self, steps: list[_Step]) -> tuple[list[int], torch.Tensor, torch.Tensor, torch.Tensor]:
        k, n = len(steps), self.n
        rows = self.rows[:k]
        fwd_sketch, sketch = rows[:, self._fwd_sketch], rows[:, self._end_sketch]
        norms = rows[:, self._norms].view(k, 4, -1)
        # per-component norms of the four per-tensor vectors: fwd weights, grads, weights, pre-clip
        comp = torch.zeros(k, 4, n, device=self.device).index_add_(
            2, self.param_comp, norms * norms).sqrt()
        fwd_norm, wnorm = comp[:, 0], comp[:, 2]
        if self._work.shape[1] <= k:  # more steps queued than the step buffer first held
            work = torch.empty(2, k + 1, self._work.shape[2], device=self.device)
            work[0, 0].copy_(self._work[0, 0])  # the update carried from the last batch
            self._work = work
            self._prods = torch.empty(4, k, self._work.shape[2], device=self.device)
            self._scaled = torch.empty(self._work.shape[2] * 4 * k, device=self.device)
            self._sketch_out = torch.empty(n * 4 * k, device=self.device)
            if self._compiled:
                self._kernel_views()
        if self._carry_wnorm is None:  # the first step: no update or weights before it (null values)
            torch.sub(sketch[0], fwd_sketch[0], out=self._work[0, 0])
            self._carry_sketch.copy_(fwd_sketch[0])
            self._carry_wnorm = fwd_norm[0]
        prev_wnorm = torch.cat([self._carry_wnorm[None], wnorm[:-1]])
        if not all(s.exact_fwd for s in steps):  # no norms taken: the weights the last step left
            exact = to_device(np.array([s.exact_fwd for s in steps]), self.device)
            fwd_norm = torch.where(exact[:, None], fwd_norm, prev_wnorm)
        sums = self._sketch_sums(fwd_sketch, sketch, k, n)
        unorm = sums[:, 0].sqrt()
        zero = torch.zeros(n, dtype=torch.float64, device=self.device)
        cols = {"grad_norm_l2": comp[:, 1],
                "grad_nonfinite_count": torch.stack([zero if s.bad is None else s.bad for s in steps]),
                "weight_norm_l2": wnorm, "update_norm_l2": unorm, "update_ratio": unorm / wnorm,
                "update_cos": sums[:, 1] / (unorm * sums[:, 2].sqrt()),
                "weight_drift_l2": torch.maximum(sums[:, 3].sqrt(), (fwd_norm - prev_wnorm).abs())}
        self._carry_wnorm = wnorm[-1]
        total = rows[:, self._grad_n].double().square().sum(1).sqrt()
        preclip = total
        if any(s.preclip == _AT_BACKWARD for s in steps):
            at_bw = to_device(np.array([s.preclip == _AT_BACKWARD for s in steps]), self.device)
            preclip = torch.where(at_bw, rows[:, self._pre_n].double().square().sum(1).sqrt(), total)
        if any(s.preclip == _BY_FACTOR for s in steps):
            preclip = preclip / to_device(np.array([s.factor if s.preclip == _BY_FACTOR else 1.0
                                                    for s in steps]), self.device)
        block = torch.stack([cols[m] for m in PARAM_METRICS], 2)
        return [s.slot for s in steps], block, total, preclip

    def _sketch_sums(self, fwd_sketch: torch.Tensor, sketch: torch.Tensor, k: int, n: int) -> torch.Tensor:
        """Per step and component, (k, 4, C), the sums of the scaled sketch products: |update|^2,
        update . previous update, |previous update|^2, |drift|^2; the last step's update and
        sketch are carried to the next batch. On the CPU, once the kernels are loaded, one
        compiled pass (`kernels.sketch_sums`) gives the eager ops' sums bit for bit."""
        if self._rows_np is not None:
            kernels.sketch_sums(self._rows_np, len(self._scale_np), k, *self._carry_np, self._scale_np,
                                self._comp_np, n, self._sketch_out_np)
            return self._sketch_out[:n * 4 * k].view(n, 4, k).permute(2, 1, 0)
        updates, drift, prods = self._work[0, :k + 1], self._work[1, :k], self._prods[:, :k]
        update, prev_update = updates[1:], updates[:-1]
        torch.sub(sketch, fwd_sketch, out=update)
        torch.sub(fwd_sketch[:1], self._carry_sketch, out=drift[:1])
        torch.sub(fwd_sketch[1:], sketch[:-1], out=drift[1:])
        for i, (a, b) in enumerate(((update, update), (update, prev_update), (prev_update, prev_update),
                                    (drift, drift))):
            torch.mul(a, b, out=prods[i])
        # scaled into a coordinate-major buffer: the index_add_ below then reads a contiguous
        # source, several times faster than the permuted view, with the same sums
        scaled = self._scaled[:prods.numel()].view(prods.shape[2], 4, k)
        torch.mul(prods.permute(2, 0, 1), self.scale[:, None, None], out=scaled)
        # one index_add_ over the coordinates for all four and every step: each component's sums
        # add its coordinates in the same order as one index_add_ per product did
        sums = torch.zeros(n, 4, k, device=self.device).index_add_(0, self.coord_comp, scaled).permute(2, 1, 0)
        updates[0].copy_(update[-1])
        self._carry_sketch.copy_(sketch[-1])
        return sums
