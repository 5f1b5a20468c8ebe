"""A re-run saved beside a trace (`rerun.rerun`): where it is, and what it said.

Apart from the re-run itself, so the analysis and the report read the saved verdict without
loading what re-executes a run.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

RESULT_FILE, SKIP_FILE = "rerun.json", "skip_ids.json"


def default_out(trace: str | Path) -> Path:
    """Where a trace's re-run goes: beside it, `<trace>.rerun`."""
    trace = Path(trace).resolve()
    return trace.parent / f"{trace.name}.rerun"


def load(trace: str | Path) -> dict[str, Any] | None:
    """The re-run verdict saved beside `trace` (`rerun.json`), or None where there is none."""
    path = default_out(trace) / RESULT_FILE
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def saved_lines(trace: str | Path) -> list[str]:
    """The saved re-run's verdict and skip list in words, for `analyze` and `rollback`; [] if none."""
    return lines(load(trace))


def lines(found: dict[str, Any] | None) -> list[str]:
    """A saved re-run (`load`) in words: its verdict with the reason, and the samples to skip."""
    if not found:
        return []
    lines = [f"rerun: {found['verdict']} — {found['reason']}"]
    if found.get("skip_ids_file"):
        proof = found.get("proofreader") or {}
        lines.append(f"rerun: skip {len(proof.get('skip_ids', []))} samples instead of steps "
                     f"{'-'.join(map(str, proof.get('steps', [])))}: ids in {found['skip_ids_file']}")
    return lines
