"""The store: DuckDB views over a real trace, and named errors for what is not one."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import polars as pl
import pytest
from rehearsed import trace
from warninglight.forensics import (
    CorruptSegmentError,
    EmptyTraceError,
    FormatVersionError,
    NotATraceError,
    open_trace,
)
from warninglight.forensics.trace.store import health_frame, health_window, info
from warninglight.tracer import schema


@pytest.fixture
def copy(tmp_path: Path) -> Path:
    out = tmp_path / "trace"
    shutil.copytree(trace("mlp_clean"), out)
    return out


def test_views_expose_the_trace() -> None:
    t = open_trace(trace("mlp_clean"))
    try:
        assert t.one("SELECT count(*), count(DISTINCT step), min(step), max(step) FROM steps") == (300, 300, 1, 300)
        assert t.one("SELECT count(DISTINCT component) FROM health") == (7,)
        assert t.one("SELECT count(*) FROM health WHERE rank = 0 AND incarnation = 1") == (7 * 300,)
        assert t.con.execute("SELECT step FROM checkpoints ORDER BY step").fetchall() == [
            (s,) for s in range(50, 301, 50)]
        roles = dict(t.con.execute("SELECT component, role FROM components").fetchall())
        assert roles["2"] == "param" and roles["3"] == "activation" and roles["6"] == "head"
        assert t.one("SELECT count(*) FROM events WHERE kind = 'start'") == (1,)
        for view in ("health_all", "steps_all", "scalars", "events_all", "components_all", "incarnations"):
            t.sql(f"SELECT * FROM {view} LIMIT 1").fetchall()
        frame = health_frame(t)
        assert isinstance(frame, pl.LazyFrame)
        cols = frame.collect_schema().names()
        assert {"step", "component", "rank", "role", "parent_param", "forward_index", *schema.HEALTH_METRICS} <= set(cols)
    finally:
        t.close()


def test_info_summarises_the_trace() -> None:
    t = open_trace(trace("mlp_clean"))
    try:
        s = info(t)
    finally:
        t.close()
    assert (s["steps"], s["first_step"], s["last_step"], s["incarnations"], s["components"], s["ranks"]) == (
        300, 1, 300, 1, 7, 1)
    assert s["segments"] >= 5 and s["size_bytes"] > 10_000 and s["dropped_steps"] == 0
    assert s["run_id"]


def test_not_a_trace_directory(tmp_path: Path) -> None:
    with pytest.raises(NotATraceError, match="is this a trace directory") as e:
        open_trace(tmp_path)
    assert str(tmp_path / "health") in str(e.value)
    assert "health/rank=0/incarnation=1/part-000000" in str(e.value)
    with pytest.raises(NotATraceError, match="is not a directory"):
        open_trace(tmp_path / "missing")


def test_empty_trace(copy: Path) -> None:
    for table in schema.TABLES:
        shutil.rmtree(copy / table, ignore_errors=True)  # a single-rank trace has no replicas
    t = open_trace(copy)  # the manifest is there: a run killed before its first segment
    try:
        assert info(t)["steps"] == 0
        assert t.warnings == [f"no committed segments under {copy}: the run recorded no complete "
                              "steps yet (the first segment closes after 10 steps or 5 s, then "
                              "every flush_every_steps)"]
        with pytest.raises(EmptyTraceError, match="recorded no complete steps"):
            health_frame(t)
    finally:
        t.close()
    shutil.rmtree(copy / schema.MANIFEST_DIR)
    with pytest.raises(NotATraceError, match="is this a trace directory"):
        open_trace(copy)


def test_corrupted_segment_is_named(copy: Path) -> None:
    seg = sorted((copy / "health").rglob("part-*.parquet"))[1]
    seg.write_bytes(seg.read_bytes()[: seg.stat().st_size // 2])
    with pytest.raises(CorruptSegmentError, match="not readable Parquet") as e:
        open_trace(copy)
    assert str(seg) in str(e.value) and "move it out" in str(e.value)


def test_unknown_format_version_is_named(copy: Path) -> None:
    path = schema.manifest_path(copy, 0)
    manifest = json.loads(path.read_text())
    manifest["format_version"] = 99
    path.write_text(json.dumps(manifest))
    with pytest.raises(FormatVersionError, match="format_version 99") as e:
        open_trace(copy)
    assert str(path) in str(e.value) and "upgrade warninglight" in str(e.value)


def test_temporary_files_are_not_segments(copy: Path) -> None:
    seg_dir = schema.segment_dir(copy, "health", 0, 1)
    (seg_dir / "part-000099.parquet.tmp").write_bytes(b"half written")
    t = open_trace(copy)
    try:
        assert t.one("SELECT count(DISTINCT step) FROM health") == (300,)
    finally:
        t.close()


def test_a_window_read_with_categorical_names_holds_the_rows_read_with_strings(copy: Path) -> None:
    """`health_window(categorical=True)` (what the classifier reads) names each row's component
    as the string read does, also where the components table lacks a name (read as strings)."""
    def both() -> tuple[pl.DataFrame, pl.DataFrame]:
        t = open_trace(copy)
        try:
            return health_window(t, 20, 60), health_window(t, 20, 60, categorical=True)
        finally:
            t.close()

    strings, named = both()
    assert named.schema["component"] == pl.Categorical and strings.height > 0
    assert named.with_columns(pl.col("component").cast(pl.String)).equals(strings)
    # the components table loses one name: its rows are still read, named
    lost = strings["component"][0]
    for path in (copy / "components").rglob("*.parquet"):
        pl.read_parquet(path, hive_partitioning=False).filter(pl.col("component") != lost).write_parquet(path)
    strings, named = both()
    assert named.schema["component"] == pl.Categorical and (named["component"] == lost).sum() > 0
    assert named.with_columns(pl.col("component").cast(pl.String)).equals(strings)


def _both_reads(path: Path, first: int, last: int) -> tuple[pl.DataFrame | None, pl.DataFrame]:
    """(Arrow's read of a window's metric columns, DuckDB's), with the component as text."""
    from warninglight.forensics.trace import store

    t = open_trace(path)
    metrics = list(schema.HEALTH_METRICS)
    try:
        fast = store._arrow_window(store.window_spans(t, "health", first, last), first, last, metrics)
        saved, store._arrow_window = store._arrow_window, lambda *_: None  # type: ignore[assignment]
        try:
            duck = health_window(t, first, last, columns=metrics, categorical=True)
        finally:
            store._arrow_window = saved  # type: ignore[assignment]
    finally:
        t.close()
    assert duck.schema["component"] == pl.Categorical
    return fast, duck


@pytest.mark.parametrize("span", [(1, 300), (20, 60), (100, 100), (51, 150), (299, 400)])
def test_arrow_reads_a_window_as_duckdb_does(span: tuple[int, int]) -> None:
    # the classifier's windows are read by Arrow's Parquet reader: the rows, order and types of
    # DuckDB's read, whether the window cuts a segment or holds it whole
    for name in ("gpt_nan", "cnn_corrupt_batches"):
        fast, duck = _both_reads(Path(__file__).resolve().parents[1] / "sample_traces" / name, *span)
        assert fast is not None and fast.schema == duck.schema and duck.height > 0
        text = pl.col("component").cast(pl.String)
        assert fast.with_columns(text).equals(duck.with_columns(text))


def test_a_window_whose_files_differ_in_columns_is_read_by_duckdb(copy: Path) -> None:
    # one segment written without a metric (an older recorder): DuckDB unifies the files by name
    seg = sorted((copy / "health").rglob("part-*.parquet"))[1]
    pl.read_parquet(seg, hive_partitioning=False).drop("update_cos").write_parquet(seg)
    fast, duck = _both_reads(copy, 1, 300)
    assert fast is None and duck["update_cos"].null_count() > 0 and duck["update_cos"].drop_nulls().len() > 0
    t = open_trace(copy)
    try:  # what the classifier calls: DuckDB's read where Arrow's cannot be
        assert health_window(t, 1, 300, columns=list(schema.HEALTH_METRICS), categorical=True).equals(duck)
    finally:
        t.close()


def _view_sql(t, view: str) -> str:  # noqa: ANN001
    return t.one(f"SELECT sql FROM duckdb_views() WHERE view_name = '{view}'")[0]


def test_files_of_one_schema_are_read_without_unifying_them() -> None:
    # every segment has the same columns and types: the view reads them as they are (binding a
    # union by name read every footer again), and holds the rows a union reads
    from warninglight.forensics.trace.footers import read_files

    t = open_trace(trace("mlp_clean"))
    try:
        assert "union_by_name" not in _view_sql(t, "health_all")
        files = [s.path for s in t.spans if s.table == "health"]
        order = "ORDER BY step, component"
        plain = t.sql(f"SELECT * FROM health_all {order}").pl()
        unified = t.sql(f"SELECT * FROM {read_files(files)} {order}").pl()
        assert "union_by_name" in read_files(files) and plain.height == 7 * 300 and plain.equals(unified)
    finally:
        t.close()


@pytest.mark.parametrize("change", ["order", "type", "both"])
def test_files_whose_columns_differ_in_order_or_type_are_unified_by_name(change: str, copy: Path) -> None:
    # one segment rewritten (by pyarrow, as the recorder writes) with its columns reversed, a FLOAT
    # metric as DOUBLE holding values no FLOAT can, or both: each value is read under its own name
    # and type (read as the other files' FLOAT, the DOUBLE values would be rounded)
    import pyarrow.parquet as pq

    seg = sorted((copy / "health").rglob("part-*.parquet"))[1]
    before = pl.read_parquet(seg, hive_partitioning=False)
    assert before.schema["out_rms"] == pl.Float32
    after = before.select(reversed(before.columns)) if change != "type" else before
    if change != "order":
        after = after.with_columns(pl.col("out_rms").cast(pl.Float64) * (1 + 2**-40))
    pq.write_table(after.to_arrow(), seg)
    t = open_trace(copy)
    try:
        assert "union_by_name" in _view_sql(t, "health_all")
        first, last = before["step"].min(), before["step"].max()
        got = t.sql(f"SELECT step, component, out_rms, grad_norm_l2 FROM health_all WHERE step BETWEEN {first} AND "
                    f"{last} ORDER BY step, component").pl()
        want = after.select("step", "component", pl.col("out_rms").cast(pl.Float64), "grad_norm_l2").sort(
            "step", "component")
        assert got.height == before.height and got.equals(want)
    finally:
        t.close()
