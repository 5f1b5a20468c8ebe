"""What code traced by torch.compile hands the recorder: one opaque op.

Dynamo guards on the Python objects a traced function reads. A hook that tells components apart
by a Python value (a closure per component, an index, a list that grows with each call) makes a
graph that holds for one component instance only, so a model whose blocks are compiled one by
one (`torch.compile(block)` for each block, the usual pattern for large models) compiles a graph
per block and reaches dynamo's recompile limit after a few blocks: an error under
`fullgraph=True`, otherwise the later blocks run uncompiled. The recorder's hook is therefore one
function for every component, and the component is named by a token: a one-value tensor kept on
its module (`Tokens`), a graph input rather than a constant, so one graph serves every block of a
class. The traced hook computes the sample and the non-finite count inside the graph and passes
them, with the token, to `warninglight::hand_over`; the compiled graph calls that op where the
hook ran, and the op hands copies of them to the component's probe at run time. `rec.log` and
`rec.batch` inside a graph hand their values over the same way, with a token of the recorder's:
nothing that grows with each call (micro-batches) is read in the graph.

The op declares that it writes `sink`, a tensor of its own, so that the compilers keep a call
whose result nothing reads; it writes nothing. It is tagged unsafe for CUDA graphs where torch
has the tag, so that `mode="reduce-overhead"` leaves it outside the captured graphs.
"""

from __future__ import annotations

import itertools
import sys
import weakref
from collections.abc import Callable
from typing import Any

import torch

# token's address -> (the method that takes what is handed over, its key)
_takers: dict[int, tuple[weakref.WeakMethod[Callable[..., None]], Any]] = {}
_sink = torch.zeros(1)
_serial = itertools.count(1)


def _hand_over(sink: torch.Tensor, token: torch.Tensor, what: str, values: list[torch.Tensor]) -> None:
    entry = _takers.get(token.data_ptr())
    if entry is None:  # a copy of a watched module (its token is a copy), or a closed recorder's
        return
    take = entry[0]()
    if take is not None:
        take(entry[1], what, values)


_libraries: list[Any] = []


def _define() -> Callable[..., None]:
    if not hasattr(torch.ops.warninglight, "hand_over"):
        lib = torch.library.Library("warninglight", "FRAGMENT")
        tags = (torch.Tag.cudagraph_unsafe,) if hasattr(torch.Tag, "cudagraph_unsafe") else ()
        lib.define("hand_over(Tensor(a!) sink, Tensor token, str what, Tensor[] values) -> ()", tags=tags)
        lib.impl("hand_over", _hand_over, "CompositeExplicitAutograd")
        fake = getattr(torch.library, "register_fake", None) or torch.library.impl_abstract
        fake("warninglight::hand_over", lambda sink, token, what, values: None, lib=lib)
        _libraries.append(lib)  # the registration lasts as long as the library object
    return torch.ops.warninglight.hand_over


_op = _define()


def hand_over(token: torch.Tensor, what: str, values: list[torch.Tensor]) -> None:
    """Inside traced code: hand `values` (and `what`, a constant) to `token`'s taker."""
    _op(_sink, token, what, values)


class Tokens:
    """Tokens whose values go to `take(key, what, values)` (a bound method, held weakly, that
    copies what it keeps: the graph may reuse the values' memory once the op has run): free
    ones (`new`), and ones kept on modules (`give`). Each set of tokens kept on modules has an
    attribute name of its own, so two recorders watching one module keep theirs apart."""

    def __init__(self, take: Callable[[Any, str, list[torch.Tensor]], None]) -> None:
        self.attr = f"_warninglight_token_{next(_serial)}"  # (token, channel-first layout)
        self._take = weakref.WeakMethod(take)

    def new(self, key: Any) -> torch.Tensor:
        token = torch.zeros(1)
        _takers[token.data_ptr()] = (self._take, key)
        return token

    @staticmethod
    def forget(token: torch.Tensor) -> None:
        """What `token` hands over from now on goes nowhere."""
        _takers.pop(token.data_ptr(), None)

    def give(self, module: torch.nn.Module, key: Any, channel_first: bool) -> None:
        """A token for component `key`, kept on its module with its output's layout."""
        module.__dict__[self.attr] = (self.new(key), channel_first)

    def of(self, module: torch.nn.Module) -> tuple[torch.Tensor, bool] | None:
        """Inside a traced hook: `module`'s token and whether its output is channel-first (None:
        it has none)."""
        return getattr(module, self.attr, None)

    def take_back(self, module: torch.nn.Module) -> None:
        entry = module.__dict__.pop(self.attr, None)
        if entry is not None:
            self.forget(entry[0])


def guard_module_hooks() -> None:
    """Make dynamo guard on module hooks (`torch._dynamo.config.skip_nnmodule_hook_guards` off)
    on the calling thread: by default a graph traced for a module without the recorder's hooks
    (an unwatched instance of the model's class, an EMA copy, or the model compiled and run
    before `watch()`) is run for one with them, and no hook fires. Dynamo's settings are per
    thread, so the recorder calls this where it is made and at each step's end (the training
    thread), and leaves the guard on when it closes (a graph compiled without it in between
    would shadow the next recorder's hooks). Nothing until the process has imported dynamo
    (importing it takes about a second)."""
    config = getattr(sys.modules.get("torch._dynamo"), "config", None)
    if config is not None and getattr(config, "skip_nnmodule_hook_guards", False):
        config.skip_nnmodule_hook_guards = False
