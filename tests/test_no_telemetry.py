"""Nothing leaves the machine unless a sink is configured: every socket connection is watched."""

from __future__ import annotations

import socket
from pathlib import Path
from typing import Any

import pytest
import torch
from warninglight.forensics import analyze, replay
from warninglight.lab import zoo
from warninglight.tracer import watch
from warninglight.tracer.alarms import SinkWorker, WebhookSink


@pytest.fixture
def connections(monkeypatch: pytest.MonkeyPatch) -> list[Any]:
    """Every address a socket tried to reach; the attempt fails (nothing gets out)."""
    tried: list[Any] = []

    def refuse(self: socket.socket, address: Any) -> None:
        tried.append(address)
        raise ConnectionRefusedError(f"test: no network ({address})")

    def refuse_ex(self: socket.socket, address: Any) -> int:
        tried.append(address)
        return 111

    monkeypatch.setattr(socket.socket, "connect", refuse)
    monkeypatch.setattr(socket.socket, "connect_ex", refuse_ex)
    return tried


def _run(path: Path, **options: Any) -> None:
    torch.manual_seed(0)
    model = zoo.mlp()
    opt = torch.optim.SGD(model.parameters(), 0.05)
    x, y = zoo.teacher_classification(n=256)
    with watch(model, opt, path, **options) as rec:
        for step in range(80):
            i = slice(step % 4 * 64, step % 4 * 64 + 64)
            loss = torch.nn.functional.cross_entropy(model(x[i]), y[i])
            opt.zero_grad()
            loss.backward()
            opt.step()
            rec.log(loss=loss)


def test_recording_and_analysis_open_no_connection(tmp_path: Path, connections: list[Any]) -> None:
    _run(tmp_path / "quiet", alarms=[f"jsonl:{tmp_path}/alarms.jsonl"])
    analyze(tmp_path / "quiet")
    replay(tmp_path / "quiet")
    assert connections == []


def test_the_watch_sees_a_configured_sink_connect(connections: list[Any]) -> None:
    worker = SinkWorker(WebhookSink("http://127.0.0.1:9/hook", timeout_s=1.0), backoff_s=0.01)
    worker.put({"text": "ALARM", "step": 1})
    worker.close(timeout_s=10)
    assert connections and connections[0][:2] == ("127.0.0.1", 9)
    assert worker.failed == 1
