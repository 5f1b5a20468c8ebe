"""The recorder's compiled kernels (tracer/jit.py, called through tracer/kernels.py) against numpy,
on sizes that take their vector loops and the remainders after them."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from warninglight.tracer import kernels

SIZES = [0, 1, 5, 17, 2047, 2048, 2049, 4097, 131_073]


@pytest.fixture(autouse=True)
def _loaded() -> None:
    assert kernels.available()


def _tensors(rng: np.random.Generator) -> list[np.ndarray]:
    ts = [(rng.standard_normal(n) * rng.uniform(1e-3, 1e3)).astype(np.float32) for n in SIZES]
    ts[3][4] = np.nan
    return ts


def _addrs(ts: list[np.ndarray]) -> tuple[np.ndarray, np.ndarray]:
    return np.array([t.ctypes.data for t in ts], np.int64), np.array([t.size for t in ts], np.int64)


def _words(t: np.ndarray) -> int:
    return int(t.view(np.uint32).astype(np.uint64).sum()) % 2**32


def test_norms_and_word_sums_equal_numpy() -> None:
    ts = _tensors(np.random.default_rng(0))
    addrs, lens = _addrs(ts)
    want = np.array([np.sqrt(np.sum(t.astype(np.float64) ** 2)) for t in ts]).astype(np.float32)
    norms = np.zeros(len(ts), np.float32)
    assert not kernels.tensor_norms(addrs, lens, norms)  # one NaN
    np.testing.assert_allclose(norms, want, rtol=1e-6)
    fused, sums = np.zeros(len(ts), np.float32), np.zeros(len(ts), np.int64)
    assert not kernels.norms_word_sums(addrs, lens, fused, sums)
    np.testing.assert_array_equal(fused, norms)
    assert list(sums) == [_words(t) for t in ts]
    finite = [i for i, t in enumerate(ts) if np.isfinite(t).all()]
    assert kernels.tensor_norms(addrs[finite], lens[finite], norms)
    slots, out = np.arange(len(ts)) % 3, np.full(3, 7, np.int64)
    kernels.word_sums(addrs, lens, slots, out)
    assert list(out) == [7 + sum(_words(t) for t, s in zip(ts, slots, strict=True) if s == k) for k in range(3)]


def test_sketch_and_scaled_norms_equal_numpy() -> None:
    rng = np.random.default_rng(1)
    ts = [t for t in _tensors(rng) if t.size >= 5]
    addrs, _ = _addrs(ts)
    ks = np.array([min(t.size, 7) for t in ts], np.int64)
    strides = np.array([max(t.size // 7, 1) for t in ts], np.int64)
    offsets = np.array([t.size - 1 - (k - 1) * s for t, k, s in zip(ts, ks, strides, strict=True)], np.int64)
    got = np.zeros(int(ks.sum()), np.float32)
    kernels.gather_sketch(addrs, offsets, strides, ks, got)
    want = np.concatenate([t[o::s][:k] for t, o, s, k in zip(ts, offsets, strides, ks, strict=True)])
    np.testing.assert_array_equal(got, want)

    buf = rng.standard_normal(20_000).astype(np.float32)
    offs, lens = np.array([3, 100, 2500, 2500, 9000], np.int64), np.array([90, 2400, 0, 4099, 10_000], np.int64)
    norms = np.zeros(5, np.float32)
    before = buf.copy()
    kernels.scaled_norms(buf, offs, lens, 0.37, norms)
    np.testing.assert_array_equal(buf, before * np.float32(0.37))
    want = [np.sqrt(np.sum(before[o:o + n].astype(np.float64) ** 2)) for o, n in zip(offs, lens, strict=True)]
    np.testing.assert_allclose(norms, np.array(want, np.float32), rtol=1e-6)


def test_one_factor_is_found_where_every_value_was_rescaled_and_nowhere_else() -> None:
    # the factor clipping rescales gradients by, as float32 multiplication leaves it; any value
    # changed otherwise (a zero, a clamp, a NaN, a sign), or nothing but zeros, gives none
    rng = np.random.default_rng(0)
    before = (rng.standard_normal(833) * np.logspace(-6, 3, 833)).astype(np.float32)
    before[::7] = 0.0
    for c in (1.0, 0.25, 1 / 3, 7.5e-5, 40.0):
        got = kernels.one_factor(before, before * np.float32(c), 2.0**-20)
        assert got == pytest.approx(c, rel=2e-7)
    # a huge gradient clipped: its smallest values' products fall below float32's normal range
    tiny = np.array([3.0, 1e-33, 2e-40, -7e-36], np.float32)
    assert kernels.one_factor(tiny, tiny * np.float32(1e-6), 2.0**-20) == pytest.approx(1e-6, rel=2e-7)
    changes = {"zeroed": (5, 0.0), "clamped": (int(np.argmax(before)), 1e-3), "NaN": (9, np.nan),
               "sign": (11, -before[11] * 0.5), "from zero": (7, 1e-30), "infinite": (12, np.inf)}
    for name, (i, value) in changes.items():
        after = before * np.float32(0.5)
        after[i] = value
        assert kernels.one_factor(before, after, 2.0**-20) is None, name
    zeros = np.zeros(16, np.float32)
    assert kernels.one_factor(zeros, zeros, 2.0**-20) is None
    assert kernels.one_factor(before[:0], before[:0], 2.0**-20) is None


def test_the_rows_copier_copies_each_samples_rows_in_one_call() -> None:
    # three samples of different widths and strides into the columns of one staging buffer, as
    # three calls of the row copier would put them
    import ctypes

    rng = np.random.default_rng(2)
    srcs = [rng.standard_normal((40, u)).astype(np.float32) for u in (3, 17, 64)]
    buf, want = np.zeros((8, 3 + 17 + 64), np.float32), np.zeros((8, 3 + 17 + 64), np.float32)
    rows, col = [], 0
    for src, step in zip(srcs, (5, 3, 1), strict=True):
        u = src.shape[1]
        want[:, col:col + u] = src[::step][:8]
        rows.append((step * u, buf.ctypes.data + 4 * col, buf.shape[1], 8, u))
        col += u
    addrs = (ctypes.c_int64 * 3)(*(s.ctypes.data for s in srcs))
    table = np.array(rows, np.int64)
    kernels.rows_copier()(ctypes.addressof(addrs), table.ctypes.data, 3)
    assert np.array_equal(buf, want)


def test_the_row_copier_copies_strided_rows_into_a_buffers_columns() -> None:
    rng = np.random.default_rng(3)
    srcs = [rng.standard_normal((n, u)).astype(np.float32) for n, u in ((768, 128), (40, 3), (1, 4099))]
    picks = [(16, 48), (3, 13), (1, 1)]  # (rows, every k-th row)
    buf = np.zeros((16, 3 + 128 + 4099 + 5), np.float32)
    cols = [3, 0, 131]
    copy = kernels.row_copier()
    for s, (r, k), c in zip(srcs, picks, cols, strict=True):
        copy(s.ctypes.data, k * s.shape[1], buf[:, c:].ctypes.data, buf.shape[1], r, s.shape[1])
    for s, (r, k), c in zip(srcs, picks, cols, strict=True):
        np.testing.assert_array_equal(buf[:r, c:c + s.shape[1]], s[::k][:r])
        assert not buf[r:, c:c + s.shape[1]].any()  # nothing beyond the rows
    assert not buf[:, -5:].any()


@pytest.mark.parametrize("bounded", [True, False])
def test_forward_sums_equal_numpy_on_a_slice_of_a_wider_buffer(bounded: bool) -> None:
    rng = np.random.default_rng(2)
    rows, units, slots_n = 16, 1300, 9
    wide = rng.standard_normal((rows, units + 77)).astype(np.float32)
    wide[0, 1], wide[2, 2], wide[3, 5] = np.nan, -np.inf, np.inf
    wide[:, 7] = 0.0
    wide[:, 8] = 1e-7
    m = wide[:, 30:30 + units]  # rows lie units + 77 apart
    slots = rng.integers(0, slots_n, units)
    centre = rng.standard_normal(units).astype(np.float32)
    half = np.abs(rng.standard_normal(units)).astype(np.float32)
    sums, absmax = np.zeros((7, slots_n)), np.zeros(slots_n, np.float32)
    kernels.forward_sums(m, slots, centre, half, bounded, 1e-6, sums, absmax)

    fin = np.isfinite(m)
    x = np.where(fin, m, np.float32(0))
    per_unit = [fin.sum(0), x.sum(0, dtype=np.float64), (x.astype(np.float64) ** 2).sum(0),
                (fin & (x == 0)).sum(0), np.zeros(units),
                (np.abs(x - centre) >= half).sum(0) if bounded else np.zeros(units),
                (np.abs(x).max(0) <= 1e-6)]
    for row, values in enumerate(per_unit):
        want = np.bincount(slots, weights=np.asarray(values, np.float64), minlength=slots_n)
        np.testing.assert_allclose(sums[row], want, rtol=1e-5, atol=1e-3, err_msg=f"row {row}")
    want_max = np.zeros(slots_n, np.float32)
    np.maximum.at(want_max, slots, np.abs(x).max(0))
    np.testing.assert_array_equal(absmax, want_max)


def _eager_sketch_sums(rows: torch.Tensor, k: int, cu: torch.Tensor, cs: torch.Tensor, scale: torch.Tensor,
                       comp: torch.Tensor, n: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The eager ops `kernels.sketch_sums` stands in for (`ParamProbe._sketch_sums`)."""
    steps = rows.shape[0]
    f, e = rows[:, :k], rows[:, k:2 * k]
    updates, drift, prods = torch.empty(steps + 1, k), torch.empty(steps, k), torch.empty(4, steps, k)
    updates[0] = cu
    update, prev = updates[1:], updates[:-1]
    torch.sub(e, f, out=update)
    torch.sub(f[:1], cs, out=drift[:1])
    torch.sub(f[1:], e[:-1], out=drift[1:])
    for i, (a, b) in enumerate(((update, update), (update, prev), (prev, prev), (drift, drift))):
        torch.mul(a, b, out=prods[i])
    scaled = torch.empty(k, 4, steps)
    torch.mul(prods.permute(2, 0, 1), scale[:, None, None], out=scaled)
    return torch.zeros(n, 4, steps).index_add_(0, comp, scaled), update[-1].clone(), e[-1].clone()


def test_the_sketch_arithmetic_equals_the_eager_ops_bit_for_bit() -> None:
    # three batches of steps, each carrying its last update and sketch to the next; values over
    # twelve decades, so that a product or a sum taken in another order would show
    rng = np.random.default_rng(3)
    k, n, width = 300, 7, 700
    scale = torch.from_numpy(rng.uniform(1, 50, k).astype(np.float32))
    comp = torch.from_numpy(np.sort(rng.integers(0, n, k)))
    cu, cs = torch.zeros(k), torch.from_numpy(rng.standard_normal(k).astype(np.float32))
    cu_np, cs_np, out = cu.numpy().copy(), cs.numpy().copy(), np.zeros(n * 4 * 8, np.float32)
    for steps in (8, 3, 8):
        rows = torch.from_numpy((rng.standard_normal((steps, width)) * 10.0 ** rng.uniform(-6, 6, (steps, width)))
                                .astype(np.float32))
        want, cu, cs = _eager_sketch_sums(rows, k, cu, cs, scale, comp, n)
        kernels.sketch_sums(rows.numpy(), k, steps, cu_np, cs_np, scale.numpy(), comp.numpy(), n, out)
        assert np.array_equal(out[:n * 4 * steps].reshape(n, 4, steps), want.numpy())
        assert np.array_equal(cu_np, cu.numpy()) and np.array_equal(cs_np, cs.numpy())
    with pytest.raises(TypeError, match="wrong size"):  # a component past the sums
        kernels.sketch_sums(rows.numpy(), k, 8, cu_np, cs_np, scale.numpy(), comp.numpy(), n - 1, out)


def test_a_kernel_refuses_arrays_of_the_wrong_dtype_or_layout() -> None:
    t = np.ones(4, np.float32)
    with pytest.raises(TypeError, match="int64"):
        kernels.tensor_norms(np.array([t.ctypes.data], np.uint64), np.array([4]), np.zeros(1, np.float32))
    with pytest.raises(TypeError, match="contiguous"):
        kernels.tensor_norms(np.array([t.ctypes.data, 0] * 2)[::2], np.array([4, 4]), np.zeros(2, np.float32))
    with pytest.raises(TypeError, match="layout"):
        kernels.forward_sums(np.ones((3, 4), np.float32)[:, ::2], np.zeros(2, np.int64), np.zeros(2, np.float32),
                             np.ones(2, np.float32), True, 0.0, np.zeros((7, 1)), np.zeros(1, np.float32))
    with pytest.raises(TypeError, match="slot"):
        kernels.word_sums(np.array([t.ctypes.data]), np.array([4]), np.array([3]), np.zeros(2, np.int64))


def test_a_count_is_read_again_when_the_address_cache_started_again(monkeypatch: pytest.MonkeyPatch) -> None:
    # the cache of arrays the kernels have seen starts again when it is full of live arrays; an
    # array whose count or max is then asked for (the sketch's components, checked after the
    # last array of the call is registered) is registered again, not a KeyError
    monkeypatch.setattr(kernels, "_addresses", {})
    monkeypatch.setattr(kernels, "_ADDRESSES_MAX", 16)
    rng = np.random.default_rng(5)
    k, n, steps = 40, 3, 2
    rows = rng.standard_normal((steps, 2 * k)).astype(np.float32)
    cu, cs = np.zeros(k, np.float32), rng.standard_normal(k).astype(np.float32)
    scale, comp = np.ones(k, np.float32), np.sort(rng.integers(0, n, k))
    want = np.zeros(n * 4 * steps, np.float32)
    kernels.sketch_sums(rows, k, steps, cu.copy(), cs.copy(), scale, comp.copy(), n, want)
    kernels._addresses.clear()
    others = [np.zeros(1, np.float32) for _ in range(16 - 5)]  # live: the clear keeps nothing
    for a in others:
        kernels._at(a, kernels._F32)
    out, comp2 = np.zeros(n * 4 * steps, np.float32), comp.copy()
    kernels.sketch_sums(rows, k, steps, cu.copy(), cs.copy(), scale, comp2, n, out)  # `out` fills it
    assert np.array_equal(out, want) and len(kernels._addresses) == 2


def test_a_pass_over_many_values_gives_the_same_norms_on_any_number_of_threads() -> None:
    # past SPLIT_FROM values the norm kernels run in parts that torch's OpenMP threads claim:
    # the same norms and word sums as numpy, bit for bit on one thread and on two
    rng = np.random.default_rng(6)
    ts = _tensors(rng) + [rng.standard_normal(n).astype(np.float32) for n in (kernels.SPLIT_FROM, 3 * kernels._PART + 5)]
    addrs, lens = _addrs(ts)
    assert kernels._plan(lens) is not None and len(kernels._plan(lens).arrays[2]) > len(ts)  # tensors cut
    want = np.array([np.sqrt(np.sum(t.astype(np.float64) ** 2)) for t in ts]).astype(np.float32)
    threads = torch.get_num_threads()
    got = {}
    try:
        for n in (1, 2):
            torch.set_num_threads(n)
            norms, fused, sums = np.zeros(len(ts), np.float32), np.zeros(len(ts), np.float32), np.zeros(len(ts), np.int64)
            assert not kernels.tensor_norms(addrs, lens, norms)  # one NaN
            assert not kernels.norms_word_sums(addrs, lens, fused, sums)
            got[n] = norms, fused, sums
    finally:
        torch.set_num_threads(threads)
    for norms, fused, sums in got.values():
        np.testing.assert_array_equal(norms, want)
        np.testing.assert_array_equal(fused, want)
        assert list(sums) == [_words(t) for t in ts]
    finite = [i for i, t in enumerate(ts) if np.isfinite(t).all()]
    norms = np.zeros(len(finite), np.float32)
    assert kernels.tensor_norms(np.ascontiguousarray(addrs[finite]), np.ascontiguousarray(lens[finite]), norms)
    np.testing.assert_array_equal(norms, want[finite])


@pytest.mark.skipif(not torch.__config__.parallel_info().count("parallel backend: OpenMP"),
                    reason="torch runs on another threading backend")
def test_the_parts_run_on_torchs_openmp_threads() -> None:
    # the GOMP_parallel found is the one torch's own ops call (the dynamic linker's order)
    assert kernels._state["openmp"] is not None
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        assert kernels.parts_on_threads()
        torch.set_num_threads(1)
        assert not kernels.parts_on_threads()
    finally:
        torch.set_num_threads(threads)


def test_the_parts_cover_every_tensor_in_order() -> None:
    rng = np.random.default_rng(7)
    for _ in range(200):
        counts = [int(c) for c in rng.choice([0, 1, 2047, 2048, 5000, 70_000, 300_000], size=rng.integers(1, 9))]
        plan = kernels._cut(counts, 1, int(rng.choice([kernels._BLOCK, 10_000, 1 << 17])))
        if not sum(counts):
            assert plan is None
            continue
        assert plan is not None
        task, bounds, tensor, first, length, _, _, firsts = plan.arrays
        parts = int(task[1])
        assert bounds[0] == 0 and bounds[-1] == len(tensor) and len(bounds) == parts + 1
        assert (np.diff(bounds) >= 0).all() and list(firsts) == list(np.searchsorted(tensor, range(len(counts) + 1)))
        for i, n in enumerate(counts):  # each tensor: one run of segments, end to end
            segs = range(firsts[i], firsts[i + 1])
            assert len(segs) >= 1 and first[segs[0]] == 0 and sum(length[s] for s in segs) == n
            assert all(first[s + 1] == first[s] + length[s] for s in segs[:-1])
            assert all(length[s] > 0 for s in segs) or n == 0
        assert (first % kernels._BLOCK == 0).all()  # every cut at a multiple of the block in its tensor
    assert kernels._cut([100, 200], 1000, kernels._PART) is None  # under the threshold: one piece
