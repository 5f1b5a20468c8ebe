"""What the recorder sees of the training loop itself: exact facts of each step, not statistics.

- **The mode.** Forwards of the watched model that ran in eval() mode with gradients enabled
  (the step's gradients then come from eval-mode dropout and batch norm, and no forward statistics
  are recorded), and components left in eval() mode while the model trains.
- **Gradient clearing.** Whether a parameter's gradient at optimizer.step still holds the one the
  previous step left, never set to None or zeroed in between (a missing `optimizer.zero_grad()`).
  It is judged at the start of every backward pass through the model's output: a parameter counts
  only if its gradient was carried over, unchanged, at each of them (the tensor and its version
  counter as the last optimizer step, or the last backward pass of this step, left them). So the
  micro-batches of gradient accumulation, several backward passes into the same gradients within
  one step, are no finding, and neither is a second loss that reaches the parameters before the
  loop clears them for their own backward (a GAN's generator loss through its discriminator).
- **What the optimizer steps on.** How many of the parameters the optimizer holds have a gradient
  at optimizer.step.
- **The batch.** The rows (size of dim 0) and the shape of the first tensor the model's forward
  received, so a batch the model saw is compared with the sample ids the loop recorded.

Every check reads Python attributes the step already holds (a parameter's `.grad`, a tensor's
version counter and shape, a module's `training` flag): no tensor op, no host-device sync.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np
import torch
from torch import nn


def grad_versions(params: list[nn.Parameter]) -> list[int]:
    """Which gradient tensor each parameter holds and its version counter, as flat ints: (0, -1)
    for none (a list of tuples made every step is garbage the collector has to walk)."""
    return versions_of([p.grad for p in params])


def versions_of(grads: list[torch.Tensor | None]) -> list[int]:
    """`grad_versions` of the parameters' `.grad` already read, in their order."""
    out: list[int] = []
    for g in grads:
        out += (0, -1) if g is None else (id(g), g._version)
    return out


def first_input(args: tuple[Any, ...], kwargs: Mapping[str, Any] | None) -> torch.Tensor | None:
    """The first tensor among a forward's positional, then keyword, arguments (token ids, images)."""
    for value in (*args, *(kwargs or {}).values()):
        if isinstance(value, torch.Tensor):
            return value
    return None


def held_mask(params: list[nn.Parameter], optimizer: torch.optim.Optimizer | None) -> np.ndarray:
    """Which of `params` an optimizer param group holds."""
    held = {id(p) for g in (optimizer.param_groups if optimizer is not None else ())
            for p in g.get("params", ())}
    return np.fromiter((id(p) in held for p in params), dtype=bool, count=len(params))


class LoopProbe:
    """The per-step facts of the module docstring, gathered at the hooks the recorder already has."""

    def __init__(self, params: list[nn.Parameter], optimizer: torch.optim.Optimizer | None) -> None:
        self.params = params
        self.optimizer = optimizer
        self._groups = -1
        self._held = np.zeros(len(params), dtype=bool)
        self._held_list: list[int] = []
        # the last `param_has_grad` array seen and what it says of the held parameters: the
        # parameter probe hands the same read-only array every step in which all have a gradient
        self._has: tuple[np.ndarray | None, int, bool] = (None, 0, False)
        self._after_step: list[int] | None = None  # gradient versions at the last optimizer step's end
        self._carried: list[bool] | None = None  # per held parameter: carried over at every backward so far
        self.eval_components: dict[str, int] = {}  # component -> first step seen in eval() mode
        self.eval_forwards = 0
        self.rows = 0
        self.shape: list[int] | None = None

    def forward(self, training: bool, args: tuple[Any, ...], kwargs: Mapping[str, Any] | None) -> None:
        """A forward of the watched model with gradients enabled (train or eval mode)."""
        if not training:
            self.eval_forwards += 1
        t = first_input(args, kwargs)
        if t is not None and t.dim() > 0:
            self.rows += int(t.shape[0])
            if self.shape is None:
                self.shape = list(t.shape)

    def component_in_eval(self, name: str, step: int) -> bool:
        """A component's forward ran in eval() mode while the model trains; True the first time."""
        if name in self.eval_components:
            return False
        self.eval_components[name] = step
        return True

    def backward_begins(self, since: list[int] | None) -> None:
        """Start of a backward pass, before any gradient accumulates: which held parameters'
        gradients are still those of the last observation (`since`: the gradient versions at this
        step's last backward end, else the last optimizer step's end)."""
        if since is not None and self._carried is None:
            return  # the step's first backward pass was not judged: its later ones judge nothing
        ref = since if since is not None else self._after_step
        if ref is None or (self._carried is not None and not any(self._carried)):
            return  # nothing to compare with, or every gradient was already seen cleared
        self._refresh_held()
        now = grad_versions(self.params)
        carried = [now[2 * i] != 0 and now[2 * i] == ref[2 * i] and now[2 * i + 1] == ref[2 * i + 1]
                   for i in self._held_list]
        self._carried = carried if self._carried is None else [
            a and b for a, b in zip(self._carried, carried, strict=True)]

    def step_facts(self, param_has_grad: np.ndarray | None) -> tuple[int | None, int]:
        """At optimizer.step: (held parameters whose gradient was never cleared since the last
        step, null when no backward was seen; held parameters with a gradient)."""
        self._refresh_held()
        if param_has_grad is None:
            return (None if self._carried is None else 0), 0
        if param_has_grad is not self._has[0]:
            held = param_has_grad[self._held]
            self._has = (param_has_grad, int(held.sum()), bool(held.all()))
        _, with_grad, all_held = self._has
        if self._carried is None:
            return None, with_grad
        if all_held:
            return sum(self._carried), with_grad
        return sum(c and bool(param_has_grad[i]) for c, i in zip(self._carried, self._held_list, strict=True)), with_grad

    def step_ended(self) -> None:
        """optimizer.step's end: note the gradients it leaves; the next step's facts start."""
        self._after_step = grad_versions(self.params)
        self._carried = None
        self.eval_forwards = self.rows = 0
        self.shape = None

    def _refresh_held(self) -> None:
        """The held mask, taken again when the optimizer gained a param group (add_param_group)."""
        groups = len(self.optimizer.param_groups) if self.optimizer is not None else 0
        if groups != self._groups:
            self._groups = groups
            self._held = held_mask(self.params, self.optimizer)
            self._held_list = np.flatnonzero(self._held).tolist()
            self._has = (None, 0, False)
            self._carried = None
