"""Per-rank evidence in the recorder: exact weight checksums, the replicas table, rank comparison."""

from __future__ import annotations

import warnings
from pathlib import Path

import duckdb
import numpy as np
import pytest
import torch
import torch.nn.functional as F
from warninglight.forensics import analyze, open_trace
from warninglight.forensics.explaining.ranks import findings
from warninglight.lab import zoo
from warninglight.tracer import kernels, params, schema, watch
from warninglight.tracer.components import discover
from warninglight.tracer.replicas import FWD_CHECK_EVERY, ReplicaProbe


def _checksums(model: torch.nn.Module) -> dict[str, int]:
    """{component: weight checksum} as the replicas table gets it at the end of a step."""
    probe = ReplicaProbe(discover(model), model, 2)
    probe.end_step(1)
    rows = probe.take(np.array([1]))
    return dict(zip(rows["component"], rows["weight_checksum"], strict=True))


def test_checksum_is_equal_on_identical_weights_and_changes_with_one_flipped_bit() -> None:
    torch.manual_seed(0)
    a = zoo.mlp()
    b = zoo.mlp()
    b.load_state_dict(a.state_dict())
    assert _checksums(a) == _checksums(b)
    with torch.no_grad():  # flip the lowest mantissa bit of one weight of layer "2"
        w = b[2].weight.view(-1).view(torch.int32)
        w[17] ^= 1
    ca, cb = _checksums(a), _checksums(b)
    assert [c for c in ca if ca[c] != cb[c]] == ["2"]
    assert abs(cb["2"] - ca["2"]) == 1  # the sum moved by exactly that bit


def test_the_compiled_pass_and_the_eager_ops_give_the_same_checksums() -> None:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(300, 70), torch.nn.Linear(70, 5).double())
    probe = ReplicaProbe(discover(model), model, 2)
    if probe._addrs is None:  # no compiled kernels here: the eager ops are the only path
        return
    compiled = probe.checksums()
    half = np.array([True, False, False, True])  # one weight and one bias
    compiled_half = probe.checksums(half)
    probe._addrs = None  # the eager ops from here
    assert probe.checksums().tolist() == compiled.tolist()
    assert probe.checksums(half).tolist() == compiled_half.tolist()
    assert 0 < compiled_half[0] < compiled[0] and compiled_half[1] < compiled[1]


def test_the_norm_misses_a_low_bit_flip_the_checksum_catches() -> None:
    torch.manual_seed(0)
    w = torch.randn(64, 64)
    v = w.clone()
    v.view(-1).view(torch.int32)[5] ^= 1
    assert torch.linalg.vector_norm(w) == torch.linalg.vector_norm(v)  # float32 norm: unchanged
    assert w.view(torch.int32).sum(dtype=torch.int64) != v.view(torch.int32).sum(dtype=torch.int64)


def _train(trace: Path, rank: int, flip_at: int | None, steps: int = 30, unseen: bool = False) -> None:
    """One rank of a pretend data-parallel run: same seed and data on every rank, no process group.
    At step `flip_at` a low mantissa bit of one weight of layer "4" flips before the forward,
    through the parameter (its version counter moves) or, `unseen`, through `.data` (none does)."""
    torch.manual_seed(0)
    model = zoo.mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    data = zoo.batches(*zoo.teacher_classification(512), 16, seed=0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with watch(model, opt, trace, rank=rank, world_size=2, flush_every_steps=10) as rec:
            for step in range(1, steps + 1):
                ids, x, y = next(data)
                if step == flip_at:
                    with torch.no_grad():
                        w = model[4].weight.data if unseen else model[4].weight
                        w.view(-1).view(torch.int32)[3] ^= 1 << 3  # a low mantissa bit
                F.cross_entropy(model(x), y).backward()
                opt.step()
                opt.zero_grad()
                rec.batch(ids)
                if rank == 0 and step % 10 == 0:
                    rec.checkpoint(str(trace / f"step-{step}.pt"))


def test_replicas_table_without_ddp_has_checksums_and_says_why_no_local_norms(tmp_path: Path) -> None:
    _train(tmp_path, 0, None, steps=5)
    rows = duckdb.sql(f"""select count(*), count(weight_checksum), count(local_grad_norm_l2),
        bool_or(grad_allreduced) from read_parquet('{schema.segment_glob(tmp_path, "replicas")}')""").fetchall()
    assert rows == [(5 * 4, 20, 0, False)]  # 5 steps x 4 parameter-owning layers of the mlp
    trace = open_trace(tmp_path)
    try:
        details = [d for (d,) in trace.con.execute("select detail from events where kind = 'warning'").fetchall()]
    finally:
        trace.close()
    fix = "pass the DDP wrapper, or a module it wraps, to watch()"
    assert sum(fix in d for d in details) == 1  # said once, at the first forward, naming the fix
    assert sum(fix in w for w in analyze(tmp_path).to_dict()["warnings"]) == 1


def test_a_single_rank_run_records_no_replicas_table(tmp_path: Path) -> None:
    model = zoo.mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    with watch(model, opt, tmp_path):
        model(torch.randn(8, 32)).sum().backward()
        opt.step()
    assert not (tmp_path / "replicas").exists()


def test_identical_replicas_are_healthy_and_a_flipped_bit_on_rank_1_is_named(tmp_path: Path) -> None:
    same, flipped = tmp_path / "same", tmp_path / "flipped"
    for rank in (0, 1):
        _train(same, rank, None)
    _train(flipped, 0, None)
    _train(flipped, 1, 17)
    trace = open_trace(same)
    try:
        assert findings(trace) == []
    finally:
        trace.close()
    d = analyze(flipped).to_dict()
    root = d["root"]
    # one bit of one weight: no norm moved, only the checksum (and the drift) says so
    assert (root["attributed_to"], root["rank"], root["onset_step"], root["scope"]) == ("4", 1, 17, "replicas")
    assert root["ranks_disagree"] is True and root["ranks"] == [1]
    assert d["rollback"]["checkpoint_step"] == 10
    assert any(a["metric"] == "weight_checksum" and a["rank"] == 1 for a in d["alarms"])
    fwd = _fwd_checks(same)
    # the forward checksum is taken on every component at least every FWD_CHECK_EVERY steps,
    # on a share of them each step (not all at once), and equals the last step's checksum
    for (rank, comp), rows in fwd.items():
        taken = [s for s, f, _ in rows if f is not None]
        assert taken[0] == 1 and np.diff([*taken, 31]).max() <= FWD_CHECK_EVERY, (rank, comp, taken)
        assert all(f == prev for (s, f, _), (_, _, prev) in zip(rows[1:], rows, strict=False) if f is not None)
    per_step = [sum(rows[i][1] is not None for rows in fwd.values()) for i in range(1, 30)]
    assert 0 < max(per_step) < len(fwd)
    # on the rank whose weight was written, at that step: taken (its version counter moved) and
    # different from the checksum after the step before
    _, f17, _ = _fwd_checks(flipped)[(1, "4")][16]
    _, _, after16 = _fwd_checks(flipped)[(1, "4")][15]
    assert f17 is not None and f17 != after16


def _fwd_checks(trace: Path) -> dict[tuple[int, str], list[tuple[int, int | None, int]]]:
    """{(rank, component): [(step, weight_checksum_fwd, weight_checksum)] in step order}."""
    rows = duckdb.sql(f"""select rank, component, step, weight_checksum_fwd, weight_checksum
        from read_parquet('{schema.segment_glob(trace, "replicas")}', hive_partitioning = true)
        order by step""").fetchall()
    out: dict[tuple[int, str], list[tuple[int, int | None, int]]] = {}
    for rank, comp, step, fwd, after in rows:
        out.setdefault((int(rank), comp), []).append((step, fwd, after))
    return out


def test_a_write_pytorch_does_not_see_is_found_at_its_step(tmp_path: Path) -> None:
    """A write into `.data` moves no version counter, so the forward checksum is not taken at
    that step (not the component's turn), but the replicas' checksums after it differ there."""
    _train(tmp_path, 0, None, steps=20)
    _train(tmp_path, 1, 13, steps=20, unseen=True)
    step, fwd, _ = _fwd_checks(tmp_path)[(1, "4")][12]
    assert (step, fwd) == (13, None)
    root = analyze(tmp_path).to_dict()["root"]
    assert (root["scope"], root["onset_step"]) == ("replicas", 13)


def test_checksums_taken_in_the_weight_norm_pass_equal_those_of_a_pass_of_their_own(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # with the kernels loaded, the checksum after the step comes from the pass that takes the
    # weights' norms (one read of the weights); it must be the checksum a pass of its own takes,
    # and the norms that weight drift compares must still agree where nothing else wrote them
    assert kernels.available()
    calls = []
    fused = kernels.norms_word_sums
    monkeypatch.setattr(kernels, "norms_word_sums", lambda *a: calls.append(1) or fused(*a))
    _train(tmp_path / "fused", 1, 17)
    assert len(calls) >= 30  # every step's end at least
    # the recorder no longer asks the weight-norm pass for checksums: the replicas take their own
    monkeypatch.setattr(params.ParamProbe, "checksums_wanted", property(lambda self: False, lambda self, v: None),
                        raising=False)
    _train(tmp_path / "own", 1, 17)
    assert len(calls) < 60  # the second run took none
    assert _fwd_checks(tmp_path / "fused") == _fwd_checks(tmp_path / "own")

    def health(trace: Path) -> list[tuple[int, str, float, float]]:
        return duckdb.sql(f"""select step, component, weight_norm_l2, weight_drift_l2 from read_parquet(
            '{schema.segment_glob(trace, "health")}', hive_partitioning = true)
            where weight_norm_l2 is not null order by step, component""").fetchall()

    got, want = health(tmp_path / "fused"), health(tmp_path / "own")
    assert [r[:2] for r in got] == [r[:2] for r in want]
    assert [r[2] for r in got] == pytest.approx([r[2] for r in want], rel=1e-6)
    # a low bit moves no norm (the checksums say it): no drift in either, none made up by the
    # switch from one kernel to the other
    assert {(s, c) for s, c, _, d in got if d} == {(s, c) for s, c, _, d in want if d} == set()


@pytest.mark.parametrize("compiled", [True, False], ids=["compiled", "eager"])
def test_local_norms_read_in_grad_refuse_a_gradient_freed_in_place(monkeypatch: pytest.MonkeyPatch,
                                                                    compiled: bool) -> None:
    # read in `.grad` before DDP's copy (tracer/replicas.py): the same norms as the gradients'
    # own, and a gradient whose storage was freed is read by no pass, compiled or eager
    from types import SimpleNamespace

    if compiled:
        assert kernels.available()  # loaded now: `kernels.ready` says so from here on
    else:
        monkeypatch.setattr(kernels, "ready", lambda: False)
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(6, 5), torch.nn.Linear(5, 3))
    probe = ReplicaProbe(discover(model), model, 2)
    probe._ddp = SimpleNamespace(require_backward_grad_sync=True)  # what a DDP without bucket views sets
    model(torch.randn(4, 6)).sum().backward()
    probe.backward_ending()
    model[1].weight.grad.add_(1.0)  # DDP's copy of the all-reduced gradient moves its version
    probe.backward_ended()
    _, sq, mask = probe._buckets[-1]
    sq = sq if isinstance(sq, np.ndarray) else torch.zeros(probe.n).index_add_(0, probe._buckets[-1][0], sq).numpy()
    want = (model[1].weight.grad - 1.0).square().sum() + model[1].bias.grad.square().sum()
    comp = probe.param_comp_np[2]
    assert mask.tolist() == [i == comp for i in range(probe.n)]  # only what DDP wrote counts
    assert sq[comp] == pytest.approx(float(want), rel=1e-5)
    probe._buckets.clear()
    model[1].weight.grad.untyped_storage().resize_(0)
    with pytest.raises(RuntimeError, match="lost its storage"):
        probe.backward_ending()
    assert probe._at_backward is None


def test_local_norms_read_through_the_parameter_probe_are_the_replicas_own() -> None:
    # the recorder hands the parameter probe's reading to the replicas: the same per-component
    # sums as their own pass, a parameter without a gradient adding nothing, and the address
    # check kept for the pass after DDP's copy into the same tensors
    from types import SimpleNamespace

    assert kernels.available()
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(6, 5), torch.nn.Linear(5, 3), torch.nn.Linear(3, 2))
    comps = discover(model)
    probe, own = ReplicaProbe(comps, model, 2), ReplicaProbe(comps, model, 2)
    pp = params.ParamProbe(comps, sketch_size=4)
    assert pp._compiled_grads
    for p in (probe, own):
        p._ddp = SimpleNamespace(require_backward_grad_sync=True)
    model[0].weight.requires_grad_(False)  # no gradient: norm 0, its component's sum the bias's alone
    model(torch.randn(4, 6)).sum().backward()
    probe.backward_ending(pp.local_norms)
    own.backward_ending()
    got, want = probe._at_backward[1], own._at_backward[1]
    assert isinstance(got, np.ndarray) and isinstance(want, np.ndarray)
    assert got.tolist() == pytest.approx(want.tolist(), rel=1e-6)
    assert got[probe.param_comp_np[0]] == pytest.approx(float(model[0].bias.grad.square().sum()), rel=1e-6)
    assert probe._at_backward[2] == own._at_backward[2]  # the same versions seen
    checked = pp._checked_grads
    assert checked is not None and pp._grad_addresses(pp._grads())  # the same tensors: taken as checked
    assert pp._checked_grads is checked


def test_local_norms_of_a_sparse_gradient_read_values_that_are_still_alive() -> None:
    # a sparse gradient is read as its coalesced values, a tensor made for the pass: it must
    # live until the compiled pass has read it (freed, its memory reads as garbage, or faults)
    assert kernels.available()
    torch.manual_seed(0)
    rows = 50_000
    model = torch.nn.Sequential(torch.nn.Embedding(rows, 64, sparse=True), torch.nn.Linear(64, 2))
    pp = params.ParamProbe(discover(model), sketch_size=4)
    model(torch.arange(rows).repeat(2)).sum().backward()  # every row twice: uncoalesced
    grad = model[0].weight.grad
    assert grad.is_sparse and not grad.is_coalesced()
    want = float(grad.coalesce().values().double().norm())
    for _ in range(3):
        _, got = pp.local_norms()
        assert got is not None and float(got[0]) == pytest.approx(want, rel=1e-6)
        pp._checked_grads = None  # each call checks the gradients afresh, as each step does


class _Branchy(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a, self.br, self.head = torch.nn.Linear(16, 16), torch.nn.Linear(16, 16), torch.nn.Linear(16, 4)

    def forward(self, x: torch.Tensor, branch: bool) -> torch.Tensor:
        h = self.a(x)
        return self.head(h + self.br(h) if branch else h)


def _branch_on_one_rank(rank: int, port: int, root: str, bucket_view: bool) -> None:
    """Rank 1 of 2 skips the `br` branch in even steps (DDP with find_unused_parameters)."""
    import os

    import torch.distributed as dist

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    kernels.available()
    dist.init_process_group("gloo", rank=rank, world_size=2)
    try:
        torch.manual_seed(0)
        model = torch.nn.parallel.DistributedDataParallel(
            _Branchy(), find_unused_parameters=True, gradient_as_bucket_view=bucket_view)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        gen = torch.Generator().manual_seed(rank)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # find_unused_parameters' own note on used parameters
            with watch(model, opt, root):
                for step in range(1, 5):
                    model(torch.randn(8, 16, generator=gen), rank == 0 or step % 2 == 1).sum().backward()
                    opt.step()
                    opt.zero_grad()
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("bucket_view", [False, True])
def test_a_branch_one_rank_skips_is_all_reduced_with_a_local_norm_of_zero(tmp_path: Path,
                                                                          bucket_view: bool) -> None:
    # DDP (find_unused_parameters) all-reduces the branch rank 1 did not run and writes its
    # gradient there, where there was none: rank 1's contribution was 0, whether its local
    # gradients are read in `.grad` or in the communication hook
    import socket

    import torch.multiprocessing as mp

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.spawn(_branch_on_one_rank, args=(port, str(tmp_path), bucket_view), nprocs=2, join=True)
    rows = duckdb.sql(f"""select step, local_grad_norm_l2, grad_allreduced
        from read_parquet('{schema.segment_glob(tmp_path, "replicas")}', hive_partitioning = true)
        where rank = 1 and component = 'br' order by step""").fetchall()
    assert [(s, a) for s, _, a in rows] == [(s, True) for s in range(1, 5)]
    assert [n == 0.0 for _, n, _ in rows] == [False, True, False, True]


def _weights_with_and_without(rank: int, world: int, port: int, root: str, set_to_none: bool) -> None:
    """Train the same DDP model (gradient_as_bucket_view) plain and watched; save whether this
    rank's final weights are the same bits."""
    import os

    import torch.distributed as dist

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    kernels.available()
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        finals = []
        for watched in (False, True):
            torch.manual_seed(0)
            net = torch.nn.Sequential(torch.nn.Linear(16, 64), torch.nn.ReLU(), torch.nn.Linear(64, 8))
            model = torch.nn.parallel.DistributedDataParallel(net, gradient_as_bucket_view=True)
            opt = torch.optim.SGD(model.parameters(), lr=0.1)
            gen = torch.Generator().manual_seed(rank)
            rec = watch(model, opt, f"{root}/trace-{watched}") if watched else None
            for _ in range(6):
                opt.zero_grad(set_to_none=set_to_none)
                F.mse_loss(model(torch.randn(32, 16, generator=gen)), torch.randn(32, 8, generator=gen)).backward()
                opt.step()
            if rec is not None:
                rec.close()
            finals.append([p.detach().clone() for p in net.parameters()])
        same = all(torch.equal(a.view(torch.int32), b.view(torch.int32)) for a, b in zip(*finals, strict=True))
        Path(root, f"same-{rank}").write_text(str(same))
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("set_to_none", [False, True])
def test_training_with_bucket_views_and_three_ranks_is_bit_identical(tmp_path: Path, set_to_none: bool) -> None:
    # with gradient_as_bucket_view DDP divides a gradient that is already a view of its bucket by
    # the world size, and multiplies one it copies by 1 / size; at 3 ranks the two differ in the
    # last bit, and the recorder's communication hook must do what DDP does
    import socket

    import torch.multiprocessing as mp

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.spawn(_weights_with_and_without, args=(3, port, str(tmp_path), set_to_none), nprocs=3, join=True)
    assert [Path(tmp_path, f"same-{r}").read_text() for r in range(3)] == ["True"] * 3
