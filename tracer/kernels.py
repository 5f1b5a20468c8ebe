"""A compiled CPU pass for the recorder's forward statistics: one pass where eager PyTorch
takes ~15.

Every 8 steps the recorder reduces the 16-row subsamples of every component's output to
per-unit statistics (finite count, sum, square sum, zeros, saturation, absmax, dead units) and
then to per-(step, component) sums. On the CPU that was ~15 eager ops, each a pass over the
whole staging buffer (a few MB): the memory traffic, not the arithmetic, was the cost. Here it
is one blocked, vectorised numba pass straight into the per-(step, component) sums.

`available()` compiles on first use (or loads numba's cache); when numba cannot be imported or
compile, it returns False and the recorder keeps its eager ops (equal to float32 rounding:
tested).
"""

from __future__ import annotations

import os
import threading
from typing import Any

import numpy as np

_lock = threading.Lock()
_state: dict[str, Any] = {}


def _build() -> dict[str, Any]:
    import numba

    @numba.njit(nogil=True, cache=True, boundscheck=False)
    def forward_sums(m: np.ndarray, slots: np.ndarray, centre: np.ndarray, half: np.ndarray,
                     bounded: bool, dead_eps: float, sums: np.ndarray, absmax: np.ndarray) -> None:
        r, w = m.shape
        block = 512  # columns whose running sums stay in L1 while the rows stream past
        # float32 running sums, branch-free, so that the loop over columns is vectorised (a
        # column has a few dozen rows: float32 sums lose nothing that matters there)
        nfin = np.empty(block, np.float32)
        nz = np.empty(block, np.float32)
        sat = np.empty(block, np.float32)
        total = np.empty(block, np.float32)
        sq = np.empty(block, np.float32)
        mx = np.empty(block, np.float32)
        one, zero = np.float32(1.0), np.float32(0.0)
        for j0 in range(0, w, block):
            b = min(block, w - j0)
            nfin[:] = 0.0
            nz[:] = 0.0
            sat[:] = 0.0
            total[:] = 0.0
            sq[:] = 0.0
            mx[:] = 0.0
            c, h = centre[j0:j0 + b], half[j0:j0 + b]
            for i in range(r):
                row = m[i, j0:j0 + b]
                for jj in range(b):
                    x = row[jj]
                    finite = x - x == 0  # False for NaN and +-inf
                    x = x if finite else zero  # a non-finite value counts as 0 but for nfin
                    nfin[jj] += one if finite else zero
                    total[jj] += x
                    sq[jj] += x * x
                    nz[jj] += one if x != 0 else zero
                    mx[jj] = max(mx[jj], abs(x))
                if bounded:
                    for jj in range(b):
                        x = row[jj]
                        x = x if x - x == 0 else zero
                        sat[jj] += one if abs(x - c[jj]) >= h[jj] else zero
            for jj in range(b):
                s = slots[j0 + jj]
                sums[0, s] += nfin[jj]
                sums[1, s] += total[jj]
                sums[2, s] += sq[jj]
                sums[3, s] += nfin[jj] - nz[jj]
                sums[5, s] += sat[jj]
                if mx[jj] <= dead_eps:
                    sums[6, s] += 1.0
                absmax[s] = max(absmax[s], mx[jj])

    # both layouts a sample matrix comes in (a whole buffer; a slice of a staging buffer's
    # columns), compiled now rather than in a training step
    x = np.arange(3, dtype=np.float32)
    wide = np.zeros((2, 6), dtype=np.float32)
    wide[:, :3] = x
    for m in (np.stack([x, x]), wide[:, :3]):
        sums, absmax = np.zeros((7, 1)), np.zeros(1, dtype=np.float32)
        forward_sums(m, np.zeros(3, dtype=np.int64), np.zeros(3, dtype=np.float32),
                     np.ones(3, dtype=np.float32), True, 1e-6, sums, absmax)
        if list(sums[:, 0]) != [6, 6, 10, 2, 0, 4, 1] or absmax[0] != 2:
            raise RuntimeError("the compiled forward kernel gave a wrong value")
    if len(forward_sums.signatures) < 2:
        raise RuntimeError("the compiled forward kernel has one layout only")
    return {"forward_sums": forward_sums}


def available() -> bool:
    """Whether the compiled pass can be used (compiles it the first time: ~2 s; then numba's
    cache loads it in ~0.5 s). `WARNINGLIGHT_EAGER=1` in the environment says no: the eager ops
    then run, e.g. to compare the two (`bench/overhead.py`, `bench/overhead_breakdown.py`)."""
    if os.environ.get("WARNINGLIGHT_EAGER", "") not in ("", "0"):
        return False
    with _lock:
        if "ok" not in _state:
            try:
                _state.update(_build())
                _state["ok"] = True
            except Exception:  # no numba, or it cannot compile here: the eager path stays
                _state["ok"] = False
        return bool(_state["ok"])


def forward_sums(m: np.ndarray, slots: np.ndarray, centre: np.ndarray, half: np.ndarray,
                 bounded: bool, dead_eps: float, sums: np.ndarray, absmax: np.ndarray) -> None:
    """One pass over a (rows, units) float32 sample matrix: per unit its finite count, sum and
    sum of squares, zeros, saturated count (|x - centre| >= half, when `bounded`) and whether it
    is dead (max |x| <= dead_eps), added into column `slots[unit]` of `sums` (7, S) float64 (row 4
    unused), and its max |x| into `absmax` (S,) float32. A non-finite value counts as 0 in all
    but the finite count."""
    _state["forward_sums"](m, slots, centre, half, bounded, dead_eps, sums, absmax)
