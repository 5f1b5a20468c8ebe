"""The errors a trace can raise on open: each names the file and the fix."""

from __future__ import annotations


class TraceError(Exception):
    """The path cannot be read as a trace."""


class NotATraceError(TraceError):
    """The path is not a trace directory."""


class EmptyTraceError(TraceError):
    """The trace directory holds no recorded steps."""


class CorruptSegmentError(TraceError):
    """A segment file is not readable Parquet."""


class FormatVersionError(TraceError):
    """The trace was written in a format version this reader does not know."""
