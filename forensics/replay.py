"""Replay: stream a trace in step order through the classifier, as a live monitor would have.

Steps arrive in chunks of `chunk` steps; each chunk is classified on a sliding window holding the
`BaselineConfig.history` steps before it (all the past any rule reads), with the same `score`,
`hits` and `alarms` the offline analysis uses. An alarm's firing step is therefore exactly the
offline alarm step; a test holds the two to it. Comparator rules (loss spike, ZClip-style) are
causal loops and are reported at the steps they fire.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import polars as pl

from .analysis import ALARM_KEYS, comparators, param_components
from .classify import alarms, hits, score
from .conditions import Config, load_config
from .localise import RootCause, locate, located_frame, root_cause
from .store import health_frame, open_trace


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


def stream(frame: pl.DataFrame, config: Config, chunk: int) -> tuple[pl.DataFrame, pl.DataFrame]:
    """(scored rows, hits) built chunk by chunk, each chunk judged on a sliding window."""
    history = config.baseline.history(config.conditions)
    steps = frame["step"].unique().sort().to_list()
    scored_parts, hit_parts = [], []
    for i in range(0, len(steps), chunk):
        first, last = steps[i], steps[min(i + chunk, len(steps)) - 1]
        window = frame.filter(pl.col("step").is_between(first - history, last))
        scored = score(window.lazy(), config).filter(pl.col("step") >= first).collect()
        scored_parts.append(scored)
        hit_parts.append(hits(scored.lazy(), config))
    return pl.concat(scored_parts, how="diagonal_relaxed"), pl.concat(hit_parts, how="diagonal_relaxed")


def replay(trace_dir: str | Path, *, config: Config | str | Path | None = None, chunk: int = 16) -> Replay:
    """When the light would have lit, live, beside the loss-spike and gradient-norm rules."""
    cfg = config if isinstance(config, Config) else load_config(config)
    trace = open_trace(trace_dir)
    try:
        frame = health_frame(trace).collect()
        components = trace.frame("components").collect()
        scored, found = stream(frame, cfg, chunk)
        located = locate(alarms(found, cfg), scored, components, cfg)
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
