"""Live alarms: the engine's classifier on each closed segment, and the sinks the alarms go to.

Imported only when `watch(..., alarms=[...])` or `on_alarm=` is used; the engine
(`warninglight.forensics`) is imported only then.
"""

from .sinks import JsonlSink, Sink, SinkError, SinkWorker, WebhookSink, sink_from_spec

__all__ = ["JsonlSink", "Sink", "SinkError", "SinkWorker", "WebhookSink", "sink_from_spec"]
