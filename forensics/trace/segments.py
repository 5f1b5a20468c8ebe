"""Which segment files of a trace a reader may use: committed, regular, in well-named partitions.

A version-2 rank commits each segment with a record under `commits/` written after all its table
files (tracer/schema.py); a file without one was left by a kill between two renames and is
ignored, by name, in a warning. Version-1 ranks (manifest `format_version` 1, or no manifest and
no `commits/rank=R` folder) have no commit records: every closed file counts. Only regular files
are listed (a FIFO named like a segment would block a reader forever) and only `rank=<integer>` /
`incarnation=<integer>` folders (anything else would turn the hive columns into text).
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from warninglight.tracer import schema

_RANK_DIR = re.compile(r"^rank=(\d+)$")
_INCARNATION_DIR = re.compile(r"^incarnation=(\d+)$")
_NAMED = 5  # files named in one warning; the rest are counted


@dataclass
class SegmentListing:
    """The segment files to read, per table, and what was left out and why."""

    by_table: dict[str, list[Path]] = field(default_factory=dict)
    warnings: list[str] = field(default_factory=list)

    @property
    def files(self) -> list[Path]:
        return [p for table in schema.TABLES for p in self.by_table.get(table, [])]


def _names(paths: list[Path], root: Path) -> str:
    shown = ", ".join(str(p.relative_to(root)) for p in paths[:_NAMED])
    return shown + (f" and {len(paths) - _NAMED} more" if len(paths) > _NAMED else "")


def _subdirs(base: Path, pattern: re.Pattern[str], odd: list[Path]) -> list[tuple[int, Path]]:
    """(number, folder) of the partition folders under `base`; others go to `odd`."""
    out = []
    for d in sorted(base.iterdir()) if base.is_dir() else []:
        m = pattern.match(d.name)
        if m and d.is_dir():
            out.append((int(m.group(1)), d))
        elif d.is_dir() or d.suffix == schema.SEGMENT_SUFFIX:
            odd.append(d)
    return out


def _committed(root: Path, rank: int, incarnation: int) -> set[str]:
    folder = root / schema.COMMIT_DIR / f"rank={rank}" / f"incarnation={incarnation}"
    if not folder.is_dir():
        return set()
    return {p.name.removesuffix(schema.COMMIT_SUFFIX) for p in folder.iterdir()
            if p.name.endswith(schema.COMMIT_SUFFIX) and p.is_file()}


def _committing_ranks(root: Path, manifests: Iterable[dict[str, Any]]) -> set[int]:
    """Ranks whose segments count only once committed (format version 2 and later)."""
    versions = {m.get("rank"): m.get("format_version") for m in manifests if isinstance(m, dict)}
    ranks = {r for r, v in versions.items() if isinstance(r, int) and isinstance(v, int) and v >= 2}
    odd: list[Path] = []
    for rank, _ in _subdirs(root / schema.COMMIT_DIR, _RANK_DIR, odd):
        if rank not in versions:  # no manifest: the commit records say which version wrote it
            ranks.add(rank)
    return ranks


def list_segments(root: Path, manifests: Iterable[dict[str, Any]] = ()) -> SegmentListing:
    """Every segment file a reader should use, per table, with warnings naming what it left out."""
    root = Path(root)
    committing = _committing_ranks(root, manifests)
    listing = SegmentListing()
    odd: list[Path] = []
    uncommitted: list[Path] = []
    irregular: list[Path] = []
    commits: dict[tuple[int, int], set[str]] = {}
    for table in schema.TABLES:
        found: list[Path] = []
        for rank, rank_dir in _subdirs(root / table, _RANK_DIR, odd):
            for inc, inc_dir in _subdirs(rank_dir, _INCARNATION_DIR, odd):
                for path in sorted(inc_dir.iterdir()):
                    if not schema.is_segment_name(path.name):
                        continue  # *.tmp: a write in progress or cut short; never a segment
                    if rank in committing and (rank, inc) not in commits:  # listed once, not per file
                        commits[(rank, inc)] = _committed(root, rank, inc)
                    if not path.is_file():
                        irregular.append(path)
                    elif rank in committing and path.name.removesuffix(schema.SEGMENT_SUFFIX) \
                            not in commits[(rank, inc)]:
                        uncommitted.append(path)
                    else:
                        found.append(path)
        listing.by_table[table] = found
    if uncommitted:
        listing.warnings.append(
            f"uncommitted segments ignored: {len(uncommitted)} file(s) without a commit record "
            f"({_names(uncommitted, root)}) — a writer killed while closing a segment; the "
            "steps they hold are not in the analysis")
    if irregular:
        listing.warnings.append(
            f"not regular files, ignored: {_names(irregular, root)} — a segment must be a plain "
            "Parquet file")
    if odd:
        listing.warnings.append(
            f"folders not named rank=<integer>/incarnation=<integer>, ignored: {_names(sorted(odd), root)}")
    return listing
