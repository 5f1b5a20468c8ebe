"""Compiled CPU passes for the recorder: the forward statistics and the parameters' norms,
sketches and checksums, each one pass where eager PyTorch takes one per statistic or per tensor.

Every 8 steps the recorder reduces the 16-row subsamples of every component's output to
per-unit statistics (finite count, sum, square sum, zeros, saturation, absmax, dead units) and
then to per-(step, component) sums; every step it takes the norms of the weights and gradients
and a sketch of the weights. On the CPU those were an eager op per statistic or per tensor, each
a pass over memory or a dispatch of its own: here each is one blocked, vectorised loop
(tracer/jit.py: LLVM IR compiled by llvmlite, cached on disk by tracer/codecache.py).

`available()` loads them (compiling them the first time on a machine) and waits for it; when
llvmlite cannot be imported or compile, or a kernel fails its check against known answers, it
returns False and the recorder keeps its eager ops (equal to float32 rounding: tested). The
recorder asks `ready()` instead, which never waits: its first call starts the load on a thread of
its own, and the eager ops take the passes until the kernels are there (a few steps: the load
maps cached code, or compiles in a fraction of a second).

The callers pass numpy arrays of the documented dtypes; each wrapper checks dtype and layout
before it hands their addresses to compiled code.
"""

from __future__ import annotations

import ctypes
import os
import threading
import time
import weakref
from typing import Any, NamedTuple

import numpy as np

_lock = threading.Lock()
_state: dict[str, Any] = {}
_loading: dict[str, threading.Thread] = {}  # the load `ready` started, under ""
_loading_lock = threading.Lock()  # not `_lock`, which a load holds for its whole length


def _checked(funcs: dict[str, Any]) -> None:
    """Raise unless every kernel gives the known answers (a wrong compile must not record)."""
    _state.update(funcs)  # the wrappers below read `_state`
    x = np.arange(3, dtype=_F32)
    wide = np.zeros((2, 6), dtype=_F32)
    wide[:, :3] = x
    for m in (np.stack([x, x]), wide[:, :3]):  # a whole buffer; a slice of a buffer's columns
        sums, absmax = np.zeros((7, 1)), np.zeros(1, dtype=_F32)
        forward_sums(m, np.zeros(3, dtype=_I64), np.zeros(3, dtype=_F32),
                     np.ones(3, dtype=_F32), True, 1e-6, sums, absmax)
        if list(sums[:, 0]) != [6, 6, 10, 2, 0, 4, 1] or absmax[0] != 2:
            raise RuntimeError("the compiled forward kernel gave a wrong value")
    t = [np.array([3.0, -4.0], _F32), np.array([np.inf, 1e-30], _F32), np.zeros(0, _F32)]
    addrs, lens = np.array([a.ctypes.data for a in t]), np.array([a.size for a in t])
    norms = np.zeros(3, _F32)
    if tensor_norms(addrs, lens, norms) or list(norms) != [5.0, np.inf, 0.0] \
            or not tensor_norms(addrs[:1], lens[:1], norms[:1]):
        raise RuntimeError("the compiled norm kernel gave a wrong value")
    got = np.zeros(3, _F32)
    gather_sketch(addrs[:2], np.array([1, 0]), np.array([1, 1]), np.array([1, 2]), got)
    if list(got) != [-4.0, np.inf, np.float32(1e-30)]:
        raise RuntimeError("the compiled sketch kernel gave a wrong value")
    want = [int(a.view(np.uint32).astype(np.uint64).sum()) % 2**32 for a in t]
    norms, words = np.zeros(3, _F32), np.zeros(3, _I64)
    if norms_word_sums(addrs, lens, norms, words) or list(norms) != [5.0, np.inf, 0.0] or list(words) != want:
        raise RuntimeError("the compiled norm-and-checksum kernel gave a wrong value")
    words = np.zeros(2, _I64)
    word_sums(addrs, lens, np.array([1, 1, 0]), words)
    if list(words) != [want[2], want[0] + want[1]]:
        raise RuntimeError("the compiled checksum kernel gave a wrong value")
    src, dest = np.arange(12, dtype=_F32), np.zeros(7, _F32)
    funcs["copy_rows1"](src.ctypes.data + 4, 5, dest.ctypes.data, 4, 2, 3)
    if list(dest) != [1, 2, 3, 0, 6, 7, 8]:
        raise RuntimeError("the compiled row copy gave a wrong value")
    srcs = (ctypes.c_int64 * 2)(src.ctypes.data, src.ctypes.data + 40)
    table = np.array([[5, dest.ctypes.data, 4, 2, 1], [1, dest.ctypes.data + 4, 4, 1, 2]], _I64)
    funcs["copy_rows_many"](ctypes.addressof(srcs), table.ctypes.data, 2)
    if list(dest) != [0, 10, 11, 0, 5, 7, 8]:
        raise RuntimeError("the compiled row copies gave a wrong value")
    gen = np.random.default_rng(0)
    rows = gen.standard_normal((3, 7)).astype(_F32)
    cu, cs = gen.standard_normal(3).astype(_F32), gen.standard_normal(3).astype(_F32)
    scale, comp = np.array([1.0, 3.0, 0.5], _F32), np.array([1, 1, 0])
    want = _sketch_sums_reference(rows, 3, cu, cs, scale, comp, 2)
    sums = np.zeros(24, _F32)
    sketch_sums(rows, 3, 3, cu, cs, scale, comp, 2, sums)
    if not np.array_equal(sums.reshape(2, 4, 3), want) or not np.array_equal(cs, rows[-1, 3:6]):
        raise RuntimeError("the compiled sketch arithmetic gave a wrong value")
    before = np.array([2.0, -4.0, 0.0], _F32)
    if one_factor(before, before * np.float32(0.25), 1e-6) != 0.25 or one_factor(before, before, 1e-6) != 1.0 \
            or one_factor(before, np.array([0.5, -1.0, 1e-3], _F32), 1e-6) is not None \
            or one_factor(before, np.array([0.5, -1.0, np.inf], _F32), 1e-6) is not None \
            or one_factor(np.zeros(3, _F32), np.zeros(3, _F32), 1e-6) is not None:
        raise RuntimeError("the compiled factor check gave a wrong value")
    buf, out = np.array([3.0, 4.0, 7.0, 1.0, -2.0], _F32), np.zeros(2, _F32)
    scaled_norms(buf, np.array([0, 3]), np.array([2, 1]), 0.5, out)
    if list(out) != [5.0, 1.0] or list(buf) != [1.5, 2.0, 3.5, 0.5, -1.0]:
        raise RuntimeError("the compiled scaled-norm kernel gave a wrong value")
    # the norm kernels in parts (`norm_parts`), on this thread, then on torch's team if found:
    # small parts over two tensors and an empty one
    import torch

    _state["openmp"], _state["threads"] = None, torch.get_num_threads
    t = [np.full(10_000, 0.5, _F32), np.zeros(0, _F32), np.full(6_000, 2.0, _F32)]
    addrs = np.array([a.ctypes.data for a in t])
    plan = _cut([a.size for a in t], 1, _BLOCK)
    norms, words = np.zeros(3, _F32), np.zeros(3, _I64)
    want = [int(a.view(np.uint32).astype(np.uint64).sum()) % 2**32 for a in t]
    if plan is None or len(plan.arrays[2]) < 8 or not _split_norms(plan, _at(addrs, _I64), _at(norms, _F32),
                                                                   _at(words, _I64)) \
            or list(norms) != [50.0, 0.0, np.float32(np.sqrt(24_000.0))] or list(words) != want:
        raise RuntimeError("the compiled norm kernel in parts gave a wrong value")
    team = _openmp()
    if team is not None:  # a team that gives another answer is not used (the parts stay here)
        on_team = np.zeros(3, _F32), np.zeros(3, _I64)
        funcs["norms_in_parts"](plan.task, _at(addrs, _I64), _at(on_team[0], _F32), _at(on_team[1], _I64), team, 2)
        if list(on_team[0]) == list(norms) and list(on_team[1]) == want:
            _state["openmp"] = team


def available() -> bool:
    """Whether the compiled passes can be used (loads them, and waits). `WARNINGLIGHT_EAGER=1` in
    the environment says no: the eager ops then run, e.g. to compare the two
    (`bench/overhead.py`, `bench/overhead_breakdown.py`)."""
    if _eager_forced():
        return False
    with _lock:
        if "ok" not in _state:
            start = time.thread_time()
            try:
                from .codecache import load

                funcs, _state["source"] = load()
                _state["cached"] = _state["source"] != "compiled"
                _checked(funcs)
                _state["ok"] = True
            except Exception:  # no llvmlite, or it cannot compile here: the eager path stays
                for name in [k for k in _state if k not in ("cached", "source")]:
                    del _state[name]
                _state["ok"] = False
            _state["load_cpu_s"] = time.thread_time() - start  # what the load cost (benches print it)
        return bool(_state["ok"])


def _eager_forced() -> bool:
    return os.environ.get("WARNINGLIGHT_EAGER", "") not in ("", "0")


def ready() -> bool:
    """Whether the kernels are loaded and passed their checks, without waiting. The first call
    starts loading them on a thread of its own; later calls say True once they are there. False
    for good where they cannot be used, and with `WARNINGLIGHT_EAGER=1`."""
    if _eager_forced():
        return False
    ok = _state.get("ok")  # a dict read: no lock, so a step never waits on a load in progress
    if ok is not None:
        return bool(ok)
    with _loading_lock:
        if "" not in _loading:
            # not a daemon: an interpreter that exits during the load waits for it rather than
            # unmapping code under it
            _loading[""] = threading.Thread(target=available, name="warninglight-kernels")
            _loading[""].start()
    return False


# what the wrappers know of each array they have seen: its data address, which stays put for the
# array's life (the recorder never resizes one in place), its dtype and layout, checked then, and
# for the counts and indices the callers never write, their sum or max (`_int_stat`). Reading
# these through numpy costs more than some kernels' own work.
_addresses: dict[int, list[Any]] = {}  # id -> [weak reference, address, dtype, {stat: value} or None]
_ADDRESSES_MAX = 4096  # past this many, the entries of arrays that are gone are dropped
_I64, _F32, _F64 = np.dtype(np.int64), np.dtype(np.float32), np.dtype(np.float64)


def _at(a: np.ndarray, dtype: np.dtype[Any]) -> int:
    """The data address of a C-contiguous array of `dtype`: what a kernel may read or write.
    (An array seen before was checked then: its dtype and layout are its own for life.)"""
    known = _addresses.get(id(a))
    if known is not None and known[0]() is a and known[2] is dtype:
        return known[1]
    if a.dtype != dtype or not a.flags.c_contiguous:
        raise TypeError(f"a kernel takes C-contiguous {dtype.name} arrays, not {a.dtype} {a.shape}")
    address = int(a.ctypes.data)
    if len(_addresses) >= _ADDRESSES_MAX:
        for key, (ref, *_) in list(_addresses.items()):
            if ref() is None:
                _addresses.pop(key, None)
        if len(_addresses) >= _ADDRESSES_MAX:  # all alive: start again rather than grow
            _addresses.clear()
    _addresses[id(a)] = [weakref.ref(a), address, dtype, None]
    return address


def _int_stat(a: np.ndarray, how: str) -> int:
    """The sum, min or max (`how`) of an int64 array a kernel was given before (`_at`), taken once:
    the counts and indices the callers pass are made once and never written. (Its entry may be
    gone since: a later `_at` that found the cache full of live arrays started it again.)"""
    known = _addresses.get(id(a))
    if known is None or known[0]() is not a:
        _at(a, _I64)
        known = _addresses[id(a)]
    if known[3] is None:
        known[3] = {}
    if how not in known[3]:
        known[3][how] = int(getattr(a, how)()) if a.size else 0
    return known[3][how]


def forward_sums(m: np.ndarray, slots: np.ndarray, centre: np.ndarray, half: np.ndarray,
                 bounded: bool, dead_eps: float, sums: np.ndarray, absmax: np.ndarray) -> None:
    """One pass over a (rows, units) float32 sample matrix (its rows may lie apart: a slice of a
    wider buffer's columns): per unit its finite count, sum and sum of squares, zeros, saturated
    count (|x - centre| >= half, when `bounded`) and whether it is dead (max |x| <= dead_eps),
    added into column `slots[unit]` (int64) of `sums` (7, S) float64 (row 4 unused), and its max
    |x| into `absmax` (S,) float32. A non-finite value counts as 0 in all but the finite count."""
    r, w = m.shape
    if m.dtype != np.float32 or (r > 1 and m.strides[0] % 4) or (w > 1 and m.strides[1] != 4) \
            or len(slots) != w or len(centre) < w or len(half) < w or sums.shape[0] != 7 or len(absmax) != sums.shape[1]:
        raise TypeError(f"forward_sums: a matrix or its sums of the wrong layout, {m.dtype} {m.shape} {m.strides}")
    if r == 0 or w == 0:
        return
    _state["forward_sums"](m.ctypes.data, r, w, m.strides[0] // 4, _at(slots, _I64), _at(centre, _F32),
                           _at(half, _F32), int(bounded), float(dead_eps), _at(sums, _F64),
                           sums.shape[1], _at(absmax, _F32))


def tensor_norms(addrs: np.ndarray, lens: np.ndarray, out: np.ndarray) -> bool:
    """The L2 norm of each of `len(addrs)` contiguous float32 CPU tensors, given as data
    addresses and element counts (int64), into `out` (float32, rounded from a float64 sum of
    squares: no float32 overflow or underflow on the way). True if every norm is finite.

    The caller keeps the tensors alive and guarantees what the addresses point at."""
    n = len(addrs)
    if len(lens) != n or len(out) < n:
        raise TypeError("tensor_norms: addresses, counts and norms of different lengths")
    at_lens = _at(lens, _I64)
    if (plan := _plan(lens)) is not None:
        return _split_norms(plan, _at(addrs, _I64), _at(out, _F32), None)
    return bool(_state["tensor_norms"](_at(addrs, _I64), at_lens, _at(out, _F32), n))


def gather_sketch(addrs: np.ndarray, offsets: np.ndarray, strides: np.ndarray, ks: np.ndarray,
                  out: np.ndarray) -> None:
    """Coordinates `offsets[i] + j * strides[i]`, j < ks[i], of each contiguous float32 CPU
    tensor at `addrs[i]`, one after the other into `out` (float32; the others int64). The caller
    keeps the tensors alive and guarantees each holds at least `offsets[i] + (ks[i] - 1) *
    strides[i] + 1` values, and never changes `ks` (its sum is checked once)."""
    n, at_ks = len(addrs), _at(ks, _I64)
    if len(offsets) != n or len(strides) != n or len(ks) != n or len(out) < _int_stat(ks, "sum"):
        raise TypeError("gather_sketch: arrays of different lengths, or too short an output")
    _state["gather_sketch"](_at(addrs, _I64), _at(offsets, _I64), _at(strides, _I64), at_ks,
                            _at(out, _F32), n)


def word_sums(addrs: np.ndarray, words: np.ndarray, slots: np.ndarray, out: np.ndarray) -> None:
    """For each contiguous CPU tensor at `addrs[i]` holding `words[i]` 32-bit words: the
    wrapping (mod 2^32) sum of its words read as unsigned integers, added into `out[slots[i]]`
    (all int64). The caller keeps the tensors alive and guarantees what the addresses point at."""
    n = len(addrs)
    if len(words) != n or len(slots) != n or (n and not 0 <= _int_stat(slots, "min") <= _int_stat(slots, "max") < len(out)):
        raise TypeError("word_sums: arrays of different lengths, or a slot outside the output")
    _state["word_sums"](_at(addrs, _I64), _at(words, _I64), _at(slots, _I64), _at(out, _I64), n)


def norms_word_sums(addrs: np.ndarray, lens: np.ndarray, out: np.ndarray, sums: np.ndarray) -> bool:
    """`tensor_norms` and `word_sums` in one read of each contiguous float32 CPU tensor at
    `addrs[i]` holding `lens[i]` values: its L2 norm into `out[i]` (float32 from a float64 sum
    of squares) and the wrapping (mod 2^32) sum of its 32-bit words into `sums[i]` (int64).
    True if every norm is finite. The caller keeps the tensors alive and guarantees what the
    addresses point at."""
    n = len(addrs)
    if len(lens) != n or len(out) < n or len(sums) < n:
        raise TypeError("norms_word_sums: arrays of different lengths")
    at_lens = _at(lens, _I64)
    if (plan := _plan(lens)) is not None:
        return _split_norms(plan, _at(addrs, _I64), _at(out, _F32), _at(sums, _I64))
    return bool(_state["norms_word_sums"](_at(addrs, _I64), at_lens, _at(out, _F32),
                                          _at(sums, _I64), n))


def scaled_norms(buf: np.ndarray, offsets: np.ndarray, lens: np.ndarray, scale: float,
                 out: np.ndarray) -> None:
    """One pass over a flat float32 buffer: the L2 norm of each segment `[offsets[i], offsets[i]
    + lens[i])` (int64; ascending, not overlapping) as it was, into `out` (float32, from a float64
    sum of squares), while every value of the buffer is multiplied by `scale` in float32, as
    `torch.Tensor.mul_(scale)` does."""
    n = len(offsets)
    if len(lens) != n or len(out) < n or (n and (int(offsets.min()) < 0 or int((offsets + lens).max()) > len(buf))):
        raise TypeError("scaled_norms: a segment outside the buffer, or arrays of different lengths")
    _state["scaled_norms"](_at(buf, _F32), len(buf), _at(offsets, _I64), _at(lens, _I64), n,
                           float(scale), _at(out, _F32))


def one_factor(before: np.ndarray, after: np.ndarray, tol: float) -> float | None:
    """The factor c > 0 with after = c * before value by value (float32 arrays of one length),
    each within `tol` times the value after (or below float32's smallest normal value: a product
    that underflowed), every value after finite; read off the largest value before. None if
    there is none: nothing but zeros, a zero where the other is not, any other change."""
    if len(before) != len(after):
        raise TypeError("one_factor: arrays of different lengths")
    c = _state["one_factor"](_at(before, _F32), _at(after, _F32), len(before), float(tol))
    return c if c > 0.0 else None


def sketch_sums(rows: np.ndarray, k: int, steps: int, cu: np.ndarray, cs: np.ndarray, scale: np.ndarray,
                comp: np.ndarray, n: int, out: np.ndarray) -> None:
    """The parameters' sketch arithmetic of `steps` steps (tracer/jit.py, `sketch_sums`): the rows
    of `rows` (float32) hold each step's sketch at its first forward in columns [0, k) and after
    its optimizer step in [k, 2k); `cu` and `cs` (float32, k) the update and the sketch the step
    before them left, which they then carry on; `scale` (float32, k) each coordinate's scale and
    `comp` (int64, k, never written) its component, below `n`. Into `out` (float32, at least
    n * 4 * steps) the sums (n, 4, steps) of the scaled |update|^2, update . update before,
    |update before|^2 and |drift|^2, the same bit for bit as the eager ops."""
    at = [_at(rows, _F32), _at(cu, _F32), _at(cs, _F32), _at(scale, _F32), _at(comp, _I64), _at(out, _F32)]
    if rows.ndim != 2 or rows.shape[0] < steps or rows.shape[1] < 2 * k or len(cu) < k or len(cs) < k \
            or len(scale) < k or len(comp) < k or len(out) < n * 4 * steps or _int_stat(comp, "max") >= n:
        raise TypeError("sketch_sums: rows, sketches or sums of the wrong size")
    _state["sketch_sums"](at[0], at[0] + 4 * k, rows.shape[1], *at[1:5], steps, k, n, at[5])


def _sketch_sums_reference(rows: np.ndarray, k: int, cu: np.ndarray, cs: np.ndarray, scale: np.ndarray,
                           comp: np.ndarray, n: int) -> np.ndarray:
    """`sketch_sums` by numpy's float32 ops, one coordinate at a time (its known answers)."""
    f, e = rows[:, :k], rows[:, k:2 * k]
    out = np.zeros((n, 4, len(rows)), dtype=_F32)
    for j in range(k):
        pu, pe = cu[j], cs[j]
        for s in range(len(rows)):
            u, d = e[s, j] - f[s, j], f[s, j] - pe
            for q, p in enumerate((u * u, u * pu, pu * pu, d * d)):
                out[comp[j], q, s] += p * scale[j]
            pu, pe = u, e[s, j]
    return out


# The norm passes over many values (`SPLIT_FROM` or more: the parameters of all but the smallest
# models) are cut into parts of about `_PART` values that the threads of torch's own OpenMP team
# claim one at a time (`norm_parts`, tracer/jit.py): the training thread waits for the pass
# either way, and the team's other threads are idle then. The parts, and so the sums, depend on
# the tensors' lengths alone: any number of threads, one included, gives the same norms for the
# same memory (weight drift compares two of them), but for subnormal values under
# `torch.set_flush_denormal(True)`, which sets the calling thread's floating-point mode alone.
SPLIT_FROM = 1 << 18
_PART, _MAX_PARTS = 1 << 17, 64
_BLOCK = 2048  # tensors are cut at multiples of this many values (aligned vector loads)


class _Plan(NamedTuple):
    task: int  # the address of `norms_in_parts`'s task (tracer/jit.py)
    arrays: tuple[np.ndarray, ...]  # the task, and the arrays it points at


# one plan per list of lengths and thread (the task holds the pass's scratch)
_plans: dict[tuple[bytes, int], _Plan | None] = {}
_PLANS_MAX = 256


def _plan(lens: np.ndarray) -> _Plan | None:
    """How a norm pass over tensors of `lens` values (int64, checked by `_at`) is cut into parts;
    None if it is one piece (under `SPLIT_FROM` values in all)."""
    key = (lens.tobytes(), threading.get_ident())
    plan = _plans.get(key, False)
    if plan is False:
        if len(_plans) >= _PLANS_MAX:
            _plans.clear()
        plan = _plans[key] = _cut(lens.tolist(), SPLIT_FROM, _PART)
    return plan


def _cut(counts: list[int], split_from: int, part: int) -> _Plan | None:
    """`_plan` for tensors of `counts` values: parts of about `part` values (at most `_MAX_PARTS`
    of them; a tensor is cut at multiples of `_BLOCK` values from its start), None under
    `split_from` values in all."""
    total = sum(counts)
    if total < split_from or not counts or min(counts) < 0:
        return None
    parts = min(_MAX_PARTS, max(2, total // part))
    cuts = [total * k // parts for k in range(1, parts)]
    segs: list[tuple[int, int, int, int]] = []  # (tensor, first value, length, part)
    pos = c = 0
    for i, n in enumerate(counts):
        off = 0
        while c < len(cuts) and cuts[c] <= pos:
            c += 1
        while c < len(cuts) and cuts[c] < pos + n:
            at = (cuts[c] - pos) // _BLOCK * _BLOCK  # a multiple of the block within the tensor
            if at > off:
                segs.append((i, off, at - off, c))
                off = at
            c += 1
        segs.append((i, off, n - off, c))
        pos += n
    tensor, first, length, of_part = (np.array(col, dtype=_I64) for col in zip(*segs, strict=True))
    bounds = np.searchsorted(of_part, np.arange(parts + 1)).astype(_I64)
    firsts = np.searchsorted(tensor, np.arange(len(counts) + 1)).astype(_I64)
    squares, words = np.zeros(len(segs)), np.zeros(len(segs), dtype=_I64)
    arrays = (bounds, tensor, first, length, squares, words, firsts)
    at = [int(a.ctypes.data) for a in arrays]
    task = np.array([0, parts, *at[:4], 0, at[4], 0, at[5], at[6], len(counts)], dtype=_I64)
    return _Plan(int(task.ctypes.data), (task, *arrays))


def _split_norms(plan: _Plan, addrs: int, out: int, sums: int | None) -> bool:
    """`tensor_norms` (or `norms_word_sums`, with `sums`) of the tensors at `addrs` (the address of
    their int64 addresses) into `out` (the address of their float32 norms) as `plan` cuts them:
    on as many threads of torch's OpenMP team as torch's ops on this thread would use (where it
    was found), else on this thread alone."""
    threads = _state["threads"]()  # torch's count on this thread, as its ops would run
    team = _state["openmp"] if threads > 1 else None
    return bool(_state["norms_in_parts"](plan.task, addrs, out, sums, team, threads))


def _openmp() -> int | None:
    """The address of the `GOMP_parallel` that torch's own CPU ops call, as the dynamic linker
    resolves it for them: in the process's global scope first (a runtime preloaded, or loaded
    globally), else among torch's dependencies. None where torch runs on another threading
    backend or none is found."""
    try:
        import torch

        if "parallel backend: OpenMP" not in torch.__config__.parallel_info():
            return None
        for scope in (None, torch._C.__file__):
            try:
                return ctypes.cast(ctypes.CDLL(scope).GOMP_parallel, ctypes.c_void_p).value
            except (OSError, AttributeError):
                continue
    except Exception:  # the team is optional: the parts then run on the calling thread
        pass
    return None


def parts_on_threads() -> bool:
    """Whether a pass cut into parts now runs on more than one thread: torch's OpenMP team was
    found, and torch is set to more than one thread on this thread."""
    return _state.get("openmp") is not None and _state["threads"]() > 1


def rows_copier() -> Any:
    """`row_copier` for many samples in one call, with three arguments: the address of a
    ctypes int64 array of n source addresses, the address of an (n, 5) int64 numpy array of
    the other five arguments of each copy, and n. The same guarantees are the caller's."""
    return _state["copy_rows_many"]


def row_copier() -> Any:
    """The compiled row copy, called with six ints: source address, its row stride (float32
    values), destination address, its row stride, rows, values a row. It copies the rows one
    after the other. The ctypes function itself, for a forward hook that cannot afford building
    arrays or checking them: the caller keeps both tensors alive and guarantees that they are
    contiguous float32 rows that hold what the rows span and do not overlap."""
    return _state["copy_rows1"]
