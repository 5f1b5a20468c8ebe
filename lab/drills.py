"""Fault drills: injectors that harm one part of a model at a known step, so forensics can be rehearsed.

A drill acts from outside the recorder (the recorder stays read-only). The training loop calls,
for every step `s` (1-based, the optimizer step about to run)::

    drill.before_step(s, model, optimizer)      # before the forward of step s
    x, y = drill.corrupt_batch(s, x, y)         # the batch step s will consume

Call `attach(model, optimizer)` once before `watch(...)`: some drills move a module's parameters
into their own optimizer param group so that its learning rate can be changed alone.
`truth()` says what forensics should find: the fault, the component, the first step it acts, the
kind (abrupt | gradual) and the condition it should produce.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

ABRUPT, GRADUAL = "abrupt", "gradual"


class DrillError(ValueError):
    """A drill was configured with a value it cannot use."""


@dataclass
class Drill:
    """Base drill: does nothing; subclasses override the hooks they need."""

    component: str
    step: int
    kind: str = ABRUPT
    fault: str = "none"
    condition: str = "unclassified"
    _model: nn.Module | None = field(default=None, init=False, repr=False)
    _hooks: list[Any] = field(default_factory=list, init=False, repr=False)

    def __post_init__(self) -> None:
        if self.step < 1:
            raise DrillError(f"drill step must be >= 1 (steps count from 1), got {self.step}")
        if self.kind not in (ABRUPT, GRADUAL):
            raise DrillError(f"drill kind must be 'abrupt' or 'gradual', got {self.kind!r}")

    def attach(self, model: nn.Module, optimizer: torch.optim.Optimizer | None) -> None:
        """Remember the model; check the component exists."""
        self._model = model
        self.module(model)

    def module(self, model: nn.Module) -> nn.Module:
        """The harmed module, looked up by its `named_modules()` path."""
        modules = dict(model.named_modules())
        if self.component not in modules:
            some = ", ".join(repr(n) for n in list(modules)[1:8])
            raise DrillError(f"no module named {self.component!r} in the model; try one of {some}")
        return modules[self.component]

    def before_step(self, step: int, model: nn.Module, optimizer: torch.optim.Optimizer | None) -> None:
        """Act before the forward pass of `step`."""

    def corrupt_batch(self, step: int, x: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The batch step `step` consumes; identity unless the drill corrupts data."""
        return x, y

    def detach(self) -> None:
        """Remove any hooks this drill installed."""
        for h in self._hooks:
            h.remove()
        self._hooks.clear()

    def truth(self) -> dict[str, Any]:
        """What forensics should find."""
        return {"fault": self.fault, "component": self.component, "step": self.step,
                "kind": self.kind, "condition": self.condition}


def _isolate(optimizer: torch.optim.Optimizer, module: nn.Module) -> dict[str, Any]:
    """Move `module`'s parameters into their own param group (same hyperparameters); return it."""
    own = {id(p) for p in module.parameters()}
    if not own:
        raise DrillError(f"module {type(module).__name__} owns no parameters to isolate")
    template = {k: v for k, v in optimizer.param_groups[0].items() if k != "params"}
    for group in optimizer.param_groups:
        group["params"] = [p for p in group["params"] if id(p) not in own]
    optimizer.add_param_group({**template, "params": list(module.parameters())})
    return optimizer.param_groups[-1]


@dataclass
class WeightCorruption(Drill):
    """Memory corruption: overwrite a module's weights once, outside the optimizer.

    mode `scale` multiplies them by `factor`; `bitflip` flips exponent bit 30 of a `fraction` of
    float32 weights (a value near 1 becomes ~1e38); `noise` adds Gaussian noise of `factor` times
    the weights' own standard deviation.
    """

    mode: str = "scale"
    factor: float = 10.0
    fraction: float = 0.01
    seed: int = 0
    fault: str = "weight_corruption"
    condition: str = "exploding"

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.mode not in ("scale", "bitflip", "noise"):
            raise DrillError(f"WeightCorruption mode must be scale, bitflip or noise, got {self.mode!r}")

    def before_step(self, step: int, model: nn.Module, optimizer: torch.optim.Optimizer | None) -> None:
        if step != self.step:
            return
        g = torch.Generator().manual_seed(self.seed)
        with torch.no_grad():
            for p in self.module(model).parameters(recurse=False):
                self._corrupt(p, g)

    def _corrupt(self, p: torch.Tensor, g: torch.Generator) -> None:
        if self.mode == "scale":
            p.mul_(self.factor)
        elif self.mode == "noise":
            p.add_(torch.randn(p.shape, generator=g).to(p) * self.factor * p.std())
        else:
            flat = p.detach().view(-1)
            k = max(1, int(self.fraction * flat.numel()))
            idx = torch.randperm(flat.numel(), generator=g)[:k].to(p.device)
            bits = flat[idx].float().view(torch.int32) ^ (1 << 30)  # exponent MSB
            flat[idx] = bits.view(torch.float32).to(p.dtype)


@dataclass
class BiasDrift(Drill):
    """A layer dies gradually: its bias is pushed down by `rate` per step for `duration` steps.

    On a Linear/Conv feeding a ReLU the pre-activations sink below zero unit by unit until the
    ReLU outputs nothing; the optimizer cannot pull a dead unit back (its gradient is zero).
    """

    rate: float = 0.05
    duration: int = 100
    kind: str = GRADUAL
    fault: str = "bias_drift"
    condition: str = "dead"

    def before_step(self, step: int, model: nn.Module, optimizer: torch.optim.Optimizer | None) -> None:
        if not self.step <= step < self.step + self.duration:
            return
        bias = getattr(self.module(model), "bias", None)
        if bias is None:
            raise DrillError(f"module {self.component!r} has no bias to drift")
        with torch.no_grad():
            bias.sub_(self.rate)


@dataclass
class WeightShrink(Drill):
    """A head loses confidence: its weights shrink by `rate` (fraction) per step, outside the optimizer."""

    rate: float = 0.03
    duration: int = 60
    kind: str = GRADUAL
    fault: str = "weight_shrink"
    condition: str = "losing_confidence"

    def before_step(self, step: int, model: nn.Module, optimizer: torch.optim.Optimizer | None) -> None:
        if not self.step <= step < self.step + self.duration:
            return
        with torch.no_grad():
            for p in self.module(model).parameters(recurse=False):
                p.mul_(1.0 - self.rate)


@dataclass
class WeightGrowth(Drill):
    """Creeping corruption: a module's weights grow by `rate` (fraction) per step, outside the optimizer.

    Slow enough that the loss curve shows nothing for a while; the layer's norms explode.
    """

    rate: float = 0.03
    duration: int = 150
    kind: str = GRADUAL
    fault: str = "weight_growth"
    condition: str = "exploding"

    def before_step(self, step: int, model: nn.Module, optimizer: torch.optim.Optimizer | None) -> None:
        if not self.step <= step < self.step + self.duration:
            return
        with torch.no_grad():
            for p in self.module(model).parameters(recurse=False):
                p.mul_(1.0 + self.rate)


@dataclass
class BiasShift(Drill):
    """Shift a module's output by a constant: it departs its baseline in no named way."""

    offset: float = 1.0
    fault: str = "bias_shift"
    condition: str = "unclassified"

    def before_step(self, step: int, model: nn.Module, optimizer: torch.optim.Optimizer | None) -> None:
        if step != self.step:
            return
        bias = getattr(self.module(model), "bias", None)
        if bias is None:
            raise DrillError(f"module {self.component!r} has no bias to shift")
        with torch.no_grad():
            bias.add_(self.offset)


@dataclass
class LRSpike(Drill):
    """The optimizer's learning rate is multiplied by `factor` for `duration` steps.

    With `component` set, only that module's parameters get the spike (they are moved into their
    own param group at attach); with `component=""` every group does. The spike multiplies the lr
    the schedule set for the step, so it composes with any scheduler. With momentum SGD a spike
    past the stability limit makes updates flip direction each step (oscillating).
    """

    factor: float = 20.0
    duration: int = 1_000_000
    fault: str = "lr_spike"
    condition: str = "exploding"
    _groups: list[dict[str, Any]] = field(default_factory=list, init=False, repr=False)
    _plain: list[float] = field(default_factory=list, init=False, repr=False)
    _written: list[float | None] = field(default_factory=list, init=False, repr=False)

    def attach(self, model: nn.Module, optimizer: torch.optim.Optimizer | None) -> None:
        if optimizer is None:
            raise DrillError("LRSpike needs the optimizer; pass it to attach(model, optimizer)")
        self._model = model
        if self.component:
            self._groups = [_isolate(optimizer, self.module(model))]
        else:
            self._groups = list(optimizer.param_groups)
        self._plain = [g["lr"] for g in self._groups]
        self._written = [None] * len(self._groups)

    def before_step(self, step: int, model: nn.Module, optimizer: torch.optim.Optimizer | None) -> None:
        spiking = self.step <= step < self.step + self.duration
        for i, group in enumerate(self._groups):
            # the lr the schedule set for this step: ours from last step unless something reset it
            if self._written[i] is None or group["lr"] != self._written[i]:
                self._plain[i] = group["lr"]
            group["lr"] = self._plain[i] * self.factor if spiking else self._plain[i]
            self._written[i] = group["lr"]

    def truth(self) -> dict[str, Any]:
        return {**super().truth(), **({} if self.component else {"scope": "optimizer"})}


@dataclass
class FreezeModule(Drill):
    """One module stops being updated (its learning rate drops to 0) while the rest learn: stagnant."""

    fault: str = "frozen_module"
    condition: str = "stagnant"
    _group: dict[str, Any] | None = field(default=None, init=False, repr=False)
    _lr: float = field(default=0.0, init=False, repr=False)

    def attach(self, model: nn.Module, optimizer: torch.optim.Optimizer | None) -> None:
        if optimizer is None:
            raise DrillError("FreezeModule needs the optimizer; pass it to attach(model, optimizer)")
        self._model = model
        self._group = _isolate(optimizer, self.module(model))
        self._lr = self._group["lr"]

    def before_step(self, step: int, model: nn.Module, optimizer: torch.optim.Optimizer | None) -> None:
        if self._group is not None:
            self._group["lr"] = 0.0 if step >= self.step else self._lr


@dataclass
class _OutputHookDrill(Drill):
    """A drill that rewrites a module's forward output from `step` on, for `duration` steps."""

    duration: int = 1
    _current: int = field(default=0, init=False, repr=False)

    def attach(self, model: nn.Module, optimizer: torch.optim.Optimizer | None) -> None:
        super().attach(model, optimizer)
        self._hooks.append(self.module(model).register_forward_hook(self._hook))

    def before_step(self, step: int, model: nn.Module, optimizer: torch.optim.Optimizer | None) -> None:
        self._current = step

    def active(self) -> bool:
        """True while the drill acts on the step being run."""
        return self.step <= self._current < self.step + self.duration

    def _hook(self, module: nn.Module, args: Any, out: torch.Tensor) -> torch.Tensor | None:
        return self.rewrite(out) if self.active() and module.training else None

    def rewrite(self, out: torch.Tensor) -> torch.Tensor:
        return out


@dataclass
class NaNInjection(_OutputHookDrill):
    """A fraction of one module's output becomes NaN at `step` (a bad kernel, an overflow)."""

    fraction: float = 0.01
    fault: str = "nan_injection"
    condition: str = "exploding"

    def rewrite(self, out: torch.Tensor) -> torch.Tensor:
        mask = torch.rand(out.shape, generator=torch.Generator().manual_seed(self._current)) < self.fraction
        return out.masked_fill(mask.to(out.device), float("nan"))


@dataclass
class GradientAttenuation(_OutputHookDrill):
    """The gradient flowing into a module's output is multiplied by `factor` (values unchanged).

    Models a broken loss scale or a stray `detach`-like bug: the module and everything upstream
    stop receiving gradient (losing gradient) while the forward pass is untouched.
    """

    factor: float = 1e-4
    duration: int = 1_000_000
    fault: str = "gradient_attenuation"
    condition: str = "losing_gradient"

    def rewrite(self, out: torch.Tensor) -> torch.Tensor:
        return out * self.factor + (out * (1.0 - self.factor)).detach()


@dataclass
class GradientSignFlip(_OutputHookDrill):
    """The gradient into a module's output changes sign every other step (values unchanged).

    Models a sign bug in a gradient path (a loss scale or accumulation that alternates): the
    module's updates, and those upstream, flip back and forth (oscillating).
    """

    duration: int = 1_000_000
    fault: str = "gradient_sign_flip"
    condition: str = "oscillating"

    def rewrite(self, out: torch.Tensor) -> torch.Tensor:
        if (self._current - self.step) % 2 == 1:
            return out
        return (2.0 * out).detach() - out  # value: out; gradient: negated


@dataclass
class PreActivationScale(Drill):
    """The input of a bounded activation (tanh, sigmoid) is multiplied by `factor`: it saturates.

    `ramp` > 0 grows the factor linearly from 1 over that many steps (a gradual fault).
    """

    factor: float = 30.0
    ramp: int = 0
    duration: int = 1_000_000
    fault: str = "preactivation_scale"
    condition: str = "saturated"
    _current: int = field(default=0, init=False, repr=False)

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.ramp > 0:
            self.kind = GRADUAL

    def attach(self, model: nn.Module, optimizer: torch.optim.Optimizer | None) -> None:
        super().attach(model, optimizer)
        self._hooks.append(self.module(model).register_forward_pre_hook(self._pre))

    def before_step(self, step: int, model: nn.Module, optimizer: torch.optim.Optimizer | None) -> None:
        self._current = step

    def scale(self) -> float:
        """The factor applied on the step being run (1 outside the drill)."""
        k = self._current - self.step
        if k < 0 or k >= self.duration:
            return 1.0
        if self.ramp > 0 and k < self.ramp:
            return 1.0 + (self.factor - 1.0) * (k + 1) / self.ramp
        return self.factor

    def _pre(self, module: nn.Module, args: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, ...] | None:
        s = self.scale()
        return None if s == 1.0 or not module.training else (args[0] * s, *args[1:])


@dataclass
class CorruptBatches(Drill):
    """A window of `duration` corrupted batches (a bad shard).

    mode `scale`: float inputs scaled by `factor` plus noise of that scale; token ids replaced by
    random tokens below the batch's largest, targets shuffled across samples. mode `random`: the
    batch replaced by garbage of the data's own range, nothing larger than the data: token ids
    and targets random over `vocab_size` (the batch's largest id + 1 when 0), float inputs by
    Gaussian noise of the batch's own mean and deviation with shuffled labels.
    `component` names the first module that reads the batch (where forensics should see it).
    """

    duration: int = 20
    factor: float = 25.0
    seed: int = 0
    mode: str = "scale"
    vocab_size: int = 0
    fault: str = "corrupt_batches"
    condition: str = "exploding"

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.mode not in ("scale", "random"):
            raise DrillError(f"CorruptBatches mode must be scale or random, got {self.mode!r}")

    def corrupt_batch(self, step: int, x: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if not self.step <= step < self.step + self.duration:
            return x, y
        return self._garbage(step, x, y, torch.ones(len(x), dtype=torch.bool))

    def _garbage(self, step: int, x: torch.Tensor, y: torch.Tensor,
                 rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The batch with `rows` (a boolean mask over its samples) made garbage."""
        g = torch.Generator().manual_seed(self.seed + step)
        x, y = x.clone(), y.clone()
        n = int(rows.sum())
        if not x.is_floating_point():
            vocab = self.vocab_size or int(x.max()) + 1
            x[rows] = torch.randint(0, vocab, (n, *x.shape[1:]), generator=g)
            if self.mode == "random":
                y[rows] = torch.randint(0, vocab, (n, *y.shape[1:]), generator=g)
            else:
                y[rows] = y.roll(1, 0)[rows]
            return x, y
        if self.mode == "random":
            x[rows] = torch.randn((n, *x.shape[1:]), generator=g) * x.std() + x.mean()
        else:
            x[rows] = x[rows] * self.factor + torch.randn((n, *x.shape[1:]), generator=g) * self.factor
        y[rows] = y.roll(1, 0)[rows]
        return x, y

    def truth(self) -> dict[str, Any]:
        # the data, not a module, is at fault; `component` is the first module that reads it
        return {**super().truth(), "scope": "data", "reads": self.component,
                "last_step": self.step + self.duration - 1}


@dataclass
class PoisonedSamples(CorruptBatches):
    """For `duration` steps, `count` samples of each batch are garbage (mode as `CorruptBatches`)
    and the rest are sound: a poisoned source mixed into clean batches."""

    count: int = 2
    mode: str = "random"
    fault: str = "poisoned_samples"

    def corrupt_batch(self, step: int, x: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if not self.step <= step < self.step + self.duration:
            return x, y
        rows = torch.zeros(len(x), dtype=torch.bool)
        rows[torch.randperm(len(x), generator=torch.Generator().manual_seed(self.seed - step))[:self.count]] = True
        return self._garbage(step, x, y, rows)


# --- faults present from step one -------------------------------------------------------------
# A trailing baseline cannot see these (there is no "before"); `analyze --reference` compares the
# run with a known-good run of the same model, component by component, step by step.


@dataclass
class MissingZeroGrad(Drill):
    """`optimizer.zero_grad()` does nothing from `step` on: gradients accumulate across steps."""

    component: str = ""
    step: int = 1
    kind: str = GRADUAL  # the gradients grow step by step
    fault: str = "missing_zero_grad"
    condition: str = "exploding"
    _current: int = field(default=0, init=False, repr=False)

    def attach(self, model: nn.Module, optimizer: torch.optim.Optimizer | None) -> None:
        if optimizer is None:
            raise DrillError("MissingZeroGrad needs the optimizer; pass it to attach(model, optimizer)")
        self._model = model
        self._current = 0
        plain = optimizer.zero_grad

        def zero_grad(set_to_none: bool = True) -> None:
            if self._current < self.step:
                plain(set_to_none=set_to_none)
        optimizer.zero_grad = zero_grad  # type: ignore[method-assign]

    def before_step(self, step: int, model: nn.Module, optimizer: torch.optim.Optimizer | None) -> None:
        self._current = step

    def truth(self) -> dict[str, Any]:
        return {**super().truth(), "scope": "setup", "finding": "grads_not_cleared"}


@dataclass
class FrozenByMistake(Drill):
    """A module's parameters are set `requires_grad=False` before training: it never learns."""

    step: int = 1
    fault: str = "frozen_by_mistake"
    condition: str = "stagnant"

    def attach(self, model: nn.Module, optimizer: torch.optim.Optimizer | None) -> None:
        super().attach(model, optimizer)
        for p in self.module(model).parameters(recurse=False):
            p.requires_grad_(False)


@dataclass
class NotInOptimizer(Drill):
    """The optimizer does not hold a module's parameters: their gradients are never applied."""

    step: int = 1
    fault: str = "not_in_optimizer"
    condition: str = "stagnant"

    def attach(self, model: nn.Module, optimizer: torch.optim.Optimizer | None) -> None:
        if optimizer is None:
            raise DrillError("NotInOptimizer needs the optimizer; pass it to attach(model, optimizer)")
        super().attach(model, optimizer)
        own = {id(p) for p in self.module(model).parameters(recurse=False)}
        for group in optimizer.param_groups:
            group["params"] = [p for p in group["params"] if id(p) not in own]

    def truth(self) -> dict[str, Any]:
        return {**super().truth(), "scope": "setup", "finding": "not_in_optimizer"}


@dataclass
class WrongInitScale(Drill):
    """A module's initial weights are `factor` times what its initialiser drew (init skipped/doubled)."""

    step: int = 1
    factor: float = 10.0
    fault: str = "wrong_init_scale"
    condition: str = "exploding"

    def attach(self, model: nn.Module, optimizer: torch.optim.Optimizer | None) -> None:
        super().attach(model, optimizer)
        with torch.no_grad():
            for p in self.module(model).parameters(recurse=False):
                p.mul_(self.factor)


# --- bugs of the training set-up, seen as facts without any reference (forensics findings) -----


@dataclass
class EvalModeTraining(Drill):
    """The model is put in eval() mode before training and never back in train() mode."""

    component: str = ""
    step: int = 1
    fault: str = "eval_mode"

    def attach(self, model: nn.Module, optimizer: torch.optim.Optimizer | None) -> None:
        self._model = model
        model.eval()

    def detach(self) -> None:
        super().detach()
        if self._model is not None:
            self._model.train()

    def truth(self) -> dict[str, Any]:
        return {**super().truth(), "scope": "setup", "finding": "eval_mode"}


@dataclass
class CollapsedBatch(Drill):
    """Every batch from `step` on reaches the model as its first sample only (a collate or
    processor bug), while the loop records every sample id it drew."""

    component: str = ""
    step: int = 1
    fault: str = "collapsed_batch"

    def corrupt_batch(self, step: int, x: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return (x[:1], y[:1]) if step >= self.step else (x, y)

    def truth(self) -> dict[str, Any]:
        return {**super().truth(), "scope": "setup", "finding": "batch_collapsed"}


@dataclass
class ZeroLearningRate(Drill):
    """Every param group's learning rate is 0 from the start (a schedule or a config that zeroes it)."""

    component: str = ""
    step: int = 1
    fault: str = "lr_zero"

    def attach(self, model: nn.Module, optimizer: torch.optim.Optimizer | None) -> None:
        if optimizer is None:
            raise DrillError("ZeroLearningRate needs the optimizer; pass it to attach(model, optimizer)")
        self._model = model
        for group in optimizer.param_groups:
            group["lr"] = 0.0

    def truth(self) -> dict[str, Any]:
        return {**super().truth(), "scope": "setup", "finding": "lr_zero"}


@dataclass
class DetachedOutput(Drill):
    """A module's output is detached from the graph: no gradient reaches it or anything before it."""

    step: int = 1
    fault: str = "detached_output"

    def attach(self, model: nn.Module, optimizer: torch.optim.Optimizer | None) -> None:
        super().attach(model, optimizer)
        self._hooks.append(self.module(model).register_forward_hook(lambda m, a, out: out.detach()))

    def truth(self) -> dict[str, Any]:
        # every component up to this one loses its gradient: the root is those, not one
        return {**super().truth(), "component": "", "scope": "setup", "finding": "no_gradient"}


@dataclass
class ZeroedBeforeStep(Drill):
    """The gradients are zeroed (in place) between the backward pass and optimizer.step."""

    component: str = ""
    step: int = 1
    fault: str = "zeroed_before_step"

    def attach(self, model: nn.Module, optimizer: torch.optim.Optimizer | None) -> None:
        if optimizer is None:
            raise DrillError("ZeroedBeforeStep needs the optimizer; pass it to attach(model, optimizer)")
        self._model = model
        plain_step = optimizer.step

        def step(*args: Any, **kwargs: Any) -> Any:
            optimizer.zero_grad(set_to_none=False)
            return plain_step(*args, **kwargs)
        optimizer.step = step  # type: ignore[method-assign]

    def truth(self) -> dict[str, Any]:
        return {**super().truth(), "scope": "setup", "finding": "zero_gradients"}
