"""Distributed rehearsals: real `torch.distributed` (gloo, CPU) data-parallel runs with rank faults.

`run_group(["ddp_grad_corrupt", "ddp_unwrapped_steps"], root)` spawns one process per rank,
joins them in one gloo process group, and trains each scenario in turn: a small GPT wrapped in
DistributedDataParallel, every rank on its own batches, recorded by `watch` into
`root/<scenario>` (one partition per rank), with the truth in `root/<scenario>/truth.json`.
Scenarios of one group share the spawned processes (spawning and joining a process group costs
more than training a scenario); they must share a world size.

The faults:

- `weight_scale`: one component's weights multiplied on one rank only, behind the optimizer's back
  (silent corruption in one GPU's memory);
- `grad_corrupt`: one component's gradient (`""`: every one) multiplied on one rank before DDP's
  all-reduce (a GPU that computes wrong; by 0: a rank whose gradients are zeroed before they are
  shared): every rank then applies the same bad average;
- `unwrapped_steps`: every other step trains the module inside the DDP wrapper, not the wrapper,
  so those steps' gradients are never synchronised and the replicas drift apart (on every rank,
  or on one: its all-reduces then pair with the others' next ones, and it makes up the missing
  ones after the recorded run so no rank waits forever);
- `zeroed_grads`: one rank's gradients zeroed after the all-reduce, before the optimizer step
  (a misplaced `zero_grad`): that rank steps on momentum alone;
- `layernorm_clip`: the gradient clipping that starts at `step` on every rank leaves LayerNorm's
  gradients out on one rank (BLOOM-176B's bug), so their LayerNorm weights part;
- `fsdp`: the same model sharded with FSDP2 `fully_shard` (clean), where this torch supports it.
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import tempfile
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from . import zoo
from .rehearsal import ScenarioError

TRUTH_FILE = "truth.json"
GPT = zoo.GPTConfig(vocab_size=96, block_size=16, n_layer=1, n_head=2, n_embd=16)
CHECKPOINT_EVERY = 10
CLIP = 0.1  # max gradient norm of the clipping scenarios: below the model's, so every step clips


class DistributedScenarioError(ScenarioError):
    """An unknown distributed scenario, or a group that cannot run together."""


@dataclass(frozen=True)
class RankScenario:
    """A data-parallel rehearsal: world size, the fault, where (rank, component) and when (step)."""

    name: str
    world_size: int = 2
    fault: str = "clean"  # clean | weight_scale | grad_corrupt | unwrapped_steps | zeroed_grads | layernorm_clip
    component: str | None = None  # the model's own module path ("h.0.mlp.c_fc"), as recorded
    rank: int | None = None  # the faulty rank; None: every rank
    step: int = 25  # first step the fault acts
    factor: float = 10.0
    steps: int = 40
    wrapper: str = "ddp"  # ddp | fsdp
    watched: str = "wrapper"  # wrapper | inner: what watch() is given, the DDP or the module in it
    condition: str = "unclassified"  # what the fault should be named
    clip: float | None = None  # max gradient norm clipped to from `step` on, every rank
    bucket_view: bool = False  # DDP's gradient_as_bucket_view: local gradients then read in a hook
    micro: int = 1  # micro-batches a step, DDP all-reducing after the last only (as nanoGPT does)

    def truth(self, seed: int) -> dict[str, Any]:
        """The answer key (same keys as a single-process rehearsal's truth.json, plus rank)."""
        clean = self.fault == "clean"
        return {"scenario": self.name, "model": "gpt", "seed": seed, "steps": self.steps,
                "healthy": clean, "world_size": self.world_size,
                "faults": [] if clean else [{k: v for k, v in asdict(self).items()
                                             if k in ("fault", "component", "rank", "step")}],
                **({} if clean else {"fault": self.fault, "component": self.component,
                                     "rank": self.rank, "step": self.step, "kind": "abrupt",
                                     "condition": self.condition})}


SCENARIOS: dict[str, RankScenario] = {sc.name: sc for sc in (
    RankScenario("ddp_weight_scale", fault="weight_scale", component="h.0.mlp.c_fc", rank=1,
                 condition="exploding"),
    RankScenario("ddp_grad_corrupt", fault="grad_corrupt", component="h.0.attn.c_attn",
                 rank=1, factor=30.0, condition="exploding"),
    RankScenario("ddp_grad_corrupt_inner", fault="grad_corrupt", component="h.0.attn.c_attn",
                 rank=1, factor=30.0, condition="exploding", watched="inner"),
    RankScenario("ddp_grad_corrupt_views", fault="grad_corrupt", component="h.0.attn.c_attn",
                 rank=1, factor=30.0, condition="exploding", bucket_view=True),
    RankScenario("ddp_unwrapped_steps", fault="unwrapped_steps", component="", rank=None),
    RankScenario("ddp_unwrapped_rank", fault="unwrapped_steps", component="", rank=1),
    RankScenario("ddp_zeroed_grads", fault="zeroed_grads", component="", rank=1),
    RankScenario("ddp_zeroed_local", fault="grad_corrupt", component="", rank=1, factor=0.0,
                 condition="losing_gradient"),
    RankScenario("ddp_layernorm_clip", fault="layernorm_clip", component="h.0.ln_1", rank=1, clip=CLIP),
    RankScenario("ddp_clean", clip=CLIP),
    RankScenario("ddp_clean_4ranks", world_size=4),
    RankScenario("ddp_accumulated", micro=3, steps=12),
    RankScenario("ddp_accumulated_views", micro=3, steps=12, bucket_view=True),
    RankScenario("fsdp_clean", wrapper="fsdp"),
)}


def scenario(name: str) -> RankScenario:
    """The scenario called `name`, or a `DistributedScenarioError` listing the names."""
    if name not in SCENARIOS:
        raise DistributedScenarioError(
            f"unknown distributed scenario {name!r}; expected one of: {', '.join(SCENARIOS)}")
    return SCENARIOS[name]


def fsdp_available() -> str | None:
    """None when FSDP2 `fully_shard` can be imported here; else why not."""
    try:
        from torch.distributed.fsdp import fully_shard  # noqa: F401
    except ImportError as exc:
        return f"torch.distributed.fsdp.fully_shard is not importable: {exc}"
    return None


# --- the run inside each spawned process ---------------------------------------------------------

def _wrap(sc: RankScenario, model: nn.Module) -> nn.Module:
    if sc.wrapper == "fsdp":
        from torch.distributed.fsdp import fully_shard

        for block in model.h:
            fully_shard(block)
        return fully_shard(model)
    return nn.parallel.DistributedDataParallel(model, gradient_as_bucket_view=sc.bucket_view)


def _inner(wrapped: nn.Module) -> nn.Module:
    return wrapped.module if isinstance(wrapped, nn.parallel.DistributedDataParallel) else wrapped


def _corrupt_grad(sc: RankScenario, model: nn.Module, state: dict[str, int]) -> list[Any]:
    """Hooks that multiply the component's local gradient by `factor` from `sc.step` on."""
    module = dict(_inner(model).named_modules())[sc.component or ""]
    hook = (lambda g: g * sc.factor if state["step"] >= sc.step else g)  # noqa: E731
    return [p.register_hook(hook) for p in module.parameters(recurse=not sc.component)]  # "": every one


def _clipped(sc: RankScenario, model: nn.Module, faulty: bool) -> list[nn.Parameter]:
    """The parameters this rank's clipping covers: all, or on the faulty rank all but LayerNorm's."""
    if sc.fault == "layernorm_clip" and faulty:
        return [p for m in _inner(model).modules() if not isinstance(m, nn.LayerNorm)
                for p in m.parameters(recurse=False)]
    return list(model.parameters())


def _make_up_all_reduces(model: nn.Module, data: Any, count: int) -> None:
    """Run `count` unrecorded backward passes through DDP: the all-reduces the other ranks still
    wait on, which this rank skipped (a real run would hang there, or at its next collective)."""
    for _ in range(count):
        _, x, y = next(data)
        logits = model(x)
        F.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1)).backward()


def _train_one(sc: RankScenario, rank: int, root: Path, seed: int, tokens: torch.Tensor) -> None:
    from warninglight.tracer import watch

    trace = root / sc.name
    torch.manual_seed(seed)
    model = _wrap(sc, zoo.TinyGPT(GPT))
    opt = torch.optim.Adam(model.parameters(), lr=3e-3)
    faulty = sc.rank is None or sc.rank == rank
    state = {"step": 0}
    handles = _corrupt_grad(sc, model, state) if sc.fault == "grad_corrupt" and faulty else []
    data = zoo.text_batches(tokens, 8, GPT.block_size, seed=1000 * seed + rank)  # per-rank data
    watched = _inner(model) if sc.watched == "inner" else model
    clipped = _clipped(sc, model, faulty)
    skipped = 0
    with watch(watched, opt, str(trace), heads=["lm_head"], flush_every_steps=20) as rec:
        for step in range(1, sc.steps + 1):
            state["step"] = step
            ids, x, y = next(data)
            if sc.fault == "weight_scale" and faulty and step == sc.step:
                with torch.no_grad():
                    for p in dict(_inner(model).named_modules())[sc.component or ""].parameters(recurse=False):
                        p.mul_(sc.factor)
            unwrapped = (sc.fault == "unwrapped_steps" and faulty and step >= sc.step
                         and (step - sc.step) % 2 == 0)
            skipped += unwrapped
            opt.zero_grad(set_to_none=True)
            for m in range(sc.micro):  # the step's earlier micro-batches: no all-reduce after them
                if sc.micro > 1:
                    model.require_backward_grad_sync = m == sc.micro - 1
                    if m:
                        ids, x, y = next(data)
                logits = (_inner(model) if unwrapped else model)(x)  # (B, T, vocab)
                loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1))
                (loss / sc.micro if sc.micro > 1 else loss).backward()
            if sc.fault == "zeroed_grads" and faulty and step >= sc.step:
                opt.zero_grad(set_to_none=False)  # misplaced: after the all-reduce, before the step
            if sc.clip is not None and step >= sc.step:
                nn.utils.clip_grad_norm_(clipped, sc.clip)
            opt.step()
            rec.log(loss=loss.detach())
            rec.batch(ids)
            if rank == 0 and step % CHECKPOINT_EVERY == 0:
                rec.checkpoint(str(trace / "checkpoints" / f"step-{step:06d}.pt"),
                               detail="rehearsal: no file was written")
    for h in handles:
        h.remove()
    if sc.fault == "unwrapped_steps" and sc.rank is not None:
        _make_up_all_reduces(model, data, skipped)
    truth = sc.truth(seed)
    if sc.wrapper == "fsdp":  # the full parameters' norms, gathered (a collective: every rank calls it)
        truth["full_weight_norms"] = _full_norms(model)
    if rank == 0:
        (trace / TRUTH_FILE).write_text(json.dumps(truth, indent=2))


def _full_norms(model: nn.Module) -> dict[str, float]:
    """Per parameter-owning module: the L2 norm of its full (unsharded) parameters after training."""
    out = {}
    for name, module in model.named_modules():
        sq = [float(p.detach().full_tensor().double().square().sum()) for p in module.parameters(recurse=False)]
        if sq:
            out[name] = sum(sq) ** 0.5
    return out


def _final_weights(rank: int, seed: int, tokens: torch.Tensor, trace: Path | None,
                   bucket_view: bool = False) -> list[torch.Tensor]:
    """Train the clean set-up for 12 steps, recorded into `trace` (or not); the final weights."""
    from warninglight.tracer import watch

    torch.manual_seed(seed)
    model = nn.parallel.DistributedDataParallel(zoo.TinyGPT(GPT), gradient_as_bucket_view=bucket_view)
    opt = torch.optim.Adam(model.parameters(), lr=3e-3)
    data = zoo.text_batches(tokens, 8, GPT.block_size, seed=1000 * seed + rank)
    rec = watch(model, opt, str(trace)) if trace is not None else None
    for _ in range(12):
        _, x, y = next(data)
        logits = model(x)
        F.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1)).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    if rec is not None:
        rec.close()
    return [p.detach().clone() for p in model.parameters()]


def _identity(rank: int, root: Path, seed: int, tokens: torch.Tensor) -> None:
    """Write whether training with and without the recorder left bit-identical weights on this
    rank: with DDP's default (local gradients read in `.grad`) and with the gradients as bucket
    views (read in the recorder's communication hook, which does DDP's arithmetic itself)."""
    same = True
    for view in (False, True):
        plain = _final_weights(rank, seed, tokens, None, view)
        watched = _final_weights(rank, seed, tokens, root / f"identity-trace-{int(view)}", view)
        same = same and all(torch.equal(a.view(torch.int32), b.view(torch.int32))
                            for a, b in zip(plain, watched, strict=True))
    (root / f"identity-rank{rank}.json").write_text(json.dumps({"rank": rank, "bit_identical": same}))


def _rank_main(rank: int, world: int, port: int, names: list[str], root: str, seed: int,
               identity: bool = False, compiled: bool = True) -> None:
    import torch.distributed as dist

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)  # world_size processes share the cores
    if compiled:  # loaded now, so every step of every scenario takes the compiled passes
        from warninglight.tracer import kernels

        kernels.available()
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        tokens = zoo.char_corpus(max_bytes=50_000)
        for name in names:
            _train_one(SCENARIOS[name], rank, Path(root), seed, tokens)
            dist.barrier()
        if identity:
            _identity(rank, Path(root), seed, tokens)
    finally:
        dist.destroy_process_group()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def run_group(names: Sequence[str], root: str | Path, seed: int = 0,
              identity: bool = False, compiled: bool = True) -> dict[str, dict[str, Any]]:
    """Train the scenarios `names` (one world size) in one spawned process group; their truths.

    `identity`: afterwards also train a clean run with and without the recorder, and write
    `root/identity-rank<R>.json` saying whether the final weights were bit-identical.
    `compiled`: the recorder's compiled kernels are loaded before the first step (a run loads
    them in the background during its first steps: `tracer/kernels.py`); False: the eager ops,
    as where they cannot be loaded.
    """
    import torch.multiprocessing as mp

    chosen = [scenario(n) for n in names]
    worlds = {sc.world_size for sc in chosen}
    if len(worlds) != 1:
        raise DistributedScenarioError(f"scenarios {list(names)} have world sizes {sorted(worlds)}; "
                                       "run one group per world size")
    if any(sc.wrapper == "fsdp" for sc in chosen) and (why := fsdp_available()):
        raise DistributedScenarioError(why)
    root = Path(root)
    root.mkdir(parents=True, exist_ok=True)
    mp.spawn(_rank_main, args=(worlds.pop(), _free_port(), list(names), str(root), seed, identity, compiled),
             nprocs=chosen[0].world_size, join=True)
    return {n: json.loads((root / n / TRUTH_FILE).read_text()) for n in names}


def rehearse(name: str, trace_dir: str | Path, seed: int = 0) -> dict[str, Any]:
    """One scenario into `trace_dir` (for the benchmark): the truth."""
    trace_dir = Path(trace_dir)
    with tempfile.TemporaryDirectory(prefix="wl-ranks-") as tmp:
        truth = run_group([name], tmp, seed)
        trace_dir.parent.mkdir(parents=True, exist_ok=True)
        shutil.move(str(Path(tmp) / name), str(trace_dir))
    return truth[name]
