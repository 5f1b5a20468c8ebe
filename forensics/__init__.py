"""The forensic engine: classify, localise and recommend a rollback from a health trace.

The package is layered by the data's path, each layer importing only the ones below it:

    trace/        the files: segments, footers, the DuckDB store, checks, SQL, the lr schedule
    judging/      the conditions' registry, each component's baseline, the one classifier
                  (its compiled passes in judging/kernels/)
    comparators/  what other tools would have seen: the loss-spike rule, ZClip, fixed rules
    explaining/   onset and root, data roots, ranks, rollback, reference runs, the analysis
    presenting/   the verdict in words, tables, figures, the HTML report

Names here are resolved on first use (PEP 562): `from warninglight.forensics.judging.conditions
import ...` (what `warninglight conditions` and `--help` need) loads neither DuckDB nor Polars.
"""

from __future__ import annotations

from importlib import import_module
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from warninglight.forensics.explaining.analysis import Analysis, analyze
    from warninglight.forensics.explaining.replay import Replay, replay
    from warninglight.forensics.explaining.rollback import CheckpointError
    from warninglight.forensics.judging.conditions import (
        CONDITIONS,
        Config,
        ConfigError,
        load_config,
    )
    from warninglight.forensics.trace.errors import (
        CorruptSegmentError,
        EmptyTraceError,
        FormatVersionError,
        NotATraceError,
        TraceError,
    )
    from warninglight.forensics.trace.store import Trace, open_trace

_WHERE = {
    "Analysis": "explaining.analysis", "analyze": "explaining.analysis",
    "CONDITIONS": "judging.conditions", "Config": "judging.conditions", "ConfigError": "judging.conditions",
    "load_config": "judging.conditions",
    "Replay": "explaining.replay", "replay": "explaining.replay",
    "CheckpointError": "explaining.rollback",
    "CorruptSegmentError": "trace.errors", "EmptyTraceError": "trace.errors", "FormatVersionError": "trace.errors",
    "NotATraceError": "trace.errors", "TraceError": "trace.errors",
    "Trace": "trace.store", "open_trace": "trace.store",
}
__all__ = [
    "CONDITIONS", "Analysis", "CheckpointError", "Config", "ConfigError", "CorruptSegmentError",
    "EmptyTraceError", "FormatVersionError", "NotATraceError",
    "Replay", "Trace", "TraceError", "analyze", "load_config", "open_trace", "replay",
]


def __getattr__(name: str) -> Any:
    if name in _WHERE:
        return getattr(import_module(f".{_WHERE[name]}", __name__), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
