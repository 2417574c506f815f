"""BatchRunner against a stand-in ASGI app (no engine): input order kept whatever order lines
finish in, the in-flight cap, the batch priority on every line, resume counts, and a cancel that
leaves the shared cap whole."""

from __future__ import annotations

import asyncio
import collections
import json

import pytest

from kvtide.batch.file_format import count_results, dump_record, parse_line
from kvtide.batch.runner import BATCH_PRIORITY, BatchRunner

# One worker runs this folder: its conftest starts the batch server once, at the folder's first test.
pytestmark = pytest.mark.xdist_group("batch")


class EchoApp:
    """Answers each POST after body["delay"] seconds with the body it got; counts lines in flight."""

    def __init__(self) -> None:
        self.in_flight = 0
        self.max_in_flight = 0
        self.bodies: list[dict] = []

    async def __call__(self, scope, receive, send) -> None:
        body = json.loads((await receive())["body"])
        self.bodies.append(body)
        self.in_flight += 1
        self.max_in_flight = max(self.max_in_flight, self.in_flight)
        try:
            await asyncio.sleep(body.get("delay", 0))
        finally:
            self.in_flight -= 1
        payload = json.dumps({"id": f"cmpl-{body['n']}", "echo": body}).encode()
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": payload})


def _lines(delays: list[float], url: str = "/v1/completions"):
    return [parse_line(json.dumps({"custom_id": f"c{n}", "method": "POST", "url": url,
                                   "body": {"n": n, "delay": d, "priority": -5}}), n + 1)
            for n, d in enumerate(delays)]


def test_order_cap_and_priority():
    app = EchoApp()
    delays = [0.05, 0.0, 0.03, 0.0, 0.01, 0.0, 0.02, 0.0] * 3
    records = []
    counts = asyncio.run(BatchRunner(app, max_concurrency=3, priority=BATCH_PRIORITY).run(_lines(delays),
                                                                                          records.append))
    assert [r["custom_id"] for r in records] == [f"c{n}" for n in range(len(delays))]
    assert [r["response"]["request_id"] for r in records] == [f"cmpl-{n}" for n in range(len(delays))]
    assert app.max_in_flight == 3
    assert {b["priority"] for b in app.bodies} == {BATCH_PRIORITY}
    assert (counts.total, counts.completed, counts.failed) == (len(delays), len(delays), 0)


def test_resume_skips_answered_lines(tmp_path):
    path = str(tmp_path / "out.jsonl")
    lines = _lines([0.0] * 6)
    lines.insert(3, parse_line("{torn", 99))
    first = []
    asyncio.run(BatchRunner(EchoApp(), max_concurrency=2).run(lines[:4], first.append))
    with open(path, "wb") as f:
        f.write(b"".join(dump_record(r) for r in first) + b'{"custom_id": "c4", "cut')
    done = count_results(path)
    assert done == collections.Counter({"c0": 1, "c1": 1, "c2": 1, None: 1})
    app, rest = EchoApp(), []
    asyncio.run(BatchRunner(app, max_concurrency=2).run(lines, rest.append, done))
    assert [r["custom_id"] for r in rest] == ["c3", "c4", "c5"]
    assert [b["n"] for b in app.bodies] == [3, 4, 5]
    with open(path, "rb") as f:
        assert f.read().endswith(b"\n")  # the cut line is gone


def test_cancel_releases_the_shared_cap():
    async def scenario():
        app = EchoApp()
        shared = asyncio.Semaphore(2)
        runner = BatchRunner(app, max_concurrency=2, semaphore=shared)
        records = []
        task = asyncio.ensure_future(runner.run(_lines([5.0] * 10), records.append))
        while app.in_flight < 2:
            await asyncio.sleep(0.01)
        runner.cancel()
        counts = await asyncio.wait_for(task, 5)
        assert records == [] and counts.total == 0
        # Both slots are free again: another batch runs at full width.
        other = EchoApp()
        await BatchRunner(other, max_concurrency=2, semaphore=shared).run(_lines([0.02] * 4), lambda r: None)
        assert other.max_in_flight == 2 and app.in_flight == 0

    asyncio.run(scenario())


class BusyApp:
    """Answers body["busy"] times with `status`/`code`, then 200."""

    def __init__(self, status: int, code: str) -> None:
        self.status, self.code = status, code
        self.calls = collections.Counter()

    async def __call__(self, scope, receive, send) -> None:
        body = json.loads((await receive())["body"])
        self.calls[body["n"]] += 1
        busy = self.calls[body["n"]] <= body["busy"]
        payload = {"error": {"message": "busy", "code": self.code}} if busy else {"id": "ok"}
        await send({"type": "http.response.start", "status": self.status if busy else 200, "headers": []})
        await send({"type": "http.response.body", "body": json.dumps(payload).encode()})


def _busy_lines(busy: list[int]):
    return [parse_line(json.dumps({"custom_id": f"c{n}", "url": "/v1/completions", "body": {"n": n, "busy": b}}),
                       n + 1) for n, b in enumerate(busy)]


def test_busy_answers_are_retried_and_others_not(monkeypatch):
    import kvtide.batch.runner as runner_module

    monkeypatch.setattr(runner_module, "RETRY_DELAYS_S", (0.0, 0.0, 0.0))
    for status, code in ((429, "queue_full"), (503, "timeout")):
        app, records = BusyApp(status, code), []
        asyncio.run(BatchRunner(app, max_concurrency=2).run(_busy_lines([0, 2, 3, 9]), records.append))
        assert [r["error"] is None for r in records] == [True, True, True, False]
        assert [app.calls[n] for n in range(4)] == [1, 3, 4, 4]  # the last busy answer is the result
        assert records[3]["response"]["status_code"] == status
    app, records = BusyApp(503, "engine_dead"), []
    asyncio.run(BatchRunner(app, max_concurrency=2).run(_busy_lines([1]), records.append))
    assert app.calls[0] == 1 and records[0]["error"]["code"] == "engine_dead"
