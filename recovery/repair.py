"""`repair`: the latest checkpoint with only the root component's tensors taken from the clean one.

Every parameter, buffer and optimizer state of the latest checkpoint is kept except those of the
repaired components (`repairable.judge`: the root, and any other whose own weights the trace says
departed), which come from the clean checkpoint the rollback names. A component's tensors are
the state-dict keys it owns directly (`<component>.<name>`, no deeper: a child module is a
component of its own), buffers included, and any key that shares their storage (a tied weight).
Its optimizer state is found through the indices the recorder wrote (`components.optimizer_index`),
never from shapes; a trace recorded before them can repair weights only (`weights_only=True`,
the latest optimizer state kept whole). The model's keys may carry a prefix (a LightningModule's
attribute, DDP's `module.`): the one prefix that makes every component's parameters present.

The output is written in the latest checkpoint's format, never over an input.
"""

from __future__ import annotations

import glob
import math
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import polars as pl
from warninglight.forensics.explaining import rollback as rb
from warninglight.forensics.explaining.analysis import Analysis, analyze
from warninglight.forensics.explaining.repairable import judge
from warninglight.forensics.presenting.texttable import text_table
from warninglight.forensics.presenting.wording import number, steps
from warninglight.recovery import checkpoints as ck


class RepairError(ValueError):
    """Checkpoints or a trace that a repair cannot use (one line: what, the value, the fix)."""


class RepairRefused(RepairError):
    """A component repair is not sound for this fault: the whole rollback stays the answer."""


@dataclass(frozen=True)
class ComponentRepair:
    """What the repair changed in one component."""

    component: str
    condition: str  # the root's condition (the registry's ceiling is its)
    tensors: list[str]  # state-dict keys taken from the clean checkpoint
    optimizer_states: list[int]  # optimizer state indices taken from the clean checkpoint
    relative_change: float | None  # ||w_latest - w_clean|| / ||w_clean|| over its parameters
    ceiling: float  # the condition's declared correction ceiling (fraction of its own weight)


@dataclass(frozen=True)
class Repair:
    """A written repair: where from, where to, what changed, what learning was kept."""

    output: str
    format: str
    latest: str
    latest_step: int
    clean: str
    clean_step: int
    components: list[ComponentRepair]
    steps_kept: int  # latest step - clean step, for every component not repaired
    components_kept: int
    optimizer_state: bool  # optimizer state repaired too (False: weights only)
    recommended: bool  # the rehearsals measured a repair of this condition no worse than the rollback
    note: str = ""
    prefix: str = ""  # the model keys' prefix in the checkpoints
    kept: list[str] = field(default_factory=list, repr=False)  # the components whose learning was kept

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d.pop("kept")
        return d


def repair(trace: str | Path, latest: str | Path, out: str | Path, clean: str | Path | None = None, *,
           model_key: str | None = None, optimizer_key: str | None = None, weights_only: bool = False,
           checkpoints_glob: str | None = None, analysis: Analysis | None = None) -> Repair:
    """Write `out`: `latest` with the root component's tensors and optimizer state from `clean`
    (default: the rollback's checkpoint). `RepairRefused` where it is not sound, `RepairError`
    for unusable input; nothing is written then."""
    latest, out = Path(latest), Path(out)
    found = analysis if analysis is not None else analyze(trace, checkpoints_glob=checkpoints_glob)
    if found.root is None:
        raise RepairRefused(f"{trace}: the run is healthy: nothing to repair")
    clean = Path(clean) if clean is not None else _rollback_path(found)
    _check_output(out, latest, clean)
    new, old = _load(latest, model_key, optimizer_key, found), _load(clean, model_key, optimizer_key, found)
    if old.step >= new.step:  # type: ignore[operator]
        raise RepairError(f"the clean checkpoint {clean} (step {old.step}) is not older than the latest "
                          f"{latest} (step {new.step}); pass them in order: repair TRACE --from LATEST --clean CLEAN")
    root = found.root
    verdict = judge(root.scope, root.attributed_to, root.condition, root.onset_step, found.alarms,
                    found.components, old.step, new.step)
    if not verdict.sound:
        raise RepairRefused(f"no component repair: {verdict.reason}; {found.rollback.note or 'roll back the whole run'}")
    comps = _components(found.components)
    prefix = _prefix(new.model, comps, latest)
    _same_model(new.model, old.model, latest, clean)
    if not weights_only:
        _require_optimizer(new, old, comps)
    model = dict(new.model)
    optimizer = _copy_optimizer(new.optimizer) if new.optimizer is not None else None
    changes = []
    for name in verdict.components:
        keys = _tensors_of(new.model, prefix, name)
        for k in keys:
            model[k] = old.model[k]
        indices = [] if weights_only else [i for i in comps[name][1] if i is not None]
        if optimizer is not None and old.optimizer is not None:
            for i in indices:
                _put_state(optimizer, old.optimizer, i)
        params = [prefix + n for n in comps[name][0]] or keys
        changes.append(ComponentRepair(name, root.condition, keys, indices,
                                       _relative_change(new.model, old.model, params),
                                       found.config.condition(root.condition).ceiling))
    ck.save(new, model, optimizer, out)
    kept = [c for c in comps if c not in verdict.components]
    note = "" if not weights_only else "weights only: the latest optimizer state is kept whole"
    return Repair(str(out), new.format, str(latest), int(new.step), str(clean), int(old.step),  # type: ignore[arg-type]
                  changes, int(new.step) - int(old.step), len(kept), not weights_only,  # type: ignore[arg-type]
                  verdict.recommended, note, prefix, kept)


def _rollback_path(found: Analysis) -> Path:
    rollback = found.rollback
    if rollback.checkpoint_path is None:
        why = ("no checkpoint before the onset: the clean state is the initialisation"
               if rollback.checkpoint_step == 0 else "the trace names no checkpoint file")
        raise RepairError(f"{why}; pass the clean checkpoint with --clean PATH")
    return Path(rollback.checkpoint_path)


def _check_output(out: Path, *inputs: Path) -> None:
    for given in inputs:
        if out.resolve() == given.resolve() or given.resolve() in out.resolve().parents:
            raise RepairError(f"-o {out} is an input ({given}); the repair never writes over one: choose a new path")
    if out.exists():
        raise RepairError(f"-o {out} already exists; the repair writes a new checkpoint: choose a new path")
    if not out.parent.is_dir():
        raise RepairError(f"-o {out}: no folder {out.parent}; create it first")


def _load(path: Path, model_key: str | None, optimizer_key: str | None, found: Analysis) -> ck.Checkpoint:
    """A checkpoint, its step from its contents, else the trace's record of it, else its name."""
    try:
        got = ck.load(path, model_key, optimizer_key)
    except ck.CheckpointFormatError as exc:
        raise RepairError(str(exc)) from None
    if got.step is not None:
        return got
    same = [c for c in _recorded(found) if c.path and Path(c.path).resolve() == path.resolve()]
    if same:
        return ck.with_step(got, same[0].step)
    try:
        return ck.with_step(got, rb.from_glob(glob.escape(str(path)))[0].step)
    except rb.CheckpointError:
        raise RepairError(f"{path}: no step in the checkpoint, in the trace's checkpoint records or in its "
                          "name; name it with its step, e.g. step-000300.pt") from None


def _recorded(found: Analysis) -> list[rb.Checkpoint]:
    from warninglight.forensics.trace.store import open_trace

    trace = open_trace(found.trace_dir)
    try:
        return rb.from_trace(trace)
    finally:
        trace.close()


def _components(frame: pl.DataFrame) -> dict[str, tuple[list[str], list[int | None]]]:
    """component -> (its parameters' names, their optimizer indices) for every parameter owner."""
    owners = frame.filter(pl.col("param_count") > 0).unique("component", keep="first", maintain_order=True)
    names = owners["param_names"].to_list() if "param_names" in owners.columns else [None] * len(owners)
    index = owners["optimizer_index"].to_list() if "optimizer_index" in owners.columns else [None] * len(owners)
    return {c: (n or [], i or []) for c, n, i in zip(owners["component"].to_list(), names, index, strict=True)}


def _own(keys: Any, prefix: str, component: str) -> list[str]:
    """The keys a module owns directly: `<prefix><component>.<name>` with no dot in the name."""
    head = prefix + (f"{component}." if component else "")
    return [k for k in keys if k.startswith(head) and "." not in k[len(head):]]


def _prefix(model: dict[str, Any], comps: dict[str, tuple[list[str], list[int | None]]], path: Path) -> str:
    """The one key prefix under which every component owns keys (and every recorded name is present)."""
    if not comps:
        raise RepairError("the trace records no parameter-owning component")
    first, (names, _) = next(iter(comps.items()))
    tail = names[0] if names else None  # the first parameter's full name, else its module's path
    candidates = {k[:pos] for k in model for pos in _boundaries(k)
                  if (k[pos:] == tail if tail else
                      k[pos:].startswith(f"{first}.") and "." not in k[pos + len(first) + 1:])}

    def fits(prefix: str) -> bool:
        return (prefix == "" or prefix.endswith(".")) and all(
            _own(model, prefix, c) and all(prefix + n in model for n in ns) for c, (ns, _) in comps.items())

    fit = sorted(p for p in candidates if fits(p))
    if len(fit) != 1:
        example = tail or f"{first}.weight"
        raise RepairError(f"{path} does not hold this trace's model: "
                          + (f"no key prefix makes every component's parameters present (e.g. {example!r})"
                             if not fit else f"several key prefixes fit ({', '.join(map(repr, fit))})"))
    return fit[0]


def _boundaries(key: str) -> list[int]:
    """Where a module path can start in a key: its start and just after each dot."""
    return [0, *(i + 1 for i, ch in enumerate(key) if ch == ".")]


def _same_model(new: dict[str, Any], old: dict[str, Any], latest: Path, clean: Path) -> None:
    if set(new) != set(old):
        odd = sorted(set(new) ^ set(old))
        raise RepairError(f"{latest} and {clean} hold different models: {len(odd)} keys in one only (e.g. {odd[0]!r})")
    for k, v in new.items():
        if tuple(v.shape) != tuple(old[k].shape):
            raise RepairError(f"{latest} and {clean} hold different models: {k!r} is {tuple(v.shape)} "
                              f"in one and {tuple(old[k].shape)} in the other")


def _require_optimizer(new: ck.Checkpoint, old: ck.Checkpoint,
                       comps: dict[str, tuple[list[str], list[int | None]]]) -> None:
    for got in (new, old):
        if got.optimizer is None:
            raise RepairError(f"{got.path} holds no optimizer state; repair the weights only with "
                              "--weights-only (the latest optimizer state, if any, kept whole)")
    if not any(i for _, i in comps.values()):
        raise RepairError("the trace predates the recorder's optimizer order (components.optimizer_index), so "
                          "optimizer state cannot be matched to parameters; repair the weights only with --weights-only")
    sizes = [[len(g["params"]) for g in got.optimizer["param_groups"]] for got in (new, old)]  # type: ignore[index]
    if sizes[0] != sizes[1]:
        raise RepairError(f"{new.path} and {old.path} hold different optimizers: param groups of {sizes[0]} "
                          f"and {sizes[1]} parameters")
    held = sum(sizes[0])
    recorded = [i for _, idx in comps.values() for i in idx if i is not None]
    if recorded and max(recorded) >= held:
        raise RepairError(f"{new.path}'s optimizer holds {held} parameters, the trace recorded index "
                          f"{max(recorded)}: not the optimizer the trace watched")


def _copy_optimizer(opt: dict[str, Any]) -> dict[str, Any]:
    return {**opt, "state": dict(opt["state"])}


def _put_state(into: dict[str, Any], clean: dict[str, Any], index: int) -> None:
    """Index `index`'s state as the clean checkpoint had it (absent there: absent here)."""
    if index in clean["state"]:
        into["state"][index] = clean["state"][index]
    else:
        into["state"].pop(index, None)


def _tensors_of(model: dict[str, Any], prefix: str, component: str) -> list[str]:
    """The component's own keys and every key that shares storage with one of them (a tied weight)."""
    own = _own(model, prefix, component)
    same = {(model[k].data_ptr(), tuple(model[k].shape)) for k in own if model[k].numel()}
    tied = [k for k, v in model.items() if k not in own and v.numel() and (v.data_ptr(), tuple(v.shape)) in same]
    return own + tied


def _relative_change(new: dict[str, Any], old: dict[str, Any], keys: list[str]) -> float | None:
    diff = sum(float((new[k].double() - old[k].double()).pow(2).sum()) for k in keys if new[k].is_floating_point())
    base = sum(float(old[k].double().pow(2).sum()) for k in keys if old[k].is_floating_point())
    return math.sqrt(diff / base) if base > 0 else None


def repair_lines(r: Repair) -> list[str]:
    """What `warninglight repair` changed, per component, and what it kept."""
    lines = [f"repaired: {r.output} ({r.format}) = {r.latest} (step {r.latest_step}) with "
             f"{', '.join(c.component for c in r.components)} from {r.clean} (step {r.clean_step})"]
    rows = [{"component": c.component, "tensors": len(c.tensors), "optimizer_states": len(c.optimizer_states),
             "relative_change": number(c.relative_change), "ceiling": number(c.ceiling), "condition": c.condition}
            for c in r.components]
    lines += ["  " + line for line in text_table(rows, list(rows[0])).splitlines()] if rows else []
    lines.append(f"kept: {steps(r.steps_kept)} of learning (step {r.latest_step} - step {r.clean_step}) "
                 f"in each of {r.components_kept} other components")
    if not r.recommended:
        lines.append("note: the rehearsals did not measure this condition's repair no worse than the full rollback")
    return lines + ([f"note: {r.note}"] if r.note else [])
