"""The model runner's speculative-decoding hooks: propose before the forward pass, verify after it.

    scheduler: request r gets 1 + k tokens (its last token x and k draft slots)
    propose:   the method's proposer (spec_decode/proposer.py) fills up to k drafts d1..dk after x
    forward:   the target computes x, d1..dk in one pass (a short query row for the attention backend)
    verify:    the sampler draws the target's token y_j at every position j, given the drafts
               before it (penalties, seeds and logprobs as in non-speculative decoding); the run
               d1..da matching y_0..y_{a-1} is accepted and y_a follows it

Verification by matching a one-hot proposal is rejection sampling with q = 1 at the draft: the
draft is accepted with probability p(d) = min(1, p(d)/q(d)), and on rejection y is distributed
as p without d, renormalised (the normalised max(0, p - q)), so the output follows the target's
distribution exactly, and a seeded request draws the same tokens as without speculation.
A sampled request's drafts from a draft model come with their distribution q
instead; those go through rejection_sample (accept with min(1, p/q), else a draw from the
normalised max(0, p - q); a bonus draw after a fully accepted run), its noise drawn per output
position from the request's seed when it has one.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch

from kvtide.config import EngineConfig
from kvtide.sampling.metadata import RowState, SamplingMetadata, step_seed
from kvtide.sampling.ops import compute_top_logprobs
from kvtide.sampling.sampler import Sampler
from kvtide.scheduler.output import ModelRunnerOutput, SchedulerOutput
from kvtide.spec_decode.parallel import broadcast_drafts, broadcast_emitted
from kvtide.spec_decode.proposer import DraftSlots, Proposer, ProposerInput, RequestView, TargetStep
from kvtide.spec_decode.registry import proposer_class
from kvtide.spec_decode.rejection_sampler import accept_matching, rejection_sample
from kvtide.worker.input_batch import StepInputs


class SpecDecodeWorker:
    """What the model runner calls: the configured method's proposer (chosen by name in
    spec_decode/registry.py), verification, and the TP group's agreement on both. Requests are
    read as RequestViews (spec_decode/proposer.py): any mapping of such views serves."""

    def __init__(self, config: EngineConfig, target: torch.nn.Module, device: torch.device) -> None:
        spec = config.speculative_config
        assert spec is not None
        self.config = spec
        self.device = device
        self.generator = torch.Generator(device=device)
        self.generator.manual_seed(config.model_config.seed + 2)
        """Rejection-sampling noise of unseeded requests."""
        self.proposer: Proposer = proposer_class(spec.method).from_config(config, target, device)
        """The configured method (spec_decode/registry.py)."""

    # ---- KV cache and CUDA graphs of a draft model ---------------------------------------------
    def attention_layers(self) -> list:
        return self.proposer.attention_layers()

    def capture_graphs(self, config: EngineConfig) -> None:
        """After the caches are bound: a draft model's decode graphs (CUDA with the Triton backend;
        a no-op elsewhere). Catch-up passes and the heads' steps run eagerly."""
        self.proposer.capture_graphs(config)

    # ---- propose -------------------------------------------------------------------------------
    def propose(self, so: SchedulerOutput, requests: Mapping[str, RequestView]) -> dict[str, list[int]]:
        """Drafts for the requests given draft slots this step (possibly fewer than their slots)."""
        batch = ProposerInput([DraftSlots(requests[req_id], k) for req_id, k in so.num_draft_tokens.items()])
        return {req_id: d for req_id, d in self.proposer.propose(batch).items() if d}

    def agree(self, so: SchedulerOutput, drafts: dict[str, list[int]]) -> dict[str, list[int]]:
        """After the grammar's cut: TP rank 0's drafts on every rank of the TP group (the grammar
        lives beside rank 0 only; spec_decode/parallel.py). A no-op with one rank per stage."""
        return broadcast_drafts(so.num_draft_tokens, drafts, self.device)

    def sampled_draft_ids(self, drafts: dict[str, list[int]]) -> set[str]:
        """Requests whose drafts were sampled from a draft distribution (verified by rejection
        sampling against it) rather than proposed deterministically."""
        return {req_id for req_id in drafts if self.proposer.draft_distribution(req_id) is not None}

    # ---- verify --------------------------------------------------------------------------------
    def verify(self, sampler: Sampler, logits: torch.Tensor, states: Sequence[RequestView],
               drafts: dict[str, list[int]], vocab_size: int, output: ModelRunnerOutput) -> dict[str, list[int]]:
        """logits: per state, one row per token it may emit (its drafts + 1). Fills `output` and
        returns the tokens each state emitted ([] for a failed one)."""
        rows: list[RowState] = []
        spans: list[tuple[int, int]] = []
        for state in states:
            d = drafts.get(state.request_id, [])
            prompt, out = state.token_ids[:state.num_prompt_tokens], state.token_ids[state.num_prompt_tokens:]
            spans.append((len(rows), len(d) + 1))
            rows.extend(RowState(state.sampling_params, prompt, out + d[:j]) for j in range(len(d) + 1))
        md = SamplingMetadata.build(rows, vocab_size, logits.device)
        sampled = sampler(logits, md)
        bad = set(sampled.bad_rows)
        emitted_all: dict[str, list[int]] = {}
        logprobs_all: dict[str, list] = {}
        for state, (first, n) in zip(states, spans, strict=True):
            req_id = state.request_id
            if any(first + j in bad for j in range(n)):
                emitted_all[req_id] = []
                continue
            d = drafts.get(req_id, [])
            q = self.proposer.draft_distribution(req_id) if d else None
            if q is None:
                emitted = accept_matching([sampled.token_ids[first:first + n]], [d])[0]
                logprobs_all[req_id] = sampled.logprobs[first:first + len(emitted)]
            else:
                emitted = self._rejection_sample(sampler, logits[first:first + n], rows[first:first + n], d, q,
                                                 vocab_size)
                logprobs_all[req_id] = self._logprobs(logits[first:first + len(emitted)], emitted,
                                                      state.sampling_params.logprobs)
            emitted_all[req_id] = emitted
        # under tensor parallelism the output rank's run is every rank's (spec_decode/parallel.py)
        emitted_all = broadcast_emitted([s.request_id for s in states], drafts, emitted_all, self.device)
        for state in states:
            req_id = state.request_id
            emitted, logprobs = emitted_all[req_id], logprobs_all.get(req_id)
            if not emitted:
                output.failed[req_id] = "model produced non-finite logits"
                continue
            if logprobs is None or len(logprobs) != len(emitted):  # another rank's run (never reported)
                logprobs = [None] * len(emitted)
            d = drafts.get(req_id, [])
            output.sampled_token_ids[req_id] = emitted[-1]
            if logprobs[-1] is not None:
                output.logprobs[req_id] = logprobs[-1]  # type: ignore[assignment]
            if d:
                output.num_draft_tokens[req_id] = len(d)
                output.spec_token_ids[req_id] = emitted[:-1]
                output.spec_logprobs[req_id] = logprobs[:-1]
        return emitted_all

    def _rejection_sample(self, sampler: Sampler, logits: torch.Tensor, rows: list[RowState], drafts: list[int],
                          q: list[torch.Tensor], vocab_size: int) -> list[int]:
        """One request's drafts drawn from q, verified by rejection sampling against the target's
        processed distributions at its len(drafts) + 1 positions."""
        p = sampler.processed_probs(logits, SamplingMetadata.build(rows, vocab_size, logits.device))
        k = len(drafts)
        uniforms = torch.empty(k, device=logits.device)
        noise = torch.empty_like(p)
        seed = rows[0].params.seed
        for j, row in enumerate(rows):
            generator = self.generator
            if seed is not None:  # the draws at an output position depend on the seed and the position only
                generator = torch.Generator(device=logits.device)
                generator.manual_seed(step_seed(seed, len(row.output_token_ids)))
            if j < k:
                uniforms[j:j + 1].uniform_(generator=generator)
            noise[j].exponential_(generator=generator)
        draft_ids = torch.tensor([drafts], dtype=torch.int64, device=logits.device)
        return rejection_sample(p[None], torch.stack(q)[None], draft_ids, [k], uniforms[None], noise[None])[0]

    @staticmethod
    def _logprobs(logits: torch.Tensor, tokens: list[int], k: int | None) -> list:
        """Logprobs of tokens chosen by rejection sampling, from the raw logits (as the sampler reports)."""
        if k is None:
            return [None] * len(tokens)
        raw = logits.float().log_softmax(dim=-1)
        return [compute_top_logprobs(raw[j], token, k) for j, token in enumerate(tokens)]

    # ---- after the step ------------------------------------------------------------------------
    def observe(self, inputs: StepInputs, hidden: torch.Tensor, requests: Mapping[str, RequestView],
                drafts: dict[str, list[int]], emitted: dict[str, list[int]]) -> None:
        """After every target step (sampling or not): what the method keeps of it. `emitted`:
        tokens each sampling row emitted ([] when it failed)."""
        self.proposer.observe(TargetStep(inputs, hidden, requests, drafts, emitted))

    def forget(self, request_ids: set[str]) -> None:
        self.proposer.forget(request_ids)
