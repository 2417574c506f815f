"""The model runner's speculative-decoding hooks: propose before the forward pass, verify after it.

    scheduler: request r gets 1 + k tokens (its last token x and k draft slots)
    propose:   the method's proposer fills up to k drafts d1..dk after x
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

import logging

import torch

from kvtide.config import EngineConfig
from kvtide.models.loader import load_model
from kvtide.sampling.metadata import RowState, SamplingMetadata, step_seed
from kvtide.sampling.ops import compute_top_logprobs
from kvtide.sampling.sampler import Sampler
from kvtide.scheduler.output import ModelRunnerOutput, SchedulerOutput
from kvtide.spec_decode.draft_proposer import ChainProposer
from kvtide.spec_decode.ngram import NgramProposer
from kvtide.spec_decode.parallel import broadcast_drafts, broadcast_emitted
from kvtide.spec_decode.rejection_sampler import accept_matching, rejection_sample
from kvtide.worker.cpu_kernels import use_cpu_kernels
from kvtide.worker.cuda_graph import DecodeCudaGraphs, maybe_capture_decode_graphs, run_model
from kvtide.worker.input_batch import CachedRequestState, StepInputs

logger = logging.getLogger(__name__)


class SpecDecodeWorker:
    def __init__(self, config: EngineConfig, target: torch.nn.Module, device: torch.device) -> None:
        spec = config.speculative_config
        assert spec is not None
        self.config = spec
        self.device = device
        self.block_size = config.cache_config.block_size
        vocab_size = config.model_config.hf_config.vocab_size
        draft_sampler = Sampler(config.model_config.seed)
        self.generator = torch.Generator(device=device)
        self.generator.manual_seed(config.model_config.seed + 2)
        """Rejection-sampling noise of unseeded requests."""
        self.draft_model: torch.nn.Module | None = None
        self.draft_graphs: DecodeCudaGraphs | None = None
        """A draft model's decode CUDA graphs: its chain steps (one token per row) replay them."""
        self.ngram = self.chain = self.medusa = self.eagle = None
        self._last_hidden: dict[str, tuple[int, torch.Tensor]] = {}
        """Medusa: request id -> (runner uid, the target's hidden state that predicted its last token)."""
        if spec.method == "ngram":
            self.ngram = NgramProposer(spec.prompt_lookup_min, spec.prompt_lookup_max)
        elif spec.method == "layer_skip":
            layers = spec.num_layers

            def early_exit(input_ids, positions, metadata):
                return target(input_ids, positions, metadata, num_layers=layers)

            # one-hot proposals: a seeded request keeps its non-speculative tokens
            self.chain = ChainProposer(early_exit, target.compute_logits, self.block_size, device, catch_up=False,
                                       sampler=None, vocab_size=vocab_size)
        elif spec.method == "draft_model":
            mc = config.model_config
            self.draft_model = load_model(spec.model, spec.draft_hf_config, mc.dtype, mc.max_model_len, str(device))
            if device.type == "cpu":
                use_cpu_kernels(self.draft_model, config.device_config.cpu_weight_prepack)
            self.chain = ChainProposer(self._draft_forward, self.draft_model.compute_logits, self.block_size,
                                       device, catch_up=True, sampler=draft_sampler, vocab_size=vocab_size,
                                       seed=config.model_config.seed)
        elif spec.method == "medusa":
            from kvtide.spec_decode.heads.medusa import MedusaHeads

            self.medusa = MedusaHeads.from_pretrained(spec.model, config.model_config.hf_config,
                                                      config.model_config.dtype, device)
            if self.medusa.num_heads < spec.num_speculative_tokens:
                raise ValueError(f"speculative_config: num_speculative_tokens={spec.num_speculative_tokens} but the "
                                 f"Medusa checkpoint has only {self.medusa.num_heads} heads")
        elif spec.method in ("eagle", "eagle3"):
            from kvtide.spec_decode.eagle_proposer import EagleProposer
            from kvtide.spec_decode.heads.eagle import EagleDraftModel

            mc = config.model_config
            self.draft_model = EagleDraftModel.from_pretrained(spec.model, spec.method, target, mc.hf_config,
                                                               mc.max_model_len, mc.dtype, device)
            self.eagle = EagleProposer(self.draft_model, target, self.block_size, device)
        else:
            raise ValueError(f"speculative method {spec.method!r} is not available in this build")

    # ---- KV cache and CUDA graphs of a draft model ---------------------------------------------
    def attention_layers(self) -> list:
        return self.draft_model.attention_layers() if self.draft_model is not None else []

    def capture_graphs(self, config: EngineConfig) -> None:
        """After the caches are bound: a draft model's decode graphs (CUDA with the Triton backend;
        a no-op elsewhere). Catch-up passes and the heads' steps run eagerly."""
        if self.config.method == "draft_model":
            self.draft_graphs = maybe_capture_decode_graphs(self.draft_model, config, self.device)

    def _draft_forward(self, input_ids: torch.Tensor, positions: torch.Tensor, metadata) -> torch.Tensor:
        return run_model(self.draft_model, self.draft_graphs, input_ids, positions, metadata)

    # ---- propose -------------------------------------------------------------------------------
    def propose(self, so: SchedulerOutput, requests: dict[str, CachedRequestState]) -> dict[str, list[int]]:
        """Drafts for the requests given draft slots this step (possibly fewer than their slots)."""
        rows = [(requests[req_id], k) for req_id, k in so.num_draft_tokens.items()]
        if self.ngram is not None:
            drafts = {state.request_id: self.ngram.propose_one(state.token_ids, k) for state, k in rows}
        elif self.chain is not None:
            drafts = self.chain.propose(rows)
        elif self.eagle is not None:
            drafts = self.eagle.propose(rows)
        else:
            drafts = self._propose_medusa(rows)
        return {req_id: d for req_id, d in drafts.items() if d}

    def agree(self, so: SchedulerOutput, drafts: dict[str, list[int]]) -> dict[str, list[int]]:
        """After the grammar's cut: TP rank 0's drafts on every rank of the TP group (the grammar
        lives beside rank 0 only; spec_decode/parallel.py). A no-op with one rank per stage."""
        return broadcast_drafts(so.num_draft_tokens, drafts, self.device)

    def _propose_medusa(self, rows: list[tuple[CachedRequestState, int]]) -> dict[str, list[int]]:
        ready = [(state, k) for state, k in rows
                 if self._last_hidden.get(state.request_id, (-1, None))[0] == state.uid]
        if not ready:
            return {}
        hidden = torch.stack([self._last_hidden[state.request_id][1] for state, _ in ready])
        tokens = self.medusa(hidden).argmax(dim=-1).tolist()  # (R, heads)
        return {state.request_id: row[:k] for (state, k), row in zip(ready, tokens, strict=True)}

    def sampled_draft_ids(self, drafts: dict[str, list[int]]) -> set[str]:
        """Requests whose drafts were sampled from a draft distribution (verified by rejection
        sampling against it) rather than proposed deterministically."""
        if self.chain is None:
            return set()
        return {req_id for req_id in drafts if self.chain.draft_probs.get(req_id) is not None}

    # ---- verify --------------------------------------------------------------------------------
    def verify(self, sampler: Sampler, logits: torch.Tensor, states: list[CachedRequestState],
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
            q = self.chain.draft_probs.get(req_id) if self.chain is not None and d else None
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
                if self.chain is not None:
                    self.chain.verified(req_id, len(emitted) - 1)
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
    def observe(self, inputs: StepInputs, hidden: torch.Tensor, requests: dict[str, CachedRequestState],
                drafts: dict[str, list[int]], emitted: dict[str, list[int]]) -> None:
        """After every target step (sampling or not): what the heads keep of the target's hidden
        states. `emitted`: tokens each sampling row emitted ([] when it failed)."""
        if self.medusa is not None:
            first = 0
            hidden_rows = hidden[inputs.logits_indices]
            for i in inputs.sample_rows:
                req_id = inputs.order[i]
                tokens = emitted.get(req_id, [])
                if tokens:
                    self._last_hidden[req_id] = (requests[req_id].uid, hidden_rows[first + len(tokens) - 1])
                first += len(drafts.get(req_id, ())) + 1
        if self.eagle is not None:
            qsl = inputs.metadata.query_start_loc_cpu
            verified = {}
            for i, req_id in enumerate(inputs.order):
                known = qsl[i + 1] - qsl[i] - len(drafts.get(req_id, ()))
                tokens = emitted.get(req_id)
                verified[req_id] = known if tokens is None else (known + len(tokens) - 1 if tokens else 0)
            self.eagle.observe(inputs, hidden, requests, verified)

    def forget(self, request_ids: set[str]) -> None:
        for req_id in request_ids:
            self._last_hidden.pop(req_id, None)
        for proposer in (self.chain, self.eagle):
            if proposer is not None:
                proposer.forget(request_ids)
