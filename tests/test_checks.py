"""Hostile traces and options, one test per class: a one-line error (exit 2) or a named warning.

Every case is a real trace (a recorded rehearsal) copied into tmp_path and damaged the way a user
can damage it; the commands run through the real CLI.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from rehearsed import trace
from typer.testing import CliRunner
from warninglight.cli.main import app
from warninglight.tracer import schema

runner = CliRunner()


def run(*args: object):
    return runner.invoke(app, [str(a) for a in args])


def one_line_error(result, start: str) -> str:
    """The error line, after checking it is the only output, on stderr, with exit code 2."""
    assert result.exit_code == 2, result.output
    assert result.stdout == "" and "Traceback" not in result.stderr
    lines = result.stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"error: {start}"), result.stderr
    return lines[0]


def warnings_of(path: Path, *args: object) -> list[str]:
    """`analyze --json`'s warnings, after checking the analysis ran and printed them on stderr too."""
    result = run("analyze", path, "--json", *args)
    assert result.exit_code == 0, result.output
    warned = json.loads(result.stdout)["warnings"]
    assert result.stderr == "".join(f"warning: {w}\n" for w in warned)
    return warned


@pytest.fixture
def copy(tmp_path: Path) -> Path:
    """A fresh copy of a recorded 300-step run (format v2: segments with commit records)."""
    out = tmp_path / "run"
    shutil.copytree(trace("mlp_clean"), out)
    return out


def segments(root: Path, table: str) -> list[Path]:
    return sorted((root / table).rglob("part-*.parquet"))


def add_segment(root: Path, table: str, data: pa.Table, seq: int = 900) -> Path:
    """Write a segment (and its commit record, so readers take it) as a writer would."""
    path = schema.segment_path(root, table, 0, 1, seq)
    path.parent.mkdir(parents=True, exist_ok=True)
    pq.write_table(data, path)
    commit = schema.commit_path(root, 0, 1, seq)
    commit.parent.mkdir(parents=True, exist_ok=True)
    commit.write_text(json.dumps({"tables": {table: data.num_rows}, "steps": None}))
    return path


def rewrite(path: Path, change) -> None:
    """Rewrite one segment file with `change(table) -> table`."""
    pq.write_table(change(pq.read_table(path)), path)


# --- paths are taken literally ----------------------------------------------------------------

@pytest.mark.parametrize("name", ["run[1]", "run*", "run?"])
def test_a_trace_path_with_glob_characters_is_taken_literally(name: str, tmp_path: Path) -> None:
    shutil.copytree(trace("mlp_clean"), tmp_path / name)
    for decoy in ("run1", "runx"):  # what the name would match as a glob: same files, fewer rows
        shutil.copytree(trace("mlp_clean"), tmp_path / decoy)
        rewrite(segments(tmp_path / decoy, "steps")[0], lambda t: t.slice(0, 5))
    got = run("info", tmp_path / name)
    assert got.exit_code == 0 and "steps: 300\n" in got.stdout and got.stderr == ""
    assert "segments: " in got.stdout
    counted = run("query", tmp_path / name, "select count(*) as n from steps", "--format", "csv")
    assert (counted.exit_code, counted.stdout) == (0, "n\n300\n"), counted.output


# --- manifests --------------------------------------------------------------------------------

@pytest.mark.parametrize(("content", "problem"), [
    ("[1, 2, 3]", "is a JSON list, not an object"),
    ('{"format_version": 2, "rank": 0, "incarnations": [{"dropped_steps": "many"}]}',
     "has non-integer field(s) incarnations[0].dropped_steps"),
    ('{"format_version": 2, "rank": "zero", "incarnations": []}', "has non-integer field(s) rank"),
    ('{"format_version": 2, "rank": 0, "incarnations": {"a": 1}}',
     "has `incarnations` that is not a list of objects"),
])
def test_an_unusable_manifest_is_named_and_dropped_steps_are_unknown(content: str, problem: str,
                                                                      copy: Path) -> None:
    path = schema.manifest_path(copy, 0)
    path.write_text(content)
    got = run("info", copy)
    assert got.exit_code == 0 and "dropped steps: unknown (a rank has no manifest)\n" in got.stdout
    assert got.stderr.splitlines() == [
        f"warning: unusable manifest: {path} {problem}; ignored, so dropped steps and the run's "
        "status are unknown",
        "warning: no manifest for rank 0: dropped steps and the run's status are unknown, not 0"]


@pytest.mark.parametrize(("manifests", "expected"), [
    ([], "no manifest for rank 0: dropped steps and the run's status are unknown, not 0"),
    ([1], "no manifest for rank 0 (manifests found only for rank 1): dropped steps and the run's "
          "status are unknown, not 0"),
])
def test_a_rank_without_its_manifest_says_dropped_steps_are_unknown(manifests: list[int],
                                                                    expected: str, copy: Path) -> None:
    own = schema.manifest_path(copy, 0)
    text = own.read_text()
    own.unlink()
    for rank in manifests:
        schema.manifest_path(copy, rank).write_text(text.replace('"rank": 0', f'"rank": {rank}'))
    assert warnings_of(copy) == [expected]
    info = json.loads(run("analyze", copy, "--json").stdout)["trace_info"]
    assert info["dropped_steps"] is None and info["steps"] == 300


# --- segments and partitions ------------------------------------------------------------------

def test_a_fifo_named_like_a_segment_or_manifest_is_skipped_not_read(copy: Path) -> None:
    extra = schema.segment_path(copy, "health", 0, 1, 901)
    os.mkfifo(extra)  # opening it for reading would block forever
    manifest = schema.manifest_path(copy, 3)
    os.mkfifo(manifest)
    got = run("info", copy)
    assert got.exit_code == 0 and "steps: 300\n" in got.stdout
    assert got.stderr.splitlines() == [
        f"warning: manifest {manifest} is not a regular file; ignored",
        "warning: not regular files, ignored: health/rank=0/incarnation=1/part-000901.parquet — a "
        "segment must be a plain Parquet file"]


def test_a_partition_folder_that_is_not_a_number_is_ignored_by_name(copy: Path) -> None:
    for table in ("health", "steps"):
        shutil.copytree(copy / table / "rank=0", copy / table / "rank=abc")
    shutil.copytree(copy / "health" / "rank=0" / "incarnation=1", copy / "health" / "rank=0" / "incarnation=x")
    warned = warnings_of(copy)
    assert warned == ["folders not named rank=<integer>/incarnation=<integer>, ignored: "
                      "health/rank=0/incarnation=x, health/rank=abc, steps/rank=abc"]


def test_a_segment_without_its_key_column_is_a_one_line_error(copy: Path) -> None:
    seg = segments(copy, "health")[1]
    rewrite(seg, lambda t: t.drop_columns(["step"]))
    for command in ("info", "analyze", "replay", "report"):
        line = one_line_error(run(command, copy, *(["-o", copy.parent / "r.html"] if command == "report" else [])),
                              f"segment {seg} has no `step` column")
        assert line.endswith("move it out of the trace directory to analyse the rest")


# --- what the rows say ------------------------------------------------------------------------

def test_duplicate_and_non_positive_steps_are_named(copy: Path) -> None:
    steps = pq.read_table(segments(copy, "steps")[0])
    add_segment(copy, "steps", steps.slice(0, 3), seq=901)  # steps 1-3 once more
    health = pq.read_table(segments(copy, "health")[0])
    shifted = health.set_column(0, "step", pa.compute.subtract(health["step"], 5))  # steps -4..
    add_segment(copy, "health", shifted.filter(pa.compute.less(shifted["step"], 1)), seq=902)
    warned = warnings_of(copy)
    assert warned[0] == ("duplicate steps: 3 step(s) of `steps` recorded more than once in the "
                         "same incarnation (first: step 1); each is analysed as many times as it appears")
    n_comp = len(pq.read_table(segments(copy, "components")[0]))
    assert warned[1:] == [f"non-positive steps: {5 * n_comp} row(s) of `health` with step < 1 (lowest "
                          "-4); steps count from 1, so these rows come from a different writer"]


def test_a_step_far_past_the_others_is_named(copy: Path) -> None:
    last = segments(copy, "steps")[-1]
    table = pq.read_table(last)
    corrupted = table.slice(table.num_rows - 1).set_column(0, "step", pa.array([10**12], pa.int64()))
    rewrite(last, lambda t: pa.concat_tables([t, corrupted]))
    warned = warnings_of(copy)
    assert warned == [f"implausible step: `steps` holds step {10**12}, where the step before it is 300; "
                      f"a corrupted row? It is analysed as recorded: check the file that holds it ({last.name})"]


def test_a_run_whose_steps_move_on_normally_is_not_named(copy: Path) -> None:
    assert not any(w.startswith("implausible step") for w in warnings_of(copy))


def test_report_goes_past_a_missing_steps_table_and_an_unreadable_answer_key(tmp_path: Path) -> None:
    faulty = tmp_path / "run"
    shutil.copytree(trace("mlp_weight_corruption"), faulty)  # alarms: the condition map is drawn
    shutil.rmtree(faulty / "steps")
    (faulty / "truth.json").write_text("{not json")
    out = tmp_path / "report.html"
    got = run("report", faulty, "-o", out)
    assert got.exit_code == 0, got.output
    said = got.stderr.splitlines()
    assert said[0].startswith("warning: no steps table: ")
    assert said[-1].startswith(f"warning: unreadable answer key: {faulty / 'truth.json'} is not JSON")
    page = out.read_text()
    assert "no steps table" in page and "unreadable answer key" in page  # the page says it too


def test_report_into_a_folder_that_does_not_exist_is_refused(copy: Path, tmp_path: Path) -> None:
    one_line_error(run("report", copy, "-o", tmp_path / "no" / "such" / "r.html"),
                   f"--out {tmp_path / 'no' / 'such' / 'r.html'}: folder {tmp_path / 'no' / 'such'} does not exist")
    assert not (tmp_path / "no").exists()


def test_a_missing_metric_column_is_named(copy: Path) -> None:
    for seg in segments(copy, "health"):
        rewrite(seg, lambda t: t.drop_columns(["out_rms", "grad_norm_l2"]))
    assert warnings_of(copy) == ["missing metric columns: health has no out_rms, grad_norm_l2; "
                                 "the conditions that read them cannot fire"]


@pytest.mark.parametrize("table", ["components", "events", "steps"])
def test_a_missing_table_is_named_and_every_command_still_answers(table: str, copy: Path) -> None:
    shutil.rmtree(copy / table)
    warned = warnings_of(copy)
    assert len(warned) == 1 and warned[0].startswith(f"no {table} table: ")
    out = copy.parent / "report.html"
    got = run("report", copy, "-o", out)
    assert got.exit_code == 0, got.output
    assert out.stat().st_size > 10_000 and got.stderr == f"warning: {warned[0]}\n"
    assert run("replay", copy).exit_code == 0


def test_a_checkpoint_file_that_does_not_exist_is_flagged(tmp_path: Path) -> None:
    faulty = tmp_path / "run"
    shutil.copytree(trace("mlp_weight_corruption"), faulty)  # checkpoints recorded, never saved
    result = json.loads(run("analyze", faulty, "--json").stdout)
    path, step = result["rollback"]["checkpoint_path"], result["rollback"]["checkpoint_step"]
    assert path and result["verdict"] == "fault"
    assert result["warnings"] == [
        f"missing checkpoint file: the rollback names {path} (step {step}), which does not exist "
        "here — find the file or pass --checkpoints with a glob of the files you have"]
    saved = faulty.parent / "ckpt"
    saved.mkdir()
    (saved / f"step-{step:06d}.pt").write_bytes(b"weights")  # the files the user does have
    again = json.loads(run("analyze", faulty, "--json", "--checkpoints", saved / "step-*.pt").stdout)
    assert again["rollback"]["checkpoint_step"] == step and again["warnings"] == []


# --- numbers at the edge ----------------------------------------------------------------------

@pytest.mark.parametrize(("option", "message"), [
    ("exploding.out_rms.z=nan", "exploding.out_rms.z must be a finite number, got nan"),
    ("exploding.out_rms.z=inf", "exploding.out_rms.z must be a finite number, got inf"),
    ("baseline.window=1e300", "baseline.window must be between 0 and 100000 steps, got 1e+300"),
    ("baseline.window=4611686018427387904", "baseline.window must be between 0 and 100000 steps"),
    ("exploding.persistence=-3", "exploding.persistence must be between 0 and 100000 steps, got -3"),
])
def test_a_threshold_that_is_not_finite_or_out_of_range_is_refused(option: str, message: str) -> None:
    for command in ("analyze", "conditions"):
        args = ["--set", option] if command == "conditions" else [trace("mlp_clean"), "--set", option]
        one_line_error(run(command, *args), message)


def test_a_step_near_2_to_the_62_with_checkpoint_every_does_not_hang(copy: Path) -> None:
    far = 2**62
    for table in ("steps", "health"):
        last = segments(copy, table)[-1]
        rewrite(last, lambda t: t.set_column(0, "step", pa.compute.add(t["step"], far)))
    result = run("rollback", copy, "--checkpoint-every", "1", "--json")
    assert result.exit_code == 0, result.output
    assert "steps_discarded" in json.loads(result.stdout)


# --- query is read-only and stays in the trace directory --------------------------------------

@pytest.mark.parametrize(("sql", "message"), [
    ("COPY steps TO '{victim}'", "query is read-only: COPY statements are refused"),
    ("COPY steps TO '{segment}' (FORMAT parquet)", "query is read-only: COPY statements are refused"),
    ("CREATE TABLE t AS SELECT 1", "query is read-only: CREATE statements are refused"),
    ("SELECT * FROM read_csv('/etc/passwd')", 'Permission Error: Cannot access file "/etc/passwd"'),
    ("SELECT * FROM glob('/etc/*')", 'Permission Error: Cannot access file "/etc/*"'),
    ("SELECT * FROM read_text('{victim}')", "Permission Error: Cannot access file"),
])
def test_query_is_read_only_and_confined_to_the_trace(sql: str, message: str, copy: Path) -> None:
    victim = copy.parent / "notes.txt"
    victim.write_text("the user's own file")
    segment = segments(copy, "steps")[0]
    before = segment.read_bytes()
    line = one_line_error(run("query", copy, sql.format(victim=victim, segment=segment)), message)
    assert line.endswith("pass --allow-external to run statements that write or read other files") or \
        line.endswith("pass --allow-external to read or write other files")
    assert victim.read_text() == "the user's own file" and segment.read_bytes() == before


def test_query_allow_external_is_the_explicit_way_out(copy: Path) -> None:
    out = copy.parent / "steps.csv"
    got = run("query", copy, f"COPY (SELECT step FROM steps ORDER BY step LIMIT 2) TO '{out}'",
              "--allow-external")
    assert got.exit_code == 0, got.output
    assert out.read_text() == "step\n1\n2\n"


# --- no command overwrites a file it did not create -------------------------------------------

def test_report_refuses_an_existing_file_without_force_and_the_trace_files_always(copy: Path) -> None:
    mine = copy.parent / "report.html"
    mine.write_text("my notes")
    one_line_error(run("report", copy, "-o", mine), f"--out {mine} already exists — pass --force")
    assert mine.read_text() == "my notes"
    manifest = schema.manifest_path(copy, 0)
    before = manifest.read_bytes()
    for force in ([], ["--force"]):
        one_line_error(run("report", copy, "-o", manifest, *force), f"--out {manifest} is inside the trace's own files")
    assert manifest.read_bytes() == before
    figures = copy.parent / "figs"
    figures.mkdir()
    (figures / "heatmap.png").write_bytes(b"mine")
    one_line_error(run("report", copy, "--format", "png", "-o", figures), f"--out {figures} is a folder that is not empty")
    got = run("report", copy, "-o", mine, "--force")
    assert got.exit_code == 0 and mine.read_text().startswith("<!doctype html>")


def test_eval_refuses_to_overwrite_its_json_or_mix_into_a_full_workdir(tmp_path: Path) -> None:
    scores = tmp_path / "scores.json"
    scores.write_text("[]")
    one_line_error(run("eval", "mlp_clean", "--json", scores), f"--json {scores} already exists")
    (tmp_path / "work").mkdir()
    (tmp_path / "work" / "mine.txt").write_text("x")
    one_line_error(run("eval", "mlp_clean", "--workdir", tmp_path / "work"), f"--workdir {tmp_path / 'work'} is not an empty folder")
    assert scores.read_text() == "[]" and (tmp_path / "work" / "mine.txt").read_text() == "x"


def test_demo_never_deletes_a_users_files(tmp_path: Path) -> None:
    run_dir = tmp_path / "real-run"
    shutil.copytree(trace("mlp_clean"), run_dir / "trace")  # looks exactly like a demo's output
    (run_dir / "checkpoints").mkdir()
    (run_dir / "checkpoints" / "step-000100.pt").write_bytes(b"weights")
    before = sorted(p.relative_to(run_dir) for p in run_dir.rglob("*"))
    line = one_line_error(run("demo", "--out", run_dir), f"--out {run_dir} is not empty and holds files the demo did not write")
    assert line.endswith("nothing was deleted — pass --out with a new or empty folder")
    assert sorted(p.relative_to(run_dir) for p in run_dir.rglob("*")) == before


# --- size -------------------------------------------------------------------------------------

def test_a_model_with_5000_components_all_alarming_replays(tmp_path: Path) -> None:
    import numpy as np
    from warninglight.tracer.writer import Segment, TraceWriter

    n_steps, names = 8, [f"layer{i}" for i in range(5000)]
    rng = np.random.default_rng(0)
    stats = 1 + rng.random((n_steps, len(names), len(schema.HEALTH_METRICS)))
    steps = np.arange(1, n_steps + 1)
    empty = {t: {c.name: [] for c in schema.COLUMNS[t]} for t in ("scalars", "events")}
    tables = {**empty,
              "components": {"component": names, "kind": ["Linear"] * len(names),
                             "forward_index": list(range(len(names))), "param_count": [10] * len(names),
                             "role": ["param"] * len(names), "bound": [None] * len(names),
                             "parent_param": [None] * len(names)},
              "steps": {"step": steps.tolist(), "wall_time_s": [1.0 * s for s in steps],
                        "step_time_s": [1.0] * n_steps, "loss": [2.0] * n_steps, "lr": [0.1] * n_steps,
                        "grad_norm_total_l2": [1.0] * n_steps, "micro_batches": [1] * n_steps,
                        "batch_ids": [None] * n_steps}}
    writer = TraceWriter(tmp_path, 0, 1, "wide", "Wide", {})
    writer.submit(Segment(steps, names, stats, np.ones(stats.shape, bool), tables), final=True)
    writer.close("normal")
    got = run("replay", tmp_path)  # every count is 1: a non-finite value in every component
    assert got.exit_code == 0 and got.stderr == "", got.output
    lines = got.stdout.splitlines()
    assert len(lines) == 5000 and all(" LIGHT  layer" in ln and " exploding (out_nonfinite_count" in ln
                                      for ln in lines)
    assert "components: 5000\n" in run("info", tmp_path).stdout


# --- what the recorder said, and how the run ended ---------------------------------------------

def _recorded(path: Path, *, eval_mode: bool = False, fail_at: int | None = None) -> Path:
    """A small MLP trained 80 steps under `watch` (in eval() mode, or raising at step `fail_at`)."""
    import torch
    import torch.nn.functional as F
    from warninglight.lab import zoo
    from warninglight.tracer import watch

    torch.manual_seed(0)
    model = zoo.mlp()
    model.train(not eval_mode)
    opt = torch.optim.SGD(model.parameters(), 0.05)
    data = zoo.batches(*zoo.teacher_classification(n=512), 32)
    try:
        with watch(model, opt, path) as rec:
            for step in range(1, 81):
                _, x, y = next(data)
                if step == fail_at:
                    raise RuntimeError("the data loader died")
                loss = F.cross_entropy(model(x), y)
                opt.zero_grad()
                loss.backward()
                opt.step()
                rec.log(loss=loss.item())
    except RuntimeError:
        pass
    return path


def test_what_the_recorder_warned_of_at_run_time_is_in_analyze(tmp_path: Path) -> None:
    import warnings as py_warnings

    with py_warnings.catch_warnings():
        py_warnings.simplefilter("ignore")  # the run-time warning: said again by analyze, checked here
        path = _recorded(tmp_path / "run", eval_mode=True)
    said = [w for w in warnings_of(path) if w.startswith("the recorder warned at step ")]
    assert len(said) == 1 and "eval() mode" in said[0] and "call model.train()" in said[0]


def test_a_run_that_ended_with_an_exception_says_so_in_info_and_analyze(tmp_path: Path) -> None:
    path = _recorded(tmp_path / "run", fail_at=40)
    assert "ended: exception" in run("info", path).stdout.splitlines()
    assert any(w.startswith("the run ended with an exception (rank 0, incarnation 1, last step recorded 39)")
               for w in warnings_of(path))
    assert "ended: normal" in run("info", _recorded(tmp_path / "clean")).stdout.splitlines()


def test_a_run_folder_given_for_its_trace_names_the_trace_inside(tmp_path: Path, copy: Path) -> None:
    (tmp_path / "demo").mkdir()
    shutil.move(copy, tmp_path / "demo" / "trace")
    one_line_error(run("analyze", tmp_path / "demo"),
                   f"{tmp_path / 'demo'} is not a trace directory but holds one: pass {tmp_path / 'demo' / 'trace'}")
