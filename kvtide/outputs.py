"""What the engine returns: RequestOutput and CompletionOutput, field names as vLLM's."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class Logprob:
    logprob: float
    rank: int | None = None
    """1-based rank of the token among the vocabulary by logprob."""
    decoded_token: str | None = None


# One dict per position: token id -> Logprob (the chosen token plus the top-k).
SampleLogprobs = list[dict[int, Logprob]]
PromptLogprobs = list[dict[int, Logprob] | None]


@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: float | None
    logprobs: SampleLogprobs | None
    finish_reason: str | None = None
    """'stop' (EOS, stop token or stop string), 'length' (max_tokens or max_model_len), 'abort'."""
    stop_reason: int | str | None = None
    """The stop string or stop token id that ended the sequence; None for EOS or length."""

    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    prompt_logprobs: PromptLogprobs | None
    outputs: list[CompletionOutput]
    finished: bool
    num_cached_tokens: int = 0
    """Prompt tokens whose KV came from the prefix cache (or a KV connector's tiers)."""
    metrics: dict[str, float] = field(default_factory=dict)
    kv_transfer_params: dict | None = None
    """What a KV connector returned as the request ended (a prefill instance's staged prompt)."""


@dataclass
class BeamSearchSequence:
    """One beam of `LLM.beam_search` (vLLM's shape)."""

    tokens: list[int]
    """Prompt and generated token ids."""
    logprobs: SampleLogprobs
    cum_logprob: float = 0.0
    text: str | None = None
    """The decoded prompt and generation."""
    finish_reason: str | None = None
    stop_reason: int | str | None = None


@dataclass
class BeamSearchOutput:
    sequences: list[BeamSearchSequence]
    """Best first."""
