"""kvtide's extension for LLM programs (kvtide.lang): scoring choices over a cached prefix."""
