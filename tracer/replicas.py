"""Per-rank evidence: an exact fingerprint of the weights each rank holds, and its local gradients.

Data-parallel replicas must hold bit-identical weights after every optimizer step. Each rank
records, per parameter-owning component and step:

- `weight_checksum`: the wrapping (mod 2^32) sum of the raw bits of every element of the
  component's parameters after the step (each float viewed as 16- or 32-bit integer words).
  Integer addition mod 2^32 is exact and order-free, so bit-identical replicas give equal
  checksums on any device and thread count, and one flipped bit changes the sum by ±2^k mod
  2^32, never 0. `weight_checksum_fwd` is the same taken at the step's first forward: on one
  rank it differs from the previous step's `weight_checksum` exactly when something other than
  the optimizer wrote the weights in between (an exact weight drift; a low mantissa bit that no
  norm sees counts). Cost: two reads of the weights per step, one small op per parameter each,
  no host sync.
- `local_grad_norm_l2`: the L2 norm of the gradient this rank contributed *before* the
  all-reduce averaged it with the others (null on a step whose gradients were not all-reduced).
  Read in a DistributedDataParallel communication hook, which sees each bucket of local
  gradients once, just before it calls the same all-reduce DDP runs without a hook. Given the
  module inside a DDP, the hook goes on the DDP found running it at the first training forward.
- `grad_allreduced`: whether DDP all-reduced this component's gradients in this step; false on
  every component means the step trained outside DDP (its gradients stayed local).

Values stay on the device until the segment is flushed, like the health stats.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch
from torch import nn

from .components import Component

_INT_VIEW = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int32}  # element bytes -> words


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
        self.rows: dict[int, tuple[torch.Tensor, torch.Tensor, np.ndarray]] = {}
        self._at_forward: torch.Tensor | None = None
        self._buckets: dict[int, tuple[torch.Tensor, torch.Tensor, np.ndarray]] = {}
        self._layouts: dict[tuple[int, ...], tuple[torch.Tensor, np.ndarray]] = {}
        self.closed = False
        self.model = model
        ddp = isinstance(model, nn.parallel.DistributedDataParallel)
        # the inner module of a DDP: its wrapper is found at the first forward, which runs inside it
        self._wrapper_unknown = not ddp
        self.hook_note = self._install_comm_hook(model) if ddp else None

    # --- local gradients: a DDP communication hook ------------------------------------------

    def _find_wrapper(self) -> str | None:
        """At the first training forward of a watched inner module: hook the DDP running it, or
        say why its local gradient norms cannot be had."""
        self._wrapper_unknown = False
        # DDP names itself while its forward runs (what torch.compile's DDP optimizer reads)
        active = nn.parallel.DistributedDataParallel._get_active_ddp_module()
        if active is not None and any(m is self.model for m in active.module.modules()):
            return self._install_comm_hook(active)
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
        if not self.closed:
            try:
                self._observe_bucket(bucket)
            except Exception:  # never break the all-reduce; the step's local norms stay null
                self._buckets.pop(bucket.index(), None)
        # The same arithmetic as DDP without a hook (grad * (1 / world) into the bucket, then a
        # summing all-reduce), so training is bit-identical with and without the recorder.
        size = group.size() if group is not None else torch.distributed.get_world_size()
        buffer.mul_(1.0 / size)
        work = torch.distributed.all_reduce(buffer, group=group, async_op=True)
        return work.get_future().then(lambda fut: fut.value()[0])

    def _observe_bucket(self, bucket: Any) -> None:
        """Per-component sum of squares of this bucket's local gradients (kept until the step ends)."""
        grads = bucket.gradients()
        params = bucket.parameters()
        key = tuple(id(p) for p in params)
        layout = self._layouts.get(key)
        if layout is None:
            comps = [self.comp_of.get(id(p), -1) for p in params]
            keep = torch.tensor([c >= 0 for c in comps], dtype=torch.bool, device=self.device)
            idx = torch.tensor([max(c, 0) for c in comps], dtype=torch.long, device=self.device)
            mask = np.zeros(self.n, dtype=bool)
            mask[[c for c in comps if c >= 0]] = True
            layout = self._layouts[key] = (torch.stack([idx, keep.long()]), mask)
        if not grads:
            return
        norms = torch.stack(torch._foreach_norm(grads)).float()
        # a later call for the same bucket in the step (another synced micro-batch) replaces it
        self._buckets[bucket.index()] = (layout[0][0], norms * norms * layout[0][1], layout[1])

    # --- per step -----------------------------------------------------------------------------

    def checksums(self) -> torch.Tensor:
        """(C,) int64: per component, the sum of its parameters' wrapping int32 bit sums."""
        # int32 accumulation: its wrap mod 2^32 is the checksum's own arithmetic, so no wider sum
        # is needed, and the narrow one is the faster on CPU
        sums = torch.stack([_words(local_shard(p)).sum(dtype=torch.int32) for p in self.params])
        return torch.zeros(self.n, dtype=torch.int64, device=self.device).index_add_(
            0, self.param_comp, sums.long() & 0xFFFFFFFF)  # unsigned: a checksum is never < 0

    def begin(self) -> str | None:
        """First training forward of a step: the checksums of the weights as the step found them;
        at the first one, for an inner module, a note when its local gradients cannot be had."""
        note = self._find_wrapper() if self._wrapper_unknown and not self.closed else None
        if self.params and not self.closed:
            self._at_forward = self.checksums()
        return note

    def end_step(self, step: int) -> None:
        """After optimizer.step: the weights' checksums and this step's local gradient norms."""
        if not self.params:
            return
        checksum = self.checksums()
        fwd = self._at_forward if self._at_forward is not None else torch.full_like(checksum, -1)
        self._at_forward = None
        local = torch.zeros(self.n, device=self.device)
        reduced = np.zeros(self.n, dtype=bool)
        for idx, sq, mask in self._buckets.values():
            local.index_add_(0, idx, sq)
            reduced |= mask
        self._buckets.clear()
        self.rows[step] = (torch.stack([checksum, fwd]), local.sqrt(), reduced)

    def take(self, steps: np.ndarray) -> dict[str, list[Any]]:
        """The `replicas` rows of `steps` (one per step and parameter-owning component), host side."""
        recs = [(int(s), self.rows.pop(int(s))) for s in steps if int(s) in self.rows]
        comps = np.flatnonzero(self.is_param)
        if not recs or not len(comps):
            return {k: [] for k in ("step", "component", "weight_checksum", "weight_checksum_fwd",
                                    "local_grad_norm_l2", "grad_allreduced", "sharded")}
        checks = torch.stack([r[0] for _, r in recs]).cpu().numpy()[:, :, comps]  # one copy each
        local = torch.stack([r[1] for _, r in recs]).cpu().numpy()[:, comps]
        reduced = np.stack([r[2] for _, r in recs])[:, comps]
        norms = [float(v) if ok else None  # NaN/Inf kept: a non-finite local gradient is evidence
                 for v, ok in zip(local.reshape(-1).tolist(), reduced.reshape(-1).tolist(), strict=True)]
        return {"step": np.repeat([s for s, _ in recs], len(comps)).tolist(),
                "component": [self.names[c] for c in comps] * len(recs),
                "weight_checksum": checks[:, 0].reshape(-1).tolist(),
                # -1: no training forward ran in the step (no checksum taken; a real one is >= 0)
                "weight_checksum_fwd": [None if v < 0 else v for v in checks[:, 1].reshape(-1).tolist()],
                "local_grad_norm_l2": norms,
                "grad_allreduced": reduced.reshape(-1).tolist(),
                "sharded": np.tile(self.sharded[comps], len(recs)).tolist()}

    def close(self) -> None:
        """Stop observing; the communication hook stays (DDP cannot drop it) and only all-reduces."""
        self.closed = True
        self._buckets.clear()
