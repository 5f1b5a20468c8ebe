"""The commands: exit codes, one-line errors without tracebacks, JSON contract, help everywhere."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import typer
from rehearsed import trace
from typer.testing import CliRunner
from warninglight.cli.main import app
from warninglight.tracer import schema

runner = CliRunner()
MINE = ["info", "query", "analyze", "rollback", "replay", "conditions"]


def run(*args: str):
    return runner.invoke(app, [str(a) for a in args])


def assert_one_line_error(result, *fragments: str) -> None:
    assert result.exit_code == 2, result.output
    assert result.stdout == ""
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), result.stderr
    assert "Traceback" not in result.stderr
    assert result.exception is None or isinstance(result.exception, SystemExit)
    for f in fragments:
        assert f in lines[0]


@pytest.fixture
def broken(tmp_path: Path):
    """Copies of a real trace, damaged in the ways a user can hit."""
    def make(kind: str) -> Path:
        out = tmp_path / kind
        shutil.copytree(trace("mlp_clean"), out)
        if kind == "empty":
            for table in schema.TABLES:
                shutil.rmtree(out / table, ignore_errors=True)  # a single-rank trace has no replicas
        elif kind == "corrupt":
            seg = sorted((out / "steps").rglob("part-*.parquet"))[0]
            seg.write_bytes(b"PAR1 not really")
        elif kind == "version":
            m = schema.manifest_path(out, 0)
            m.write_text(json.dumps({**json.loads(m.read_text()), "format_version": 7}))
        return out
    return make


@pytest.mark.parametrize("command", ["info", "analyze", "rollback", "replay"])
@pytest.mark.parametrize(("kind", "fragments"), [
    ("not_a_trace", ["is this a trace directory?", "expected files like health/rank=0"]),
    ("empty", ["no health rows in", "recorded no complete steps"]),
    ("corrupt", ["is not readable Parquet", "part-000000", "move it out"]),
    ("version", ["format_version 7", "rank=0.json", "upgrade warninglight"]),
])
def test_bad_input_is_one_line_exit_2(command: str, kind: str, fragments: list[str], broken, tmp_path) -> None:
    path = tmp_path if kind == "not_a_trace" else broken(kind)
    result = run(command, path)
    if (kind, command) == ("empty", "info"):  # a run killed before its first segment: info still works
        assert result.exit_code == 0 and "steps: 0\n" in result.stdout
        assert result.stderr.startswith("warning: no committed segments under ")
        return
    assert_one_line_error(result, *fragments)
    if kind != "not_a_trace":
        assert str(path) in result.stderr


def test_missing_path_is_one_line(tmp_path: Path) -> None:
    assert_one_line_error(run("analyze", tmp_path / "nope"), "is not a directory", "nope")


def test_analyze_exit_codes_and_text() -> None:
    healthy, faulty = trace("mlp_clean"), trace("mlp_weight_corruption")
    assert run("analyze", healthy, "--exit-code").exit_code == 0
    r = run("analyze", faulty)
    assert r.exit_code == 0 and r.stdout.startswith("verdict: fault\nroot: 2 exploding: onset step 150")
    assert "rollback: checkpoint at step 100" in r.stdout and "loss-only operator" in r.stdout
    assert run("analyze", faulty, "--exit-code").exit_code == 1


def test_analyze_json_is_the_documented_object() -> None:
    r = run("analyze", trace("mlp_weight_corruption"), "--json")
    d = json.loads(r.stdout)
    assert d["verdict"] == "fault"
    assert set(d["root"]) >= {"attributed_to", "observed_on", "condition", "onset_step", "alarm_step", "magnitude",
                              "metric"}
    assert all(set(a) >= {"attributed_to", "observed_on", "condition", "step", "onset_step", "magnitude", "metric"}
               for a in d["alarms"])
    assert "component" not in d["root"] and all("component" not in a for a in d["alarms"])  # one vocabulary
    assert set(d["rollback"]) >= {"checkpoint_step", "checkpoint_path", "steps_discarded", "skip_step_range",
                                  "skip_batches", "loss_only"}
    assert set(d["rollback"]["loss_only"]) >= {"alarm_step", "checkpoint_step", "contaminated", "steps_discarded"}
    assert set(d["detectors"]) >= {"loss_spike_step", "grad_norm_spike_step"}
    assert (d["root"]["attributed_to"], d["root"]["onset_step"], d["rollback"]["checkpoint_step"]) == ("2", 150, 100)
    documented = documented_keys()
    emitted = {"Top level": d, "`root`": d["root"], "`alarms[]`": d["alarms"][0], "`rollback`": d["rollback"],
               "`rollback.loss_only`": d["rollback"]["loss_only"], "`detectors`": d["detectors"], "`repair`": d["repair"]}
    for section, obj in emitted.items():  # every emitted key documented in its section, and no stale one
        assert set(obj) == documented[section], f"docs/analysis-json.md section {section}"


def documented_keys() -> dict[str, set[str]]:
    """The keys each section of docs/analysis-json.md documents (first column of its table)."""
    doc = (Path(__file__).parents[1] / "docs" / "analysis-json.md").read_text()
    keys: dict[str, set[str]] = {}
    section = ""
    for line in doc.splitlines():
        if line.startswith("#"):
            section = line.lstrip("#").strip()
        elif line.startswith("| `"):
            keys.setdefault(section, set()).add(line.split("`")[1])
    return keys


def test_threshold_options_reach_the_classifier(tmp_path: Path) -> None:
    faulty = trace("mlp_weight_corruption")
    strict = run("analyze", faulty, "--json", "--set", "exploding.persistence=30")
    assert json.loads(strict.stdout)["root"]["condition"] != "exploding" or \
        json.loads(strict.stdout)["root"]["alarm_step"] >= 179
    f = tmp_path / "t.toml"
    f.write_text("[exploding]\npersistence = 30\n")
    assert json.loads(run("analyze", faulty, "--json", "--config", f).stdout) == json.loads(strict.stdout)
    assert_one_line_error(run("analyze", faulty, "--set", "exploding.out_rms.q=1"), "not a threshold")


def test_query_formats_and_bad_sql() -> None:
    t = trace("mlp_clean")
    sql = "SELECT component, count(*) AS n FROM health WHERE component IN ('0', '6') GROUP BY 1 ORDER BY 1"
    assert run("query", t, sql, "--format", "csv").stdout == "component,n\n0,300\n6,300\n"
    assert json.loads(run("query", t, sql, "--format", "json").stdout) == [
        {"component": "0", "n": 300}, {"component": "6", "n": 300}]
    assert run("query", t, sql).stdout.splitlines() == ["component  n", "0          300", "6          300"]
    assert_one_line_error(run("query", t, "SELEC 1"), "syntax error")
    assert_one_line_error(run("query", t, "SELECT * FROM nonesuch"), "DESCRIBE health")
    assert_one_line_error(run("query", t, "SELECT nope FROM health"), "nope")
    for no_rows in ("", "/* just a comment */"):
        assert_one_line_error(run("query", t, no_rows), "returns no result to print", "give a SELECT")
    assert_one_line_error(run("query", t, "SELECT [1, 2] AS ids", "--format", "csv"),
                          "CSV cannot hold", "ids", "--format json")


def test_info_replay_rollback_conditions() -> None:
    t = trace("mlp_weight_corruption")
    assert "steps: 300" in run("info", t).stdout
    timeline = run("replay", t).stdout
    assert "LIGHT  2 exploding" in timeline and "loss-spike rule fires" in timeline
    assert run("rollback", t).stdout.startswith("rollback: checkpoint at step 100")
    table = run("conditions").stdout
    for name in ("dead", "oscillating", "saturated", "stagnant", "exploding", "losing_confidence",
                 "losing_gradient", "unclassified"):
        assert name in table


def test_every_command_and_option_has_help() -> None:
    group = typer.main.get_command(app)
    assert set(MINE) <= set(group.commands)
    for name, cmd in group.commands.items():
        r = run(name, "--help")
        assert r.exit_code == 0, name
        assert cmd.help and cmd.help.split("\n")[0] in " ".join(r.stdout.split()), f"{name} has no help"
        for param in cmd.params:
            assert getattr(param, "help", None), f"{name} {param.name} has no help text"
    top = run("--help").stdout
    assert all(name in top for name in group.commands)


@pytest.mark.parametrize("command", ["analyze", "replay", "rollback"])
def test_a_trace_closed_before_its_first_step_is_one_line(command: str, tmp_path: Path) -> None:
    from warninglight.lab import zoo
    from warninglight.tracer import watch

    watch(zoo.mlp(), tmp_path / "t").close()  # empty segments, no steps: not "healthy"
    assert_one_line_error(run(command, tmp_path / "t"), "no health rows", "recorded no complete steps")


def test_a_healthy_verdict_on_a_trace_too_short_to_judge_says_so(tmp_path: Path) -> None:
    import torch
    from warninglight.lab import zoo
    from warninglight.tracer import watch

    model = zoo.mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with watch(model, opt, tmp_path / "t"):
        for _ in range(5):
            model(torch.randn(8, 32)).pow(2).mean().backward()
            opt.step()
            opt.zero_grad()
    r = run("analyze", tmp_path / "t")
    assert r.exit_code == 0 and r.stdout.startswith("verdict: healthy\n")
    assert r.stdout.splitlines()[-1].startswith(
        "note: only 5 steps recorded; a component is first judged against its baseline at its recorded step 67 ")
    assert "note:" not in run("analyze", trace("mlp_clean")).stdout


def test_the_installed_command_answers_and_exits_with_the_apps_codes(tmp_path: Path) -> None:
    # `warninglight` as pip installs it (pyproject's script: `run`, the app with the collector set
    # for a short process), in a fresh interpreter
    import subprocess
    import sys
    import tomllib

    scripts = tomllib.loads((Path(__file__).resolve().parents[1] / "pyproject.toml").read_text())["project"]["scripts"]
    assert scripts["warninglight"] == "warninglight.cli.main:run"
    command = [sys.executable, "-c", "import sys; from warninglight.cli.main import run; sys.exit(run())"]
    ok = subprocess.run([*command, "query", trace("mlp_clean"), "SELECT count(*) AS n FROM health", "--format", "csv"],
                        capture_output=True, text=True, timeout=120)
    assert (ok.returncode, ok.stdout) == (0, "n\n2100\n"), ok.stderr
    bad = subprocess.run([*command, "info", tmp_path / "missing"], capture_output=True, text=True, timeout=120)
    assert bad.returncode == 2 and bad.stdout == "" and bad.stderr.startswith("error: ") and "not a directory" in bad.stderr


def test_every_commands_annotations_are_evaluated_not_strings() -> None:
    # Typer reads each command's signature at every start; a string annotation (PEP 563) costs it
    # an eval each: ~15 ms of every quick command for the 20 commands
    import inspect

    for command in app.registered_commands:
        hints = inspect.get_annotations(command.callback)
        assert hints and not [k for k, v in hints.items() if isinstance(v, str)], command.callback.__name__


def test_the_command_keeps_freed_memory_a_while_but_never_over_the_users_setting() -> None:
    # the allocators' settings for a command's process (cli/main.py): set before Polars and
    # Arrow load, each one left as the user gave it
    show = ("import os, sys; import warninglight.cli.main; "
            "print(os.environ['MIMALLOC_PURGE_DELAY'], os.environ['_RJEM_MALLOC_CONF'], 'pyarrow' in sys.modules)")
    env = {k: v for k, v in os.environ.items() if k not in ("MIMALLOC_PURGE_DELAY", "_RJEM_MALLOC_CONF")}
    ours = subprocess.run([sys.executable, "-c", show], capture_output=True, text=True, check=True, env=env)
    assert ours.stdout.split() == ["2000", "dirty_decay_ms:5000,muzzy_decay_ms:5000", "False"]
    theirs = subprocess.run([sys.executable, "-c", show], capture_output=True, text=True, check=True,
                            env={**env, "MIMALLOC_PURGE_DELAY": "7", "_RJEM_MALLOC_CONF": "dirty_decay_ms:0"})
    assert theirs.stdout.split() == ["7", "dirty_decay_ms:0", "False"]
