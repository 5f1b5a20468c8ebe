"""Grow a real recorded trace to the size of a real run, without inventing a single value.

Source: the shipped GPT sample traces (`gpt_clean`, and `gpt_weight_corruption`, the same run
with one MLP layer's weights scaled x10 at step 150; both are identical before step 150).

- Components: the model's 18 components are copied `copies` times under new names
  (`c7.h.0.mlp.c_fc`); copy 0 keeps the recorded names.
- Steps: after the recorded 300 steps every series runs the second half of the run backwards and
  forwards (300, 299, ..., 150, 151, ..., 300, 299, ...), so each component's series stays
  continuous. Copy k runs the same walk shifted by 5k steps, so the copies are not in lock-step.
- The faulty trace is the clean one except for copy 0's last forward pass (source steps
  150..300), which is taken from the faulty recording: its weight corruption lands at grown step
  `steps - 150` on `h.0.mlp.c_fc`, after a history that is exactly the recorded one.

Written in the current trace format (segment file names with their step ranges, the schema's
Parquet options, one segment per 100 steps as the recorder writes them).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import polars as pl
import pyarrow as pa
import pyarrow.parquet as pq
from warninglight.tracer import schema

SAMPLES = Path(__file__).resolve().parent.parent / "sample_traces"
RECORDED = 300      # steps in each sample trace
TURN = 150          # the walk turns between TURN and RECORDED
FAULT_SOURCE = 150  # the drill acted at this recorded step
SHIFT = 5           # copy k's walk starts SHIFT * k steps later
SEGMENT_STEPS = 100


@dataclass(frozen=True)
class Source:
    """The recorded tables of one sample trace, as arrays indexed by recorded step - 1."""

    components: pl.DataFrame
    health: np.ndarray   # (RECORDED, C, M) float64, NaN where null
    valid: np.ndarray    # (RECORDED, C, M) bool
    steps: pl.DataFrame  # one row per recorded step, sorted


def load(name: str) -> Source:
    """Read one sample trace into arrays (component order: the components table's)."""
    root = SAMPLES / name
    comps = pl.read_parquet(root / "components" / "**" / "*.parquet").sort("forward_index")
    names = comps["component"].to_list()
    health = pl.read_parquet(root / "health" / "**" / "*.parquet", hive_partitioning=False)
    health = health.with_columns(pl.col("component").replace_strict(
        {c: i for i, c in enumerate(names)}, return_dtype=pl.Int64).alias("ci")).sort("step", "ci")
    metrics = list(schema.HEALTH_METRICS)
    values = health.select([pl.col(m).cast(pl.Float64) for m in metrics]).to_numpy()
    shape = (RECORDED, len(names), len(metrics))
    assert len(health) == RECORDED * len(names), "a sample trace has every component at every step"
    steps = pl.read_parquet(root / "steps" / "**" / "*.parquet", hive_partitioning=False).sort("step")
    return Source(comps, values.reshape(shape), ~np.isnan(values).reshape(shape), steps)


def walk(grown: np.ndarray) -> np.ndarray:
    """Recorded step (1-based) that grown step `grown` (1-based, may be shifted) replays."""
    p = (grown - RECORDED - 1) % (2 * (RECORDED - TURN)) + 1
    back = RECORDED - p
    fwd = TURN + (p - (RECORDED - TURN))
    return np.where(grown <= RECORDED, grown, np.where(p <= RECORDED - TURN, back, fwd))


def steps_for(target: int, n_components: int) -> int:
    """Grown length closest to `target` component-steps that ends on a full forward pass."""
    period = 2 * (RECORDED - TURN)
    passes = max(1, round((target / n_components - RECORDED) / period))
    return RECORDED + passes * period


def _write(root: Path, table: str, data: pa.Table, seq: int, span: tuple[int, int] | None) -> int:
    path = schema.segment_path(root, table, 0, 1, seq, span)
    path.parent.mkdir(parents=True, exist_ok=True)
    pq.write_table(data, path, **schema.PARQUET_WRITE_OPTIONS)
    return path.stat().st_size


def _commit(root: Path, seq: int, span: tuple[int, int], rows: dict[str, int]) -> None:
    """The segment's commit record, written after its tables, as the recorder's writer does."""
    path = schema.commit_path(root, 0, 1, seq, span)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"tables": rows, "steps": list(span)}))


def _conform(data: pa.Table, table: str) -> pa.Table:
    """`data` in the current schema of `table`: columns the sample trace predates are null."""
    target = schema.SCHEMAS[table]
    return pa.Table.from_arrays(
        [data.column(f.name).cast(f.type) if f.name in data.column_names else pa.nulls(len(data), f.type)
         for f in target], schema=target)


def _components(src: Source, copies: int) -> pa.Table:
    parts = []
    n = len(src.components)
    for k in range(copies):
        prefix = "" if k == 0 else f"c{k}."
        parts.append(src.components.with_columns(
            (pl.lit(prefix) + pl.col("component")).alias("component"),
            pl.when(pl.col("parent_param").is_not_null()).then(pl.lit(prefix) + pl.col("parent_param"))
            .alias("parent_param"),
            pl.col("forward_index") + k * n))
    return _conform(pl.concat(parts).to_arrow(), "components")


def _health(clean: Source, fault: Source | None, names: list[str], first: int, last: int,
            copies: int, fault_from: int | None) -> pa.Table:
    grown = np.arange(first, last + 1)
    n_comp = clean.health.shape[1]
    src_step = walk(grown[:, None] + SHIFT * np.arange(copies)[None, :]) - 1    # (S, K)
    vals = clean.health[src_step]    # (S, K, C, M)
    valid = clean.valid[src_step]
    if fault is not None and fault_from is not None:
        hit = grown >= fault_from
        vals[hit, 0] = fault.health[src_step[hit, 0]]
        valid[hit, 0] = fault.valid[src_step[hit, 0]]
    rows = len(grown) * copies * n_comp
    vals, valid = vals.reshape(rows, -1), valid.reshape(rows, -1)
    cols: dict[str, pa.Array] = {"step": pa.array(np.repeat(grown, copies * n_comp)),
                                 "component": pa.array(names * len(grown))}
    for m, name in enumerate(schema.HEALTH_METRICS):
        typ = schema.SCHEMAS["health"].field(name).type
        v = vals[:, m]
        if pa.types.is_integer(typ):
            v = np.nan_to_num(v).astype(np.int64)
        cols[name] = pa.array(v.astype(typ.to_pandas_dtype()), typ, mask=~valid[:, m])
    return pa.Table.from_pydict(cols, schema=schema.SCHEMAS["health"])


def _steps(clean: Source, fault: Source | None, first: int, last: int, fault_from: int | None) -> pa.Table:
    grown = np.arange(first, last + 1)
    src = walk(grown) - 1
    rows = clean.steps[src.tolist()]
    if fault is not None and fault_from is not None and (grown >= fault_from).any():
        hit = grown >= fault_from
        rows = pl.concat([rows.filter(pl.Series(~hit)), fault.steps[src[hit].tolist()]])
    return _conform(rows.with_columns(pl.Series("step", grown)).to_arrow(), "steps")


def _events(first: int, last: int, every: int) -> pa.Table:
    steps = [s for s in range((first // every + 1) * every, last + 1, every) if s >= first]
    return pa.Table.from_pydict({
        "step": steps, "wall_time_s": [0.0] * len(steps), "kind": ["checkpoint"] * len(steps),
        "path": [f"checkpoints/step-{s:06d}.pt" for s in steps],
        "detail": ["grown trace: no file was written"] * len(steps)}, schema=schema.SCHEMAS["events"])


def grow(out: Path, steps: int, copies: int, faulty: bool, checkpoint_every: int = 1000) -> dict[str, object]:
    """Write a grown trace to `out`; returns its truth (fault component and step, or healthy)."""
    clean = load("gpt_clean")
    fault = load("gpt_weight_corruption") if faulty else None
    assert steps >= RECORDED and (steps - RECORDED) % (2 * (RECORDED - TURN)) == 0, "ends on a forward pass"
    fault_from = steps - (RECORDED - FAULT_SOURCE) if faulty else None
    comps = _components(clean, copies)
    names = comps.column("component").to_pylist()
    size = 0
    for seq, first in enumerate(range(1, steps + 1, SEGMENT_STEPS)):
        last = min(first + SEGMENT_STEPS - 1, steps)
        span = (first, last)
        tables = {"health": _health(clean, fault, names, first, last, copies, fault_from),
                  "steps": _steps(clean, fault, first, last, fault_from)}
        if seq == 0:
            tables["components"] = comps
        if (first - 1) // checkpoint_every != last // checkpoint_every:
            tables["events"] = _events(first, last, checkpoint_every)
        size += sum(_write(out, name, table, seq, span) for name, table in tables.items())
        _commit(out, seq, span, {name: table.num_rows for name, table in tables.items()})
    manifest = {"format_version": schema.FORMAT_VERSION, "run_id": f"grown-{steps}x{len(names)}", "rank": 0,
                "world_size": 1, "model_class": "TinyGPT (grown)", "incarnations": [
                    {"incarnation": 1, "status": "normal", "first_step": 1, "last_step": steps,
                     "steps_recorded": steps, "dropped_steps": 0}]}
    path = schema.manifest_path(out, 0)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(manifest))
    truth = {"healthy": True} if not faulty else {"component": "h.0.mlp.c_fc", "step": fault_from,
                                                   "fault": "weight_corruption"}
    _answer_key(out, steps, fault_from)
    return {**truth, "steps": steps, "components": len(names), "health_rows": steps * len(names),
            "bytes": size}


def _answer_key(out: Path, steps: int, fault_from: int | None) -> None:
    """The source's truth.json, its steps moved to where the grown run has them: `eval --trace`
    scores the grown trace against it, and the report marks the injection."""
    key = json.loads((SAMPLES / ("gpt_clean" if fault_from is None else "gpt_weight_corruption") / "truth.json").read_text())
    shift = 0 if fault_from is None else fault_from - FAULT_SOURCE

    def moved(entry: dict[str, object]) -> dict[str, object]:
        return {k: v + shift if k in ("step", "last_step") and isinstance(v, int) else v for k, v in entry.items()}

    key = {**moved(key), "scenario": f"grown-{'clean' if fault_from is None else 'fault'}", "steps": steps,
           "faults": [moved(f) for f in key.get("faults", [])]}
    (out / "truth.json").write_text(json.dumps(key))
