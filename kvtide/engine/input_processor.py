"""InputProcessor: user prompt + SamplingParams -> validated EngineCoreRequests.

Everything a user can get wrong is checked here, raising ValueError that names the parameter,
before any engine state changes. A request with n > 1 becomes n engine-core requests
("{index}_{request_id}", seed + index when seeded), as in vLLM; all but the first are forked from
the first (`fork_of`) once it has computed the prompt, so the prompt is computed once. With beam
search the first is the root beam and the others are output slots for the n best beams.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import OrderedDict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from kvtide.engine.request import EngineCoreRequest
from kvtide.lora.request import LoRARequest
from kvtide.sampling_params import SamplingParams


@dataclass
class ProcessedPrompt:
    """A prompt already tokenized and validated (e.g. by the server, off its event loop): passed
    back in, it is taken as it is."""

    prompt: str | None
    prompt_token_ids: list[int]


PromptType = str | Sequence[int] | Mapping[str, Any] | ProcessedPrompt

logger = logging.getLogger(__name__)

CHECKED_CONSTRAINTS_CACHE = 64
"""Constraints remembered as parsed: a request's n prompts (or a client's repeated schema) are
parsed once, and the server can parse one off its event loop before adding the request."""


class InputProcessor:
    def __init__(self, tokenizer, vocab_size: int, max_model_len: int, eos_token_ids: list[int]) -> None:
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.max_model_len = max_model_len
        self.prompt_fills_context = False
        """A pooling model's prompt may take all of max_model_len: nothing is generated after it."""
        self.eos_token_ids = eos_token_ids
        self.num_invalid_structured_outputs = 0
        """Requests refused for a schema, regex or grammar that does not parse (a metric)."""
        self._checked_constraints: OrderedDict[tuple, str | None] = OrderedDict()
        """Constraint key -> None (parsed) or the parse error (refused again without parsing)."""
        self._checked_lock = threading.Lock()  # the server checks on a worker thread, the engine on its loop
        self.logits_processor_classes: list[type] = []
        """The engine's logits processors: each checks a request's arguments (validate_params)."""
        self.generation_defaults: dict[str, Any] = {}
        """The model's sampling defaults (engine/generation_defaults.py) for fields a request leaves unset."""

    def configure(self, engine_args: Any, model_dir: str) -> None:
        """The engine-wide settings requests are checked and completed with: its logits
        processors' classes and the model's sampling defaults (logged: the defaults in force)."""
        from kvtide.engine.generation_defaults import describe_generation_defaults, load_generation_defaults
        from kvtide.logits_processors.loader import parse_specs, resolve_classes

        self.logits_processor_classes = resolve_classes(parse_specs(getattr(engine_args, "logits_processors", None)))
        setting = getattr(engine_args, "generation_config", "auto")
        self.generation_defaults = load_generation_defaults(setting, model_dir)
        logger.info("%s", describe_generation_defaults(self.generation_defaults, setting))

    def process_prompt(self, prompt: PromptType, add_special_tokens: bool = True,
                       truncate_prompt_tokens: int | None = None) -> ProcessedPrompt:
        """Tokenize and validate a prompt; with `truncate_prompt_tokens` keep its last k tokens
        (-1: max_model_len - 1) before checking it fits, and its text becomes theirs."""
        text: str | None = None
        if isinstance(prompt, ProcessedPrompt):
            return self._truncate(prompt, truncate_prompt_tokens)
        if isinstance(prompt, str):
            text, token_ids = prompt, None
        elif isinstance(prompt, Mapping):
            if "prompt_token_ids" in prompt:
                token_ids = prompt["prompt_token_ids"]
                if not isinstance(token_ids, Sequence) or isinstance(token_ids, (str, bytes, bytearray)):
                    raise ValueError("prompt_token_ids must be a list of integers, got "
                                     f"{type(token_ids).__name__}")
            elif "prompt" in prompt:
                text, token_ids = prompt["prompt"], None
            else:
                raise ValueError("prompt: a dict prompt needs 'prompt' or 'prompt_token_ids'")
        elif isinstance(prompt, Sequence) and not isinstance(prompt, (bytes, bytearray)):
            token_ids = prompt
        else:
            raise ValueError(f"prompt must be a string, a list of token ids or a dict, got {type(prompt).__name__}")
        if token_ids is None:
            if not isinstance(text, str):
                raise ValueError("prompt: 'prompt' must be a string")
            if text == "":
                raise ValueError("prompt must not be empty")
            try:
                text.encode("utf-8")
            except UnicodeEncodeError as e:
                raise ValueError(f"prompt is not valid Unicode text ({e.reason} at position {e.start})") from e
            if self.tokenizer is None:
                raise ValueError("prompt: a text prompt needs a tokenizer; pass token ids instead")
            token_ids = self.tokenizer.encode(text, add_special_tokens=add_special_tokens)
        if truncate_prompt_tokens is not None and 0 < len(token_ids):
            return self._truncate(ProcessedPrompt(text, self._check_token_ids(token_ids, check_length=False)),
                                  truncate_prompt_tokens)
        token_ids = self._check_token_ids(token_ids)
        return ProcessedPrompt(text, token_ids)

    def _truncate(self, prompt: ProcessedPrompt, keep: int | None) -> ProcessedPrompt:
        if keep is None:
            return prompt
        if not isinstance(keep, int) or isinstance(keep, bool) or (keep < 1 and keep != -1):
            raise ValueError(f"truncate_prompt_tokens must be an integer >= 1 or -1 (the model's limit), got {keep!r}")
        keep = self.max_model_len - 1 if keep == -1 else keep
        if len(prompt.prompt_token_ids) <= keep:
            return ProcessedPrompt(prompt.prompt, self._check_token_ids(prompt.prompt_token_ids))
        token_ids = self._check_token_ids(prompt.prompt_token_ids[-keep:])
        text = self.tokenizer.decode(token_ids) if self.tokenizer is not None else None
        return ProcessedPrompt(text, token_ids)

    def _check_token_ids(self, token_ids: Sequence[Any], check_length: bool = True) -> list[int]:
        if len(token_ids) == 0:
            raise ValueError("prompt must not be empty (0 tokens)")
        if any(not isinstance(t, int) or isinstance(t, bool) for t in token_ids):
            raise ValueError("prompt_token_ids must be a list of integers")
        bad = [t for t in token_ids if not 0 <= t < self.vocab_size]
        if bad:
            raise ValueError(f"prompt_token_ids: token id {bad[0]} is out of range [0, {self.vocab_size})")
        if check_length and self.prompt_fills_context and len(token_ids) > self.max_model_len:
            raise ValueError(f"prompt is {len(token_ids)} tokens, more than max_model_len={self.max_model_len}")
        if check_length and not self.prompt_fills_context and len(token_ids) >= self.max_model_len:
            raise ValueError(f"prompt is {len(token_ids)} tokens, which leaves no room to generate "
                             f"within max_model_len={self.max_model_len}")
        return list(token_ids)

    @property
    def max_prompt_len(self) -> int:
        return self.max_model_len if self.prompt_fills_context else self.max_model_len - 1

    def check_params(self, params: SamplingParams, num_prompt_tokens: int) -> None:
        if params.logit_bias:
            bad = [t for t in params.logit_bias if t >= self.vocab_size]
            if bad:
                raise ValueError(f"logit_bias: token id {bad[0]} is out of range [0, {self.vocab_size})")
        bad = [t for t in params.stop_token_ids or [] if t >= self.vocab_size]
        if bad:
            raise ValueError(f"stop_token_ids: token id {bad[0]} is out of range [0, {self.vocab_size})")
        bad = [t for t in params.allowed_token_ids or [] if t >= self.vocab_size]
        if bad:
            raise ValueError(f"allowed_token_ids: token id {bad[0]} is out of range [0, {self.vocab_size})")
        if params.bad_words:
            self.bad_words_token_ids(params.bad_words)
        if self.logits_processor_classes:
            from kvtide.logits_processors.loader import validate_params

            validate_params(self.logits_processor_classes, params)
        if (params.stop or params.include_stop_str_in_output) and self.tokenizer is None:
            raise ValueError("stop: stop strings need a tokenizer")
        if params.structured_outputs is not None:
            self._check_structured_outputs(params)
        if params.use_beam_search:
            num_stop = len(set(params.stop_token_ids or []) |
                           (set() if params.ignore_eos else set(self.eos_token_ids)))
            if max(2, 1 + num_stop) * params.num_beams > self.vocab_size:
                raise ValueError(f"beam_width: {params.num_beams} beams need "
                                 f"{max(2, 1 + num_stop) * params.num_beams} candidates per step, more "
                                 f"than the vocabulary ({self.vocab_size})")

    def bad_words_token_ids(self, bad_words: list[str]) -> list[list[int]]:
        """Each bad word's token sequence as written after another word (with a leading space)
        and as written alone (without), both refused: a tokenizer marks a word's start in its
        first token, so either may be what the model emits."""
        if self.tokenizer is None:
            raise ValueError("bad_words need a tokenizer")
        sequences: list[list[int]] = []
        for word in bad_words:
            for text in (word.strip(), " " + word.strip()):
                ids = list(self.tokenizer.encode(text, add_special_tokens=False))
                if ids and ids not in sequences:
                    sequences.append(ids)
        bad = [t for ids in sequences for t in ids if not 0 <= t < self.vocab_size]
        if bad:
            raise ValueError(f"bad_words: token id {bad[0]} is out of range [0, {self.vocab_size})")
        return sequences

    def _check_structured_outputs(self, params: SamplingParams) -> None:
        """Parse the constraint now (a bad schema, regex or grammar is the caller's error, before
        anything is queued); the engine core compiles it against the tokenizer."""
        from kvtide.structured_output.grammars import build_grammar

        so = params.structured_outputs
        if self.tokenizer is None:
            raise ValueError("structured_outputs needs a tokenizer (the grammar is compiled against its vocabulary)")
        bad = [t for t in so.reasoning_end_token_ids or [] if t >= self.vocab_size]
        if bad:
            raise ValueError(f"structured_outputs.reasoning_end_token_ids: token id {bad[0]} is out of range "
                             f"[0, {self.vocab_size})")
        key = so.key()
        with self._checked_lock:
            if key in self._checked_constraints:
                self._checked_constraints.move_to_end(key)
                error = self._checked_constraints[key]
                if error is None:
                    return
                self.num_invalid_structured_outputs += 1
                raise ValueError(error)
        error = None
        try:
            build_grammar(so)
        except ValueError as e:
            self.num_invalid_structured_outputs += 1
            error = str(e)
        # Failures are remembered too: a constraint that takes seconds to parse and fails is refused
        # at once when it comes again.
        with self._checked_lock:
            self._checked_constraints[key] = error
            while len(self._checked_constraints) > CHECKED_CONSTRAINTS_CACHE:
                self._checked_constraints.popitem(last=False)
        if error is not None:
            raise ValueError(error)

    def make_requests(self, request_id: str, prompt: ProcessedPrompt, params: SamplingParams,
                      priority: int = 0, arrival_time: float | None = None,
                      lora_request: LoRARequest | None = None) -> list[EngineCoreRequest]:
        self.check_params(params, len(prompt.prompt_token_ids))
        params = params.with_defaults(self.generation_defaults).clone()
        if params.bad_words:
            params.bad_words_token_ids = self.bad_words_token_ids(params.bad_words)
        params.all_stop_token_ids = set(params.stop_token_ids or []) | \
            (set() if params.ignore_eos else set(self.eos_token_ids))
        arrival = arrival_time if arrival_time is not None else time.time()
        num = params.num_samples
        requests = []
        ids = [request_id] if num == 1 else [f"{index}_{request_id}" for index in range(num)]
        for index, child_id in enumerate(ids):
            child_params = params if num == 1 or params.use_beam_search else params.clone(
                n=1, best_of=None, seed=None if params.seed is None else params.seed + index,
                logprobs=params.logprobs if params.best_of is None or params.logprobs is not None else 0)
            requests.append(EngineCoreRequest(child_id, prompt.prompt_token_ids, child_params,
                                              list(self.eos_token_ids), arrival, priority,
                                              fork_of=ids[0] if index else None, lora_request=lora_request))
        return requests
