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
