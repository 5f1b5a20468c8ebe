"""The `watch` API contract: forms of the call, options, errors, and a real two-rank gloo run."""

from __future__ import annotations

import json
import os
import re
import socket
import warnings
from pathlib import Path
from typing import Any

import duckdb
import pyarrow.parquet as pq
import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F
from warninglight.lab import zoo
from warninglight.tracer import Recorder, RecorderConfig, schema, watch


def rows(trace: Path, table: str, sql: str) -> list[tuple]:
    t = f"read_parquet('{schema.segment_glob(trace, table)}', hive_partitioning=true)"
    return duckdb.sql(sql.replace(" from t", f" from {t}")).fetchall()


def test_without_an_optimizer_rec_step_ends_each_step(tmp_path: Path) -> None:
    model = zoo.mlp()
    rec = watch(model, tmp_path)  # the path may come second when there is no optimizer
    assert isinstance(rec, Recorder) and rec.step_count == 0
    for _ in range(3):
        model(torch.randn(8, 32)).sum().backward()
        with torch.no_grad():
            for p in model.parameters():
                p -= 0.1 * p.grad
                p.grad = None
        rec.step()
    rec.close()
    rec.close()  # idempotent
    assert rec.step_count == 3
    ratio = rows(tmp_path, "health", "select step, update_ratio from t where component = '0' order by step")
    assert [s for s, _ in ratio] == [1, 2, 3] and all(r > 0 for _, r in ratio)


def test_rec_step_with_an_optimizer_warns_and_does_not_double_count(tmp_path: Path) -> None:
    model = zoo.mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with watch(model, opt, tmp_path) as rec:
        model(torch.randn(8, 32)).sum().backward()
        opt.step()
        with pytest.warns(RuntimeWarning, match="rec.step"):
            rec.step()
    assert rec.step_count == 1


def test_options_reach_the_trace(tmp_path: Path) -> None:
    model = zoo.mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with watch(model, opt, tmp_path, heads=["4"], rank=3, world_size=8, run_id="exp-7",
               start_step=100, lr_schedule="cosine") as rec:
        model(torch.randn(8, 32)).sum().backward()
        opt.step()
    assert rec.step_count == 101 and rec.rank == 3
    manifest = json.loads(schema.manifest_path(tmp_path, 3).read_text())
    assert (manifest["run_id"], manifest["world_size"], manifest["config"]["lr_schedule"]) == ("exp-7", 8, "cosine")
    roles = dict(rows(tmp_path, "components", "select component, role from t"))
    assert roles["4"] == "head" and roles["6"] == "param"
    assert rows(tmp_path, "health", "select distinct step, rank from t") == [(101, 3)]


def test_a_misspelt_option_is_stored_but_named(tmp_path: Path) -> None:
    model = zoo.mlp()
    with pytest.warns(UserWarning, match="did you mean sample_size="):
        rec = watch(model, path=tmp_path, sampel_size=8)
    rec.close()
    assert json.loads(schema.manifest_path(tmp_path, 0).read_text())["config"]["sampel_size"] == 8
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a config key unlike any option says nothing
        watch(model, path=tmp_path / "b", lr_schedule="cosine").close()


@pytest.mark.parametrize("kwargs, match", [
    ({"heads": ["nope"]}, "heads=.*nope"),
    ({"flush_every_steps": 0}, "flush_every_steps"),
])
def test_bad_options_are_named_errors(tmp_path: Path, kwargs: dict, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        watch(zoo.mlp(), None, tmp_path, **kwargs)
    with pytest.raises(ValueError, match="trace directory"):
        watch(zoo.mlp())
    model = zoo.mlp()
    with pytest.raises(ValueError, match="the optimizer comes second"):
        watch(model, tmp_path, torch.optim.SGD(model.parameters(), lr=0.1))


def _swapped() -> tuple:
    model = zoo.mlp()
    return torch.optim.SGD(model.parameters(), lr=0.1), model


@pytest.mark.parametrize("call, error, message", [
    (lambda t: ("runs/x", None, t), TypeError,
     "watch(model=...) expects the torch.nn.Module to record, got str 'runs/x'; "
     "call watch(model, optimizer, 'runs/exp1')"),
    (lambda t: (None, None, t), TypeError,
     "watch(model=...) expects the torch.nn.Module to record, got None"),
    (lambda t: (*_swapped(), t), TypeError,
     "watch(model=...) got a SGD, which looks like the optimizer: pass the model first, "
     "watch(model, optimizer, 'runs/exp1')"),
    (lambda t: (zoo.mlp(), zoo.mlp(), t), TypeError,
     "watch(optimizer=...) got a Sequential, which looks like the model: the model and the "
     "optimizer are swapped"),
    (lambda t: (zoo.mlp(), [1, 2], t), TypeError,
     "watch(optimizer=...) expects a torch.optim.Optimizer (or None, then steps end on "
     "rec.step()), got a list"),
    (lambda t: (zoo.mlp(), None, 7), TypeError,
     "watch(path=...) expects the trace directory as a str or os.PathLike, got 7"),
    (lambda t: (zoo.mlp(), None, t / "file.txt"), ValueError,
     "that is an existing file, and a trace is a directory"),
])
def test_a_wrong_argument_is_named_with_what_it_got(tmp_path: Path, call, error: type,
                                                     message: str) -> None:
    (tmp_path / "file.txt").write_text("not a trace")
    model, opt, path = call(tmp_path)
    for start in (watch, Recorder):  # watch() and the class give the same error
        with pytest.raises(error, match=re.escape(message)) as caught:
            start(model, opt, path)
        assert caught.value.__cause__ is None and caught.value.__context__ is None
    assert not (tmp_path / "manifest").exists()  # refused before anything was written


def _steps(model: torch.nn.Module, opt: torch.optim.Optimizer, n: int) -> None:
    for _ in range(n):
        model(torch.randn(8, 32)).sum().backward()
        opt.step()
        opt.zero_grad()


def _manifest_config(trace: Path) -> dict:
    return json.loads(schema.manifest_path(trace, 0).read_text())["config"]


def _segment_steps(trace: Path) -> list[list[int]]:
    """The steps of each segment of the steps table, in the order they were written."""
    files = sorted(Path(trace).glob("steps/rank=0/*/*.parquet"))
    return [pq.read_table(f, columns=["step"]).column("step").to_pylist() for f in files]


def test_a_config_object_records_what_its_keywords_record(tmp_path: Path) -> None:
    def run(trace: Path, **options: object) -> dict:
        torch.manual_seed(0)
        model = zoo.mlp()
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        with watch(model, opt, trace, **options):
            _steps(model, opt, 5)
        return _manifest_config(trace)

    by_keywords = run(tmp_path / "kw", sample_size=8, flush_every_steps=2, heads=["4"],
                      lr_schedule="cosine")
    by_config = run(tmp_path / "cfg", config=RecorderConfig(
        sample_size=8, flush_every_steps=2, heads=("4",), run_config={"lr_schedule": "cosine"}))
    assert by_config == by_keywords
    assert (by_config["sample_size"], by_config["heads"], by_config["lr_schedule"]) == (8, ["4"], "cosine")
    assert _segment_steps(tmp_path / "cfg") == _segment_steps(tmp_path / "kw") == [[1, 2], [3, 4], [5]]
    heads = rows(tmp_path / "cfg", "components", "select component from t where role = 'head'")
    assert heads == [("4",)]


def test_keywords_beside_a_config_override_its_fields(tmp_path: Path) -> None:
    base = RecorderConfig(sample_size=8, flush_every_steps=5, run_config={"team": "a"})
    model = zoo.mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with watch(model, opt, tmp_path, config=base, flush_every_steps=3, dataset="x") as rec:
        _steps(model, opt, 7)
    config = _manifest_config(tmp_path)
    assert (config["sample_size"], config["flush_every_steps"]) == (8, 3)
    assert (config["team"], config["dataset"]) == ("a", "x")  # run config: the two merged
    assert rec.config.flush_every_steps == 3 and base.flush_every_steps == 5  # the base is unchanged
    # a segment every 3 steps (each flush keeps its last step back for logs that come late)
    assert _segment_steps(tmp_path) == [[1, 2, 3], [4, 5, 6], [7]]


def test_live_alarms_flush_sooner_unless_the_cadence_is_given() -> None:
    assert RecorderConfig().flush_cadence() == (100, 30.0)
    assert RecorderConfig(alarms=["jsonl:a.jsonl"]).flush_cadence() == (10, 2.0)
    assert RecorderConfig(on_alarm=print).flush_cadence() == (10, 2.0)
    assert RecorderConfig(on_alarm=print, flush_every_steps=50).flush_cadence() == (50, 2.0)
    assert RecorderConfig(alarms=[], flush_every_s=7).flush_cadence() == (100, 7)


@pytest.mark.parametrize("options, error, message", [
    ({"sample_size": 0}, ValueError, "sample_size must be >= 1, got 0"),
    ({"sketch_size": 2.5}, TypeError, "sketch_size must be an int >= 1, got 2.5"),
    ({"flush_every_steps": 0}, ValueError, "flush_every_steps must be >= 1, got 0"),
    ({"flush_every_s": -1}, ValueError, "flush_every_s must be > 0, got -1"),
    ({"flush_every_s": "30"}, TypeError, "flush_every_s must be a number of seconds, got '30'"),
    ({"start_step": -1}, ValueError, "start_step must be >= 0, got -1"),
    ({"rank": 2, "world_size": 2}, ValueError, "rank must be < world_size, got rank=2 with world_size=2"),
    ({"hooks_under_compile": "fast"}, ValueError, "hooks_under_compile='fast'; expected 'graph'"),
    ({"replicas": "yes"}, TypeError, "replicas must be True, False or None, got 'yes'"),
    ({"on_alarm": "print"}, TypeError, "on_alarm must be callable"),
    ({"heads": [4]}, TypeError, "heads must be module paths (strings) such as 'lm_head', got 4"),
    ({"run_config": {"sample_size": 8}}, ValueError,
     "run_config['sample_size'] would hide the recorder's own setting"),
])
def test_a_bad_option_is_named_with_its_value(tmp_path: Path, options: dict, error: type,
                                               message: str) -> None:
    with pytest.raises(error, match=re.escape(message)):
        RecorderConfig(**options)
    with pytest.raises(error, match=re.escape(message)):  # the same error from watch's keywords
        watch(zoo.mlp(), None, tmp_path, **options)
    assert not tmp_path.joinpath("manifest").exists()  # refused before anything was written


def test_recorder_takes_a_config_keywords_or_its_run_config_mapping(tmp_path: Path) -> None:
    model = zoo.mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with Recorder(model, opt, tmp_path, config={"lr_schedule": "cosine"}, sample_size=8):
        _steps(model, opt, 1)
    config = _manifest_config(tmp_path)
    assert (config["lr_schedule"], config["sample_size"]) == ("cosine", 8)
    with pytest.raises(TypeError, match="'sampel_size' is not a recorder option; did you mean sample_size="):
        Recorder(model, opt, tmp_path / "b", sampel_size=8)
    with pytest.raises(TypeError, match="config must be a RecorderConfig, got str"):
        watch(model, opt, tmp_path / "c", config="fast")


def test_closing_restores_the_previous_sigterm_handler(tmp_path: Path) -> None:
    import signal

    before = signal.getsignal(signal.SIGTERM)
    rec = watch(zoo.mlp(), tmp_path)
    assert signal.getsignal(signal.SIGTERM) != before
    rec.close()
    assert signal.getsignal(signal.SIGTERM) == before


def test_a_recorder_closed_off_the_main_thread_leaves_a_handler_that_passes_sigterm_on(tmp_path: Path) -> None:
    # only the main thread sets handlers: the one left behind holds the recorder weakly (its
    # model can be freed), hands a SIGTERM to the handler before it, and the next recorder takes
    # it out of the chain
    import gc
    import signal
    import threading
    import weakref

    got: list[int] = []
    before = signal.signal(signal.SIGTERM, lambda signum, frame: got.append(signum))
    try:
        model = zoo.mlp()
        rec = watch(model, tmp_path / "a")
        gone = weakref.ref(model)
        worker = threading.Thread(target=rec.close)
        worker.start()
        worker.join()
        left = signal.getsignal(signal.SIGTERM)
        assert rec._closed and callable(left) and left is not got.append
        del rec, model, worker
        gc.collect()
        assert gone() is None  # the handler left behind keeps no model alive
        left(signal.SIGTERM, None)
        assert got == [signal.SIGTERM]
        second = watch(zoo.mlp(), tmp_path / "b")
        assert second._prev_sigterm is not left and second._prev_sigterm(signal.SIGTERM, None) is None
        assert got == [signal.SIGTERM] * 2  # the test's own handler, with nothing between
        second.close()
        assert signal.getsignal(signal.SIGTERM) is second._prev_sigterm
        # closed in another order than made: the handler before them both comes back at the end
        one, two = watch(zoo.mlp(), tmp_path / "c"), watch(zoo.mlp(), tmp_path / "d")
        one.close()
        assert signal.getsignal(signal.SIGTERM) is two._sigterm_handler  # the open one stays
        two.close()
        assert signal.getsignal(signal.SIGTERM) is second._prev_sigterm
    finally:
        signal.signal(signal.SIGTERM, before)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _rank_main(rank: int, world: int, port: int, trace: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    torch.set_num_threads(1)
    torch.manual_seed(0)
    model = torch.nn.parallel.DistributedDataParallel(zoo.mlp())
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    with warnings.catch_warnings(), watch(model, opt, trace, flush_every_steps=2):
        warnings.simplefilter("ignore")
        for _, (_, x, y) in zip(range(4), zoo.batches(*zoo.teacher_classification(256), 16, seed=rank), strict=False):
            F.cross_entropy(model(x), y).backward()
            opt.step()
            opt.zero_grad()
    dist.destroy_process_group()


def test_two_gloo_ranks_write_their_own_partitions(tmp_path: Path) -> None:
    mp.spawn(_rank_main, args=(2, _free_port(), str(tmp_path)), nprocs=2, join=True)
    assert rows(tmp_path, "steps", "select rank, count(*) from t group by rank order by rank") == [(0, 4), (1, 4)]
    for rank in (0, 1):
        manifest = json.loads(schema.manifest_path(tmp_path, rank).read_text())
        assert (manifest["rank"], manifest["world_size"]) == (rank, 2)
    # different data per rank, same all-reduced gradients: equal weights, different activations
    w = rows(tmp_path, "health", "select count(distinct weight_norm_l2), count(distinct out_rms) "
                                 "from t where component = '0' and step = 4")
    assert w == [(1, 2)]


class _TensorParallelOut(torch.nn.Module):
    """A layer whose output is a DTensor (a tensor-parallel layer with use_local_output=False)."""

    def __init__(self, mesh: Any) -> None:
        super().__init__()
        self.mesh, self.weight = mesh, torch.nn.Parameter(torch.randn(16, 32) / 6)

    def forward(self, x: torch.Tensor) -> Any:
        from torch.distributed.tensor import DTensor, Replicate

        return DTensor.from_local(x @ self.weight.t(), self.mesh, [Replicate()])


def _dtensor_main(rank: int, port: int, trace: str) -> None:
    from torch.distributed.device_mesh import init_device_mesh

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=0, world_size=1)
    torch.manual_seed(0)
    layer = _TensorParallelOut(init_device_mesh("cpu", (1,)))
    model = torch.nn.ModuleDict({"tp": layer, "head": torch.nn.Linear(16, 10)})
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    with watch(model, opt, trace):
        for _, (_, x, y) in zip(range(3), zoo.batches(*zoo.teacher_classification(256), 16), strict=False):
            F.cross_entropy(model["head"](layer(x).to_local()), y).backward()
            opt.step()
            opt.zero_grad()
    dist.destroy_process_group()


def test_a_component_whose_output_is_a_dtensor_is_recorded_from_its_local_part(tmp_path: Path) -> None:
    # the staging copy met a DTensor among plain tensors and failed: every step went unrecorded
    mp.spawn(_dtensor_main, args=(_free_port(), str(tmp_path)), nprocs=1, join=True)
    assert rows(tmp_path, "steps", "select count(*) from t") == [(3,)]
    assert rows(tmp_path, "health", "select component, count(out_rms) from t group by component "
                                    "order by component") == [("head", 3), ("tp", 3)]


class _SparseOut(torch.nn.Linear):
    """A layer whose output no probe can subsample (a sparse tensor)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return super().forward(x).to_sparse()


class _Dense(torch.nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x.to_dense()


def test_a_failing_probe_warns_once_and_training_is_unchanged(tmp_path: Path) -> None:
    def run(trace: Path | None) -> list[torch.Tensor]:
        torch.manual_seed(0)
        model = torch.nn.Sequential(_SparseOut(8, 8), _Dense(), torch.nn.ReLU(), torch.nn.Linear(8, 2))
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        rec = watch(model, opt, trace) if trace else None
        for _ in range(3):
            model(torch.randn(4, 8)).sum().backward()
            opt.step()
            opt.zero_grad()
        if rec:
            rec.close()
        return [p.detach().clone() for p in model.parameters()]

    plain = run(None)
    with pytest.warns(RuntimeWarning, match="probe failed"):
        watched = run(tmp_path)
    assert all(torch.equal(a, b) for a, b in zip(plain, watched, strict=True))
    assert rows(tmp_path, "health", "select count(*) filter (where out_rms is not null) from t "
                                    "where component = '2'") == [(3,)]  # the ReLU was still seen
    assert rows(tmp_path, "steps", "select count(*) from t") == [(3,)]


def test_training_in_eval_mode_says_so(tmp_path: Path) -> None:
    model = zoo.mlp().eval()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with watch(model, opt, tmp_path), pytest.warns(RuntimeWarning, match=r"eval\(\) mode.*model.train\(\)"):
        model(torch.randn(8, 32)).sum().backward()
        opt.step()


def test_a_bad_logged_value_or_batch_id_is_dropped_not_the_segment(tmp_path: Path) -> None:
    model = zoo.mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.warns(RuntimeWarning, match=r"rec.log\(lr=...\) ignored.*list"), \
            watch(model, opt, tmp_path) as rec:
        for _ in range(3):
            loss = model(torch.randn(8, 32)).pow(2).mean()
            loss.backward()
            opt.step()
            rec.log(loss=loss, lr=[0.1])  # a scheduler's get_last_lr() is a list
            rec.batch(7)                  # one batch index
            rec.batch(["a"])              # not an int: ignored
    assert rows(tmp_path, "steps", "select step, batch_ids from t order by step") == [
        (1, [7]), (2, [7]), (3, [7])]
    assert len(rows(tmp_path, "health", "select * from t where component = '0'")) == 3


def test_a_segment_that_cannot_be_built_is_counted_as_dropped(tmp_path: Path) -> None:
    # a logged tensor that cannot be read back (a meta tensor holds no value) fails its segment
    # on the writer thread, which turns the steps into rows: those steps are lost, counted and
    # said; the segments before and after are written
    torch.manual_seed(0)
    model = zoo.mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    data = zoo.batches(*zoo.teacher_classification(256), 32)
    with (pytest.warns(RuntimeWarning, match="trace writing failed.*meta"),
          watch(model, opt, tmp_path, flush_every_steps=3) as rec):
        for step in range(1, 13):
            _, x, y = next(data)
            torch.nn.functional.cross_entropy(model(x), y).backward()
            opt.step()
            opt.zero_grad()
            if step == 5:
                rec.log(loss=torch.tensor(1.0, device="meta"))
    written = [s for (s,) in rows(tmp_path, "steps", "select step from t order by step")]
    assert 5 not in written and {1, 12} <= set(written)
    assert rec.dropped_steps == 12 - len(written)  # every lost step is counted, none silently
