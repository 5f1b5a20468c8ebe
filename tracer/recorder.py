"""`watch(model, optimizer, path)`: record every component's health at every optimizer step.

A step's path, all on the training thread unless a thread is named:
1. hook: the root's forward pre-hook opens the step at its first training forward
   (`_begin_step`: `ParamProbe.begin` notes the weights as the step found them), and each
   component's forward hook hands its output to `ForwardProbe.observe`.
2. probe: `observe` copies a strided row subsample of the output into a staging buffer; the end
   of the backward pass notes the gradients (`ParamProbe.after_backward`) and optimizer.step's
   pre-hook takes their norms (`_pre_step`).
3. buffer: optimizer.step's post-hook ends the step (`_post_step`): `_record_step` takes the
   weights after it and appends the step's record to the `StepBuffer`; every
   `FORWARD_BATCH_STEPS` steps the queued samples and norms are reduced, those steps at once,
   into the buffer's device rows. On an accelerator nothing is read back to the host.
4. writer: every `flush_every_steps` steps or `flush_every_s` seconds `_flush_if_due` hands the
   finished steps to the `TraceWriter` as one segment (one non-blocking copy to the host); the
   writer thread converts and writes its Parquet files and, with live alarms, passes it to the
   monitor thread, whose alarms reach `on_alarm` here at a later step's end.

Which step a call belongs to: a step ends at `optimizer.step()` (or `rec.step()` without an
optimizer). `rec.log` and `rec.batch` attach to the step in progress if a training forward has run
since the last step ended, else to the step just completed — so logging either before or after
`optimizer.step()` in the usual loop lands on the right step. `rec.checkpoint(path)` always
records the steps completed so far (the checkpoint holds the weights after that many steps).
"""

from __future__ import annotations

import atexit
import contextlib
import dataclasses
import json
import numbers
import os
import signal
import threading
import time
import uuid
import warnings
import weakref
from collections.abc import Iterator, Mapping
from types import FrameType, TracebackType
from typing import Any

import numpy as np
import torch
from torch import nn

from . import graphops, schema
from .arguments import check_arguments, check_model
from .buffer import LoopFacts, StepBuffer, StepRecord
from .components import (
    assign_param_groups,
    assign_parents,
    discover,
    note_trainable,
    release_tied,
    resolve_heads,
    user_module,
)
from .config import (
    LIVE_FLUSH_S,  # noqa: F401 (imported from here by bench/alarm_latency.py)
    LIVE_FLUSH_STEPS,  # noqa: F401
    OPTIONS,
    RecorderConfig,
    did_you_mean,
    with_options,
)
from .loopfacts import LoopProbe
from .params import ParamProbe
from .probes import (
    FORWARD_BATCH_STEPS,
    FORWARD_METRICS,
    PARAM_METRICS,
    ForwardProbe,
    first_tensor,
    graph_task,
)
from .replicas import ReplicaProbe
from .writer import TraceWriter

_METRIC_POS = {m: i for i, m in enumerate(schema.HEALTH_METRICS)}


def _runs(metrics: tuple[str, ...]) -> list[tuple[slice, slice]]:
    """(health columns, block columns) slices copying a block of `metrics` into a health row."""
    runs: list[tuple[slice, slice]] = []
    for j, m in enumerate(metrics):
        pos = _METRIC_POS[m]
        if runs and runs[-1][0].stop == pos and runs[-1][1].stop == j:
            runs[-1] = (slice(runs[-1][0].start, pos + 1), slice(runs[-1][1].start, j + 1))
        else:
            runs.append((slice(pos, pos + 1), slice(j, j + 1)))
    return runs


_FORWARD_RUNS, _PARAM_RUNS = _runs(FORWARD_METRICS), _runs(PARAM_METRICS)
_FORWARD_POS = [_METRIC_POS[m] for m in FORWARD_METRICS]
_OUT_NONFINITE = _METRIC_POS["out_nonfinite_count"]
_PARAM_POS = [_METRIC_POS[m] for m in PARAM_METRICS]
assert sorted(_FORWARD_POS + _PARAM_POS) == list(range(len(schema.HEALTH_METRICS)))
_MAX_WARNING_EVENTS = 20
# The first segment closes after this many steps or seconds (if sooner than the flush settings).
_FIRST_FLUSH_STEPS = 10
# steps between the flushes' refreshes of the parameters' views (`ParamProbe.refresh`)
REFRESH_EVERY_STEPS = 100
_FIRST_FLUSH_S = 5.0
# The step buffer's first size in steps, at most (it doubles when a segment holds more).
_BUFFER_ROWS = 256
_FORWARD = "\x00forward"  # what a compiled graph hands over at a training forward's start


class Recorder:
    """Hooks on a model (and its optimizer) that write a health trace; see `watch`."""

    def __init__(self, model: nn.Module, optimizer: torch.optim.Optimizer | None,
                 path: str | os.PathLike[str], *,
                 config: RecorderConfig | Mapping[str, Any] | None = None, **options: Any) -> None:
        """`options` are RecorderConfig's fields and override `config`'s (a mapping given as
        `config` is the run config, stored in the manifest)."""
        check_arguments(model, optimizer, path)
        cfg = self.config = with_options(config, options)
        self.model, self.optimizer = model, _usable_optimizer(optimizer)
        self.rank, self.world_size = _rank_and_world(cfg.rank, cfg.world_size)
        inner = user_module(model)  # component names are the user's module paths, wrapped or not
        heads = None
        if cfg.heads:
            names = {n for n, _ in inner.named_modules()}
            # a head named by its path under the DDP wrapper ("module.lm_head") is taken as well
            heads = [h.removeprefix("module.") if inner is not model and h not in names else h
                     for h in cfg.heads]
        self.components = discover(inner, heads)
        if heads:  # the message for a wrong name lists tied modules too, unnamed as they are
            resolve_heads(self.components, heads, [c.name for c in discover(inner)])
        self._heads_given = bool(cfg.heads)
        params = [p for c in self.components for p in c.params]
        self.device = params[0].device if params else torch.device("cpu")
        self.fwd = ForwardProbe(self.components, cfg.sample_size, self.device)
        self.params = ParamProbe(self.components, cfg.sketch_size)
        self.loop = LoopProbe(self.params.params, self.optimizer)
        self._step_facts: tuple[int | None, int] = (None, 0)
        # per-rank evidence (tracer/replicas.py): by default only when there are replicas to compare
        on = self.world_size > 1 if cfg.replicas is None else cfg.replicas
        self.replicas = ReplicaProbe(self.components, model, self.world_size) if on else None
        self.params.checksums_wanted = self.replicas is not None
        self.flush_every_steps, self.flush_every_s = cfg.flush_cadence()
        self.step_count = cfg.start_step
        self._first_step = cfg.start_step + 1
        self._static_valid = self._structural_validity()
        # the last step's validity, shared by the steps like it (`_step_validity`)
        self._validity: tuple[np.ndarray, np.ndarray, tuple[tuple[bool, ...], bool], np.ndarray] | None = None
        # a long flush interval does not reserve its rows up front: the buffer doubles as it fills
        self.buffer = StepBuffer(self.components, self.device, min(self.flush_every_steps, _BUFFER_ROWS) + 2)
        self._backward_queued = False
        self._backward_seen = False  # a backward pass ended since the last training forward began
        # the callbacks queued at a backward pass's end, never traced: a backward pass run from a
        # compiled function (a compiled training step) calls them while dynamo watches new frames
        self._ending = torch.compiler.disable(self._backward_ending)
        self._ended = torch.compiler.disable(self._after_backward)
        self._output_grad_seen = False  # `_on_output_grad` ran in this step
        # the parameters' own gradient hooks, standing in for the hook on the model's output that
        # a forward compiled whole cannot register (`_hook_parameters`): by parameter index
        self._param_hooks: dict[int, Any] = {}
        self._refreshed_at = 0  # the step of the flush that last refreshed the parameters' views
        self._busy = 0  # `_sigterm_deferred` depth on the main thread
        # a step's end and close() run one at a time, whatever threads call them (a watchdog's
        # close() waits for the training thread's flush, and that thread's next step end sees it)
        self._lock = threading.RLock()
        # ("log", values) and ("batch", ids) given inside graphs torch.compile traced: handed
        # over when the graph runs (tracer/graphops.py), taken in at the next entry point
        self._from_graph: list[tuple[str, Any]] = []
        self._sigterm_pending: tuple[int, FrameType | None] | None = None
        self._in_step = False
        self._micro_batches = 0
        self._order = 0
        self._hooks_stopped = False  # warned that a step ran with no forward hook firing
        self._warned = False
        self._warning_events = 0
        self._errors_seen = 0
        self._closed = False
        self._flushed = False
        self._last_step_time = self._last_flush = time.time()
        # estimates are stored to the bits their sampling error leaves meaningful (schema.SAMPLED_BITS)
        significand_bits = {} if cfg.full_precision else {
            c.name: c.bits for c in schema.HEALTH_COLUMNS if c.bits is not None}
        manifest_cfg = self._manifest_config(significand_bits)
        self._monitor = None
        if cfg.live:  # live mode: the engine is imported only here
            # built first: a bad sink is a SinkError before anything is written
            from .alarms.monitor import LiveMonitor
            self._monitor = LiveMonitor(list(cfg.alarms), cfg.on_alarm, self.rank, os.fspath(path),
                                        cfg.alarm_config)
        self.writer = TraceWriter(path, self.rank, self.world_size,
                                  cfg.run_id or uuid.uuid4().hex[:12], type(model).__name__,
                                  manifest_cfg, significand_bits=significand_bits)
        self.incarnation = self.writer.incarnation
        self._event("start", detail=json.dumps(manifest_cfg, default=str))
        if self.incarnation > 1:
            self._event("restart", detail=f"incarnation {self.incarnation}")
        if self._monitor is not None:
            self.writer.on_segment = self._monitor.submit
        if self.replicas is not None and self.replicas.hook_note:
            self._event("warning", detail=self.replicas.hook_note)
        self._eager_under_compile = cfg.hooks_under_compile == "eager"
        self._in_graph = cfg.hooks_under_compile == "graph"
        self._handles: list[Any] = []
        self._comp_hooks: dict[int, Any] = {}
        # the component hooks taken out of their modules for a forward pass under no_grad
        # (`_hooks_aside`), as (hooks dict, id, hook); and the watched forward passes under way
        self._aside: list[tuple[dict[int, Any], int, Any]] = []
        self._forwards = 0
        self._noting = False  # in a watched forward pass on CPU: hooks may note outputs (`_make_hook`)
        self._graph_token = graphops.Tokens(self._take_from_graph).new(None)  # `log`, `batch` in graphs
        self._install_hooks()
        self._pid = os.getpid()  # a forked child inherits the handlers, not the recorder
        self._prev_sigterm = self._install_sigterm()
        atexit.register(self._at_exit)
        self._check_writer()

    def _manifest_config(self, significand_bits: dict[str, int]) -> dict[str, Any]:
        """The settings the manifest's `config` holds: the options as resolved, then the run's."""
        cfg = self.config
        return {"sample_size": cfg.sample_size, "sketch_size": cfg.sketch_size,
                "flush_every_steps": self.flush_every_steps, "flush_every_s": self.flush_every_s,
                "heads": None if cfg.heads is None else list(cfg.heads),
                "start_step": cfg.start_step, "hooks_under_compile": cfg.hooks_under_compile,
                "replicas": self.replicas is not None, "significand_bits": significand_bits,
                **cfg.run_config}

    # --- public API -------------------------------------------------------------------------

    @property
    def dropped_steps(self) -> int:
        """Steps whose rows were lost (writer failures, a full queue, probe errors)."""
        return self.writer.dropped_steps

    @property
    def alarms(self) -> list[dict[str, Any]]:
        """Live alarms raised so far (`watch(..., alarms=...)`), oldest first; [] when not live."""
        return list(self._monitor.alarms) if self._monitor is not None else []

    @property
    def path(self) -> str:
        """The trace directory."""
        return str(self.writer.root)

    def log(self, **values: float | torch.Tensor) -> None:
        """Step-level scalars (`loss=...`, anything else goes to `scalars`); tensors are not synced.
        Inside a graph torch.compile traces (fullgraph=True too) the values are handed over as
        the graph runs and go to the step whose optimizer.step comes next; the step gets the mean
        of a name's values, inside graphs or not."""
        if self._closed:
            return
        # checked now: a value that float() rejects would fail the whole segment at flush time
        bad = [k for k, v in values.items() if not _is_scalar(v)]
        for k in bad:
            self._warn_once(f"rec.log({k}=...) ignored: expected a number or tensor, got "
                            f"{type(values.pop(k)).__name__}")
        if torch.compiler.is_compiling():  # no lock in a graph, no graph break: handed over
            for name, value in values.items():
                value = (value.detach() if isinstance(value, torch.Tensor)
                         else torch.tensor(float(value), dtype=torch.float64))
                graphops.hand_over(self._graph_token, name, [value])
            return
        with self._lock:
            if not self._closed:
                self._absorb_from_graph()
                self.buffer.log(self._target_step(), values)

    def batch(self, ids: Any) -> None:
        """The sample ids (or batch indices) this step consumed: an int, or a list or tensor of ints."""
        if self._closed:
            return
        if not isinstance(ids, torch.Tensor):  # checked now, not at flush: one bad id lost the segment
            try:
                ids = [int(ids)] if isinstance(ids, numbers.Integral) else [int(i) for i in ids]
            except (TypeError, ValueError) as exc:
                self._warn_once(f"rec.batch(...) ignored: expected a list or tensor of int sample "
                                f"ids, got {type(ids).__name__} ({exc})")
                return
        if torch.compiler.is_compiling():
            ids = ids.detach() if isinstance(ids, torch.Tensor) else torch.tensor(ids, dtype=torch.long)
            graphops.hand_over(self._graph_token, "", [ids])
            return
        with self._lock:
            if not self._closed:
                self._absorb_from_graph()
                self.buffer.batch(self._target_step(), ids)

    def checkpoint(self, path: str | os.PathLike[str], detail: str | None = None) -> None:
        """Record that a checkpoint holding the weights after `step_count` steps was saved."""
        with self._lock:
            if not self._closed:
                self._event("checkpoint", path=os.fspath(path), detail=detail)

    def step(self) -> None:
        """End a step by hand, when no optimizer was given to `watch`."""
        if self.optimizer is not None:
            self._warn_once("rec.step() ignored: steps advance on optimizer.step() when an "
                            "optimizer is given to watch()")
            return
        self._pre_step()
        self._post_step()

    def close(self, reason: str = "normal") -> None:
        """Stop recording and write everything still buffered. Safe to call twice, and from any
        thread: a call while another thread closes it returns once that close is done."""
        with self._sigterm_deferred(), self._lock:  # a deferred SIGTERM handled after the lock is let go
            if self._closed:
                return
            self._absorb_from_graph()
            self._closed, self._noting = True, False
            self._remove_hooks()
            if self.replicas is not None:
                self.replicas.close()
            atexit.unregister(self._at_exit)
            self._event("stop", detail=reason)
            self._flush(final=True)
            self.writer.close(reason)
            self._check_writer()
            self._restore_sigterm()  # last: a SIGTERM until here waits for the flush
        if self._monitor is not None:
            self._monitor.close()
            self._monitor.deliver()  # the last alarms' on_alarm: close() is the last step boundary
            for message in self._monitor.errors[:1]:
                warnings.warn(f"warninglight: live alarms: {message}", RuntimeWarning, stacklevel=2)

    def __enter__(self) -> Recorder:
        return self

    def __deepcopy__(self, memo: dict[int, Any]) -> Recorder:
        """A deep copy of the watched model (an EMA, a weight average) takes its hooks, and with
        them this recorder, as they are: the hooks see that the module they run for is not the
        watched one, and do nothing. (A copied optimizer has no hooks: torch copies none.)"""
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.close("exception" if exc_type is not None else "normal")

    # --- hooks ------------------------------------------------------------------------------

    def _install_hooks(self) -> None:
        """Forward hooks, then the optimizer's step hooks; a failure removes those installed."""
        handles = self._handles
        try:
            handles.append(self.model.register_forward_pre_hook(self._root_pre_hook, with_kwargs=True))
            handles.append(self.model.register_forward_hook(self._root_hook))
            graphops.guard_module_hooks()
            self.fwd.first_seen = self._first_seen
            hook = self._make_hook()
            for comp in self.components:
                self.fwd.tokens.give(comp.module, comp.index, comp.channel_first)
                handles.append(comp.module.register_forward_hook(hook))
                self._comp_hooks[comp.index] = handles[-1]
            if self.optimizer is not None:
                # never traced: an optimizer.step that torch.compile traces (a compiled optimizer,
                # a compiled training step) calls them outside its graph, at a graph break each
                pre, post = torch.compiler.disable(self._pre_step), torch.compiler.disable(self._post_step)
                handles.append(self.optimizer.register_step_pre_hook(lambda *_: pre()))
                handles.append(self.optimizer.register_step_post_hook(lambda *_: post()))
        except Exception as exc:  # an optimizer-like object without hooks: record nothing, break nothing
            self._remove_hooks()
            self._warn_once(f"could not install hooks ({type(exc).__name__}: {exc}); nothing will "
                            f"be recorded — pass the torch optimizer itself to watch()")

    def _remove_hooks(self) -> None:
        self._aside = []  # removed with the others: never put back
        for h in self._handles:
            h.remove()
        self._handles.clear()
        self._param_hooks.clear()
        for comp in self.components:
            self.fwd.tokens.take_back(comp.module)
        graphops.Tokens.forget(self._graph_token)

    def _hooks_aside(self) -> None:
        """A forward pass of the model under no_grad (an evaluation) records nothing, and a module
        with a forward hook, even one that returns at once, is called through torch's slower
        path: the components' hooks are taken out of their modules for the pass (`_hooks_back`
        puts them back at its end, or at the next entry point if it raised). Not while a watched
        forward pass is under way (another thread's, or the one that runs the model under
        no_grad inside its own forward), and not on a module that has hooks of other owners
        (putting ours back would change their order). A forward that turns gradients back on
        inside an evaluation's pass is not observed."""
        with self._lock:
            if self._closed or self._aside or self._forwards:
                return
            aside = self._aside
            for handle in self._comp_hooks.values():
                hooks = handle.hooks_dict_ref()
                if hooks is not None and len(hooks) == 1 and handle.id in hooks:
                    aside.append((hooks, handle.id, hooks.pop(handle.id)))

    def _hooks_back(self) -> None:
        """The hooks `_hooks_aside` took out, back into their modules (a module's only hook each)."""
        with self._lock:
            aside, self._aside = self._aside, []
            for hooks, key, hook in aside:
                hooks[key] = hook

    def _recording(self, module: nn.Module) -> bool:
        return not self._closed and module.training and torch.is_grad_enabled()

    def _root_pre_hook(self, module: nn.Module, args: Any, kwargs: Any) -> None:
        if module is not self.model or self._closed:
            return  # a copy of the model (`__deepcopy__`): not watched
        if torch.compiler.is_compiling():  # traced: the forward is counted as the graph runs
            if module.training and torch.is_grad_enabled():
                graphops.hand_over(self._graph_token, _FORWARD, [])
            return
        if not torch.is_grad_enabled():
            self._hooks_aside()
            return
        if self._aside:
            self._hooks_back()
        with self._lock:  # (each entry point: a close() from another thread waits for it)
            if self._closed:
                return
            self._forwards += 1
            self.loop.forward(module.training, args, kwargs)  # eval() mode too: a fact of its own
            if not module.training:
                return
            self._micro_batches += 1
            self._noting = self.fwd.device.type == "cpu"
            try:
                self._begin_step()
                if self.fwd.held:  # another micro-batch: judge the previous one by its gradients,
                    # if a backward pass made them since (two forward passes, then one backward: not yet)
                    self.fwd.settle(self.params.grads_so_far_finite() if self._backward_seen else None)
            except Exception as exc:
                self._probe_failed(exc)
            self._backward_seen = False

    def _root_hook(self, module: nn.Module, args: Any, out: Any) -> None:
        """End of the forward pass: take the samples the hooks left, and arrange calls at the start
        (gradient clearing) and the end (pre-clip norms) of the backward pass through this output."""
        if module is not self.model or self._closed:
            return
        if torch.compiler.is_compiling():  # traced: a compiled forward of the step ran
            if module.training and torch.is_grad_enabled():
                self.fwd.graph_sampled = True
            return
        if not torch.is_grad_enabled():
            if self._aside:
                self._hooks_back()
            return
        with self._lock:
            if self._closed:
                return
            t = first_tensor(out)
            self._noting = False
            self._forwards = max(0, self._forwards - 1)  # (a step's end may have reset it meanwhile)
            if module.training:
                if not self._in_step:  # a forward whose pre-hook ran compiled: its step began
                    self.fwd.graph_sampled = True
                try:
                    self.fwd.copy_deferred()
                    self.fwd.end_forward(t, self.params.grads_so_far_finite)
                except Exception as exc:
                    self._probe_failed(exc)
            if t is not None and t.requires_grad:
                t.register_hook(self._on_output_grad)

    def _on_output_grad(self, grad: torch.Tensor) -> None:
        """The start of a backward pass through the model's output (or, `_hook_parameters`, the
        first gradient computed for a parameter in it, before any accumulates)."""
        if self._backward_queued:  # once per backward pass, however many outputs
            return
        with self._lock:
            if self._closed or self._backward_queued:
                return
            self._backward_queued = self._output_grad_seen = True
            try:  # before any gradient of this pass accumulates: were the last step's cleared?
                self.loop.backward_begins(self.params.backward_versions)
                if self.replicas is not None:
                    self.replicas.backward_begins()
            except Exception as exc:
                self._probe_failed(exc)
            torch.autograd.Variable._execution_engine.queue_callback(self._ending)

    def _hook_parameters(self) -> None:
        """A step whose forward ran as one compiled graph registered no hook on the model's output
        (dynamo cannot trace one): from now on every parameter's gradient hook starts the
        backward pass's work instead, whichever comes first (the pre-clip norm, the loop's checks
        at the backward's start and end). A parameter's hook runs before its gradient
        accumulates, so the first of them runs before any does."""
        for i, p in enumerate(self.params.params):
            if i not in self._param_hooks and p.requires_grad:  # (one frozen now may train later)
                self._param_hooks[i] = handle = p.register_hook(self._on_output_grad)
                self._handles.append(handle)

    def _backward_ending(self) -> None:
        """The first callback at the end of a backward pass (queued at its start). A wrapper queues
        its own during the pass, after this one: DDP copies the all-reduced gradients back into
        `.grad` there, FSDP reduces its shards. The gradients as the backward pass leaves them
        are those after every such callback, so `_after_backward` is queued behind them."""
        if self.replicas is not None:
            with self._lock:
                try:  # DDP's copy has not happened yet: `.grad` holds this rank's own gradients
                    if not self._closed:
                        self.replicas.backward_ending(self.params.local_norms)
                except Exception as exc:
                    self._probe_failed(exc)
        try:
            torch.autograd.Variable._execution_engine.queue_callback(self._ended)
        except Exception:  # no backward pass in progress on this thread to queue into
            self._ended()

    def _after_backward(self) -> None:
        self._backward_queued, self._backward_seen = False, True
        with self._lock:
            if self._closed:
                return
            now = None  # the gradients' versions as they are now, read by the parameter probe
            try:
                self.params.after_backward()
                now = self.params.backward_versions
            except Exception as exc:
                self._probe_failed(exc)
            if self.replicas is not None:
                try:
                    self.replicas.backward_ended(now)
                except Exception as exc:
                    self._probe_failed(exc)

    def _make_hook(self) -> Any:
        """The forward hook of every component: one function, so that a graph torch.compile
        traces for one block of a class serves every block (tracer/graphops.py)."""
        fwd, comps = self.fwd, {c.module: c for c in self.components}
        noted, notable = fwd.noted, fwd.notable()

        def hook(module: nn.Module, args: Any, out: Any) -> None:
            if torch.compiler.is_compiling():
                # traced by torch.compile: the sample and the non-finite count are computed in
                # the graph and handed over by an op when it runs (no graph break: fullgraph=True works)
                if self._in_graph and self._recording(module):
                    fwd.observe_in_graph(module, out)
                return
            comp = comps.get(module)
            if comp is None:  # a copy of the model (`__deepcopy__`): not watched
                return
            idx = comp.index
            # within a watched forward pass on CPU (`_noting`), a component whose output nothing
            # writes in place: its output noted, observed at the pass's end (`ForwardProbe.drain`)
            if (self._noting and type(out) is torch.Tensor and idx in notable and module.training
                    and torch.is_grad_enabled()):
                noted.append((comp, out, out._version))
                return
            # (a checkpointed module's forward run again in the backward pass: observed there
            # only if its first run was not, under a reentrant checkpoint's no_grad)
            with self._lock:
                if not self._recording(module) or (fwd.sampled[idx] and graph_task() != -1):
                    if (not module.training and self.model.training and not self._closed
                            and torch.is_grad_enabled()):
                        self._component_in_eval(comp)
                    return
                try:
                    self._begin_step()
                    if comp.forward_index is None and self.step_count < self._first_step:
                        comp.forward_index, self._order = self._order, self._order + 1
                    fwd.observe(comp, out)
                except Exception as exc:  # a probe must never break the forward pass
                    self._probe_failed(exc)
        # "eager": dynamo calls the hook outside the graph (a graph break per component)
        return torch.compiler.disable(hook) if self._eager_under_compile else hook

    def _component_in_eval(self, comp: Any) -> None:
        """A component runs in eval() mode while the model trains: an event the first time."""
        if self.loop.component_in_eval(comp.name, self.step_count + 1):
            self._event("finding", detail=json.dumps(
                {"finding": "component_eval_mode", "component": comp.name,
                 "kind": type(comp.module).__name__, "step": self.step_count + 1}))

    def _absorb_from_graph(self, step: int | None = None) -> None:
        """The values `log` and `batch` got inside compiled graphs since the last entry point, to
        `step` (by default the step a value given now goes to). They reach the recorder only at
        its next entry point: those of a graph run after optimizer.step go to the next step
        unless an eager forward, `log` or `batch` comes before that step's optimizer.step."""
        if not self._from_graph:
            return
        taken, self._from_graph = self._from_graph, []
        step = self._target_step() if step is None else step
        for kind, payload in taken:
            if kind == "log":
                self.buffer.log(step, payload)
            else:
                self.buffer.batch(step, payload)

    def _take_from_graph(self, key: None, what: str, values: list[torch.Tensor]) -> None:
        """A value `log` (`what`: its name) or `batch` (`what` empty) got inside a compiled graph,
        handed over as the graph runs (copied: the graph may reuse its memory), or the start of
        a compiled training forward (`_FORWARD`)."""
        if what == _FORWARD:
            self._micro_batches += 1
            return
        value = values[0].clone()
        self._from_graph.append(("log", {what: value}) if what else ("batch", value))

    def _begin_step(self) -> None:
        if not self._in_step:
            self._absorb_from_graph()  # given after the last step's optimizer.step: that step's
            self._in_step = True
            self.params.begin()
            if self.replicas is not None and (note := self.replicas.begin(self.params.weights_seen)):
                self._warn_once(note)

    def _pre_step(self) -> None:
        if self._closed:
            return
        with self._lock:
            if self._closed:
                return
            self._absorb_from_graph(self.step_count + 1)  # given before this optimizer.step
            if self._aside:  # an evaluation's forward raised: its pass never ended
                self._hooks_back()
            try:
                self.params.grads()
                self._step_facts = self.loop.step_facts(self.params.param_has_grad)
                # forward outputs held on CPU are counted only if the gradients say something was
                # not finite; a non-finite output that never reaches the gradients goes uncounted
                if self.fwd.held or self.fwd.released:
                    self.fwd.settle(None if self.params.has_grad is None else self.params.grads_finite)
            except Exception as exc:
                self._probe_failed(exc)

    def _post_step(self) -> None:
        """optimizer.step's post-hook (or `rec.step()`): the step ends here."""
        if self._closed:
            return
        now = time.time()
        with self._sigterm_deferred(), self._lock:  # a deferred SIGTERM handled after the lock is let go
            if self._closed:  # by another thread, while this one waited
                return
            self._record_step(now)
            self._flush_if_due(now)
        # outside the lock: the user's on_alarm may close the recorder, whose alarm sinks may
        # wait for it
        if self._monitor is not None and self._monitor.on_alarm is not None:
            self._monitor.deliver()

    @contextlib.contextmanager
    def _sigterm_deferred(self) -> Iterator[None]:
        """A SIGTERM handled on this thread while the step's end or `close()` run (reducing the
        queued steps, taking them out of the buffer) closes the recorder when they are done:
        closing in their middle would write rows they had not filled. (Only the main thread
        handles signals; the handler's close() waits for another thread's on the lock.)"""
        if threading.current_thread() is not threading.main_thread():
            yield
            return
        self._busy += 1
        try:
            yield
        finally:
            self._busy -= 1
            if not self._busy and self._sigterm_pending is not None:
                signum, frame = self._sigterm_pending
                self._sigterm_pending = None
                self._on_sigterm(signum, frame)

    def _record_step(self, now: float) -> None:
        """Count the step and queue its values for the buffer; a failure loses this step only.
        A record in the buffer whose values were not all queued is made null (an interrupt)."""
        self.step_count += 1
        queued = False
        try:
            graphops.guard_module_hooks()  # on the training thread, once dynamo is imported
            if (self.fwd.graph_sampled and not self._output_grad_seen
                    and len(self._param_hooks) < len(self.params.params)):
                self._hook_parameters()
            # a backward pass whose end never came (it failed, or compiled autograd ran it)
            # leaves the next one to start afresh
            self._output_grad_seen = self._backward_queued = False
            if self.fwd.from_graph or self.fwd.graph_sampled:
                self._absorb_graph_samples()
            if self.step_count == self._first_step:
                self._settle_components()
            elif not self._hooks_stopped and self._order and not self.fwd.samples:
                self._hooks_stopped = True
                self._warn_once(
                    f"no forward hook fired in step {self.step_count}, though they did before: its "
                    "forward statistics are null. A torch.compile graph traced without the hooks "
                    "may be running (dynamo reuses a graph compiled for another instance of the "
                    "model's class, e.g. an unwatched copy, and does not guard against hooks: set "
                    "torch._dynamo.config.skip_nnmodule_hook_guards = False before compiling), or "
                    "the forward ran in eval() mode or under no_grad")
            self._buffer_step(now)
            queued = True
            if self.replicas is not None:
                self.replicas.end_step(self.step_count, self.params.end_sums, self.params.weights_seen)
            if max(len(self.fwd.pending), len(self.params.pending)) >= FORWARD_BATCH_STEPS:
                self._reduce_pending()  # nulls the rows it leaves unfilled
        except BaseException as exc:  # an interrupt too (KeyboardInterrupt), then raised again
            recs = self.buffer.records
            if not queued and recs and recs[-1].step == self.step_count:  # its values may never come
                r = recs[-1]
                r.valid, r.present = np.zeros_like(r.valid), (False, False, r.present[2])
            elif isinstance(exc, Exception) and not queued:
                self.writer.record_failure(f"step {self.step_count} not recorded", 1)
            if not isinstance(exc, Exception):
                raise
            self._probe_failed(exc)
        finally:
            self.fwd.reset()
            self.loop.step_ended()
            self._in_step, self._micro_batches, self._last_step_time = False, 0, now
            self._forwards = 0  # a forward that raised never ended: none is under way now
            self._step_facts = (None, 0)

    def _flush_if_due(self, now: float) -> None:
        """At the step boundary: report writer failures, and hand the finished steps to the
        writer when a segment is due."""
        self._check_writer()
        pending = len(self.buffer.records)
        every_steps, every_s = self.flush_every_steps, self.flush_every_s
        if not self._flushed:  # the first segment closes early: a short-lived run leaves a trace
            every_steps, every_s = min(every_steps, _FIRST_FLUSH_STEPS), min(every_s, _FIRST_FLUSH_S)
        if pending > every_steps or (pending > 1 and now - self._last_flush >= every_s):
            self._flush(final=False)

    def _buffer_step(self, now: float) -> None:
        """The step's record into the buffer (its values reach it at `_reduce_pending`); queue its
        samples."""
        slot = self.buffer.next_slot()
        # copies left for the step's end first (a hook that ran after the forward's end): a copy
        # lost to an in-place write makes its component unsampled, which the validity must see,
        # and the outputs it held are settled with the others
        self.fwd.copy_deferred()
        self.fwd.settle(None)  # outputs still held: no gradients were seen this step
        pvalid, has_total, has_preclip = self.params.end(slot)
        valid = self._step_validity(pvalid)
        lr = self.optimizer.param_groups[0].get("lr") if self.optimizer else None
        lr_host = None
        if isinstance(lr, torch.Tensor) and lr.device == self.device:
            self.buffer.scalars[slot, 2].copy_(lr.detach().reshape(()))
        elif lr is not None:
            lr_host = float(lr)  # a number, or a tensor on the host while the model is not
        self.buffer.records.append(StepRecord(
            self.step_count, slot, valid, now, now - self._last_step_time, self._micro_batches,
            (has_total, has_preclip, lr is not None), lr_host,
            _group_lrs(self.optimizer.param_groups) if self.optimizer else None,
            LoopFacts(self.loop.eval_forwards, *self._step_facts, self.loop.rows or None,
                      self.loop.shape)))
        self.fwd.take(slot)

    def _step_validity(self, pvalid: np.ndarray) -> np.ndarray:
        """The step's (C, M) validity: the structure's, the components sampled, the parameters'
        (`pvalid`). Read-only: steps alike share one array (a step of a steady run is like the last,
        and each numpy op here costs the step far more than in a loop, its code cold between the
        training's ops); a record that loses values later takes a copy."""
        key = (tuple(self.fwd.sampled), self.fwd.unknown)
        memo = self._validity
        if memo is not None and memo[0] is self._static_valid and memo[1] is pvalid and memo[2] == key:
            return memo[3]
        valid = self._static_valid.copy()
        sampled = np.array(self.fwd.sampled)[:, None]
        for cols, _ in _FORWARD_RUNS:  # column runs: cheaper than indexing by position lists
            valid[:, cols] &= sampled
        if self.fwd.unknown:  # outputs let go uncounted, and the gradients are not finite
            valid[:, _OUT_NONFINITE] = False
        for cols, of in _PARAM_RUNS:
            valid[:, cols] = pvalid[:, of]
        valid.flags.writeable = False
        self._validity = (self._static_valid, pvalid, key, valid)
        return valid

    def _absorb_graph_samples(self) -> None:
        """Observations made inside compiled graphs join the step's (first call per component)."""
        self.fwd.absorb_graph_samples()

    def _first_seen(self, idx: int) -> None:
        """A component's first call in a step, as a compiled graph runs: its place in the
        forward order, during the first step (as the eager hook gives it)."""
        comp = self.components[idx]
        if comp.forward_index is None and self.step_count < self._first_step:
            comp.forward_index, self._order = self._order, self._order + 1

    def _reduce_pending(self) -> None:
        """Parameter and forward statistics of the queued steps, computed together, into their rows.
        A failure, or an interrupt (KeyboardInterrupt, raised wherever the training thread is),
        leaves the rows it did not fill null: they hold another step's values."""
        pslots = {s.slot for s in self.params.pending}
        fslots = {s.slot for s in self.fwd.pending}
        failed: Exception | None = None
        try:
            self._put_params(self.params.reduce())
        except BaseException as exc:  # those rows hold stale values: make them null, then report
            for r in self.buffer.records:
                if r.slot in pslots:
                    r.valid = r.valid.copy()  # shared with other steps (`_step_validity`)
                    r.valid[:, _PARAM_POS] = False
                    r.present = (False, False, r.present[2])
            if not isinstance(exc, Exception):
                raise  # the forward statistics stay queued, for close()
            failed = exc
        try:
            for first, block in self.fwd.compute():
                self.buffer.put(slice(first, first + block.shape[0]), _FORWARD_RUNS, block)
        except BaseException as exc:
            for r in self.buffer.records:
                if r.slot in fslots:
                    r.valid = r.valid.copy()
                    r.valid[:, _FORWARD_POS] = False
            if not isinstance(exc, Exception):
                raise
            failed = failed or exc
        if failed is not None:
            raise failed

    def _put_params(self, reduced: tuple[list[int], torch.Tensor, torch.Tensor, torch.Tensor] | None) -> None:
        if reduced is None:
            return
        slots, block, total, preclip = reduced
        scalars = torch.stack([total, preclip], 1)
        if slots == list(range(slots[0], slots[0] + len(slots))):  # the usual case: one run of rows
            rows = slice(slots[0], slots[0] + len(slots))
            self.buffer.put(rows, _PARAM_RUNS, block)
            self.buffer.scalars[rows, :2].copy_(scalars)
            return
        for i, slot in enumerate(slots):
            self.buffer.put(slot, _PARAM_RUNS, block[i])
            self.buffer.scalars[slot, :2].copy_(scalars[i])

    def _structural_validity(self) -> np.ndarray:
        valid = np.ones((len(self.components), len(schema.HEALTH_METRICS)), dtype=bool)
        for c in self.components:
            valid[c.index, _METRIC_POS["out_sat_frac"]] = c.bound in ("tanh", "sigmoid")
            for m in ("pred_entropy_nats", "pred_maxprob"):
                valid[c.index, _METRIC_POS[m]] = c.head
            if c.released:
                valid[c.index] = False
        return valid

    def _settle_components(self) -> None:
        """After the first step: heads, parents, and a warning for components never seen."""
        self.fwd.first_seen = None  # the forward order is the first step's: no call of a later one
        if not self._heads_given:
            resolve_heads(self.components, None)
            self._hooks_back()
            for c in release_tied(self.components):  # a tied module is recorded as a head only
                if (handle := self._comp_hooks.pop(c.index, None)) is not None:
                    handle.remove()
        assign_parents(self.components)
        if self.optimizer is not None:
            assign_param_groups(self.components, self.optimizer.param_groups)
        note_trainable(self.components)
        self._static_valid = self._structural_validity()
        unseen = [c.name for c in self.components if c.forward_index is None and not c.released]
        if unseen:
            why = ("the model is in eval() mode: outputs are recorded only in train() mode, so "
                   "call model.train() before training" if not self.model.training else
                   "unused modules; a torch.compile'd model watched with hooks_under_compile="
                   "'skip', where the default 'graph' records it inside the compiled graph; or a "
                   "graph dynamo compiled for an unwatched instance of the class, which it does "
                   "not guard against hooks: set torch._dynamo.config.skip_nnmodule_hook_guards "
                   "= False before compiling")
            msg = (f"forward hooks never fired in the first step for {len(unseen)} of "
                   f"{len(self.components)} components ({why}): {', '.join(unseen[:20])}")
            if len(unseen) * 2 > len(self.components):
                self._warn_once(msg)  # also records the event
            else:
                self._event("warning", detail=msg)

    # --- step attribution, events, failures --------------------------------------------------

    def _target_step(self) -> int:
        """The step a value given now belongs to: the one in progress once its forward began
        (eager or compiled), else the one the last optimizer.step ended."""
        return self.step_count + 1 if (self._in_step or self.fwd.graph_sampled or self.fwd.from_graph
                                       or self.step_count < self._first_step) else self.step_count

    def _event(self, kind: str, path: str | None = None, detail: str | None = None) -> None:
        self.buffer.events.append({"step": self.step_count, "wall_time_s": time.time(),
                                   "kind": kind, "path": path, "detail": detail})

    def _warn_once(self, message: str) -> None:
        if self._warning_events < _MAX_WARNING_EVENTS:  # a failure repeating every step is not news
            self._warning_events += 1
            self._event("warning", detail=message)
        if not self._warned:
            self._warned = True
            warnings.warn(f"warninglight: {message}", RuntimeWarning, stacklevel=3)

    def _probe_failed(self, exc: Exception) -> None:
        self._warn_once(f"probe failed, training continues unrecorded for affected steps: "
                        f"{type(exc).__name__}: {exc}")

    def _check_writer(self) -> None:
        errors = self.writer.errors
        if len(errors) > self._errors_seen:
            self._errors_seen = len(errors)
            self._event("dropped", detail=f"{self.writer.dropped_steps} steps dropped; last error: "
                                          f"{errors[-1]}")
            self._warn_once(f"trace writing failed under {self.path!r} ({errors[-1]}); "
                            f"training continues, {self.writer.dropped_steps} steps dropped so far")

    # --- flushing ---------------------------------------------------------------------------

    def _flush(self, final: bool) -> None:
        """Hand the finished steps (all of them when `final`) to the writer as one segment."""
        pending = len(self.buffer.records) if final else max(0, len(self.buffer.records) - 1)
        try:
            self._last_flush = time.time()
            self._flushed = True
            try:
                self._reduce_pending()
            except Exception as exc:  # the values it lost are null in their rows: write the segment
                self._probe_failed(exc)
            # the parameters' views taken again (a tensor put under one is found at each pass):
            # at once where the weights are off the compiled passes, else now and then
            if self.params.off_compiled or self.step_count - self._refreshed_at >= REFRESH_EVERY_STEPS:
                self.params.refresh()
                self._refreshed_at = self.step_count
            if not final:
                # wait for the previous segment before taking these steps out of the buffer: a
                # SIGTERM during the wait flushes them itself (close() below sets _closed)
                self.writer.ready()
                if self._closed:
                    return
            segment = self.buffer.take_segment(final)
            try:
                if self.replicas is not None:
                    segment.tables["replicas"] = self.replicas.take(segment.steps)
            except Exception as exc:  # the segment goes without its replicas rows
                self._probe_failed(exc)
            finally:  # taken out of the buffer: submitted even on an interrupt
                self.writer.submit(segment, final=final)
        except Exception as exc:  # the steps taken out of the buffer are gone: say how many
            self._probe_failed(exc)
            self.writer.record_failure(f"segment of {pending} steps not written: "
                                       f"{type(exc).__name__}: {exc}", pending)

    # --- process life -----------------------------------------------------------------------

    def _install_sigterm(self) -> Any:
        """The recorder's SIGTERM handler in place (main thread only: Python sets handlers
        there); the handler it replaces, less those of recorders closed since (`_SigtermHandler`)."""
        self._sigterm_handler: _SigtermHandler | None = None
        if threading.current_thread() is not threading.main_thread():
            return None
        handler = _SigtermHandler(self)
        # the handler it passes on to is known before it is in place: a SIGTERM right after
        # finds it (only this thread sets handlers, so none can come between)
        prev = _open_handler(signal.getsignal(signal.SIGTERM))
        handler.prev = self._prev_sigterm = prev
        try:
            signal.signal(signal.SIGTERM, handler)
        except (ValueError, OSError):
            return None
        self._sigterm_handler = handler
        return prev

    def _restore_sigterm(self) -> None:
        """On the main thread, the handlers of closed recorders taken off the top: the handler
        there was before them back once every recorder above it is closed, in whatever order.
        Off the main thread the recorder's stays, and passes every signal on (`_SigtermHandler`)."""
        if self._prev_sigterm is None or threading.current_thread() is not threading.main_thread():
            return
        now = signal.getsignal(signal.SIGTERM)
        if isinstance(now, _SigtermHandler) and now.closed():
            signal.signal(signal.SIGTERM, _open_handler(now))

    def _on_sigterm(self, signum: int, frame: FrameType | None) -> None:
        if os.getpid() != self._pid:  # a forked child's: the recorder is its parent's
            self._pass_sigterm_on(signum, frame)
            return
        if self._busy:  # at the end of what runs (`_sigterm_deferred`)
            self._sigterm_pending = (signum, frame)
            return
        self.close("sigterm")
        self._pass_sigterm_on(signum, frame)

    def _pass_sigterm_on(self, signum: int, frame: FrameType | None) -> None:
        """To the handler there was before the recorder's, else the default action."""
        _pass_on(self._prev_sigterm, signum, frame)

    def _at_exit(self) -> None:
        if os.getpid() == self._pid:  # not in a forked child that exits through Python
            self.close("normal")


class _SigtermHandler:
    """The recorder's SIGTERM handler. It holds the recorder weakly: a recorder closed on a
    thread that could not put the previous handler back (only the main thread sets handlers)
    leaves this behind, which keeps neither the recorder nor its model alive, passes every signal
    on to the handler before it, and is taken out of the chain by the next recorder's install."""

    def __init__(self, rec: Recorder) -> None:
        self.rec = weakref.ref(rec)
        self.prev: Any = None  # the handler before it (the recorder's `_prev_sigterm`, while it lives)

    def closed(self) -> bool:
        rec = self.rec()
        return rec is None or rec._closed

    def __call__(self, signum: int, frame: FrameType | None) -> None:
        rec = self.rec()
        if rec is not None:
            rec._on_sigterm(signum, frame)
        else:
            _pass_on(self.prev, signum, frame)


def _open_handler(handler: Any) -> Any:
    """`handler` less the handlers of closed recorders on top of it."""
    while isinstance(handler, _SigtermHandler) and handler.closed():
        handler = handler.prev
    return handler


def _pass_on(prev: Any, signum: int, frame: FrameType | None) -> None:
    """A SIGTERM to the handler `prev`, else (`SIG_DFL`, or None: not set from Python) the
    default action; ignored if it was ignored."""
    if callable(prev):
        prev(signum, frame)
    elif prev != signal.SIG_IGN:
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        os.kill(os.getpid(), signal.SIGTERM)


def _group_lrs(groups: list[dict[str, Any]]) -> list[float | None]:
    """Every param group's lr as a host float; a device tensor lr is left null (no sync)."""
    return [float(g["lr"]) if not isinstance(g.get("lr"), torch.Tensor) or g["lr"].device.type == "cpu"
            else None for g in groups]


def _usable_optimizer(optimizer: Any) -> torch.optim.Optimizer | None:
    """`optimizer`, or the torch optimizer a framework wrapper holds (accelerate, Lightning), or
    None with a warning: a wrapper that subclasses Optimizer without its hook tables would fail."""
    seen = optimizer
    for _ in range(4):  # wrappers of wrappers
        if seen is None or hasattr(seen, "_optimizer_step_pre_hooks"):
            return seen
        inner = getattr(seen, "optimizer", None) or getattr(seen, "_optimizer", None)
        if inner is None or inner is seen:
            break
        seen = inner
    warnings.warn(f"warninglight: {type(optimizer).__name__} is not a torch optimizer and holds "
                  "none under .optimizer; recording without it (steps advance on rec.step())",
                  RuntimeWarning, stacklevel=4)
    return None


def _is_scalar(value: Any) -> bool:
    if value is None or isinstance(value, torch.Tensor):
        return True
    try:
        float(value)
    except (TypeError, ValueError):
        return False
    return True


def _rank_and_world(rank: int | None, world_size: int | None) -> tuple[int, int]:
    dist = torch.distributed
    initialised = dist.is_available() and dist.is_initialized()
    if rank is None:
        rank = dist.get_rank() if initialised else 0
    if world_size is None:
        world_size = dist.get_world_size() if initialised else 1
    return rank, world_size


def watch(model: nn.Module, optimizer: torch.optim.Optimizer | str | os.PathLike[str] | None = None,
          path: str | os.PathLike[str] | None = None, *, config: RecorderConfig | None = None,
          **options: Any) -> Recorder:
    """Start recording `model` (stepping on `optimizer`) into the trace directory `path`.

    The options are `RecorderConfig`'s fields (sample_size, flush_every_steps, alarms, ...), given
    as `config=RecorderConfig(...)`, as keywords, or both: keywords override the config's fields.
    A keyword that is no option is stored in the manifest's config (`run_config`), with a warning
    when it looks like a misspelt option.

    An optimizer-like wrapper (accelerate's AcceleratedOptimizer, Lightning's LightningOptimizer)
    is unwrapped to the torch optimizer it holds; one that holds none is recorded without, with a
    warning.
    """
    check_model(model)  # first: watch(optimizer, model, path) is named as swapped
    if isinstance(optimizer, (str, os.PathLike)):  # watch(model, "runs/x") without an optimizer
        if path is not None:  # watch(model, "runs/x", opt) would record no steps at all
            raise ValueError(f"watch(model, {os.fspath(optimizer)!r}, {type(path).__name__}): the "
                             "optimizer comes second, e.g. watch(model, optimizer, 'runs/exp1')")
        optimizer, path = None, optimizer
    if path is None:
        raise ValueError("watch() needs a trace directory, e.g. watch(model, optimizer, 'runs/exp1')")
    known = {k: v for k, v in options.items() if k in OPTIONS}
    extra = {k: v for k, v in options.items() if k not in OPTIONS}
    for key in extra:  # a misspelt option would otherwise be stored silently as run config
        hint = did_you_mean(key)
        if hint:
            warnings.warn(f"warninglight: watch({key}=...) is not an option and is stored as run "
                          f"config{hint}", UserWarning, stacklevel=2)
    cfg = with_options(config, known)
    if extra:
        cfg = dataclasses.replace(cfg, run_config={**cfg.run_config, **extra})
    return Recorder(model, optimizer, path, config=cfg)


__all__ = ["Recorder", "RecorderConfig", "watch"]
