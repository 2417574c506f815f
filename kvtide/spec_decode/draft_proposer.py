"""Proposals from a model run autoregressively over the paged KV cache (draft model, layer skip).

A step's drafts for a row whose last token x sits at position s (the target computes s .. s+k):

    catch-up   the draft computes its tokens [draft_computed, s] in one packed forward pass (the
               prompt on its first proposal, then the tokens accepted since); its logits at x give d1
    chain      d1 at s+1 gives d2, ..., d_{k-1} at s+k-1 gives d_k: k-1 single-token steps

All rows of a step go through each forward together. The draft writes its KV into the target's
block table slots (its own cache tensors for a draft model; the target's first layers' own for
layer skip, where the target's verification rewrites the same values), so prefix caching,
preemption and copy-on-write need nothing of their own: every slot the draft writes is one the
target allocated for this step. A draft model's KV is trusted only for tokens it computed in this
runner's life of the request (a new, preempted or forked request catches up from position 0), so
a prefix-cache hit never hands it KV it did not write.

A greedy request's drafts are the draft's argmax (one-hot proposals, verified by matching). Given a
sampler (draft models), a sampled request's are drawn from the draft's distribution q, processed
exactly as the target's will be (penalties, temperature, top-k/top-p, min-p, given the drafts
before), and q is kept for rejection sampling: when draft and target agree, nearly every draft is
accepted. Without one (layer skip), every draft is the argmax.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from kvtide.config import EngineConfig
from kvtide.models.loader import load_model
from kvtide.sampling.metadata import RowState, SamplingMetadata, step_seed
from kvtide.sampling.ops import argmax_first
from kvtide.sampling.sampler import Sampler
from kvtide.sampling_params import SamplingType
from kvtide.spec_decode.proposer import Proposer, ProposerInput, RequestView, TargetStep
from kvtide.worker.cpu_kernels import use_cpu_kernels
from kvtide.worker.cuda_graph import DecodeCudaGraphs, maybe_capture_decode_graphs, run_model
from kvtide.worker.input_batch import prepare_step_inputs

Forward = Callable[[torch.Tensor, torch.Tensor, object], torch.Tensor]
"""(input_ids, positions, metadata) -> hidden states (T, hidden)."""


@dataclass
class DraftSequence:
    """What prepare_step_inputs reads of a request, for the draft's own progress."""

    token_ids: list[int]
    num_computed_tokens: int
    block_ids: Sequence[int]
    uid: int


class ChainProposer(Proposer):
    """The catch-up and chain passes above, for any forward function over the paged KV cache;
    the methods below say which model runs them."""

    def __init__(self, forward: Forward, compute_logits: Callable[[torch.Tensor], torch.Tensor],
                 block_size: int, device: torch.device, catch_up: bool, sampler: Sampler | None, vocab_size: int,
                 seed: int = 0) -> None:
        self.forward = forward
        self.sampler = sampler
        """Draws sampled requests' drafts from q when given; None: argmax drafts for every request."""
        self.vocab_size = vocab_size
        self.generator = torch.Generator(device=device)
        self.generator.manual_seed(seed + 1)
        """Draft draws of unseeded requests (apart from the target's own draws)."""
        self.draft_probs: dict[str, list[torch.Tensor]] = {}
        """The last propose's q rows (one per draft) of its sampled requests."""
        self.compute_logits = compute_logits
        self.block_size = block_size
        self.device = device
        self.catch_up = catch_up
        """Whether the draft keeps KV of its own (draft model) that lags the target's; False when it
        reads the target's cache (layer skip: the target computed everything before x)."""
        self._computed: dict[str, tuple[int, int]] = {}
        """request id -> (runner uid, tokens whose draft KV is written)."""
        self._fed: dict[str, int] = {}
        """request id -> drafts the last chain fed back (their KV holds if they are accepted)."""

    def propose(self, batch: ProposerInput) -> dict[str, list[int]]:
        """k drafts per request (k: its draft slots); a request's last token is x, at position
        num_computed_tokens."""
        rows = batch.rows
        seqs: dict[str, DraftSequence] = {}
        num_sched: dict[str, int] = {}
        wanted: dict[str, int] = {}
        for state, k in rows:
            start = state.num_computed_tokens
            done = self._draft_computed(state) if self.catch_up else start
            seqs[state.request_id] = DraftSequence(list(state.token_ids), done, state.block_ids, state.uid)
            num_sched[state.request_id] = start + 1 - done
            wanted[state.request_id] = k
            if self.catch_up:
                # x's KV is the draft's own; the drafts' KV is trusted once accepted, next time.
                self._computed[state.request_id] = (state.uid, start + 1)
                self._fed[state.request_id] = k - 1
        drafts: dict[str, list[int]] = {req_id: [] for req_id in wanted}
        states = {state.request_id: state for state, _ in rows}
        self.draft_probs = {}
        while num_sched:
            inputs = prepare_step_inputs(num_sched, seqs, self.block_size, self.device)
            hidden = self.forward(inputs.input_ids, inputs.positions, inputs.metadata)
            logits = self.compute_logits(hidden[inputs.logits_indices])
            tokens = argmax_first(logits).tolist()
            self._sample_random_rows(logits, [inputs.order[i] for i in inputs.sample_rows], states, drafts, tokens)
            next_sched: dict[str, int] = {}
            for row, token in zip(inputs.sample_rows, tokens, strict=True):
                req_id = inputs.order[row]
                seq = seqs[req_id]
                seq.num_computed_tokens += num_sched[req_id]
                seq.token_ids.append(token)
                drafts[req_id].append(token)
                if len(drafts[req_id]) < wanted[req_id]:
                    next_sched[req_id] = 1
            num_sched = next_sched
        return drafts

    def _sample_random_rows(self, logits: torch.Tensor, req_ids: list[str], states: dict[str, RequestView],
                            drafts: dict[str, list[int]], tokens: list[int]) -> None:
        """Replace the argmax of sampled requests' rows by a draw from q, keeping q."""
        rows = [i for i, r in enumerate(req_ids) if states[r].sampling_params.sampling_type != SamplingType.GREEDY]
        if not rows or self.sampler is None:
            return
        row_states = []
        for i in rows:
            state = states[req_ids[i]]
            row_states.append(RowState(state.sampling_params, state.token_ids[:state.num_prompt_tokens],
                                       state.token_ids[state.num_prompt_tokens:] + drafts[req_ids[i]]))
        md = SamplingMetadata.build(row_states, self.vocab_size, logits.device)
        index = torch.tensor(rows, dtype=torch.int64, device=logits.device)
        q = self.sampler.processed_probs(logits[index], md)
        noise = torch.empty_like(q)
        noise.exponential_(generator=self.generator)
        for j, row in enumerate(row_states):
            if row.params.seed is not None:  # its own stream, apart from the target's (seed, position) draws
                g = torch.Generator(device=q.device)
                g.manual_seed(step_seed(row.params.seed, -1 - len(row.output_token_ids)))
                noise[j].exponential_(generator=g)
        drawn = argmax_first(q / noise).tolist()
        for j, i in enumerate(rows):
            tokens[i] = drawn[j]
            self.draft_probs.setdefault(req_ids[i], []).append(q[j])

    def draft_distribution(self, request_id: str) -> list[torch.Tensor] | None:
        return self.draft_probs.get(request_id)

    def observe(self, step: TargetStep) -> None:
        """After verification: the fed-back drafts that were accepted hold valid draft KV too."""
        for req_id, emitted in step.emitted.items():
            if emitted and step.drafts.get(req_id) and req_id in self._fed and req_id in self._computed:
                uid, done = self._computed[req_id]
                self._computed[req_id] = (uid, done + min(len(emitted) - 1, self._fed.pop(req_id)))

    def _draft_computed(self, state: RequestView) -> int:
        uid, done = self._computed.get(state.request_id, (-1, 0))
        return min(done, state.num_computed_tokens) if uid == state.uid else 0

    def forget(self, request_ids: set[str]) -> None:
        for req_id in request_ids:
            self._computed.pop(req_id, None)
            self._fed.pop(req_id, None)


class DraftModelProposer(ChainProposer):
    """A smaller checkpoint sharing the target's tokenizer, with KV of its own in the target's
    block tables; a sampled request's drafts are drawn from its processed distribution q."""

    def __init__(self, draft_model: torch.nn.Module, config: EngineConfig, device: torch.device) -> None:
        self.draft_model = draft_model
        self.draft_graphs: DecodeCudaGraphs | None = None
        """The draft's decode CUDA graphs: its chain steps (one token per row) replay them."""
        mc = config.model_config
        super().__init__(self._draft_forward, draft_model.compute_logits, config.cache_config.block_size, device,
                         catch_up=True, sampler=Sampler(mc.seed), vocab_size=mc.hf_config.vocab_size, seed=mc.seed)

    @classmethod
    def from_config(cls, config: EngineConfig, target: torch.nn.Module, device: torch.device) -> DraftModelProposer:
        spec, mc = config.speculative_config, config.model_config
        assert spec is not None
        draft_model = load_model(spec.model, spec.draft_hf_config, mc.dtype, mc.max_model_len, str(device))
        if device.type == "cpu":
            use_cpu_kernels(draft_model, config.device_config.cpu_weight_prepack)
        return cls(draft_model, config, device)

    def attention_layers(self) -> list:
        return self.draft_model.attention_layers()

    def capture_graphs(self, config: EngineConfig) -> None:
        """CUDA with the Triton backend (a no-op elsewhere); catch-up passes run eagerly."""
        self.draft_graphs = maybe_capture_decode_graphs(self.draft_model, config, self.device)

    def _draft_forward(self, input_ids: torch.Tensor, positions: torch.Tensor, metadata) -> torch.Tensor:
        return run_model(self.draft_model, self.draft_graphs, input_ids, positions, metadata)


class LayerSkipProposer(ChainProposer):
    """The target's own first num_layers layers, then its final norm and LM head (an early exit),
    reading and writing the target's KV of those layers. Its drafts are one-hot (argmax), so a
    seeded request keeps its non-speculative tokens."""

    @classmethod
    def from_config(cls, config: EngineConfig, target: torch.nn.Module, device: torch.device) -> LayerSkipProposer:
        spec = config.speculative_config
        assert spec is not None
        num_layers = spec.num_layers

        def early_exit(input_ids: torch.Tensor, positions: torch.Tensor, metadata) -> torch.Tensor:
            return target(input_ids, positions, metadata, num_layers=num_layers)

        return cls(early_exit, target.compute_logits, config.cache_config.block_size, device, catch_up=False,
                   sampler=None, vocab_size=config.model_config.hf_config.vocab_size)
