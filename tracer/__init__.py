"""The recorder: per-component health traces written to Parquet while a model trains.

`watch` and `Recorder` are resolved on first use (PEP 562), so `from warninglight.tracer import
schema` (what the engine and the CLI read) does not import torch.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from .recorder import Recorder, watch

__all__ = ["Recorder", "watch"]


def __getattr__(name: str) -> Any:
    if name in __all__:
        from . import recorder

        return getattr(recorder, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
