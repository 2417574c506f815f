"""KV-cache compression: quantized cache dtypes (`formats.py`), their per-layer scales (`scales.py`),
and the sink + window attention policy that bounds a request's KV (`policy.py`)."""
