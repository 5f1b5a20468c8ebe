"""The forensic engine: classify, localise and recommend a rollback from a health trace.

Names are resolved on first use (PEP 562): `from warninglight.forensics.conditions import ...`
(what `warninglight conditions` and `--help` need) loads neither DuckDB nor Polars.
"""

from __future__ import annotations

import sys
import types
from importlib import import_module
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from .analysis import Analysis, analyze
    from .conditions import CONDITIONS, Config, ConfigError, load_config
    from .replay import Replay, replay
    from .rollback import CheckpointError
    from .store import (
        CorruptSegmentError,
        EmptyTraceError,
        FormatVersionError,
        NotATraceError,
        Trace,
        TraceError,
        open_trace,
    )

_WHERE = {
    "Analysis": "analysis", "analyze": "analysis",
    "CONDITIONS": "conditions", "Config": "conditions", "ConfigError": "conditions", "load_config": "conditions",
    "Replay": "replay", "replay": "replay",
    "CheckpointError": "rollback",
    "CorruptSegmentError": "store", "EmptyTraceError": "store", "FormatVersionError": "store",
    "NotATraceError": "store", "Trace": "store", "TraceError": "store", "open_trace": "store",
}
__all__ = [
    "CONDITIONS", "Analysis", "CheckpointError", "Config", "ConfigError", "CorruptSegmentError",
    "EmptyTraceError", "FormatVersionError", "NotATraceError", "Replay", "Trace", "TraceError",
    "analyze", "load_config", "open_trace", "replay",
]


def __getattr__(name: str) -> Any:
    if name in _WHERE:
        return getattr(import_module(f".{_WHERE[name]}", __name__), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


class _Package(types.ModuleType):
    """`forensics.replay` is the function, as it was with eager imports: loading the submodule of
    the same name would otherwise bind the module over it."""

    @property
    def replay(self) -> Any:
        return import_module(".replay", __name__).replay

    @replay.setter
    def replay(self, module: Any) -> None:  # the import system binding the submodule: keep the function
        pass


sys.modules[__name__].__class__ = _Package
