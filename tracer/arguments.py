"""`watch()`'s and `Recorder`'s positional arguments checked before anything is hooked or written.

Each check raises one `TypeError` or `ValueError` naming the argument, what it got and what it
expects, so a swapped model and optimizer, or a path where the model goes, is said in words and
not as an `AttributeError` from deep inside the recorder.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import torch
from torch import nn

CALL = "watch(model, optimizer, 'runs/exp1')"


def _got(value: Any) -> str:
    """How a value is named in a message: a string or path by its text, anything else by its type."""
    if isinstance(value, (str, os.PathLike)):
        return f"{type(value).__name__} {os.fspath(value)!r}"
    if value is None or isinstance(value, (bool, int, float)):
        return repr(value)
    name = type(value).__name__
    return f"{'an' if name[0] in 'AEIOUaeiou' else 'a'} {name}"


def looks_like_optimizer(value: Any) -> bool:
    """A torch optimizer, or a wrapper holding one (accelerate, Lightning): param_groups and step."""
    return isinstance(value, torch.optim.Optimizer) or (
        hasattr(value, "param_groups") and callable(getattr(value, "step", None)))


def check_model(model: Any) -> None:
    """`model` is the nn.Module to record."""
    if isinstance(model, nn.Module):
        return
    if looks_like_optimizer(model):
        raise TypeError(f"watch(model=...) got {_got(model)}, which looks like the optimizer: "
                        f"pass the model first, {CALL}")
    raise TypeError(f"watch(model=...) expects the torch.nn.Module to record, got {_got(model)}; "
                    f"call {CALL}")


def check_optimizer(optimizer: Any) -> None:
    """`optimizer` is None or optimizer-like (a wrapper is unwrapped later, by the recorder)."""
    if optimizer is None or looks_like_optimizer(optimizer):
        return
    if isinstance(optimizer, nn.Module):
        raise TypeError(f"watch(optimizer=...) got {_got(optimizer)}, which looks like the model: "
                        f"the model and the optimizer are swapped; call {CALL}")
    if hasattr(optimizer, "optimizer") or hasattr(optimizer, "_optimizer"):
        return  # a framework's wrapper: the recorder unwraps it, or records without it and warns
    raise TypeError(f"watch(optimizer=...) expects a torch.optim.Optimizer (or None, then steps end "
                    f"on rec.step()), got {_got(optimizer)}; call {CALL}")


def check_path(path: Any) -> None:
    """`path` names a trace directory: a str or os.PathLike that is not an existing file."""
    if not isinstance(path, (str, os.PathLike)) or isinstance(path, bytes):
        raise TypeError(f"watch(path=...) expects the trace directory as a str or os.PathLike, got "
                        f"{_got(path)}; call {CALL}")
    text = os.fspath(path)
    if not isinstance(text, str) or not text:
        raise TypeError(f"watch(path=...) expects the trace directory as a non-empty str, got "
                        f"{text!r}; call {CALL}")
    if Path(text).is_file():
        raise ValueError(f"watch(path={text!r}): that is an existing file, and a trace is a "
                         "directory; give a new or existing directory, e.g. 'runs/exp1'")


def check_arguments(model: Any, optimizer: Any, path: Any) -> None:
    """All three, the model first: a swapped pair is named by what the model slot holds."""
    check_model(model)
    check_optimizer(optimizer)
    check_path(path)


__all__ = ["CALL", "check_arguments", "check_model", "check_optimizer", "check_path",
           "looks_like_optimizer"]
