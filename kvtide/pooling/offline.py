"""The offline pooling API behind `LLM.encode`, `embed`, `classify` and `score` (vLLM's names).

Pooling requests queue through the same engine as generation: one sampling-free request per
prompt (SamplingParams(max_tokens=1) keeps the scheduler from scheduling past the prompt), ending
with the pooled output.
"""

from __future__ import annotations

from collections.abc import Sequence

from kvtide.engine.input_processor import ProcessedPrompt
from kvtide.pooling.config import PoolerConfig
from kvtide.pooling.outputs import (
    ClassificationOutput,
    ClassificationRequestOutput,
    EmbeddingOutput,
    EmbeddingRequestOutput,
    PoolingRequestOutput,
    ScoringOutput,
    ScoringRequestOutput,
    cosine_similarity,
)
from kvtide.pooling.params import PoolingParams
from kvtide.pooling.scoring import check_truncation, score_pairs, tokenize_text, truncate_ids
from kvtide.sampling_params import SamplingParams

_TASK_MODEL = {"embed": "embed", "classify": "classify", "score": "classify"}


def pooler_config(llm) -> PoolerConfig:
    """The pooling model's PoolerConfig; ValueError for a generation model."""
    core = getattr(llm.engine, "core", None)
    if core is None:
        raise ValueError("offline pooling runs on one engine: use data_parallel_size=1 (or serve the model "
                         "with --data-parallel-size)")
    config = core.config.model_config.pooler_config
    if config is None:
        raise ValueError("this is a generation model: pooling (embed, classify, score) needs a pooling model, "
                         "e.g. LLM(model, runner='pooling'), or an embedding / classification checkpoint")
    return config


def encode(llm, prompts, pooling_params: PoolingParams | Sequence[PoolingParams] | None = None,
           use_tqdm: bool = False, truncate_prompt_tokens: int | None = None) -> list[PoolingRequestOutput]:
    """Pool each prompt (a string, token ids, or {"prompt_token_ids": [...]}); a ("text", "text")
    tuple is a cross-encoder's pair, tokenized with the tokenizer's pair template."""
    config = pooler_config(llm)
    prompt_list = _as_list(prompts)
    params_list = list(pooling_params) if isinstance(pooling_params, Sequence) else \
        [pooling_params or PoolingParams(task=config.task)] * len(prompt_list)
    if len(params_list) != len(prompt_list):
        raise ValueError(f"pooling_params: got {len(params_list)} for {len(prompt_list)} prompts")
    hidden_size = llm.engine.core.config.model_config.hf_config.hidden_size
    keep = check_truncation(truncate_prompt_tokens, llm.engine.input_processor.max_prompt_len)
    processed = []
    for prompt, params in zip(prompt_list, params_list, strict=True):  # validate everything first
        if not isinstance(params, PoolingParams):
            raise ValueError(f"pooling_params must be PoolingParams, got {type(params).__name__}")
        if _TASK_MODEL.get(params.task, config.task) != config.task:
            raise ValueError(f"task {params.task!r} needs a {_TASK_MODEL[params.task]} model; this one is "
                             f"a {config.task} model")
        config.check_dimensions(params.dimensions, hidden_size)
        processed.append(_process(llm, prompt, keep))
    engine = llm.engine
    ids: list[str] = []
    try:
        for prompt, params in zip(processed, params_list, strict=True):
            request_id = engine.next_request_id()
            engine.add_request(request_id, prompt, SamplingParams(max_tokens=1, detokenize=False),
                               pooling_params=params)
            ids.append(request_id)
    except BaseException:
        engine.abort_request(ids)
        raise
    outputs = llm._run(ids, use_tqdm)
    for output in outputs:
        if not isinstance(output, PoolingRequestOutput):
            raise RuntimeError(f"pooling request {output.request_id} failed in the engine")
    return outputs


def embed(llm, prompts, pooling_params: PoolingParams | None = None, use_tqdm: bool = False,
          truncate_prompt_tokens: int | None = None) -> list[EmbeddingRequestOutput]:
    params = pooling_params or PoolingParams(task="embed")
    if params.task != "embed":
        raise ValueError(f"embed: pooling_params.task must be 'embed', got {params.task!r}")
    return [EmbeddingRequestOutput(o.request_id, EmbeddingOutput(o.outputs.data), o.prompt_token_ids)
            for o in encode(llm, prompts, params, use_tqdm, truncate_prompt_tokens)]


def classify(llm, prompts, pooling_params: PoolingParams | None = None, use_tqdm: bool = False,
             truncate_prompt_tokens: int | None = None) -> list[ClassificationRequestOutput]:
    params = pooling_params or PoolingParams(task="classify")
    if params.task != "classify":
        raise ValueError(f"classify: pooling_params.task must be 'classify', got {params.task!r}")
    return [ClassificationRequestOutput(o.request_id, ClassificationOutput(o.outputs.data), o.prompt_token_ids)
            for o in encode(llm, prompts, params, use_tqdm, truncate_prompt_tokens)]


def score(llm, text_1, text_2, use_tqdm: bool = False, truncate_prompt_tokens: int | None = None,
          pooling_params: PoolingParams | None = None) -> list[ScoringRequestOutput]:
    """One score per pair (one-to-one or one-to-many): a cross-encoder (a classification model)
    scores each pair tokenized together; an embedding model by the cosine of the two embeddings."""
    config = pooler_config(llm)
    pairs = score_pairs(text_1, text_2)
    if config.task == "classify":
        params = pooling_params or PoolingParams(task="score")
        outputs = encode(llm, pairs, PoolingParams(task="score", use_activation=params.use_activation),
                         use_tqdm, truncate_prompt_tokens)
        return [ScoringRequestOutput(o.request_id, ScoringOutput(o.outputs.data[0]), o.prompt_token_ids)
                for o in outputs]
    texts = list(dict.fromkeys(t for pair in pairs for t in pair))
    embedded = dict(zip(texts, encode(llm, texts, PoolingParams(task="embed"), use_tqdm, truncate_prompt_tokens),
                        strict=True))
    results = []
    for a, b in pairs:
        ea, eb = embedded[a], embedded[b]
        results.append(ScoringRequestOutput(f"{ea.request_id}-{eb.request_id}",
                                            ScoringOutput(cosine_similarity(ea.outputs.data, eb.outputs.data)),
                                            ea.prompt_token_ids + eb.prompt_token_ids))
    return results


def _process(llm, prompt, keep: int | None) -> ProcessedPrompt:
    """A prompt tokenized (a pair with the pair template), cut to `keep` tokens, validated."""
    processor = llm.engine.input_processor
    if isinstance(prompt, tuple) and len(prompt) == 2:
        return processor.process_prompt(tokenize_text(llm.tokenizer, prompt[0], prompt[1], keep))
    if keep is None:
        return processor.process_prompt(prompt)
    if isinstance(prompt, str):
        return ProcessedPrompt(prompt, processor.process_prompt(tokenize_text(llm.tokenizer, prompt, None, keep))
                               .prompt_token_ids)
    ids = prompt["prompt_token_ids"] if isinstance(prompt, dict) else prompt
    return processor.process_prompt(truncate_ids(list(ids), keep))


def _as_list(prompts) -> list:
    if isinstance(prompts, (str, dict, tuple)):
        return [prompts]
    if isinstance(prompts, Sequence) and prompts and all(isinstance(t, int) for t in prompts):
        return [prompts]
    if isinstance(prompts, Sequence):
        if not prompts:
            raise ValueError("prompts must not be empty")
        return list(prompts)
    raise ValueError(f"prompts must be a string, token ids, or a list of them; got {type(prompts).__name__}")
