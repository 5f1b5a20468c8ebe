"""Which modules of a model are components, what kind they are, and the `components` table rows."""

from __future__ import annotations

import difflib
from dataclasses import dataclass, field

from torch import nn

# Parameter-free nonlinearities we record, and the range each one is bounded to (None: unbounded).
ACTIVATION_BOUNDS: dict[type[nn.Module], str | None] = {
    nn.ReLU: "relu", nn.ReLU6: "relu", nn.Tanh: "tanh", nn.Hardtanh: "tanh",
    nn.Sigmoid: "sigmoid", nn.Hardsigmoid: "sigmoid", nn.Softmax: "sigmoid",
    nn.GELU: None, nn.SiLU: None, nn.LeakyReLU: None, nn.ELU: None, nn.SELU: None,
    nn.CELU: None, nn.Mish: None, nn.Softplus: None, nn.Hardswish: None, nn.LogSoftmax: None,
}

# Modules whose output carries units along dim 1 (channels), not along the last dim.
_CHANNEL_FIRST = (nn.Conv1d, nn.Conv2d, nn.Conv3d, nn.ConvTranspose1d, nn.ConvTranspose2d,
                  nn.ConvTranspose3d, nn.BatchNorm1d, nn.BatchNorm2d, nn.BatchNorm3d)

# (center, half width) of each bounded range: an output is saturated when it lies within 1% of the
# range's width of a bound, i.e. |x - center| >= 0.98 * half width.
SAT_RANGES: dict[str, tuple[float, float]] = {"tanh": (0.0, 1.0), "sigmoid": (0.5, 0.5)}


@dataclass
class Component:
    """One recorded module: its path, kind, parameters and what was learnt in the first forward."""

    index: int
    name: str
    module: nn.Module
    params: list[nn.Parameter]
    role: str                          # "param", "activation" or "head"
    bound: str | None = None
    channel_first: bool = False
    forward_index: int | None = None   # first-call order in the first recorded forward
    parent_param: str | None = None
    head: bool = False
    param_group: int | None = None     # optimizer param group holding its parameters
    param_names: list[str] = field(default_factory=list)  # state-dict keys of `params`, in order
    optimizer_index: list[int | None] = field(default_factory=list)  # each one's optimizer state key
    requires_grad: list[bool] = field(default_factory=list)  # each one's requires_grad at the first step
    tied_to: str | None = None         # a module whose parameters are all another component's
    released: bool = False             # a tied module found not to be a head: not recorded
    extra: dict[str, object] = field(default_factory=dict)

    @property
    def param_count(self) -> int:
        """Parameters owned directly by this module."""
        return sum(p.numel() for p in self.params)


def user_module(model: nn.Module) -> nn.Module:
    """The module whose paths the user knows: the one inside DistributedDataParallel wrappers
    (whose own paths would put `module.` before every name)."""
    while isinstance(model, nn.parallel.DistributedDataParallel):
        model = model.module
    return model


def discover(model: nn.Module, heads: list[str] | None = None) -> list[Component]:
    """Every module owning parameters directly, plus known activation modules, in module order.

    A module whose parameters are all owned by a module found earlier (an output head tied to
    the token embedding) owns none; it is a component only as a possible head: when it is named
    in `heads`, or when no heads are named (the default head may be it; `release_tied` drops the
    others after the first forward). Its `tied_to` names the owner of the first of them.
    """
    owner: dict[int, str] = {}
    found: list[Component] = []
    for name, module in model.named_modules():
        every = list(module.named_parameters(recurse=False))
        named = [(n, p) for n, p in every if id(p) not in owner]
        own = [p for _, p in named]
        for p in own:  # a tied parameter belongs to its first owner
            owner[id(p)] = name
        tied_to = None
        if own:
            role, bound = "param", None
        elif every and (heads is None or name in heads):
            role, bound, tied_to = "param", None, owner[id(every[0][1])]
        elif type(module) in ACTIVATION_BOUNDS:
            role, bound = "activation", ACTIVATION_BOUNDS[type(module)]
        else:
            continue
        found.append(Component(len(found), name, module, own, role, bound,
                               channel_first=isinstance(module, _CHANNEL_FIRST), tied_to=tied_to,
                               param_names=[f"{name}.{n}" if name else n for n, _ in named]))
    return found


def resolve_heads(components: list[Component], heads: list[str] | None,
                  possible: list[str] | None = None) -> None:
    """Mark output heads: the names given, else the last component called that owns parameters
    or whose parameters are all tied to another's (a tied output head produces the logits).
    `possible`: the paths a head could have had (default: the components'), for the message."""
    by_name = {c.name: c for c in components}
    if heads:
        unknown = [h for h in heads if h not in by_name]
        if unknown:
            names = possible if possible is not None else list(by_name)
            close = difflib.get_close_matches(unknown[0], names, n=1, cutoff=0.6)
            hint = f"did you mean {close[0]!r}? " if close else ""
            raise ValueError(f"heads={unknown!r} are not components of the model; {hint}"
                             f"expected module paths such as {names[-3:]!r}")
        for h in heads:
            by_name[h].head = True
    else:
        called = [c for c in components if c.role == "param" and c.forward_index is not None]
        if called:
            max(called, key=lambda c: c.forward_index or 0).head = True
    for c in components:
        if c.head:
            c.role = "head"


def release_tied(components: list[Component]) -> list[Component]:
    """Tied modules that did not become heads: no longer recorded (their health rows are null)."""
    out = [c for c in components if c.tied_to is not None and not c.head]
    for c in out:
        c.released = True
    return out


def assign_parents(components: list[Component]) -> None:
    """For each activation, the parameter-owning component called just before it."""
    order = sorted((c for c in components if c.forward_index is not None),
                   key=lambda c: c.forward_index or 0)
    last_param: str | None = None
    for c in order:
        if c.role == "activation":
            c.parent_param = last_param
        else:
            last_param = c.name


def assign_param_groups(components: list[Component], param_groups: list[dict[str, object]]) -> None:
    """For each component, the first optimizer param group holding any of its parameters, and
    each parameter's index in the optimizer's order (how `state_dict()["state"]` is keyed: the
    groups' `params` lists one after another, counted from 0)."""
    group_of: dict[int, int] = {}
    index_of: dict[int, int] = {}
    for i, group in enumerate(param_groups):
        for p in group.get("params", ()):  # type: ignore[union-attr]
            group_of.setdefault(id(p), i)
            index_of.setdefault(id(p), len(index_of))
    for c in components:
        c.param_group = next((group_of[id(p)] for p in c.params if id(p) in group_of), None)
        c.optimizer_index = [index_of.get(id(p)) for p in c.params]


def note_trainable(components: list[Component]) -> None:
    """Which of each component's parameters require grad (at the first step)."""
    for c in components:
        c.requires_grad = [p.requires_grad for p in c.params]


def component_rows(components: list[Component]) -> dict[str, list[object]]:
    """The `components` table, column by column."""
    return {
        "component": [c.name for c in components],
        "kind": [type(c.module).__name__ for c in components],
        "forward_index": [c.forward_index for c in components],
        "param_count": [c.param_count for c in components],
        "role": [c.role for c in components],
        "bound": [c.bound for c in components],
        "parent_param": [c.parent_param for c in components],
        "param_group": [c.param_group for c in components],
        "param_names": [c.param_names or None for c in components],
        "optimizer_index": [c.optimizer_index if c.params and c.optimizer_index else None for c in components],
        "requires_grad": [c.requires_grad or None for c in components],
        "tied_to": [c.tied_to for c in components],
    }
