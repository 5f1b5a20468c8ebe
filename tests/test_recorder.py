"""The recorder on real small training runs: read-only, NaN/Inf counted, real training loops."""

from __future__ import annotations

import contextlib
import copy
import json
import math
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import duckdb
import pytest
import torch
import torch.nn.functional as F
from warninglight.lab import zoo
from warninglight.tracer import kernels, schema, watch

Loss = Callable[[torch.nn.Module, tuple[torch.Tensor, ...]], torch.Tensor]


@pytest.fixture(autouse=True)
def _one_thread() -> Iterator[None]:
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def classify(model: torch.nn.Module, batch: tuple[torch.Tensor, ...]) -> torch.Tensor:
    return F.cross_entropy(model(batch[1]), batch[2])


def next_token(model: torch.nn.Module, batch: tuple[torch.Tensor, ...]) -> torch.Tensor:
    return F.cross_entropy(model(batch[1]).flatten(0, 1), batch[2].flatten())


CASES: dict[str, tuple[Callable[[], torch.nn.Module], Callable[[], Iterator[zoo.Batch]], Loss]] = {
    "mlp": (zoo.mlp, lambda: zoo.batches(*zoo.teacher_classification(512), 32), classify),
    "cnn": (zoo.cnn, lambda: zoo.batches(*zoo.blob_images(256), 16), classify),
    "gpt": (lambda: zoo.TinyGPT(zoo.GPTConfig(block_size=32)),
            lambda: zoo.text_batches(zoo.char_corpus(20_000), 4, 32), next_token),
}


def train(case: str, steps: int, trace: Path | None) -> tuple[list[torch.Tensor], torch.Tensor]:
    """Train one zoo model from a fixed seed; return its parameters and the global RNG state."""
    make_model, make_data, loss_fn = CASES[case]
    torch.manual_seed(0)
    model = make_model()
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    rec = watch(model, opt, trace, flush_every_steps=20) if trace else None
    for _, batch in zip(range(steps), make_data(), strict=False):
        loss = loss_fn(model, batch)
        loss.backward()
        opt.step()
        opt.zero_grad()
        if rec:
            rec.log(loss=loss)
            rec.batch(batch[0])
    if rec:
        rec.close()
    return [p.detach().clone() for p in model.parameters()], torch.get_rng_state()


def read(trace: Path, table: str, sql: str = "select * from t") -> list[tuple]:
    """Rows of a plain-DuckDB query over one trace table, available in `sql` as `t`."""
    glob = schema.segment_glob(trace, table)
    t = f"read_parquet('{glob}', hive_partitioning=true)"
    return duckdb.sql(sql.replace(" from t", f" from {t}")).fetchall()


@pytest.mark.parametrize("case", ["mlp", "cnn", "gpt"])
def test_training_is_bit_identical_with_and_without_the_recorder(case: str, tmp_path: Path) -> None:
    plain, rng_plain = train(case, 50, None)
    watched, rng_watched = train(case, 50, tmp_path / "t")
    assert all(torch.equal(a, b) for a, b in zip(plain, watched, strict=True))
    assert torch.equal(rng_plain, rng_watched)  # the recorder drew nothing from the global RNG
    n_comp = read(tmp_path / "t", "components", "select count(*) from t")[0][0]
    assert read(tmp_path / "t", "health", "select count(*), max(step) from t")[0] == (50 * n_comp, 50)


def test_a_long_flush_interval_reserves_no_rows_for_it_up_front(tmp_path: Path) -> None:
    # a million steps between flushes: the step buffer starts small and doubles as steps come;
    # every step still reaches the trace
    torch.manual_seed(0)
    model = zoo.mlp(hidden=12, depth=2)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    with watch(model, opt, tmp_path, flush_every_steps=10**6, flush_every_s=1e9) as rec:
        first_rows = rec.buffer.stats.shape[0]
        for _, batch in zip(range(600), zoo.batches(*zoo.teacher_classification(512), 32), strict=False):
            classify(model, batch).backward()
            opt.step()
            opt.zero_grad()
        grown = rec.buffer.stats.shape[0]
    assert first_rows <= 258 < grown
    steps = read(tmp_path, "health", "select distinct step from t order by step")
    assert [s for (s,) in steps] == list(range(1, 601))


def test_nan_and_inf_inside_the_model_are_counted_not_raised(tmp_path: Path) -> None:
    torch.manual_seed(0)
    model = zoo.mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    x, y = zoo.teacher_classification(64)
    x[3, 0], x[5, 1] = float("nan"), float("inf")  # two bad inputs in one batch
    with watch(model, opt, tmp_path) as rec:
        for step in (1, 2):
            xb = x if step == 2 else x.nan_to_num(0.0, 0.0, 0.0)
            with torch.no_grad():  # not a training forward: not recorded
                expected = int((~torch.isfinite(model[0](xb))).sum())
            F.cross_entropy(model(xb), y).backward()
            opt.step()
            opt.zero_grad()
            rec.log(loss=1.0)
    rows = dict(((s, c), (o, g)) for s, c, o, g in read(
        tmp_path, "health", "select step, component, out_nonfinite_count, grad_nonfinite_count from t"))
    assert rows[(1, "0")] == (0, 0) and rows[(1, "6")] == (0, 0)
    assert rows[(2, "0")][0] == expected == 2 * 64  # each bad input spoils a whole output row
    assert rows[(2, "0")][1] > 0 and rows[(2, "6")][0] > 0  # NaN reached the gradients and the head
    assert read(tmp_path, "steps", "select micro_batches from t") == [(1,), (1,)]


@pytest.mark.parametrize("width", [3, 4096])
def test_an_output_wider_than_the_held_ones_is_not_read_and_counts_stay_exact(tmp_path: Path, width: int) -> None:
    # a narrow head's output is read at the forward's end and the held outputs go; a head wider
    # than all of them together (a large vocabulary's logits) is not read: the outputs are held
    # to the step, and a NaN at step 4 is counted exactly either way (step 1 runs the eager
    # passes while the kernels load: it holds the outputs whatever the width)
    assert kernels.available()
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, width))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    held_after_forward = []
    with watch(model, opt, tmp_path) as rec:
        for step in (1, 2, 3, 4):
            x = torch.randn(32, 8)
            if step == 4:
                x[4, 2] = float("nan")
            out = model(x)
            held_after_forward.append(bool(rec.fwd.held))
            F.cross_entropy(out, torch.randint(0, width, (32,))).backward()
            opt.step()
            opt.zero_grad()
    assert held_after_forward[1:] == [width > 3, width > 3, True]
    counts = dict(((s, c), n) for s, c, n in read(
        tmp_path, "health", "select step, component, out_nonfinite_count from t"))
    assert counts[(3, "0")] == 0 and counts[(4, "0")] == 16 and counts[(4, "2")] == width


class _MaskedOverflow(torch.nn.Module):
    """A mask keeps an infinite `lin` output out of the model's output, and exp's backward
    (gradient x result: 0 x inf) turns the gradients to NaN."""

    def __init__(self) -> None:
        super().__init__()
        self.lin, self.head = torch.nn.Linear(4, 4), torch.nn.Linear(4, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        e = torch.exp(self.lin(x))
        return self.head(torch.where(torch.isfinite(e), e, torch.zeros_like(e)))


@pytest.mark.parametrize("compiled", [True, False])
def test_a_non_finite_output_that_reaches_only_the_gradients_is_counted_or_null_never_zero(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, compiled: bool) -> None:
    # on the CPU the outputs of a forward pass whose own output is finite are let go at its end
    # (compiled check): a NaN/inf inside that reaches only the gradients then has no count, and
    # the step says so (null) instead of claiming zero; without the compiled kernels they are held to the step
    from warninglight.tracer import kernels

    if not compiled:
        monkeypatch.setattr(kernels, "ready", lambda: False)
    torch.manual_seed(0)
    model = _MaskedOverflow()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    x = torch.randn(8, 4)
    with watch(model, opt, tmp_path, flush_every_steps=2):
        for step in (1, 2, 3):
            if step == 2:
                with torch.no_grad():
                    model.lin.bias[0] = math.inf  # lin's first unit is infinite in all 8 rows
            out = model(x)
            assert torch.isfinite(out).all()
            out.sum().backward()
            assert torch.isfinite(model.lin.weight.grad).all() == (step != 2)
            opt.step()
            opt.zero_grad()
            with torch.no_grad():
                model.lin.weight.zero_()  # the NaN step left NaN weights: start clean again
                model.lin.bias.zero_()
    rows = dict(((s, c), (o, g)) for s, c, o, g in read(
        tmp_path, "health", "select step, component, out_nonfinite_count, grad_nonfinite_count from t"))
    assert rows[(2, "lin")][1] == 5 and rows[(2, "head")][1] == 0  # NaN reached lin's gradients only
    # without the compiled kernels: lin's 8 infinities counted; compiled: unknown, in every component of the step
    assert [rows[(2, c)][0] for c in ("lin", "head")] == ([None, None] if compiled else [8, 0])
    # steps whose forward and gradients are finite: zeros both ways
    assert [rows[(s, c)][0] for s in (1, 3) for c in ("lin", "head")] == [0, 0, 0, 0]


def _poison(model: _MaskedOverflow, kind: str | None) -> None:
    """Set up a micro-batch: "hidden" (lin's first unit infinite, masked out of the output; NaN
    gradients), "output" (a NaN head bias: the model's output is NaN) or clean (None)."""
    with torch.no_grad():
        for p in model.parameters():
            p.nan_to_num_(0.0, 0.0, 0.0)  # what an earlier NaN step left
        model.lin.bias[0] = math.inf if kind == "hidden" else 0.0
        model.head.bias[0] = math.nan if kind == "output" else 0.0


@pytest.mark.parametrize("micro", [("hidden", "output"), ("output", "hidden"), (None, None)])
def test_micro_batches_let_go_uncounted_never_give_a_partial_count(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, micro: tuple[str | None, ...]) -> None:
    # the count covers every micro-batch: with one let go (finite output) whose gradients are
    # not finite, the step's count is unknown, not the other micro-batches' count alone; once a
    # micro-batch's output is not finite, the rest of the step is held and counted exactly
    from warninglight.tracer import kernels

    counts = {}
    for compiled in (True, False):
        if compiled:
            assert kernels.available()  # loaded now, whatever ran before this test
        else:
            monkeypatch.setattr(kernels, "ready", lambda: False)
        torch.manual_seed(0)
        model = _MaskedOverflow()
        opt = torch.optim.SGD(model.parameters(), lr=0.01)
        trace = tmp_path / str(compiled)
        with watch(model, opt, trace, flush_every_steps=2):
            for kind in micro:
                _poison(model, kind)
                model(torch.randn(8, 4)).sum().backward()
            opt.step()
            opt.zero_grad()
            _poison(model, None)
            model(torch.randn(8, 4))  # a step without a backward pass: nothing to judge, counted as 0
            opt.step()
        counts[compiled] = dict(((s, c), o) for s, c, o in read(
            trace, "health", "select step, component, out_nonfinite_count from t"))
    exact = counts[False]
    if micro == (None, None):
        assert set(exact.values()) == {0}
    else:
        # the hidden infinities counted; without the kernels the model's output is not checked,
        # so its NaN (whose gradient, of a sum, is finite) is counted only once the gradients
        # are not finite
        assert exact[(1, "lin")] == 8 and exact[(1, "head")] == (8 if micro[0] == "hidden" else 0)
    if micro[0] == "hidden":  # let go uncounted, then NaN gradients: unknown
        expected = {**exact, (1, "lin"): None, (1, "head"): None}
    elif micro[0] == "output":  # a non-finite model output, checked: counted whatever the gradients
        expected = {**exact, (1, "head"): 8}
    else:
        expected = exact
    assert counts[True] == expected


def test_a_non_finite_model_output_with_finite_gradients_is_counted(tmp_path: Path) -> None:
    # masked logits: the model's own output holds -inf where an action is invalid, and the loss
    # and the gradients stay finite; the infinities are counted, not taken as none
    kernels.available()

    class Policy(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.body, self.head = torch.nn.Linear(8, 16), torch.nn.Linear(16, 6)
            self.temperature = torch.nn.Parameter(torch.tensor(1.0))  # the root is a component

        def forward(self, x: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
            return (self.head(torch.tanh(self.body(x))) / self.temperature).masked_fill(~valid, -math.inf)

    torch.manual_seed(0)
    model = Policy()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    with watch(model, opt, tmp_path):
        for step in (1, 2, 3):
            valid = torch.ones(32, 6, dtype=torch.bool)
            valid[:, 4:] = step != 2  # two actions invalid in step 2
            F.cross_entropy(model(torch.randn(32, 8), valid), torch.randint(0, 4, (32,))).backward()
            assert all(torch.isfinite(p.grad).all() for p in model.parameters())
            opt.step()
            opt.zero_grad()
    counts = dict(((s, c), n) for s, c, n in read(
        tmp_path, "health", "select step, component, out_nonfinite_count from t"))
    assert [counts[(s, "")] for s in (1, 2, 3)] == [0, 64, 0]
    assert [counts[(2, c)] for c in ("body", "head")] == [0, 0]


@pytest.mark.parametrize("compiled", [True, False])
def test_a_root_output_written_in_place_after_the_forward_has_no_statistics(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, compiled: bool) -> None:
    # a root module that owns a parameter is a component whose hook runs after the forward's
    # end. The compiled path copies its sample in the hook; the eager ops defer the copy to the
    # step's end, and an output written in place before then has lost the values the hook saw:
    # that step's statistics of it are null, never the zeros of a copy that was not made
    if compiled:
        kernels.available()
    else:
        monkeypatch.setattr(kernels, "ready", lambda: False)

    class Scaled(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = torch.nn.Linear(8, 4)
            self.scale = torch.nn.Parameter(torch.tensor(2.0))

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.lin(x) * self.scale

    torch.manual_seed(0)
    model = Scaled()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    with watch(model, opt, tmp_path, full_precision=True):
        for step in range(1, 7):
            out = model(torch.randn(32, 8) + 3)
            if step == 5:
                out.clamp_(min=-100)  # in place, after the forward
            out.pow(2).mean().backward()
            opt.step()
            opt.zero_grad()
    rms = dict(((s, c), v) for s, c, v in read(tmp_path, "health", "select step, component, out_rms from t"))
    assert [rms[(s, "")] is None for s in range(1, 7)] == [False] * 4 + [not compiled, False]
    assert all(rms[(s, "")] > 0.5 for s in range(1, 7) if rms[(s, "")] is not None)  # values, not zeros


@pytest.mark.parametrize("compiled", [True, False])
def test_two_forward_passes_before_one_backward_count_the_first_ones_nan(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, compiled: bool) -> None:
    # a siamese loss: two forward passes, then one backward pass. The first pass's outputs are
    # not judged by gradients no backward pass of theirs made (the last step's, zeroed)
    if compiled:
        kernels.available()
    else:
        monkeypatch.setattr(kernels, "ready", lambda: False)
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    with watch(model, opt, tmp_path):
        for step in range(1, 4):
            x1, x2 = torch.randn(32, 8), torch.randn(32, 8)
            if step == 3:
                x1[0, 0] = math.nan  # row 0 of every output of the first pass
            ((model(x1) - model(x2)) ** 2).mean().backward()
            opt.step()
            opt.zero_grad(set_to_none=False)
    counts = dict(((s, c), n) for s, c, n in read(
        tmp_path, "health", "select step, component, out_nonfinite_count from t"))
    assert [counts[(3, c)] for c in ("0", "1", "2")] == [16, 16, 4]
    assert {counts[(s, c)] for s in (1, 2) for c in ("0", "1", "2")} == {0}


def test_gradient_accumulation_and_eval_passes(tmp_path: Path) -> None:
    torch.manual_seed(0)
    model = zoo.mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    data = zoo.batches(*zoo.teacher_classification(512), 16)
    with watch(model, opt, tmp_path) as rec:
        for _ in range(4):
            for _ in range(3):  # three micro-batches per optimizer step
                ids, xb, yb = next(data)
                (F.cross_entropy(model(xb), yb) / 3).backward()
                rec.batch(ids)
            opt.step()
            opt.zero_grad()
            model.eval()
            with torch.no_grad():
                model(xb)  # an evaluation pass: not part of any step
            model.train()
    steps = read(tmp_path, "steps", "select step, micro_batches, len(batch_ids) from t order by step")
    assert steps == [(s, 3, 48) for s in range(1, 5)]


class _Counted(torch.nn.Linear):
    """A Linear that notes how many forward hooks it has each time it runs."""

    def __init__(self, *args: Any) -> None:
        super().__init__(*args)
        self.hooks_seen: list[int] = []
        self.fail_in_eval = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.hooks_seen.append(len(self._forward_hooks))
        if self.fail_in_eval and not self.training:
            raise ValueError("an evaluation batch the model refuses")
        return super().forward(x)


class _Evaluated(torch.nn.Module):
    """Two layers; with `nested`, a training forward first runs the model on its input under
    no_grad (a teacher's pass of the same model inside the step's forward)."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b, self.nested = _Counted(8, 16), _Counted(16, 2), False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.nested and self.training and torch.is_grad_enabled():
            with torch.no_grad():
                self(x)
        return self.b(torch.relu(self.a(x)))


def _evaluated_run(path: Path, evaluate: str | None) -> tuple[_Evaluated, list[tuple]]:
    """Eight steps of `_Evaluated`, with an evaluation pass under no_grad after each step
    (`evaluate`: "plain", "failing" — its first layer raises —, "other hook" — another owner's
    hook on the second layer —, or "nested"); the trace's per-component rows."""
    torch.manual_seed(0)
    model = _Evaluated()
    model.nested = evaluate == "nested"
    noted: list[int] = []
    if evaluate == "other hook":
        model.b.register_forward_hook(lambda m, a, out: noted.append(out.shape[0]))
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    held_out = torch.randn(4, 8)  # drawn in every run: the training batches are the same
    with watch(model, opt, path) as rec:
        for _ in range(8):
            x, y = torch.randn(16, 8), torch.randint(0, 2, (16,))
            loss = F.cross_entropy(model(x), y)
            loss.backward()
            opt.step()
            opt.zero_grad()
            rec.log(loss=loss)
            if evaluate in (None, "nested"):
                continue
            model.eval()
            model.a.fail_in_eval = evaluate == "failing"
            with torch.no_grad(), contextlib.suppress(ValueError):  # "failing": it raises
                model(held_out)
            model.train()
    if evaluate == "other hook":  # the other owner's hook ran in every pass, its order kept
        assert noted == [16, 4] * 8
    return model, read(path, "health", "select step, component, grad_norm_l2, weight_norm_l2, out_rms, "
                       "out_nonfinite_count from t order by step, component")


@pytest.mark.parametrize("evaluate", ["plain", "failing", "other hook"])
def test_an_evaluation_pass_runs_without_the_component_hooks(tmp_path: Path, evaluate: str) -> None:
    # a forward pass under no_grad records nothing: the components' hooks are out of their
    # modules for it (a module with a hook is called through torch's slower path), and back for
    # the next training forward, even after an evaluation that raised; a module with another
    # owner's hook keeps ours in place. The trace is that of the run without evaluations
    model, rows = _evaluated_run(tmp_path / "evaluated", evaluate)
    _, plain = _evaluated_run(tmp_path / "plain", None)
    assert rows == plain and len(rows) == 8 * 2 and all(r[4] is not None for r in rows)
    training, evaluation = model.a.hooks_seen[0::2], model.a.hooks_seen[1::2]
    assert training == [1] * 8 and evaluation == [0] * 8
    if evaluate == "failing":  # the first layer raised: the second ran in training alone
        assert model.b.hooks_seen == [1] * 8
    else:
        # ours stays where another owner's hook is
        assert model.b.hooks_seen == ([2, 2] if evaluate == "other hook" else [1, 0]) * 8


def test_a_pass_under_no_grad_inside_a_training_forward_keeps_the_hooks(tmp_path: Path) -> None:
    # the model run under no_grad inside its own training forward: the step's forward is under
    # way, so the hooks stay, and the step's components are all observed
    model, rows = _evaluated_run(tmp_path / "nested", "nested")
    assert model.a.hooks_seen == [1] * 16
    assert len(rows) == 8 * 2 and all(r[4] is not None for r in rows)


def test_a_copy_of_the_watched_model_is_not_watched(tmp_path: Path) -> None:
    # an EMA or a weight average is made by copy.deepcopy of the model, hooks and all: the copy
    # runs (in training mode, and in eval mode as a teacher), the optimizer is copied too, and
    # the trace is the one a run without copies writes
    import copy

    kernels.available()  # both runs take the compiled passes from their first step

    def run(path: Path, copies: bool) -> list[tuple]:
        torch.manual_seed(0)
        model = zoo.mlp()
        opt = torch.optim.SGD(model.parameters(), lr=0.05)
        data = zoo.batches(*zoo.teacher_classification(512), 32)
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # no warning of the recorder's
            with watch(model, opt, path) as rec:
                ema = avg = None
                for step in range(12):
                    _, xb, yb = next(data)
                    loss = F.cross_entropy(model(xb), yb)
                    loss.backward()
                    opt.step()
                    opt.zero_grad()
                    rec.log(loss=loss)
                    if copies and step == 2:
                        ema, avg = copy.deepcopy(model), torch.optim.swa_utils.AveragedModel(model)
                        copy.deepcopy(opt).step()
                    if ema is not None and avg is not None:
                        ema.eval()
                        with torch.no_grad():  # a teacher's pass, in the middle of training
                            ema(xb)
                        ema.train()
                        F.cross_entropy(ema(xb), yb).backward()  # a copy trained on its own
                        avg.update_parameters(model)
        return read(path, "health", "select step, component, grad_norm_l2, weight_norm_l2, out_rms "
                    "from t order by step, component")

    plain, copied = run(tmp_path / "plain", False), run(tmp_path / "copied", True)
    assert len(plain) == 12 * len({c for _, c, *_ in plain}) and copied == plain
    events = read(tmp_path / "copied", "events", "select kind from t where kind in ('warning', 'finding')")
    assert events == []


@pytest.mark.parametrize("reentrant", [False, True])
def test_activation_checkpointing_changes_nothing_in_the_trace(tmp_path: Path, reentrant: bool) -> None:
    # a checkpointed block runs its forward again inside the backward pass, hooks and all: that
    # is no forward call of the step (a NaN in it was counted twice)
    from torch.utils.checkpoint import checkpoint

    class Net(torch.nn.Module):
        def __init__(self, checkpointed: bool) -> None:
            super().__init__()
            self.block = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh())
            self.head = torch.nn.Linear(16, 4)
            self.checkpointed = checkpointed

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            h = checkpoint(self.block, x, use_reentrant=reentrant) if self.checkpointed else self.block(x)
            return self.head(h)

    kernels.available()

    def run(path: Path, checkpointed: bool) -> list[tuple]:
        torch.manual_seed(0)
        model = Net(checkpointed)
        opt = torch.optim.SGD(model.parameters(), lr=0.01)
        with watch(model, opt, path):
            for step in range(6):
                x = torch.randn(32, 8, requires_grad=reentrant)
                if step == 3:
                    x.data[0, 0] = float("nan")  # a NaN through every component of row 0
                model(x).sum().backward()
                opt.step()
                opt.zero_grad()
        return read(path, "health", "select step, component, out_nonfinite_count, out_rms, grad_norm_l2 "
                    "from t order by step, component")

    plain, checkpointed = run(tmp_path / "plain", False), run(tmp_path / "ckpt", True)
    counts = {(s, c): n for s, c, n, *_ in plain if s == 4}
    assert counts == {(4, "block.0"): 16, (4, "block.1"): 16, (4, "head"): 4}
    assert _nan_as_none(checkpointed) == _nan_as_none(plain)


def _nan_as_none(rows: list[tuple]) -> list[tuple]:
    return [tuple(None if isinstance(v, float) and math.isnan(v) else v for v in r) for r in rows]


def test_grad_scaler_norms_are_the_unscaled_ones(tmp_path: Path) -> None:
    def run(scaler: torch.amp.GradScaler | None, path: Path) -> list[float]:
        torch.manual_seed(0)
        model = zoo.mlp()
        opt = torch.optim.SGD(model.parameters(), lr=0.01)
        with watch(model, opt, path):
            for _, (_, xb, yb) in zip(range(3), zoo.batches(*zoo.teacher_classification(256), 32), strict=False):
                loss = F.cross_entropy(model(xb), yb)
                if scaler is None:
                    loss.backward()
                    opt.step()
                else:
                    scaler.scale(loss).backward()
                    scaler.step(opt)
                    scaler.update()
                opt.zero_grad()
        return [r[0] for r in read(path, "steps", "select grad_norm_total_l2 from t order by step")]

    scaled = run(torch.amp.GradScaler("cpu", init_scale=2.0**12), tmp_path / "scaled")
    plain = run(None, tmp_path / "plain")
    assert scaled == pytest.approx(plain, rel=1e-6) and len(plain) == 3


def test_grad_scaler_after_a_clipped_step_still_gives_the_unscaled_norms(tmp_path: Path) -> None:
    # clipping on step 1 only, then the scaler's unscale alone: the unscale moves no version
    # counter, so the gradients look unchanged since backward; the recorded norms must still be
    # those the optimizer receives (unscaled), not the backward-end (scaled) ones
    torch.manual_seed(0)
    model = zoo.mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**12)
    seen: list[float] = []
    opt.register_step_pre_hook(lambda *_: seen.append(float(torch.linalg.vector_norm(
        torch.cat([p.grad.flatten() for p in model.parameters()]).double()))))
    with watch(model, opt, tmp_path):
        for step, (_, xb, yb) in zip(range(4), zoo.batches(*zoo.teacher_classification(256), 32), strict=False):
            scaler.scale(F.cross_entropy(model(xb), yb)).backward()
            scaler.unscale_(opt)
            if step == 0:
                torch.nn.utils.clip_grad_norm_(model.parameters(), 1e6)  # moves the counters only
            scaler.step(opt)
            scaler.update()
            opt.zero_grad()
    got = [r[0] for r in read(tmp_path, "steps", "select grad_norm_total_l2 from t order by step")]
    assert len(seen) == 4 and got == pytest.approx(seen, rel=1e-5)


@pytest.mark.parametrize("other_first", [False, True])
def test_a_graph_compiled_for_an_unwatched_instance_is_not_run_for_the_watched_one(
        other_first: bool, tmp_path: Path) -> None:
    # dynamo does not guard against module hooks by default: a graph traced for an unwatched
    # instance of the class (an EMA or teacher model) was run for the watched one, and no hook
    # fired. From watch() on, dynamo guards on hooks, so the watched model compiles a graph of
    # its own; a graph traced before watch() (dynamo's default then) still shadows it, and the
    # recorder says how to avoid that
    import torch._dynamo.config as dynamo_config

    with dynamo_config.patch(skip_nnmodule_hook_guards=True):  # dynamo's default (a fresh process)
        _shadowed_or_not(other_first, tmp_path)


def _shadowed_or_not(other_first: bool, tmp_path: Path) -> None:
    import torch._dynamo.config as dynamo_config

    torch._dynamo.reset()
    torch.manual_seed(0)
    model, other = zoo.mlp(), zoo.mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    data = zoo.batches(*zoo.teacher_classification(256), 32)
    compiled_other = torch.compile(other, backend="eager")
    if other_first:
        compiled_other(next(data)[1])
    with warnings.catch_warnings(record=True) as caught, watch(model, opt, tmp_path):
        warnings.simplefilter("always")
        compiled = torch.compile(model, backend="eager")
        for _ in range(3):
            _, xb, yb = next(data)
            compiled_other(xb)
            F.cross_entropy(compiled(xb), yb).backward()
            opt.step()
            opt.zero_grad()
    assert dynamo_config.skip_nnmodule_hook_guards is False  # left on: the next watch() is safe too
    rows = read(tmp_path, "health", "select step, count(out_rms) from t group by step order by step")
    warned = [str(w.message) for w in caught if "skip_nnmodule_hook_guards = False" in str(w.message)]
    if other_first:
        assert [n for _, n in rows] == [0, 0, 0] and len(warned) == 1
    else:
        assert [n for _, n in rows] == [7, 7, 7] and not warned
    torch._dynamo.reset()


@pytest.mark.parametrize("mode, fullgraph", [("eager", False), ("skip", True), ("graph", True)])
def test_torch_compile_is_recorded_or_named(mode: str, fullgraph: bool, tmp_path: Path) -> None:
    torch._dynamo.reset()  # compiled code from another test's model must not be reused here
    torch.manual_seed(0)
    model = zoo.mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    with warnings.catch_warnings(record=True) as caught, \
            watch(model, opt, tmp_path, hooks_under_compile=mode) as rec:
        warnings.simplefilter("always")
        compiled = torch.compile(model, backend="eager", fullgraph=fullgraph)  # hooks came first
        for _, (_, xb, yb) in zip(range(3), zoo.batches(*zoo.teacher_classification(256), 32), strict=False):
            F.cross_entropy(compiled(xb), yb).backward()
            opt.step()
            opt.zero_grad()
    assert rec.step_count == 3
    seen = read(tmp_path, "health", "select count(*) filter (where out_rms is not null), "
                                    "count(*) filter (where grad_norm_l2 is not null) from t")
    warned = [d for k, d in read(tmp_path, "events", "select kind, detail from t") if k == "warning"]
    if mode in ("eager", "graph"):  # every component seen: outside the graph, or inside it
        assert seen == [(21, 12)] and not warned
    else:  # fullgraph compiles; forward stats are missing and said to be
        assert seen == [(0, 12)] and "7 of 7 components" in warned[0]
        assert any("torch.compile" in str(w.message) for w in caught)


def _fresh_compiled_mlp() -> tuple[torch.nn.Module, torch.optim.Optimizer, Any]:
    """A seeded MLP and its SGD, with dynamo's caches and counters emptied (a graph compiled for
    another test's model must be neither reused nor counted)."""
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    torch.manual_seed(0)
    model = zoo.mlp()
    return model, torch.optim.SGD(model.parameters(), lr=0.01), counters


def test_log_and_batch_inside_a_fullgraph_compiled_step_go_to_their_steps(tmp_path: Path) -> None:
    # no lock and no graph break in a traced graph: the values come out as the graph's outputs
    # and go to the step whose optimizer.step comes next; a value logged outside the graph after
    # a compiled forward goes to that forward's step too. One graph for the whole run
    model, opt, counters = _fresh_compiled_mlp()
    losses = []
    with watch(model, opt, tmp_path) as rec:
        @torch.compile(backend="eager", fullgraph=True)
        def forward(xb: torch.Tensor, yb: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
            loss = F.cross_entropy(model(xb), yb)
            rec.log(loss=loss, tokens_seen=123456789)  # a Python number: kept exactly
            rec.batch(ids)
            return loss

        data = zoo.batches(*zoo.teacher_classification(256), 32)
        for i, (_, xb, yb) in zip(range(3), data, strict=False):
            loss = forward(xb, yb, torch.arange(i * 32, i * 32 + 2))
            losses.append(loss.item())
            rec.log(eager=loss.item() + 1)
            loss.backward()
            opt.step()
            opt.zero_grad()
    assert rec.step_count == 3 and counters["stats"]["unique_graphs"] == 1
    rows = read(tmp_path, "steps", "select step, loss, batch_ids from t order by step")
    assert [r[0] for r in rows] == [1, 2, 3]
    assert [r[1] for r in rows] == pytest.approx(losses, rel=1e-6)
    assert [r[2] for r in rows] == [[0, 1], [32, 33], [64, 65]]
    assert read(tmp_path, "scalars", "select value from t where name = 'tokens_seen'") == [(123456789.0,)] * 3
    got = read(tmp_path, "scalars", "select step, value from t where name = 'eager' order by step")
    assert [s for s, _ in got] == [1, 2, 3]
    assert [v for _, v in got] == pytest.approx([v + 1 for v in losses], rel=1e-6)
    torch._dynamo.reset()


def test_values_logged_in_each_compiled_micro_batch_come_out_of_one_graph(tmp_path: Path) -> None:
    # a value a graph logs, and the batch ids it gives, are handed over as it runs (no list that
    # grows with each micro-batch is read in the graph, which dynamo would guard on): one graph,
    # the step's loss is the mean of its micro-batches', as for values logged outside graphs,
    # and its batch ids are theirs in order
    model, opt, counters = _fresh_compiled_mlp()
    data = zoo.batches(*zoo.teacher_classification(2048), 8)
    want = []
    with watch(model, opt, tmp_path) as rec:
        @torch.compile(backend="eager", fullgraph=True)
        def micro_step(xb: torch.Tensor, yb: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
            loss = F.cross_entropy(model(xb), yb)
            rec.log(loss=loss)
            rec.batch(ids)
            return loss

        for step in range(3):
            losses = []
            for micro in range(12):
                _, xb, yb = next(data)
                loss = micro_step(xb, yb, torch.tensor([100 * step + micro]))
                (loss / 12).backward()
                losses.append(loss.item())
            want.append(sum(losses) / len(losses))
            opt.step()
            opt.zero_grad()
    assert counters["stats"]["unique_graphs"] == 1
    got = read(tmp_path, "steps", "select step, loss, batch_ids from t order by step")
    assert [s for s, _, _ in got] == [1, 2, 3]
    assert [v for _, v, _ in got] == pytest.approx(want, rel=1e-6)
    assert [ids for _, _, ids in got] == [[100 * s + m for m in range(12)] for s in range(3)]
    torch._dynamo.reset()


def test_a_compiled_model_over_many_micro_batches_compiles_one_graph_and_counts_them_all(tmp_path: Path) -> None:
    # the step's first forward pass gives the samples; the later ones (micro-batches) add only
    # their non-finite counts, and nothing the graph reads grows with them: one graph for the
    # run however many micro-batches a step has, where one per micro-batch hit dynamo's limit
    model, opt, counters = _fresh_compiled_mlp()
    compiled = torch.compile(model, backend="eager", fullgraph=True)
    data = zoo.batches(*zoo.teacher_classification(2048), 8)
    with watch(model, opt, tmp_path) as rec:
        for step in (1, 2, 3):
            for micro in range(12):
                _, xb, yb = next(data)
                if step == 2 and micro == 5:  # a forward pass of the step with one NaN input
                    xb = xb.clone()
                    xb[0, 0] = math.nan
                    compiled(xb)  # no backward: the gradients stay finite
                    continue
                (F.cross_entropy(compiled(xb), yb) / 12).backward()
            opt.step()
            opt.zero_grad()
    assert rec.step_count == 3 and counters["stats"]["unique_graphs"] == 1
    # the compiled forwards are counted as they run
    assert read(tmp_path, "steps", "select micro_batches from t order by step") == [(12,)] * 3
    rows = read(tmp_path, "health", "select step, component, out_rms, out_nonfinite_count from t")
    first = min(c for _, c, _, _ in rows)
    assert all(rms is not None for _, _, rms, _ in rows)  # every component sampled every step
    counts = {(s, c): n for s, c, _, n in rows}
    assert counts[(2, first)] > 0  # the NaN's row, counted in a later micro-batch's graph
    assert all(counts[(s, c)] == 0 for s, c in counts if s != 2)
    torch._dynamo.reset()


class _TwoHeads(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.body, self.head_a, self.head_b = (torch.nn.Linear(32, 64), torch.nn.Linear(64, 10),
                                               torch.nn.Linear(64, 10))

    def forward(self, x: torch.Tensor, task: str) -> torch.Tensor:
        h = torch.relu(self.body(x))
        return self.head_a(h) if task == "a" else self.head_b(h)


def _seeded(make: Callable[[], torch.nn.Module], lr: float, batch: int, backend: str | None
            ) -> tuple[torch.nn.Module, torch.optim.Optimizer, Callable[..., torch.Tensor], Iterator[Any]]:
    """A seeded model, its SGD, its forward (compiled whole with `backend`, fullgraph, unless
    None) and a batch stream, with dynamo's caches emptied."""
    torch._dynamo.reset()
    torch.manual_seed(0)
    model = make()
    forward = torch.compile(model, backend=backend, fullgraph=True) if backend is not None else model
    return (model, torch.optim.SGD(model.parameters(), lr=lr), forward,
            zoo.batches(*zoo.teacher_classification(512), batch))


def test_a_component_first_called_in_a_later_compiled_micro_batch_is_sampled(tmp_path: Path) -> None:
    # count-only is for the components a graph already sampled in the step, not for every
    # component once one forward pass ran: a head used only by the second micro-batch has
    # forward statistics, as it has uncompiled
    def run(trace: Path, compiled: bool) -> list[tuple]:
        model, opt, fm, data = _seeded(_TwoHeads, 0.1, 16, "eager" if compiled else None)
        with watch(model, opt, trace):
            for _ in range(3):
                for task in ("a", "b"):
                    _, xb, yb = next(data)
                    (F.cross_entropy(fm(xb, task), yb) / 2).backward()
                opt.step()
                opt.zero_grad()
        return read(trace, "health", "select step, component, out_rms from t where component like 'head%' "
                                     "order by step, component")

    got, want = run(tmp_path / "compiled", True), run(tmp_path / "eager", False)
    assert len(got) == 6 and all(rms is not None for _, _, rms in got)
    assert [r[:2] for r in got] == [r[:2] for r in want]
    assert [r[2] for r in got] == pytest.approx([r[2] for r in want], rel=1e-5)
    torch._dynamo.reset()


class _Block(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.norm, self.up, self.down = torch.nn.LayerNorm(16), torch.nn.Linear(16, 32), torch.nn.Linear(32, 16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(torch.relu(self.up(self.norm(x))))


class _Deep(torch.nn.Module):
    """A stem, twelve blocks of one class, a head: more blocks than dynamo compiles graphs for
    one function (its recompile limit, 8)."""

    def __init__(self, checkpointed: bool = False) -> None:
        super().__init__()
        self.stem, self.head = torch.nn.Linear(32, 16), torch.nn.Linear(16, 10)
        self.blocks = torch.nn.ModuleList(_Block() for _ in range(12))
        self.checkpointed = checkpointed  # each block's forward run again in the backward pass

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.stem(x)
        for block in self.blocks:
            x = (torch.utils.checkpoint.checkpoint(block, x, use_reentrant=False) if self.checkpointed
                 else block(x))
        return self.head(x)


@pytest.mark.parametrize("checkpointed", [False, True])
def test_blocks_compiled_one_by_one_share_one_graph_and_are_recorded(checkpointed: bool, tmp_path: Path) -> None:
    # each block compiled on its own (the large-model pattern): a hook that told components apart
    # by a Python value compiled a graph per block and failed at the ninth under fullgraph. The
    # trace is the one an uncompiled run writes: micro-batches, one with a NaN, a deep copy, and
    # blocks run again in the backward pass (activation checkpointing) included
    from torch._dynamo.utils import counters

    def run(trace: Path, compiled: bool) -> tuple[list[tuple], list[tuple]]:
        torch._dynamo.reset()
        counters.clear()
        torch.manual_seed(0)
        model = _Deep(checkpointed)
        opt = torch.optim.SGD(model.parameters(), lr=0.05)
        data = zoo.batches(*zoo.teacher_classification(512), 8)
        with watch(model, opt, trace):
            shadow = copy.deepcopy(model)  # an EMA-like copy: its hooks run, and record nothing
            if compiled:
                for block in (*model.blocks, *shadow.blocks):
                    block.compile(backend="aot_eager", fullgraph=True)
            for step in range(3):
                for micro in range(3):
                    _, xb, yb = next(data)
                    if (step, micro) == (1, 2):  # one NaN input
                        xb = xb.clone()
                        xb[0, 0] = math.nan
                    (F.cross_entropy(model(xb), yb) / 3).backward()
                    shadow(torch.full_like(xb, math.nan))
                if step == 1:  # the loop skips a step whose gradients are not finite
                    opt.zero_grad()
                opt.step()
                opt.zero_grad()
        if compiled:
            assert counters["stats"]["unique_graphs"] == 1
        return (read(trace, "health", "select step, component, out_rms, out_absmax, out_nonfinite_count "
                                      "from t order by step, component"),
                read(trace, "components", "select component, forward_index, kind from t order by component"))

    (got, got_components), (want, want_components) = run(tmp_path / "compiled", True), run(tmp_path / "eager", False)
    assert got_components == want_components  # the forward order, and the head it names
    assert len(got) == 3 * (2 + 12 * 3) and all(r[2] is not None for r in got)
    counts = [sum(r[4] for r in got if r[0] == step) for step in (1, 2, 3)]
    assert counts[0] == counts[2] == 0 < counts[1]  # the NaN's step; the copy's are not the model's
    assert [r[:2] for r in got] == [r[:2] for r in want]
    assert [v for r in got for v in r[2:4]] == pytest.approx([v for r in want for v in r[2:4]], rel=1e-5)
    assert [r[4] for r in got] == [r[4] for r in want]
    torch._dynamo.reset()


def test_a_model_compiled_whole_has_its_pre_clip_norm_from_the_third_step(tmp_path: Path) -> None:
    # dynamo cannot trace the hook on the model's output that starts the backward pass's work:
    # after a step whose forward ran as one graph, the parameters' gradient hooks start it
    # instead, and the pre-clip norm is the uncompiled run's from the step after the next
    def run(trace: Path, compiled: bool) -> list[tuple]:
        model, opt, forward, data = _seeded(_Deep, 0.05, 8, "aot_eager" if compiled else None)
        with watch(model, opt, trace):
            for _ in range(5):
                _, xb, yb = next(data)
                F.cross_entropy(forward(xb), yb).backward()
                torch.nn.utils.clip_grad_norm_(model.parameters(), 0.1)
                opt.step()
                opt.zero_grad()
        return read(trace, "steps", "select step, grad_norm_total_l2, grad_norm_preclip_l2 from t order by step")

    got, want = run(tmp_path / "compiled", True), run(tmp_path / "eager", False)
    assert [r[2] is None for r in want] == [True, False, False, False, False]
    assert [r[2] is None for r in got] == [True, True, False, False, False]
    assert [r[2] for r in got[2:]] == pytest.approx([r[2] for r in want[2:]], rel=1e-5)
    assert all(r[2] > 1 for r in got[2:])  # clipped to 0.1: the norm before it, not after
    torch._dynamo.reset()


@pytest.mark.parametrize("backend", ["aot_eager", "inductor"])
def test_a_compiled_models_samples_go_straight_to_their_staging_places(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, backend: str) -> None:
    # from the third step (the samples' shapes seen twice) a compiled graph's sample is copied
    # into its place in the staging buffers, as an eager hook's is: over reductions (every 8
    # steps) and a NaN step, the trace is the uncompiled run's (inductor: its kernels fuse the
    # hooks' ops with the model's and reuse their buffers)
    kernels.available()
    copies = []
    real = kernels.row_copier

    def counted() -> Any:
        copies.append(1)
        return real()

    def run(trace: Path, compiled: bool) -> list[tuple]:
        model, opt, forward, data = _seeded(_Deep, 0.05, 8, backend if compiled else None)
        with watch(model, opt, trace):
            for step in range(1, 13):
                _, xb, yb = next(data)
                if step == 10:
                    xb = xb.clone()
                    xb[0, 0] = math.nan
                F.cross_entropy(forward(xb), yb).backward()
                if step == 10:  # the loop skips a step whose gradients are not finite
                    opt.zero_grad()
                opt.step()
                opt.zero_grad()
        return read(trace, "health", "select step, component, out_rms, out_absmax, out_nonfinite_count "
                                     "from t order by step, component")

    want = run(tmp_path / "eager", False)
    monkeypatch.setattr(kernels, "row_copier", counted)
    got = run(tmp_path / "compiled", True)
    assert len(copies) >= 10 * 37  # every component's sample from the third step on
    assert len(got) == 12 * 38 and all(r[2] is not None for r in got)
    assert [r[:2] for r in got] == [r[:2] for r in want]
    assert [v for r in got for v in r[2:4]] == pytest.approx([v for r in want for v in r[2:4]], rel=1e-5)
    assert [r[4] for r in got] == [r[4] for r in want] and sum(r[4] for r in got if r[0] == 10) > 0
    torch._dynamo.reset()


class _Net(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = torch.nn.Linear(32, 64), torch.nn.Linear(64, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(torch.relu(self.a(x)))


@pytest.mark.filterwarnings("ignore:warninglight. forward hooks never fired")  # 'skip' says so
@pytest.mark.parametrize("mode", ["graph", "skip"])
def test_a_loss_logged_after_a_compiled_forward_goes_to_that_step(mode: str, tmp_path: Path) -> None:
    # a compiled forward begins its step as an eager one does, however dynamo runs the root
    # hooks: here a no_grad validation forward makes dynamo run the end-of-forward hook eagerly
    # from then on, while the one at the start stays compiled
    torch._dynamo.reset()
    torch.manual_seed(0)
    model = _Net()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    compiled = torch.compile(model, backend="eager")
    data = zoo.batches(*zoo.teacher_classification(512), 16)
    want = []
    with watch(model, opt, tmp_path, hooks_under_compile=mode) as rec:
        for _ in range(5):
            _, xb, yb = next(data)
            loss = F.cross_entropy(compiled(xb), yb)
            loss.backward()
            rec.log(loss=loss.item())
            want.append(loss.item())
            opt.step()
            opt.zero_grad()
            model.eval()
            with torch.no_grad():
                compiled(torch.randn(16, 32))
            model.train()
    got = read(tmp_path, "steps", "select step, loss from t order by step")
    assert [s for s, _ in got] == [1, 2, 3, 4, 5]
    assert [v for _, v in got] == pytest.approx(want, rel=1e-6)
    torch._dynamo.reset()


@pytest.mark.parametrize("mode", ["graph", "eager"])
def test_a_compiled_training_step_with_the_optimizer_inside_is_recorded(mode: str, tmp_path: Path) -> None:
    # forward, backward and optimizer.step in one compiled function (a compiled optimizer
    # too): dynamo traced the recorder's step hooks and every step was dropped. They run
    # outside its graphs, and the trace is the one an uncompiled run writes
    def run(trace: Path, compile_step: bool) -> list[tuple]:
        torch._dynamo.reset()
        torch.manual_seed(0)
        model = zoo.mlp()
        opt = torch.optim.SGD(model.parameters(), lr=0.01)
        with watch(model, opt, trace, hooks_under_compile=mode):
            def step(xb: torch.Tensor, yb: torch.Tensor) -> torch.Tensor:
                loss = F.cross_entropy(model(xb), yb)
                loss.backward()
                opt.step()
                opt.zero_grad()
                return loss
            fn = torch.compile(step, backend="eager") if compile_step else step
            for _, (_, xb, yb) in zip(range(4), zoo.batches(*zoo.teacher_classification(256), 32), strict=False):
                fn(xb, yb)
        return read(trace, "health", "select step, component, grad_norm_l2, weight_norm_l2, update_norm_l2 "
                                     "from t where grad_norm_l2 is not null order by step, component")

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        got = run(tmp_path / "compiled", True)
    assert not [w for w in caught if "probe failed" in str(w.message)]
    want = run(tmp_path / "eager", False)
    assert [r[:2] for r in got] == [r[:2] for r in want] and {r[0] for r in got} == {1, 2, 3, 4}
    for g, w in zip(got, want, strict=True):
        assert g[2:] == pytest.approx(w[2:], rel=1e-5)
    torch._dynamo.reset()


def test_unused_components_are_named_in_a_warning_event(tmp_path: Path) -> None:
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.ReLU())
    model.add_module("spare", torch.nn.Linear(4, 4))  # owns parameters, never called
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with watch(model, opt, tmp_path):
        model[1](model[0](torch.randn(8, 4))).sum().backward()
        opt.step()
    details = [d for k, d in read(tmp_path, "events", "select kind, detail from t") if k == "warning"]
    assert len(details) == 1 and "spare" in details[0]
    manifest = json.loads(schema.manifest_path(tmp_path, 0).read_text())
    assert set(manifest) == set(schema.MANIFEST_KEYS)
    assert set(manifest["incarnations"][0]) == set(schema.INCARNATION_KEYS)


def test_log_and_batch_attach_to_the_step_whether_called_before_or_after_step(tmp_path: Path) -> None:
    model = torch.nn.Linear(3, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with watch(model, opt, tmp_path) as rec:
        for step in range(1, 4):
            loss = model(torch.ones(2, 3)).sum()
            loss.backward()
            rec.log(before=step)        # forward done, step not yet: belongs to this step
            opt.step()
            rec.log(loss=float(step))   # after optimizer.step(): the step just completed
            rec.batch([step, step])
            if step == 2:
                rec.checkpoint("ck2.pt")
    assert read(tmp_path, "steps", "select step, loss, batch_ids from t order by step") == [
        (1, 1.0, [1, 1]), (2, 2.0, [2, 2]), (3, 3.0, [3, 3])]
    assert read(tmp_path, "scalars", "select step, value from t order by step") == [
        (1, 1.0), (2, 2.0), (3, 3.0)]
    assert read(tmp_path, "events", "select step, path from t where kind = 'checkpoint'") == [(2, "ck2.pt")]
