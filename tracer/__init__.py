"""The recorder: per-component health traces written to Parquet while a model trains.

`watch`, `Recorder` and `RecorderConfig` are resolved on first use (PEP 562), so `from
warninglight.tracer import schema` (what the engine and the CLI read) does not import torch, and
neither does `RecorderConfig`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from .config import RecorderConfig
    from .recorder import Recorder, watch

__all__ = ["Recorder", "RecorderConfig", "watch"]


def __getattr__(name: str) -> Any:
    if name == "RecorderConfig":
        from .config import RecorderConfig

        return RecorderConfig
    if name in __all__:
        from . import recorder

        return getattr(recorder, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
