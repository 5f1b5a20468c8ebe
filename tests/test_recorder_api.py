"""The `watch` API contract: forms of the call, options, errors, and a real two-rank gloo run."""

from __future__ import annotations

import json
import os
import socket
import warnings
from pathlib import Path

import duckdb
import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F
from warninglight.lab import zoo
from warninglight.tracer import Recorder, schema, watch


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


def test_closing_restores_the_previous_sigterm_handler(tmp_path: Path) -> None:
    import signal

    before = signal.getsignal(signal.SIGTERM)
    rec = watch(zoo.mlp(), tmp_path)
    assert signal.getsignal(signal.SIGTERM) != before
    rec.close()
    assert signal.getsignal(signal.SIGTERM) == before


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
                                 "from t where component = 'module.0' and step = 4")
    assert w == [(1, 2)]


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


def test_a_segment_that_cannot_be_built_is_counted_as_dropped(tmp_path: Path,
                                                                monkeypatch: pytest.MonkeyPatch) -> None:
    from warninglight.tracer import buffer

    real = buffer._scalar_rows
    calls = {"n": 0}

    def fail_second_segment(recs: list, logs: list) -> dict:
        calls["n"] += 1
        if calls["n"] == 2:  # an unexpected internal error while turning steps into rows
            raise RuntimeError("simulated row-building bug")
        return real(recs, logs)

    monkeypatch.setattr(buffer, "_scalar_rows", fail_second_segment)
    torch.manual_seed(0)
    model = zoo.mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    data = zoo.batches(*zoo.teacher_classification(256), 32)
    with (pytest.warns(RuntimeWarning, match="simulated row-building bug"),
          watch(model, opt, tmp_path, flush_every_steps=3) as rec):
        for _ in range(12):
            _, x, y = next(data)
            torch.nn.functional.cross_entropy(model(x), y).backward()
            opt.step()
            opt.zero_grad()
    written = rows(tmp_path, "steps", "select count(*) from t")[0][0]
    assert 0 < written < 12
    assert rec.dropped_steps == 12 - written  # every lost step is counted, none silently
