"""KV-cache compression: quantized cache dtypes (`formats.py`), their per-layer scales (`scales.py`)
and the token-dropping policies that bound a request's KV (`token_dropping.py`)."""
