"""The paged KV cache's bookkeeping: blocks, ref counts, prefix hashes. No tensors live here."""
