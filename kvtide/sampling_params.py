"""SamplingParams: how to pick tokens and when to stop, validated at construction.

Every bad value raises ValueError naming the parameter and its allowed range, before a request
touches the engine. Field names and defaults follow vLLM's so user code carries over.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from enum import IntEnum

_GREEDY_EPS = 1e-5
MAX_LOGPROBS = 20


class SamplingType(IntEnum):
    GREEDY = 0
    RANDOM = 1
    RANDOM_SEED = 2


@dataclass
class SamplingParams:
    n: int = 1
    """Number of completions returned for the prompt."""
    best_of: int | None = None
    """Completions generated before the n best (by cumulative logprob) are returned."""
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    """-1 (or 0, accepted as vLLM does) disables top-k."""
    min_p: float = 0.0
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    max_tokens: int | None = 16
    """None: up to max_model_len."""
    min_tokens: int = 0
    logprobs: int | None = None
    """Top logprobs returned per generated token (the chosen one is always included)."""
    prompt_logprobs: int | None = None
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    logit_bias: dict[int, float] | None = None
    cache_salt: str | None = None
    """Tenant key mixed into the first prefix-cache block hash: different salts never share KV."""
    detokenize: bool = True
    # Filled by the engine: EOS of the model, so stop checks need no tokenizer.
    all_stop_token_ids: set[int] = field(default_factory=set, repr=False)

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        elif self.stop is None:
            self.stop = []
        else:
            self.stop = list(self.stop)
        self.stop_token_ids = list(self.stop_token_ids or [])
        if self.top_k == 0:
            self.top_k = -1
        if self.logit_bias is not None:
            self.logit_bias = {int(k): float(v) for k, v in self.logit_bias.items()}
        self._verify()
        self.all_stop_token_ids = set(self.stop_token_ids)

    def _verify(self) -> None:
        def bad(name: str, rule: str, value: object) -> ValueError:
            return ValueError(f"{name} must be {rule}, got {value!r}")

        if not isinstance(self.n, int) or self.n < 1:
            raise bad("n", "an integer >= 1", self.n)
        if self.best_of is not None and (not isinstance(self.best_of, int) or self.best_of < self.n):
            raise bad("best_of", f"an integer >= n ({self.n})", self.best_of)
        for name, lo, hi in (("presence_penalty", -2.0, 2.0), ("frequency_penalty", -2.0, 2.0)):
            value = getattr(self, name)
            if not _finite(value) or not lo <= value <= hi:
                raise bad(name, f"in [{lo}, {hi}]", value)
        if not _finite(self.repetition_penalty) or self.repetition_penalty <= 0:
            raise bad("repetition_penalty", "a finite number > 0", self.repetition_penalty)
        if not _finite(self.temperature) or self.temperature < 0:
            raise bad("temperature", "a finite number >= 0", self.temperature)
        if not _finite(self.top_p) or not 0 < self.top_p <= 1:
            raise bad("top_p", "in (0, 1]", self.top_p)
        if not isinstance(self.top_k, int) or isinstance(self.top_k, bool) or self.top_k < -1:
            raise bad("top_k", "-1 (disabled) or an integer >= 1", self.top_k)
        if not _finite(self.min_p) or not 0 <= self.min_p <= 1:
            raise bad("min_p", "in [0, 1]", self.min_p)
        if self.seed is not None and (not isinstance(self.seed, int) or isinstance(self.seed, bool)):
            raise bad("seed", "an integer", self.seed)
        if self.max_tokens is not None and (not isinstance(self.max_tokens, int) or self.max_tokens < 1):
            raise bad("max_tokens", "an integer >= 1", self.max_tokens)
        if not isinstance(self.min_tokens, int) or self.min_tokens < 0:
            raise bad("min_tokens", "an integer >= 0", self.min_tokens)
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise bad("min_tokens", f"<= max_tokens ({self.max_tokens})", self.min_tokens)
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, int) or not 0 <= value <= MAX_LOGPROBS):
                raise bad(name, f"an integer in [0, {MAX_LOGPROBS}]", value)
        if any(not isinstance(s, str) or s == "" for s in self.stop):
            raise bad("stop", "a list of non-empty strings", self.stop)
        if any(not isinstance(t, int) or t < 0 for t in self.stop_token_ids):
            raise bad("stop_token_ids", "a list of integers >= 0", self.stop_token_ids)
        if self.logit_bias is not None:
            for token_id, bias in self.logit_bias.items():
                if token_id < 0 or not _finite(bias) or not -100 <= bias <= 100:
                    raise bad("logit_bias", "a map of token ids >= 0 to biases in [-100, 100]",
                              {token_id: bias})
        if self.cache_salt is not None and (not isinstance(self.cache_salt, str) or not self.cache_salt):
            raise bad("cache_salt", "a non-empty string", self.cache_salt)

    @property
    def sampling_type(self) -> SamplingType:
        if self.temperature < _GREEDY_EPS:
            return SamplingType.GREEDY
        return SamplingType.RANDOM if self.seed is None else SamplingType.RANDOM_SEED

    @property
    def num_samples(self) -> int:
        """Sequences generated for this prompt (best_of if set, else n)."""
        return self.best_of or self.n

    def clone(self, **overrides: object) -> SamplingParams:
        fields = {k: v for k, v in self.__dict__.items() if k != "all_stop_token_ids"}
        fields.update(overrides)
        fields["stop"] = list(self.stop or [])
        fields["stop_token_ids"] = list(self.stop_token_ids or [])
        params = SamplingParams(**fields)  # type: ignore[arg-type]
        params.all_stop_token_ids = set(self.all_stop_token_ids) | set(params.stop_token_ids or [])
        return params


def _finite(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
