"""Counts the host reads the recorder makes: every way a tensor's value reaches Python, called
from the recorder's own code (tracer/) on the training (main) thread. On an accelerator each one
waits for the device; on the CPU the few that remain are documented (docs/overhead.md)."""

from __future__ import annotations

import sys
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import torch
from warninglight.tracer import probes

TRACER_DIR = str(Path(probes.__file__).parent)
READS = ("item", "tolist", "numpy", "__bool__", "__float__", "__int__", "__index__")


@contextmanager
def counting() -> Iterator[dict[str, int]]:
    """{way of reading: times the recorder used it} while the block runs."""
    counts = dict.fromkeys(READS, 0)
    main = threading.main_thread()
    real = {name: getattr(torch.Tensor, name) for name in READS}
    own = {name for name in READS if name in vars(torch.Tensor)}  # the rest are inherited

    def counted(name: str):  # noqa: ANN202
        def read(self: torch.Tensor, *args: object, **kwargs: object) -> object:
            caller = sys._getframe(1).f_code.co_filename
            if threading.current_thread() is main and caller.startswith(TRACER_DIR):
                counts[name] += 1
            return real[name](self, *args, **kwargs)
        return read
    try:
        for name in READS:
            setattr(torch.Tensor, name, counted(name))
        yield counts
    finally:
        for name, method in real.items():
            if name in own:
                setattr(torch.Tensor, name, method)
            else:
                delattr(torch.Tensor, name)
