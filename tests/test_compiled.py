"""A kernel run as its own Python code gives what the compiled kernel gives, bit for bit, and
`compiled.pick` runs a small input as Python only until the kernel compiles."""

from __future__ import annotations

import math
import os
import subprocess
import sys
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numba
import numpy as np
import pytest
from polars.testing import assert_frame_equal
from typer.testing import CliRunner
from warninglight.cli.main import app
from warninglight.forensics import analyze
from warninglight.forensics.explaining import analysis
from warninglight.forensics.judging.kernels import compiled, quantiles

TRACES = Path(__file__).resolve().parents[1] / "sample_traces"


def _analyzed(monkeypatch: pytest.MonkeyPatch, name: str, mode: str) -> analysis.Analysis:
    """`analyze(band=True)` (the report's analysis: heatmap and root band) with every kernel
    run `mode`, counting what `pick` gave: no kernel may run the other way."""
    given: Counter[bool] = Counter()
    pick = compiled.pick

    def counted(kernel: Any, rows: int) -> Callable[..., Any]:
        chosen = pick(kernel, rows)
        given[chosen is kernel] += 1
        return chosen

    with monkeypatch.context() as m, compiled.mode(mode):
        m.setattr(compiled, "pick", counted)
        result = analyze(TRACES / name, band=True)
    assert given[mode == "compiled"] > 0 and given[mode != "compiled"] == 0, given
    return result


def _assert_same(a: analysis.Analysis, b: analysis.Analysis) -> None:
    assert a.to_dict() == b.to_dict()
    assert_frame_equal(a.alarms, b.alarms, check_exact=True)
    assert_frame_equal(a.heat.sort("component", "step"), b.heat.sort("component", "step"), check_exact=True)
    assert (a.root_band is None) == (b.root_band is None)
    if a.root_band is not None and b.root_band is not None:
        assert_frame_equal(a.root_band, b.root_band, check_exact=True)


@pytest.mark.parametrize("name", ["gpt_weight_corruption", "gpt_nan", "gpt_lr_spike", "cnn_bitflip",
                                  "mlp_saturation_gradual", "mlp_clean"])
def test_python_kernels_give_the_compiled_analysis(monkeypatch: pytest.MonkeyPatch, name: str) -> None:
    py, jit = (_analyzed(monkeypatch, name, mode) for mode in ("python", "compiled"))
    _assert_same(py, jit)
    assert py.heat["score"].is_not_null().sum() > 0  # a heatmap of scores, not of nulls, compared
    assert jit.verdict == (analysis.HEALTHY if name.endswith("clean") else analysis.FAULT)


@pytest.mark.parametrize("name", ["gpt_weight_corruption", "cnn_bitflip"])
def test_python_kernels_give_the_compiled_heat_bins(monkeypatch: pytest.MonkeyPatch, name: str) -> None:
    """Several steps a heat cell: the heatmap by `heatbins`' kernels."""
    monkeypatch.setattr(analysis, "HEAT_BINS", 100)
    py, jit = (_analyzed(monkeypatch, name, mode) for mode in ("python", "compiled"))
    assert jit.heat_width > 1
    _assert_same(py, jit)


def _kernels() -> tuple[Any, Any]:
    """A fresh uncompiled kernel (and the one it calls): out[i] = values[i] / 2 + 1."""
    @numba.njit
    def inner(x: float) -> float:  # pragma: no cover - compiled
        return x * 0.5 + 1.0

    @numba.njit
    def outer(values: np.ndarray, out: np.ndarray) -> None:  # pragma: no cover - compiled
        for i in range(len(values)):
            out[i] = inner(values[i])
    return outer, inner


def test_a_small_input_runs_as_python_and_compiles_nothing(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(compiled, "MODE", "auto")
    outer, inner = _kernels()
    values, out = np.linspace(-3.0, 3.0, 10), np.empty(10)
    run = compiled.pick(outer, len(values))
    assert run is not outer
    run(values, out)
    assert out.tolist() == (values * 0.5 + 1.0).tolist()
    assert outer.signatures == [] and inner.signatures == []  # neither compiled


def test_a_large_input_compiles_and_the_kernel_stays_compiled(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(compiled, "MODE", "auto")
    outer, _ = _kernels()
    assert compiled.pick(outer, compiled.CALL + 1) is outer
    assert compiled.pick(outer, compiled.CALL) is not outer  # not compiled yet: at the limit, Python
    outer(np.ones(2), np.empty(2))
    assert compiled.pick(outer, 1) is outer  # compiled in this process


def test_past_its_budget_a_kernel_compiles(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(compiled, "MODE", "auto")
    monkeypatch.setattr(compiled, "BUDGET", 0.0)
    outer, _ = _kernels()
    values, out = np.ones(1000), np.empty(1000)
    first = compiled.pick(outer, len(values))
    assert first is not outer  # its cost as Python not known yet
    first(values, out)
    assert compiled.pick(outer, len(values)) is outer  # its time as Python is past the budget
    assert out.tolist() == [1.5] * 1000


def test_python_that_raises_runs_compiled(monkeypatch: pytest.MonkeyPatch) -> None:
    """Python's exp overflows where compiled code gives inf: the call is made compiled."""
    @numba.njit
    def grown(x: np.ndarray, out: np.ndarray) -> None:  # pragma: no cover - compiled
        for i in range(len(x)):
            out[i] = math.exp(x[i])

    monkeypatch.setattr(compiled, "MODE", "python")
    out = np.empty(2)
    compiled.pick(grown, 2)(np.array([1.0, 1000.0]), out)
    assert np.isinf(out[1]) and grown.signatures != []


def test_a_kernel_in_numbas_cache_runs_compiled(tmp_path: Path) -> None:
    """A new process finds what an earlier one compiled in numba's cache (read through numba's
    private index: this holds that it still reads it)."""
    code = ("import numpy as np; from warninglight.forensics.judging.kernels import compiled, quantiles as q; "
            "print(compiled.pick(q.first_marked, 3) is q.first_marked); "
            "q.first_marked(np.zeros(3, np.bool_), np.array([0, 3]), np.empty(1, np.int64))")
    env = {**os.environ, "NUMBA_CACHE_DIR": str(tmp_path), compiled.ENV: "auto"}
    runs = [subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
            for _ in range(2)]
    assert [r.stdout.strip() for r in runs] == ["False", "True"]


def test_warm_compiles_whatever_the_mode(monkeypatch: pytest.MonkeyPatch) -> None:
    """`warm`'s two-row calls would run as Python: it compiles them (a live monitor's first
    segment is not the one to wait)."""
    modes: list[str] = []
    pick = compiled.pick
    monkeypatch.setattr(compiled, "MODE", "auto")
    monkeypatch.setattr(compiled, "pick", lambda kernel, rows: modes.append(compiled.MODE) or pick(kernel, rows))
    quantiles.warm()
    assert modes and set(modes) == {"compiled"}
    assert compiled.MODE == "auto"  # put back after


def test_an_unknown_mode_is_refused_with_the_variable_and_the_choices(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(compiled, "MODE", "fast")
    with pytest.raises(compiled.KernelModeError, match="WARNINGLIGHT_KERNELS='fast' is not a kernel mode — "
                                                       "set it to one of auto, compiled, python"):
        compiled.pick(quantiles.fold_heat, 1)
    with pytest.raises(compiled.KernelModeError, match="'jit'"), compiled.mode("jit"):
        pass


def test_the_cli_says_an_unknown_mode_in_one_line(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(compiled, "MODE", "fast")
    result = CliRunner().invoke(app, ["analyze", str(TRACES / "mlp_clean")])
    assert result.exit_code == 2, result.output
    assert result.stderr.strip().splitlines() == [
        "error: WARNINGLIGHT_KERNELS='fast' is not a kernel mode — set it to one of auto, compiled, python "
        "(unset: auto)"]
