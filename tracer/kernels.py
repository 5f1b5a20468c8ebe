"""A compiled CPU pass for the recorder's forward statistics: one pass where eager PyTorch
takes one per statistic.

Every 8 steps the recorder reduces the 16-row subsamples of every component's output to
per-unit statistics (finite count, sum, square sum, zeros, saturation, absmax, dead units) and
then to per-(step, component) sums. On the CPU that was an eager op per statistic, each a pass
over the whole staging buffer: the memory traffic, not the arithmetic, was the cost. Here it
is one blocked, vectorised numba pass straight into the per-(step, component) sums.

`available()` compiles on first use (or loads numba's cache) and waits for it; when numba cannot
be imported or compile, it returns False and the recorder keeps its eager ops (equal to float32
rounding: tested). The recorder asks `ready()` instead, which never waits: the eager ops take
the passes until the kernels are there. Importing numba and loading the kernels is most of what
the recorder costs a process once, and the compiled passes save a few percent of each step, so
the load pays only in a run that lasts: `ready()` starts it, on a thread of its own, once the
process has been recording for `LOAD_AFTER_S` seconds (a short run never pays it; a long one
pays at most about twice what knowing its length in advance would have cost).
"""

from __future__ import annotations

import os
import threading
import time
from typing import Any

import numpy as np

_lock = threading.Lock()
_state: dict[str, Any] = {}
_loading: dict[str, threading.Thread] = {}  # what `ready` started loading, by kernel name
_loading_lock = threading.Lock()  # not `_lock`, which a load holds for its whole length
# seconds from the first `ready()` of a process to the start of the kernels' load: about their
# load's CPU time over the share of a small model's step the compiled passes save
LOAD_AFTER_S = 10.0
_first_asked: list[float] = []  # when `ready()` was first called in this process


def _build() -> dict[str, Any]:
    from .jit import forward_sums, gather_sketch, tensor_norms

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
    # the parameter passes, on tensors read through their addresses (checked against torch)
    t = [np.array([3.0, 4.0], np.float32), np.array([np.inf, 1.0], np.float32), np.zeros(0, np.float32)]
    addrs, lens = np.array([a.ctypes.data for a in t]), np.array([a.size for a in t])
    norms = np.zeros(3, np.float32)
    if tensor_norms(addrs, lens, norms) or list(norms) != [5.0, np.inf, 0.0] \
            or not tensor_norms(addrs[:1], lens[:1], norms[:1]):
        raise RuntimeError("the compiled norm kernel gave a wrong value")
    got = np.zeros(3, np.float32)
    gather_sketch(addrs[:2], np.array([1, 0]), np.array([1, 1]), np.array([1, 2]), got)
    if list(got) != [4.0, np.inf, 1.0]:
        raise RuntimeError("the compiled sketch kernel gave a wrong value")
    return {"forward_sums": forward_sums, "tensor_norms": tensor_norms, "gather_sketch": gather_sketch}


def available() -> bool:
    """Whether the compiled pass can be used (compiles it the first time, which takes seconds;
    later processes load numba's cache). `WARNINGLIGHT_EAGER=1` in the environment says no: the
    eager ops then run, e.g. to compare the two (`bench/overhead.py`, `bench/overhead_breakdown.py`)."""
    if _eager_forced():
        return False
    with _lock:
        if "ok" not in _state:
            try:
                _state.update(_build())
                _state["ok"] = True
            except Exception:  # no numba, or it cannot compile here: the eager path stays
                _state["ok"] = False
        return bool(_state["ok"])


def _eager_forced() -> bool:
    return os.environ.get("WARNINGLIGHT_EAGER", "") not in ("", "0")


def ready(name: str = "") -> bool:
    """Whether the kernels (`name`: also that extra one, "word_sums", "scaled_norms" or
    "norms_word_sums") are loaded and passed their checks, without waiting. The first call
    `LOAD_AFTER_S` seconds or more after the process's first call starts loading them on a
    thread of its own; calls say True once they are there. False for good without numba or
    with `WARNINGLIGHT_EAGER=1`."""
    if _eager_forced():
        return False
    key = f"{name}_ok" if name else "ok"
    if key in _state:  # a dict read: no lock, so a step never waits on a load in progress
        return bool(_state[key])
    now = time.monotonic()
    if not _first_asked:
        _first_asked.append(now)
    if name in _loading or now - _first_asked[0] < LOAD_AFTER_S:
        return False
    with _loading_lock:
        if name not in _loading:
            build = _EXTRAS.get(name)
            load = (lambda: _extra_available(name, build)) if build else available
            # not a daemon: an interpreter that exits during the load waits for it rather than
            # tearing numba down under it
            _loading[name] = threading.Thread(target=load, name="warninglight-kernels")
            _loading[name].start()
    return False


def forward_sums(m: np.ndarray, slots: np.ndarray, centre: np.ndarray, half: np.ndarray,
                 bounded: bool, dead_eps: float, sums: np.ndarray, absmax: np.ndarray) -> None:
    """One pass over a (rows, units) float32 sample matrix: per unit its finite count, sum and
    sum of squares, zeros, saturated count (|x - centre| >= half, when `bounded`) and whether it
    is dead (max |x| <= dead_eps), added into column `slots[unit]` of `sums` (7, S) float64 (row 4
    unused), and its max |x| into `absmax` (S,) float32. A non-finite value counts as 0 in all
    but the finite count."""
    _state["forward_sums"](m, slots, centre, half, bounded, dead_eps, sums, absmax)


def tensor_norms(addrs: np.ndarray, lens: np.ndarray, out: np.ndarray) -> bool:
    """The L2 norm of each of `len(addrs)` contiguous float32 CPU tensors, given as data
    addresses (int64) and element counts, into `out` (float32, rounded from a float64 sum of
    squares: no float32 overflow or underflow on the way). True if every norm is finite.

    The caller keeps the tensors alive and guarantees what the addresses point at."""
    return bool(_state["tensor_norms"](addrs, lens, out))


def gather_sketch(addrs: np.ndarray, offsets: np.ndarray, strides: np.ndarray, ks: np.ndarray,
                  out: np.ndarray) -> None:
    """Coordinates `offsets[i] + j * strides[i]`, j < ks[i], of each contiguous float32 CPU
    tensor at `addrs[i]`, one after the other into `out` (float32). The caller keeps the tensors
    alive and guarantees each holds at least `offsets[i] + (ks[i] - 1) * strides[i] + 1` values."""
    _state["gather_sketch"](addrs, offsets, strides, ks, out)


def _build_word_sums() -> Any:
    from .jit import word_sums

    t = [np.array([1.0, -2.5, -1e30, -3e38], np.float32), np.array([3.0], np.float64)]
    got = np.zeros(2, np.int64)
    word_sums(np.array([a.ctypes.data for a in t]), np.array([4, 2]), np.array([1, 1]), got)
    want = sum(int(a.view(np.uint32).astype(np.uint64).sum()) % 2**32 for a in t)
    if list(got) != [0, want]:
        raise RuntimeError("the compiled checksum kernel gave a wrong value")
    return word_sums


def _extra_available(name: str, build: Any) -> bool:
    """Whether the kernel `name` can be used: built by `build` on first use (compiled, or loaded
    from numba's cache); False without numba, with `WARNINGLIGHT_EAGER=1`, or when it fails its
    check, and then the eager ops stay."""
    if not available():
        return False
    with _lock:
        if f"{name}_ok" not in _state:
            try:
                _state[name] = build()
                _state[f"{name}_ok"] = True
            except Exception:  # numba cannot compile it here: the eager ops stay
                _state[f"{name}_ok"] = False
        return bool(_state[f"{name}_ok"])


def word_sums_available() -> bool:
    """Whether `word_sums` can be used (see `_extra_available`)."""
    return _extra_available("word_sums", _build_word_sums)


def word_sums(addrs: np.ndarray, words: np.ndarray, slots: np.ndarray, out: np.ndarray) -> None:
    """For each contiguous CPU tensor at `addrs[i]` (int64) holding `words[i]` 32-bit words: the
    wrapping (mod 2^32) sum of its words read as unsigned integers, added into `out[slots[i]]`
    (int64). The caller keeps the tensors alive and guarantees what the addresses point at."""
    _state["word_sums"](addrs, words, slots, out)


def _build_norms_word_sums() -> Any:
    from .jit import norms_word_sums

    t = [np.array([3.0, -4.0], np.float32), np.array([np.inf, 1e-30], np.float32), np.zeros(0, np.float32)]
    addrs, lens = np.array([a.ctypes.data for a in t]), np.array([a.size for a in t])
    norms, sums = np.zeros(3, np.float32), np.zeros(3, np.int64)
    finite = norms_word_sums(addrs, lens, norms, sums)
    want = [int(a.view(np.uint32).astype(np.uint64).sum()) % 2**32 for a in t]
    if finite or list(norms) != [5.0, np.inf, 0.0] or list(sums) != want:
        raise RuntimeError("the compiled norm-and-checksum kernel gave a wrong value")
    return norms_word_sums


def norms_word_sums_available() -> bool:
    """Whether `norms_word_sums` can be used (see `_extra_available`)."""
    return _extra_available("norms_word_sums", _build_norms_word_sums)


def norms_word_sums(addrs: np.ndarray, lens: np.ndarray, out: np.ndarray, sums: np.ndarray) -> bool:
    """`tensor_norms` and `word_sums` in one read of each contiguous float32 CPU tensor at
    `addrs[i]` holding `lens[i]` values: its L2 norm into `out[i]` (float32 from a float64 sum
    of squares) and the wrapping (mod 2^32) sum of its 32-bit words into `sums[i]` (int64).
    True if every norm is finite. The caller keeps the tensors alive and guarantees what the
    addresses point at."""
    return bool(_state["norms_word_sums"](addrs, lens, out, sums))


def _build_scaled_norms() -> Any:
    from .jit import scaled_norms

    buf = np.array([3.0, 4.0, 7.0, 1.0, -2.0], np.float32)
    out = np.zeros(2, np.float32)
    scaled_norms(buf, np.array([0, 3]), np.array([2, 1]), np.float32(0.5), out)
    if list(out) != [5.0, 1.0] or list(buf) != [1.5, 2.0, 3.5, 0.5, -1.0]:
        raise RuntimeError("the compiled scaled-norm kernel gave a wrong value")
    return scaled_norms


def scaled_norms_available() -> bool:
    """Whether `scaled_norms` can be used (see `_extra_available`)."""
    return _extra_available("scaled_norms", _build_scaled_norms)


def scaled_norms(buf: np.ndarray, offsets: np.ndarray, lens: np.ndarray, scale: float,
                 out: np.ndarray) -> None:
    """One pass over a flat float32 buffer: the L2 norm of each segment `[offsets[i], offsets[i]
    + lens[i])` (ascending, not overlapping) as it was, into `out` (float32, from a float64 sum
    of squares), while every value of the buffer is multiplied by `scale` in float32, as
    `torch.Tensor.mul_(scale)` does."""
    _state["scaled_norms"](buf, offsets, lens, np.float32(scale), out)


_EXTRAS = {"word_sums": _build_word_sums, "scaled_norms": _build_scaled_norms,
           "norms_word_sums": _build_norms_word_sums}
