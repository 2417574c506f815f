"""What the engine core's process does for a pipeline's stages around each step. Under pipeline
parallelism only the last stage samples, in another process than rank 0 (the first stage, beside
the scheduler and structured output's matchers), and each stage counts only its own layers. So:
the last stage's tokens are relayed to the earlier stages with the next step (`SampledTokenRelay`),
structured output's drafts and masks are computed before the step and travel with it
(`GrammarAhead`), and the first stage's expert load joins the last stage's (`merge_expert_load`).
"""

from __future__ import annotations

import dataclasses

from kvtide.config import EngineConfig
from kvtide.scheduler.output import ModelRunnerOutput, SchedulerOutput
from kvtide.structured_output.step import GrammarStep


class SampledTokenRelay:
    """Under pipeline parallelism only the last stage samples; the earlier stages (rank 0 among
    them) learn each request's tokens from the request's next step (CachedRequestData.
    sampled_token_ids), which this relay fills from the outputs it has seen (with speculative
    decoding a step's accepted drafts, then its sampled token: every stage then proposes n-gram
    drafts from the same tokens). Tokens of a request
    that is sent again in full (after preemption) or finished are dropped: the full copy has them."""

    def __init__(self, enabled: bool) -> None:
        self.enabled = enabled
        self._pending: dict[str, list[int]] = {}
        self._live: set[str] = set()

    def record(self, output: ModelRunnerOutput) -> None:
        if not self.enabled:
            return
        for req_id, token in output.sampled_token_ids.items():
            if req_id in self._live:  # speculative decoding: the accepted drafts came first
                self._pending.setdefault(req_id, []).extend(output.spec_token_ids.get(req_id, []) + [token])
        for req_id in output.failed:  # the sampling stage appended a placeholder for it
            if req_id in self._live:
                self._pending.setdefault(req_id, []).append(0)

    def attach(self, so: SchedulerOutput) -> SchedulerOutput:
        if not self.enabled:
            return so
        for req_id in so.finished_req_ids:
            self._live.discard(req_id)
            self._pending.pop(req_id, None)
        for new in so.scheduled_new_reqs:
            self._live.add(new.request_id)
            self._pending.pop(new.request_id, None)
        if not self._pending:
            return so
        cached = [dataclasses.replace(c, sampled_token_ids=self._pending.pop(c.request_id))
                  if c.request_id in self._pending else c for c in so.scheduled_cached_reqs]
        return dataclasses.replace(so, scheduled_cached_reqs=cached)


class GrammarAhead:
    """Structured output under pipeline parallelism: the last stage samples, in another process than
    the matchers. Before each step the engine core cuts the constrained requests' drafts and fills
    their token bitmask rows (structured_output/step.py `GrammarStep.ahead`, the same calls the
    runner makes at world size 1), and every rank takes that StepBitmask with the step. The drafts
    are n-gram ones, the only method pipelines run: proposed here from the scheduler's tokens, which
    are every stage's tokens (no step is scheduled ahead of a constrained request's token), so they
    equal what each rank proposes."""

    def __init__(self, config: EngineConfig) -> None:
        spec = config.speculative_config
        self._propose = None
        if spec is not None:
            from kvtide.spec_decode.ngram import NgramProposer

            assert spec.method == "ngram", "pipeline parallelism runs n-gram drafts only"
            self._propose = NgramProposer(spec.prompt_lookup_min, spec.prompt_lookup_max).propose_one

    def attach(self, so: SchedulerOutput) -> SchedulerOutput:
        grammar = so.grammar
        if not isinstance(grammar, GrammarStep):  # none, or already computed ahead
            return so
        return dataclasses.replace(so, grammar=grammar.ahead(so.num_draft_tokens, self._propose))


def merge_expert_load(first: dict | None, last: dict | None) -> dict | None:
    """The first and last pipeline stages' per-layer expert load as one report (each stage counts
    only its own layers; a stage between them is not reported)."""
    if first is None or last is None:
        return last if first is None else first
    return {key: first[key] + last[key] for key in ("layers", "tokens", "dropped")}
