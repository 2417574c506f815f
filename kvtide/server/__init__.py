"""The OpenAI-compatible HTTP server (`kvtide serve`): FastAPI in this process, the engine core in
its own (see engine/async_llm.py and engine/core_client.py)."""
