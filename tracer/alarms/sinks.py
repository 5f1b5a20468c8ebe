"""Where live alarms go: JSONL, a webhook, or any object with `send(alarm)`; each behind its own thread.

A sink is anything with `send(alarm: dict) -> None` (and optionally `close()`, and
`every_alarm = False` to be sent only an incident's news: its first alarm and each change of its
root or rollback); `send` may block or raise. Every sink runs behind a `SinkWorker`: a bounded queue and a daemon thread that retries a
failing `send` with exponential backoff, so a slow, hung or failing endpoint delays nothing but
its own deliveries — never training, never the other sinks. When the queue is full the newest
alarm is dropped and counted.

Sinks are named by strings in `watch(..., alarms=[...])`: `jsonl:PATH`, `webhook:URL` (or
`webhook:$ENV_VAR`, read when `watch` starts), `mlflow:TRACKING_URI`, `tensorboard:LOGDIR`,
`wandb:offline` (trackers: see trackers.py, imported only when named).
"""

from __future__ import annotations

import json
import os
import queue
import threading
import time
import urllib.request
from pathlib import Path
from typing import Any

from .base import Sink, SinkError


class JsonlSink:
    """One alarm per line, appended to `path` (flushed per alarm, so `tail -f` sees it)."""

    retries = 2
    every_alarm = True  # a record: every alarm, each with its `incident`

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.path = Path(path)
        if self.path.is_dir():
            raise SinkError(f"alarm sink 'jsonl:{path}': that is a directory; name a file in it, "
                            f"e.g. 'jsonl:{self.path / 'alarms.jsonl'}'")
        self.path.parent.mkdir(parents=True, exist_ok=True)

    def send(self, alarm: dict[str, Any]) -> None:
        with self.path.open("a", encoding="utf-8") as f:
            f.write(json.dumps(alarm, default=str) + "\n")


class WebhookSink:
    """POST an incident's news as JSON: a Slack-compatible one-line `text` plus the structured
    fields (the skip ids in `rollback.skip_batches`, never in the text)."""

    retries = 4
    every_alarm = False  # a message: an incident's first alarm, then each change of root or rollback

    def __init__(self, url: str, timeout_s: float = 5.0) -> None:
        if not url.startswith(("http://", "https://")):
            raise SinkError(f"webhook URL {url!r} must start with http:// or https://")
        self.url, self.timeout_s = url, timeout_s

    def send(self, alarm: dict[str, Any]) -> None:
        body = json.dumps(alarm, default=str).encode()  # `text` (the one line) leads the fields
        req = urllib.request.Request(self.url, data=body, method="POST",
                                     headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=self.timeout_s) as resp:  # raises on 4xx/5xx
            resp.read()


class SinkWorker:
    """A sink behind a bounded queue and a daemon thread, with retries and backoff."""

    def __init__(self, sink: Any, queue_size: int = 256, backoff_s: float = 0.5,
                 max_backoff_s: float = 8.0) -> None:
        self.sink = sink
        self.name = type(sink).__name__
        self.retries = int(getattr(sink, "retries", 2))
        self.every_alarm = bool(getattr(sink, "every_alarm", True))
        self.backoff_s, self.max_backoff_s = backoff_s, max_backoff_s
        self.delivered = self.dropped = self.failed = 0
        self.errors: list[str] = []
        self._queue: queue.Queue[dict[str, Any]] = queue.Queue(queue_size)
        self._stopping = threading.Event()  # end when the queue is empty
        self._stop = threading.Event()  # give up retrying now
        self._thread = threading.Thread(target=self._run, name=f"warninglight-sink-{self.name}",
                                        daemon=True)
        self._thread.start()

    def put(self, alarm: dict[str, Any]) -> None:
        """Queue an alarm; never blocks (a full queue drops it and counts it)."""
        try:
            self._queue.put_nowait(alarm)
        except queue.Full:
            self.dropped += 1

    def stop(self) -> None:
        """Ask the thread to end once the queue is delivered; returns at once."""
        self._stopping.set()

    def join(self, deadline: float) -> None:
        """Wait until the queue is delivered or `deadline` (time.monotonic) passes, then close the sink."""
        self._thread.join(max(0.0, deadline - time.monotonic()))
        self._stop.set()  # a send still retrying gives up at its next backoff
        closer = getattr(self.sink, "close", None)
        if callable(closer) and not self._thread.is_alive():
            try:
                closer()
            except Exception as exc:
                self._error(exc)

    def close(self, timeout_s: float = 5.0) -> None:
        """`stop`, then `join` for at most `timeout_s`."""
        self.stop()
        self.join(time.monotonic() + timeout_s)

    def _run(self) -> None:
        while True:
            try:
                alarm = self._queue.get(timeout=0.1)  # s: how soon an idle worker sees `stop`
            except queue.Empty:
                if self._stopping.is_set():
                    return
                continue
            self._deliver(alarm)

    def _deliver(self, alarm: dict[str, Any]) -> None:
        if self._stop.is_set():  # closed past its deadline: what is left is not sent
            self.failed += 1
            return
        delay = self.backoff_s
        for attempt in range(self.retries + 1):
            try:
                self.sink.send(alarm)
                self.delivered += 1
                return
            except Exception as exc:  # a sink's failure is its own: count it, retry, move on
                self._error(exc)
                if attempt == self.retries or self._stop.wait(delay):
                    break
                delay = min(delay * 2, self.max_backoff_s)
        self.failed += 1

    def _error(self, exc: BaseException) -> None:
        if len(self.errors) < 20:
            self.errors.append(f"{self.name}: {type(exc).__name__}: {exc}")


def _env(value: str, spec: str) -> str:
    if not value.startswith("$"):
        return value
    found = os.environ.get(value[1:])
    if not found:
        raise SinkError(f"alarm sink {spec!r}: environment variable {value[1:]} is not set; "
                        f"export it, or give the value itself")
    return found


def sink_from_spec(spec: str | Any) -> Any:
    """A sink from its string (`jsonl:PATH`, `webhook:URL`, ...) or a sink object as is."""
    if not isinstance(spec, str):
        if not callable(getattr(spec, "send", None)):
            raise SinkError(f"alarm sink {spec!r} has no send(alarm) method; give a string like "
                            "'jsonl:runs/x/alarms.jsonl' or an object with send(alarm)")
        return spec
    kind, sep, arg = spec.partition(":")
    if not sep or not arg:
        raise SinkError(f"alarm sink {spec!r}: expected KIND:ARGUMENT, e.g. 'jsonl:alarms.jsonl', "
                        "'webhook:$SLACK_URL', 'mlflow:sqlite:///mlflow.db', 'tensorboard:tb', "
                        "'wandb:offline'")
    if kind not in ("jsonl", "webhook", "mlflow", "tensorboard", "wandb"):
        raise SinkError(f"alarm sink {spec!r}: unknown kind {kind!r}; use jsonl, webhook, mlflow, "
                        "tensorboard or wandb")
    value = _env(arg, spec)
    try:
        if kind == "jsonl":
            return JsonlSink(value)
        if kind == "webhook":
            return WebhookSink(value)
        from . import trackers
        return trackers.from_spec(kind, value, spec)
    except SinkError:
        raise
    except Exception as exc:  # a directory not writable, a tracker refusing its URI: one line, no chain
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
        raise SinkError(f"alarm sink {spec!r} could not be opened: {type(exc).__name__}: "
                        f"{first}") from None



__all__ = ["JsonlSink", "Sink", "SinkError", "SinkWorker", "WebhookSink", "sink_from_spec"]
