"""`RecorderConfig`: every option of `watch` and `Recorder` in one object, checked when it is made.

    watch(model, opt, "runs/x", config=RecorderConfig(sample_size=32, alarms=["jsonl:a.jsonl"]))
    watch(model, opt, "runs/x", sample_size=32, alarms=["jsonl:a.jsonl"])   # the same

Keywords given beside a config override its fields (`dataclasses.replace`), so a base config can
be shared and one field changed per run. This module imports no torch: a config can be built,
checked and stored where torch is not loaded.
"""

from __future__ import annotations

import difflib
import numbers
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, fields, replace
from typing import Any, Literal

# flush cadence when live alarms are on: an alarm reaches the sinks within one flush interval
# (and a classification) of its step
LIVE_FLUSH_STEPS, LIVE_FLUSH_S = 10, 2.0
# flush cadence otherwise: a segment per this many steps or seconds, whichever comes first
FLUSH_STEPS, FLUSH_S = 100, 30.0
HOOK_MODES = ("graph", "skip", "eager")
# manifest config keys the recorder writes itself, beside the options
_RESERVED = ("significand_bits",)


@dataclass(frozen=True, kw_only=True)
class RecorderConfig:
    """How a recorder records. Every field has a default; `RecorderConfig()` is `watch`'s."""

    rank: int | None = None
    """This process's rank; None: torch.distributed's, or 0 when it is not initialised."""
    world_size: int | None = None
    """How many ranks train; None: torch.distributed's, or 1."""
    heads: tuple[str, ...] | None = None
    """Module paths of the output heads (prediction entropy and confidence); None: the last
    component called in the first step that owns parameters, or whose parameters are all tied to
    another's (an output head tied to the token embedding)."""
    sample_size: int = 16
    """Rows subsampled from each component's output per step."""
    sketch_size: int = 256
    """Coordinates per parameter in the fixed sketch the update and drift norms come from."""
    flush_every_steps: int | None = None
    """Steps per trace segment; None: 100, or 10 with live alarms (`alarms` or `on_alarm`). Each
    segment costs a fixed amount: its steps reduced on the training thread without the batching
    of 8, and its files written by the writer thread, whose CPU the training's threads share. A
    segment every step or few steps costs a small model a large share of its step."""
    flush_every_s: float | None = None
    """Seconds per trace segment at most; None: 30, or 2 with live alarms."""
    start_step: int = 0
    """Optimizer steps already done when resuming: the first step recorded is `start_step + 1`."""
    run_id: str | None = None
    """Names the run in the manifest; None: a fresh random id."""
    hooks_under_compile: Literal["graph", "skip", "eager"] = "graph"
    """Inside torch.compile'd code: "graph", the forward hooks take their sample and non-finite
    count inside the graph, which hands them over as it runs (no graph break, fullgraph=True
    works, one graph for every block of a class compiled one by one); "skip", they do
    nothing there (a warning event names it); "eager", they run outside the graph (one graph
    break per component, incompatible with fullgraph=True)."""
    replicas: bool | None = None
    """Per-rank weight checksums and local gradient norms (tracer/replicas.py); None: on when
    world_size > 1."""
    alarms: tuple[Any, ...] = ()
    """Sinks for live alarms: "jsonl:PATH", "webhook:URL" or "webhook:$ENV_VAR",
    "mlflow:TRACKING_URI", "tensorboard:LOGDIR", "wandb:offline", or objects with send(alarm)."""
    on_alarm: Callable[[dict[str, Any]], Any] | None = None
    """Called with each live alarm on the training thread, at the next step boundary."""
    alarm_config: Any = None
    """Thresholds for live alarms, as for `analyze --config`; None: the defaults."""
    full_precision: bool = False
    """Store every bit of the columns that are estimates from a subsample or a sketch; by default
    they keep the significand bits their sampling error leaves meaningful (docs/trace-format.md,
    "Precision"), which lets them compress."""
    run_config: Mapping[str, Any] = field(default_factory=dict)
    """Anything else about the run (lr schedule, dataset, ...), stored in the manifest's config
    beside the options; `watch(..., lr_schedule="cosine")` puts unknown keywords here."""

    def __post_init__(self) -> None:
        for name in ("sample_size", "sketch_size"):
            _check_int(name, getattr(self, name), 1)
        if self.flush_every_steps is not None:
            _check_int("flush_every_steps", self.flush_every_steps, 1)
        if self.flush_every_s is not None:
            value = self.flush_every_s
            if isinstance(value, bool) or not isinstance(value, numbers.Real):
                raise TypeError(f"flush_every_s must be a number of seconds, got {value!r}")
            if not value > 0:
                raise ValueError(f"flush_every_s must be > 0, got {value!r}")
        _check_int("start_step", self.start_step, 0)
        if self.rank is not None:
            _check_int("rank", self.rank, 0)
        if self.world_size is not None:
            _check_int("world_size", self.world_size, 1)
            if self.rank is not None and self.rank >= self.world_size:
                raise ValueError(f"rank must be < world_size, got rank={self.rank} with "
                                 f"world_size={self.world_size}")
        if self.hooks_under_compile not in HOOK_MODES:
            raise ValueError(f"hooks_under_compile={self.hooks_under_compile!r}; expected 'graph' "
                             "(samples taken inside the compiled graph), 'skip' (record nothing "
                             "inside torch.compile'd code) or 'eager' (graph breaks)")
        if not (self.replicas is None or isinstance(self.replicas, bool)):
            raise TypeError(f"replicas must be True, False or None, got {self.replicas!r}")
        if not isinstance(self.full_precision, bool):
            raise TypeError(f"full_precision must be True or False, got {self.full_precision!r}")
        if self.run_id is not None and not isinstance(self.run_id, str):
            raise TypeError(f"run_id must be a string, got {self.run_id!r}")
        if self.on_alarm is not None and not callable(self.on_alarm):
            raise TypeError(f"on_alarm must be callable (it is called with each alarm), got "
                            f"{type(self.on_alarm).__name__}")
        # a frozen dataclass sets its normalised fields through object.__setattr__
        object.__setattr__(self, "heads", _names("heads", self.heads))
        object.__setattr__(self, "alarms", _sinks(self.alarms))
        object.__setattr__(self, "run_config", _run_config(self.run_config))

    @property
    def live(self) -> bool:
        """Live alarms are on: sinks given, or an `on_alarm` callback."""
        return bool(self.alarms) or self.on_alarm is not None

    def flush_cadence(self) -> tuple[int, float]:
        """(steps, seconds) per segment: the fields, or the defaults for live or plain recording."""
        steps, seconds = (LIVE_FLUSH_STEPS, LIVE_FLUSH_S) if self.live else (FLUSH_STEPS, FLUSH_S)
        return (steps if self.flush_every_steps is None else self.flush_every_steps,
                seconds if self.flush_every_s is None else self.flush_every_s)


OPTIONS: tuple[str, ...] = tuple(f.name for f in fields(RecorderConfig))


def with_options(config: RecorderConfig | Mapping[str, Any] | None,
                 options: Mapping[str, Any]) -> RecorderConfig:
    """`config` (None: the defaults) with the keyword `options` over it.

    A mapping given as `config` is the run config (what `Recorder(config={...})` meant before
    there was a RecorderConfig). Keywords that are not options are a TypeError naming the
    closest option."""
    if config is None:
        base = RecorderConfig()
    elif isinstance(config, RecorderConfig):
        base = config
    elif isinstance(config, Mapping):
        base = RecorderConfig(run_config=config)
    else:
        raise TypeError(f"config must be a RecorderConfig, got {type(config).__name__}")
    unknown = [k for k in options if k not in OPTIONS]
    if unknown:
        raise TypeError(f"{unknown[0]!r} is not a recorder option{did_you_mean(unknown[0])}; "
                        f"the options are {', '.join(OPTIONS)}")
    return replace(base, **options) if options else base


def did_you_mean(key: str) -> str:
    """"; did you mean NAME=?" for an option close to `key`, else ""."""
    close = difflib.get_close_matches(key, OPTIONS, n=1, cutoff=0.8)
    return f"; did you mean {close[0]}=?" if close else ""


def _check_int(name: str, value: Any, low: int) -> None:
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise TypeError(f"{name} must be an int >= {low}, got {value!r}")
    if value < low:
        raise ValueError(f"{name} must be >= {low}, got {value}")


def _names(option: str, value: Any) -> tuple[str, ...] | None:
    """Module paths as a tuple; one string is one path."""
    if value is None:
        return None
    names = (value,) if isinstance(value, str) else tuple(value)
    bad = [n for n in names if not isinstance(n, str)]
    if bad:
        raise TypeError(f"{option} must be module paths (strings) such as 'lm_head', got {bad[0]!r}")
    return names


def _sinks(value: Any) -> tuple[Any, ...]:
    """Alarm sinks as a tuple; one string (or one object with send) is one sink."""
    if value is None:
        return ()
    if isinstance(value, str) or callable(getattr(value, "send", None)):
        return (value,)
    if not isinstance(value, (list, tuple)):
        from .alarms.base import SinkError  # here: a plain watch() loads nothing of the alarms

        raise SinkError(f"alarms must be a sink or a list of sinks, got {type(value).__name__} "
                        f"{value!r}; e.g. alarms=['jsonl:runs/x/alarms.jsonl', 'webhook:$SLACK_URL']")
    return tuple(value)


def _run_config(value: Any) -> dict[str, Any]:
    if not isinstance(value, Mapping):
        raise TypeError(f"run_config must be a mapping of names to values, got {type(value).__name__}")
    clash = [k for k in value if k in OPTIONS or k in _RESERVED]
    if clash:
        raise ValueError(f"run_config[{clash[0]!r}] would hide the recorder's own setting of that "
                         f"name in the manifest; pass it as the option {clash[0]}= instead")
    return dict(value)
