"""SamplingParams: how to pick tokens and when to stop, validated at construction.

Every bad value raises ValueError naming the parameter and its allowed range, before a request
touches the engine. Field names and defaults follow vLLM's so user code carries over.
"""

from __future__ import annotations

import dataclasses
import functools
import json as _json
import math
from dataclasses import dataclass, field
from enum import IntEnum

from kvtide.wire_codec import encode

_GREEDY_EPS = 1e-5
GENERATION_DEFAULT_FIELDS = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty")
"""Fields a model's generation_config.json may default for requests that leave them unset
(engine/generation_defaults.py)."""
MAX_LOGPROBS = 20
MAX_STRUCTURED_SPEC_BYTES = 256 * 1024
"""UTF-8 bytes of a structured-output JSON schema (as JSON text): compile time and memory grow with
it (a 256 KiB schema of tool calls compiles in ~3 s and ~75 MB against a 49k vocabulary)."""
MAX_STRUCTURED_GRAMMAR_BYTES = 16 * 1024
"""UTF-8 bytes of a regex, EBNF grammar or structural tag: they compile to larger automata per
byte than schemas (16 KiB: ~0.3 s; a 256 KiB regex passes 1 GiB while compiling)."""
MAX_STRUCTURED_CHOICES = 256
"""Strings of a structured-output choice."""
MAX_STRUCTURED_CHOICE_BYTES = 8 * 1024
"""UTF-8 bytes of all choice strings together: long alternatives compile slowly (8 x 1 KiB: ~1 s)."""


@dataclass
class StructuredOutputsParams:
    """Constrain the output to a JSON schema, a regex, one of some strings, an EBNF/GBNF grammar,
    any JSON object, or an xgrammar structural tag (vLLM's names; exactly one is set). Each is
    compiled to a token-level grammar; the sampler masks every token the grammar forbids."""

    json: str | dict | None = None
    """A JSON schema (a dict or its JSON text)."""
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    """EBNF (xgrammar's / GBNF syntax, the start rule named `root`)."""
    json_object: bool | None = None
    """Any JSON object (OpenAI's response_format {"type": "json_object"})."""
    structural_tag: str | None = None
    """An xgrammar structural tag (JSON text): free text with constrained tagged sections."""
    disable_any_whitespace: bool = False
    """JSON without optional whitespace (compact output, fewer tokens)."""
    disable_additional_properties: bool = False
    """Accepted for vLLM compatibility: xgrammar compiles schemas strictly anyway (an object takes
    properties the schema does not name only where it says additionalProperties)."""
    whitespace_pattern: str | None = None
    """Accepted for vLLM compatibility and refused if set: xgrammar has no such knob."""
    reasoning_end_token_ids: list[int] | None = None
    """Set by the server's reasoning parser: the grammar applies only once the output holds this
    token sequence (the end of the reasoning section, e.g. the ids of "</think>")."""

    KINDS = ("json", "regex", "choice", "grammar", "json_object", "structural_tag")

    def __post_init__(self) -> None:
        set_kinds = [k for k in self.KINDS if getattr(self, k) not in (None, False)]
        if len(set_kinds) != 1:
            raise ValueError("structured_outputs: exactly one of json, regex, choice, grammar, json_object "
                             f"or structural_tag must be set, got {set_kinds or 'none'}")
        if self.json is not None:
            if isinstance(self.json, str):
                try:
                    parsed = _json.loads(self.json)
                except ValueError as e:
                    raise ValueError(f"structured_outputs.json: not valid JSON ({e})") from e
            else:
                parsed = self.json
            if not isinstance(parsed, (dict, bool)):
                raise ValueError("structured_outputs.json: a JSON schema is an object, got "
                                 f"{type(parsed).__name__}")
        for name in ("regex", "grammar", "structural_tag"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, str) or not value):
                raise ValueError(f"structured_outputs.{name} must be a non-empty string, got {value!r}")
        if self.choice is not None:
            if (not isinstance(self.choice, (list, tuple)) or not self.choice
                    or not all(isinstance(c, str) and c for c in self.choice)):
                raise ValueError("structured_outputs.choice must be a non-empty list of non-empty strings, "
                                 f"got {self.choice!r}")
            self.choice = list(self.choice)
        self._check_sizes()
        if self.json_object not in (None, True):
            raise ValueError(f"structured_outputs.json_object must be true, got {self.json_object!r}")
        if self.reasoning_end_token_ids is not None:
            if not self.reasoning_end_token_ids or not all(_is_int(t) and t >= 0
                                                           for t in self.reasoning_end_token_ids):
                raise ValueError("structured_outputs.reasoning_end_token_ids must be a non-empty list of "
                                 f"token ids, got {self.reasoning_end_token_ids!r}")
            self.reasoning_end_token_ids = list(self.reasoning_end_token_ids)
        if self.whitespace_pattern is not None:
            raise ValueError("structured_outputs.whitespace_pattern is not supported by the xgrammar backend; "
                             "use disable_any_whitespace")

    def _check_sizes(self) -> None:
        """Bounded compile work: each constraint is compiled against the whole vocabulary, in time
        and memory that grow with its text, so its size is capped before anything is queued."""
        if self.choice is not None:
            if len(self.choice) > MAX_STRUCTURED_CHOICES:
                raise ValueError(f"structured_outputs.choice: at most {MAX_STRUCTURED_CHOICES} choices, got "
                                 f"{len(self.choice)}")
            size = sum(len(c.encode("utf-8", "surrogatepass")) for c in self.choice)
            if size > MAX_STRUCTURED_CHOICE_BYTES:
                raise ValueError(f"structured_outputs.choice: at most {MAX_STRUCTURED_CHOICE_BYTES} bytes of "
                                 f"choices together, got {size}")
        for name in ("json", "regex", "grammar", "structural_tag"):
            value = getattr(self, name)
            if value is None:
                continue
            text = value if isinstance(value, str) else _json.dumps(value)
            size = len(text.encode("utf-8", "surrogatepass"))
            limit = MAX_STRUCTURED_SPEC_BYTES if name == "json" else MAX_STRUCTURED_GRAMMAR_BYTES
            if size > limit:
                raise ValueError(f"structured_outputs.{name}: at most {limit} bytes, got {size}")

    @property
    def kind(self) -> str:
        return next(k for k in self.KINDS if getattr(self, k) not in (None, False))

    def spec(self) -> str:
        """The constraint as canonical text: with the kind and the whitespace options, the key the
        compiled grammar is cached under."""
        value = getattr(self, self.kind)
        if self.kind == "json":
            value = _json.loads(value) if isinstance(value, str) else value
            return _json.dumps(value, separators=(",", ":"))  # key order kept: it is the output's order
        if self.kind == "choice":
            return _json.dumps(value)
        return "" if self.kind == "json_object" else value

    def key(self) -> tuple[str, str, bool, bool]:
        return (self.kind, self.spec(), self.disable_any_whitespace, self.disable_additional_properties)

    @classmethod
    def from_value(cls, value: object) -> StructuredOutputsParams | None:
        """Accept an instance, a dict of its fields (as JSON or the wire carries it), or None."""
        if value is None or isinstance(value, cls):
            return value
        if isinstance(value, dict):
            unknown = set(value) - {f for f in cls.__dataclass_fields__}
            if unknown:
                raise ValueError(f"structured_outputs: unknown field(s) {sorted(unknown)}")
            return cls(**value)
        raise ValueError(f"structured_outputs must be a StructuredOutputsParams or a dict, got "
                         f"{type(value).__name__}")


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
    use_beam_search: bool = False
    """Beam search instead of sampling: keep the beam_width best partial sequences each step and
    return the n best finished ones, as HF `generate(num_beams=..., do_sample=False)` does.
    temperature, top_p, top_k, min_p and seed do not apply."""
    beam_width: int | None = None
    """Beams kept per step with use_beam_search (default: n); must be >= n."""
    length_penalty: float = 1.0
    """Beam search: a finished beam scores cumulative_logprob / generated_len ** length_penalty."""
    early_stopping: bool | str = False
    """Beam search: True stops once beam_width beams finished; False stops when no running beam can
    beat the worst finished one (HF's heuristic); "never" runs canonical beam search."""
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    """-1 disables top-k. 0 is refused (the issue's rule), not silently read as 'disabled'."""
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
    prompt_logprobs_start: int | None = None
    """With prompt_logprobs: the first prompt position whose logprob is wanted. The prefix cache may
    then serve the prompt's full blocks before it (those positions come back as None), so scoring
    continuations of a cached prefix computes only the continuations. None: every position, and the
    prompt is computed in full."""
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    logit_bias: dict[int, float] | None = None
    cache_salt: str | None = None
    """Tenant key mixed into the first prefix-cache block hash: different salts never share KV."""
    detokenize: bool = True
    speculation: bool = True
    """With a speculative-config engine, let this request be sped up by draft tokens (False: it
    always decodes one token per step; its output is the same either way for greedy requests)."""
    structured_outputs: StructuredOutputsParams | None = None
    """Constrain the output to a schema, regex, choice or grammar (structured_output/)."""
    kv_transfer_params: dict | None = None
    """For a KV connector (kvtide/disagg/): {"do_remote_decode": true} asks a prefill instance to
    stage the prompt's KV for a decode instance; the params it returns, sent to a decode instance,
    let it load the prompt instead of computing it (vLLM's kv_transfer_params)."""
    bad_words: list[str] | None = None
    """Words never generated: each one's token sequence (with and without a leading space) is
    cut by masking its last token wherever the output already ends with the ones before it."""
    allowed_token_ids: list[int] | None = None
    """Only these tokens may be generated (every other logit is masked)."""
    truncate_prompt_tokens: int | None = None
    """Keep only the prompt's last k tokens (-1: as many as max_model_len leaves room for)."""
    extra_args: dict | None = None
    """Per-request arguments for logits processors (vLLM's extra_args; the server's vllm_xargs)."""
    bad_words_token_ids: list[list[int]] | None = field(default=None, repr=False)
    """Filled by the engine from bad_words and the tokenizer: the token sequences to cut."""
    # Filled by the engine: EOS of the model, so stop checks need no tokenizer.
    all_stop_token_ids: set[int] = field(default_factory=set, repr=False)

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        elif self.stop is None:
            self.stop = []
        elif isinstance(self.stop, (list, tuple)):
            self.stop = list(self.stop)
        else:
            raise ValueError(f"stop must be a string or a list of non-empty strings, got {self.stop!r}")
        if not isinstance(self.stop_token_ids, (list, tuple, type(None))):
            raise ValueError(f"stop_token_ids must be a list of integers >= 0, got {self.stop_token_ids!r}")
        self.stop_token_ids = list(self.stop_token_ids or [])
        if self.logit_bias is not None:
            self.logit_bias = _normalize_logit_bias(self.logit_bias)
        self.structured_outputs = StructuredOutputsParams.from_value(self.structured_outputs)
        if isinstance(self.bad_words, str):
            self.bad_words = [self.bad_words]
        for name in ("bad_words", "allowed_token_ids"):
            value = getattr(self, name)
            if isinstance(value, tuple):
                setattr(self, name, list(value))
        self._verify()
        self.all_stop_token_ids = set(self.stop_token_ids)

    def _verify(self) -> None:
        def bad(name: str, rule: str, value: object) -> ValueError:
            return ValueError(f"{name} must be {rule}, got {value!r}")

        if not _is_int(self.n) or self.n < 1:
            raise bad("n", "an integer >= 1", self.n)
        if self.best_of is not None and (not _is_int(self.best_of) or self.best_of < self.n):
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
        if not _is_int(self.top_k) or self.top_k < -1 or self.top_k == 0:
            raise bad("top_k", "-1 (disabled) or an integer >= 1", self.top_k)
        if not _finite(self.min_p) or not 0 <= self.min_p <= 1:
            raise bad("min_p", "in [0, 1]", self.min_p)
        if self.seed is not None and not _is_int(self.seed):
            raise bad("seed", "an integer", self.seed)
        if self.max_tokens is not None and (not _is_int(self.max_tokens) or self.max_tokens < 1):
            raise bad("max_tokens", "an integer >= 1", self.max_tokens)
        if not _is_int(self.min_tokens) or self.min_tokens < 0:
            raise bad("min_tokens", "an integer >= 0", self.min_tokens)
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise bad("min_tokens", f"<= max_tokens ({self.max_tokens})", self.min_tokens)
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            if value is not None and (not _is_int(value) or not 0 <= value <= MAX_LOGPROBS):
                raise bad(name, f"an integer in [0, {MAX_LOGPROBS}]", value)
        if self.prompt_logprobs_start is not None and (
                self.prompt_logprobs is None or not _is_int(self.prompt_logprobs_start)
                or self.prompt_logprobs_start < 1):
            raise bad("prompt_logprobs_start", "an integer >= 1, with prompt_logprobs set", self.prompt_logprobs_start)
        if any(not isinstance(s, str) or s == "" for s in self.stop):
            raise bad("stop", "a list of non-empty strings", self.stop)
        if any(not _is_int(t) or t < 0 for t in self.stop_token_ids):
            raise bad("stop_token_ids", "a list of integers >= 0", self.stop_token_ids)
        if self.logit_bias is not None:
            for token_id, bias in self.logit_bias.items():
                if token_id < 0 or not _finite(bias) or not -100 <= bias <= 100:
                    raise bad("logit_bias", "a map of token ids >= 0 to biases in [-100, 100]",
                              {token_id: bias})
        if self.cache_salt is not None and (not isinstance(self.cache_salt, str) or not self.cache_salt):
            raise bad("cache_salt", "a non-empty string", self.cache_salt)
        if not isinstance(self.speculation, bool):
            raise bad("speculation", "a bool", self.speculation)
        if self.kv_transfer_params is not None and not _is_wire_object(self.kv_transfer_params):
            # it travels to the engine core as msgpack, which holds integers of at most 64 bits
            raise bad("kv_transfer_params", "an object of JSON values (integers of at most 64 bits)",
                      self.kv_transfer_params)
        self._verify_token_filters(bad)
        self._verify_beam_search(bad)

    def _verify_token_filters(self, bad) -> None:
        """bad_words, allowed_token_ids, truncate_prompt_tokens and extra_args (token ids are
        checked against the vocabulary by the engine's input processor)."""
        if self.bad_words is not None and (not isinstance(self.bad_words, list) or any(
                not isinstance(w, str) or not w.strip() for w in self.bad_words)):
            raise bad("bad_words", "a list of non-blank strings", self.bad_words)
        if self.allowed_token_ids is not None and (
                not isinstance(self.allowed_token_ids, list) or not self.allowed_token_ids
                or any(not _is_int(t) or t < 0 for t in self.allowed_token_ids)):
            raise bad("allowed_token_ids", "a non-empty list of token ids >= 0", self.allowed_token_ids)
        if self.truncate_prompt_tokens is not None and (
                not _is_int(self.truncate_prompt_tokens)
                or (self.truncate_prompt_tokens < 1 and self.truncate_prompt_tokens != -1)):
            raise bad("truncate_prompt_tokens", "an integer >= 1 or -1 (the model's limit)",
                      self.truncate_prompt_tokens)
        if self.extra_args is not None and not _is_wire_object(self.extra_args):
            raise bad("extra_args", "an object of JSON values (integers of at most 64 bits)", self.extra_args)
        if self.bad_words_token_ids is not None and (
                not isinstance(self.bad_words_token_ids, list)
                or any(not isinstance(w, list) or not w or any(not _is_int(t) or t < 0 for t in w)
                       for w in self.bad_words_token_ids)):
            raise bad("bad_words_token_ids", "a list of non-empty token id lists", self.bad_words_token_ids)

    @property
    def filters_tokens(self) -> bool:
        """Whether the sampler masks tokens for this request before any penalty (allowed_token_ids,
        bad words)."""
        return bool(self.allowed_token_ids) or bool(self.bad_words_token_ids)

    def _verify_beam_search(self, bad) -> None:
        if not isinstance(self.use_beam_search, bool):
            raise bad("use_beam_search", "a bool", self.use_beam_search)
        if self.beam_width is not None and (not _is_int(self.beam_width) or self.beam_width < self.n):
            raise bad("beam_width", f"an integer >= n ({self.n})", self.beam_width)
        if not _finite(self.length_penalty):
            raise bad("length_penalty", "a finite number", self.length_penalty)
        if not (isinstance(self.early_stopping, bool) or self.early_stopping == "never"):
            raise bad("early_stopping", "True, False or 'never'", self.early_stopping)
        if not self.use_beam_search:
            return
        unsupported = {"best_of": self.best_of is not None, "stop": bool(self.stop),
                       "min_tokens": self.min_tokens > 0, "logit_bias": bool(self.logit_bias),
                       "presence_penalty": self.presence_penalty != 0.0,
                       "frequency_penalty": self.frequency_penalty != 0.0,
                       "repetition_penalty": self.repetition_penalty != 1.0,
                       "bad_words": bool(self.bad_words), "allowed_token_ids": bool(self.allowed_token_ids)}
        for name, is_set in unsupported.items():
            if is_set:
                raise ValueError(f"{name} is not supported with use_beam_search=True")

    @property
    def sampling_type(self) -> SamplingType:
        if self.temperature < _GREEDY_EPS:
            return SamplingType.GREEDY
        return SamplingType.RANDOM if self.seed is None else SamplingType.RANDOM_SEED

    @property
    def num_beams(self) -> int:
        """Beams kept per step (use_beam_search only)."""
        return self.beam_width if self.beam_width is not None else self.n

    @property
    def num_samples(self) -> int:
        """Sequences generated for this prompt (best_of if set, else n)."""
        return self.best_of or self.n

    @property
    def unset_fields(self) -> frozenset[str]:
        """The GENERATION_DEFAULT_FIELDS the caller did not pass (a model's defaults may fill them)."""
        return frozenset(GENERATION_DEFAULT_FIELDS) - self.__dict__.get("_given", frozenset(GENERATION_DEFAULT_FIELDS))

    def with_defaults(self, defaults: dict[str, object]) -> SamplingParams:
        """These params with `defaults` filling the fields left unset (beam search takes none: it
        does not sample)."""
        fill = {k: v for k, v in defaults.items() if k in self.unset_fields}
        if not fill or self.use_beam_search:
            return self
        return self.clone(**fill)

    def clone(self, **overrides: object) -> SamplingParams:
        fields = {k: v for k, v in self.__dict__.items() if k not in ("all_stop_token_ids", "_given")}
        fields["stop"] = list(self.stop or [])
        fields["stop_token_ids"] = list(self.stop_token_ids or [])
        fields["logit_bias"] = dict(self.logit_bias) if self.logit_bias is not None else None
        for name in ("bad_words", "allowed_token_ids"):
            value = getattr(self, name)
            fields[name] = list(value) if value is not None else None
        if self.bad_words_token_ids is not None:
            fields["bad_words_token_ids"] = [list(w) for w in self.bad_words_token_ids]
        fields.update(overrides)
        params = SamplingParams(**fields)  # type: ignore[arg-type]
        params.all_stop_token_ids = set(self.all_stop_token_ids) | set(params.stop_token_ids or [])
        params._given = self.__dict__.get("_given", frozenset()) | frozenset(overrides)
        return params


def _remember_given_fields(init):
    """SamplingParams' __init__, also remembering which GENERATION_DEFAULT_FIELDS the caller
    passed: a default is indistinguishable from a value otherwise."""
    names = [f.name for f in dataclasses.fields(SamplingParams)]

    @functools.wraps(init)
    def __init__(self, *args, **kwargs):
        init(self, *args, **kwargs)
        given = set(kwargs) | set(names[:len(args)])
        self._given = frozenset(given & set(GENERATION_DEFAULT_FIELDS))

    return __init__


SamplingParams.__init__ = _remember_given_fields(SamplingParams.__init__)  # type: ignore[method-assign]


@dataclass
class BeamSearchParams:
    """vLLM's `LLM.beam_search` parameters, mapped onto SamplingParams(use_beam_search=True)."""

    beam_width: int
    max_tokens: int
    ignore_eos: bool = False
    temperature: float = 0.0
    """Only 0.0: beam search here is deterministic, as HF's is."""
    length_penalty: float = 1.0
    include_stop_str_in_output: bool = False

    def to_sampling_params(self) -> SamplingParams:
        if self.temperature != 0.0:
            raise ValueError(f"temperature must be 0.0 for beam search, got {self.temperature!r}")
        return SamplingParams(n=self.beam_width, use_beam_search=True, beam_width=self.beam_width,
                              max_tokens=self.max_tokens, ignore_eos=self.ignore_eos,
                              length_penalty=self.length_penalty,
                              include_stop_str_in_output=self.include_stop_str_in_output)


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_wire_object(value: object) -> bool:
    """A dict the API process's wire encoder (kvtide/wire_codec.py) can send to the engine core."""
    if not isinstance(value, dict):
        return False
    try:
        encode([value])
    except (TypeError, OverflowError, ValueError):
        return False
    return True


def _normalize_logit_bias(logit_bias: object) -> dict[int, float]:
    """Keys may be ints or, as JSON carries them, decimal strings ("50256")."""
    def bad() -> ValueError:
        return ValueError(f"logit_bias must be a map of token ids >= 0 to biases in [-100, 100], "
                          f"got {logit_bias!r}")

    if not isinstance(logit_bias, dict):
        raise bad()
    normalized = {}
    for key, value in logit_bias.items():
        if not (_is_int(key) or (isinstance(key, str) and key.strip().lstrip("-").isdigit())):
            raise bad()
        if not _finite(value):
            raise bad()
        normalized[int(key)] = float(value)  # type: ignore[arg-type]
    return normalized


def _finite(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
