"""Replay: stream a trace in step order through the classifier, as a live monitor would have.

Steps arrive in chunks of `chunk` steps and go, in one pass, through the same incremental
`stream.Classifier` the offline analysis drives: each chunk is judged with the rows it carried
from the `BaselineConfig.history` steps before it (all the past any rule reads). An alarm's
firing step is therefore exactly the offline alarm step, whatever the chunk; a test holds the two
to it. Comparator rules (loss spike, ZClip-style) are causal loops and are reported at the steps
they fire.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import polars as pl
from warninglight.forensics.explaining.analysis import (
    ALARM_KEYS,
    classify_trace,
    comparators,
    judged_steps,
    locate_alarms,
    param_components,
)
from warninglight.forensics.explaining.localise import RootCause, located_frame, root_cause
from warninglight.forensics.judging.conditions import Config, load_config
from warninglight.forensics.trace.store import open_trace


@dataclass(frozen=True)
class Event:
    """One line of the timeline: the light (an alarm) or a comparator firing."""

    step: int
    source: str  # "light" | "loss_spike" | "grad_norm_spike"
    observed_on: str | None = None  # the component whose metric alarmed
    condition: str | None = None
    onset_step: int | None = None
    magnitude: float | None = None
    metric: str | None = None


@dataclass
class Replay:
    """The timeline, and the alarms as the live classifier raised them."""

    events: list[Event]
    alarms: pl.DataFrame
    root: RootCause | None
    detectors: dict[str, Any] = field(default_factory=dict)
    warnings: list[str] = field(default_factory=list)  # problems of the trace the replay went past

    def to_dict(self) -> dict[str, Any]:
        return {"events": [e.__dict__ for e in self.events], "detectors": self.detectors,
                "warnings": self.warnings,
                "root": None if self.root is None else
                {k: getattr(self.root.alarm, k) for k in ("attributed_to", "condition", "onset_step", "step")}}


def replay(trace_dir: str | Path, *, config: Config | str | Path | None = None,
           chunk: int | None = None, steps: tuple[int, int] | None = None) -> Replay:
    """When the light would have lit, live, beside the loss-spike and gradient-norm rules.

    `chunk`: steps per feed (default: as many as `analyze` judges at once); it changes the cost,
    never the alarms. `steps` = (A, B): only that window is judged (see `analysis.analyze`).
    """
    cfg = config if isinstance(config, Config) else load_config(config)
    trace = open_trace(trace_dir)
    try:
        components = trace.frame("components").collect()
        clf = classify_trace(trace, cfg, components, chunk_steps=chunk, steps=steps)
        located = locate_alarms(trace, clf.alarms(), components, cfg, since=judged_steps(trace, cfg, steps)[0])
        root, _ = root_cause(located, cfg, param_components(components))
        compared = comparators(trace, root.alarm.onset_step if root else None)
    finally:
        trace.close()
    events = [Event(a.step, "light", a.observed_on, a.condition, a.onset_step, a.magnitude, a.metric)
              for a in located]
    for key, source in (("loss_spike_step", "loss_spike"), ("grad_norm_spike_step", "grad_norm_spike")):
        if compared[key] is not None:
            events.append(Event(compared[key], source))
    events.sort(key=lambda e: (e.step, e.source != "light"))
    return Replay(events, located_frame(located).select(ALARM_KEYS), root, compared, trace.warnings)
