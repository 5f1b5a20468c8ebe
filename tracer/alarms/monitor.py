"""The live loop: closed segments in, alarms out to the sinks and to the user's `on_alarm`.

Threads: the writer thread hands each closed segment to `submit` (a queue put, nothing more);
one monitor thread classifies segments in order and puts each new alarm on the queue of every
sink that keeps every alarm (JSONL, a sink object), and only an incident's first alarm and those
that change its root or rollback on the others' (webhook, trackers: one message per news); the training thread, at each step boundary, calls `deliver` which runs `on_alarm` for the
alarms raised since. A slow classifier or sink delays alarms, never training: the only work on
the training thread is an empty-deque check per step.
"""

from __future__ import annotations

import collections
import queue
import threading
import time
import warnings
from collections.abc import Callable, Sequence
from typing import Any

from ..writer import Segment
from .sinks import SinkWorker, sink_from_spec

OnAlarm = Callable[[dict[str, Any]], Any]


class LiveMonitor:
    """Classifies closed segments off the training thread and fans the alarms out."""

    def __init__(self, sinks: Sequence[Any], on_alarm: OnAlarm | None, rank: int,
                 trace_dir: str, config: Any = None) -> None:
        from .live import LiveClassifier  # the engine: imported only in live-alarm mode

        built = [sink_from_spec(s) for s in sinks]  # every spec checked before a thread starts
        self.workers = [SinkWorker(s) for s in built]
        self.on_alarm = on_alarm
        self.trace_dir = trace_dir
        self.alarms: list[dict[str, Any]] = []
        self.errors: list[str] = []
        self._classifier = LiveClassifier(rank, _config(config))
        self._segments: queue.SimpleQueue[Segment | None] = queue.SimpleQueue()
        self._pending: collections.deque[dict[str, Any]] = collections.deque()
        self._lock = threading.Lock()
        self._thread = threading.Thread(target=self._run, name="warninglight-alarms", daemon=True)
        self._thread.start()

    def submit(self, seg: Segment) -> None:
        """Called by the writer thread with each segment once its files are in place."""
        self._segments.put(seg)

    def deliver(self) -> None:
        """Run `on_alarm` for every alarm raised since the last call (on the caller's thread)."""
        while self._pending:
            alarm = self._pending.popleft()
            try:
                self.on_alarm(alarm)  # type: ignore[misc]
            except Exception as exc:  # the user's action failed: say so, keep training
                warnings.warn(f"warninglight: on_alarm raised {type(exc).__name__}: {exc}; "
                              "training continues", RuntimeWarning, stacklevel=2)

    def close(self, classify_timeout_s: float = 30.0, sinks_timeout_s: float = 15.0) -> None:
        """Classify what is queued, then give the sinks together at most `sinks_timeout_s` to deliver.

        A hung endpoint costs the end of the run at most `sinks_timeout_s`; its alarms are in the
        JSONL sink and `rec.alarms` all the same.
        """
        self._segments.put(None)
        self._thread.join(classify_timeout_s)
        for w in self.workers:
            w.stop()
        deadline = time.monotonic() + sinks_timeout_s
        for w in self.workers:
            w.join(deadline)
            self.errors += w.errors

    def _run(self) -> None:
        try:  # load the compiled baseline kernel now (its first compile takes seconds), not at the first alarm
            from warninglight.forensics.judging.kernels.quantiles import warm

            warm()
        except Exception as exc:  # the first segment will report what fails
            self._error(f"live classification could not start: {type(exc).__name__}: {exc}")
        while (seg := self._segments.get()) is not None:
            try:
                found = self._classifier.feed(seg)
            except Exception as exc:  # the classifier's failure must not stop the trace
                self._error(f"live classification of steps {_span(seg)} failed: "
                            f"{type(exc).__name__}: {exc}")
                continue
            for alarm in found:
                alarm["trace"] = self.trace_dir
                alarm["raised_at"] = time.time()
                with self._lock:
                    self.alarms.append(alarm)
                if self.on_alarm is not None:
                    self._pending.append(alarm)
                for w in self.workers:  # a record takes every alarm; a message, its incident's news
                    if alarm.get("update") is not None or w.every_alarm:
                        w.put(alarm)

    def _error(self, message: str) -> None:
        if len(self.errors) < 20:
            self.errors.append(message)


def _span(seg: Segment) -> str:
    return f"{int(seg.steps[0])}-{int(seg.steps[-1])}" if len(seg.steps) else "(none)"


def _config(config: Any) -> Any:
    if config is None:
        return None
    from warninglight.forensics.judging.conditions import Config, load_config
    return config if isinstance(config, Config) else load_config(config)


__all__ = ["LiveMonitor", "OnAlarm"]
