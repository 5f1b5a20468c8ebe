"""Live alarms: a real run with an injected fault raises them during training, into real sinks."""

from __future__ import annotations

import importlib.util
import itertools
import json
import os
import re
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from warninglight.forensics import replay
from warninglight.forensics.explaining.analysis import ALARM_KEYS
from warninglight.lab import zoo
from warninglight.lab.drills import WeightCorruption
from warninglight.tracer import watch
from warninglight.tracer.alarms import JsonlSink, SinkError, SinkWorker, WebhookSink, sink_from_spec
from webhook_server import WebhookServer

FAULT_STEP, STEPS = 100, 130
KEYS = ("step", "observed_on", "condition", "onset_step", "attributed_to", "metric")


class Received:
    """A sink object: keeps each alarm it was sent."""

    def __init__(self) -> None:
        self.got: list[dict[str, Any]] = []

    def send(self, alarm: dict[str, Any]) -> None:
        self.got.append(alarm)


def _train(path: Path, sinks: list[Any], on_alarm: Any, steps_run: list[int],
           during: list[bool], hung: WebhookServer) -> Any:
    torch.manual_seed(0)
    model, opt = zoo.mlp(), None
    opt = torch.optim.Adam(model.parameters(), 1e-3)
    data = zoo.batches(*zoo.teacher_classification(n=1024), 64)
    drill = WeightCorruption("2", FAULT_STEP, mode="scale", factor=10.0)
    drill.attach(model, opt)
    try:
        with watch(model, opt, path, alarms=sinks, on_alarm=on_alarm) as rec:
            step, hung_steps, give_up = 0, 0, time.time() + 300
            # train past the fault; then on, until 10 steps have run while the hung endpoint held
            # its request (it is released only after training): the hang slowed nothing
            while step < STEPS or (hung_steps < 10 and time.time() < give_up):
                step += 1
                ids, x, y = next(data)
                drill.before_step(step, model, opt)
                loss = F.cross_entropy(model(x), y)
                opt.zero_grad()
                loss.backward()
                opt.step()
                rec.log(loss=loss.item())
                rec.batch(ids)
                if step % 50 == 0:
                    torch.save(model.state_dict(), path.parent / f"step-{step}.pt")
                    rec.checkpoint(path.parent / f"step-{step}.pt")
                steps_run.append(step)
                hung_steps += hung.hanging.is_set() and not hung.release.is_set()
            during.append(hung_steps)
            hung.release.set()  # so closing does not wait out the sinks' deadline for it
    finally:
        drill.detach()
    return rec


def _trackers(root: Path) -> list[str]:
    """The tracker sinks whose extras are installed (CI installs them all)."""
    found = []
    if importlib.util.find_spec("mlflow"):
        found.append(f"mlflow:sqlite:///{root}/mlflow.db")
    if importlib.util.find_spec("tensorboard"):
        found.append(f"tensorboard:{root}/tb")
    if importlib.util.find_spec("wandb"):
        found.append("wandb:offline")
    return found


@pytest.fixture(scope="module")
def live(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    root = tmp_path_factory.mktemp("live")
    received, calls, steps_run, during = Received(), [], [], []
    saved = {k: os.environ.get(k) for k in ("WANDB_MODE", "WANDB_DIR", "WANDB_SILENT")}
    os.environ.update(WANDB_MODE="offline", WANDB_DIR=str(root), WANDB_SILENT="true")
    with WebhookServer() as good, WebhookServer(["hang"]) as hung:

        def on_alarm(alarm: dict[str, Any]) -> None:  # called inside opt.step() of step len+1
            calls.append((threading.get_ident(), len(steps_run) + 1, alarm))

        rec = _train(root / "trace", [f"jsonl:{root}/alarms.jsonl", f"webhook:{good.url}",
                                      f"webhook:{hung.url}", received, *_trackers(root)],
                     on_alarm, steps_run, during, hung)
    if importlib.util.find_spec("wandb"):
        import wandb
        wandb.teardown()  # the offline run's records are complete once its service has stopped
    yield {"rec": rec, "root": root, "received": received.got, "webhook": good.received,
           "calls": calls, "steps_run": steps_run, "during": during}
    for k, v in saved.items():
        os.environ.pop(k, None) if v is None else os.environ.__setitem__(k, v)


def test_live_alarms_equal_replay(live: dict[str, Any]) -> None:
    rec = live["rec"]
    offline = replay(live["root"] / "trace")
    assert len(rec.alarms) > 0
    assert min(a["step"] for a in rec.alarms) == FAULT_STEP + 1  # raised during the run, not after
    as_live = sorted(tuple(a[k] for k in KEYS) + (round(a["magnitude"], 9),) for a in rec.alarms)
    as_replay = sorted(tuple(a[k] for k in KEYS) + (round(a["magnitude"], 9),)
                       for a in offline.alarms.iter_rows(named=True))
    assert as_live == as_replay
    last_root = rec.alarms[-1]["root"]
    assert (last_root["attributed_to"], last_root["onset_step"], last_root["condition"]) == (
        offline.root.alarm.attributed_to, offline.root.alarm.onset_step, offline.root.alarm.condition)


def test_every_sink_got_every_alarm_in_order(live: dict[str, Any]) -> None:
    alarms = live["rec"].alarms
    lines = [json.loads(s) for s in (live["root"] / "alarms.jsonl").read_text().splitlines()]
    assert [(a["step"], a["observed_on"], a["condition"]) for a in lines] == \
           [(a["step"], a["observed_on"], a["condition"]) for a in alarms]
    assert [a["observed_on"] for a in live["received"]] == [a["observed_on"] for a in alarms]
    assert [b["observed_on"] for _, b in live["webhook"]] == [a["observed_on"] for a in _announced(live)]


def test_one_incident_is_one_webhook_post_and_every_alarm_a_jsonl_line(live: dict[str, Any]) -> None:
    alarms = live["rec"].alarms
    lines = [json.loads(s) for s in (live["root"] / "alarms.jsonl").read_text().splitlines()]
    assert len(alarms) > 1 and len(lines) == len(alarms)  # several alarms, one fault
    assert {a["incident"] for a in lines} == {1}
    posts = [b for _, b in live["webhook"]]
    assert [b["update"] for b in posts] == ["new"] + ["update"] * (len(posts) - 1)
    assert len(posts) < len(alarms)
    said = [(b["root"]["attributed_to"], b["root"]["onset_step"], b["rollback"]["checkpoint_step"],
             tuple(b["rollback"]["skip_step_range"])) for b in posts]
    assert len(set(said)) == len(said)  # each post after the first changed the root or rollback
    for body in posts:
        assert "\n" not in body["text"] and len(body["text"]) < 300, body["text"]
        assert body["rollback"]["skip_batches"]  # the ids are in the JSON ...
        skip = body["rollback"]["skip_batches"]
        assert len(skip) > 3 and ", ".join(map(str, skip[:3])) not in body["text"]  # ... not the text
        assert body["detail"].startswith(f"step {body['step']}: ")


def test_jsonl_alarm_has_analyze_fields_root_and_rollback(live: dict[str, Any]) -> None:
    first = json.loads((live["root"] / "alarms.jsonl").read_text().splitlines()[0])
    assert set(ALARM_KEYS) <= set(first)
    assert first["root"]["onset_step"] == FAULT_STEP
    # the latest checkpoint strictly before the onset (the one at step 100 holds the fault)
    assert first["rollback"]["checkpoint_step"] == 50
    assert first["rollback"]["checkpoint_path"].endswith("step-50.pt")
    assert first["rollback"]["skip_batches"]  # rec.batch ids of the steps from onset to alarm


def test_webhook_posts_slack_text_and_fields(live: dict[str, Any]) -> None:
    _, body = live["webhook"][0]
    assert body["text"].startswith("ALARM ")
    assert f"onset step {FAULT_STEP}" in body["text"]
    assert body["condition"] == live["rec"].alarms[0]["condition"]


def test_on_alarm_runs_on_the_training_thread_at_a_step_boundary(live: dict[str, Any]) -> None:
    calls = live["calls"]
    assert len(calls) == len(live["rec"].alarms)
    assert {ident for ident, _, _ in calls} == {threading.get_ident()}
    assert all(step >= alarm["step"] for _, step, alarm in calls)


def test_a_hung_webhook_did_not_hold_training(live: dict[str, Any]) -> None:
    # steps trained while the endpoint held its request: the loop stops at 10 once past STEPS,
    # more if the request was already held earlier than 10 steps before STEPS
    assert len(live["during"]) == 1 and live["during"][0] >= 10
    assert live["rec"].step_count == len(live["steps_run"]) >= STEPS
    assert live["rec"].dropped_steps == 0


def test_webhook_retries_through_failures_and_a_hang() -> None:
    with WebhookServer(["fail", "fail", "hang", "ok"]) as server:
        worker = SinkWorker(WebhookSink(server.url, timeout_s=0.5), backoff_s=0.05)
        worker.put({"text": "ALARM x", "step": 7})
        worker.close(timeout_s=30)
        assert server.answers == ["fail", "fail", "hang", "ok"]
        assert [b["step"] for _, b in server.received] == [7]  # the hung request never completed
    assert (worker.delivered, worker.failed) == (1, 0)
    assert "500" in worker.errors[0] and "timed out" in worker.errors[2]


def test_a_full_sink_queue_drops_and_counts() -> None:
    class Stuck:
        retries = 0

        def __init__(self) -> None:
            self.go = threading.Event()

        def send(self, alarm: dict[str, Any]) -> None:
            self.go.wait(30)

    stuck = Stuck()
    worker = SinkWorker(stuck, queue_size=2)
    for i in range(6):  # one in flight, two queued, the rest dropped
        worker.put({"step": i})
    stuck.go.set()
    worker.close(timeout_s=30)
    assert worker.delivered + worker.dropped == 6
    assert worker.dropped >= 3


@pytest.mark.parametrize(("spec", "message"), [
    ("slack:https://x", "unknown kind 'slack'"),
    ("jsonl", "expected KIND:ARGUMENT"),
    ("webhook:$WL_TEST_UNSET_URL", "environment variable WL_TEST_UNSET_URL is not set"),
    ("webhook:ftp://x", "must start with http:// or https://"),
    (42, "has no send(alarm) method"),
])
def test_bad_sink_is_a_named_error(spec: Any, message: str, tmp_path: Path,
                                   monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("WL_TEST_UNSET_URL", raising=False)
    with pytest.raises(SinkError, match=message.replace("(", r"\(").replace(")", r"\)")):
        watch(zoo.mlp(), torch.optim.SGD(zoo.mlp().parameters(), 0.1), tmp_path, alarms=[spec])
    assert not (tmp_path / "health").exists()  # refused before anything was written


@pytest.mark.parametrize(("alarms", "message"), [
    (42, "alarms must be a sink or a list of sinks, got int 42; e.g. alarms=['jsonl:"),
    ({"jsonl": "a.jsonl"}, "alarms must be a sink or a list of sinks, got dict {'jsonl': 'a.jsonl'}"),
    (["jsonl:{tmp}"], "alarm sink 'jsonl:{tmp}': that is a directory; name a file in it"),
    (["jsonl:{tmp}/file.txt/a.jsonl"], "alarm sink 'jsonl:{tmp}/file.txt/a.jsonl' could not be opened: "),
])
def test_a_bad_sink_list_is_one_sink_error_at_watch(alarms: Any, message: str, tmp_path: Path) -> None:
    (tmp_path / "file.txt").write_text("a file where a directory would go")
    alarms = [a.replace("{tmp}", str(tmp_path)) for a in alarms] if isinstance(alarms, list) else alarms
    with pytest.raises(SinkError, match=re.escape(message.replace("{tmp}", str(tmp_path)))) as caught:
        watch(zoo.mlp(), None, tmp_path / "trace", alarms=alarms)
    error = caught.value
    assert "\n" not in str(error)  # one line
    assert error.__cause__ is None and (error.__context__ is None or error.__suppress_context__)
    assert not (tmp_path / "trace").exists()


def test_webhook_url_from_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("WL_TEST_HOOK", "http://127.0.0.1:9/hook")
    assert sink_from_spec("webhook:$WL_TEST_HOOK").url == "http://127.0.0.1:9/hook"
    assert isinstance(sink_from_spec("jsonl:/tmp/x/a.jsonl"), JsonlSink)


def _alarm_steps(live: dict[str, Any]) -> list[int]:
    return [a["step"] for a in _announced(live)]


def _announced(live: dict[str, Any]) -> list[dict[str, Any]]:
    """The alarms a message sink is sent: each incident's first, and each change of its root or rollback."""
    return [a for a in live["rec"].alarms if a["update"] is not None]


def test_mlflow_run_has_the_alarms(live: dict[str, Any]) -> None:
    pytest.importorskip("mlflow")
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri=f"sqlite:///{live['root']}/mlflow.db")
    exp = client.get_experiment_by_name("warninglight")
    (run,) = client.search_runs([exp.experiment_id])
    root = live["rec"].alarms[-1]["root"]
    assert run.data.tags["warninglight.root"] == root["attributed_to"]
    assert run.data.tags["warninglight.last_alarm"].startswith("ALARM ")
    history = client.get_metric_history(run.info.run_id, "warninglight/alarms")
    assert [(m.step, m.value) for m in history] == [
        (s, float(i + 1)) for i, s in enumerate(_alarm_steps(live))]


def test_tensorboard_events_read_back(live: dict[str, Any]) -> None:
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(live["root"] / "tb"), size_guidance={"tensors": 0, "scalars": 0})
    events.Reload()
    texts = events.Tensors("warninglight/alarm/text_summary")
    assert [t.step for t in texts] == _alarm_steps(live)
    assert all(t.tensor_proto.string_val[0].startswith(b"ALARM ") for t in texts)
    magnitudes = events.Scalars("warninglight/alarm_magnitude")
    assert [round(m.value, 3) for m in magnitudes] == [
        round(a["magnitude"], 3) for a in _announced(live)]


def test_wandb_offline_run_holds_the_alarms(live: dict[str, Any]) -> None:
    pytest.importorskip("wandb")
    from wandb_records import records

    (path,) = (live["root"] / "wandb").glob("offline-run-*/run-*.wandb")
    logged = [r.history for r in records(path) if r.WhichOneof("record_type") == "history"]
    steps = [int(float(i.value_json)) for h in logged for i in h.item
             if i.nested_key == ["warninglight/alarm_step"] or i.key == "warninglight/alarm_step"]
    assert steps == _alarm_steps(live)


def test_a_scheduled_lr_drop_raises_no_live_alarm_as_replay_raises_none(tmp_path: Path) -> None:
    """Live alarms judge update sizes per unit of the lr each component saw, as analyze does: a
    step decay (SGD + momentum, lr x0.1) is the schedule working, not a fault, live or offline."""
    torch.manual_seed(0)
    model = zoo.mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    decay = torch.optim.lr_scheduler.StepLR(opt, step_size=120, gamma=0.1)
    data = zoo.batches(*zoo.teacher_classification(n=1024), 64)
    sink = tmp_path / "alarms.jsonl"
    with watch(model, opt, tmp_path / "trace", alarms=[f"jsonl:{sink}"]) as rec:
        for _ in range(200):
            _, x, y = next(data)
            loss = F.cross_entropy(model(x), y)
            opt.zero_grad()
            loss.backward()
            opt.step()
            decay.step()
            rec.log(loss=loss.item())
    assert rec.writer.dropped_steps == 0
    assert replay(tmp_path / "trace").alarms.is_empty()
    assert rec.alarms == []
    assert not sink.exists() or sink.read_text() == ""


def test_on_alarm_runs_without_the_recorders_lock_held(tmp_path: Path) -> None:
    # the user's on_alarm may close the recorder, whose sinks it then waits for, and a sink may
    # call the recorder: neither waits on the recorder's lock while on_alarm runs
    free, box = [], []

    def on_alarm(alarm: dict[str, Any]) -> None:
        probe = threading.Thread(target=lambda: free.append(box[0]._lock.acquire(timeout=2)
                                                            and (box[0]._lock.release() or True)))
        probe.start()
        probe.join()
        box[0].close("alarm")

    torch.manual_seed(0)
    model = zoo.mlp()
    opt = torch.optim.Adam(model.parameters(), 1e-3)
    data = zoo.batches(*zoo.teacher_classification(n=1024), 64)
    drill = WeightCorruption("2", FAULT_STEP, mode="scale", factor=10.0)
    drill.attach(model, opt)
    try:
        box.append(watch(model, opt, tmp_path / "trace", alarms=[Received()], on_alarm=on_alarm))
        # train until on_alarm has closed it: the alarm comes some steps after the fault, how
        # many depends on the machine's load (a bound in time, not in steps, for a fast model)
        deadline = time.monotonic() + 120
        for step in itertools.count(1):
            if box[0]._closed or time.monotonic() > deadline:
                break
            _, x, y = next(data)
            drill.before_step(step, model, opt)
            F.cross_entropy(model(x), y).backward()
            opt.step()
            opt.zero_grad()
    finally:
        drill.detach()
        box[0].close()
    assert free and all(free)  # the first call closed it; the others of that boundary too
    entry = json.loads((tmp_path / "trace" / "manifest" / "rank=0.json").read_text())["incarnations"][0]
    assert entry["status"] == "alarm"
