"""The sampler: logits (R, V) -> one token per row, in documented, ordered steps.

  1. logprobs, if asked, from the raw model logits (before any processing, as vLLM reports them);
  2. token filters (allowed_token_ids, bad words), the engine's logits processors that may change
     the argmax (logits_processors/), logit_bias, min_tokens (stop ids masked), repetition /
     presence / frequency penalties (vLLM's order);
  3. greedy rows take the argmax;
  4. random rows: temperature, the engine's argmax-invariant logits processors, then top_k, top_p,
     min_p (transformers' warper order), then a draw
     by the exponential race argmax(p / q), q ~ Exp(1): no device sync, and a seeded row draws its
     q from its own generator, so its token does not depend on the other rows.
Rows with non-finite logits are reported, and only those requests fail.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from kvtide.sampling.metadata import SamplingMetadata
from kvtide.sampling.ops import (
    apply_min_p,
    apply_penalties,
    apply_token_filters,
    apply_top_k_top_p,
    argmax_first,
    compute_top_logprobs,
)
from kvtide.scheduler.output import TopLogprobs


@dataclass
class SamplerOutput:
    token_ids: list[int]
    logprobs: list[TopLogprobs | None]
    bad_rows: list[int]
    """Rows whose logits were not finite."""


class Sampler:
    def __init__(self, seed: int = 0) -> None:
        self.seed = seed
        self._generators: dict[torch.device, torch.Generator] = {}
        """Unseeded rows draw from one generator per device (a CPU one cannot fill a CUDA tensor)."""

    def __call__(self, logits: torch.Tensor, md: SamplingMetadata) -> SamplerOutput:
        logits = logits.float()
        # A row is bad if it holds NaN or +inf, or nothing but -inf (-inf alone is a masked token:
        # structured output, logit processors). Such a row sums to NaN or +inf, or to -inf with a
        # -inf maximum. One cheap reduction read back as floats; the exact check only for the rows
        # it flags (a sum can also overflow to +inf from finite values), and one max for masked rows.
        totals = logits.sum(dim=-1).tolist()
        bad_rows = [i for i, total in enumerate(totals) if total != total or total == math.inf]
        if bad_rows:
            suspects = logits[bad_rows]
            broken = (suspects.isnan() | suspects.isposinf()).any(dim=-1)
            bad_rows = [bad_rows[j] for j in broken.nonzero().flatten().tolist()]
        if -math.inf in totals:
            maxima = logits.amax(dim=-1).tolist()
            bad_rows = sorted(set(bad_rows) | {i for i, top in enumerate(maxima) if top == -math.inf})
        if bad_rows:
            finite = torch.ones(logits.shape[0], dtype=torch.bool, device=logits.device)
            finite[bad_rows] = False
            logits = torch.where(finite[:, None], logits, torch.zeros_like(logits))

        raw_logprobs = logits.log_softmax(dim=-1) if md.max_num_logprobs is not None else None
        logits = self._process(logits, md)

        if md.all_greedy:
            sampled = argmax_first(logits)
        else:
            sampled = self._sample_random(logits, md)
            if not md.all_random:
                sampled = torch.where(md.greedy_mask, argmax_first(logits), sampled)

        token_ids = sampled.tolist()
        logprobs: list[TopLogprobs | None] = [None] * len(token_ids)
        if raw_logprobs is not None:
            for i, row in enumerate(md.rows):
                if row.params.logprobs is not None:
                    logprobs[i] = compute_top_logprobs(raw_logprobs[i], token_ids[i], row.params.logprobs)
        return SamplerOutput(token_ids, logprobs, bad_rows)

    def processed_probs(self, logits: torch.Tensor, md: SamplingMetadata) -> torch.Tensor:
        """The distribution a random row draws from (steps 2 and 4): what speculative sampling
        compares a draft's distribution against."""
        return self._random_probs(self._process(logits.float(), md), md)

    @staticmethod
    def _process(logits: torch.Tensor, md: SamplingMetadata) -> torch.Tensor:
        """Step 2: token filters, processors that may move the argmax, bias and penalties."""
        if md.logits_processors is not None:
            if md.needs_processing:
                logits = apply_token_filters(logits.clone(), md)
            logits = md.logits_processors.apply(logits, argmax_invariant=False)
            if md.needs_processing:
                logits = apply_penalties(logits, md, filtered=True)
            return logits
        return apply_penalties(logits, md) if md.needs_processing else logits

    def _random_probs(self, logits: torch.Tensor, md: SamplingMetadata) -> torch.Tensor:
        logits = logits / md.temperature[:, None]
        if md.logits_processors is not None:
            logits = md.logits_processors.apply(logits, argmax_invariant=True)
        logits = apply_top_k_top_p(logits, md.top_k, md.top_p)
        probs = logits.softmax(dim=-1)
        if md.min_p is not None:
            probs = apply_min_p(probs, md.min_p)
        return probs

    def _sample_random(self, logits: torch.Tensor, md: SamplingMetadata) -> torch.Tensor:
        probs = self._random_probs(logits, md)
        q = torch.empty_like(probs)
        if len(md.generators) < probs.shape[0]:
            q.exponential_(generator=self._generator(q.device))
        for row, generator in md.generators.items():
            q[row].exponential_(generator=generator)
        return argmax_first(probs.div(q))

    def _generator(self, device: torch.device) -> torch.Generator:
        generator = self._generators.get(device)
        if generator is None:
            generator = torch.Generator(device=device)
            generator.manual_seed(self.seed)
            self._generators[device] = generator
        return generator

