"""What the recorder asks of the host in a training step, and what it keeps in memory over a run."""

from __future__ import annotations

import gc
import math
import tracemalloc
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import hostreads
import pyarrow.parquet as pq
import pytest
import torch
import torch.nn.functional as F
from warninglight.lab import zoo
from warninglight.tracer import kernels, params, watch

_READS = hostreads.READS


@pytest.fixture()
def host_reads() -> Iterator[dict[str, int]]:
    """Counts host reads made by the recorder's code on the training (main) thread."""
    with hostreads.counting() as counts:
        yield counts


def _train_gpt(device: str, steps: int, micro_batches: int, trace: Path) -> object:
    torch.manual_seed(0)
    model = zoo.TinyGPT(zoo.GPTConfig(block_size=32)).to(device)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    rec = watch(model, opt, trace, flush_every_steps=5)
    for _ in range(steps):
        for _ in range(micro_batches):
            x = torch.randint(0, 65, (4, 32), device=device)
            loss = F.cross_entropy(model(x).flatten(0, 1), x.flatten())
            loss.backward()
            rec.log(loss=loss)
            rec.batch(torch.arange(4, device=device))
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad()
    rec.close()
    return rec


def test_on_an_accelerator_the_step_reads_nothing_back(host_reads: dict[str, int], tmp_path: Path) -> None:
    # the meta device stands in for an accelerator: it has no data, so any read of a value
    # raises, and the recorder would name it in a "probe failed" warning
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        rec = _train_gpt("meta", steps=12, micro_batches=2, trace=tmp_path)
    failed = [str(w.message) for w in caught if "probe failed" in str(w.message)]
    assert failed == [] and rec.step_count == 12
    assert host_reads == dict.fromkeys(_READS, 0)


def _forward_reductions(trace: Path) -> int:
    """How many times the forward samples were reduced, read from the segments the run wrote.

    Samples are reduced every 8 steps and at each flush that has steps not yet reduced. A flush
    keeps its last step back for the next segment (logs may still come for it) after reducing it;
    with a flush every 5 steps no 8 accumulate in between. So every segment but the last was cut
    by a flush that reduced, and the last, written at close, needed one only if it holds more than
    the step kept back (or is the only one)."""
    files = sorted(trace.glob("steps/rank=0/*/*.parquet"))
    last = pq.read_table(files[-1], columns=["step"]).num_rows
    return len(files) - 1 + (1 if len(files) == 1 or last > 1 else 0)


@pytest.mark.parametrize("mode", ["compiled", "compiled-blas", "eager"])
def test_on_cpu_the_step_reads_what_is_documented(host_reads: dict[str, int], tmp_path: Path,
                                                  monkeypatch: pytest.MonkeyPatch, mode: str) -> None:
    # docs/overhead.md. With the compiled kernels (compiled): the norm passes over weights and gradients are
    # compiled and give their finite verdict to Python directly, so no tensor is read, except
    # that where tensors are large enough for BLAS (`params.BLAS_FROM`; lowered here so that
    # this small GPT has some), each pass reads one verdict on their float32 sums; the
    # parameter rows get one zero-copy numpy view when the recorder is made, and so do the five
    # other buffers of the sketch arithmetic (`ParamProbe._kernel_views`), and each reduction
    # of a batch of steps' sampled outputs (the GPT's samples all have 16 rows: one group)
    # takes one zero-copy numpy view of CPU memory; the model's output is judged finite by a
    # compiled check, which reads no tensor. Without the compiled kernels: one read per step (is the
    # total gradient norm finite?), one per extra micro-batch (are the gradients so far finite?),
    # one per pass of norms over the weights or gradients (is any float32 sum of squares out of
    # range?) and one per reduction (is the sample finite?)
    compiled = mode != "eager"
    if mode == "compiled-blas":
        monkeypatch.setattr(params, "BLAS_FROM", 8192)
    if compiled:
        assert kernels.available()
    else:
        monkeypatch.setenv("WARNINGLIGHT_EAGER", "1")
        assert not kernels.available()
    steps, micro = 16, 2
    taken = _counting_passes(monkeypatch)
    taken.append(0)
    _train_gpt("cpu", steps=steps, micro_batches=micro, trace=tmp_path)
    reductions = _forward_reductions(tmp_path)
    assert 2 <= reductions <= 5  # every 8 steps, and at each flush
    # norm passes: per step the gradients at the optimizer and the weights after it; the
    # gradients at the end of the step's last backward pass once the first step showed that the
    # loop modifies them (clipping; compiled, a sketch of them instead once the loop showed that
    # it only rescales them); the weights at the first forward on the first step and every 8th
    # (nothing else wrote them)
    passes = (2 * steps + (steps - 1)
              + 1 + (steps - 1) // params.EXACT_DRIFT_EVERY)
    assert taken[0] == passes if not compiled else passes - steps // 2 <= taken[0] <= passes
    passes = taken[0]
    if compiled:
        # with BLAS tensors: a verdict per norm pass. (The extra micro-batch's finite check
        # judges held outputs; a forward pass whose output is finite lets them go)
        blas = passes if mode == "compiled-blas" else 0
        assert host_reads == {**dict.fromkeys(_READS, 0), "numpy": 1 + 5 + reductions,
                              **({"__bool__": blas} if blas else {})}
    else:
        assert host_reads == {**dict.fromkeys(_READS, 0),
                              "__bool__": steps * micro + passes + reductions}


class _Experts(torch.nn.Module):
    """Sixteen one-weight experts on the root: a random subset reaches the output, one is frozen."""

    def __init__(self, n: int = 16) -> None:
        super().__init__()
        self.weights = [torch.nn.Parameter(torch.randn(2)) for _ in range(n)]
        for i, w in enumerate(self.weights):
            self.register_parameter(f"expert{i}", w)
        self.weights[0].requires_grad_(False)
        self.gen = torch.Generator().manual_seed(0)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        chosen = (torch.rand(len(self.weights), generator=self.gen) < 0.5).tolist()
        chosen[1] = True  # one expert always answers: the output always has a gradient
        return sum(x * w for w, c in zip(self.weights, chosen, strict=True) if c)


def test_recorder_memory_stays_flat_over_20k_steps(tmp_path: Path) -> None:
    # which parameters get a gradient changes every step (one of 16,384 patterns): a cache keyed
    # by it would grow by an entry almost every step
    torch.manual_seed(0)
    model = _Experts()
    opt = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=1e-3)
    x = torch.randn(2, 2)
    traced = []
    tracemalloc.start(1)
    try:
        with watch(model, opt, tmp_path, flush_every_steps=500) as rec:
            for step in range(1, 20_001):
                model(x).sum().backward()
                opt.step()
                opt.zero_grad(set_to_none=True)
                if step % 4000 == 0 and step >= 8000:
                    gc.collect()
                    traced.append(tracemalloc.get_traced_memory()[0])
    finally:
        tracemalloc.stop()
    assert rec.step_count == 20_000 and rec.dropped_steps == 0
    # rows waiting for the writer come and go (~0.4 KB a step, up to two segments of 500 steps);
    # a cache entry per gradient pattern (~1 KB, ~4,500 new patterns after step 8,000) would not
    assert max(traced) - traced[0] < 1024 * 1024, traced


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_on_cuda_a_training_step_never_synchronises(tmp_path: Path) -> None:
    # the overhead benchmark's GPT with bf16 autocast, two micro-batches, clipping, device-side
    # logged losses and batch ids; any host-device sync raises inside the step (and the recorder
    # would turn a raise in its hooks into a "probe failed" warning, so warnings are checked too)
    torch.manual_seed(0)
    cfg = zoo.GPTConfig(n_layer=4, n_embd=256, n_head=4, block_size=128)
    model = zoo.TinyGPT(cfg).cuda()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        rec = watch(model, opt, tmp_path, flush_every_steps=4)
        torch.cuda.set_sync_debug_mode("error")
        try:
            for _ in range(10):
                for _ in range(2):
                    x = torch.randint(0, cfg.vocab_size, (8, cfg.block_size), device="cuda")
                    with torch.autocast("cuda", dtype=torch.bfloat16):
                        loss = F.cross_entropy(model(x).flatten(0, 1).float(), x.flatten())
                    loss.backward()
                    rec.log(loss=loss)
                    rec.batch(torch.arange(8, device="cuda"))
                torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
                opt.step()
                opt.zero_grad(set_to_none=True)
        finally:
            torch.cuda.set_sync_debug_mode("default")
        rec.close()
    assert [str(w.message) for w in caught if "warninglight" in str(w.message)] == []
    assert rec.step_count == 10 and rec.dropped_steps == 0


def _train_mlp(trace: Path, clip: float | None = None, steps: int = 4) -> None:
    """Watched SGD steps of the zoo's MLP, its gradients clipped to `clip` if given."""
    torch.manual_seed(0)
    model = zoo.mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    data = zoo.batches(*zoo.teacher_classification(256), 32)
    with watch(model, opt, trace):
        for _ in range(steps):
            _, x, y = next(data)
            F.cross_entropy(model(x), y).backward()
            if clip is not None:
                torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
            opt.step()
            opt.zero_grad()


def test_pre_clip_gradient_norm_is_recorded_beside_the_clipped_one(tmp_path: Path) -> None:
    import duckdb
    from warninglight.tracer import schema

    def run(clip: float | None, trace: Path) -> list[tuple]:
        _train_mlp(trace, clip)
        glob = schema.segment_glob(trace, "steps")
        return duckdb.sql(f"select grad_norm_preclip_l2, grad_norm_total_l2 from "
                          f"read_parquet('{glob}') order by step").fetchall()

    plain = run(None, tmp_path / "plain")
    assert all(pre == total for pre, total in plain)  # nothing touched the gradients after backward
    clipped = run(0.01, tmp_path / "clipped")
    assert clipped[0][0] is None  # the first step shows that the loop modifies gradients
    assert len(clipped) == 4
    for pre, total in clipped[1:]:  # what the optimizer got, and what backward left
        assert total == pytest.approx(0.01, rel=1e-4) and pre > 10 * total


def _counting_passes(monkeypatch: pytest.MonkeyPatch, field: str | None = None) -> list[int]:
    """An empty list whose last item, once a 0 is appended, counts the parameter probe's norm
    passes (into `field` only, if given): append a 0 to start a new count."""
    counts: list[int] = []
    norms_into = params.ParamProbe._norms_into

    def counted(self: params.ParamProbe, into: str, *args: object, **kwargs: object) -> object:
        if counts and (field is None or into == field):
            counts[-1] += 1
        return norms_into(self, into, *args, **kwargs)
    monkeypatch.setattr(params.ParamProbe, "_norms_into", counted)
    return counts


def _exact_total(model: torch.nn.Module) -> float:
    """The total L2 norm of the model's gradients, in float64."""
    return math.sqrt(sum(float(p.grad.double().square().sum()) for p in model.parameters()
                         if p.grad is not None))


def _preclip_norms(trace: Path) -> list[float | None]:
    """The trace's grad_norm_preclip_l2, step by step."""
    import duckdb
    from warninglight.tracer import schema

    glob = schema.segment_glob(trace, "steps")
    return [r[0] for r in duckdb.sql(f"select grad_norm_preclip_l2 from read_parquet('{glob}') order by step").fetchall()]


def _rescaling_loop(trace: Path, monkeypatch: pytest.MonkeyPatch, steps: int, modify: Any,
                    micro: int | list[int] = 1, frozen: bool = False, scale: Any = None
                    ) -> tuple[list[int], list[float], list[float | None]]:
    """Watched SGD steps of the zoo's MLP (`frozen`: its first layer's weight), over `micro`
    micro-batches each (a list: step by step), their loss times `scale(step)` if given, calling
    `modify(step, model)` between the last backward pass and the optimizer step: the pre-clip
    norm passes each step took, the exact pre-clip total norms (float64, read before `modify`)
    and the recorded ones."""
    kernels.available()  # the compiled passes from the first step: the gradients' sketch needs them
    taken = _counting_passes(monkeypatch, "pre_norms")  # one count a step, appended below
    torch.manual_seed(0)
    model = zoo.mlp()
    model[0].weight.requires_grad_(not frozen)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    data = zoo.batches(*zoo.teacher_classification(512), 16)
    want = []
    with watch(model, opt, trace, full_precision=True):
        for step in range(1, steps + 1):
            taken.append(0)
            m = micro if isinstance(micro, int) else micro[step - 1]
            for _ in range(m):
                _, x, y = next(data)
                (F.cross_entropy(model(x), y) * (scale(step) if scale else 1.0) / m).backward()
            want.append(_exact_total(model))
            modify(step, model)
            opt.step()
            opt.zero_grad()
    return taken, want, _preclip_norms(trace)


@pytest.mark.parametrize(("micro", "frozen"), [(1, False), (3, False), (1, True)])
def test_a_loop_that_only_rescales_its_gradients_takes_its_pre_clip_norms_from_the_step(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, micro: int, frozen: bool) -> None:
    # clipping by the total norm (active at every step here) only rescales the gradients: once
    # the exact passes of BACKWARD_COUNT_STEPS steps showed one factor, the backward end takes
    # the gradients' sketch alone, and the pre-clip norm is the optimizer step's over the factor
    # the sketch shows, float32 roundings from the exact one; the exact pass still runs every
    # EXACT_PRECLIP_EVERY-th step. Over micro-batches, at the step's last backward pass; with a
    # frozen weight (no gradient), over the others
    def clip(step: int, model: torch.nn.Module) -> None:
        torch.nn.utils.clip_grad_norm_(model.parameters(), 0.01)

    steps, learn = 40, params.BACKWARD_COUNT_STEPS
    taken, want, got = _rescaling_loop(tmp_path, monkeypatch, steps, clip, micro, frozen)
    exact = [s for s in range(learn + 2, steps + 1) if (s - 1) % params.EXACT_PRECLIP_EVERY == 0]
    assert taken[:learn + 1] == [0] + [1] * learn  # the first step shows that the loop changes them
    assert [s for s in range(learn + 2, steps + 1) if taken[s - 1]] == exact and len(exact) >= 3
    assert got[0] is None
    for s in range(2, steps + 1):
        assert got[s - 1] == pytest.approx(want[s - 1], rel=1e-6), s
    assert all(w > 10 * 0.01 for w in want)  # clipped at every step: the norm before, not after


def test_gradients_whose_clipping_total_overflows_keep_their_pre_clip_norm(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # an exploding step once the loop is known to rescale: gradients past float32's square root
    # of its range make clip_grad_norm_'s float32 total infinite and its factor zero, which no
    # sketch can divide out. The backward end sees their size in its sketch and takes the exact
    # pass, so the step the alarm is about records its pre-clip norm; the factor is learnt again
    def clip(step: int, model: torch.nn.Module) -> None:
        total = torch.nn.utils.clip_grad_norm_(model.parameters(), 0.01)
        assert math.isinf(total) == (step == 20)

    steps = 36
    taken, want, got = _rescaling_loop(tmp_path, monkeypatch, steps, clip,
                                       scale=lambda step: 1e21 if step == 20 else 1.0)
    assert 20 % params.EXACT_PRECLIP_EVERY != 1 and taken[18] == 0  # step 19 took the sketch
    assert taken[19] == 1 and got[19] == pytest.approx(want[19], rel=1e-6) and want[19] > 1e19
    learnt = 20 + params.BACKWARD_COUNT_STEPS  # the exact passes from step 21 to this one
    assert taken[20:learnt] == [1] * params.BACKWARD_COUNT_STEPS and taken[learnt] == 0
    for s in range(2, steps + 1):
        assert got[s - 1] == pytest.approx(want[s - 1], rel=1e-6), s


@pytest.mark.parametrize("change", ["mask from step 20", "clip by value"])
def test_a_change_other_than_one_factor_keeps_the_exact_pre_clip_pass(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, change: str) -> None:
    # a loop that changes the gradients value by value (a mask over half a layer, clipping each
    # value) is no rescaling: seen on the exact passes, they stay; seen only on the sketch (the
    # mask, once the loop had shown one factor), that step has no pre-clip norm and the exact
    # passes resume. No step records a pre-clip norm other than the exact one
    def modify(step: int, model: torch.nn.Module) -> None:
        if change == "clip by value":
            torch.nn.utils.clip_grad_value_(model.parameters(), 1e-3)
            return
        if step >= 20:
            model[0].weight.grad[: model[0].weight.shape[0] // 2] = 0.0
        torch.nn.utils.clip_grad_norm_(model.parameters(), 0.01)

    steps = 30
    taken, want, got = _rescaling_loop(tmp_path, monkeypatch, steps, modify)
    nulls = [s for s in range(1, steps + 1) if got[s - 1] is None]
    if change == "clip by value":
        assert taken == [0] + [1] * (steps - 1) and nulls == [1]
    else:
        assert taken[19] == 0 and nulls == [1, 20]  # the sketch, then the mask
        assert taken[20:] == [1] * (steps - 20)
    for s in range(2, steps + 1):
        assert got[s - 1] is None or got[s - 1] == pytest.approx(want[s - 1], rel=1e-6), s


@pytest.mark.parametrize("change", ["one value zeroed on some steps", "a NaN cleaned"])
def test_a_loop_that_writes_its_gradients_twice_keeps_the_exact_pre_clip_pass(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, change: str) -> None:
    # the clip rescales every gradient with one write; a loop that writes them again (one value
    # of a layer zeroed at steps 12-14, once the factor was learnt; a NaN the backward pass leaves
    # at steps 12-13, cleaned by nan_to_num_ at every step) changes values the sketch need not
    # read. A second write since the backward end keeps the exact pass: no step records a total
    # over a factor for gradients that were not only rescaled, and the NaN steps record NaN
    now = [0]

    def with_nan(g: torch.Tensor) -> torch.Tensor:
        if now[0] not in (12, 13):
            return g
        g = g.clone()
        g[7, 3] = math.nan
        return g

    def modify(step: int, model: torch.nn.Module) -> None:
        now[0] = step + 1  # the step of the next backward pass
        if change == "a NaN cleaned":
            if step == 1:
                model[0].weight.register_hook(with_nan)
            for p in model.parameters():
                p.grad.nan_to_num_(nan=0.0)
        elif step in (12, 13, 14):
            g = model[0].weight.grad.view(-1)
            g[g.abs().argmax()] = 0.0
        torch.nn.utils.clip_grad_norm_(model.parameters(), 0.01)

    steps = 20
    taken, want, got = _rescaling_loop(tmp_path, monkeypatch, steps, modify)
    for s in range(2, steps + 1):
        w, g = want[s - 1], got[s - 1]
        assert g is None or (math.isnan(w) and math.isnan(g)) or g == pytest.approx(w, rel=1e-6), s
    if change == "a NaN cleaned":  # two writes at every step: never the sketch
        assert taken == [0] + [1] * (steps - 1) and all(math.isnan(got[s - 1]) for s in (12, 13))
    else:  # the sketch at step 12 (null), then the exact passes
        assert taken[11] == 0 and got[11] is None and taken[12:14] == [1, 1]
        assert None not in got[12:14]


@pytest.mark.parametrize("write", ["into .data", "a new tensor"])
def test_gradients_changed_without_moving_a_version_counter_keep_the_exact_pre_clip_pass(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, write: str) -> None:
    # a rescale no version counter sees: through `.data` (the old clipping idiom), or a new
    # tensor that may take the freed one's id at the same version. The sketch the backward end
    # takes beside the counters sees the change: that step null, the exact passes from then on,
    # and never the optimizer's total passed off as the pre-clip norm
    def modify(step: int, model: torch.nn.Module) -> None:
        for p in model.parameters():
            if write == "into .data":
                p.grad.data.mul_(0.25)
            else:
                g = p.grad.detach()
                p.grad = None
                p.grad = g.mul(0.25)

    steps = 12
    taken, want, got = _rescaling_loop(tmp_path, monkeypatch, steps, modify)
    assert got[0] is None and None not in got[1:]
    for s in range(2, steps + 1):
        assert got[s - 1] == pytest.approx(want[s - 1], rel=1e-6), s


def test_a_large_gradient_the_clip_leaves_out_keeps_the_exact_pre_clip_pass(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # an embedding's gradient left out of the clip: no write, where the others have one. Its
    # norm is a BLAS dot product (a tensor of BLAS_FROM values or more), which the learning
    # steps leave out, and its sketch is all zero (rows no batch uses), so only its version
    # counter tells that it was not rescaled with the rest: every step keeps the exact pass
    monkeypatch.setattr(params, "BLAS_FROM", 1024 * 16)
    kernels.available()
    torch.manual_seed(0)

    class Model(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.emb = torch.nn.Embedding(1024, 16)  # BLAS_FROM values
            self.body = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 4))

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.body(self.emb(x).mean(1))

    model = Model()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    taken = _counting_passes(monkeypatch, "pre_norms")
    trace, want, steps = tmp_path / "t", [], 24
    with watch(model, opt, trace, full_precision=True) as rec:
        for _ in range(steps):
            taken.append(0)
            x, y = torch.randint(0, 64, (8, 4)), torch.randint(0, 4, (8,))
            F.cross_entropy(model(x), y).backward()
            want.append(_exact_total(model))
            torch.nn.utils.clip_grad_norm_(model.body.parameters(), 0.01)
            opt.step()
            opt.zero_grad()
        assert rec.params._blas_list  # the embedding's norm is BLAS's
    got = _preclip_norms(trace)
    assert taken == [0] + [1] * (steps - 1)
    for s in range(2, steps + 1):
        assert got[s - 1] == pytest.approx(want[s - 1], rel=1e-6), s


def test_accumulated_gradients_take_the_pre_clip_pass_once_a_step(tmp_path: Path,
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    # a loop that accumulates over m micro-batches and clips: the pre-clip norms are those the
    # last backward pass left, taken once a step, not after every micro-batch; a step with fewer
    # micro-batches than the steps before it has none (null), one with more still has them
    def clip(step: int, model: torch.nn.Module) -> None:
        torch.nn.utils.clip_grad_norm_(model.parameters(), 0.01)

    taken, want, got = _rescaling_loop(tmp_path, monkeypatch, 7, clip, [3, 3, 3, 3, 2, 4, 3])
    # step 1 learns that the loop clips; step 5 ends before the backward pass that would take
    # them (its 2nd, where the steps before made 3); from then on the 2nd and later take them
    assert taken == [0, 1, 1, 1, 0, 3, 2]
    assert got[0] is None and got[4] is None
    for i in (1, 2, 3, 5, 6):
        assert got[i] == pytest.approx(want[i], rel=1e-6)


@pytest.mark.filterwarnings("ignore:warninglight. no forward hook fired")  # --without forward says so
def test_the_overhead_bench_leaves_out_what_it_says(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """`bench/overhead.py --without`: the parts it names are really gone from the watched run (a
    bench that measured them anyway would print a cost nobody can remove)."""
    import sys

    import duckdb
    from warninglight.tracer import schema

    monkeypatch.syspath_prepend(str(Path(__file__).resolve().parents[1] / "bench"))
    monkeypatch.delitem(sys.modules, "overhead", raising=False)
    from overhead import leave_out
    from warninglight.tracer import recorder

    reductions = []
    assert kernels.available()  # loaded before the first run: every run takes the same passes

    def run(parts: set[str], trace: Path) -> list[tuple]:
        with monkeypatch.context() as m:
            leave_out(parts, m.setattr)
            reduce = recorder.Recorder._reduce_pending
            calls = [0]

            def counted(self: recorder.Recorder) -> None:
                calls[0] += 1
                reduce(self)
            m.setattr(recorder.Recorder, "_reduce_pending", counted)
            _train_mlp(trace, steps=20)
        reductions.append(calls[0])
        glob = schema.segment_glob(trace, "health")
        return duckdb.sql(f"select grad_norm_l2, weight_norm_l2, out_rms from read_parquet('{glob}') "
                          "where grad_norm_l2 is not null order by step, component").fetchall()

    whole = run(set(), tmp_path / "whole")
    # a Linear's weight and bias: each pass left out writes 1 per tensor, sqrt(2) per component
    assert whole and all(g != pytest.approx(2 ** 0.5) and rms is not None for g, _, rms in whole)
    without = run({"all"}, tmp_path / "all")
    assert len(without) == len(whole)
    assert all(g == pytest.approx(2 ** 0.5) and w == pytest.approx(2 ** 0.5) and rms is None
               for g, w, rms in without)
    assert run({"work"}, tmp_path / "work") == []  # hooks that do nothing record nothing
    assert run(set(), tmp_path / "again") == whole  # the patches are undone
    # and the recorder reduces as often as the whole one does, not at every step
    assert reductions[0] == reductions[1] == reductions[3] < 20
    # the reductions left out: the passes and copies still run, but no statistic is derived
    # from them (the rows keep the buffer's NaN), and the queued steps do not pile up
    reduced = run({"reduce"}, tmp_path / "reduce")
    assert len(reduced) == len(whole) and all(math.isnan(v) for row in reduced for v in row)
    assert reductions[4] == reductions[0]


def test_the_interleaved_bench_reports_a_run_shorter_than_its_ten_parts(
        monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    """`bench/overhead.py --interleave N` with N under 10: the spread is over N runs of one step,
    not a division by zero after every step was timed."""
    import sys

    monkeypatch.syspath_prepend(str(Path(__file__).resolve().parents[1] / "bench"))
    monkeypatch.delitem(sys.modules, "overhead", raising=False)
    from cases import adamw_loop, mlp_case
    from overhead import measure_interleaved

    measure_interleaved("MLP", lambda: adamw_loop(mlp_case(batch=8)), 3)
    out = capsys.readouterr().out
    assert "3 steps each way" in out and "ratio of the summed times per run of 1 steps" in out
    assert "3 pairs" in out


def test_the_phase_bench_times_every_phase_of_two_copies_trained_alike(
        monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    """`bench/overhead_breakdown.py --phases`: every phase of the step is printed for both copies,
    and the plain and the watched copy saw the same batches (their weights end equal: the
    recorder only reads)."""
    import sys

    monkeypatch.syspath_prepend(str(Path(__file__).resolve().parents[1] / "bench"))
    monkeypatch.delitem(sys.modules, "overhead_breakdown", raising=False)
    from overhead_breakdown import _PHASES, phases

    plain, watched = phases(3)
    lines = capsys.readouterr().out.splitlines()
    assert "3 steps each way, alternated step by step" in lines[0]
    for name in (*_PHASES, "the step"):
        row = next(line for line in lines if line.startswith(name))
        assert float(row[len(name):].split()[1]) > 0  # the watched copy's ms
    for a, b in zip(plain.parameters(), watched.parameters(), strict=True):
        assert torch.equal(a, b)


def test_the_phase_bench_runs_a_recorder_without_a_saving_beside_the_whole_one(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    """`bench/overhead_breakdown.py --phases --against PART`: three copies trained alike, each
    phase's cost printed for both recorders; the switch turns that saving off on its recorder
    only (12 clipped steps of the nanoGPT layout: the other learns the factor and copies in one
    call)."""
    import sys

    monkeypatch.syspath_prepend(str(Path(__file__).resolve().parents[1] / "bench"))
    monkeypatch.delitem(sys.modules, "overhead_breakdown", raising=False)
    from nanogpt import nanogpt_case
    from overhead_breakdown import _AGAINST, _PHASES, phases

    models = phases(3, "copies")
    lines = capsys.readouterr().out.splitlines()
    assert "one saving off (`copies`): the forward samples copied one by one" in lines[1]
    for name in (*_PHASES, "the step"):
        assert len(next(line for line in lines if line.startswith(name))[len(name):].split()) == 3
    for ps in zip(*(m.parameters() for m in models), strict=True):
        assert all(torch.equal(ps[0], p) for p in ps[1:])
    kernels.available()
    for part, off in _AGAINST.items():
        recs = []
        for i, switched in enumerate((False, True)):
            torch.manual_seed(0)
            model, opt, step = nanogpt_case()
            rec = watch(model, opt, tmp_path / f"{part}{i}")
            if switched:
                off[1](rec)
            for _ in range(12):
                step()
            recs.append(rec)
            rec.close()
        saved = [r.params._by_factor if part == "factor" else r.fwd._copies is not None for r in recs]
        assert saved == [True, False], part


def test_the_evaluation_bench_alternates_evaluations_and_refuses_a_case_without_one(
        monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    """`bench/overhead.py --evaluations N`: train.py's estimate_loss, a batch of each split, on
    both copies; a case with no evaluation is named in a one-line exit."""
    import sys

    monkeypatch.syspath_prepend(str(Path(__file__).resolve().parents[1] / "bench"))
    monkeypatch.delitem(sys.modules, "overhead", raising=False)
    from cases import adamw_loop, mlp_case
    from nanogpt import nanogpt_case
    from overhead import measure_evaluations

    def tiny() -> Any:
        return nanogpt_case(batch=2, n_layer=1, n_embd=32, block=16, eval_iters=1)

    measure_evaluations("tiny nanoGPT", tiny, 3)
    out = capsys.readouterr().out
    assert "(3 each way, alternated)" in out and "ratio of the summed evaluation times" in out
    with pytest.raises(SystemExit, match="the case 'MLP' has no evaluation"):
        measure_evaluations("MLP", lambda: adamw_loop(mlp_case(batch=8)), 3)


def test_the_gpu_check_runs_from_the_checkout_without_the_engines_packages(tmp_path: Path) -> None:
    """`bench/gpu_check.sh` is what a machine with a GPU and no network runs: it must import the
    recorder from the checkout, with polars, duckdb and numba absent and nothing installed (here
    `--tiny`, on CPU: its sync test is skipped, its bench trains a tiny GPT)."""
    import os
    import subprocess
    import sys

    site = tmp_path / "site"
    site.mkdir()
    (site / "sitecustomize.py").write_text(
        "import sys\n"
        "for name in ('polars', 'duckdb', 'numba'):\n"
        "    sys.modules[name] = None\n"
        "sys.meta_path[:] = [f for f in sys.meta_path if 'editable' not in repr(f).lower()]\n")
    env = {**os.environ, "PYTHON": sys.executable, "PYTHONPATH": str(site), "OUT": str(tmp_path / "out")}
    root = Path(__file__).resolve().parents[1]
    done = subprocess.run(["bash", str(root / "bench" / "gpu_check.sh"), "--tiny", "--skip-compile"],
                          env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    out = tmp_path / "out"
    # collected, and run where CUDA is (else skipped)
    assert ("1 passed" if torch.cuda.is_available() else "1 skipped") in (out / "sync-test.txt").read_text()
    bench = (out / "gpu-overhead.txt").read_text()
    assert "ratio with/without" in bench and "0 steps dropped" in bench
    assert "sync test: exit 0; gpu_overhead.py: exit 0" in (out / "machine.txt").read_text()
