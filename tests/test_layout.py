"""The package layout holds: the recorder and the engine never import the lab."""

from __future__ import annotations

import subprocess
import sys

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
