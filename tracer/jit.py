"""The recorder's numba kernels (see tracer/kernels.py, which imports this module on first use).

They are defined at module level, every one with `cache=True`: a function that refers to an
object made at run time (an intrinsic defined inside another function, say) gets a new cache key
in every process and is compiled again each time; here a later process loads every one from
numba's cache instead of compiling them at `watch()`.
"""

from __future__ import annotations

from typing import Any

import numba
import numpy as np
from numba import types
from numba.extending import intrinsic


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

@intrinsic
def f32_at(typingctx: Any, addr: Any) -> Any:  # an integer address as a float32 pointer
    sig = types.CPointer(types.float32)(types.int64)

    def codegen(context: Any, builder: Any, signature: Any, args: Any) -> Any:
        return builder.inttoptr(args[0], context.get_value_type(types.CPointer(types.float32)))
    return sig, codegen

# reassociation only (the sum vectorises); no assumption that values are finite
@numba.njit(nogil=True, fastmath={"reassoc", "contract"}, boundscheck=False, cache=True)
def tensor_norms(addrs: np.ndarray, lens: np.ndarray, out: np.ndarray) -> bool:
    all_finite = True
    for i in range(addrs.shape[0]):
        n = lens[i]
        acc = 0.0
        if n > 0:
            a = numba.carray(f32_at(addrs[i]), (n,))
            for j in range(n):
                x = np.float64(a[j])
                acc += x * x
        v = np.float32(np.sqrt(acc))
        out[i] = v
        if not np.isfinite(v):
            all_finite = False
    return all_finite

@numba.njit(nogil=True, boundscheck=False, cache=True)
def gather_sketch(addrs: np.ndarray, offsets: np.ndarray, strides: np.ndarray, ks: np.ndarray,
                  out: np.ndarray) -> None:
    o = 0
    for i in range(addrs.shape[0]):
        k, off, st = ks[i], offsets[i], strides[i]
        a = numba.carray(f32_at(addrs[i]), (off + (k - 1) * st + 1,))
        for j in range(k):
            out[o + j] = a[off + j * st]
        o += k


@intrinsic
def u32_at(typingctx: Any, addr: Any) -> Any:  # an integer address as a uint32 pointer
    sig = types.CPointer(types.uint32)(types.int64)

    def codegen(context: Any, builder: Any, signature: Any, args: Any) -> Any:
        return builder.inttoptr(args[0], context.get_value_type(types.CPointer(types.uint32)))
    return sig, codegen


@numba.njit(nogil=True, boundscheck=False, cache=True)
def word_sums(addrs: np.ndarray, words: np.ndarray, slots: np.ndarray, out: np.ndarray) -> None:
    for i in range(addrs.shape[0]):
        n = words[i]
        # numba widens integer arithmetic to 64 bits: the sum wraps mod 2^64, of which
        # the low 32 bits are the sum mod 2^32 (the checksum's own arithmetic)
        acc = np.uint64(0)
        if n > 0:
            a = numba.carray(u32_at(addrs[i]), (n,))
            for j in range(n):
                acc += a[j]
        out[slots[i]] += np.int64(acc & np.uint64(0xFFFFFFFF))


# values of a tensor read twice while they are in L1: their squares, then their words (or their
# scaling), so that each value comes from memory once
L1_BLOCK = 2048


# reassociation only, as `tensor_norms`; the words' sum is exact integer arithmetic
@numba.njit(nogil=True, fastmath={"reassoc", "contract"}, boundscheck=False, cache=True)
def norms_word_sums(addrs: np.ndarray, lens: np.ndarray, out: np.ndarray, sums: np.ndarray) -> bool:
    all_finite = True
    for i in range(addrs.shape[0]):
        n = lens[i]
        acc = 0.0
        s = np.uint64(0)
        if n > 0:
            a = numba.carray(f32_at(addrs[i]), (n,))
            w = numba.carray(u32_at(addrs[i]), (n,))
            for j0 in range(0, n, L1_BLOCK):
                x = a[j0:j0 + L1_BLOCK]
                for j in range(x.shape[0]):
                    v = np.float64(x[j])
                    acc += v * v
                y = w[j0:j0 + L1_BLOCK]
                for j in range(y.shape[0]):
                    s += y[j]
        sums[i] = np.int64(s & np.uint64(0xFFFFFFFF))
        v32 = np.float32(np.sqrt(acc))
        out[i] = v32
        if not np.isfinite(v32):
            all_finite = False
    return all_finite


@numba.njit(nogil=True, fastmath={"reassoc", "contract"}, boundscheck=False, cache=True)
def scaled_norms(buf: np.ndarray, offsets: np.ndarray, lens: np.ndarray, scale: np.float32,
                 out: np.ndarray) -> None:
    # slices indexed from 0: an index numba cannot prove non-negative is checked for
    # wrap-around on every access, which keeps the loop from vectorising
    pos = 0
    for i in range(offsets.shape[0]):
        gap = buf[pos:offsets[i]]  # between segments: scaled only
        for j in range(gap.shape[0]):
            gap[j] = gap[j] * scale
        seg = buf[offsets[i]:offsets[i] + lens[i]]
        acc = 0.0
        for j0 in range(0, seg.shape[0], L1_BLOCK):  # a block's squares, then its scaling
            blk = seg[j0:j0 + L1_BLOCK]
            for j in range(blk.shape[0]):
                x = np.float64(blk[j])
                acc += x * x
            for j in range(blk.shape[0]):
                blk[j] = blk[j] * scale  # one float32 product: what `mul_` computes
        out[i] = np.float32(np.sqrt(acc))
        pos = offsets[i] + lens[i]
    rest = buf[pos:]
    for j in range(rest.shape[0]):
        rest[j] = rest[j] * scale
