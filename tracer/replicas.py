"""Per-rank evidence: an exact fingerprint of the weights each rank holds, and its local gradients.

Data-parallel replicas must hold bit-identical weights after every optimizer step. Each rank
records, per parameter-owning component and step:

- `weight_checksum`: the wrapping (mod 2^32) sum of the raw bits of every element of the
  component's parameters after the step (each float viewed as 16- or 32-bit integer words).
  Integer addition mod 2^32 is exact and order-free, so bit-identical replicas give equal
  checksums on any device and thread count, and one flipped bit changes the sum by ±2^k mod
  2^32, never 0. Taken for every component after every step: replicas that part are found at
  the step they part, whatever parted them. On the CPU one compiled pass over the weights
  (tracer/kernels.py) takes every parameter's sum: with float32 weights the pass that takes
  their norms after the step (`ParamProbe.end`, handed over as `end_step(step, sums)`), else a
  pass of its own; elsewhere one small op per parameter.
- `weight_checksum_fwd`: the same checksum taken at the step's first forward; on one rank it
  differs from the previous step's `weight_checksum` exactly when something other than the
  optimizer wrote the weights in between (an exact weight drift; a low mantissa bit that no
  norm sees counts). Its use is to name the rank whose weights were written when replicas part,
  and a full read of the weights at every forward would cost as much as the checksum after the
  step, so it is taken where a write may have happened: on a component one of whose parameters
  PyTorch saw written since the last step's end (a version counter moved: any in-place op on
  the parameter or a view of it, `copy_`, `load_state_dict`; or a tensor put under it), exact at
  that step; and on every component in turn, a byte-balanced share each step, so that every
  component is checked at least every `FWD_CHECK_EVERY` steps whatever the counters say (writes
  into `.data`, and memory faults, move none: the replicas still part at their step, found by
  `weight_checksum`, and the rank is named by this check when it falls on that step, else by
  the other evidence the engine weighs). Null where not taken. Sharded components, and every
  component at a run's first step, are always taken.
- `local_grad_norm_l2`: the L2 norm of the gradient this rank contributed *before* the
  all-reduce averaged it with the others (null on a step whose gradients were not all-reduced).
  DistributedDataParallel all-reduces copies of the gradients in its buckets and copies the
  result into `.grad` in a callback at the end of the backward pass, which runs after the
  recorder's first one: there `.grad` still holds this rank's own gradients, and one pass over
  them takes their norms (`backward_ending`), with no hook in DDP's path; after a backward pass
  DDP does not all-reduce (`no_sync`, an earlier micro-batch) nothing is read. Where the
  gradients are views of the buckets (`gradient_as_bucket_view=True`) they are read in a
  communication hook instead, which sees each bucket of local gradients once, just before it
  calls the same all-reduce DDP runs without a hook (on the CPU, in the one compiled pass that
  also scales the bucket by 1 / world size, as DDP does; where 1 / world size is not a power of
  two, each gradient scaled as DDP would, divided if it was a view of the bucket already). Given
  the module inside a DDP, the DDP found running it at the first training forward is the one read.
- `grad_allreduced`: whether DDP all-reduced this component's gradients in this step (read in
  `.grad`: DDP copied new values into one of its gradients after the backward pass; in the
  hook: one of its buckets came through); false on every component means the step trained
  outside DDP (its gradients stayed local).

Values stay on the device until the segment is flushed, like the health stats; nothing in a
step reads one back to the host.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple

import numpy as np
import torch
from torch import nn

from . import kernels
from .components import Component
from .loopfacts import versions_of

_INT_VIEW = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int32}  # element bytes -> words
# steps within which every component's weights are checked at the first forward (the bound on
# finding a write outside the optimizer that PyTorch does not see, on the rank that made it)
FWD_CHECK_EVERY = 8


def lost_storage(t: torch.Tensor) -> bool:
    """True if a plain CPU tensor's storage no longer holds its values (freed in place, as
    sharding wrappers do): reading it, by address or by an eager op, would read freed memory.
    (`ParamProbe._grad_addresses` inlines the contiguous case on the step's path.)"""
    if type(t) is not torch.Tensor or not t.is_cpu or (n := t.numel()) == 0:
        return False
    if t.is_contiguous():  # the usual gradient: its values are the storage's next n elements
        end = t.storage_offset() + n
    else:
        end = t.storage_offset() + 1 + sum((d - 1) * st for d, st in zip(t.shape, t.stride(), strict=True))
    return t.data_ptr() == 0 or t.untyped_storage().nbytes() < end * t.element_size()


def grad_values(g: torch.Tensor) -> torch.Tensor:
    """A gradient's values: a sparse one (`nn.Embedding(sparse=True)`) as its coalesced values,
    which have its norm and its non-finite count; a dense one as it is."""
    return g.coalesce().values() if g.is_sparse else g


def _exact_reciprocal(n: int) -> bool:
    """Is 1 / n a power of two (n one), so that x * (1 / n) is x / n, bit for bit?"""
    return n > 0 and n & (n - 1) == 0


def local_shard(p: torch.Tensor) -> torch.Tensor:
    """The part of a parameter this rank holds (a DTensor's local shard), detached."""
    to_local = getattr(p, "to_local", None)
    return (to_local() if callable(to_local) else p).detach()


def is_sharded(p: torch.Tensor) -> bool:
    """True for a DTensor parameter sharded across ranks (FSDP2 `fully_shard`)."""
    placements = getattr(p, "placements", None)
    return bool(placements) and any(getattr(pl, "is_shard", lambda: False)() for pl in placements)


def _words(t: torch.Tensor) -> torch.Tensor:
    """`t`'s raw bits as a flat tensor of integer words (a view when `t` is contiguous)."""
    flat = t.reshape(-1)
    if not flat.is_floating_point():
        return flat
    return flat.view(_INT_VIEW[flat.element_size()])


class _BucketLayout(NamedTuple):
    """Where a DDP bucket's gradients go: for the eager ops, the component of each gradient
    (`index`; 0 where `keep` is 0: a parameter of no component); for the compiled pass, the
    components of those that have one (`comps`; `owned` marks them among the gradients) and
    the gradients' offsets and lengths in the bucket's buffer (None: not a flat float32 CPU
    buffer of them); the components it holds (`mask`)."""

    index: torch.Tensor
    keep: torch.Tensor
    mask: np.ndarray
    comps: np.ndarray
    owned: np.ndarray
    offsets: np.ndarray | None
    lens: np.ndarray | None


class ReplicaProbe:
    """Weight checksums and local gradient norms of the parameter-owning components, per step."""

    def __init__(self, components: list[Component], model: nn.Module, world_size: int) -> None:
        owned = [(c.index, p) for c in components for p in c.params]
        self.n = len(components)
        self.names = [c.name for c in components]
        self.params = [p for _, p in owned]
        self.device = self.params[0].device if self.params else torch.device("cpu")
        self.param_comp = torch.tensor([c for c, _ in owned], dtype=torch.long, device=self.device)
        self.comp_of = {id(p): c for c, p in owned}
        self.is_param = np.zeros(self.n, dtype=bool)
        self.is_param[[c for c, _ in owned]] = True
        self.sharded = np.zeros(self.n, dtype=bool)
        for c, p in owned:
            self.sharded[c] |= is_sharded(p)
        self.world_size = world_size
        # per step: (checksums after it and at its forward (2, C), local norms (C,), all-reduced
        # components, components checked at the forward); host arrays on the CPU (`end_step`)
        self.rows: dict[int, tuple[Any, Any, np.ndarray, np.ndarray]] = {}
        self._at_forward: tuple[torch.Tensor, np.ndarray] | None = None
        # per bucket of this step (key -1: the gradients read in `.grad`, `backward_ended`): its
        # per-component squared local norms (a host array from the compiled pass; else a device
        # tensor with the component of each value), and its components
        self._buckets: dict[int, tuple[torch.Tensor | None, torch.Tensor | np.ndarray, np.ndarray]] = {}
        # per bucket layout (its buffer's size, its parameters in order): where its gradients lie
        self._layouts: dict[tuple[int, ...], _BucketLayout] = {}
        self.param_comp_np = np.array([c for c, _ in owned], dtype=np.int64)
        self.param_comp_list = [c for c, _ in owned]
        self._turns = self._rotation(owned)
        self._turns.flags.writeable = False  # each step's choice is a copy (`_written`)
        self._turn_takes = self._turns[:, self.param_comp_np]  # the same, per parameter
        self._sharded_param = self.sharded & self.is_param
        self._any_sharded = bool(self._sharded_param.any())
        # per turn, the compiled word sums' arrays over its parameters (`checksums`)
        self._turn_args: dict[int, tuple[np.ndarray, np.ndarray, np.ndarray]] = {}
        # where each parameter's gradient was as the backward pass began (`backward_begins`),
        # kept for a communication hook that scales a bucket as DDP would (`_scale_as_ddp`)
        self._grads_at_begin: dict[int, int] = {}
        # parameters whose version counters and addresses say whether PyTorch saw them written
        self._watched = [i for i, (c, _) in enumerate(owned) if not self.sharded[c]]
        self._at_end: tuple[list[int], list[int]] | None = None  # (versions, addresses) at the last end
        self._next_step = 0
        self._addrs: np.ndarray | None = None  # the compiled pass's addresses (None: eager ops)
        self._ptrs: list[int] = []
        self._words = np.zeros(0, dtype=np.int64)
        self._zero: torch.Tensor | None = None  # a parameter not taken by the eager ops adds this
        # sharded (DTensor) parameters take the eager ops, which read their local shards
        # the compiled passes once their kernels are loaded (`kernels.ready`), the eager ops until
        # then: the checksums are the same integers either way
        self._may_compile = bool(self.params) and self.device.type == "cpu" and not self.sharded.any()
        self._compiled = self._may_compile and kernels.ready()
        self._refresh()
        # the local norms read in the pass that scales DDP's bucket (`_observe_bucket`)
        self._may_fuse = self.device.type == "cpu"
        self._fused = self._may_fuse and kernels.ready()
        self._scaled = False
        self.closed = False
        self.model = model
        # local gradients read in `.grad` at the end of backward (`backward_ending`), before DDP
        # copies the all-reduced ones into it; None: in a communication hook, or not at all
        self._ddp: nn.parallel.DistributedDataParallel | None = None
        # at the end of the backward pass, before DDP's callback: (component of each parameter with
        # a gradient, or None for a host array already per component; their squared local norms;
        # the gradients' `versions_of`)
        self._at_backward: tuple[torch.Tensor | None, Any, list[int]] | None = None
        ddp = isinstance(model, nn.parallel.DistributedDataParallel)
        # the inner module of a DDP: its wrapper is found at the first forward, which runs inside it
        self._wrapper_unknown = not ddp
        self.hook_note = self._read_local_from(model) if ddp else None

    # --- local gradients: in `.grad` before DDP's copy, or in a communication hook ----------

    def _read_local_from(self, model: nn.parallel.DistributedDataParallel) -> str | None:
        """Where this rank's local gradients are read. DDP all-reduces copies of the gradients in
        its buckets and copies the result into `.grad` only in a callback at the end of the
        backward pass, queued after the recorder's first one: unless the gradients are views of
        the buckets (`gradient_as_bucket_view=True`), `.grad` holds this rank's own gradients
        there (`backward_ending`), whatever communication hook DDP runs. Else a communication hook
        of ours reads them. A note when neither can."""
        if not getattr(model, "gradient_as_bucket_view", True):
            self._ddp = model
            return None
        return self._install_comm_hook(model)

    def backward_begins(self) -> None:
        """The start of a backward pass, before any gradient of it accumulates: where each
        gradient is, if the communication hook may have to scale as DDP does (`_scale_as_ddp`)."""
        if self.hook_note is None and self._ddp is None and not _exact_reciprocal(self.world_size):
            self._grads_at_begin = {id(p): g.data_ptr() for p in self.params if (g := p.grad) is not None}

    def backward_ending(self, read: Callable[[], tuple[list[torch.Tensor | None], np.ndarray | None]]
                        | None = None) -> None:
        """The first callback at the end of a backward pass, before DDP's (`_read_local_from`):
        the per-component norms of the local gradients, kept until `backward_ended` says which
        DDP all-reduced. `read`: the parameters' `.grad` (this probe's parameters, in its order)
        and their per-parameter norms if it can take them (`ParamProbe.local_norms`, whose check
        of the gradients then serves the passes after DDP's copy too)."""
        self._at_backward = None
        # a micro-batch under `no_sync()` (or `require_backward_grad_sync = False`, as nanoGPT
        # sets it): DDP all-reduces nothing after this backward pass, so nothing to read yet
        if (self._ddp is None or self.closed or not self.params
                or not getattr(self._ddp, "require_backward_grad_sync", True)):
            return
        grads, taken = ([p.grad for p in self.params], None) if read is None else read()
        if all(g is None for g in grads):
            return
        seen = versions_of(grads)
        if taken is not None:  # 0 for a parameter without a gradient: adds nothing to its component
            sq = np.bincount(self.param_comp_np, weights=np.square(taken, dtype=np.float64), minlength=self.n)
            self._at_backward = (None, sq, seen)
            return
        have = [i for i, g in enumerate(grads) if g is not None]
        gs = [grads[i] for i in have]
        comps = self.param_comp_np[have]
        if any(lost_storage(g) for g in gs):  # read by no pass: eager ops would read freed memory too
            raise RuntimeError("a gradient has lost its storage (freed in place?): this step's local "
                               "gradient norms are not taken")
        if self.device.type == "cpu" and kernels.ready() and all(
                type(g) is torch.Tensor and g.dtype is torch.float32 and g.is_contiguous() for g in gs):
            norms = np.empty(len(gs), dtype=np.float32)
            kernels.tensor_norms(np.array([g.data_ptr() for g in gs], dtype=np.int64),
                                 np.array([g.numel() for g in gs], dtype=np.int64), norms)
            sq = np.bincount(comps, weights=np.square(norms, dtype=np.float64), minlength=self.n)
            self._at_backward = (None, sq, seen)
        else:
            sq = torch.stack(torch._foreach_norm([grad_values(local_shard(g)) for g in gs])).float().square_()
            self._at_backward = (torch.tensor(comps, dtype=torch.long, device=self.device), sq, seen)

    def backward_ended(self, now: list[int] | None = None) -> None:
        """The last callback of the backward pass, after DDP's: the gradients it all-reduced are
        those it copied into `.grad` (a version moved, or a new tensor). Their components' local
        norms count for the step; with none all-reduced (no DDP forward, or `no_sync`) a later
        backward pass of the step may still give them. `now`: the gradients' `versions_of` as
        they are now, if already read (`ParamProbe.after_backward`, whose order is this probe's)."""
        taken, self._at_backward = self._at_backward, None
        if taken is None or self.closed:
            return
        idx, sq, seen = taken
        if now is None:
            now = versions_of([p.grad for p in self.params])
        if now == seen:
            return
        # a gradient where there was none: DDP all-reduced a parameter this rank did not use
        # (find_unused_parameters), whose local contribution was 0. (A loop, not numpy: each
        # numpy call costs the step several times its cost in a loop, its code cold here.)
        comp_of = self.param_comp_list
        reduced = [comp_of[i >> 1] for i in range(0, len(now), 2)
                   if now[i + 1] >= 0 and (now[i] != seen[i] or now[i + 1] != seen[i + 1])]
        if not reduced:
            return
        mask = np.zeros(self.n, dtype=bool)
        mask[reduced] = True
        self._buckets[-1] = (idx, sq, mask)

    def _find_wrapper(self) -> str | None:
        """At the first training forward of a watched inner module: hook the DDP running it, or
        say why its local gradient norms cannot be had."""
        self._wrapper_unknown = False
        # DDP names itself while its forward runs (what torch.compile's DDP optimizer reads)
        active = nn.parallel.DistributedDataParallel._get_active_ddp_module()
        if active is not None and any(m is self.model for m in active.module.modules()):
            return self._read_local_from(active)
        return ("local gradient norms (each rank's gradients before the all-reduce) not recorded: "
                "the watched module's forward ran outside any DistributedDataParallel forward "
                "(FSDP, gradients all-reduced by hand, or DDP's Python reducer); pass the DDP "
                "wrapper, or a module it wraps, to watch()")

    def _install_comm_hook(self, model: nn.parallel.DistributedDataParallel) -> str | None:
        """Register the hook on a DistributedDataParallel model; a note saying why not, else None."""
        if getattr(model, "_comm_hooks", None):
            return ("the DDP model already has a communication hook, and DDP takes only one: local "
                    "gradient norms not recorded")
        try:
            # DDP checks the hook's annotations; a postponed (string) annotation fails its check
            def hook(group, bucket):  # type: ignore[no-untyped-def]  # noqa: ANN001, ANN202
                return self._comm_hook(group, bucket)

            model.register_comm_hook(model.process_group, hook)
        except Exception as exc:  # e.g. a builtin hook registered from C++
            return f"DDP refused the communication hook ({type(exc).__name__}: {exc}); local gradient norms not recorded"
        return None

    def _comm_hook(self, group: Any, bucket: Any) -> torch.futures.Future[torch.Tensor]:
        buffer = bucket.buffer()
        # The same arithmetic as DDP without a hook (grad * (1 / world) into the bucket, then a
        # summing all-reduce), so training is bit-identical with and without the recorder. On the
        # CPU the local norms are read in the pass that scales the bucket (`_observe_bucket`)
        size = group.size() if group is not None else torch.distributed.get_world_size()
        exact = _exact_reciprocal(size)
        self._scaled = False
        if not self.closed:
            try:
                self._observe_bucket(bucket, buffer, 1.0 / size if exact else 1.0)
            except Exception:  # never break the all-reduce; the step's local norms stay null
                self._buckets.pop(bucket.index(), None)
        if not exact:
            self._scale_as_ddp(bucket, buffer, size)
        elif not self._scaled:
            buffer.mul_(1.0 / size)
        work = torch.distributed.all_reduce(buffer, group=group, async_op=True)
        return work.get_future().then(lambda fut: fut.value()[0])

    def _scale_as_ddp(self, bucket: Any, buffer: torch.Tensor, size: int) -> None:
        """Scale a bucket's gradients by 1 / `size` as DDP without a hook does: it divides a
        gradient that was already a view of the bucket as the backward pass began (by
        `size`), and multiplies one it copied in (by 1 / `size`). Where 1 / `size` is not a
        power of two, the two differ in the last bit. (Gradients that are not views of the
        buffer: the buffer is multiplied, as before.)"""
        at_begin, grads = self._grads_at_begin, bucket.gradients()
        lo = buffer.data_ptr()
        hi = lo + buffer.numel() * buffer.element_size()
        if not all(lo <= g.data_ptr() < hi for g in grads if g.numel()):
            buffer.mul_(1.0 / size)
            return
        for p, g in zip(bucket.parameters(), grads, strict=True):
            if at_begin.get(id(p)) == g.data_ptr():
                g.div_(size)
            else:
                g.mul_(1.0 / size)

    def _observe_bucket(self, bucket: Any, buffer: torch.Tensor, scale: float) -> None:
        """Per-component sum of squares of this bucket's local gradients (kept until the step
        ends). Where the bucket is a flat float32 CPU buffer holding the gradients in order, one
        compiled pass takes their norms and scales the buffer by `scale` (`self._scaled`); the
        gradients' places in it are found once per layout (the buffer's size and its parameters
        in order: DDP lays their views out the same way each time)."""
        params = bucket.parameters()
        key = (buffer.numel(), *map(id, params))
        layout = self._layouts.get(key)
        grads = None
        if layout is None:
            grads = bucket.gradients()
            layout = self._layouts[key] = self._layout(key[1:], buffer, grads)
        if not self._fused and self._may_fuse:
            self._fused = kernels.ready()
        if not (self._fused and layout.offsets is not None):
            if grads is None:
                grads = bucket.gradients()
            if grads:  # a later micro-batch's replaces it
                self._buckets[bucket.index()] = (layout.index, torch.stack(torch._foreach_norm(grads)).float()
                                                 .square_().mul_(layout.keep), layout.mask)
            return
        norms = np.empty(len(layout.offsets), dtype=np.float32)
        kernels.scaled_norms(buffer.numpy(), layout.offsets, layout.lens, scale, norms)
        self._scaled = True
        sq = np.bincount(layout.comps, weights=np.square(norms[layout.owned], dtype=np.float64),
                         minlength=self.n)
        self._buckets[bucket.index()] = (None, sq, layout.mask)

    def _layout(self, param_ids: tuple[int, ...], buffer: torch.Tensor,
                grads: list[torch.Tensor]) -> _BucketLayout:
        """A bucket's layout (`_BucketLayout`) from its parameters and one call's gradients."""
        comps = np.array([self.comp_of.get(i, -1) for i in param_ids], dtype=np.int64)
        owned = comps >= 0
        mask = np.zeros(self.n, dtype=bool)
        mask[comps[owned]] = True
        mask.flags.writeable = False  # a step's row may hold it until the flush (`end_step`)
        found = self._offsets(buffer, grads) if grads else None
        return _BucketLayout(
            torch.tensor(np.maximum(comps, 0), dtype=torch.long, device=self.device),
            torch.tensor(owned, dtype=torch.float32, device=self.device),
            mask, comps[owned], owned, *(found or (None, None)))

    @staticmethod
    def _offsets(buffer: torch.Tensor, grads: list[torch.Tensor]) -> tuple[np.ndarray, np.ndarray] | None:
        """(offsets, lengths) of `grads` in `buffer`, in elements, if the buffer is a flat float32
        CPU tensor and the gradients contiguous float32 views laid out in it in order, apart;
        else None."""
        f32 = torch.float32
        if not (type(buffer) is torch.Tensor and buffer.dtype is f32 and buffer.is_cpu
                and buffer.layout is torch.strided and buffer.is_contiguous() and not buffer.requires_grad):
            return None
        base = buffer.data_ptr()
        if any(g.dtype is not f32 or not g.is_contiguous() for g in grads):
            return None
        offsets = (np.array([g.data_ptr() for g in grads], dtype=np.int64) - base) // 4
        lens = np.array([g.numel() for g in grads], dtype=np.int64)
        ends = offsets + lens
        if offsets[0] < 0 or ends[-1] > buffer.numel() or (offsets[1:] < ends[:-1]).any():
            return None
        return offsets, lens

    # --- weight checksums -------------------------------------------------------------------

    def _rotation(self, owned: list[tuple[int, torch.Tensor]]) -> np.ndarray:
        """(FWD_CHECK_EVERY, C) bool: the components checked at the forward on each turn, every
        component on one turn, the turns' bytes balanced (largest component first)."""
        size = np.zeros(self.n, dtype=np.int64)
        for c, p in owned:
            size[c] += local_shard(p).numel() * p.element_size()
        turns = np.zeros((FWD_CHECK_EVERY, self.n), dtype=bool)
        load = np.zeros(FWD_CHECK_EVERY, dtype=np.int64)
        for c in sorted(np.flatnonzero(self.is_param), key=lambda c: -size[c]):
            t = int(np.argmin(load))
            turns[t, c], load[t] = True, load[t] + size[c]
        return turns

    def _refresh(self) -> None:
        """Take the parameters' addresses again (in case `p.data` was replaced); the compiled
        pass reads them while every parameter is a plain contiguous CPU tensor of 32- or 64-bit
        elements whose storage holds it (else the eager ops read them)."""
        self._addrs = None
        if not self._compiled:
            return
        flat = [local_shard(p) for p in self.params]
        self._ptrs = [p.data_ptr() for p in self.params]
        usable = all(type(t) is torch.Tensor and t.data_ptr() == q != 0 and t.is_cpu and t.is_contiguous()
                     and t.element_size() in (4, 8)
                     and t.untyped_storage().nbytes() >= (t.storage_offset() + t.numel()) * t.element_size()
                     for t, q in zip(flat, self._ptrs, strict=True))
        self._turn_args = {}
        if usable:
            self._words = np.array([t.numel() * t.element_size() // 4 for t in flat], dtype=np.int64)
            self._addrs = np.array(self._ptrs, dtype=np.int64)

    def checksums(self, take: np.ndarray | None = None, turn: int | None = None) -> torch.Tensor:
        """(C,) int64: per component, the sum of its parameters' wrapping 32-bit bit sums
        (unsigned); only over the parameters `take` marks (a (P,) bool mask), if given: those of
        the components of `turn` (`_turns`) when `turn` is given, whose arrays are kept."""
        if not self._compiled and self._may_compile and kernels.ready():
            self._compiled = True
            self._refresh()
        elif self._compiled and [p.data_ptr() for p in self.params] != self._ptrs:
            self._refresh()
        if self._addrs is not None:
            out = np.zeros(self.n, dtype=np.int64)
            if take is None:
                kernels.word_sums(self._addrs, self._words, self.param_comp_np, out)
            elif turn is not None:  # the arrays of a turn, made once: no numpy call in the step
                args = self._turn_args.get(turn)
                if args is None:
                    args = self._turn_args[turn] = (self._addrs[take], self._words[take], self.param_comp_np[take])
                kernels.word_sums(*args, out)
            else:
                kernels.word_sums(self._addrs[take], self._words[take], self.param_comp_np[take], out)
            return torch.from_numpy(out)
        if take is None:
            take = np.ones(len(self.params), dtype=bool)
        # int32 accumulation: its wrap mod 2^32 is the checksum's own arithmetic, so no wider sum
        # is needed, and the narrow one is the faster on CPU. A parameter not taken adds 0, so the
        # index stays the one on the device (no host-to-device copy in the step)
        zero = self._zero if self._zero is not None else torch.zeros((), dtype=torch.int32, device=self.device)
        self._zero = zero
        sums = torch.stack([_words(local_shard(p)).sum(dtype=torch.int32) if t else zero
                            for p, t in zip(self.params, take, strict=True)])
        return torch.zeros(self.n, dtype=torch.int64, device=self.device).index_add_(
            0, self.param_comp, sums.long() & 0xFFFFFFFF)  # unsigned: a checksum is never < 0

    def _written(self, seen: tuple[list[int], list[int]] | None = None) -> tuple[np.ndarray, int | None]:
        """(C,) bool: the components to check at this forward (`weight_checksum_fwd`), and the
        turn (`_turns`) if they are exactly that turn's. `seen`: every parameter's version
        counter and address now, if already read (`ParamProbe.weights_seen`)."""
        if self._at_end is None:  # no step ended yet: all of them
            return self.is_param.copy(), None
        turn = self._next_step % FWD_CHECK_EVERY
        take = self._turns[turn] | self._sharded_param
        versions, ptrs = self._at_end
        if seen is not None and not self._any_sharded and seen[0] == versions and seen[1] == ptrs:
            return take, turn  # nothing written since the last step's end
        params, comp_of = self.params, self.param_comp_list
        for j, i in enumerate(self._watched):
            p = params[i]
            if p._version != versions[j] or p.data_ptr() != ptrs[j]:
                take[comp_of[i]] = True
                turn = None
        return take, (None if self._any_sharded else turn)

    # --- per step -----------------------------------------------------------------------------

    def begin(self, seen: tuple[list[int], list[int]] | None = None) -> str | None:
        """First training forward of a step: the checksums of the weights as the step found them,
        where they may have been written (`_written`, given `seen`); at the first one, for an
        inner module, a note when its local gradients cannot be had."""
        note = self._find_wrapper() if self._wrapper_unknown and not self.closed else None
        if self.params and not self.closed:
            take, turn = self._written(seen)
            per_param = self._turn_takes[turn] if turn is not None else take[self.param_comp_np]
            self._at_forward = (self.checksums(per_param, turn), take)
        return note

    def end_step(self, step: int, sums: np.ndarray | None = None,
                 seen: tuple[list[int], list[int]] | None = None) -> None:
        """After optimizer.step: the weights' checksums and this step's local gradient norms.
        `sums`: the per-parameter checksums of the weights as they are now, taken in another
        pass over them (`ParamProbe.end`); else a pass of its own takes them. `seen`: every
        parameter's version counter and address now, if already read. On the CPU the row
        keeps host arrays, left for `take` to finish for many steps at once (each numpy call costs
        the step several times its cost at a flush, its code cold here); elsewhere, the device's."""
        if not self.params:
            return
        host = self.device.type == "cpu"
        if sums is None:
            checksum = self.checksums()
            checksum = checksum.numpy() if host else checksum
        else:  # each below 2^32, a few per component: exact in float64 (made integers in `take`)
            checksum = np.bincount(self.param_comp_np, weights=sums, minlength=self.n)
            checksum = checksum if host else torch.from_numpy(checksum.astype(np.int64)).to(self.device)
        params = self.params
        if seen is not None and not self._any_sharded:  # every parameter is watched
            self._at_end = seen
        else:
            self._at_end = ([params[i]._version for i in self._watched],
                            [params[i].data_ptr() for i in self._watched])
        self._next_step = step + 1
        fwd, taken = self._at_forward if self._at_forward is not None else (None, np.zeros(self.n, dtype=bool))
        self._at_forward = None
        buckets = list(self._buckets.values())
        self._buckets.clear()
        local: torch.Tensor | None = None
        if len(buckets) == 1 and buckets[0][0] is None:  # the usual: one host array of the step's
            _, on_host, reduced = buckets[0]  # (its mask read-only: kept as it is)
        else:
            on_host, reduced = np.zeros(self.n), np.zeros(self.n, dtype=bool)
            for idx, sq, mask in buckets:
                if idx is None:  # the compiled pass's: already per component, on the host
                    on_host += sq
                else:
                    local = (torch.zeros(self.n, device=self.device) if local is None else local).index_add_(0, idx, sq)
                reduced |= mask
        if host:  # squared norms: their roots are taken in `take`
            squares = on_host if local is None else local.add_(torch.from_numpy(on_host.astype(np.float32))).numpy()
            self.rows[step] = (checksum, None if fwd is None else fwd.numpy(), squares, reduced, taken)
            return
        if local is None:
            norms = torch.from_numpy(np.sqrt(on_host).astype(np.float32)).to(self.device)
        else:
            norms = local.add_(torch.from_numpy(on_host.astype(np.float32)).to(self.device)).sqrt_()
        fwd = torch.zeros_like(checksum) if fwd is None else fwd
        self.rows[step] = (torch.stack([checksum, fwd]), norms, reduced, taken)

    def take(self, steps: np.ndarray) -> dict[str, list[Any]]:
        """The `replicas` rows of `steps` (one per step and parameter-owning component), host side."""
        recs = [(int(s), self.rows.pop(int(s))) for s in steps if int(s) in self.rows]
        comps = np.flatnonzero(self.is_param)
        if not recs or not len(comps):
            return {k: [] for k in ("step", "component", "weight_checksum", "weight_checksum_fwd",
                                    "local_grad_norm_l2", "grad_allreduced", "sharded")}
        if self.device.type == "cpu":  # host rows (`end_step`): checksum, at the forward, squared local norms
            zero = np.zeros(self.n, dtype=np.int64)
            after = np.stack([r[0] for _, r in recs]).astype(np.int64)[:, comps]
            at_fwd = np.stack([zero if r[1] is None else r[1] for _, r in recs]).astype(np.int64)[:, comps]
            local = np.sqrt(np.stack([r[2] for _, r in recs])).astype(np.float32)[:, comps]
        else:  # on the device: one copy each
            checks = torch.stack([r[0] for _, r in recs]).cpu().numpy()[:, :, comps]
            after, at_fwd = checks[:, 0], checks[:, 1]
            local = torch.stack([r[1] for _, r in recs]).cpu().numpy()[:, comps]
        reduced = np.stack([r[-2] for _, r in recs])[:, comps]  # the rows end (..., all-reduced, taken)
        taken = np.stack([r[-1] for _, r in recs])[:, comps]
        norms = [float(v) if ok else None  # NaN/Inf kept: a non-finite local gradient is evidence
                 for v, ok in zip(local.reshape(-1).tolist(), reduced.reshape(-1).tolist(), strict=True)]
        return {"step": np.repeat([s for s, _ in recs], len(comps)).tolist(),
                "component": [self.names[c] for c in comps] * len(recs),
                "weight_checksum": after.reshape(-1).tolist(),
                # null where not taken (`_written`), or no training forward ran in the step
                "weight_checksum_fwd": [v if ok else None for v, ok in zip(
                    at_fwd.reshape(-1).tolist(), taken.reshape(-1).tolist(), strict=True)],
                "local_grad_norm_l2": norms,
                "grad_allreduced": reduced.reshape(-1).tolist(),
                "sharded": np.tile(self.sharded[comps], len(recs)).tolist()}

    def close(self) -> None:
        """Stop observing; the communication hook stays (DDP cannot drop it) and only all-reduces."""
        self.closed = True
        self._buckets.clear()
