"""Plain aligned text tables: the one format every command prints rows in.

Kept apart from `wording` (which needs the analysis types) so that `warninglight conditions`
prints its table without loading the engine.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any


def _cell(v: Any) -> str:
    if isinstance(v, float):
        if 1e6 <= abs(v) < 1e15:  # a timestamp or a count: every whole digit, none in an exponent
            return f"{v:.6f}".rstrip("0").rstrip(".")
        return f"{v:.4g}"
    return "" if v is None else str(v)


def text_table(rows: Sequence[Mapping[str, Any]], columns: Sequence[str]) -> str:
    """A plain aligned text table (header, then rows)."""
    cells = [[_cell(r.get(c)) for c in columns] for r in rows]
    widths = [max([len(c), *(len(row[i]) for row in cells)]) for i, c in enumerate(columns)]
    lines = ["  ".join(c.ljust(w) for c, w in zip(columns, widths, strict=True)).rstrip()]
    lines += ["  ".join(v.ljust(w) for v, w in zip(row, widths, strict=True)).rstrip() for row in cells]
    return "\n".join(lines)
