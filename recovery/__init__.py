"""After the alarm: re-execute the incident (`rerun`, with the Proofreader) and repair a
checkpoint's root component (`repair`).

Unlike the engine, these run the user's model: they load checkpoints and train, so they import
torch, the recorder and the engine. Nothing in `tracer` or `forensics` imports this package; the
CLI imports it only in the commands that run a model.
"""

from __future__ import annotations

from importlib import import_module
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from warninglight.recovery.repair import Repair, RepairError, RepairRefused, repair
    from warninglight.recovery.rerun import Rerun, RerunError, rerun

_WHERE = {"Repair": "repair", "RepairError": "repair", "RepairRefused": "repair", "repair": "repair",
          "Rerun": "rerun", "RerunError": "rerun", "rerun": "rerun"}
__all__ = ["Repair", "RepairError", "RepairRefused", "Rerun", "RerunError", "repair", "rerun"]


def __getattr__(name: str) -> Any:
    if name in _WHERE:
        return getattr(import_module(f".{_WHERE[name]}", __name__), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
