"""The smallest rollback that removes a fault, beside what a loss-curve-only operator would do.

A checkpoint recorded at step c holds the weights after c steps (tracer/schema.py), so it is
free of a fault whose onset is step o exactly when c < o. We recommend the latest such
checkpoint, the steps it throws away (last recorded step − c), and the steps (and batch ids, where
`rec.batch` recorded them) from the onset to the alarm — for bad data, to the end of the bad
window — to skip on resume. The loss-only choice
is the latest checkpoint strictly before the loss-spike alarm; it is *contaminated* when it was
saved at or after the onset (it already holds the damage).
"""

from __future__ import annotations

import glob
import re
from collections.abc import Iterable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from warninglight.forensics.trace.store import Trace

_MAX_ASSUMED = 100_000  # checkpoints listed one by one for --checkpoint-every
_STEP_IN_NAME = re.compile(r"(\d+)(?!.*\d)")  # the last number in a file name
# What a checkpoint file is called by the frameworks' conventions (torch.save, Lightning, safetensors).
_CHECKPOINT_SUFFIXES = frozenset({".pt", ".pth", ".ckpt", ".bin", ".safetensors", ".tar"})
CONVENTIONS = "checkpoints/, Trainer's checkpoint-N/, Lightning's checkpoints/*.ckpt"


class CheckpointError(ValueError):
    """Checkpoint options that cannot be used."""


@dataclass(frozen=True)
class Checkpoint:
    step: int
    path: str | None


@dataclass(frozen=True)
class LossOnlyChoice:
    """What an operator with only the loss curve would do: roll back before the loss spike."""

    alarm_step: int | None
    checkpoint_step: int | None
    contaminated: bool | None
    steps_discarded: int | None


@dataclass(frozen=True)
class Rollback:
    checkpoint_step: int | None  # None: no clean checkpoint; 0 means restart from initialisation
    checkpoint_path: str | None
    steps_discarded: int | None
    skip_step_range: list[int] | None  # [first, last] step whose batches to skip, both included
    skip_batches: list[int] | None
    loss_only: LossOnlyChoice
    checkpoint_source: str = "trace"
    note: str = ""
    checkpoints: list[int] = field(default_factory=list)
    skip_batches_by_rank: dict[str, list[int]] | None = None

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d.pop("checkpoints")
        return d


def from_trace(trace: Trace) -> list[Checkpoint]:
    """Checkpoints the run recorded with `rec.checkpoint(path)` (effective timeline)."""
    rows = trace.con.execute("SELECT DISTINCT step, path FROM checkpoints ORDER BY step").fetchall()
    return [Checkpoint(int(s), p) for s, p in rows if s is not None]


def from_glob(pattern: str) -> list[Checkpoint]:
    """Checkpoint files matching `pattern`, their step parsed from the last number in the name."""
    found = []
    for path in sorted(glob.glob(pattern)):
        m = _STEP_IN_NAME.search(Path(path).stem)
        if m:
            found.append(Checkpoint(int(m.group(1)), path))
    if not found:
        raise CheckpointError(f"--checkpoints {pattern!r} matched no file with a step number in its name "
                              "(e.g. ckpt/step-000300.pt); check the glob and quote it")
    return sorted(found, key=lambda c: c.step)


@dataclass(frozen=True)
class Found:
    """Checkpoint files found beside a trace that recorded none, and the glob that names them."""

    checkpoints: list[Checkpoint]
    pattern: str


def _numbered(paths: Iterable[Path]) -> list[Checkpoint]:
    found = [(m, p) for p in paths if (m := _STEP_IN_NAME.search(p.stem if p.is_file() else p.name))]
    return sorted((Checkpoint(int(m.group(1)), str(p)) for m, p in found), key=lambda c: c.step)


def beside(trace_root: Path) -> Found | None:
    """Checkpoints in the conventional places beside a trace (`CONVENTIONS`), in the trace's
    folder or the run folder that holds it: files with a step number in their name under
    `checkpoints/` (the demo's layout, and most scripts'), transformers Trainer's `checkpoint-N/`
    folders, Lightning's `lightning_logs/version_K/checkpoints/*.ckpt`. The first place that holds
    any is used; None where none does."""
    for base in (trace_root, trace_root.parent):
        folder = base / "checkpoints"
        if folder.is_dir():
            files = [p for p in folder.iterdir() if p.is_file() and p.suffix in _CHECKPOINT_SUFFIXES]
            if found := _numbered(files):
                return Found(found, str(folder / "*"))
        trainer = [p for p in base.glob("checkpoint-*") if p.is_dir() and p.name[len("checkpoint-"):].isdigit()]
        if found := _numbered(trainer):
            return Found(found, str(base / "checkpoint-*"))
        lightning = sorted(base.glob("lightning_logs/version_*/checkpoints/*.ckpt"))
        if found := _numbered(lightning):
            folder = lightning[-1].parent  # the latest version's, where a run was restarted
            return Found([c for c in found if Path(c.path or "").parent == folder], str(folder / "*.ckpt"))
    return None


def every(n: int, last_step: int, before: Iterable[int | None] = ()) -> list[Checkpoint]:
    """Checkpoints assumed at every `n` steps up to the last step.

    All of them for a run of at most `_MAX_ASSUMED` of them; past that only the ones a rollback can
    choose (the latest before each step in `before`, and the last), so a step number near 2**62
    costs a few divisions, not a list of 2**62 checkpoints.
    """
    if n < 1:
        raise CheckpointError(f"--checkpoint-every must be >= 1 step, got {n}")
    if last_step // n <= _MAX_ASSUMED:
        return [Checkpoint(s, None) for s in range(n, last_step + 1, n)]
    steps = {(last_step // n) * n} | {((s - 1) // n) * n for s in before if s is not None and s > n}
    return [Checkpoint(s, None) for s in sorted(steps) if 0 < s <= last_step]


def _before(checkpoints: list[Checkpoint], step: int) -> Checkpoint:
    clean = [c for c in checkpoints if c.step < step]
    return max(clean, key=lambda c: c.step) if clean else Checkpoint(0, None)


def batches_in(trace: Trace, first: int, last: int) -> list[int] | None:
    """Batch ids recorded for steps first..last, each once (a sample drawn twice in the window is
    skipped once), or None if the run did not record them."""
    rows = trace.con.execute(
        "SELECT batch_ids FROM steps WHERE step BETWEEN ? AND ? ORDER BY step", [first, last]).fetchall()
    ids = list(dict.fromkeys(int(i) for (b,) in rows if b is not None for i in b))  # each id once, in order
    return ids if ids or any(b is not None for (b,) in rows) else None


def batches_by_rank(trace: Trace, first: int, last: int) -> dict[str, list[int]] | None:
    """Each rank's batch ids for steps first..last, when several ranks recorded different ones."""
    rows = trace.con.execute(
        "SELECT rank, batch_ids FROM steps WHERE step BETWEEN ? AND ? AND batch_ids IS NOT NULL "
        "ORDER BY rank, step", [first, last]).fetchall()
    by: dict[str, list[int]] = {}
    for rank, ids in rows:
        by.setdefault(str(rank), []).extend(int(i) for i in ids)
    by = {rank: list(dict.fromkeys(ids)) for rank, ids in by.items()}
    return by if len(by) > 1 and len({tuple(v) for v in by.values()}) > 1 else None


def recommend(trace: Trace | None, checkpoints: list[Checkpoint], source: str, onset: int | None,
              alarm: int | None, loss_spike: int | None, last_step: int,
              skip_until: int | None = None, skip: bool = True) -> Rollback:
    """The rollback for a fault with `onset` raised at `alarm` (both None: nothing to roll back).

    `skip_until`: the last step of a bad-data window when it outlasts the alarm; the steps (and
    batches) to skip then run from the onset to there, not only to the alarm.
    `skip` False: a fault of the training set-up, whose batches were sound: none to skip.
    `trace` None (the live monitor, which has no DuckDB trace): skip_batches is left None.
    """
    steps = sorted(c.step for c in checkpoints)
    loss_only = _loss_only(checkpoints, onset, loss_spike, last_step)
    if onset is None or alarm is None:
        return Rollback(None, None, None, None, None, loss_only, source, "healthy: nothing to roll back", steps)
    ckpt = _before(checkpoints, onset)
    note = (f"resume from the checkpoint at step {ckpt.step}" if ckpt.step else
            "no checkpoint before the onset: restart from initialisation" if checkpoints else
            "no checkpoint was recorded (rec.checkpoint(path)) or found beside the trace "
            f"({CONVENTIONS}): restart from initialisation, or pass --checkpoints GLOB")
    if not skip:
        note += "; fix the training set-up first (the batches were sound: none to skip)"
        return Rollback(ckpt.step, ckpt.path, last_step - ckpt.step, None, None, loss_only, source,
                        note + _loss_only_note(loss_only, ckpt, onset), steps)
    last_skip = max(alarm, skip_until or alarm)
    note += f"; skip step {onset}" if onset == last_skip else f"; skip steps {onset}-{last_skip}"
    note += _loss_only_note(loss_only, ckpt, onset)
    return Rollback(ckpt.step, ckpt.path, last_step - ckpt.step, [onset, last_skip],
                    batches_in(trace, onset, last_skip) if trace is not None else None, loss_only,
                    source, note, steps,
                    batches_by_rank(trace, onset, last_skip) if trace is not None else None)


def _loss_only_note(loss_only: LossOnlyChoice, ckpt: Checkpoint, onset: int) -> str:
    """What a loss-only operator would have done, beside our checkpoint."""
    if loss_only.alarm_step is None:
        return "; the loss-spike rule never fired, so a loss-only operator would not roll back"
    if loss_only.checkpoint_step is None:
        return ""
    later = loss_only.checkpoint_step - ckpt.step
    return (f"; a loss-only operator would roll back to step {loss_only.checkpoint_step}"
            + (f", which already held the damage (saved at or after onset {onset})" if loss_only.contaminated else "")
            + (f" ({later} steps later than ours)" if later > 0 else ""))


def _loss_only(checkpoints: list[Checkpoint], onset: int | None, loss_spike: int | None,
               last_step: int) -> LossOnlyChoice:
    if loss_spike is None:
        return LossOnlyChoice(None, None, None, None)
    ckpt = _before(checkpoints, loss_spike)
    contaminated = None if onset is None else ckpt.step >= onset
    return LossOnlyChoice(loss_spike, ckpt.step, contaminated, last_step - ckpt.step)
