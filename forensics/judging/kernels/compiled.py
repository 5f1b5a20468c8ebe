"""Each kernel compiled, or run as its own Python code while compiling it would cost more.

numba compiles a kernel the first time it is called with new argument types and caches the
machine code (`cache=True`), so a later process loads it at once; compiling every kernel an
analysis calls takes much longer than a small trace's analysis needs as plain Python. So `pick`
gives a kernel's own Python code (its `py_func`) while the kernel is neither compiled in this
process nor in numba's cache, the call is small (`CALL` rows) and the kernel's CPU time as
Python in this process, this call's predicted from the calls before, stays within `BUDGET`;
past them it compiles, and runs compiled from then on. The kernels it calls run as their
Python code too (what NUMBA_DISABLE_JIT does, for one call tree): the same arithmetic in the
same order, so the same results bit for bit (tests/test_compiled.py).

`WARNINGLIGHT_KERNELS` chooses for the process: `auto` (the default, as above), `compiled`
(always compile: the test suite, a machine that analyses many small traces) or `python`
(Python wherever it gives the compiled result: to step through a kernel in a debugger).
`mode` chooses inside a block.
"""

from __future__ import annotations

import contextlib
import os
import threading
import time
import types
from collections import Counter
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
from numba.core.dispatcher import Dispatcher
from warninglight.forensics.judging.conditions import ConfigError

ENV = "WARNINGLIGHT_KERNELS"
MODES = ("auto", "compiled", "python")
MODE = os.environ.get(ENV, "auto")  # this process's (`mode` changes it inside a block)
CALL = 20_000  # rows: a larger call compiles (a small trace is one step window, one call per metric)
# CPU seconds one kernel runs as Python in a process before it compiles: about what compiling one
# of the larger kernels takes, so a kernel called often costs at most about twice the better choice
BUDGET = 2.0

_lock = threading.Lock()
_rows: Counter[Dispatcher] = Counter()  # rows each kernel ran as Python
_seconds: Counter[Dispatcher] = Counter()  # and the CPU seconds they took
_on_disk: dict[Dispatcher, bool] = {}
_twins: dict[Dispatcher, Callable[..., Any]] = {}
_namespaces: dict[int, tuple[dict[str, Any], dict[str, Any]]] = {}  # id(module globals): (them, the twins')


class KernelModeError(ConfigError):
    """`WARNINGLIGHT_KERNELS` (or `mode`) names no mode."""


def pick(kernel: Dispatcher, rows: int) -> Callable[..., Any]:
    """`kernel`, or a call of its Python code where that costs less than compiling it (a call on
    `rows` rows; see the module's docstring). Either gives the same results."""
    mode = _checked(MODE)
    if mode == "compiled" or (mode == "auto" and kernel.signatures):
        return kernel
    with _lock:
        if mode == "auto" and (rows > CALL or _cached(kernel) or _seconds[kernel] + rows * _per_row(kernel) > BUDGET):
            return kernel
        return _python(kernel, _twin(kernel), rows)


@contextlib.contextmanager
def mode(name: str) -> Iterator[None]:
    """Every kernel `pick`ed inside the block compiled (`"compiled"`), as Python (`"python"`) or
    chosen (`"auto"`), in every thread: tests, and `quantiles.warm`, which compiles ahead."""
    global MODE
    before, MODE = MODE, _checked(name)
    try:
        yield
    finally:
        MODE = before


def _checked(name: str) -> str:
    if name not in MODES:
        raise KernelModeError(f"{ENV}={name!r} is not a kernel mode — set it to one of {', '.join(MODES)} "
                              "(unset: auto)")
    return name


def _cached(kernel: Dispatcher) -> bool:
    """Whether numba's cache holds the kernel, for its current source and this CPU."""
    if kernel not in _on_disk:
        try:  # numba's private cache index: guarded, since a wrong answer may cost time, never a result
            index = kernel._cache._cache_file._load_index()  # {} where stale or absent
            magic = kernel.targetctx.codegen().magic_tuple()  # the CPU: part of each entry's key
            _on_disk[kernel] = any(key[1] == magic for key in index)
        except Exception:  # no cache (`cache=False`), or numba laid it out otherwise: compile
            _on_disk[kernel] = False
    return _on_disk[kernel]


def _per_row(kernel: Dispatcher) -> float:
    """CPU seconds a row the kernel took as Python so far (0: not run yet)."""
    return _seconds[kernel] / _rows[kernel] if _rows[kernel] else 0.0


def _python(kernel: Dispatcher, twin: Callable[..., Any], rows: int) -> Callable[..., Any]:
    """A call of the kernel's Python code `twin` on `rows` rows that behaves as the compiled
    kernel: no floating-point warnings, and where Python raises (an exp that overflows, a log
    of 0: compiled code gives inf) the call is made compiled instead. Its CPU time is counted."""
    def call(*args: Any) -> Any:
        start = time.thread_time()  # this thread's: not the time it waits for the GIL
        try:
            with np.errstate(all="ignore"):  # compiled code raises no floating-point warning
                return twin(*args)
        except (ArithmeticError, ValueError):
            # the kernels that can raise so (the baseline's, which take exp and log) write their
            # outputs afresh or fold a maximum into them: the compiled call leaves what it would alone
            return kernel(*args)
        finally:
            with _lock:
                _rows[kernel] += rows
                _seconds[kernel] += time.thread_time() - start
    return call


def _twin(kernel: Dispatcher) -> Callable[..., Any]:
    """The kernel's Python function, every kernel in its globals (or its closure) as Python too."""
    if kernel not in _twins:
        f = kernel.py_func
        globals_ = _namespace(f.__globals__)
        closure = None if f.__closure__ is None else tuple(
            types.CellType(_twin(c.cell_contents)) if isinstance(c.cell_contents, Dispatcher) else c
            for c in f.__closure__)
        _twins.setdefault(kernel, types.FunctionType(f.__code__, globals_, f.__name__, f.__defaults__, closure))
    return _twins[kernel]


def _namespace(module_globals: dict[str, Any]) -> dict[str, Any]:
    """A module's globals with its kernels, and those of the modules it names (`rt.hits`), as Python."""
    key = id(module_globals)
    if key not in _namespaces:
        ns = dict(module_globals)
        _namespaces[key] = module_globals, ns  # first: the kernels in it may call each other
        for name, value in module_globals.items():
            if isinstance(value, Dispatcher):
                ns[name] = _twin(value)
            elif isinstance(value, types.ModuleType) and any(isinstance(v, Dispatcher) for v in vars(value).values()):
                ns[name] = types.SimpleNamespace(**{k: _twin(v) if isinstance(v, Dispatcher) else v
                                                    for k, v in vars(value).items()})
    return _namespaces[key][1]
