"""Rehearsed traces shared by the forensics tests: each scenario is trained once per test session.

Real small training runs with the recorder and the drills (tracer/rehearsal.py); the traces live
in one temporary directory removed at exit. Helpers, not tests: pytest does not collect this file.
"""

from __future__ import annotations

import atexit
import functools
import json
import shutil
import tempfile
from pathlib import Path
from typing import Any

from warninglight.forensics import Analysis, analyze
from warninglight.lab.rehearsal import rehearse

ROOT = Path(tempfile.mkdtemp(prefix="wl-rehearsed-"))
atexit.register(shutil.rmtree, ROOT, ignore_errors=True)


@functools.cache
def trace(scenario: str, steps: int | None = None, seed: int = 0, checkpoint_every: int = 50) -> Path:
    """The trace directory of one rehearsal (trained on first use)."""
    out = ROOT / f"{scenario}-{steps}-{seed}-{checkpoint_every}"
    rehearse(scenario, out, seed=seed, steps=steps, checkpoint_every=checkpoint_every)
    return out


@functools.cache
def analysed(scenario: str, steps: int | None = None, seed: int = 0) -> Analysis:
    """`analyze` of a rehearsal (computed once)."""
    return analyze(trace(scenario, steps, seed))


def truth(path: Path) -> dict[str, Any]:
    """The truth.json a rehearsal wrote."""
    return json.loads((path / "truth.json").read_text())
