"""The registry of the eight conditions: signal, trigger rules, thresholds, persistence, ceiling.

This is the one place a condition is defined. The classifier turns each `Rule` into a Polars
expression over the baseline columns (`baseline.py`); docs/conditions.md and `warninglight
conditions` are generated from here. Thresholds can be overridden from a TOML file::

    [baseline]
    window = 64

    [exploding]
    persistence = 3

    [exploding.out_rms]        # a rule, named by its metric
    z = 10.0
    fold = 4.0

or from `--set exploding.out_rms.z=10` on the command line.

A rule compares a component's metric with its own trailing baseline (median `med`, robust scale
`scale`, z = (value - med) / scale). Direction `up`: value above; `down`: below; `either`: both;
`nonfinite`: a non-finite count > 0 or a NaN/Inf value, which alarms at once with no baseline.
A rule fires at a step when every threshold it sets holds; a condition alarms when one of its
rules has fired on `persistence` consecutive steps.
"""

from __future__ import annotations

import math
import tomllib
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

UP, DOWN, EITHER, NONFINITE = "up", "down", "either", "nonfinite"


class ConfigError(ValueError):
    """A threshold file or override names something unknown or holds a bad value."""


# Largest step count a setting may take (window, lag, persistence...): far beyond any useful
# baseline, and small enough that the rolling windows it sizes stay within memory.
MAX_STEPS = 100_000


@dataclass(frozen=True)
class Rule:
    """One trigger of a condition on one health metric; unset thresholds are not checked."""

    metric: str
    direction: str
    z: float | None = None        # |robust z| at least this
    fold: float | None = None     # value/med >= fold (up) or <= 1/fold (down)
    delta: float | None = None    # |value - med| at least this, in the metric's units
    level: float | None = None    # value >= level (up) or <= level (down)
    peers_fold: float | None = None  # the median component's value/med at least this (others still move)
    roles: tuple[str, ...] = ()   # component roles it applies to; () = all
    persistence: int | None = None  # overrides the condition's

    def __post_init__(self) -> None:
        if self.direction not in (UP, DOWN, EITHER, NONFINITE):
            raise ConfigError(f"rule on {self.metric}: direction must be up, down, either or nonfinite, got {self.direction!r}")
        for name in ("z", "fold", "delta", "peers_fold"):
            value = getattr(self, name)
            if value is not None and value < 0:
                raise ConfigError(f"{self.metric}.{name} must be >= 0, got {value}")
        if self.fold is not None and self.fold < 1:
            raise ConfigError(f"{self.metric}.fold must be >= 1 (a factor of change), got {self.fold}")
        if self.persistence is not None and self.persistence < 1:
            raise ConfigError(f"{self.metric}.persistence must be >= 1 step, got {self.persistence}")


@dataclass(frozen=True)
class Condition:
    """A named condition: what it means, the signal it reads, its rules and declared ceiling."""

    name: str
    meaning: str
    signal: str
    rules: tuple[Rule, ...]
    persistence: int
    ceiling: float  # correction ceiling: fraction of the component's own weight (shown, never applied)
    precedence: int  # lower wins when one component shows several conditions at once

    def persistence_of(self, rule: Rule) -> int:
        """Consecutive steps `rule` must hold before this condition alarms."""
        return rule.persistence if rule.persistence is not None else self.persistence


@dataclass(frozen=True)
class BaselineConfig:
    """The trailing robust baseline every component is compared with."""

    window: int = 64      # steps in the baseline window
    lag: int = 3          # the window ends this many steps before the step judged
    min_samples: int = 64  # no verdict until a full window of finite past values: early training moves fast
    onset_z: float = 3.0  # onset walk-back: a step departs while |z| against the alarm's baseline exceeds this
    episode_gap: int = 10  # hits further apart than this start a new alarm

    def __post_init__(self) -> None:
        for name in ("window", "min_samples", "episode_gap"):
            if getattr(self, name) < 1:
                raise ConfigError(f"baseline.{name} must be >= 1, got {getattr(self, name)}")
        if self.lag < 0:
            raise ConfigError(f"baseline.lag must be >= 0 steps, got {self.lag}")
        for name in ("window", "lag", "min_samples", "episode_gap"):
            if getattr(self, name) > MAX_STEPS:
                raise ConfigError(f"baseline.{name} must be at most {MAX_STEPS} steps, got {getattr(self, name)}")
        if self.min_samples > self.window:
            raise ConfigError(f"baseline.min_samples ({self.min_samples}) must not exceed baseline.window ({self.window})")

    def history(self, conditions: tuple[Condition, ...]) -> int:
        """Past steps a live classifier must keep to judge a step exactly as the offline one does."""
        longest = max(c.persistence_of(r) for c in conditions for r in c.rules)
        return self.window + self.lag + longest + 1


CONDITIONS: tuple[Condition, ...] = (
    Condition("exploding", "norms blow up, or non-finite values appear",
              "non-finite counts; output, gradient, weight and update norms far above baseline; the learning rate surging past its history",
              (Rule("out_nonfinite_count", NONFINITE, persistence=1),
               Rule("grad_nonfinite_count", NONFINITE, persistence=1),
               Rule("grad_norm_l2", NONFINITE, persistence=1),
               Rule("weight_norm_l2", NONFINITE, persistence=1),
               Rule("out_rms", UP, z=6.0, fold=3.0),
               Rule("out_absmax", UP, z=6.0, fold=4.0),
               Rule("grad_norm_l2", UP, z=6.0, fold=5.0),
               Rule("weight_norm_l2", UP, fold=2.5),  # no z: weight norms move slowly, a creep has no spread
               Rule("update_norm_l2", UP, z=6.0, fold=10.0),
               # The lr itself: a one-step rise of at least this factor to above every lr the run
               # had set (`lr_surge`, 1 otherwise). Warmup rises by small steps, a restart returns
               # to a level already set; a spike does neither, and its updates explode at once.
               Rule("lr_surge", UP, fold=3.0, persistence=1)),
              persistence=2, ceiling=0.5, precedence=7),
    Condition("dead", "the component stopped responding",
              "dead-unit fraction up, output rms collapsing towards 0",
              (Rule("out_dead_frac", UP, delta=0.3, level=0.5),
               Rule("out_rms", DOWN, z=6.0, fold=20.0, roles=("param", "activation"))),
              persistence=3, ceiling=0.1, precedence=2),
    Condition("saturated", "outputs pinned at their bounds",
              "saturated fraction of a bounded activation up",
              (Rule("out_sat_frac", UP, delta=0.25, level=0.4),),
              persistence=3, ceiling=0.2, precedence=3),
    Condition("losing_confidence", "predictions flatten",
              "head entropy up, max probability down",
              # Entropy is bounded by ln(classes): near uniform its z stays small, so the
              # absolute rise (nats) carries the decision.
              (Rule("pred_entropy_nats", UP, z=2.0, delta=0.25, roles=("head",)),
               Rule("pred_maxprob", DOWN, z=3.0, delta=0.1, roles=("head",))),
              persistence=5, ceiling=0.2, precedence=4),
    Condition("oscillating", "updates flip back and forth",
              "update cosine to the previous update persistently negative",
              (Rule("update_cos", DOWN, level=-0.5, delta=0.4),),
              persistence=4, ceiling=0.3, precedence=5),
    Condition("stagnant", "stopped learning while others learn",
              "update norm (so the update ratio) collapses while the median component's does not; "
              "or its gradients are never applied (no optimizer param group holds it: lr NaN)",
              (Rule("update_norm_l2", DOWN, z=6.0, fold=10.0, peers_fold=0.5),
               Rule("lr", NONFINITE, persistence=1)),
              persistence=5, ceiling=0.05, precedence=6),
    Condition("losing_gradient", "gradient vanishes",
              "gradient norm far below its baseline",
              (Rule("grad_norm_l2", DOWN, z=6.0, fold=10.0),),
              persistence=3, ceiling=0.05, precedence=8),
    Condition("unclassified", "departs its baseline in no named way",
              "any of output mean/rms/zero fraction, gradient, weight or update norm far off baseline",
              (Rule("out_mean", EITHER, z=12.0, delta=0.1),
               Rule("out_rms", EITHER, z=12.0, fold=1.5),
               Rule("out_zero_frac", EITHER, z=12.0, delta=0.2),
               Rule("grad_norm_l2", EITHER, z=12.0, fold=3.0),
               Rule("weight_norm_l2", EITHER, z=12.0, fold=1.2),
               Rule("update_ratio", EITHER, z=12.0, fold=3.0)),
              persistence=5, ceiling=0.1, precedence=9),
)
UNCLASSIFIED = "unclassified"


@dataclass(frozen=True)
class Config:
    """Baseline settings and the conditions with their (possibly overridden) thresholds."""

    baseline: BaselineConfig = field(default_factory=BaselineConfig)
    conditions: tuple[Condition, ...] = CONDITIONS

    def condition(self, name: str) -> Condition:
        for c in self.conditions:
            if c.name == name:
                return c
        raise ConfigError(f"unknown condition {name!r}; expected one of {', '.join(c.name for c in self.conditions)}")


def _coerce(key: str, value: Any, current: Any) -> Any:
    want = int if isinstance(current, int) and not isinstance(current, bool) else float
    if isinstance(value, str):
        try:
            value = float(value)
        except ValueError as exc:
            raise ConfigError(f"{key} must be a number, got {value!r}") from exc
    if not isinstance(value, int | float) or isinstance(value, bool):
        raise ConfigError(f"{key} must be a number, got {value!r}")
    try:
        finite = math.isfinite(value)
    except OverflowError:  # an int beyond any float
        finite = False
    if not finite:  # a NaN threshold compares false: it would disable the rule
        raise ConfigError(f"{key} must be a finite number, got {value!r}")
    if want is int and not float(value).is_integer():  # int(1.7) would silently become 1
        raise ConfigError(f"{key} must be a whole number, got {value!r}")
    if want is int and not 0 <= value <= MAX_STEPS:
        raise ConfigError(f"{key} must be between 0 and {MAX_STEPS} steps, got {value!r}")
    return want(value)


def _apply_rule(cond: Condition, metric: str, values: dict[str, Any]) -> Condition:
    known = [r for r in cond.rules if r.metric == metric]
    if not known:
        raise ConfigError(f"condition {cond.name} has no rule on {metric!r}; its rules read "
                          f"{', '.join(sorted({r.metric for r in cond.rules}))}")
    # a metric with a threshold rule beside its non-finite one (exploding.grad_norm_l2): the
    # override is for the threshold; a NaN must still alarm at once
    targets = {id(r) for r in ([r for r in known if r.direction != NONFINITE] or known)}
    rules = []
    for r in cond.rules:
        if id(r) in targets:
            for k, v in values.items():
                if k not in ("z", "fold", "delta", "level", "peers_fold", "persistence"):
                    raise ConfigError(f"{cond.name}.{metric}.{k} is not a threshold; use z, fold, delta, level, peers_fold or persistence")
                r = replace(r, **{k: _coerce(f"{cond.name}.{metric}.{k}", v, 1.0 if k != "persistence" else 1)})
        rules.append(r)
    return replace(cond, rules=tuple(rules))


def _apply_condition(cond: Condition, table: dict[str, Any]) -> Condition:
    for key, value in table.items():
        if isinstance(value, dict):
            cond = _apply_rule(cond, key, value)
        elif key in ("persistence", "ceiling"):
            cond = replace(cond, **{key: _coerce(f"{cond.name}.{key}", value, getattr(cond, key))})
        else:
            raise ConfigError(f"{cond.name}.{key} is not a setting; use persistence, ceiling or a rule table like [{cond.name}.<metric>]")
    if cond.persistence < 1:
        raise ConfigError(f"{cond.name}.persistence must be >= 1 step, got {cond.persistence}")
    return cond


def apply(config: Config, table: dict[str, Any]) -> Config:
    """A config with the settings of a parsed TOML table applied."""
    baseline = config.baseline
    conditions = {c.name: c for c in config.conditions}
    for key, value in table.items():
        if key == "baseline":  # all at once: window and min_samples are checked together
            if not isinstance(value, dict):
                raise ConfigError(f"baseline must be a table like [baseline] window = 64, got {value!r}")
            for k in value:
                if not hasattr(baseline, k):
                    raise ConfigError(f"baseline.{k} is not a setting; use window, lag, min_samples, onset_z or episode_gap")
            changes = {k: _coerce(f"baseline.{k}", v, getattr(baseline, k)) for k, v in value.items()}
            if "min_samples" not in changes:  # a shorter window shortens the wait for a verdict too
                changes["min_samples"] = min(baseline.min_samples, changes.get("window", baseline.window))
            baseline = replace(baseline, **changes)
        elif key in conditions and isinstance(value, dict):
            conditions[key] = _apply_condition(conditions[key], value)
        else:
            raise ConfigError(f"unknown setting [{key}]; expected [baseline] or a condition: {', '.join(conditions)}")
    return Config(baseline=baseline, conditions=tuple(conditions.values()))


def _nest(dotted: str, value: str) -> dict[str, Any]:
    table: dict[str, Any] = {}
    parts = dotted.split(".")
    node = table
    for p in parts[:-1]:
        node = node.setdefault(p, {})
    node[parts[-1]] = value
    return table


def load_config(path: str | Path | None = None, overrides: list[str] | None = None) -> Config:
    """Defaults, then a TOML file's settings, then `key=value` overrides (`exploding.out_rms.z=10`)."""
    config = Config()
    if path is not None:
        try:
            table = tomllib.loads(Path(path).read_text())
        except (OSError, tomllib.TOMLDecodeError) as exc:
            raise ConfigError(f"cannot read threshold file {path}: {exc} — pass a TOML file like docs/conditions.md shows") from exc
        config = apply(config, table)
    for item in overrides or []:
        key, sep, value = item.partition("=")
        if not sep or "." not in key:
            raise ConfigError(f"--set {item!r}: expected KEY=VALUE with a dotted key, e.g. exploding.out_rms.z=10")
        config = apply(config, _nest(key.strip(), value.strip()))
    return config


def registry_rows(config: Config | None = None) -> list[dict[str, Any]]:
    """One row per rule, for `warninglight conditions` and docs/conditions.md."""
    config = config or Config()
    rows = []
    for c in config.conditions:
        for r in c.rules:
            limits = [f"{k} {'>=' if k != 'level' or r.direction != DOWN else '<='} {getattr(r, k):g}"
                      for k in ("z", "fold", "delta", "level", "peers_fold") if getattr(r, k) is not None]
            rows.append({"condition": c.name, "meaning": c.meaning, "metric": r.metric,
                         "direction": r.direction, "thresholds": ", ".join(limits) or "any",
                         "persistence": c.persistence_of(r), "ceiling": c.ceiling,
                         "roles": ",".join(r.roles) or "all"})
    return rows


def markdown(config: Config | None = None) -> str:
    """docs/conditions.md: the registry as tables (regenerate with `python -m warninglight.forensics.judging.conditions`)."""
    config = config or Config()
    b = config.baseline
    out = ["# The conditions", "",
           "Generated from `forensics/conditions.py` (the one registry); do not edit by hand.", "",
           "Every component is compared with its own trailing baseline: median and robust scale "
           f"(IQR/1.349) of its last {b.window} values, ending {b.lag} steps before the step judged, "
           f"no verdict before {b.min_samples} past values. Norms and ratios are judged in log units. "
           "z = (value - median) / scale. A rule fires when every threshold it sets holds "
           "(`z`: |z| at least; `fold`: value/median at least, or at most 1/fold going down; `delta`: "
           "|value - median| at least; `level`: value beyond; `peers_fold`: the median component's "
           "value/median at least, i.e. the others still move). A condition alarms when a rule has "
           "held for its persistence in consecutive steps; non-finite values alarm at once.", "",
           "The correction ceiling is the largest change, as a fraction of the component's own "
           "weight, a correction for this condition should make. It is shown, never applied.", "",
           "| condition | meaning | signal | persistence | ceiling |", "|---|---|---|---|---|"]
    out += [f"| {c.name} | {c.meaning} | {c.signal} | {c.persistence} | {c.ceiling:g} |" for c in config.conditions]
    out += ["", "## Rules", "", "| condition | metric | direction | thresholds | persistence | roles |",
            "|---|---|---|---|---|---|"]
    out += [f"| {r['condition']} | `{r['metric']}` | {r['direction']} | {r['thresholds']} | {r['persistence']} | {r['roles']} |"
            for r in registry_rows(config)]
    out += ["", "## Overriding thresholds", "",
            "A TOML file (`--config FILE`) or `--set KEY=VALUE` options:", "", "```toml",
            "[baseline]", f"window = {b.window}", "", "[exploding]", "persistence = 3", "",
            "[exploding.out_rms]   # a rule, named by its metric", "z = 10.0", "fold = 4.0", "```", "",
            "`--set exploding.out_rms.z=10 --set baseline.window=128`", "",
            "Where a metric has both a non-finite rule and a threshold rule under one condition "
            "(`exploding.grad_norm_l2`), an override of that rule changes the threshold rule: "
            "non-finite values always alarm at once.", ""]
    return "\n".join(out)


if __name__ == "__main__":
    print(markdown(), end="")
