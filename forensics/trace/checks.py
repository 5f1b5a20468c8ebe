"""Sanity checks on a trace as read: what is wrong with it, said by name.

Two kinds of answer. A file that cannot be part of any analysis (not Parquet, a table's key column
missing, an unknown format version) is a `TraceError` whose message names the file and the fix:
the CLI prints it in one line and exits 2. Anything the analysis can go past (no manifest for a
rank, duplicate or non-positive steps, a missing metric column or table, a checkpoint file that is
not there) is a warning: one line of text that starts with what is wrong, carried in
`Trace.warnings`, printed by every command and listed in `analyze --json` under `warnings`.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Protocol

from warninglight.forensics.trace.footers import SegmentSpan, overlapping, read_files
from warninglight.tracer import schema


class Trace(Protocol):
    """What the checks read of an open trace (`store.Trace`)."""

    manifests: list[dict[str, Any]]
    spans: list[SegmentSpan]

    def one(self, sql: str) -> Any: ...

# Manifest fields that must be whole numbers (or null) for counts and step ranges to mean anything.
_MANIFEST_INTS = ("rank", "world_size")
_INCARNATION_INTS = ("incarnation", "first_step", "last_step", "steps_recorded", "dropped_steps",
                     "segments")
# Steps a run's last step may lie past the one before it, beyond twice that step, before it is
# named as implausible: a restart at a later step leaves a gap, never one this size alone.
_FAR_STEPS = 100_000
# The recorder's warnings said one by one; past this many, their number and where to read them.
_MAX_RECORDER_WARNINGS = 10
# What a reader loses when a table is missing, said to the user.
_MISSING_TABLE = {
    "steps": "loss, learning rate and the comparators (loss-spike and gradient-norm rules) are "
             "not available, and batch ids to skip are unknown",
    "components": "component roles, bounds and forward order are unknown, so rules that need a "
                  "role (activations, heads) do not run and the root is the first alarm",
    "events": "recorded checkpoints and stop reasons are unknown; pass --checkpoints or "
              "--checkpoint-every for a rollback",
}


def _is_int(v: Any) -> bool:
    return v is None or (isinstance(v, int) and not isinstance(v, bool))


def manifest_problem(manifest: Any) -> str | None:
    """What makes a parsed manifest unusable (its shape, a field that is not a number), or None."""
    if not isinstance(manifest, dict):
        return f"is a JSON {type(manifest).__name__}, not an object"
    bad = [k for k in _MANIFEST_INTS if not _is_int(manifest.get(k))]
    incarnations = manifest.get("incarnations", [])
    if not isinstance(incarnations, list) or not all(isinstance(i, dict) for i in incarnations):
        return "has `incarnations` that is not a list of objects"
    bad += [f"incarnations[{n}].{k}" for n, inc in enumerate(incarnations)
            for k in _INCARNATION_INTS if not _is_int(inc.get(k))]
    if bad:
        return f"has non-integer field(s) {', '.join(bad[:5])}"
    return None


def manifest_ranks(trace: Trace) -> set[int]:
    """Ranks that have a usable manifest."""
    return {m["rank"] for m in trace.manifests if isinstance(m.get("rank"), int)}


def data_ranks(trace: Trace) -> list[int]:
    """Ranks that recorded health or step rows, from the segments' footers, read when the trace
    was opened: no file is scanned again."""
    return sorted({s.rank for s in trace.spans if s.table in ("health", "steps") and s.rows})


def _manifest_warnings(trace: Trace) -> list[str]:
    have = manifest_ranks(trace)
    lacking = [r for r in data_ranks(trace) if r not in have]
    if not lacking:
        return []
    others = f" (manifests found only for rank {', '.join(map(str, sorted(have)))})" if have else ""
    return [f"no manifest for rank {', '.join(map(str, lacking))}{others}: dropped steps and the "
            "run's status are unknown, not 0"]


def _step_warnings(trace: Trace) -> list[str]:
    """Steps recorded twice in one incarnation, and steps below 1. Both are looked for only in the
    segments whose step ranges allow them (`footers.overlapping`, a range starting below 1), so
    opening a trace of 1e8 rows reads no rows when there are none."""
    out = []
    for table, keys in (("steps", "rank, incarnation, step"),
                        ("health", "rank, incarnation, step, component")):
        twice = overlapping(trace.spans, table)
        dup = trace.one(f"SELECT count(*), min(step) FROM (SELECT {keys} FROM {read_files(twice)} "
                        f"GROUP BY ALL HAVING count(*) > 1)") if twice else (0, None)
        if dup[0]:
            out.append(f"duplicate steps: {dup[0]} step(s) of `{table}` recorded more than once in "
                       f"the same incarnation (first: step {dup[1]}); each is analysed as many "
                       "times as it appears")
        below = [s.path for s in trace.spans if s.table == table and s.rows and (s.first is None or s.first < 1)]
        low = trace.one(f"SELECT count(*), min(step) FROM {read_files(below)} WHERE step < 1") if below else (0, None)
        if low[0]:
            out.append(f"non-positive steps: {low[0]} row(s) of `{table}` with step < 1 (lowest "
                       f"{low[1]}); steps count from 1, so these rows come from a different writer")
        far = _step_far_past(trace, table)
        if far:
            out.append(far)
    return out


def _step_far_past(trace: Trace, table: str) -> str | None:
    """A warning when a table's last step lies far past every other step it holds (a corrupted
    row): more than twice the step before it and `_FAR_STEPS` beyond. Only the file holding the
    last step is read (its two highest steps); the others' are their spans' last steps."""
    spans = sorted((s for s in trace.spans if s.table == table and s.rows and s.last is not None),
                   key=lambda s: s.last or 0)
    if not spans:
        return None
    top = trace.con.execute(f"SELECT DISTINCT step FROM {read_files([spans[-1].path])} "
                            "WHERE step IS NOT NULL ORDER BY step DESC LIMIT 2").fetchall()
    before = [int(s) for (s,) in top[1:]] + [s.last for s in spans[:-1] if s.last is not None]
    if not top or not before:
        return None
    last, prior = int(top[0][0]), max(before)
    if last <= 2 * prior + _FAR_STEPS:
        return None
    return (f"implausible step: `{table}` holds step {last}, where the step before it is {prior}; a "
            "corrupted row? It is analysed as recorded: check the file that holds it "
            f"({spans[-1].path.name})")


def _column_warnings(trace: Trace) -> list[str]:
    schemas = [s.columns for s in trace.spans if s.table == "health"]
    have = set().union(*schemas)  # the columns of `health_all`, without binding it again
    missing = [m for m in schema.HEALTH_METRICS if m not in have] if schemas else []
    if not missing:
        return []
    return [f"missing metric columns: health has no {', '.join(missing)}; the conditions that "
            "read them cannot fire"]


def _recorder_warnings(trace: Trace, has_events: bool) -> list[str]:
    """What the recorder warned of while the run trained (its `warning` events, each said once,
    at the first step it held) and what its writer could not write (the manifests' warnings);
    and a run that ended with an exception."""
    out = []
    if has_events:
        rows = trace.con.execute("SELECT detail, min(step), list(DISTINCT rank ORDER BY rank) FROM events "
                                 "WHERE kind = 'warning' AND detail IS NOT NULL GROUP BY detail "
                                 "ORDER BY min(step), detail").fetchall()
        for detail, step, ranks in rows[:_MAX_RECORDER_WARNINGS]:
            where = f" (rank {', '.join(map(str, ranks))})" if len(trace.manifests) > 1 else ""
            out.append(f"the recorder warned at step {step}{where}: {detail}")
        if len(rows) > _MAX_RECORDER_WARNINGS:
            out.append(f"the recorder warned of {len(rows) - _MAX_RECORDER_WARNINGS} more things: "
                       "query the trace's events (kind = 'warning') for them")
    for m in trace.manifests:
        for inc in m.get("incarnations", []):
            where = f"rank {m.get('rank')}, incarnation {inc.get('incarnation')}"
            out += [f"the recorder could not write everything ({where}): {w}" for w in inc.get("warnings") or []
                    if isinstance(w, str)]
            if inc.get("status") == "exception":
                out.append(f"the run ended with an exception ({where}, last step recorded "
                           f"{inc.get('last_step')}): the trace holds what was recorded before it")
    return out


def run_status(trace: Trace) -> str | None:
    """How the run's latest incarnation ended, per rank: `normal`, `exception`, `signal`, or
    `running` where it never closed (killed, or still training); None without a manifest."""
    ended = {}
    for m in trace.manifests:
        incarnations = [i for i in m.get("incarnations", []) if isinstance(i, dict)]
        if incarnations:
            last = max(incarnations, key=lambda i: i.get("incarnation") or 0)
            ended[m.get("rank")] = str(last.get("status"))
    if not ended:
        return None
    if len(set(ended.values())) == 1:
        return next(iter(ended.values()))
    return ", ".join(f"rank {r}: {s}" for r, s in sorted(ended.items(), key=lambda kv: str(kv[0])))


def trace_warnings(trace: Trace, by_table: dict[str, list[Path]]) -> list[str]:
    """Every warning about a trace that opened: manifests, tables, columns, step numbers, and
    what the recorder itself warned of."""
    out = _manifest_warnings(trace)
    out += [f"no {t} table: {why}" for t, why in _MISSING_TABLE.items() if not by_table.get(t)]
    out += _column_warnings(trace)
    out += _step_warnings(trace)
    out += _recorder_warnings(trace, bool(by_table.get("events")))
    return out


def checkpoint_warning(path: str | None, step: int | None, trace_root: Path) -> str | None:
    """A warning when the recommended checkpoint file is not where the run recorded it."""
    if not path:
        return None
    p = Path(path)
    if p.exists() or (not p.is_absolute() and (trace_root / p).exists()):
        return None
    return (f"missing checkpoint file: the rollback names {path} (step {step}), which does not "
            "exist here — find the file or pass --checkpoints with a glob of the files you have")


def is_trace_file(trace_root: Path, path: Path) -> bool:
    """True if `path` is, or lies under, one of the trace's own folders (tables, manifests, commits)."""
    own = [Path(trace_root) / d for d in (*schema.TABLES, schema.MANIFEST_DIR, schema.COMMIT_DIR)]
    target = Path(path).resolve()
    return any(target == d.resolve() or d.resolve() in target.parents for d in own)
