"""The committed sample traces: present, complete, labelled, small, and what the README says."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import duckdb
import pytest
from warninglight.tracer import schema

ROOT = Path(__file__).resolve().parents[1] / "sample_traces"
MAX_TOTAL_BYTES = 20 * 1024 * 1024


def _generator():
    spec = importlib.util.spec_from_file_location("generate", ROOT / "generate.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


GENERATE = _generator()
TRACES = GENERATE.TRACES


def _truth(name: str) -> dict:
    return json.loads((ROOT / name / "truth.json").read_text())


def _sql(name: str, table: str, query: str) -> list[tuple]:
    glob = schema.segment_glob(ROOT / name, table)
    return duckdb.sql(query.format(t=f"read_parquet('{glob}', hive_partitioning=true)")).fetchall()


def test_every_listed_trace_is_committed_and_nothing_else() -> None:
    folders = sorted(p.name for p in ROOT.iterdir() if p.is_dir() and not p.name.startswith((".", "__")))
    assert folders == sorted(TRACES)
    readme = (ROOT / "README.md").read_text()
    for name in TRACES:
        assert f"`{name}`" in readme


def test_the_set_covers_the_models_and_faults_asked_for() -> None:
    truths = [_truth(n) for n in TRACES]
    assert len(truths) >= 8
    assert {t["model"] for t in truths} == {"mlp", "cnn", "gpt"}
    assert sum(t["healthy"] for t in truths) >= 2
    faults = {t["fault"] for t in truths if not t["healthy"]}
    assert {"weight_corruption", "bias_drift", "lr_spike", "nan_injection", "corrupt_batches",
            "preactivation_scale"} <= faults
    assert {t["kind"] for t in truths if not t["healthy"]} == {"abrupt", "gradual"}


@pytest.mark.parametrize("name", TRACES)
def test_trace_is_complete(name: str) -> None:
    truth = _truth(name)
    steps = truth["steps"]
    assert _sql(name, "steps", "select count(*), min(step), max(step) from {t}") == [(steps, 1, steps)]
    # batch ids on every step, and a checkpoint event every 100 steps
    assert _sql(name, "steps", "select count(*) from {t} where len(batch_ids) > 0") == [(steps,)]
    ckpts = [r[0] for r in _sql(name, "events", "select step from {t} where kind = 'checkpoint' order by step")]
    assert ckpts == list(range(100, steps + 1, 100))
    components = _sql(name, "components", "select count(*) from {t}")[0][0]
    assert _sql(name, "health", "select count(*) from {t}") == [(steps * components,)]
    # no checkpoint files committed: the events name paths relative to the repository
    assert not (ROOT / name / "checkpoints").exists()
    paths = _sql(name, "events", "select path from {t} where kind = 'checkpoint'")
    assert all(p[0].startswith(f"sample_traces/{name}/") for p in paths)
    if not truth["healthy"]:
        known = {r[0] for r in _sql(name, "components", "select component from {t}")}
        assert truth["component"] == "" or truth["component"] in known
        assert 1 <= truth["step"] <= steps


def test_total_size_within_budget() -> None:
    total = sum(GENERATE.size_bytes(ROOT / n) for n in TRACES)
    assert 0 < total <= MAX_TOTAL_BYTES
