"""Estimates are stored to the significand bits their sampling error leaves meaningful.

The columns computed from a subsample or a sketch keep `schema.SAMPLED_BITS` bits (within
2**-11 of the computed value); every other column keeps all of its bits; and the engine reaches
the same verdicts on the rounded values.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import duckdb
import numpy as np
import pyarrow.parquet as pq
import pytest
import torch
import torch.nn.functional as F
from warninglight.forensics.explaining.analysis import analyze
from warninglight.forensics.trace.store import info, open_trace
from warninglight.lab import zoo
from warninglight.tracer import schema, watch
from warninglight.tracer.writer import round_significand, rounded_table

SAMPLES = Path(__file__).resolve().parents[1] / "sample_traces"
ROUNDED = {c.name: c.bits for c in schema.HEALTH_COLUMNS if c.bits is not None}
EXACT = [m for m in schema.HEALTH_METRICS if m not in ROUNDED]


def test_the_estimates_and_only_they_are_rounded() -> None:
    assert sorted(ROUNDED) == sorted(["out_mean", "out_rms", "out_absmax", "update_norm_l2", "update_ratio",
                                      "update_cos", "pred_entropy_nats", "pred_maxprob"])
    assert set(ROUNDED.values()) == {schema.SAMPLED_BITS}
    assert {"grad_norm_l2", "weight_norm_l2", "weight_drift_l2", "out_zero_frac"} <= set(EXACT)


def test_rounding_is_to_nearest_within_half_a_unit_of_the_last_kept_bit() -> None:
    rng = np.random.default_rng(0)
    x = (rng.normal(size=200_000) * 10.0 ** rng.uniform(-30, 30, 200_000)).astype(np.float32)
    for bits in (0, 4, 10, 16, 22):
        y = round_significand(x, bits)
        assert y.dtype == np.float32 and np.isfinite(y).all()
        assert (np.abs(y.astype(np.float64) - x) <= 2.0 ** -(bits + 1) * np.abs(x)).all()
        assert not (y.view(np.uint32) & np.uint32((1 << (23 - bits)) - 1)).any()  # low bits gone
        assert np.array_equal(round_significand(y, bits), y)  # a rounded value is kept as it is
        assert (np.sign(y) == np.sign(x)).all()
    assert np.array_equal(round_significand(x, 23), x)


def test_ties_go_to_even_and_special_values_are_kept() -> None:
    ulp = 2.0 ** -10  # of a value in [1, 2) kept to 10 bits
    x = np.array([1 + ulp / 2, 1 + 1.5 * ulp, 1 + ulp / 2 + 2 ** -23, -(1 + 1.5 * ulp), 2 - ulp / 2], np.float32)
    assert round_significand(x, 10).tolist() == [1.0, 1 + 2 * ulp, 1 + ulp, -(1 + 2 * ulp), 2.0]
    special = np.array([np.nan, np.inf, -np.inf, 0.0, -0.0, 0.5, -4.0], np.float32)
    got = round_significand(special, 10)
    assert np.isnan(got[0]) and got[1:].tolist() == special[1:].tolist()
    assert np.signbit(got[4])
    big = np.array([np.finfo(np.float32).max, -np.finfo(np.float32).max], np.float32)
    assert np.isfinite(round_significand(big, 10)).all()  # cut, never rounded to infinity


def _record(path: Path, **kw: object) -> None:
    torch.manual_seed(0)
    model = zoo.mlp(hidden=64, depth=2)  # tensors above the 256-coordinate sketch: estimates
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    with watch(model, opt, path, flush_every_steps=8, **kw):
        for _, (_, x, y) in zip(range(20), zoo.batches(*zoo.teacher_classification(512), 32), strict=False):
            F.cross_entropy(model(x), y).backward()
            opt.step()
            opt.zero_grad()


def _health(path: Path) -> dict[str, np.ndarray]:
    glob = schema.segment_glob(path, "health")
    frame = duckdb.sql(f"select * from read_parquet('{glob}') order by step, component").pl()
    return {m: frame[m].to_numpy() for m in schema.HEALTH_METRICS}  # nulls as NaN


def test_a_recorded_trace_stores_the_estimates_rounded_and_the_rest_whole(tmp_path: Path) -> None:
    _record(tmp_path / "default")
    _record(tmp_path / "full", full_precision=True)  # the same run: the recorder only reads
    stored, full = _health(tmp_path / "default"), _health(tmp_path / "full")
    for m in EXACT:
        assert np.array_equal(stored[m], full[m], equal_nan=True), m
    for m, bits in ROUNDED.items():
        was = full[m].astype(np.float32)
        assert np.array_equal(stored[m].astype(np.float32), round_significand(was, bits), equal_nan=True), m
    some = full["out_rms"].astype(np.float32)
    assert not np.array_equal(some, round_significand(some, schema.SAMPLED_BITS))  # there was something to round
    config = {name: json.loads(schema.manifest_path(tmp_path / name, 0).read_text())["config"]
              for name in ("default", "full")}
    assert config["default"]["significand_bits"] == ROUNDED and config["full"]["significand_bits"] == {}
    for name, bits in (("default", schema.SAMPLED_BITS), ("full", None)):  # what `info` says of it
        trace = open_trace(tmp_path / name)
        try:
            assert info(trace)["estimate_bits"] == bits
        finally:
            trace.close()


def _rounded_copy(src: Path, dst: Path) -> None:
    """`src` with its estimate columns rounded as the recorder now stores them."""
    shutil.copytree(src, dst)
    for f in (dst / "health").rglob("*.parquet"):
        pq.write_table(rounded_table(pq.read_table(f)), f, **schema.PARQUET_WRITE_OPTIONS)


def _close(a: object, b: object, where: str = "") -> None:
    """Equal, except the values read from rounded columns (an alarm's value and median: to the
    rounding) and the robust z computed from them (an alarm's magnitude: within 3%)."""
    if isinstance(a, dict) and isinstance(b, dict):
        assert a.keys() == b.keys(), where
        for k in a:
            if k not in ("trace", "size_bytes"):
                _close(a[k], b[k], f"{where}.{k}")
    elif isinstance(a, list) and isinstance(b, list):
        assert len(a) == len(b), where
        for i, (x, y) in enumerate(zip(a, b, strict=True)):
            _close(x, y, f"{where}[{i}]")
    elif where.endswith(".magnitude") and isinstance(a, float) and isinstance(b, float):
        assert b == pytest.approx(a, rel=0.03), where
    elif where.endswith((".value", ".median")) and isinstance(a, float) and isinstance(b, float):
        assert b == pytest.approx(a, rel=2.0 ** -schema.SAMPLED_BITS), where
    else:
        assert a == b, where


@pytest.mark.parametrize("name", sorted(p.name for p in SAMPLES.iterdir() if (p / "health").is_dir()))
def test_the_engine_judges_a_sample_trace_the_same_with_its_estimates_rounded(tmp_path: Path, name: str) -> None:
    _rounded_copy(SAMPLES / name, tmp_path / name)
    before, after = analyze(SAMPLES / name).to_dict(), analyze(tmp_path / name).to_dict()
    _close(before, after)
    assert after["trace_info"]["size_bytes"] < before["trace_info"]["size_bytes"]
    assert before["trace_info"]["estimate_bits"] is None  # recorded before estimates were rounded
