"""OutputProcessor: EngineCoreOutputs -> RequestOutputs.

Per sequence it detokenizes incrementally, applies stop strings (asking the core to abort the
sequence), and gathers logprobs; per user request it joins the n samples into one RequestOutput.
Output kinds as vLLM's: CUMULATIVE (everything so far), DELTA (only what is new; streaming) and
FINAL_ONLY (one output when all samples finished; offline).
"""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field

from kvtide.engine.detokenizer import IncrementalDetokenizer
from kvtide.engine.messages import EngineCoreOutput
from kvtide.outputs import CompletionOutput, Logprob, PromptLogprobs, RequestOutput, SampleLogprobs
from kvtide.pooling.outputs import PoolingOutput, PoolingRequestOutput
from kvtide.sampling_params import SamplingParams


class RequestOutputKind(enum.Enum):
    CUMULATIVE = 0
    DELTA = 1
    FINAL_ONLY = 2


@dataclass
class SequenceState:
    """One generated sequence (one of the n samples of a request)."""

    index: int
    detokenizer: IncrementalDetokenizer | None
    token_ids: list[int] = field(default_factory=list)
    logprobs: SampleLogprobs | None = None
    cumulative_logprob: float | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    sent_text_len: int = 0
    sent_tokens: int = 0
    sent_finish: bool = False


@dataclass
class RequestState:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams
    output_kind: RequestOutputKind
    sequences: dict[str, SequenceState]
    """engine-core request id -> sequence (one per sample)."""
    prompt_logprobs: PromptLogprobs | None = None
    num_cached_tokens: int = 0
    arrival_time: float = field(default_factory=time.time)
    first_token_time: float | None = None
    error: str | None = None
    kv_transfer_params: dict | None = None
    pooled: list[float] | None = None
    """A pooling request's output, once its prompt is computed."""

    @property
    def finished(self) -> bool:
        return all(s.finish_reason is not None for s in self.sequences.values())


class OutputProcessor:
    def __init__(self, tokenizer) -> None:
        self.tokenizer = tokenizer
        self.requests: dict[str, RequestState] = {}
        self._child_to_parent: dict[str, str] = {}

    def add_request(self, request_id: str, prompt: str | None, prompt_token_ids: list[int],
                    params: SamplingParams, child_ids: list[str], output_kind: RequestOutputKind,
                    arrival_time: float | None = None) -> None:
        sequences = {}
        track_cumulative = params.logprobs is not None or (params.best_of or 0) > params.n or \
            params.use_beam_search
        for index, child_id in enumerate(child_ids):
            detok = IncrementalDetokenizer(self.tokenizer, prompt_token_ids, params) \
                if params.detokenize and self.tokenizer is not None else None
            sequences[child_id] = SequenceState(
                index=index, detokenizer=detok, logprobs=[] if params.logprobs is not None else None,
                cumulative_logprob=0.0 if track_cumulative else None)
            self._child_to_parent[child_id] = request_id
        self.requests[request_id] = RequestState(
            request_id, prompt, prompt_token_ids, params, output_kind, sequences,
            prompt_logprobs=[None] if params.prompt_logprobs is not None else None,
            arrival_time=arrival_time or time.time())

    def has_unfinished_requests(self) -> bool:
        return bool(self.requests)

    def child_ids(self, request_id: str) -> list[str]:
        state = self.requests.get(request_id)
        return list(state.sequences) if state else []

    def abort_requests(self, request_ids: list[str]) -> list[str]:
        """Forget requests; returns the engine-core ids of their unfinished sequences."""
        to_abort = []
        for request_id in request_ids:
            state = self.requests.pop(request_id, None)
            if state is None:
                continue
            for child_id, seq in state.sequences.items():
                self._child_to_parent.pop(child_id, None)
                if seq.finish_reason is None:
                    to_abort.append(child_id)
        return to_abort

    def process_outputs(self, outputs: list[EngineCoreOutput]
                        ) -> tuple[list[RequestOutput | PoolingRequestOutput], list[str]]:
        """Returns (request outputs to deliver, engine-core ids to abort because of stop strings)."""
        touched: dict[str, RequestState] = {}
        to_abort: list[str] = []
        now = time.time()
        for out in outputs:
            parent_id = self._child_to_parent.get(out.request_id)
            if parent_id is None:
                continue
            state = self.requests[parent_id]
            seq = state.sequences[out.request_id]
            state.num_cached_tokens = max(state.num_cached_tokens, out.num_cached_tokens)
            if out.error is not None:
                state.error = out.error
            if out.kv_transfer_params is not None:
                state.kv_transfer_params = out.kv_transfer_params
            if out.pooling_output is not None:
                state.pooled = out.pooling_output
            if out.new_prompt_logprobs and state.prompt_logprobs is not None:
                self._add_prompt_logprobs(state, out.new_prompt_logprobs)
            if out.new_token_ids and state.first_token_time is None:
                state.first_token_time = now
            stopped_by_string = self._add_tokens(seq, out)
            if stopped_by_string and not out.finished:
                to_abort.append(out.request_id)
            touched[parent_id] = state
        results = []
        for parent_id, state in touched.items():
            result = self._make_output(state)
            if result is not None:
                results.append(result)
            if state.finished:
                del self.requests[parent_id]
                for child_id in state.sequences:
                    self._child_to_parent.pop(child_id, None)
        return results, to_abort

    def _add_tokens(self, seq: SequenceState, out: EngineCoreOutput) -> bool:
        if seq.finish_reason is not None:
            return False
        seq.token_ids.extend(out.new_token_ids)
        if out.new_logprobs and seq.cumulative_logprob is not None:
            for token_id, (lp, rank, top_ids, top_lps) in zip(out.new_token_ids, out.new_logprobs, strict=True):
                if seq.logprobs is not None:
                    seq.logprobs.append(self._logprob_dict(token_id, lp, rank, top_ids, top_lps))
                seq.cumulative_logprob += lp
        stopped = False
        if seq.detokenizer is not None:
            stopped = seq.detokenizer.update(out.new_token_ids, out.finished)
        if stopped:
            seq.finish_reason, seq.stop_reason = "stop", seq.detokenizer.stop_reason  # type: ignore[union-attr]
        elif out.finished:
            seq.finish_reason, seq.stop_reason = out.finish_reason, out.stop_reason
        return stopped

    def _logprob_dict(self, token_id: int, lp: float, rank: int, top_ids: list[int],
                      top_lps: list[float]) -> dict[int, Logprob]:
        entry = {token_id: Logprob(lp, rank, self._decode_one(token_id))}
        for r, (tid, tlp) in enumerate(zip(top_ids, top_lps, strict=True), start=1):
            if tid not in entry:
                entry[tid] = Logprob(tlp, r, self._decode_one(tid))
        return entry

    def _decode_one(self, token_id: int) -> str | None:
        if self.tokenizer is None:
            return None
        return self.tokenizer.convert_ids_to_tokens(token_id)

    def _add_prompt_logprobs(self, state: RequestState, entries) -> None:
        # Positions the prefix cache served (prompt_logprobs_start) have none: None, as position 0.
        while len(state.prompt_logprobs) <= state.num_cached_tokens:  # type: ignore[arg-type]
            state.prompt_logprobs.append(None)  # type: ignore[union-attr]
        for (lp, rank, top_ids, top_lps) in entries:
            position = len(state.prompt_logprobs)  # type: ignore[arg-type]
            token_id = state.prompt_token_ids[position]
            state.prompt_logprobs.append(  # type: ignore[union-attr]
                self._logprob_dict(token_id, lp, rank, top_ids, top_lps))

    def _make_output(self, state: RequestState) -> RequestOutput | PoolingRequestOutput | None:
        kind = state.output_kind
        finished = state.finished
        if state.pooled is not None:
            return PoolingRequestOutput(state.request_id, PoolingOutput(state.pooled), state.prompt_token_ids,
                                        finished, state.num_cached_tokens, state.prompt)
        if kind == RequestOutputKind.FINAL_ONLY and not finished:
            return None
        completions = []
        for seq in state.sequences.values():
            completion = self._completion(seq, kind)
            if completion is not None:
                completions.append(completion)
        if kind == RequestOutputKind.DELTA and not completions and not finished:
            return None
        if kind != RequestOutputKind.DELTA:
            n = state.params.n
            if state.params.best_of and state.params.best_of > n and finished:
                completions.sort(key=lambda c: c.cumulative_logprob or 0.0, reverse=True)
                completions = sorted(completions[:n], key=lambda c: c.index)
        metrics = {"arrival_time": state.arrival_time}
        if state.first_token_time is not None:
            metrics["first_token_time"] = state.first_token_time
        return RequestOutput(
            request_id=state.request_id, prompt=state.prompt, prompt_token_ids=state.prompt_token_ids,
            prompt_logprobs=state.prompt_logprobs, outputs=completions, finished=finished,
            num_cached_tokens=state.num_cached_tokens, metrics=metrics, kv_transfer_params=state.kv_transfer_params)

    def _completion(self, seq: SequenceState, kind: RequestOutputKind) -> CompletionOutput | None:
        detok = seq.detokenizer
        finished = seq.finish_reason is not None
        text_end = detok.emittable_length(finished) if detok else 0
        full_text = detok.text if detok else ""
        num_tokens = len(seq.token_ids)
        if kind != RequestOutputKind.DELTA:
            return CompletionOutput(seq.index, full_text[:text_end], list(seq.token_ids),
                                    seq.cumulative_logprob, seq.logprobs, seq.finish_reason, seq.stop_reason)
        if text_end == seq.sent_text_len and num_tokens == seq.sent_tokens and \
                (not finished or seq.sent_finish):
            return None
        text = full_text[seq.sent_text_len:text_end]
        token_ids = seq.token_ids[seq.sent_tokens:]
        logprobs = seq.logprobs[seq.sent_tokens:] if seq.logprobs is not None else None
        seq.sent_text_len, seq.sent_tokens = text_end, num_tokens
        seq.sent_finish = finished
        return CompletionOutput(seq.index, text, token_ids, seq.cumulative_logprob, logprobs,
                                seq.finish_reason, seq.stop_reason)
