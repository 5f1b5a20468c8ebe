"""The README's set-up commands are the ones CI runs, verbatim."""

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _setup_commands() -> list[str]:
    readme = (ROOT / "README.md").read_text()
    section = readme.split("## Set up", 1)[1]
    block = re.search(r"```bash\n(.*?)```", section, re.S)
    assert block, "README's Set up section has no ```bash block"
    return [line for line in block.group(1).splitlines() if line.strip()]


def test_readme_has_two_setup_commands() -> None:
    commands = _setup_commands()
    assert len(commands) == 2
    assert "demo" in commands[0]
    assert "pytest" in commands[1]


def test_ci_runs_the_readme_commands_verbatim() -> None:
    ci_lines = (ROOT / ".ci" / "run").read_text().splitlines()
    for command in _setup_commands():
        assert command in ci_lines, f"{command!r} is in the README but not in .ci/run"


def test_the_test_command_installs_every_extra() -> None:
    """So no integration test (MLflow, TensorBoard, W&B, transformers, Lightning) is skipped in CI."""
    import tomllib

    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    everything = extras["all"][0]
    assert everything.startswith("warninglight[")
    named = set(everything[len("warninglight["):-1].split(","))
    assert named == set(extras) - {"dev", "all"}
    assert "'.[dev,all]'" in _setup_commands()[1]
