"""The recorder: per-component health traces written to Parquet while a model trains."""

from .recorder import Recorder, watch

__all__ = ["Recorder", "watch"]
