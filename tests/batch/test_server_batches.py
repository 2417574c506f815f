"""/v1/files and /v1/batches with the official `openai` client against a tiny-model server.

A batch's good lines come back with Hugging Face's greedy answers, its bad lines in the error file
with the very error the route gives the same body over HTTP; cancel stops a running batch; unknown
ids are 404, oversized files and wrong purposes 400.
"""

from __future__ import annotations

import json
import time

import httpx
import openai
import pytest
from batch_lines import MAX_BATCH_FILE_BYTES as MAX_FILE_BYTES
from batch_lines import Expected, chat_body, check_record, completion_body
from serve_helpers import API_KEY, MODEL_NAME, wait_idle

# One worker runs this folder: its conftest starts the batch server once, at the folder's first test.
pytestmark = pytest.mark.xdist_group("batch")

QUESTIONS = ["what holds the keys?", "name a river", "count to three", "why blocks", "seven lattice", "harbor"]


@pytest.fixture(scope="module")
def client(batch_server):
    return openai.OpenAI(base_url=batch_server.url("/v1"), api_key=API_KEY, max_retries=0, timeout=60.0)


def _jsonl(items) -> bytes:
    return b"".join((item if isinstance(item, str) else json.dumps(item)).encode() + b"\n" for item in items)


def _wait(client, batch_id: str, timeout_s: float = 90.0):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        batch = client.batches.retrieve(batch_id)
        if batch.status in ("completed", "failed", "cancelled", "expired"):
            return batch
        time.sleep(0.1)
    raise AssertionError(f"batch {batch_id} still {batch.status} after {timeout_s} s")


def test_batch_round_trip(client, batch_server, llama_dir):
    url = "/v1/chat/completions"
    bad_body = {**chat_body(MODEL_NAME, "x"), "temperature": "hot"}
    items = [{"custom_id": f"q{i}", "method": "POST", "url": url, "body": chat_body(MODEL_NAME, q)}
             for i, q in enumerate(QUESTIONS)]
    items += [{"custom_id": "bad-body", "method": "POST", "url": url, "body": bad_body},
              {"custom_id": "bad-url", "method": "POST", "url": "/v1/completions",
               "body": completion_body(MODEL_NAME, "x")},
              '{"custom_id": "torn", ',
              {"custom_id": "q0", "method": "POST", "url": url, "body": chat_body(MODEL_NAME, "again")}]
    data = _jsonl(items)
    uploaded = client.files.create(file=("questions.jsonl", data), purpose="batch")
    assert (uploaded.purpose, uploaded.bytes, uploaded.filename) == ("batch", len(data), "questions.jsonl")
    assert client.files.retrieve(uploaded.id).bytes == len(data)
    assert client.files.content(uploaded.id).content == data

    batch = client.batches.create(input_file_id=uploaded.id, endpoint=url, completion_window="24h",
                                  metadata={"job": "round-trip"})
    assert batch.status in ("validating", "in_progress") and batch.metadata == {"job": "round-trip"}
    batch = _wait(client, batch.id)
    assert batch.status == "completed", batch
    assert (batch.request_counts.total, batch.request_counts.completed, batch.request_counts.failed) == (10, 6, 4)
    assert batch.id in [b.id for b in client.batches.list()]
    with pytest.raises(openai.ConflictError):
        client.batches.cancel(batch.id)  # a finished batch

    outputs = [json.loads(line) for line in client.files.content(batch.output_file_id).text.splitlines()]
    assert [r["custom_id"] for r in outputs] == [f"q{i}" for i in range(len(QUESTIONS))]
    for record, question in zip(outputs, QUESTIONS, strict=True):
        check_record(llama_dir, record, Expected(record["custom_id"], "chat", question))
    # The same body over HTTP gets the same answer.
    body = chat_body(MODEL_NAME, QUESTIONS[0])
    ignore_eos = body.pop("ignore_eos")
    direct = client.chat.completions.create(**body, extra_body={"ignore_eos": ignore_eos})
    assert direct.choices[0].message.content == outputs[0]["response"]["body"]["choices"][0]["message"]["content"]

    errors = {r["custom_id"]: r for r in
              (json.loads(line) for line in client.files.content(batch.error_file_id).text.splitlines())}
    assert sorted(errors, key=str) == sorted(["bad-body", "bad-url", None, "q0"], key=str)
    http = httpx.post(batch_server.url(url), json=bad_body, headers=batch_server.headers, timeout=30)
    assert http.status_code == 400 == errors["bad-body"]["response"]["status_code"]
    assert errors["bad-body"]["response"]["body"] == http.json()
    assert errors["bad-body"]["error"]["message"] == http.json()["error"]["message"]
    assert errors["bad-url"]["error"]["code"] == "invalid_url"
    assert errors[None]["error"]["code"] == "invalid_json"
    assert errors["q0"]["error"]["code"] == "duplicate_custom_id"

    assert client.files.delete(uploaded.id).deleted
    with pytest.raises(openai.NotFoundError):
        client.files.retrieve(uploaded.id)


def test_cancel_stops_a_running_batch(client, batch_server):
    items = [{"custom_id": f"long{i}", "method": "POST", "url": "/v1/completions",
              "body": {**completion_body(MODEL_NAME, f"story {i}"), "max_tokens": 400}} for i in range(40)]
    uploaded = client.files.create(file=("long.jsonl", _jsonl(items)), purpose="batch")
    batch = client.batches.create(input_file_id=uploaded.id, endpoint="/v1/completions", completion_window="24h")
    cancelling = client.batches.cancel(batch.id)
    assert cancelling.status in ("cancelling", "cancelled")
    batch = _wait(client, batch.id, timeout_s=30)
    assert batch.status == "cancelled" and batch.cancelled_at is not None
    counts = batch.request_counts
    assert counts.total == 40 and counts.completed + counts.failed < 40
    if batch.output_file_id is not None:
        assert len(client.files.content(batch.output_file_id).text.splitlines()) == counts.completed
    assert client.batches.cancel(batch.id).status == "cancelled"  # again: nothing changes
    wait_idle(batch_server)  # the lines in flight were aborted in the engine, not left running


def test_bad_input(client):
    unknown_file = "file-" + "0" * 24
    for call in (lambda: client.files.retrieve(unknown_file), lambda: client.files.content(unknown_file),
                 lambda: client.files.retrieve("../../etc/passwd"), lambda: client.batches.retrieve("batch_nope"),
                 lambda: client.batches.create(input_file_id=unknown_file, endpoint="/v1/completions",
                                               completion_window="24h")):
        with pytest.raises(openai.NotFoundError):
            call()
    line = _jsonl([{"custom_id": "a", "method": "POST", "url": "/v1/completions",
                    "body": completion_body(MODEL_NAME, "x")}])
    for size in (MAX_FILE_BYTES + 1, 4 * MAX_FILE_BYTES):  # within the multipart slack, and far over it
        big = line * (size // len(line) + 1)
        with pytest.raises(openai.BadRequestError) as e:
            client.files.create(file=("big.jsonl", big), purpose="batch")
        assert e.value.body["code"] == "file_too_large"
    with pytest.raises(openai.BadRequestError) as e:
        client.files.create(file=("many.jsonl", b'{"custom_id": "x"}\n' * 65), purpose="batch")
    assert "--max-batch-file-lines" in e.value.body["message"]
    with pytest.raises(openai.BadRequestError) as e:
        client.files.create(file=("tune.jsonl", line), purpose="fine-tune")
    assert e.value.body["param"] == "purpose"
    uploaded = client.files.create(file=("one.jsonl", line), purpose="batch")
    with pytest.raises(openai.BadRequestError) as e:
        client.batches.create(input_file_id=uploaded.id, endpoint="/v1/embeddings", completion_window="24h")
    assert "does not serve embeddings" in e.value.body["message"]
    with pytest.raises(openai.BadRequestError):
        client.batches.create(input_file_id=uploaded.id, endpoint="/v1/completions", completion_window="1h")
