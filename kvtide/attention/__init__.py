"""Attention backends over the paged KV cache; torch_ref is the oracle every backend is checked against."""
