"""Pooling endpoints: /v1/embeddings, /pooling, /classify, /score, /rerank (vLLM's, OpenAI's, Jina's
and Cohere's shapes) for a server running a pooling model (`--runner pooling`)."""
