"""The package layout holds: the recorder and the engine never import the lab."""

from __future__ import annotations

import re
import subprocess
import sys

import importgraph
import pytest


@pytest.mark.parametrize("package", ["warninglight.tracer", "warninglight.forensics", "warninglight.cli.main"])
def test_product_packages_do_not_import_the_lab(package: str) -> None:
    code = (f"import sys, {package}; "
            "print(sorted(m for m in sys.modules if m.startswith('warninglight.lab')))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]", f"{package} imports the lab: {out.stdout}"


def test_recorder_imports_no_engine_tracker_or_framework() -> None:
    """Live alarms import the engine and trackers only when used; `import warninglight.tracer` and
    a plain `watch` stay free of them."""
    heavy = ("warninglight.forensics", "warninglight.tracer.alarms", "mlflow", "wandb", "tensorboard",
             "transformers", "lightning")
    code = ("import sys, torch; from warninglight.tracer import watch; import tempfile; "
            "m = torch.nn.Linear(2, 2); o = torch.optim.SGD(m.parameters(), 0.1); "
            "rec = watch(m, o, tempfile.mkdtemp()); m(torch.ones(1, 2)).sum().backward(); o.step(); "
            f"rec.close(); print(sorted(m for m in sys.modules if m.startswith({heavy!r})))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]", out.stdout


# The engine's layers, lowest first: a module imports only its own layer and those below it.
LAYERS = ("trace", "judging", "comparators", "explaining", "presenting")


def _layer(module: str) -> int | None:
    parts = module.split(".")
    if parts[:2] != ["warninglight", "forensics"] or len(parts) < 3:
        return None
    return LAYERS.index(parts[2])


def test_engine_layers_import_downward_only() -> None:
    upward = [(m, t) for m, targets in importgraph.graph().items() for t in targets
              if _layer(m) is not None and _layer(t) is not None and _layer(t) > _layer(m)]
    assert upward == [], f"a layer imports one above it: {upward}"


def test_the_kernels_read_only_the_registry_above_them() -> None:
    """judging/kernels is behind a small interface: it imports other kernels, the conditions'
    registry and the trace's schema, nothing else of the product."""
    allowed = ("warninglight.forensics.judging.kernels.", "warninglight.forensics.judging.conditions",
               "warninglight.tracer.schema")
    wider = [(m, t) for m, targets in importgraph.graph().items() if m.startswith(allowed[0])
             for t in targets if not t.startswith(allowed)]
    assert wider == [], wider


def test_no_import_cycles() -> None:
    assert importgraph.cycles() == []


def test_no_private_names_across_modules() -> None:
    assert importgraph.private_crossings() == []


def test_the_graph_sees_imports_inside_functions() -> None:
    """The checks above could not fail if the graph missed lazy imports: it does not."""
    g = importgraph.graph()
    assert "warninglight.forensics.explaining.analysis" in g["warninglight.cli.analyze_cmds"]  # a lazy import
    assert "warninglight.forensics.trace.store" in g["warninglight.forensics.explaining.analysis"]


def test_the_architecture_map_names_every_module_and_only_real_ones() -> None:
    """docs/architecture.md's module table stays true: each product module is in it, each file
    it names exists."""
    doc = (importgraph.ROOT / "docs" / "architecture.md").read_text()
    named = set()
    for line in doc.splitlines():
        if line.startswith("| `"):
            cell = line.split("|")[1]
            paths = re.findall(r"`([a-z_/]+\.py)`", cell)
            folder = paths[0].rsplit("/", 1)[0] if paths and "/" in paths[0] else ""
            named |= {p if "/" in p else f"{folder}/{p}" for p in paths}
    assert all((importgraph.ROOT / p).is_file() for p in named), sorted(p for p in named if not (importgraph.ROOT / p).is_file())
    modules = {str(p.relative_to(importgraph.ROOT)) for p in importgraph.modules().values() if p.name != "__init__.py"}
    assert sorted(modules - named) == []


def test_the_engine_and_the_cli_load_torch_only_where_a_command_runs_a_model() -> None:
    """Every engine and CLI module imports without torch, and `analyze` runs without it: only
    `rerun` and `repair`, which load checkpoints and train, import it, inside their functions."""
    names = sorted(m for m in importgraph.modules() if m.startswith(("warninglight.forensics", "warninglight.cli")))
    code = ("import importlib, sys\n"
            f"for name in {names!r}: importlib.import_module(name)\n"
            "from typer.testing import CliRunner\n"
            "from warninglight.cli.main import app\n"
            f"r = CliRunner().invoke(app, ['analyze', {str(importgraph.ROOT / 'sample_traces' / 'mlp_dying_layer')!r}])\n"
            "print(r.exit_code, 'torch' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.split() == ["0", "False"], out.stdout + out.stderr


def test_the_recorder_and_the_engine_never_import_recovery() -> None:
    """`recovery` runs models (torch, the recorder, the engine): it sits above both."""
    up = [(m, t) for m, targets in importgraph.graph().items() for t in targets
          if m.startswith(("warninglight.tracer", "warninglight.forensics")) and t.startswith("warninglight.recovery")]
    assert up == [], up
    assert "warninglight.forensics.explaining.analysis" in importgraph.graph()["warninglight.recovery.repair"]
