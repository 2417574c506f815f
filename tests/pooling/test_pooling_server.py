"""The pooling endpoints of real `kvtide serve` processes: an embedding server (Qwen3 embedding
layout), a cross-encoder server (Qwen3ForSequenceClassification), through
the official openai client (embeddings, base64 included) and plain HTTP (score, rerank, classify,
pooling), with Hugging Face's outputs as the reference; each bad input answers 400 with OpenAI's
error object."""

from __future__ import annotations

import base64
import os

import numpy as np
import openai
import pytest
import torch
from pooling_reference import PROMPTS, cosine_distance, hf_embedding, hf_ids, hf_logits
from serve_helpers import API_KEY, MODEL_NAME, start_server, wait_ready

QWEN3 = dict(head_dim=32)


@pytest.fixture(scope="module")
def servers(checkpoint_factory):
    embedder = checkpoint_factory("Qwen3Model", seed=3, matryoshka_dimensions=[32, 64], **QWEN3)
    classifier = checkpoint_factory("Qwen3ForSequenceClassification", seed=11, num_labels=1, **QWEN3)
    flags = ["--max-num-seqs", "8", "--kv-cache-memory", "16MiB"]
    # No API key: `kvtide bench serve` sends none.
    handles = {"embed": (embedder, start_server(embedder, *flags, "--pooler-config", '{"pooling_type": "LAST"}',
                                                api_key=None)),
               "classify": (classifier, start_server(classifier, *flags, "--runner", "pooling", api_key=None))}
    try:
        yield {name: (model_dir, wait_ready(handle)) for name, (model_dir, handle) in handles.items()}
    finally:
        for _, handle in handles.values():
            handle.stop()
            os.unlink(handle.log_path)


def client_of(handle) -> openai.OpenAI:
    return openai.OpenAI(base_url=handle.url("/v1"), api_key=API_KEY, max_retries=0, timeout=60)


def assert_error(response, status: int, param: str | None = None) -> dict:
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert error["message"] and error["type"]
    if param is not None:
        assert error["param"] == param, error
    return error


def test_embeddings_through_the_openai_client(servers):
    model_dir, handle = servers["embed"]
    client = client_of(handle)
    result = client.embeddings.create(model=MODEL_NAME, input=PROMPTS)
    assert [d.index for d in result.data] == list(range(len(PROMPTS)))
    for prompt, item in zip(PROMPTS, result.data, strict=True):
        assert cosine_distance(item.embedding, hf_embedding(model_dir, prompt, "LAST")) < 1e-5
    assert result.usage.prompt_tokens == result.usage.total_tokens > len(PROMPTS)
    encoded = client.embeddings.create(model=MODEL_NAME, input="hello world", encoding_format="base64")
    decoded = np.frombuffer(base64.b64decode(encoded.data[0].embedding), dtype="<f4").copy()  # little-endian float32
    assert decoded.shape == (128,)
    assert cosine_distance(decoded, hf_embedding(model_dir, "hello world", "LAST")) < 1e-5
    ids = client.embeddings.create(model=MODEL_NAME, input=[hf_ids(model_dir, "hi"), hf_ids(model_dir, "x")])
    assert cosine_distance(ids.data[1].embedding, hf_embedding(model_dir, "x", "LAST")) < 1e-5
    short = client.embeddings.create(model=MODEL_NAME, input="hello world", dimensions=32)
    assert len(short.data[0].embedding) == 32
    full = hf_embedding(model_dir, "hello world", "LAST", normalize=False)
    assert cosine_distance(short.data[0].embedding, full[:32]) < 1e-5


def test_embedding_bad_inputs_answer_400(servers):
    _, handle = servers["embed"]
    with handle.client() as http:
        for body, param in [({"input": ""}, "input"), ({"input": []}, "input"), ({"input": ["a", ""]}, "input"),
                            ({"input": "hi", "encoding_format": "int8"}, "encoding_format"),
                            ({"input": "hi", "dimensions": 48}, "dimensions"),
                            ({"input": "word " * 400}, "input")]:
            assert_error(http.post("/v1/embeddings", json={"model": MODEL_NAME, **body}), 400, param)
        truncated = http.post("/v1/embeddings", json={"input": "word " * 400, "truncate_prompt_tokens": 10})
        assert truncated.status_code == 200 and truncated.json()["usage"]["prompt_tokens"] == 10
        pooled = http.post("/pooling", json={"input": ["hello world"]}).json()
        assert pooled["data"][0]["object"] == "pooling" and len(pooled["data"][0]["data"]) == 128
        assert_error(http.post("/classify", json={"input": "hi"}), 400)  # an embedder does not classify
        assert_error(http.post("/v1/completions", json={"prompt": "hi", "max_tokens": 2}), 400)
        assert_error(http.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}]}), 400)


def test_embedding_model_scores_by_cosine(servers):
    model_dir, handle = servers["embed"]
    with handle.client() as http:
        data = http.post("/v1/score", json={"text_1": "hello world", "text_2": ["hello there", "x"]}).json()["data"]
    for item, text in zip(data, ["hello there", "x"], strict=True):
        expected = float(torch.dot(hf_embedding(model_dir, "hello world", "LAST"), hf_embedding(model_dir, text, "LAST")))
        assert abs(item["score"] - expected) < 1e-5


def test_cross_encoder_score_and_rerank(servers):
    model_dir, handle = servers["classify"]
    query = "which animal is quick"
    documents = ["the quick brown fox", "a lazy dog sleeps", "quick animals run fast", "weather today", "x"]
    reference = [float(torch.sigmoid(hf_logits(model_dir, query, d)[0])) for d in documents]
    best_first = sorted(range(len(documents)), key=lambda i: -reference[i])
    with handle.client() as http:
        for path in ("/score", "/v1/score"):
            data = http.post(path, json={"model": MODEL_NAME, "text_1": query, "text_2": documents}).json()["data"]
            assert [abs(d["score"] - r) < 1e-5 for d, r in zip(data, reference, strict=True)] == [True] * 5
        pairs = http.post("/score", json={"text_1": [query, "b"], "text_2": documents[:2]}).json()["data"]
        assert abs(pairs[1]["score"] - float(torch.sigmoid(hf_logits(model_dir, "b", documents[1])[0]))) < 1e-5
        for path in ("/rerank", "/v1/rerank", "/v2/rerank"):
            body = http.post(path, json={"query": query, "documents": documents, "top_n": 3}).json()
            assert [r["index"] for r in body["results"]] == best_first[:3]
            assert body["results"][0]["document"]["text"] == documents[best_first[0]]
            assert body["usage"]["total_tokens"] > 0
        bare = http.post("/rerank", json={"query": query, "documents": documents, "return_documents": False}).json()
        assert [r["index"] for r in bare["results"]] == best_first and bare["results"][0]["document"] is None
        logits = http.post("/classify", json={"input": [f"{query}", "x"], "activation": False}).json()["data"]
        assert abs(logits[1]["probs"][0] - float(hf_logits(model_dir, "x")[0])) < 1e-4
        assert_error(http.post("/score", json={"text_1": [query, "b"], "text_2": documents}), 400, "text_2")
        assert_error(http.post("/rerank", json={"query": query, "documents": []}), 400, "documents")
        assert_error(http.post("/v1/embeddings", json={"input": "hi"}), 400)  # a cross-encoder does not embed


def test_pooling_metrics_are_counted_apart(servers):
    _, handle = servers["embed"]
    with handle.client() as http:
        http.post("/v1/embeddings", json={"input": ["a b c", "d"]}).raise_for_status()
        text = http.get("/metrics").text
    requests = [line for line in text.splitlines() if line.startswith("kvtide:pooling_requests_total")]
    tokens = [line for line in text.splitlines() if line.startswith("kvtide:pooling_prompt_tokens_total")]
    assert requests and float(requests[0].rsplit(" ", 1)[1]) >= 2
    assert tokens and float(tokens[0].rsplit(" ", 1)[1]) >= 6
    generation = [line for line in text.splitlines() if line.startswith("kvtide:generation_tokens_total")]
    assert generation and float(generation[0].rsplit(" ", 1)[1]) == 0


@pytest.mark.parametrize("backend", ["openai-embeddings", "rerank"])
def test_bench_serve_pooling_backends(servers, backend):
    import argparse
    import asyncio

    from kvtide.bench.pooling import format_pooling_report, run_pooling_benchmark
    from kvtide.bench.serve import add_serve_args

    _, handle = servers["embed" if backend == "openai-embeddings" else "classify"]
    parser = argparse.ArgumentParser()
    add_serve_args(parser)
    args = parser.parse_args(["--base-url", handle.base_url, "--backend", backend, "--max-concurrency", "4",
                              "--embedding-batch-size", "2", "--rerank-documents", "3"])
    result = asyncio.run(run_pooling_benchmark(args, texts=PROMPTS))
    assert result["failed"] == 0, result["errors"]
    assert result["completed"] == (3 if backend == "openai-embeddings" else len(PROMPTS))
    assert result["sequence_throughput"] > 0 and result["total_input_tokens"] > 0
    assert "Sequence throughput" in format_pooling_report(result)
