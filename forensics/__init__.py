"""The forensic engine: classify, localise and recommend a rollback from a health trace."""

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

__all__ = [
    "CONDITIONS", "Analysis", "CheckpointError", "Config", "ConfigError", "CorruptSegmentError",
    "EmptyTraceError", "FormatVersionError", "NotATraceError", "Replay", "Trace", "TraceError",
    "analyze", "load_config", "open_trace", "replay",
]
