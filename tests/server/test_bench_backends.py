"""`kvtide bench serve --backend openai-chat | openai-responses` against a real server: every
request completes with its output length, and on the same seeded prompts (greedy) the Responses API
streams exactly the text chat completions does (the same conversation through the same template)."""

from __future__ import annotations

import json

from serve_helpers import API_KEY, MODEL_NAME

from kvtide.cli import main as kvtide_main


def _run(server, llama_dir, tmp_path, backend: str, monkeypatch) -> dict:
    monkeypatch.setenv("OPENAI_API_KEY", API_KEY)
    out = tmp_path / f"{backend}.json"
    rc = kvtide_main(["bench", "serve", "--base-url", server.base_url, "--backend", backend, "--model", MODEL_NAME,
                      "--tokenizer", llama_dir, "--num-prompts", "4", "--random-input-len", "12",
                      "--random-output-len", "6", "--max-concurrency", "2", "--seed", "3", "--output-json", str(out),
                      "--disable-tqdm"])
    assert rc == 0
    return json.loads(out.read_text())


def test_chat_and_responses_backends(server, llama_dir, tmp_path, monkeypatch):
    chat = _run(server, llama_dir, tmp_path, "openai-chat", monkeypatch)
    responses = _run(server, llama_dir, tmp_path, "openai-responses", monkeypatch)
    for result, endpoint in ((chat, "/v1/chat/completions"), (responses, "/v1/responses")):
        assert result["endpoint"] == endpoint
        assert result["completed"] == 4 and result["failed"] == 0, result["errors"]
        assert all(r["output_len"] == 6 and r["ttft"] > 0 for r in result["requests"])
        assert all(len(r["chunk_times"]) >= 1 for r in result["requests"])
    assert [r["generated_text"] for r in chat["requests"]] == [r["generated_text"] for r in responses["requests"]]
    assert [r["prompt_len"] for r in chat["requests"]] == [r["prompt_len"] for r in responses["requests"]]
