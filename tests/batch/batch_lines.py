"""A batch input file of good and bad lines, and what each line must come back as."""

from __future__ import annotations

import json
import os
import sys
from dataclasses import dataclass

# tests/models' HF reference helpers, imported by module name as the other folders share theirs.
_MODELS = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "models")
if _MODELS not in sys.path:
    sys.path.insert(0, _MODELS)

from hf_reference import hf_greedy, hf_model_and_tokenizer, random_prompts  # noqa: E402

MAX_TOKENS = 12
ENGINE_FLAGS = ["--max-model-len", "256", "--max-num-seqs", "8"]
"""run-batch's small engine: the CPU KV cache it allocates is bounded by max_num_seqs * max_model_len."""
MAX_BATCH_FILE_BYTES = 16 * 1024
"""--max-batch-file-bytes of the test server."""
COMPLETION_PROMPTS = random_prompts(8, seed=11, max_words=10)
CHAT_QUESTIONS = ["what holds the keys?", "name a river", "count to three", "why blocks"]


@dataclass
class Expected:
    custom_id: str | None
    kind: str
    """'completion', 'chat', or the error code the line must get."""
    prompt: str | None = None
    status: int | None = None
    """For a line a route refuses: the HTTP status it must carry."""


def completion_body(model: str, prompt: str) -> dict:
    return {"model": model, "prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0, "ignore_eos": True}


def chat_body(model: str, question: str) -> dict:
    return {"model": model, "messages": [{"role": "user", "content": question}], "max_tokens": MAX_TOKENS,
            "temperature": 0, "ignore_eos": True}


def _line(custom_id, url, body, method="POST") -> str:
    return json.dumps({"custom_id": custom_id, "method": method, "url": url, "body": body})


def make_batch(model: str, num_lines: int = 200) -> tuple[list[str], list[Expected]]:
    """Lines (JSONL text) and, per line, what its result must be. Every tenth line is a bad one,
    each kind of bad line in turn."""
    bad_kinds = [
        ("{\"custom_id\": \"broken\", \"url\": ", Expected(None, "invalid_json")),
        (json.dumps({"method": "POST", "url": "/v1/completions", "body": {}}), Expected(None, "invalid_request")),
        (_line("{id}", "/v1/images/generations", {}), Expected("{id}", "invalid_url")),
        (_line("{id}", "/v1/embeddings", {"model": model, "input": "x"}),
         Expected("{id}", "model_not_supported", status=400)),
        (_line("{id}", "/v1/completions", {**completion_body(model, "x"), "max_tokens": 0}),
         Expected("{id}", "max_tokens", status=400)),
        (_line("{id}", "/v1/chat/completions", {**chat_body(model, "x"), "temperature": "hot"}),
         Expected("{id}", "temperature", status=400)),
        (_line("{id}", "/v1/completions", {**completion_body(model, "x"), "model": "no-such-model"}),
         Expected("{id}", "model_not_found", status=404)),
        (_line("{id}", "/v1/completions", completion_body(model, "x"), method="GET"), Expected("{id}", "invalid_method")),
        (_line("{id}", "/v1/completions", {**completion_body(model, "x"), "stream": True}),
         Expected("{id}", "invalid_body")),
        (_line("req-000", "/v1/completions", completion_body(model, "x")), Expected("req-000", "duplicate_custom_id")),
    ]
    lines, expected = [], []
    for i in range(num_lines):
        custom_id = f"req-{i:03d}"
        if i % 10 == 9:
            text, want = bad_kinds[(i // 10) % len(bad_kinds)]
            lines.append(text.replace("{id}", custom_id))
            expected.append(Expected(want.custom_id and want.custom_id.replace("{id}", custom_id), want.kind,
                                     status=want.status))
        elif i % 3 == 2:
            question = CHAT_QUESTIONS[i % len(CHAT_QUESTIONS)]
            lines.append(_line(custom_id, "/v1/chat/completions", chat_body(model, question)))
            expected.append(Expected(custom_id, "chat", question))
        else:
            prompt = COMPLETION_PROMPTS[i % len(COMPLETION_PROMPTS)]
            lines.append(_line(custom_id, "/v1/completions", completion_body(model, prompt)))
            expected.append(Expected(custom_id, "completion", prompt))
    return lines, expected


def hf_answer(model_dir: str, want: Expected) -> tuple[str, int]:
    """HF's greedy text for a good line, and its prompt's length in tokens."""
    if want.kind == "completion":
        ref = hf_greedy(model_dir, want.prompt, MAX_TOKENS)
    else:
        _, tokenizer = hf_model_and_tokenizer(model_dir)
        text = tokenizer.apply_chat_template([{"role": "user", "content": want.prompt}], tokenize=False,
                                             add_generation_prompt=True)
        ref = hf_greedy(model_dir, tokenizer.encode(text, add_special_tokens=False), MAX_TOKENS)
    return ref.text, len(ref.prompt_ids)


def check_record(model_dir: str, record: dict, want: Expected) -> None:
    """One output record against what its line must give."""
    assert record["custom_id"] == want.custom_id
    assert record["id"].startswith("batch_req_")
    if want.kind in ("completion", "chat"):
        assert record["error"] is None, record
        response = record["response"]
        assert response["status_code"] == 200 and response["request_id"] == response["body"]["id"]
        body = response["body"]
        text = body["choices"][0]["text"] if want.kind == "completion" else body["choices"][0]["message"]["content"]
        ref_text, num_prompt_tokens = hf_answer(model_dir, want)
        assert text == ref_text, (want, text, ref_text)
        assert body["usage"]["prompt_tokens"] == num_prompt_tokens
        assert body["usage"]["completion_tokens"] == MAX_TOKENS
        return
    error = record["error"]
    assert error is not None, record
    if want.status is None:
        assert record["response"] is None
        assert error["code"] == want.kind, record
        return
    response = record["response"]
    assert response["status_code"] == want.status, record
    server_error = response["body"]["error"]
    assert error["message"] == server_error["message"]
    assert want.kind in (server_error["param"], server_error["code"]), record
