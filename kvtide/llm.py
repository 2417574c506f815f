"""LLM: the offline API. Give it prompts, get RequestOutputs back, in order."""

from __future__ import annotations

import weakref
from collections.abc import Sequence
from typing import Any

from tqdm import tqdm

from kvtide.bootstrap import build_engine_core
from kvtide.engine.dp_client import check_data_parallel_args
from kvtide.engine.dp_llm_engine import DataParallelLLMEngine
from kvtide.engine.input_processor import PromptType
from kvtide.engine.llm_engine import LLMEngine
from kvtide.engine_args import EngineArgs
from kvtide.lora.request import LoRARequest
from kvtide.outputs import BeamSearchOutput, BeamSearchSequence, RequestOutput
from kvtide.pooling.outputs import (
    ClassificationRequestOutput,
    EmbeddingRequestOutput,
    PoolingRequestOutput,
    ScoringRequestOutput,
)
from kvtide.pooling.params import PoolingParams
from kvtide.sampling_params import BeamSearchParams, SamplingParams
from kvtide.tokenizer import load_tokenizer


class LLM:
    """`LLM(model=..., dtype=..., max_model_len=..., block_size=16, kv_cache_memory=...,
    max_num_seqs=..., max_num_batched_tokens=..., seed=...)`; any EngineArgs field is accepted.
    With data_parallel_size=N the prompts are spread over N engine-core processes (each with its
    share of the cores), as the server's replicas."""

    def __init__(self, model: str = "demo", **kwargs: Any) -> None:
        self.engine_args = EngineArgs(model=model, **kwargs)
        self.engine: LLMEngine | DataParallelLLMEngine
        if self.engine_args.data_parallel_size != 1:
            check_data_parallel_args(self.engine_args)
            # N engine-core processes, as `kvtide serve --data-parallel-size N` runs them.
            self.engine = DataParallelLLMEngine(self.engine_args)
            self.tokenizer = self.engine.tokenizer
            self.model_info = self.engine.llm.info
            self._finalizer = weakref.finalize(self, self.engine.shutdown)
            return
        core, info = build_engine_core(self.engine_args)
        self.tokenizer = load_tokenizer(info.tokenizer_dir, self.engine_args.trust_remote_code)
        self.model_info = info
        self.engine = LLMEngine(core, self.tokenizer, info.vocab_size, info.max_model_len, info.eos_token_ids)
        self.engine.input_processor.configure(self.engine_args, info.model_dir)
        self.engine.input_processor.prompt_fills_context = info.pooler is not None  # a pooling model
        self._finalizer = weakref.finalize(self, core.shutdown)

    def shutdown(self) -> None:
        """Stop the engine (a replica of several ranks: its worker processes and process group; data
        parallelism: every replica's process). Also runs when the LLM is garbage collected or the
        interpreter exits."""
        self._finalizer()

    def get_tokenizer(self):
        return self.tokenizer

    def get_default_sampling_params(self) -> SamplingParams:
        """vLLM's: SamplingParams holding the model's sampling defaults (--generation-config); a
        request that leaves a field unset gets the same value anyway."""
        return SamplingParams().with_defaults(self.engine.input_processor.generation_defaults)

    def generate(self, prompts: PromptType | Sequence[PromptType],
                 sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
                 use_tqdm: bool = False, priority: Sequence[int] | None = None,
                 lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None) -> list[RequestOutput]:
        """`lora_request`: one LoRA adapter for every prompt, or one (or None: the base model) per prompt."""
        prompt_list = _as_prompt_list(prompts)
        if sampling_params is None:
            sampling_params = SamplingParams()
        params_list = list(sampling_params) if isinstance(sampling_params, Sequence) else \
            [sampling_params] * len(prompt_list)
        if len(params_list) != len(prompt_list):
            raise ValueError(f"sampling_params: got {len(params_list)} for {len(prompt_list)} prompts")
        if priority is not None and len(priority) != len(prompt_list):
            raise ValueError(f"priority: got {len(priority)} values for {len(prompt_list)} prompts")
        loras = _per_prompt_loras(lora_request, len(prompt_list))
        # Validate everything before queueing anything.
        for prompt, params in zip(prompt_list, params_list, strict=True):
            if not isinstance(params, SamplingParams):
                raise ValueError(f"sampling_params must be SamplingParams, got {type(params).__name__}")
            processed = self.engine.input_processor.process_prompt(
                prompt, truncate_prompt_tokens=params.truncate_prompt_tokens)
            self.engine.input_processor.check_params(params, len(processed.prompt_token_ids))
        for lora in dict.fromkeys(r for r in loras if r is not None):  # each adapter loaded and checked once
            self.engine.add_lora(lora)
        ids: list[str] = []
        try:
            for i, (prompt, params) in enumerate(zip(prompt_list, params_list, strict=True)):
                request_id = self.engine.next_request_id()
                self.engine.add_request(request_id, prompt, params, priority[i] if priority else 0,
                                        lora_request=loras[i])
                ids.append(request_id)
        except BaseException:
            self.engine.abort_request(ids)  # a late refusal (e.g. a full queue) takes the batch back
            raise
        return self._run(ids, use_tqdm)

    def chat(self, messages: list[dict[str, Any]] | list[list[dict[str, Any]]],
             sampling_params: SamplingParams | None = None, chat_template: str | None = None,
             add_generation_prompt: bool = True, use_tqdm: bool = False) -> list[RequestOutput]:
        conversations = messages if messages and isinstance(messages[0], list) else [messages]
        prompts: list[PromptType] = []
        for conversation in conversations:
            # The template places BOS itself: tokenize once, adding no special tokens.
            text = self.tokenizer.apply_chat_template(conversation, chat_template=chat_template,
                                                      add_generation_prompt=add_generation_prompt,
                                                      tokenize=False)
            prompts.append({"prompt_token_ids": self.tokenizer.encode(text, add_special_tokens=False)})
        return self.generate(prompts, sampling_params, use_tqdm)

    def _run(self, request_ids: list[str], use_tqdm: bool) -> list[RequestOutput]:
        results: dict[str, RequestOutput] = {}
        bar = tqdm(total=len(request_ids), desc="Processed prompts", disable=not use_tqdm)
        try:
            while self.engine.has_unfinished_requests():
                for output in self.engine.step():
                    if output.finished:
                        results[output.request_id] = output
                        bar.update(1)
        except BaseException:
            self.engine.abort_unfinished()
            raise
        finally:
            bar.close()
        return [results[r] for r in request_ids]

    def reset_prefix_cache(self) -> bool:
        return self.engine.reset_prefix_cache()

    # ---- sleep mode and weight updates (LLM(..., enable_sleep_mode=True)) -------------------------
    def sleep(self, level: int = 1) -> None:
        """Level 1 frees the KV cache, level 2 the weights too (reloaded from the checkpoint on
        wake_up). Between requests only; the prefix cache is forgotten."""
        self.engine.sleep(level)

    def wake_up(self) -> None:
        self.engine.wake_up()

    def is_sleeping(self) -> bool:
        return bool(self.engine.core.sleep_level)

    def update_weights(self, weights) -> int:
        """New values for the model's weights, as (checkpoint name, tensor) pairs of the same shapes
        (an RL trainer's state dict); checked whole before any changes. Returns the weight version."""
        return self.engine.update_weights(weights=weights)

    def update_weights_from_disk(self, model_path: str) -> int:
        """Every weight from another checkpoint directory of the same architecture and shapes."""
        return self.engine.update_weights(model_dir=model_path)

    def collective_rpc(self, method: str, args: tuple = (), kwargs: dict | None = None) -> list:
        """`method` on every rank's model runner (vLLM's RL hook): the sleep-mode and weight-update
        calls by name ("update_weights" with a list of (name, tensor) pairs), else a runner method."""
        engine_calls = {"sleep": self.sleep, "wake_up": self.wake_up, "update_weights": self.update_weights,
                        "update_weights_from_disk": self.update_weights_from_disk}
        if method in engine_calls:  # through the engine: the prefix cache is reset with them
            return [engine_calls[method](*args, **(kwargs or {}))]
        return self.engine.core.executor.collective_rpc(method, args, kwargs)
    # ---- pooling models (kvtide/pooling/offline.py) -------------------------------------------
    def encode(self, prompts, pooling_params: PoolingParams | Sequence[PoolingParams] | None = None,
               use_tqdm: bool = False, truncate_prompt_tokens: int | None = None) -> list[PoolingRequestOutput]:
        """Each prompt's pooled output as the model's pooler makes it."""
        from kvtide.pooling import offline

        return offline.encode(self, prompts, pooling_params, use_tqdm, truncate_prompt_tokens)

    def embed(self, prompts, pooling_params: PoolingParams | None = None, use_tqdm: bool = False,
              truncate_prompt_tokens: int | None = None) -> list[EmbeddingRequestOutput]:
        """Embeddings (`.outputs.embedding`) of an embedding model."""
        from kvtide.pooling import offline

        return offline.embed(self, prompts, pooling_params, use_tqdm, truncate_prompt_tokens)

    def classify(self, prompts, pooling_params: PoolingParams | None = None, use_tqdm: bool = False,
                 truncate_prompt_tokens: int | None = None) -> list[ClassificationRequestOutput]:
        """Class probabilities (`.outputs.probs`) of a sequence classification model."""
        from kvtide.pooling import offline

        return offline.classify(self, prompts, pooling_params, use_tqdm, truncate_prompt_tokens)

    def score(self, text_1: str | Sequence[str], text_2: str | Sequence[str], use_tqdm: bool = False,
              truncate_prompt_tokens: int | None = None,
              pooling_params: PoolingParams | None = None) -> list[ScoringRequestOutput]:
        """One score (`.outputs.score`) per pair, one-to-one or one-to-many: a cross-encoder's, or
        an embedding model's cosine."""
        from kvtide.pooling import offline

        return offline.score(self, text_1, text_2, use_tqdm, truncate_prompt_tokens, pooling_params)

    def beam_search(self, prompts: PromptType | Sequence[PromptType], params: BeamSearchParams,
                    use_tqdm: bool = False,
                    lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None) -> list[BeamSearchOutput]:
        """vLLM's entry point: per prompt, the beam_width best beams, best first. The same as
        `generate(prompts, SamplingParams(use_beam_search=True, ...))`."""
        outputs = self.generate(prompts, params.to_sampling_params(), use_tqdm=use_tqdm, lora_request=lora_request)
        results = []
        for output in outputs:
            sequences = []
            for c in output.outputs:
                tokens = output.prompt_token_ids + c.token_ids
                text = self.tokenizer.decode(tokens, skip_special_tokens=True) if self.tokenizer else None
                sequences.append(BeamSearchSequence(tokens, c.logprobs or [], c.cumulative_logprob or 0.0,
                                                    text, c.finish_reason, c.stop_reason))
            results.append(BeamSearchOutput(sequences))
        return results


def _per_prompt_loras(lora_request: LoRARequest | Sequence[LoRARequest | None] | None,
                      num_prompts: int) -> list[LoRARequest | None]:
    if lora_request is None or isinstance(lora_request, LoRARequest):
        return [lora_request] * num_prompts
    if not isinstance(lora_request, Sequence):
        raise ValueError(f"lora_request must be a LoRARequest or a list of them, got {type(lora_request).__name__}")
    if len(lora_request) != num_prompts:
        raise ValueError(f"lora_request: got {len(lora_request)} for {num_prompts} prompts")
    for lora in lora_request:
        if lora is not None and not isinstance(lora, LoRARequest):
            raise ValueError(f"lora_request entries must be LoRARequest or None, got {type(lora).__name__}")
    return list(lora_request)


def _as_prompt_list(prompts: PromptType | Sequence[PromptType]) -> list[PromptType]:
    if isinstance(prompts, (str, dict)):
        return [prompts]
    if isinstance(prompts, Sequence) and prompts and all(isinstance(t, int) for t in prompts):
        return [prompts]  # one prompt of token ids
    if isinstance(prompts, Sequence):
        if not prompts:
            raise ValueError("prompts must not be empty")
        return list(prompts)
    raise ValueError(f"prompts must be a string, token ids, or a list of them; got {type(prompts).__name__}")
