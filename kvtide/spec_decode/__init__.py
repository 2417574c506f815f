"""Speculative decoding: verifying draft tokens against the target model."""
