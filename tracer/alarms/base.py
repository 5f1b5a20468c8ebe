"""What every alarm sink is and raises: the protocol and the error, below the sinks themselves."""

from __future__ import annotations

from typing import Any, Protocol, runtime_checkable


class SinkError(ValueError):
    """A sink named in `watch(..., alarms=[...])` that cannot be used."""


@runtime_checkable
class Sink(Protocol):
    """Receives one alarm (a JSON-ready dict) per call; may block or raise."""

    def send(self, alarm: dict[str, Any]) -> None: ...
