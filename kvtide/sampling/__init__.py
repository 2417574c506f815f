"""Batched token sampling on tensors: logits processors, masks, seeded draws, logprobs."""
