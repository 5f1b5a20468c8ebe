"""The recorder's facts of the training loop (tracer/loopfacts.py), read back from real traces."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import duckdb
import pytest
import torch
import torch.nn.functional as F
from torch import nn
from warninglight.tracer import watch

STEPS = 6


def _mlp() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Dropout(0.1), nn.Linear(16, 4))


def _plain(m: nn.Module, opt: torch.optim.Optimizer, x: torch.Tensor, y: torch.Tensor) -> None:
    opt.zero_grad()
    F.cross_entropy(m(x), y).backward()
    opt.step()


def _no_zero_grad(m: nn.Module, opt: torch.optim.Optimizer, x: torch.Tensor, y: torch.Tensor) -> None:
    F.cross_entropy(m(x), y).backward()
    opt.step()


def _zero_after_forward(m: nn.Module, opt: torch.optim.Optimizer, x: torch.Tensor, y: torch.Tensor) -> None:
    loss = F.cross_entropy(m(x), y)
    opt.zero_grad(set_to_none=False)  # zeroed in place, after the forward
    loss.backward()
    opt.step()


def _accumulate(m: nn.Module, opt: torch.optim.Optimizer, x: torch.Tensor, y: torch.Tensor) -> None:
    opt.zero_grad()
    for half in (slice(0, 16), slice(16, 32)):  # two micro-batches into the same gradients
        F.cross_entropy(m(x[half]), y[half]).backward()
    opt.step()


def _accumulate_no_zero(m: nn.Module, opt: torch.optim.Optimizer, x: torch.Tensor, y: torch.Tensor) -> None:
    for half in (slice(0, 16), slice(16, 32)):
        F.cross_entropy(m(x[half]), y[half]).backward()
    opt.step()


def _second_loss_first(m: nn.Module, opt: torch.optim.Optimizer, x: torch.Tensor, y: torch.Tensor) -> None:
    """A GAN's shape: another loss reaches the watched model's parameters before the loop clears
    them for its own backward pass."""
    m(x).square().mean().backward()  # the other loss, through this model
    opt.zero_grad()
    F.cross_entropy(m(x), y).backward()
    opt.step()


def _record(tmp_path: Path, loop: Callable[..., None], *, eval_mode: bool = False) -> list[dict[str, Any]]:
    m = _mlp()
    opt = torch.optim.SGD(m.parameters(), lr=0.1)
    if eval_mode:
        m.eval()
    g = torch.Generator().manual_seed(1)
    with watch(m, opt, tmp_path / "t") as rec:
        for step in range(STEPS):
            x, y = torch.randn(32, 8, generator=g), torch.randint(0, 4, (32,), generator=g)
            loop(m, opt, x, y)
            rec.batch(list(range(32 * step, 32 * step + 32)))
    return _steps(tmp_path / "t")


def _steps(trace: Path) -> list[dict[str, Any]]:
    rel = duckdb.sql(f"SELECT * FROM read_parquet('{trace}/steps/*/*/*.parquet') ORDER BY step")
    return [dict(zip(rel.columns, row, strict=True)) for row in rel.fetchall()]


@pytest.mark.parametrize(("loop", "stale"), [
    (_plain, 0), (_zero_after_forward, 0), (_accumulate, 0), (_second_loss_first, 0),
    (_no_zero_grad, 4), (_accumulate_no_zero, 4),
])
def test_gradients_never_cleared_are_counted_from_the_second_step(tmp_path: Path, loop: Callable[..., None],
                                                                   stale: int) -> None:
    rows = _record(tmp_path, loop)
    assert rows[0]["grads_not_cleared"] is None  # no step before the first to carry from
    assert [r["grads_not_cleared"] for r in rows[1:]] == [stale] * (STEPS - 1)
    assert all(r["params_with_grad"] == 4 for r in rows)



def test_eval_mode_forwards_are_counted_and_no_training_forward_is(tmp_path: Path) -> None:
    rows = _record(tmp_path, _plain, eval_mode=True)
    assert [(r["eval_forwards"], r["micro_batches"]) for r in rows] == [(1, 0)] * STEPS
    train = _record(tmp_path / "train", _plain)
    assert [(r["eval_forwards"], r["micro_batches"]) for r in train] == [(0, 1)] * STEPS


def test_the_input_rows_and_shape_are_what_the_model_received(tmp_path: Path) -> None:
    rows = _record(tmp_path, _accumulate)
    assert [(r["input_rows"], r["input_shape"]) for r in rows] == [(32, [16, 8])] * STEPS
    assert all(len(r["batch_ids"]) == 32 for r in rows)


class _KeywordModel(nn.Module):
    """A model called with keyword arguments only, as transformers' models are."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(50, 8)
        self.head = nn.Linear(8, 50)

    def forward(self, *, input_ids: torch.Tensor) -> torch.Tensor:
        return self.head(self.embed(input_ids))


def test_a_keyword_input_is_read(tmp_path: Path) -> None:
    torch.manual_seed(0)
    m = _KeywordModel()
    opt = torch.optim.Adam(m.parameters())
    with watch(m, opt, tmp_path / "t"):
        for _ in range(3):
            ids = torch.randint(0, 50, (4, 7))
            opt.zero_grad()
            F.cross_entropy(m(input_ids=ids).reshape(-1, 50), ids.reshape(-1)).backward()
            opt.step()
    assert [(r["input_rows"], r["input_shape"]) for r in _steps(tmp_path / "t")] == [(4, [4, 7])] * 3


def test_frozen_parameters_are_named_and_have_no_gradient(tmp_path: Path) -> None:
    m = _mlp()
    m[0].weight.requires_grad_(False)
    opt = torch.optim.SGD(m.parameters(), lr=0.1)  # holds the frozen weight too, as often
    with watch(m, opt, tmp_path / "t"):
        for _ in range(3):
            _plain(m, opt, torch.randn(32, 8), torch.randint(0, 4, (32,)))
    rows = _steps(tmp_path / "t")
    assert [r["params_with_grad"] for r in rows] == [3, 3, 3]
    comps = duckdb.sql(f"SELECT component, requires_grad, optimizer_index FROM "
                       f"read_parquet('{tmp_path}/t/components/*/*/*.parquet') WHERE param_count > 0 "
                       "ORDER BY component").fetchall()
    assert comps == [("0", [False, True], [0, 1]), ("3", [True, True], [2, 3])]


def test_a_component_left_in_eval_mode_is_an_event_once(tmp_path: Path) -> None:
    torch.manual_seed(0)
    m = nn.Sequential(nn.Linear(8, 16), nn.BatchNorm1d(16), nn.ReLU(), nn.Linear(16, 4))
    opt = torch.optim.SGD(m.parameters(), lr=0.1)
    with watch(m, opt, tmp_path / "t"):
        for step in range(4):
            m.train()
            if step >= 1:
                m[1].eval()  # frozen batch norm from the second step on
            _plain(m, opt, torch.randn(32, 8), torch.randint(0, 4, (32,)))
    found = duckdb.sql(f"SELECT step, detail FROM read_parquet('{tmp_path}/t/events/*/*/*.parquet') "
                       "WHERE kind = 'finding'").fetchall()
    assert len(found) == 1
    assert json.loads(found[0][1]) == {"finding": "component_eval_mode", "component": "1",
                                       "kind": "BatchNorm1d", "step": 2}
