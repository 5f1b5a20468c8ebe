"""Durability of the trace: killed processes, SIGTERM, normal exit, restarts, unwritable disks."""

from __future__ import annotations

import atexit
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import textwrap
import threading
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
from warninglight.tracer.writer import claim_incarnation, next_incarnation

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


# One process imports torch once and forks a recording run per request, so ten kills cost ten
# forks, not ten interpreter starts. Each run prints "<pid> <step>" after every optimizer step,
# and after its last step waits to be killed.
ZYGOTE = textwrap.dedent("""
    import os, signal, sys
    import torch
    torch.set_num_threads(1)  # before any op: no thread pool exists to be broken by fork()
    import torch.nn.functional as F
    from warninglight.lab import zoo
    from warninglight.tracer import watch
    torch.optim.SGD(zoo.mlp().parameters(), lr=0.05)  # imports dynamo (seconds) once, not per run

    def train(path, steps, flush):
        torch.manual_seed(0)
        model = zoo.mlp()
        opt = torch.optim.SGD(model.parameters(), lr=0.05)
        rec = watch(model, opt, path, flush_every_steps=flush)
        for step, (ids, x, y) in enumerate(zoo.batches(*zoo.teacher_classification(512), 32), 1):
            loss = F.cross_entropy(model(x), y)
            loss.backward(); opt.step(); opt.zero_grad()
            rec.log(loss=loss); rec.batch(ids)
            print(os.getpid(), step, flush=True)
            if step == steps:
                break
        signal.pause()  # wait for the kill: a run never ends on its own before the parent reacts

    for line in sys.stdin:
        path, steps, flush = line.split()
        pid = os.fork()
        if pid == 0:
            try:
                train(path, int(steps), int(flush))
            finally:
                os._exit(0)
        _, status = os.waitpid(pid, 0)
        print("exit", pid, status, flush=True)
""")
KILL_STEPS, KILL_FLUSH = 80, 12  # steps per run; flush_every_steps (the first segment closes at 10)


def kill_runs(tmp_path: Path, moments: list[int]) -> list[tuple[Path, int]]:
    """SIGKILL one recording run at each moment (a printed step); (trace, last printed step) each."""
    script = tmp_path / "zygote.py"
    script.write_text(ZYGOTE)
    proc = subprocess.Popen([sys.executable, str(script)], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, text=True)
    assert proc.stdin is not None and proc.stdout is not None
    runs = []
    try:
        for i, moment in enumerate(moments):
            trace = tmp_path / f"kill{i}"
            proc.stdin.write(f"{trace} {KILL_STEPS} {KILL_FLUSH}\n")
            proc.stdin.flush()
            printed = 0
            for line in proc.stdout:
                words = line.split()
                if words[0] == "exit":
                    assert int(words[2]) == signal.SIGKILL, f"run {i} was not killed: {line}"
                    break
                printed = int(words[1])
                if printed == moment:
                    os.kill(int(words[0]), signal.SIGKILL)
            runs.append((trace, printed))
    finally:
        proc.stdin.close()
        proc.wait(timeout=60)
    return runs


def test_sigkill_at_ten_moments_leaves_a_readable_trace_losing_at_most_the_open_segments(
        tmp_path: Path) -> None:
    rng = random.Random(2026)
    # one kill inside the first segment (a run killed in its first seconds), nine anywhere
    moments = [rng.randint(1, 10)] + [rng.randint(1, KILL_STEPS - 1) for _ in range(9)]
    losses = []
    t0 = time.perf_counter()
    runs = kill_runs(tmp_path, moments)
    t1 = time.perf_counter()
    for trace, printed in runs:
        manifest = json.loads(schema.manifest_path(trace, 0).read_text())
        assert manifest["incarnations"][0]["status"] == "running"  # it never got to say goodbye
        info = CliRunner().invoke(app, ["info", str(trace)])
        assert info.exit_code == 0, info.output
        committed = int(info.stdout.split("last step: ")[1].split("\n")[0] or 0)
        # plain DuckDB reads what is there: the manifest always, the segments once there are some
        assert duckdb.sql(f"select count(*) from read_json('{schema.manifest_path(trace, 0)}')").fetchall() == [(1,)]
        analyzed = CliRunner().invoke(app, ["analyze", str(trace), "--json"])
        if committed:
            assert analyzed.exit_code == 0, analyzed.output
            assert json.loads(analyzed.stdout)["trace_info"]["last_step"] == committed
            assert query(trace, "select count(*) > 0 from health") == [(True,)]
            assert_committed_complete(trace, committed)
        else:  # killed before the first segment closed: nothing to analyse, said in one line
            assert analyzed.exit_code == 2
            assert analyzed.stderr.startswith("error: no health rows") and analyzed.stderr.count("\n") == 1
        # lost: the open segment, and at most the one being written (a flush waits for it)
        losses.append(printed - committed)
        assert printed - committed <= 2 * KILL_FLUSH + 1, (printed, committed)
    print(f"moments {moments}: steps lost {losses}; runs {t1 - t0:.1f} s, reading {time.perf_counter() - t1:.1f} s")
    assert any(lost > 0 for lost in losses) and max(moments) > 2 * KILL_FLUSH  # the kills did land mid-run


def assert_committed_complete(trace: Path, last: int) -> None:
    """What a reader sees: steps 1..last once each, in steps and for every component in health."""
    from warninglight.forensics import open_trace

    t = open_trace(trace)
    try:
        n_comp = t.one("select count(*) from components")[0]
        assert t.one("select count(*), count(distinct step), min(step), max(step) from steps") == (last, last, 1, last)
        assert t.one("select count(*), max(step) from health") == (last * n_comp, last)
    finally:
        t.close()


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


def test_two_runs_on_one_directory_at_once_keep_their_own_incarnations(tmp_path: Path) -> None:
    # two recorders given one trace directory at once (two processes, a restarted job whose old
    # process still flushes): each claims an incarnation of its own, and each manifest write
    # keeps the other's entry as it stands on disk
    torch.manual_seed(0)
    runs = []
    for steps in (9, 14):
        model = zoo.mlp(hidden=12, depth=2)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        runs.append((model, opt, watch(model, opt, tmp_path, flush_every_steps=3), steps))
    assert [rec.writer.incarnation for *_, rec, _ in runs] == [1, 2]
    batches = zoo.batches(*zoo.teacher_classification(256), 32)
    for i, (_, x, y) in zip(range(14), batches, strict=False):
        for model, opt, rec, steps in runs:  # their steps and flushes interleaved
            if i < steps:
                F.cross_entropy(model(x), y).backward()
                opt.step()
                opt.zero_grad()
            elif i == steps:
                rec.close()
    runs[1][2].close()
    manifest = json.loads(schema.manifest_path(tmp_path, 0).read_text())
    assert [(e["incarnation"], e["status"], e["steps_recorded"], e["dropped_steps"])
            for e in manifest["incarnations"]] == [(1, "normal", 9, 0), (2, "normal", 14, 0)]
    rows = query(tmp_path, "select incarnation, count(*), max(step) from steps group by incarnation order by incarnation")
    assert rows == [(1, 9, 9), (2, 14, 14)]
    # claimed before any manifest says so: two processes that both found 1 free
    assert [claim_incarnation(tmp_path / "fresh", 0) for _ in range(2)] == [1, 2]


def test_unwritable_trace_directory_mid_run_drops_steps_and_training_goes_on(tmp_path: Path) -> None:
    torch.manual_seed(0)
    model = zoo.mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    trace = tmp_path / "trace"
    data = zoo.batches(*zoo.teacher_classification(256), 32)
    # flushes at steps 5, 9, 13, ... hand over steps 1-4, 5-8, 9-12, ...; waiting for the writer
    # to be idle before breaking and mending the directory makes the outcome exact
    with pytest.warns(RuntimeWarning, match="trace writing failed"):
        rec = watch(model, opt, trace, flush_every_steps=4)
        for step in range(1, 31):
            _, x, y = next(data)
            F.cross_entropy(model(x), y).backward()
            opt.step()
            opt.zero_grad()
            if step in (10, 20):
                assert rec.writer.ready()  # steps 5-8 written; then 13-16 failed
            if step == 10:  # root ignores permissions: a file where the directory was stops it
                shutil.rmtree(trace)
                trace.write_text("not a directory")
            if step == 20:
                trace.unlink()
        rec.close()
    assert rec.step_count == 30
    manifest = json.loads(schema.manifest_path(trace, 0).read_text())
    assert rec.dropped_steps == 8 == manifest["incarnations"][0]["dropped_steps"]  # 9-12, 13-16
    steps = [r[0] for r in query(trace, "select step from steps")]
    assert sorted(steps) == list(range(17, 31))  # 1-8 went with the deleted directory
    assert "Not a directory" in manifest["incarnations"][0]["warnings"][0]


def test_a_flush_waits_for_the_segment_in_flight_and_drops_past_the_cap(tmp_path: Path) -> None:
    """One segment in flight at most: a stuck writer costs counted steps, never a backlog."""
    torch.manual_seed(0)
    model = zoo.mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    data = zoo.batches(*zoo.teacher_classification(256), 32)
    rec = watch(model, opt, tmp_path, flush_every_steps=4)
    rec.writer.max_wait_s = 0.05
    release = threading.Event()
    write = rec.writer._write_segment
    rec.writer._write_segment = lambda seg: (release.wait(30), write(seg))  # a disk that stalls
    with pytest.warns(RuntimeWarning, match="previous segment still being written"):
        for _ in range(13):  # flushes at 5 (1-4, stalls), 9 (5-8) and 13 (9-12)
            _, x, y = next(data)
            F.cross_entropy(model(x), y).backward()
            opt.step()
            opt.zero_grad()
    assert rec.dropped_steps == 8 and rec.writer.busy  # 5-8 and 9-12 dropped, 1-4 still in flight
    assert rec.writer.waited_s > 0  # the first drop waited for the cap; the second did not wait
    release.set()
    rec.close()
    assert [r[0] for r in query(tmp_path, "select step from steps order by step")] == [1, 2, 3, 4, 13]
    entry = json.loads(schema.manifest_path(tmp_path, 0).read_text())["incarnations"][0]
    assert entry["dropped_steps"] == 8 and entry["flush_wait_s"] > 0


def test_a_segment_without_its_commit_record_is_ignored_by_name(tmp_path: Path) -> None:
    train(zoo.mlp(), tmp_path, 12)  # segments of steps 1-4, 5-8, 9-12
    commit = sorted((tmp_path / schema.COMMIT_DIR).rglob("*-s5-8.json"))
    assert len(commit) == 1
    commit[0].unlink()  # as if killed after renaming the tables, before the commit
    got = CliRunner().invoke(app, ["info", str(tmp_path)])
    assert got.exit_code == 0 and "steps: 8\n" in got.stdout
    assert "warning: uncommitted segments ignored: 4 file(s) without a commit record " in got.stderr
    assert "part-000001-s5-8.parquet" in got.stderr
    listed = json.loads(CliRunner().invoke(app, ["analyze", str(tmp_path), "--json"]).stdout)
    assert listed["warnings"][0].startswith("uncommitted segments ignored")
    # steps and health agree: no step whose health rows are missing
    from warninglight.forensics import open_trace
    t = open_trace(tmp_path)
    try:
        assert t.one("select count(distinct step) from steps") == t.one("select count(distinct step) from health") == (8,)
    finally:
        t.close()


def test_the_first_segment_closes_early(tmp_path: Path) -> None:
    torch.manual_seed(0)
    model = zoo.mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    rec = watch(model, opt, tmp_path)  # defaults: every 100 steps or 30 s
    for _, (_, x, y) in zip(range(11), zoo.batches(*zoo.teacher_classification(256), 32), strict=False):
        F.cross_entropy(model(x), y).backward()
        opt.step()
        opt.zero_grad()
    assert rec.writer.ready()
    assert query(tmp_path, "select count(*), max(step) from steps") == [(10, 10)]  # before close()
    rec.close()


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


def _values(trace: Path) -> dict[tuple[int, str], tuple]:
    glob = schema.segment_glob(trace, "health")
    rows = duckdb.sql(f"select step, component, grad_norm_l2, weight_norm_l2, out_rms from read_parquet('{glob}')")
    return {(s, c): rest for s, c, *rest in rows.fetchall()}


def _train_until(trace: Path, steps: int, **options: object) -> None:
    """`steps` steps of a small MLP under the recorder (flushing every 5), same weights and batches
    every call; a KeyboardInterrupt raised inside the recorder ends the loop as it would a user's."""
    from warninglight.tracer import kernels

    kernels.available()
    torch.manual_seed(0)
    model = zoo.mlp(hidden=12, depth=2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    batches = zoo.batches(*zoo.teacher_classification(256), 32)
    with watch(model, opt, trace, flush_every_steps=5, **options) as rec:
        for _, (_, x, y) in zip(range(steps), batches, strict=False):
            loss = F.cross_entropy(model(x), y)
            loss.backward()
            opt.step()
            opt.zero_grad()
            rec.log(loss=loss)


@pytest.mark.parametrize("where", ["params", "forward", "segment", "record"])
def test_an_interrupt_inside_the_recorder_writes_no_wrong_value(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                                where: str) -> None:
    # Ctrl-C raises KeyboardInterrupt wherever the training thread is, the recorder included:
    # the steps it was reducing, taking out of the buffer or recording are written right or
    # null, never with another step's values, and none goes missing uncounted
    from warninglight.tracer import buffer, params, probes

    _train_until(tmp_path / "reference", 24)
    reference = _values(tmp_path / "reference")
    targets = {"params": (params.ParamProbe, "_reduce"), "forward": (probes.ForwardProbe, "_reduce"),
               "segment": (buffer.StepBuffer, "take_segment"), "record": (probes.ForwardProbe, "take")}
    owner, name = targets[where]
    original, calls, at = getattr(owner, name), [0], 13 if where == "record" else 3

    def interrupted(*args, **kwargs):  # type: ignore[no-untyped-def]
        calls[0] += 1
        if calls[0] == at:
            raise KeyboardInterrupt
        return original(*args, **kwargs)
    monkeypatch.setattr(owner, name, interrupted)
    with pytest.raises(KeyboardInterrupt):
        _train_until(tmp_path / "interrupted", 24)
    got = _values(tmp_path / "interrupted")
    steps = sorted({s for s, _ in got})
    assert steps == list(range(1, steps[-1] + 1)) and steps[-1] >= 8
    for key, values in got.items():
        assert all(v is None or v == r for v, r in zip(values, reference[key], strict=True)), key
    assert any(v is not None for values in got.values() for v in values)


@pytest.mark.parametrize("where", ["reduction", "segment"])
def test_a_sigterm_handled_inside_a_flush_closes_after_it(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                          where: str) -> None:
    # the SIGTERM handler runs on the training thread between two of its bytecodes, in the
    # middle of the recorder's own flush too: the recorder closes once the flush is done, so the
    # rows it was filling are written filled, and the steps it was taking out of the buffer stay
    from warninglight.tracer import buffer, params, recorder

    _train_until(tmp_path / "reference", 24)
    reference = _values(tmp_path / "reference")
    made, calls = [], [0]
    init = recorder.Recorder.__init__

    def keep(self, *args, **kwargs):  # type: ignore[no-untyped-def]
        init(self, *args, **kwargs)
        self._prev_sigterm = lambda *_: None  # the loop's own handler: training goes on
        made.append(self)
    monkeypatch.setattr(recorder.Recorder, "__init__", keep)
    owner, name = (params.ParamProbe, "reduce") if where == "reduction" else (buffer.StepBuffer, "take_segment")
    original = getattr(owner, name)

    def signalled(*args, **kwargs):  # type: ignore[no-untyped-def]
        out = original(*args, **kwargs)
        calls[0] += 1
        if calls[0] == 2:
            made[0]._on_sigterm(signal.SIGTERM, None)  # as if delivered right here
        return out
    monkeypatch.setattr(owner, name, signalled)
    _train_until(tmp_path / "signalled", 24)
    got = _values(tmp_path / "signalled")
    steps = sorted({s for s, _ in got})
    assert made[0]._closed and steps == list(range(1, steps[-1] + 1)) and 5 <= steps[-1] < 24
    assert all(values == reference[key] for key, values in got.items())


def test_a_close_from_another_thread_waits_for_the_training_threads_step_end(tmp_path: Path,
                                                                            monkeypatch: pytest.MonkeyPatch) -> None:
    # a watchdog thread's close() that comes while the training thread ends a step (its record
    # in the buffer, its forward samples not yet queued) runs once that step's end is done, and
    # the training thread's next step end finds the recorder closed: every step up to the close
    # is written once, with its own values
    from warninglight.tracer import probes, recorder

    _train_until(tmp_path / "reference", 24)
    reference = _values(tmp_path / "reference")
    made, watchdog, calls = [], [], [0]
    init = recorder.Recorder.__init__

    def keep(self, *args, **kwargs):  # type: ignore[no-untyped-def]
        init(self, *args, **kwargs)
        made.append(self)
    monkeypatch.setattr(recorder.Recorder, "__init__", keep)
    take = probes.ForwardProbe.take

    def raced(self, slot):  # type: ignore[no-untyped-def]
        calls[0] += 1
        if calls[0] == 7:
            watchdog.append(threading.Thread(target=made[0].close, args=("watchdog",)))
            watchdog[0].start()
            watchdog[0].join(0.5)  # an unguarded close() runs to its end right here
        return take(self, slot)
    monkeypatch.setattr(probes.ForwardProbe, "take", raced)
    _train_until(tmp_path / "raced", 24)
    watchdog[0].join()
    got = _values(tmp_path / "raced")
    steps = sorted({s for s, _ in got})  # the close comes at the first entry point it can take
    assert made[0]._closed and steps == list(range(1, steps[-1] + 1)) and 7 <= steps[-1] < 24
    assert got == {key: reference[key] for key in got}
    (entry,) = json.loads(schema.manifest_path(tmp_path / "raced", 0).read_text())["incarnations"]
    assert (entry["status"], entry["dropped_steps"], entry["steps_recorded"]) == ("watchdog", 0, steps[-1])


@pytest.mark.parametrize("where", ["params", "forward"])
def test_a_close_from_another_thread_waits_for_the_training_threads_hooks(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                                          where: str) -> None:
    # the training thread is held inside a hook of step 8's forward (the first-forward weight
    # reading, the observation of the outputs the components' hooks noted) while a watchdog's
    # close() goes as far as it can: it waits for the hook, so its reduction never reads a row
    # the hook is writing
    from warninglight.tracer import params, probes, recorder

    def values(trace: Path) -> dict[tuple[int, str], tuple]:
        rows = duckdb.sql("select step, component, update_norm_l2, weight_drift_l2, out_rms from "
                          f"read_parquet('{schema.segment_glob(trace, 'health')}')")
        return {(s, c): tuple(rest) for s, c, *rest in rows.fetchall()}

    _train_until(tmp_path / "reference", 24)
    reference = values(tmp_path / "reference")
    made, watchdog, inside, go, during = [], [], threading.Event(), threading.Event(), []
    init = recorder.Recorder.__init__

    def keep(self, *args, **kwargs):  # type: ignore[no-untyped-def]
        init(self, *args, **kwargs)
        made.append(self)
    monkeypatch.setattr(recorder.Recorder, "__init__", keep)
    owner, name, reducer = ((params.ParamProbe, "begin", params.ParamProbe) if where == "params"
                            else (probes.ForwardProbe, "drain", probes.ForwardProbe))
    hooked, reduce = getattr(owner, name), reducer._reduce

    def reduce_in_watchdog(self, *args):  # type: ignore[no-untyped-def]
        if threading.current_thread() is not threading.main_thread():
            inside.set()  # the watchdog's close() reached its reduction
            go.wait(5)
        return reduce(self, *args)

    def held(self, *args):  # type: ignore[no-untyped-def]
        if made[0].step_count == 7 and not watchdog:  # step 8's forward, inside the hook
            watchdog.append(threading.Thread(target=made[0].close, args=("watchdog",)))
            watchdog[0].start()
            during.append(inside.wait(1))  # an unguarded close() reaches its reduction here
            out = hooked(self, *args)
            go.set()
            return out
        return hooked(self, *args)
    monkeypatch.setattr(reducer, "_reduce", reduce_in_watchdog)
    monkeypatch.setattr(owner, name, held)
    _train_until(tmp_path / "raced", 24)
    watchdog[0].join()
    got = values(tmp_path / "raced")
    steps = sorted({s for s, _ in got})
    assert during == [False]  # the watchdog's reduction came only after the hook
    assert steps == list(range(1, steps[-1] + 1)) and steps[-1] >= 7
    assert got == {key: reference[key] for key in got}


def test_a_sigterm_while_another_thread_closes_ends_the_process_after_that_close(tmp_path: Path,
                                                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    # the handler's close() waits for a watchdog's close() in progress (a slow final write)
    # before the default action would end the process: the trace is whole when it does
    from warninglight.tracer import recorder, writer

    made, watchdog, ended, closing, handled = [], [], [], threading.Event(), threading.Event()
    init, close = recorder.Recorder.__init__, writer.TraceWriter.close

    def keep(self, *args, **kwargs):  # type: ignore[no-untyped-def]
        init(self, *args, **kwargs)
        self._prev_sigterm = lambda *_: ended.append(json.loads(  # what the process leaves
            schema.manifest_path(tmp_path, 0).read_text())["incarnations"][0]["status"])
        made.append(self)

    def slow_close(self, *args, **kwargs):  # type: ignore[no-untyped-def]
        closing.set()
        handled.wait(2)  # a slow disk, until the handler has returned (an unguarded one at once)
        close(self, *args, **kwargs)
    monkeypatch.setattr(recorder.Recorder, "__init__", keep)
    monkeypatch.setattr(writer.TraceWriter, "close", slow_close)
    torch.manual_seed(0)
    model = zoo.mlp(hidden=12, depth=2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with watch(model, opt, tmp_path, flush_every_steps=5):
        for i, (_, x, y) in zip(range(12), zoo.batches(*zoo.teacher_classification(256), 32), strict=False):
            F.cross_entropy(model(x), y).backward()
            opt.step()
            opt.zero_grad()
            if i == 6:
                watchdog.append(threading.Thread(target=made[0].close, args=("watchdog",)))
                watchdog[0].start()
                closing.wait(10)  # the watchdog is in its close()
                made[0]._on_sigterm(signal.SIGTERM, None)  # as if delivered here
                handled.set()
    watchdog[0].join()
    assert ended == ["watchdog"]


def test_the_manifest_lock_is_waited_for_a_bounded_time_and_no_forked_child_keeps_it(tmp_path: Path) -> None:
    # another process holding the lock delays a manifest write by at most MANIFEST_LOCK_WAIT_S
    # (then it is written without the lock): no training thread waits on a file for long. A
    # child forked while the lock is held (a DataLoader worker) does not keep it
    from warninglight.tracer import writer

    lock = tmp_path / "rank=0.lock"
    holder = subprocess.Popen([sys.executable, "-c", textwrap.dedent(f"""
        import fcntl, os, sys
        fd = os.open({str(lock)!r}, os.O_RDWR | os.O_CREAT)
        fcntl.lockf(fd, fcntl.LOCK_EX)
        print("held", flush=True)
        sys.stdin.readline()""")], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout is not None and holder.stdout.readline().strip() == "held"
        with writer._locked(lock) as had:  # given up after the bounded wait: written unlocked
            pass
    finally:
        holder.kill()
        holder.wait()
    assert had is False
    inside, leave, other = threading.Event(), threading.Event(), []

    def hold() -> None:
        with writer._locked(lock):
            inside.set()
            leave.wait(30)
    holder_thread = threading.Thread(target=hold)
    holder_thread.start()
    inside.wait(30)
    with writer._locked(Path(os.path.relpath(lock))) as had:  # the same file, spelt otherwise
        other.append(had)
    leave.set()
    holder_thread.join()
    assert other == [False]  # it waited for the other writer of this process, then went on
    stay, keep_open = os.pipe()
    with writer._locked(lock) as had:
        assert had is True
        pid = os.fork()
        if pid == 0:  # the child stays, holding whatever it inherited, until it is killed
            os.read(stay, 1)
            os._exit(0)
    try:
        with writer._locked(lock) as had:  # free again once the parent let it go
            pass
    finally:
        os.kill(pid, signal.SIGKILL)
        os.waitpid(pid, 0)
        os.close(stay)
        os.close(keep_open)
    assert had is True


def test_a_forked_child_passes_sigterm_on_and_leaves_its_parents_recorder_alone(tmp_path: Path) -> None:
    # a child forked from the training process inherits the recorder's SIGTERM handler and
    # atexit hook, not the recorder (nor the threads that held its lock at the fork: a close()
    # there would wait for ever): it ends as the signal's default action says, and never writes
    # the parent's manifest
    torch.manual_seed(0)
    model = zoo.mlp(hidden=12, depth=2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    before = signal.signal(signal.SIGTERM, signal.SIG_DFL)
    try:
        with watch(model, opt, tmp_path, flush_every_steps=3) as rec:
            for _, (_, x, y) in zip(range(4), zoo.batches(*zoo.teacher_classification(256), 32), strict=False):
                F.cross_entropy(model(x), y).backward()
                opt.step()
                opt.zero_grad()
            holding, release = threading.Event(), threading.Event()
            holder = threading.Thread(target=lambda: (rec._lock.acquire(), holding.set(), release.wait(30),
                                                      rec._lock.release()))
            holder.start()  # another thread in the recorder at the fork (a watchdog's close())
            holding.wait(30)
            pid = os.fork()
            if pid:
                release.set()
                holder.join()
            if pid == 0:  # the child: its exit hooks, then SIGTERM to itself; never back into pytest
                try:
                    atexit._run_exitfuncs()
                    os.kill(os.getpid(), signal.SIGTERM)  # handled before the next line runs
                finally:
                    os._exit(3)
            stuck = threading.Timer(30, os.kill, (pid, signal.SIGKILL))  # a child that never ends
            stuck.start()
            _, status = os.waitpid(pid, 0)
            stuck.cancel()
            entry = json.loads(schema.manifest_path(tmp_path, 0).read_text())["incarnations"][0]
            assert os.WIFSIGNALED(status) and os.WTERMSIG(status) == signal.SIGTERM
            assert entry["status"] == "running"  # the parent's, untouched by the child
    finally:
        signal.signal(signal.SIGTERM, before)
    assert json.loads(schema.manifest_path(tmp_path, 0).read_text())["incarnations"][0]["status"] == "normal"


def test_a_manifest_that_fails_to_follow_a_committed_segment_drops_no_step(tmp_path: Path,
                                                                           monkeypatch: pytest.MonkeyPatch) -> None:
    # the segment is committed before the manifest is rewritten: a failed manifest write is
    # reported, and counts no step of that segment as dropped
    from warninglight.tracer import writer

    write, calls = writer.TraceWriter._write_manifest, [0]

    def fails_once(self):  # type: ignore[no-untyped-def]
        calls[0] += 1
        if calls[0] == 3:
            raise OSError("read-only for a moment")
        return write(self)
    monkeypatch.setattr(writer.TraceWriter, "_write_manifest", fails_once)
    with pytest.warns(RuntimeWarning, match="read-only for a moment"):
        _train_until(tmp_path, 24)
    manifest = json.loads(schema.manifest_path(tmp_path, 0).read_text())
    entry = manifest["incarnations"][-1]
    assert calls[0] > 3 and entry["dropped_steps"] == 0 and entry["steps_recorded"] == 24
    assert sorted({s for s, _ in _values(tmp_path)}) == list(range(1, 25))


def test_writers_of_one_file_at_once_each_replace_it_whole(tmp_path: Path) -> None:
    # two writers of one trace directory (a writer thread and close(), or two processes) write
    # the same manifest: each through a temporary file of its own, so no rename takes another's
    from warninglight.tracer.writer import _atomic_write

    target, failures = tmp_path / "manifest" / "rank=0.json", []
    payloads = [json.dumps({"writer": w, "pad": "x" * 4096}).encode() for w in range(4)]

    def write(w: int) -> None:
        try:
            for _ in range(200):
                _atomic_write(target, payloads[w])
        except OSError as exc:
            failures.append(exc)
    threads = [threading.Thread(target=write, args=(w,)) for w in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert failures == [] and target.read_bytes() in payloads
    assert [p.name for p in target.parent.iterdir()] == [target.name]
