"""Pooling models: embeddings, classification, scores and reranking over the same engine.

A pooling request is prefill-only: the scheduler computes its prompt (in chunks where attention is
causal), the runner pools the hidden states (`runner.py`, `poolers.py`) instead of sampling, and
the request ends there. The modules here without torch (`params.py`, `config.py`, `outputs.py`,
`scoring.py`) are what the engine and the API side import.
"""
