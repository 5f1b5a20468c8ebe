"""Compiled CPU passes for the recorder's per-step statistics: one call where eager PyTorch takes
one op per tensor.

On a small model each eager op costs more in dispatch than in arithmetic, and the recorder's
per-tensor norms are ~two ops per parameter tensor, twice a step. Here they are one numba call
over the tensors' memory, read through their addresses (taken while the tensors are held, so
the memory stays valid for the call). Sums of squares accumulate in float64: no float32 overflow
or underflow to check for, and the same value for the same memory every time.

`available()` compiles on first use (or loads numba's cache); when numba cannot be imported or
compiled, it returns False and the recorder keeps its eager path.
"""

from __future__ import annotations

import threading
from typing import Any

import numpy as np

_lock = threading.Lock()
_state: dict[str, Any] = {}


def _build() -> dict[str, Any]:
    import numba
    from numba import types
    from numba.extending import intrinsic

    @intrinsic
    def _address(typingctx: Any, addr: Any) -> Any:
        """An int64 address as a void pointer (what `numba.carray` reads from)."""
        def codegen(context: Any, builder: Any, signature: Any, args: Any) -> Any:
            return builder.inttoptr(args[0], context.get_value_type(types.voidptr))
        return types.voidptr(addr), codegen

    @numba.njit(nogil=True, fastmath=True, cache=True)
    def norm_f32(addr: int, n: int) -> float:
        acc = 0.0
        if n:
            a = numba.carray(_address(addr), (n,), np.float32)
            for j in range(n):
                x = np.float64(a[j])
                acc += x * x
        return np.sqrt(acc)

    @numba.njit(nogil=True, cache=True)
    def norms_f32(addrs: np.ndarray, lens: np.ndarray, out: np.ndarray) -> None:
        for i in range(addrs.shape[0]):
            out[i] = norm_f32(addrs[i], lens[i])  # the same arithmetic as one tensor at a time

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

    x = np.arange(3, dtype=np.float32)
    out = np.zeros(1, dtype=np.float32)
    norms_f32(np.array([x.ctypes.data], dtype=np.int64), np.array([3], dtype=np.int64), out)
    if abs(float(out[0]) - 5 ** 0.5) > 1e-6 or norm_f32(x.ctypes.data, 3) != out[0]:
        raise RuntimeError("the compiled norm kernel gave a wrong value")
    # both layouts a sample matrix comes in (a whole buffer; a slice of a staging buffer's
    # columns), compiled now rather than in a training step
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
    return {"norms_f32": norms_f32, "forward_sums": forward_sums}


def available() -> bool:
    """Whether the compiled kernels can be used (compiles them the first time: ~1 s, then cached)."""
    with _lock:
        if "ok" not in _state:
            try:
                _state.update(_build())
                _state["ok"] = True
            except Exception:  # no numba, or it cannot compile here: the eager path stays
                _state["ok"] = False
        return bool(_state["ok"])


def norms_f32(addrs: np.ndarray, lens: np.ndarray, out: np.ndarray) -> None:
    """out[i] = L2 norm of the `lens[i]` contiguous float32 values at address `addrs[i]`.

    The caller holds the tensors behind the addresses for the duration of the call."""
    _state["norms_f32"](addrs, lens, out)


def forward_sums(m: np.ndarray, slots: np.ndarray, centre: np.ndarray, half: np.ndarray,
                 bounded: bool, dead_eps: float, sums: np.ndarray, absmax: np.ndarray) -> None:
    """One pass over a (rows, units) float32 sample matrix: per unit its finite count, sum and
    sum of squares, zeros, saturated count (|x - centre| >= half, when `bounded`) and whether it
    is dead (max |x| <= dead_eps), added into column `slots[unit]` of `sums` (7, S) float64 (row 4
    unused), and its max |x| into `absmax` (S,) float32. A non-finite value counts as 0 in all
    but the finite count."""
    _state["forward_sums"](m, slots, centre, half, bounded, dead_eps, sums, absmax)
