"""The health metrics against direct computation on a real small training run."""

from __future__ import annotations

import hashlib
import math
import os
import subprocess
import sys
import warnings
from collections.abc import Iterator
from pathlib import Path

import duckdb
import hostreads
import pytest
import torch
import torch.nn.functional as F
from torch import nn
from warninglight.lab import zoo
from warninglight.tracer import codecache, components, kernels, params, recorder, schema, watch


def health(trace: Path, metric: str) -> dict[tuple[int, str], float | None]:
    """{(step, component): value} of one health column, read back from the Parquet trace."""
    glob = schema.segment_glob(trace, "health")
    rows = duckdb.sql(f"select step, component, {metric} from read_parquet('{glob}')").fetchall()
    return {(s, c): v for s, c, v in rows}


@pytest.mark.parametrize("steps", [4, 20])
def test_gradient_weight_and_update_metrics_match_direct_computation(tmp_path: Path, steps: int) -> None:
    # 20 steps with a flush every 7: values derived in batches of steps, cut short by flushes, and
    # carried from one batch to the next (the update cosine needs the step before)
    torch.manual_seed(0)
    model = zoo.mlp(hidden=12, depth=2)  # every tensor <= 256 values: the sketch is exact
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    expected: dict[str, list[float]] = {"grad": [], "weight": [], "ratio": [], "cos": []}
    prev_update = None
    layer = model[2]
    with watch(model, opt, tmp_path, flush_every_steps=7, full_precision=True):
        for _, (_, x, y) in zip(range(steps), zoo.batches(*zoo.teacher_classification(256), 32), strict=False):
            F.cross_entropy(model(x), y).backward()
            before = torch.cat([layer.weight.detach().flatten(), layer.bias.detach().flatten()])
            grads = torch.cat([layer.weight.grad.flatten(), layer.bias.grad.flatten()])
            opt.step()
            opt.zero_grad()
            after = torch.cat([layer.weight.detach().flatten(), layer.bias.detach().flatten()])
            update = after - before
            expected["grad"].append(float(torch.linalg.vector_norm(grads)))
            expected["weight"].append(float(torch.linalg.vector_norm(after)))
            expected["ratio"].append(float(update.norm() / after.norm()))
            if prev_update is not None:
                expected["cos"].append(float(F.cosine_similarity(update, prev_update, dim=0)))
            prev_update = update
    for key, metric in (("grad", "grad_norm_l2"), ("weight", "weight_norm_l2"), ("ratio", "update_ratio")):
        got = health(tmp_path, metric)
        assert [got[(s, "2")] for s in range(1, steps + 1)] == pytest.approx(expected[key], rel=1e-5)
    cos = health(tmp_path, "update_cos")
    assert cos[(1, "2")] is None
    assert [cos[(s, "2")] for s in range(2, steps + 1)] == pytest.approx(expected["cos"], abs=1e-5)
    assert health(tmp_path, "grad_norm_l2")[(1, "1")] is None  # a ReLU has no parameters


def test_dead_and_saturated_fractions(tmp_path: Path) -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 16), nn.ReLU(),
                          nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, 3))
    with torch.no_grad():
        model[2].bias.fill_(-100.0)  # nothing gets through the second ReLU: all its units dead
        model[4].bias.copy_(torch.tensor([0.0, 0.0] + [50.0, -50.0] * 7))  # tanh at ±1 but 2 units
    opt = torch.optim.SGD(model.parameters(), lr=1e-6)
    with watch(model, opt, tmp_path):
        model(torch.randn(64, 8)).sum().backward()
        opt.step()
    dead, sat = health(tmp_path, "out_dead_frac"), health(tmp_path, "out_sat_frac")
    assert dead[(1, "3")] == 1.0 and dead[(1, "1")] < 0.5
    assert sat[(1, "5")] == pytest.approx(14 / 16) and sat[(1, "1")] is None  # a ReLU has no saturation bound
    glob = schema.segment_glob(tmp_path, "components")
    parents = dict(duckdb.sql(f"select component, parent_param from read_parquet('{glob}')").fetchall())
    assert parents["3"] == "2" and parents["5"] == "4" and parents["0"] is None


def test_weight_drift_is_nonzero_exactly_after_an_outside_write(tmp_path: Path) -> None:
    torch.manual_seed(0)
    model = zoo.mlp()  # hidden layers of 64x64 = 4096 weights: far more than the 256-sketch
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    data = zoo.batches(*zoo.teacher_classification(256), 32)
    with watch(model, opt, tmp_path):
        for step in range(1, 13):
            _, x, y = next(data)
            F.cross_entropy(model(x), y).backward()
            opt.step()
            opt.zero_grad()
            with torch.no_grad():  # between the end of a step and the next forward
                if step == 4:
                    model[2].weight.mul_(1.5)         # a whole layer rescaled
                if step == 8:
                    model[4].weight[7, 9] += 0.5      # one element, almost surely off-sketch
                if step == 11:  # a hardware-style fault: the top exponent bit of one weight flips
                    model[0].weight.view(torch.int32)[5, 17] ^= 1 << 30
    drift = health(tmp_path, "weight_drift_l2")
    assert drift[(1, "2")] is None  # nothing to compare the first step with
    touched = {(s, c) for (s, c), v in drift.items() if v}
    assert touched == {(5, "2"), (9, "4"), (12, "0")}
    assert drift[(5, "2")] > 0.3 * float(model[2].weight.detach().norm()) / 1.5
    assert drift[(9, "4")] > 0.001


def test_a_write_through_data_is_seen_by_the_periodic_exact_check(tmp_path: Path) -> None:
    # `.data` moves no version counter: off the sketch, such a write between two steps is caught
    # by the exact weight norms only on the steps that take them whatever the counters say; a new
    # tensor put under a parameter is seen at the next forward
    torch.manual_seed(0)
    model = zoo.mlp()
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    data = zoo.batches(*zoo.teacher_classification(256), 32)
    every = params.EXACT_DRIFT_EVERY
    with watch(model, opt, tmp_path):
        for step in range(1, 2 * every + 1):
            _, x, y = next(data)
            F.cross_entropy(model(x), y).backward()
            opt.step()
            opt.zero_grad()
            if step in (3, every):  # before step 4 (counters only) and before an exact step
                model[4].weight.data[7, 9] += 0.5
            if step == 5:  # a new tensor under the parameter: seen at the next forward
                model[2].weight.data = model[2].weight.data * 1.5
    drift = health(tmp_path, "weight_drift_l2")
    assert {(s, c) for (s, c), v in drift.items() if v} == {(6, "2"), (every + 1, "4")}
    weight = health(tmp_path, "weight_norm_l2")  # measured on the new tensor from then on
    assert weight[(6, "2")] == pytest.approx(1.5 * weight[(5, "2")], rel=0.05)
    assert weight[(7, "2")] == pytest.approx(float(model[2].weight.detach().norm()), rel=0.05)


def test_a_parameter_cut_to_a_prefix_of_itself_is_measured_at_its_new_size(tmp_path: Path) -> None:
    # `p.data = p.data[:k]` (a class dropped from the head) keeps the tensor's address: the
    # compiled passes must not go on reading the old length. From the next step every weight
    # norm is that of the new tensor, or null, never the old one's
    kernels.available()  # the compiled passes from the first step
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 64), torch.nn.ReLU(), torch.nn.Linear(64, 3))
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    classes, want = 3, []
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # torch's own, about an output resized in the eager ops
        with watch(model, opt, tmp_path, full_precision=True):
            for step in range(1, 10):
                x, y = torch.randn(16, 8), torch.randint(0, classes, (16,))
                F.cross_entropy(model(x), y).backward()
                opt.step()
                opt.zero_grad()
                want.append(math.sqrt(sum(float(p.detach().double().square().sum())
                                          for p in model[2].parameters())))
                if step == 4:
                    model[2].weight.data = model[2].weight.data[:2]
                    model[2].bias.data = model[2].bias.data[:2]
                    classes = 2
    weight = health(tmp_path, "weight_norm_l2")
    assert want[4] < 0.95 * want[3]  # the cut is visible in the norm
    for step in range(1, 10):
        got = weight[(step, "2")]
        assert got is None or got == pytest.approx(want[step - 1], rel=1e-5), step
    assert all(weight[(step, "2")] is not None for step in (1, 2, 3, 4, 9))


def test_a_bfloat16_models_norms_are_summed_in_float32(tmp_path: Path) -> None:
    # 16-bit tensors' norms by torch._foreach_norm in their own precision keep three significant
    # digits: a step's change to the weight norm vanishes in the rounding. Summed in float32,
    # each norm is within float32 roundings of the float64 one
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 64), torch.nn.ReLU(), torch.nn.Linear(64, 3))
    model = model.to(torch.bfloat16)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    grads, weights = [], []
    with watch(model, opt, tmp_path, full_precision=True):
        for _ in range(6):
            x, y = torch.randn(16, 8, dtype=torch.bfloat16), torch.randint(0, 3, (16,))
            F.cross_entropy(model(x).float(), y).backward()
            grads.append(math.sqrt(sum(float(p.grad.double().square().sum()) for p in model[0].parameters())))
            opt.step()
            opt.zero_grad()
            weights.append(math.sqrt(sum(float(p.detach().double().square().sum()) for p in model[0].parameters())))
    got_g, got_w = health(tmp_path, "grad_norm_l2"), health(tmp_path, "weight_norm_l2")
    assert len({round(w, 6) for w in weights}) > 1  # the weight norm moves, if by little
    for step in range(1, 7):
        assert got_g[(step, "0")] == pytest.approx(grads[step - 1], rel=1e-5), step
        assert got_w[(step, "0")] == pytest.approx(weights[step - 1], rel=1e-5), step


@pytest.mark.parametrize("every", [8, 13])
def test_parameter_values_do_not_depend_on_how_many_steps_are_reduced_together(every: int) -> None:
    # steps reduced one at a time, in the recorder's batches of 8, and 13 at once (more than the
    # step buffer holds: it grows) give the same values, bit for bit; an outside write in between
    torch.manual_seed(0)
    model = zoo.mlp(hidden=40)
    start = {k: v.clone() for k, v in model.state_dict().items()}
    data = list(zip(range(20), zoo.batches(*zoo.teacher_classification(256), 32), strict=False))

    def run(reduce_every: int) -> tuple[torch.Tensor, torch.Tensor]:
        model.load_state_dict(start)
        opt = torch.optim.Adam(model.parameters(), lr=1e-2)
        probe = params.ParamProbe(components.discover(model), sketch_size=16)  # strided sketches
        blocks, totals = [], []
        for step, (_, x, y) in data:
            probe.begin()
            F.cross_entropy(model(x), y).backward()
            probe.after_backward()
            probe.grads()
            opt.step()
            opt.zero_grad()
            probe.end(slot=step)
            if step == 9:
                with torch.no_grad():
                    model[2].weight.mul_(1.5)
            if (step + 1) % reduce_every == 0 or step == len(data) - 1:
                slots, block, total, _ = probe.reduce()
                assert slots == list(range(step + 1 - len(slots), step + 1))
                blocks.append(block)
                totals.append(total)
        return torch.cat(blocks), torch.cat(totals)

    one, total = run(1)
    batched, batched_total = run(every)
    assert one.shape == (20, len(components.discover(model)), len(params.PARAM_METRICS))
    assert torch.equal(one.isnan(), batched.isnan())
    assert torch.equal(one.nan_to_num(), batched.nan_to_num()) and torch.equal(total, batched_total)
    drift = one[:, :, params.PARAM_METRICS.index("weight_drift_l2")]
    assert drift[10, 2] > 0 and drift[9, 2] == 0  # the write shows at the step after it


class _Tensor(nn.Module):
    """A component of one parameter, which its forward returns: its norms are that tensor's."""

    def __init__(self, t: torch.Tensor) -> None:
        super().__init__()
        self.w = nn.Parameter(t)

    def forward(self) -> torch.Tensor:
        return self.w


class _Awkward(nn.Module):
    """Gradients whose norms are hard to take in float32, and gradients the compiled pass must
    leave to the eager ops (non-contiguous, sparse); each tensor its own component."""

    NAMES = ("zero", "loud", "quiet", "plain", "emb")

    def __init__(self) -> None:
        super().__init__()
        self.zero = _Tensor(torch.zeros(300))       # weights and gradient exactly 0
        self.loud = _Tensor(torch.randn(50))        # gradient entries `loud_scale`: 1e20, squares
                                                    # past float32's range
        self.quiet = _Tensor(torch.randn(50))       # gradient entries ~1e-24: squares below it
        self.plain = _Tensor(torch.randn(40, 31))   # a sketch of every 4th of 1,240 values
        self.emb = nn.Embedding(10, 4, sparse=True)
        self.loud_scale = 1e20
        self.quiet_only = False                     # a step where only `quiet` has a gradient

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        quiet = self.quiet().sum() * 1e-25 * x.sum()
        if self.quiet_only:
            return quiet
        return (quiet + self.zero().sum() * 0.0 + self.loud().sum() * self.loud_scale
                + (x @ self.plain()).sum() + self.emb(torch.arange(3)).sum())


def _norm64(t: torch.Tensor) -> float:
    return float(torch.linalg.vector_norm((t.to_dense() if t.is_sparse else t).double()))


def _train_awkward(trace: Path, grad_kind: str) -> dict[str, dict[int, object]]:
    """Three steps of `_Awkward` under the recorder: `loud` gradients at the first, `grad_kind`'s
    at the second (a non-contiguous gradient sends that pass to the eager ops, which would lose
    the loud norms), `quiet_only` the third. What the optimizer saw, in float64: per step the
    gradient norms and non-finite counts per component, the total, and the weights after."""
    torch.manual_seed(0)
    model = _Awkward()
    named = dict(zip(_Awkward.NAMES, (model.zero.w, model.loud.w, model.quiet.w, model.plain.w,
                                      model.emb.weight), strict=True))
    # `loud` is recorded but not stepped (its gradient would blow its weights up)
    opt = torch.optim.SGD([p for n, p in named.items() if n != "loud"], lr=1e-3)
    seen: dict[str, dict[int, object]] = {"grad": {}, "bad": {}, "total": {}, "weight": {}}
    with watch(model, opt, trace, full_precision=True):
        for step in (1, 2, 3):
            model.loud_scale, model.quiet_only = (1e20 if step == 1 else 1.0), step == 3
            model(torch.randn(8, 40)).backward()
            if step == 2 and grad_kind == "non-contiguous":
                model.plain.w.grad = torch.randn(31, 40).t()  # same shape, strides of a transpose
            elif step == 1 and grad_kind == "non-finite":
                model.loud.w.grad[7] = math.inf
            grads = {n: p.grad for n, p in named.items() if p.grad is not None}
            seen["grad"][step] = {n: _norm64(g) for n, g in grads.items()}
            seen["bad"][step] = {n: int((~torch.isfinite(g.coalesce().values() if g.is_sparse else g)).sum())
                                 for n, g in grads.items()}
            seen["total"][step] = math.sqrt(sum(v * v for v in seen["grad"][step].values()))
            opt.step()
            model.zero_grad()  # `loud`'s too
            seen["weight"][step] = {n: _norm64(p.detach()) for n, p in named.items()}
    return seen


def _nan_as_str(values: dict) -> dict:
    """`values` with NaN as "nan", so that two of them compare equal."""
    return {k: "nan" if isinstance(v, float) and math.isnan(v) else v for k, v in values.items()}


def _steps_column(trace: Path, column: str) -> list[float | None]:
    glob = schema.segment_glob(trace, "steps")
    return [v for (v,) in duckdb.sql(f"select {column} from read_parquet('{glob}') order by step").fetchall()]


def _kernel_source(env: dict[str, str]) -> tuple[str, bool]:
    """Where a new process's kernels came from (tracer/codecache.py `load`), and whether it imported llvmlite."""
    script = ("import sys\n"
              "from warninglight.tracer import kernels\n"
              "assert kernels.available()\n"
              "print(kernels._state['source'], 'llvmlite' in sys.modules)")
    run = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env, check=True)
    source, imported = run.stdout.split()
    return source, imported == "True"


@pytest.mark.skipif(codecache._library_key() is None or codecache._linker() is None,
                    reason="needs /proc/cpuinfo and a C compiler driver to link the library")
def test_a_later_process_loads_the_compiled_kernels_from_the_cache(tmp_path: Path) -> None:
    # the first process on a machine compiles the kernels and links them into a library; every
    # later one loads that without importing llvmlite. A file cut short or not ours is made
    # again, never loaded
    env = {k: v for k, v in os.environ.items() if k != "CC"}
    env["WARNINGLIGHT_CACHE_DIR"] = str(tmp_path)
    assert _kernel_source(env) == ("compiled", True)
    assert _kernel_source(env) == ("library", False)
    (lib,), (obj,) = tmp_path.glob("kernels-*.so"), tmp_path.glob("kernels-*.o")
    whole = lib.read_bytes()
    lib.write_bytes(whole[:len(whole) // 2])  # the object code is mapped; the library linked again
    assert _kernel_source(env) == ("object", True) and _kernel_source(env) == ("library", False)
    lib.unlink()
    whole = obj.read_bytes()
    obj.write_bytes(whole[:len(whole) // 2])
    assert _kernel_source(env) == ("compiled", True) and obj.read_bytes() == whole
    assert _kernel_source(env) == ("library", False)
    # a whole library that does not load (here: not a library at all) turns the library off
    lib.write_bytes(b"not a shared object")
    lib.with_name(lib.name + ".sha256").write_text(hashlib.sha256(b"not a shared object").hexdigest())
    assert _kernel_source(env) == ("object", True) and _kernel_source(env) == ("object", True)
    assert "did not load" in lib.with_name(lib.name + ".off").read_text()
    blocked = tmp_path / "a-file"
    blocked.write_text("")
    env["WARNINGLIGHT_CACHE_DIR"] = str(blocked / "cache")  # cannot be made: compiled, every time
    assert _kernel_source(env) == ("compiled", True) and _kernel_source(env) == ("compiled", True)


def test_without_a_linker_every_process_maps_the_object_code(tmp_path: Path) -> None:
    # a linker that fails is tried once: later processes map the object code and try no more,
    # until the note that says why is deleted
    env = {**os.environ, "WARNINGLIGHT_CACHE_DIR": str(tmp_path), "CC": "false"}
    assert _kernel_source(env) == ("compiled", True) and _kernel_source(env) == ("object", True)
    assert not list(tmp_path.glob("kernels-*.so"))
    if codecache._library_key() is not None:
        (off,) = tmp_path.glob("kernels-*.so.off")
        assert "false did not link it" in off.read_text()
        off.unlink()
        if codecache._linker() is not None and "CC" not in os.environ:
            del env["CC"]
            assert _kernel_source(env) == ("object", True) and _kernel_source(env) == ("library", False)


def test_a_cpu_not_known_without_llvm_gets_no_library(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # without /proc/cpuinfo the library's key is unknown: the object code only
    monkeypatch.setenv("WARNINGLIGHT_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(codecache, "_cpu_identity", lambda: None)
    assert codecache.load()[1] == "compiled" and codecache.load()[1] == "object"
    assert [p.suffix for p in tmp_path.iterdir()] == [".o"]


@pytest.mark.parametrize("threads", [1, 2])
def test_large_tensors_are_blas_dot_products_only_where_the_pass_runs_on_one_thread(tmp_path: Path,
                                                                                     threads: int) -> None:
    # a model past SPLIT_FROM values with a tensor past BLAS_FROM: on torch's two threads the
    # compiled pass in parts reads it; on one thread a BLAS dot product does; the same norms
    assert kernels.available()
    before = torch.get_num_threads()
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(600, 500), nn.Tanh(), nn.Linear(500, 4))
    assert model[0].weight.numel() >= params.BLAS_FROM and sum(p.numel() for p in model.parameters()) >= kernels.SPLIT_FROM
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    norms = []
    try:
        torch.set_num_threads(threads)
        with watch(model, opt, tmp_path, full_precision=True) as rec:
            assert rec.params._blas_list == ([] if threads > 1 and kernels.parts_on_threads() else [0])
            for _ in range(3):
                model(torch.randn(8, 600)).square().mean().backward()
                norms.append(math.hypot(*(t.grad.double().norm().item() for t in (model[0].weight, model[0].bias))))
                opt.step()
                opt.zero_grad()
    finally:
        torch.set_num_threads(before)
    got = health(tmp_path, "grad_norm_l2")
    assert [got[(s, "0")] for s in (1, 2, 3)] == pytest.approx(norms, rel=1e-6)


@pytest.mark.parametrize("passes", ["whole", "blas", "in parts"])
@pytest.mark.parametrize("grad_kind", ["dense", "non-contiguous", "non-finite"])
def test_compiled_parameter_passes_record_what_the_eager_ones_do(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, grad_kind: str, passes: str) -> None:
    # the compiled norms and sketches (tracer/kernels.py) against the eager ops and against
    # float64, as the trace holds them: per-component norms, the total gradient norm (float64
    # from the per-tensor norms, so a tensor's norm lost to float32's range shows there), the
    # non-finite counts, and the update norms and cosines (from the sketches: equal sketches
    # give equal values); with BLAS taking the tensors of 60 values or more (the zeros and the
    # matrix) too; and with every pass cut into parts of 64 values that torch's threads take.
    # (A BLAS-sized tensor's norm comes from float32 squares, as the eager ops' do: `quiet`'s
    # norm would be lost there.)
    assert kernels.available()
    if passes == "blas":
        monkeypatch.setattr(params, "BLAS_FROM", 60)
    if passes == "in parts":
        for name, value in (("SPLIT_FROM", 1), ("_PART", 64), ("_BLOCK", 16), ("_plans", {})):
            monkeypatch.setattr(kernels, name, value)
    traces, seen = {}, {}
    for compiled in (True, False):
        if not compiled:
            monkeypatch.setattr(kernels, "ready", lambda: False)
        traces[compiled] = tmp_path / str(compiled)
        seen[compiled] = _train_awkward(traces[compiled], grad_kind)
    assert seen[True] == seen[False]  # the same training either way
    if passes == "in parts":  # the compiled passes went through the parts
        assert any(plan is not None and len(plan.arrays[2]) > len(_Awkward.NAMES) for plan in kernels._plans.values())
    want = seen[True]
    fast, eager = traces[True], traces[False]
    for trace in (fast, eager):
        grad, bad = health(trace, "grad_norm_l2"), health(trace, "grad_nonfinite_count")
        weight = health(trace, "weight_norm_l2")
        for step in (1, 2, 3):
            # per component the norm is taken again from float32 squares: `loud` and `quiet`
            # leave that range, so they are checked in the total below
            had = [n for n in ("zero", "plain", "emb") if n in want["grad"][step]]
            assert [grad[(step, n)] for n in ("zero", "plain", "emb") if n not in had] == [None] * (3 - len(had))
            assert [grad[(step, n)] for n in had] == pytest.approx(
                [want["grad"][step][n] for n in had], rel=1e-6)
            assert {n: bad[(step, n)] for n in _Awkward.NAMES} == {
                n: want["bad"][step].get(n) for n in _Awkward.NAMES}
            assert [weight[(step, n)] for n in _Awkward.NAMES] == pytest.approx(
                [want["weight"][step][n] for n in _Awkward.NAMES], rel=1e-6)
    totals = [_steps_column(t, "grad_norm_total_l2") for t in (fast, eager)]
    assert totals[0] == pytest.approx([want["total"][s] for s in (1, 2, 3)], rel=1e-6, abs=0)
    if grad_kind == "non-finite":
        assert totals[0][0] == math.inf and want["bad"][1]["loud"] == 1
    # the eager ops may lose a float32 sum of squares out of range: equal wherever they keep it
    kept = [i for i, e in enumerate(totals[1]) if math.isfinite(e) and e > 0]
    assert [totals[1][i] for i in kept] == pytest.approx([totals[0][i] for i in kept], rel=1e-6, abs=0)
    assert 1 in kept  # the second step's norms are in range
    for metric in ("update_norm_l2", "update_cos"):  # the sketches, bit for bit
        values = health(fast, metric)
        assert _nan_as_str(values) == _nan_as_str(health(eager, metric)), metric
        some = values[(1 if metric == "update_norm_l2" else 2, "plain")]
        assert math.isfinite(some) and some != 0  # there are values to compare


def _thirty_steps_one_failing(trace: Path) -> None:
    """30 steps of a small MLP under the recorder, one of whose reductions the caller made fail
    (the failure is reported as a probe's)."""
    torch.manual_seed(0)
    model = zoo.mlp(hidden=12, depth=2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    batches = zoo.batches(*zoo.teacher_classification(256), 32)
    with pytest.warns(RuntimeWarning, match="probe failed.*injected"), \
            watch(model, opt, trace, flush_every_steps=100) as rec:
        for _, (_, x, y) in zip(range(30), batches, strict=False):
            loss = F.cross_entropy(model(x), y)
            loss.backward()
            opt.step()
            opt.zero_grad()
            rec.log(loss=loss)


def test_a_failed_reduction_nulls_its_own_steps_only(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # steps alike share one read-only validity array; the steps whose values a failed reduction
    # lost take a copy to null, so the steps before and after them keep theirs
    reduce, calls = params.ParamProbe.reduce, [0]

    def fails_once(self: params.ParamProbe):  # type: ignore[no-untyped-def]
        calls[0] += 1
        if calls[0] == 2:
            self.pending = []
            raise RuntimeError("injected")
        return reduce(self)
    monkeypatch.setattr(params.ParamProbe, "reduce", fails_once)
    _thirty_steps_one_failing(tmp_path)
    grad, rms = health(tmp_path, "grad_norm_l2"), health(tmp_path, "out_rms")
    lost = [s for s in range(1, 31) if grad[(s, "2")] is None]
    # the second batch of steps reduced together (a flush cuts one short), none other
    assert calls[0] > 2 and 0 < len(lost) <= params.FORWARD_BATCH_STEPS
    assert lost == list(range(lost[0], lost[0] + len(lost))) and lost[0] > 1 and lost[-1] < 30
    assert all(rms[(s, "2")] is not None for s in range(1, 31))  # the forward statistics stay


def test_a_reduction_that_fails_at_the_last_flush_nulls_its_steps_and_writes_them(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # the reduction at close() fails: the steps it held are written with null values, and the
    # segment with them and every other step of it is written, not dropped
    reduce, closing = params.ParamProbe.reduce, [False]

    def fails_at_close(self: params.ParamProbe):  # type: ignore[no-untyped-def]
        if closing[0] and self.pending:
            raise RuntimeError("injected")
        return reduce(self)
    close = recorder.Recorder.close

    def closes(self: recorder.Recorder, *args: object) -> None:
        closing[0] = True
        close(self, *args)
    monkeypatch.setattr(params.ParamProbe, "reduce", fails_at_close)
    monkeypatch.setattr(recorder.Recorder, "close", closes)
    _thirty_steps_one_failing(tmp_path)
    grad, rms = health(tmp_path, "grad_norm_l2"), health(tmp_path, "out_rms")
    assert sorted(s for s, c in grad if c == "2") == list(range(1, 31))
    lost = [s for s in range(1, 31) if grad[(s, "2")] is None]
    assert lost == list(range(lost[0], 31)) and 1 < lost[0] < 30 and len(lost) <= params.FORWARD_BATCH_STEPS
    assert all(rms[(s, "2")] is not None for s in range(1, 31))  # the forward statistics stay


def test_the_step_after_a_failed_reduction_starts_the_chain_again(tmp_path: Path,
                                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    # the update cosine and the drift compare a step with the one before it, which a failed
    # reduction lost: the next step has neither, as a run's first step, and no false drift
    # (nothing writes these weights outside the optimizer: every drift is 0)
    sketch_sums, calls = params.ParamProbe._sketch_sums, [0]

    def fails_once(self, *args):  # type: ignore[no-untyped-def]
        calls[0] += 1
        if calls[0] == 2:
            raise RuntimeError("injected")
        return sketch_sums(self, *args)
    monkeypatch.setattr(params.ParamProbe, "_sketch_sums", fails_once)
    _thirty_steps_one_failing(tmp_path)
    grad, cos, drift = (health(tmp_path, m) for m in ("grad_norm_l2", "update_cos", "weight_drift_l2"))
    comps = sorted(c for s, c in grad if s == 1 and grad[(s, c)] is not None)
    lost = [s for s in range(1, 31) if grad[(s, comps[0])] is None]
    assert comps and lost and lost[-1] < 29
    after = lost[-1] + 1
    for c in comps:
        assert cos[(after, c)] is None and drift[(after, c)] is None, c
        assert all(cos[(s, c)] is not None for s in range(after + 1, 31)), c
        assert {drift[(s, c)] for s in range(2, 31) if drift[(s, c)] is not None} == {0.0}, c


@pytest.mark.parametrize("compiled", [True, False])
def test_an_optimizer_that_puts_new_tensors_under_the_parameters_is_read_at_its_step(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, compiled: bool) -> None:
    # an optimizer whose step sets `p.data` to a new tensor: the weights after the step are the
    # new tensors, read at that step (not the old ones, a step late), and nothing wrote them
    # outside the optimizer (no drift)
    from warninglight.tracer import kernels

    if compiled:
        kernels.available()
    else:
        monkeypatch.setattr(kernels, "ready", lambda: False)

    class NewTensors(torch.optim.Optimizer):
        def __init__(self, ps: Iterator[torch.nn.Parameter]) -> None:
            super().__init__(ps, {"lr": 0.1})

        @torch.no_grad()
        def step(self, closure: None = None) -> None:  # type: ignore[override]
            for group in self.param_groups:
                for p in group["params"]:
                    p.data = p.data - group["lr"] * p.grad

    torch.manual_seed(0)
    model = zoo.mlp(hidden=12, depth=2)
    opt = NewTensors(model.parameters())
    batches, norms = zoo.batches(*zoo.teacher_classification(256), 32), []
    with watch(model, opt, tmp_path, full_precision=True):
        for _, (_, x, y) in zip(range(10), batches, strict=False):
            F.cross_entropy(model(x), y).backward()
            opt.step()
            opt.zero_grad()
            norms.append(_norm64(torch.cat([model[0].weight.flatten(), model[0].bias]).detach()))
    weight, drift = health(tmp_path, "weight_norm_l2"), health(tmp_path, "weight_drift_l2")
    assert [weight[(s, "0")] for s in range(1, 11)] == pytest.approx(norms, rel=1e-6)
    assert {drift[(s, "0")] for s in range(2, 11)} == {0.0}


def test_a_large_frozen_parameter_costs_no_read_in_the_gradient_pass(tmp_path: Path,
                                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    # on the CPU a tensor of BLAS size has its norm taken by a dot product, whose float32 sum is
    # checked (one host read a pass); a parameter without a gradient has nothing to check: the
    # gradient pass reads nothing, the weights' pass after the step reads its one verdict
    monkeypatch.setattr(params, "BLAS_FROM", 1500)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(50, 40), nn.Linear(40, 30), nn.Linear(30, 2))
    model[0].requires_grad_(False)  # 2,000 weights: BLAS-sized, never a gradient
    opt = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.1)
    at_step, grads = [], []
    with hostreads.counting() as reads, watch(model, opt, tmp_path, full_precision=True):
        for _ in range(4):
            model(torch.randn(4, 50)).sum().backward()
            grads.append({"1": _norm64(torch.cat([model[1].weight.grad.flatten(), model[1].bias.grad])),
                          "2": _norm64(torch.cat([model[2].weight.grad.flatten(), model[2].bias.grad]))})
            before = reads["__bool__"]
            opt.step()
            at_step.append(reads["__bool__"] - before)
            opt.zero_grad()
    assert at_step == [1, 1, 1, 1]
    got = health(tmp_path, "grad_norm_l2")
    assert [got[(s, "0")] for s in range(1, 5)] == [None] * 4
    assert [{c: got[(s, c)] for c in ("1", "2")} for s in range(1, 5)] == [
        pytest.approx(g, rel=1e-6) for g in grads]


@pytest.mark.parametrize("clip", [False, True], ids=["plain", "clipped"])
@pytest.mark.parametrize("compiled", [True, False], ids=["compiled", "eager"])
def test_a_gradient_freed_in_place_is_refused_not_read(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                        compiled: bool, clip: bool) -> None:
    # sharding wrappers free a tensor's storage in place between uses: the recorder says so and
    # records that step without gradient norms instead of reading freed memory. A loop that clips
    # makes two passes over the same gradients in a step (backward end, optimizer step): the
    # second is not spared the check by the first having passed
    if not compiled:
        monkeypatch.setattr(kernels, "ready", lambda: False)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(40, 30), nn.Linear(30, 2))
    grads, pre = {}, {}
    with pytest.warns(RuntimeWarning, match="gradient of parameter 2 has lost its storage"), \
            watch(model, path=tmp_path, full_precision=True) as rec:
        for step in (1, 2, 3):
            model(torch.randn(4, 40)).sum().backward()
            pre[step] = _norm64(torch.cat([p.grad.flatten() for p in model.parameters()]))
            if clip:
                torch.nn.utils.clip_grad_norm_(model.parameters(), 0.5)
            grads[step] = _norm64(torch.cat([model[1].weight.grad.flatten(), model[1].bias.grad]))
            if step == 2:
                model[1].weight.grad.untyped_storage().resize_(0)
            rec.step()
            model.zero_grad()
    got = health(tmp_path, "grad_norm_l2")
    assert [got[(s, "1")] for s in (1, 2, 3)] == [pytest.approx(grads[1], rel=1e-6), None,
                                                  pytest.approx(grads[3], rel=1e-6)]
    assert got[(2, "0")] is None  # the whole pass is refused, not only the freed tensor
    assert _steps_column(tmp_path, "grad_norm_total_l2")[1] is None
    if clip:  # the backward-end pass of the steps after it is taken and exact
        assert _steps_column(tmp_path, "grad_norm_preclip_l2")[2] == pytest.approx(pre[3], rel=1e-6)
    assert health(tmp_path, "weight_norm_l2")[(2, "1")] == pytest.approx(
        _norm64(torch.cat([model[1].weight.detach().flatten(), model[1].bias.detach()])), rel=1e-6)


def test_a_weight_freed_in_place_is_refused_and_compiled_again_once_back(tmp_path: Path) -> None:
    # the compiled passes read the weights through addresses: one whose storage is freed in
    # place is read by no pass (that step is dropped, and said); once back, the eager ops read
    # it, and after the next flush the compiled passes again (no host read at all)
    assert kernels.available()
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(40, 30), nn.Linear(30, 2))
    w = model[1].weight
    reads_per_step = []
    with pytest.warns(RuntimeWarning, match="weights of parameter 2 have lost their storage"), \
            hostreads.counting() as reads, watch(model, path=tmp_path, flush_every_steps=3) as rec:
        for step in range(1, 13):
            before = reads["__bool__"]
            model(torch.randn(4, 40)).sum().backward()
            if step == 4:
                saved, nbytes = w.detach().clone(), w.untyped_storage().nbytes()
                w.untyped_storage().resize_(0)
            rec.step()
            if step == 4:
                w.untyped_storage().resize_(nbytes)
                with torch.no_grad():
                    w.copy_(saved)
            model.zero_grad()
            reads_per_step.append(reads["__bool__"] - before)
    assert rec.dropped_steps == 1
    weight = health(tmp_path, "weight_norm_l2")
    assert sorted({s for s, _ in weight}) == [1, 2, 3, *range(5, 13)]
    want = _norm64(torch.cat([w.detach().flatten(), model[1].bias.detach()]))
    assert [weight[(s, "1")] for s in range(5, 13)] == pytest.approx([want] * 8, rel=1e-6)
    assert reads_per_step[:3] == [0, 0, 0] and reads_per_step[-4:] == [0, 0, 0, 0]


def test_compiled_gradient_passes_stay_on_after_a_gradient_of_another_layout(tmp_path: Path) -> None:
    # a non-contiguous gradient sends that step's gradient pass to the eager ops, and only that
    # pass: their verdict on the norms is one host read, the compiled pass's return value none
    assert kernels.available()
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 6), nn.Linear(6, 2))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    at_step, grads = [], []
    with hostreads.counting() as reads, watch(model, opt, tmp_path, full_precision=True):
        for step in range(1, 5):
            model(torch.randn(4, 8)).sum().backward()
            if step == 2:
                model[0].weight.grad = torch.randn(8, 6).t()  # same shape, transposed strides
            grads.append([_norm64(torch.cat([m.weight.grad.flatten(), m.bias.grad])) for m in model])
            before = reads["__bool__"]
            opt.step()
            at_step.append(reads["__bool__"] - before)
            opt.zero_grad()
    assert at_step == [0, 1, 0, 0]
    got = health(tmp_path, "grad_norm_l2")
    assert [[got[(s, c)] for c in ("0", "1")] for s in range(1, 5)] == [
        pytest.approx(g, rel=1e-6) for g in grads]


class _Spare(nn.Module):
    """A model on the CPU with a spare layer on another device (never called)."""

    def __init__(self) -> None:
        super().__init__()
        self.used = nn.Linear(8, 2)
        self.spare = nn.Linear(2, 2, device="meta")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.used(x)


def test_a_parameter_off_the_cpu_is_never_read_by_address(tmp_path: Path) -> None:
    # the compiled passes read CPU memory by address; a meta tensor has none (reading its
    # address would crash the process): the eager ops take it, fail, and the recorder says so
    model = _Spare()
    opt = torch.optim.SGD(model.used.parameters(), lr=0.1)
    with pytest.warns(RuntimeWarning, match="probe failed.*meta"), watch(model, opt, tmp_path) as rec:
        for _ in range(3):
            model(torch.randn(4, 8)).sum().backward()
            opt.step()
            opt.zero_grad()
    assert rec.step_count == 3 and rec.dropped_steps == 3


def test_head_prediction_entropy_and_confidence(tmp_path: Path) -> None:
    torch.manual_seed(0)
    model = zoo.mlp()
    with torch.no_grad():
        model[6].weight.zero_()
        model[6].bias.zero_()  # uniform predictions over 10 classes
    opt = torch.optim.SGD(model.parameters(), lr=1e-9)
    with watch(model, opt, tmp_path, full_precision=True):
        model(torch.randn(32, 32)).sum().backward()
        opt.step()
    assert health(tmp_path, "pred_entropy_nats")[(1, "6")] == pytest.approx(torch.log(torch.tensor(10.0)).item())
    assert health(tmp_path, "pred_maxprob")[(1, "6")] == pytest.approx(0.1)
    assert health(tmp_path, "pred_maxprob")[(1, "4")] is None  # not a head


def test_activation_statistics_match_the_output(tmp_path: Path) -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 5), nn.ReLU())
    x = torch.randn(16, 6)  # 16 rows = the 16 sampled rows: every value is in the sample
    with torch.no_grad():
        out = model(x)
    with watch(model, path=tmp_path, full_precision=True) as rec:
        model(x).sum().backward()
        rec.step()
    got = {m: health(tmp_path, m)[(1, "1")] for m in ("out_mean", "out_rms", "out_absmax", "out_zero_frac")}
    assert got == pytest.approx({"out_mean": float(out.mean()), "out_rms": float(out.square().mean().sqrt()),
                                 "out_absmax": float(out.abs().max()), "out_zero_frac": float((out == 0).float().mean())})


def test_activation_statistics_match_the_output_at_every_step(tmp_path: Path) -> None:
    # batches of 16 rows and then 8 (every value is in the sample): samples are copied into
    # staging buffers once a shape repeats, batches of 8 steps are reduced together, flushes every
    # 7 steps cut them short, and the shape change makes new buffers; none of it may move a value
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 12), nn.ReLU(), nn.Linear(12, 12), nn.Tanh(), nn.Linear(12, 3))
    with torch.no_grad():
        model[0].bias[:3] = -50.0  # three ReLU units dead
        model[2].bias[:4] = 40.0   # four tanh units saturated
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    expected: dict[tuple[int, str], dict[str, float]] = {}
    step = [1]

    def record(name: str):  # noqa: ANN202
        def hook(module: nn.Module, args: object, out: torch.Tensor) -> None:
            o = out.detach()
            expected[(step[0], name)] = {
                "out_mean": float(o.mean()), "out_rms": float(o.square().mean().sqrt()),
                "out_absmax": float(o.abs().max()), "out_zero_frac": float((o == 0).float().mean()),
                "out_dead_frac": float((o.abs() <= 1e-6).all(0).float().mean()),
                "out_sat_frac": float((o.abs() >= 0.98).float().mean())}
        return hook
    for i, layer in enumerate(model):
        layer.register_forward_hook(record(str(i)))
    with watch(model, opt, tmp_path, flush_every_steps=7, full_precision=True):
        for s in range(1, 21):
            step[0] = s
            x = torch.randn(16 if s <= 12 else 8, 6)
            F.mse_loss(model(x), torch.zeros(len(x), 3)).backward()
            opt.step()
            opt.zero_grad()
    metrics = ["out_mean", "out_rms", "out_absmax", "out_zero_frac", "out_dead_frac", "out_sat_frac"]
    got = {m: health(tmp_path, m) for m in metrics}
    for (s, name), want in expected.items():
        for m in metrics:
            if m == "out_sat_frac" and name != "3":
                assert got[m][(s, name)] is None  # only a bounded activation saturates
            else:
                assert got[m][(s, name)] == pytest.approx(want[m], rel=1e-6, abs=1e-7), (s, name, m)
    assert len(expected) == 20 * 5
    assert got["out_dead_frac"][(20, "1")] >= 3 / 12
    assert got["out_sat_frac"][(20, "3")] >= 4 / 12


def test_an_output_written_in_place_after_its_hook_is_recorded_as_the_layer_left_it(tmp_path: Path) -> None:
    # nn.ReLU(inplace=True) overwrites the Linear's output after the Linear's hook has run
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 12), nn.ReLU(inplace=True), nn.Linear(12, 3))
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    expected: dict[int, float] = {}
    step = [1]
    model[0].register_forward_hook(lambda m, a, out: expected.__setitem__(step[0], float(out.detach().mean())))
    with watch(model, opt, tmp_path, full_precision=True):
        for s in range(1, 13):
            step[0] = s
            F.mse_loss(model(torch.randn(16, 6)), torch.zeros(16, 3)).backward()
            opt.step()
            opt.zero_grad()
    got = health(tmp_path, "out_mean")
    assert [got[(s, "0")] for s in range(1, 13)] == pytest.approx([expected[s] for s in range(1, 13)], rel=1e-6)
    assert health(tmp_path, "out_zero_frac")[(12, "0")] == 0.0  # before the ReLU: no zeros


class _LateInPlace(nn.Module):
    """A layer whose output the parent starts to scale in place, after the layer's hook, at a
    later step; `shared`: the layer is called a second time, on that output."""

    def __init__(self, shared: bool = False) -> None:
        super().__init__()
        width = 6 if shared else 12
        self.lin, self.head = nn.Linear(6, width), nn.Linear(width, 3)
        self.in_place, self.shared = False, shared

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.lin(x)
        if self.in_place:
            h.mul_(2.0)
        return self.head(self.lin(h) if self.shared else h)


def test_an_output_first_written_in_place_at_a_later_step_loses_that_steps_sample_only(tmp_path: Path) -> None:
    # until step 6 nothing writes the layer's output in place, so its hook only notes it and the
    # forward's end observes it; at step 6 the parent scales it after the hook: the values the
    # hook saw are gone (that step's sample is null), and from then on the hook copies them
    torch.manual_seed(0)
    model = _LateInPlace()
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    seen: dict[int, float] = {}
    step = [1]
    model.lin.register_forward_hook(lambda m, a, out: seen.__setitem__(step[0], float(out.detach().mean())))
    with watch(model, opt, tmp_path, full_precision=True) as rec:
        for s in range(1, 13):
            step[0], model.in_place = s, s >= 6
            F.mse_loss(model(torch.randn(16, 6)), torch.zeros(16, 3)).backward()
            opt.step()
            opt.zero_grad()
            if s == 5:  # the layer's hook only notes its output
                assert next(c.index for c in rec.components if c.name == "lin") in rec.fwd.notable()
    got = health(tmp_path, "out_mean")
    assert got[(6, "lin")] is None
    kept = [s for s in range(1, 13) if s != 6]
    assert [got[(s, "lin")] for s in kept] == pytest.approx([seen[s] for s in kept], rel=1e-6)


def test_a_forward_pass_like_the_last_copies_its_samples_in_one_call(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # from the third step (a staging plan, then a pass that noted the same outputs) the outputs
    # the hooks noted are copied by one compiled call; a pass of another batch size (step 7)
    # takes the copies one by one and the next pass like it the one call again. The trace is
    # that of the copies one by one, value for value
    assert kernels.available()
    calls = []
    real = kernels.rows_copier

    def counted() -> object:
        calls.append(1)
        return real()

    def run(trace: Path, one_call: bool) -> list[tuple]:
        torch.manual_seed(0)
        model = zoo.mlp(depth=4)
        opt = torch.optim.SGD(model.parameters(), lr=0.05)
        data = zoo.batches(*zoo.teacher_classification(512), 16)
        with watch(model, opt, trace) as rec:
            if not one_call:
                monkeypatch.setattr(rec.fwd, "_copies_of", lambda noted: None)
            for s in range(1, 15):
                _, x, y = next(data)
                F.cross_entropy(model(x[:5] if s == 7 else x), y[:5] if s == 7 else y).backward()
                opt.step()
                opt.zero_grad()
        glob = schema.segment_glob(trace, "health")
        return duckdb.sql(f"select step, component, out_mean, out_rms, out_absmax, out_zero_frac, out_dead_frac "
                          f"from read_parquet('{glob}') order by step, component").fetchall()

    monkeypatch.setattr(kernels, "rows_copier", counted)
    want = run(tmp_path / "one by one", False)
    assert calls == []
    got = run(tmp_path / "one call", True)
    assert len(calls) >= 8 and got == want
    assert len(got) == 14 * 9 and all(r[3] is not None for r in got)  # every component sampled, step 7 too


def test_a_shared_modules_first_output_written_in_place_is_not_stood_in_for(tmp_path: Path) -> None:
    # a component's sample is its first call's output: when that is lost (written in place after
    # the hook), the step's values are null, not the second call's
    torch.manual_seed(0)
    model = _LateInPlace(shared=True)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    first: dict[int, float] = {}
    step = [1]

    def note_first(module: nn.Module, args: object, out: torch.Tensor) -> None:
        first.setdefault(step[0], float(out.detach().mean()))
    model.lin.register_forward_hook(note_first)
    with watch(model, opt, tmp_path, full_precision=True):
        for s in range(1, 13):
            step[0], model.in_place = s, s == 6
            F.mse_loss(model(torch.randn(16, 6)), torch.zeros(16, 3)).backward()
            opt.step()
            opt.zero_grad()
    got = health(tmp_path, "out_mean")
    assert got[(6, "lin")] is None
    kept = [s for s in range(1, 13) if s != 6]
    assert [got[(s, "lin")] for s in kept] == pytest.approx([first[s] for s in kept], rel=1e-6)


def _sigmoid_tanh_model() -> nn.Module:
    return nn.Sequential(nn.Linear(8, 24), nn.Tanh(), nn.Linear(24, 24), nn.Sigmoid(),
                         nn.Linear(24, 24), nn.ReLU(), nn.Linear(24, 3))


@pytest.mark.parametrize("bad", [None, math.nan, math.inf])
def test_compiled_forward_statistics_equal_the_eager_ones(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                          bad: float | None) -> None:
    # the compiled CPU pass (tracer/kernels.py) against the eager ops it replaces: saturated
    # and dead units, exact zeros, and a non-finite value written into an output at step 5
    assert kernels.available()
    traces = {}
    step = [0]

    def poison(module: nn.Module, args: object, out: torch.Tensor) -> torch.Tensor:
        if bad is not None and step[0] == 5:
            out = out.clone()
            out[0, 1] = bad
        return out
    for compiled in (True, False):
        if not compiled:
            monkeypatch.setattr(kernels, "ready", lambda: False)
        torch.manual_seed(0)
        model = _sigmoid_tanh_model()
        with torch.no_grad():
            model[2].weight[:4].zero_()  # units of the sigmoid's input stuck at its bias
            model[2].bias[:4] = 30.0
        opt = torch.optim.SGD(model.parameters(), lr=0.05)
        model[4].register_forward_hook(poison)
        trace = tmp_path / str(compiled)
        with watch(model, opt, trace, flush_every_steps=6):
            for step[0] in range(12):
                x = torch.randn(16, 8) * 4  # a wide input: many tanh units saturate
                F.cross_entropy(model(x), torch.randint(0, 3, (16,))).backward()
                opt.step()
                opt.zero_grad()
        traces[compiled] = trace
    metrics = ("out_mean", "out_rms", "out_absmax", "out_zero_frac", "out_sat_frac", "out_dead_frac",
               "out_nonfinite_count")
    for metric in metrics:
        fast, eager = health(traces[True], metric), health(traces[False], metric)
        assert fast.keys() == eager.keys() and len(fast) == 12 * 7  # 7 components, 12 steps
        assert [k for k, v in fast.items() if v is None] == [k for k, v in eager.items() if v is None]
        pairs = [(fast[k], eager[k]) for k in fast if fast[k] is not None]
        assert [a for a, _ in pairs] == pytest.approx([b for _, b in pairs], rel=1e-6, abs=1e-7), metric
    sat = health(traces[True], "out_sat_frac")
    assert sat[(1, "1")] > 0.1 and sat[(1, "3")] > 0.1  # the case the kernel's saturated count is for
    if bad is not None:
        assert health(traces[True], "out_nonfinite_count")[(6, "4")] == 1


class _Branches(nn.Module):
    """Two experts on the root, the second used on odd steps only."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b, self.head = nn.Linear(8, 8), nn.Linear(8, 8), nn.Linear(8, 3)
        self.use_b = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.a(x)
        if self.use_b:
            h = h + self.b(x)
        return self.head(torch.relu(h))


@pytest.mark.parametrize("set_to_none", [True, False])
def test_gradient_norms_are_those_the_optimizer_receives(tmp_path: Path, set_to_none: bool) -> None:
    # the norms the optimizer receives: two micro-batches accumulated, an expert
    # without a gradient on even steps (a zeroed gradient left from the step before when
    # zero_grad keeps the tensors; step 3's gradient at step 4, no zero_grad in between),
    # gradients scaled in place after backward on steps 5-6
    torch.manual_seed(0)
    model = _Branches()
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    expected: list[dict[str, float]] = []
    totals: list[float] = []

    def note(*_: object) -> None:
        totals.append(float(torch.linalg.vector_norm(torch.cat(
            [p.grad.flatten() for p in model.parameters() if p.grad is not None]).double())))
        expected.append({name: float(torch.linalg.vector_norm(torch.cat(
            [p.grad.flatten() for p in mod.parameters()]).double()))
            for name, mod in (("a", model.a), ("b", model.b), ("head", model.head))
            if all(p.grad is not None for p in mod.parameters())})
    with watch(model, opt, tmp_path, flush_every_steps=5):
        opt.register_step_pre_hook(note)
        for step in range(1, 13):
            model.use_b = step % 2 == 1
            for _ in range(2):
                F.cross_entropy(model(torch.randn(16, 8)), torch.randint(0, 3, (16,))).backward()
            if step in (5, 6):
                for p in model.parameters():
                    if p.grad is not None:
                        p.grad.mul_(0.5)
            opt.step()
            if step != 3:  # step 4 adds to step 3's gradients; expert b's stays as step 3 left it
                opt.zero_grad(set_to_none=set_to_none)
    got = health(tmp_path, "grad_norm_l2")
    for step, norms in enumerate(expected, start=1):
        for name in ("a", "b", "head"):
            if name in norms:
                assert got[(step, name)] == pytest.approx(norms[name], rel=1e-5), (step, name)
            else:
                assert got[(step, name)] is None, (step, name)
    glob = schema.segment_glob(tmp_path, "steps")
    total = duckdb.sql(f"select grad_norm_total_l2 from read_parquet('{glob}') order by step").fetchall()
    assert [t for (t,) in total] == pytest.approx(totals, rel=1e-5)
    assert not set_to_none or "b" not in expected[1]  # step 2: expert b had no gradient at all
    assert set_to_none or expected[1]["b"] == 0  # ... or a zeroed one
    assert expected[3]["b"] == expected[2]["b"] > 0  # step 4: expert b's gradient from step 3


def test_the_kernels_load_in_the_background_and_take_over_at_a_step_end(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # a process that has not loaded the kernels: watch() does not wait for them, the eager
    # ops take the first
    # steps, the compiled passes the later ones. Across the change the values are
    # the eager ones to float32 rounding, and weight drift stays exactly zero in a loop that
    # writes the weights only through the optimizer (the norms it compares come from one kind
    # of pass), while an outside write after the change is still seen at its step
    assert kernels.available()
    monkeypatch.setattr(kernels, "_state", {})
    monkeypatch.setattr(kernels, "_loading", {})
    # the two kinds of pass often round a norm to the same float32: the eager weight norms are
    # made a few float32 steps larger here, so that a drift comparing norms of two kinds (a
    # switch at the wrong point) cannot hide
    norms_into = params.ParamProbe._norms_into

    def skewed(self: params.ParamProbe, field: str, tensors: list[torch.Tensor], kind: str,
               weight_addrs: object = None) -> bool | None:
        finite = norms_into(self, field, tensors, kind, weight_addrs)
        if kind == "weights" and weight_addrs is None:
            getattr(self._row(), field).mul_(1 + 2.0 ** -20)
        return finite
    monkeypatch.setattr(params.ParamProbe, "_norms_into", skewed)

    def train(trace: Path, hold: bool) -> tuple[list[bool], list[bool]]:
        torch.manual_seed(0)
        model = zoo.mlp()
        opt = torch.optim.Adam(model.parameters(), lr=1e-3)
        data = zoo.batches(*zoo.teacher_classification(256), 32)
        modes: tuple[list[bool], list[bool]] = ([], [])
        if hold:
            kernels._lock.acquire()  # the load waits here: the first steps are surely eager
        rec = watch(model, opt, trace, flush_every_steps=7)
        for step in range(1, 25):
            if hold and step == 9:  # its first forward takes the exact weight norms (every 8th)
                kernels._lock.release()
                kernels._loading[""].join()
            _, x, y = next(data)
            F.cross_entropy(model(x), y).backward()
            opt.step()
            opt.zero_grad()
            modes[0].append(rec.params._compiled)
            modes[1].append(rec.fwd._compiled)
            if step == 20:
                with torch.no_grad():
                    model[2].weight.mul_(1.5)
        rec.close()
        return modes

    switched, eager = tmp_path / "switched", tmp_path / "eager"
    params_mode, fwd_mode = train(switched, hold=True)
    assert params_mode == [False] * 8 + [True] * 16
    assert fwd_mode == [False] * 8 + [True] * 16
    monkeypatch.setattr(kernels, "ready", lambda: False)
    assert train(eager, hold=False) == ([False] * 24, [False] * 24)
    drift = health(switched, "weight_drift_l2")
    assert {(s, c) for (s, c), v in drift.items() if v} == {(21, "2")}
    for metric in ("grad_norm_l2", "weight_norm_l2", "update_norm_l2", "out_mean", "out_absmax", "out_dead_frac"):
        got, want = health(switched, metric), health(eager, metric)
        assert got.keys() == want.keys()
        keys = sorted(k for k, v in want.items() if v is not None)
        assert [got[k] for k in keys] == pytest.approx([want[k] for k in keys], rel=1e-5, abs=1e-7), metric


def test_the_first_ready_starts_the_load_on_a_thread_and_never_waits(monkeypatch: pytest.MonkeyPatch) -> None:
    assert kernels.available()
    monkeypatch.setattr(kernels, "_state", {})
    monkeypatch.setattr(kernels, "_loading", {})
    with kernels._lock:  # the load waits here: `ready` must not
        assert not kernels.ready() and not kernels.ready()
        assert list(kernels._loading) == [""] and kernels._loading[""].is_alive()
    kernels._loading[""].join()
    assert kernels.ready() and kernels._state["ok"]
    monkeypatch.setenv("WARNINGLIGHT_EAGER", "1")  # says no, loaded or not, and starts nothing
    assert not kernels.ready()
    monkeypatch.setattr(kernels, "_state", {})
    monkeypatch.setattr(kernels, "_loading", {})
    assert not kernels.ready() and kernels._loading == {}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.float64, torch.int64])
def test_the_non_finite_count_of_compiled_graphs_is_exact(dtype: torch.dtype) -> None:
    # what a traced hook counts: NaN, both infinities, values that overflow to infinity in the
    # graph, the largest finite values and subnormals, eager and through inductor, which must
    # not fold x - x to 0, and which computes a 16-bit output in float32 (its overflow to
    # infinity happens only when the output is stored: counted all the same)
    from warninglight.tracer.probes import nonfinite_count

    torch._dynamo.reset()
    x = torch.randn(4099, dtype=torch.float64) * 100
    x[[3, 10, 11, 500]] = torch.tensor([math.nan, math.inf, -math.inf, -math.nan], dtype=torch.float64)
    x[20:24] = torch.tensor([1e-310, -1e-310, -0.0, 0.0])
    if dtype.is_floating_point:
        info = torch.finfo(dtype)
        x[30:33] = torch.tensor([info.max, -info.max, info.tiny / 4])
        x[40:42] = info.max  # twice this overflows
    x = x.to(dtype) if dtype.is_floating_point else torch.arange(4099, dtype=dtype)

    def doubled(v: torch.Tensor) -> torch.Tensor:
        return nonfinite_count(v * 2)

    want = int((~torch.isfinite(x * 2)).sum())
    assert want == (0 if dtype == torch.int64 else 8)
    assert int(doubled(x)) == want
    assert int(torch.compile(doubled, backend="inductor", fullgraph=True)(x)) == want
    torch._dynamo.reset()
