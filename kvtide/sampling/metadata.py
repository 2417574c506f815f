"""SamplingMetadata: one step's sampling parameters as batched tensors (one row per request)."""

from __future__ import annotations

import hashlib
from dataclasses import dataclass

import torch

from kvtide.sampling_params import SamplingParams, SamplingType


@dataclass
class RowState:
    """What the sampler needs of one request: its parameters and token history."""

    params: SamplingParams
    prompt_token_ids: list[int]
    output_token_ids: list[int]


@dataclass
class SamplingMetadata:
    all_greedy: bool
    all_random: bool
    temperature: torch.Tensor
    """(R,) float32; 1.0 on greedy rows so division is harmless."""
    greedy_mask: torch.Tensor
    """(R,) bool."""
    top_k: torch.Tensor | None
    """(R,) int64, vocab size where disabled; None when no row uses it."""
    top_p: torch.Tensor | None
    min_p: torch.Tensor | None
    generators: dict[int, torch.Generator]
    """row -> generator for seeded rows, seeded from (seed, output position) so a draw does not
    depend on the batch it lands in, nor on preemption."""
    rows: list[RowState]
    needs_processing: bool
    """Any penalty, logit bias or min_tokens mask to apply."""
    max_num_logprobs: int | None
    """Largest `logprobs` asked for in the batch (None: no row wants logprobs)."""

    @classmethod
    def build(cls, rows: list[RowState], vocab_size: int, device: torch.device | str = "cpu") -> SamplingMetadata:
        types = [r.params.sampling_type for r in rows]
        greedy = [t == SamplingType.GREEDY for t in types]
        temperature = torch.tensor([1.0 if g else r.params.temperature for g, r in zip(greedy, rows, strict=True)],
                                   dtype=torch.float32, device=device)
        top_k = top_p = min_p = None
        random_rows = [r for g, r in zip(greedy, rows, strict=True) if not g]
        if any(r.params.top_k > 0 for r in random_rows):
            top_k = torch.tensor([r.params.top_k if r.params.top_k > 0 else vocab_size for r in rows],
                                 dtype=torch.int64, device=device)
        if any(r.params.top_p < 1.0 for r in random_rows):
            top_p = torch.tensor([r.params.top_p for r in rows], dtype=torch.float32, device=device)
        if any(r.params.min_p > 0.0 for r in random_rows):
            min_p = torch.tensor([r.params.min_p for r in rows], dtype=torch.float32, device=device)
        generators = {}
        for i, r in enumerate(rows):
            if types[i] == SamplingType.RANDOM_SEED:
                g = torch.Generator(device=device)
                g.manual_seed(step_seed(r.params.seed, len(r.output_token_ids)))  # type: ignore[arg-type]
                generators[i] = g
        needs_processing = any(
            r.params.presence_penalty or r.params.frequency_penalty or r.params.repetition_penalty != 1.0
            or r.params.logit_bias or len(r.output_token_ids) < r.params.min_tokens for r in rows)
        wanted = [r.params.logprobs for r in rows if r.params.logprobs is not None]
        return cls(all_greedy=all(greedy), all_random=not any(greedy), temperature=temperature,
                   greedy_mask=torch.tensor(greedy, dtype=torch.bool, device=device), top_k=top_k,
                   top_p=top_p, min_p=min_p, generators=generators, rows=rows,
                   needs_processing=needs_processing, max_num_logprobs=max(wanted) if wanted else None)


def step_seed(seed: int, position: int) -> int:
    """A 63-bit seed for the draw at output `position` of a request seeded with `seed`."""
    digest = hashlib.blake2b(f"{seed}:{position}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") & ((1 << 63) - 1)
