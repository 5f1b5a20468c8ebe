"""Global state every test must leave as it found it: torch's CPU threads and matplotlib's backend.

The suite runs torch on one CPU thread, set once here: small models train fastest on one (on a
shared 2-core machine two threads spin against each other), and reductions then run in the same
order everywhere. A test that changes either setting and leaves it changed fails, and the setting
is put back so the next test is not affected.

The engine's kernels run compiled (`WARNINGLIGHT_KERNELS=compiled`, in the commands the tests
start too): on a fresh checkout the small inputs of tests would otherwise run as Python, and
nothing compiled would be tested (tests/test_compiled.py holds the two to each other). Set the
variable to `python` to run the suite's kernels as Python instead.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import contextmanager

import matplotlib
import pytest
import torch
from warninglight.forensics.judging.kernels import compiled

os.environ.setdefault(compiled.ENV, "compiled")
compiled.MODE = os.environ[compiled.ENV]

SUITE_THREADS = 1


def pytest_configure(config: pytest.Config) -> None:
    torch.set_num_threads(SUITE_THREADS)


@contextmanager
def torch_threads(n: int) -> Iterator[None]:
    """Run a block with `n` torch CPU threads, then put the previous count back."""
    before = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(before)


@pytest.fixture(autouse=True)
def _global_state_is_restored() -> Iterator[None]:
    threads, backend = torch.get_num_threads(), matplotlib.get_backend()
    yield
    leaked = []
    if torch.get_num_threads() != threads:
        leaked.append(f"torch threads {threads} -> {torch.get_num_threads()}")
        torch.set_num_threads(threads)
    if matplotlib.get_backend() != backend:
        leaked.append(f"matplotlib backend {backend} -> {matplotlib.get_backend()}")
        matplotlib.use(backend)
    assert not leaked, f"the test changed global state and did not restore it: {'; '.join(leaked)}"
