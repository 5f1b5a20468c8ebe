"""Durability of the trace: killed processes, SIGTERM, normal exit, restarts, unwritable disks."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import duckdb
import pytest
import torch
import torch.nn.functional as F
from typer.testing import CliRunner
from warninglight.cli.main import app
from warninglight.lab import zoo
from warninglight.tracer import schema, watch
from warninglight.tracer.writer import next_incarnation

# A training script that prints each completed step; `MODE` picks how it ends.
CHILD = textwrap.dedent("""
    import sys, time, torch, torch.nn.functional as F
    from warninglight.tracer import watch
    from warninglight.lab import zoo
    torch.set_num_threads(1)
    mode, path = sys.argv[1], sys.argv[2]
    torch.manual_seed(0)
    model = zoo.mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    rec = watch(model, opt, path, flush_every_steps=5)
    for step, (ids, x, y) in enumerate(zoo.batches(*zoo.teacher_classification(512), 32), 1):
        loss = F.cross_entropy(model(x), y)
        loss.backward(); opt.step(); opt.zero_grad()
        rec.log(loss=loss); rec.batch(ids)
        print(step, flush=True)
        if mode == "exit" and step == 40:
            break              # no close(): the atexit flush must save everything
        time.sleep(0.01)
""")


def run_child(tmp_path: Path, mode: str, stop_at: int, sig: int | None) -> tuple[Path, list[int], int]:
    """Start the child, send `sig` once it printed step `stop_at`; its trace, steps and exit code."""
    script = tmp_path / "child.py"
    script.write_text(CHILD)
    trace = tmp_path / "trace"
    proc = subprocess.Popen([sys.executable, str(script), mode, str(trace)],
                            stdout=subprocess.PIPE, text=True)
    printed = []
    assert proc.stdout is not None
    for line in proc.stdout:
        printed.append(int(line))
        if sig is not None and printed[-1] == stop_at:
            proc.send_signal(sig)
            break
    printed += [int(line) for line in proc.stdout]
    return trace, printed, proc.wait(timeout=60)


def query(trace: Path, sql: str) -> list[tuple]:
    """Plain DuckDB over the trace's segment files; tables appear as `health`, `steps`, ..."""
    for table in schema.TABLES:
        sql = sql.replace(f" {table}", f" read_parquet('{schema.segment_glob(trace, table)}', "
                                       "hive_partitioning=true)")
    return duckdb.sql(sql).fetchall()


def assert_complete(trace: Path, last: int) -> None:
    """Steps 1..last all present, once, in steps and (for every component) in health."""
    n_comp = query(trace, "select count(*) from components")[0][0]
    assert query(trace, "select count(*), count(distinct step), min(step), max(step) from steps") == [
        (last, last, 1, last)]
    assert query(trace, "select count(*), max(step) from health") == [(last * n_comp, last)]


def test_sigkill_leaves_a_readable_trace_up_to_the_last_closed_segment(tmp_path: Path) -> None:
    trace, printed, code = run_child(tmp_path, "loop", 30, signal.SIGKILL)
    assert code == -signal.SIGKILL
    last = query(trace, "select max(step) from steps")[0][0]
    assert 5 <= last <= printed[-1] and last % 5 == 0  # segments close every 5 steps
    assert_complete(trace, last)
    manifest = json.loads(schema.manifest_path(trace, 0).read_text())
    assert manifest["incarnations"][0]["status"] == "running"  # it never got to say goodbye
    assert manifest["incarnations"][0]["last_step"] == last
    # ...and the CLI reads it as it is: no repair step, no error
    info = CliRunner().invoke(app, ["info", str(trace)])
    assert info.exit_code == 0 and f"last step: {last}" in info.stdout
    got = CliRunner().invoke(app, ["query", str(trace), "select count(*) as n from steps", "--format", "csv"])
    assert (got.exit_code, got.stdout) == (0, f"n\n{last}\n")


def test_sigterm_loses_nothing(tmp_path: Path) -> None:
    trace, printed, code = run_child(tmp_path, "loop", 23, signal.SIGTERM)
    assert code == -signal.SIGTERM  # the default action still ends the process
    last = query(trace, "select max(step) from steps")[0][0]
    assert last in (printed[-1], printed[-1] + 1)  # a step may finish before its print
    assert_complete(trace, last)
    assert query(trace, "select kind, detail from events where kind = 'stop'") == [("stop", "sigterm")]
    assert json.loads(schema.manifest_path(trace, 0).read_text())["incarnations"][0]["status"] == "sigterm"


def test_normal_exit_without_close_loses_nothing(tmp_path: Path) -> None:
    trace, printed, code = run_child(tmp_path, "exit", 0, None)
    assert code == 0 and printed[-1] == 40
    assert_complete(trace, 40)
    assert query(trace, "select count(*) from steps where loss is null or batch_ids is null") == [(0,)]


def train(model: torch.nn.Module, path: Path, steps: int, **kw: object) -> None:
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    with watch(model, opt, path, flush_every_steps=4, **kw) as rec:
        for _, (_, x, y) in zip(range(steps), zoo.batches(*zoo.teacher_classification(256), 32), strict=False):
            F.cross_entropy(model(x), y).backward()
            opt.step()
            opt.zero_grad()
            if rec.step_count == 5:
                rec.checkpoint(path / "ck5.pt")


def test_restart_into_the_same_directory_is_a_new_incarnation(tmp_path: Path) -> None:
    torch.manual_seed(0)
    model = zoo.mlp()
    train(model, tmp_path, 12)
    train(model, tmp_path, 10, start_step=5)  # rolled back to the step-5 checkpoint
    rows = query(tmp_path, "select incarnation, count(*), min(step), max(step) from steps "
                           "group by incarnation order by incarnation")
    assert rows == [(1, 12, 1, 12), (2, 10, 6, 15)]
    assert query(tmp_path, "select count(*) from (select step from steps group by step having count(*) = 2)") == [(7,)]
    kinds = query(tmp_path, "select incarnation, kind from events where kind in ('start', 'restart') order by all")
    assert kinds == [(1, "start"), (2, "restart"), (2, "start")]
    manifest = json.loads(schema.manifest_path(tmp_path, 0).read_text())
    assert [i["incarnation"] for i in manifest["incarnations"]] == [1, 2]
    assert next_incarnation(tmp_path, 0) == 3 and next_incarnation(tmp_path, 1) == 1


def test_unwritable_trace_directory_mid_run_drops_steps_and_training_goes_on(tmp_path: Path) -> None:
    torch.manual_seed(0)
    model = zoo.mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    trace = tmp_path / "trace"
    data = zoo.batches(*zoo.teacher_classification(256), 32)
    with pytest.warns(RuntimeWarning, match="trace writing failed"):
        rec = watch(model, opt, trace, flush_every_steps=4)
        for step in range(1, 31):
            _, x, y = next(data)
            F.cross_entropy(model(x), y).backward()
            opt.step()
            opt.zero_grad()
            if step == 10:  # root ignores permissions: a file where the directory was stops it
                shutil.rmtree(trace)
                trace.write_text("not a directory")
            if step == 20:
                trace.unlink()
            time.sleep(0.005)
        rec.close()
    assert rec.step_count == 30 and rec.dropped_steps > 0
    manifest = json.loads(schema.manifest_path(trace, 0).read_text())
    assert manifest["incarnations"][0]["dropped_steps"] == rec.dropped_steps
    steps = [r[0] for r in query(trace, "select step from steps")]
    # steps 1-8 went with the deleted directory; 9-16 could not be written (5-8 too, if the
    # writer was slower than the deletion); from step 17 on the directory was back
    assert sorted(steps) == list(range(17, 31)) and rec.dropped_steps in (8, 12)
    assert "Not a directory" in manifest["incarnations"][0]["warnings"][0]


def test_an_unwritable_path_from_the_start_never_raises(tmp_path: Path) -> None:
    blocker = tmp_path / "file"
    blocker.write_text("x")
    model = zoo.mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    with pytest.warns(RuntimeWarning), watch(model, opt, blocker / "trace", flush_every_steps=2) as rec:
        for _ in range(5):
            model(torch.randn(4, 32)).sum().backward()
            opt.step()
    assert rec.dropped_steps == 5
    assert os.path.isfile(blocker)


def test_trace_format_doc_is_generated_from_the_schema() -> None:
    from warninglight.lab import formatdoc

    doc = (Path(__file__).parent.parent / "docs" / "trace-format.md").read_text()
    assert doc == formatdoc.render(), "regenerate: python -m warninglight.lab.formatdoc > docs/trace-format.md"
    for table, columns in schema.COLUMNS.items():
        assert all(f"| `{c.name}` |" in doc for c in columns), table
    assert all(f"| `{k}` |" in doc for k in schema.MANIFEST_KEYS + schema.INCARNATION_KEYS)


def test_an_exception_in_the_loop_is_recorded_as_the_stop_reason(tmp_path: Path) -> None:
    model = zoo.mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    with pytest.raises(KeyError), watch(model, opt, tmp_path):
        model(torch.randn(4, 32)).sum().backward()
        opt.step()
        raise KeyError("data loader failed")
    assert query(tmp_path, "select step, detail from events where kind = 'stop'") == [(1, "exception")]
    assert json.loads(schema.manifest_path(tmp_path, 0).read_text())["incarnations"][0]["status"] == "exception"
