"""A generation model's server turns the pooling endpoints away with vLLM's 400 ("The model does not
support ... API"), as OpenAI's error object; the pooling servers are tested in tests/pooling."""

from __future__ import annotations

import pytest


@pytest.mark.parametrize("path,body", [("/v1/embeddings", {"input": "hi"}), ("/pooling", {"input": "hi"}),
                                       ("/classify", {"input": "hi"}), ("/score", {"text_1": "a", "text_2": "b"}),
                                       ("/v1/score", {"text_1": "a", "text_2": ["b", "c"]}),
                                       ("/rerank", {"query": "a", "documents": ["b"]}),
                                       ("/v1/rerank", {"query": "a", "documents": ["b"]}),
                                       ("/v2/rerank", {"query": "a", "documents": ["b"]})])
def test_generation_model_refuses_pooling_endpoints(server, path, body):
    with server.client() as http:
        response = http.post(path, json=body)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["type"] == "invalid_request_error"
    assert error["message"].startswith("The model does not support") and error["message"].endswith("API")
