"""LLMEngine: the in-process engine (input processing, engine core, output processing).

    add_request(id, prompt, params)  ->  validated, split into n core requests, queued
    step()                           ->  one core step; RequestOutputs of what changed
"""

from __future__ import annotations

import itertools
import logging
from collections.abc import Iterable

from kvtide.engine.core import EngineCore
from kvtide.engine.input_processor import InputProcessor, PromptType
from kvtide.engine.output_processor import OutputProcessor, RequestOutputKind
from kvtide.lora.request import LoRARequest
from kvtide.outputs import RequestOutput
from kvtide.pooling.outputs import PoolingRequestOutput
from kvtide.pooling.params import PoolingParams
from kvtide.sampling_params import SamplingParams

logger = logging.getLogger(__name__)


class LLMEngine:
    def __init__(self, core: EngineCore, tokenizer, vocab_size: int, max_model_len: int,
                 eos_token_ids: list[int]) -> None:
        self.core = core
        self.tokenizer = tokenizer
        self.input_processor = InputProcessor(tokenizer, vocab_size, max_model_len, eos_token_ids)
        self.output_processor = OutputProcessor(tokenizer)
        self._ids = itertools.count()

    def next_request_id(self) -> str:
        return str(next(self._ids))

    def add_request(self, request_id: str, prompt: PromptType, params: SamplingParams,
                    priority: int = 0, output_kind: RequestOutputKind = RequestOutputKind.FINAL_ONLY,
                    lora_request: LoRARequest | None = None, pooling_params: PoolingParams | None = None) -> None:
        """Validate and queue a request. Raises ValueError before changing anything. A LoRA adapter
        is the caller's to load first (`add_lora`: that checks it). With `pooling_params` (a pooling
        model) it ends with a PoolingRequestOutput once its prompt is computed."""
        if not isinstance(params, SamplingParams):
            raise ValueError(f"sampling_params must be SamplingParams, got {type(params).__name__}")
        if request_id in self.output_processor.requests:
            raise ValueError(f"request_id {request_id!r} is already in use")
        processed = self.input_processor.process_prompt(prompt, truncate_prompt_tokens=params.truncate_prompt_tokens)
        core_requests = self.input_processor.make_requests(request_id, processed, params, priority,
                                                           lora_request=lora_request)
        for core_request in core_requests:
            core_request.pooling_params = pooling_params
            self.core.check_request(core_request)
        self.output_processor.add_request(request_id, processed.prompt, processed.prompt_token_ids,
                                          params, [r.request_id for r in core_requests], output_kind,
                                          core_requests[0].arrival_time)
        try:
            for core_request in core_requests:
                self.core.add_request(core_request)
        except BaseException:
            self.abort_request([request_id])  # take back the samples already queued
            raise

    def add_lora(self, lora_request: LoRARequest) -> float:
        """Load and check a LoRA adapter (ValueError: a bad one, or LoRA is off); the load's seconds."""
        if not isinstance(lora_request, LoRARequest):
            raise ValueError(f"lora_request must be a LoRARequest, got {type(lora_request).__name__}")
        return self.core.add_lora(lora_request)

    def remove_lora(self, lora_int_id: int) -> None:
        self.core.remove_lora(lora_int_id)

    def abort_request(self, request_ids: Iterable[str]) -> None:
        child_ids = self.output_processor.abort_requests(list(request_ids))
        self.core.abort_requests(child_ids)

    def abort_unfinished(self) -> None:
        self.abort_request(list(self.output_processor.requests))

    def reset_prefix_cache(self) -> bool:
        return self.core.reset_prefix_cache()

    def sleep(self, level: int = 1) -> None:
        self.core.sleep(level)

    def wake_up(self) -> None:
        self.core.wake_up()

    def update_weights(self, weights=None, model_dir: str | None = None) -> int:
        return self.core.update_weights(weights, model_dir)

    def has_unfinished_requests(self) -> bool:
        return self.output_processor.has_unfinished_requests() or self.core.has_unfinished_requests()

    def step(self) -> list[RequestOutput | PoolingRequestOutput]:
        core_outputs = self.core.step()
        for out in core_outputs:
            if out.error is not None:  # offline there is no error object to hand back: say it here
                logger.warning("request %s failed in the engine (its output ends with finish_reason "
                               "'abort'): %s", out.request_id, out.error)
        outputs, to_abort = self.output_processor.process_outputs(core_outputs)
        if to_abort:
            self.core.stop_requests(to_abort)
        return outputs
