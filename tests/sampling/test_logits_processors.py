"""Logits processors (vLLM's batch-level interface): a token ban changes greedy output exactly as
transformers' bad_words_ids (a -inf mask) and logit_bias do, the n-gram processor equals
transformers' no_repeat_ngram_size, per-request arguments reach only their own request, and each
request keeps its state while the batch adds, removes and moves it under forced preemption."""

from __future__ import annotations

import functools

import pytest
import torch
from torch_threads import one_torch_thread

from kvtide import LLM, SamplingParams
from kvtide.logits_processors import BatchUpdate, LogitsProcessor, MoveDirectionality
from kvtide.logits_processors.batch import LogitsProcessorBatch, OutputTokens
from kvtide.logits_processors.builtin import NoRepeatNGramLogitsProcessor, TokenBanLogitsProcessor

PROMPTS = ["Once upon a time", "The cache holds blocks", "A scheduler hands out tokens", "river mountain seven",
           "quantum lattice ember", "harbor violet"]
MAX_TOKENS = 20


@pytest.fixture(autouse=True, scope="module")
def _one_torch_thread():
    yield from one_torch_thread()


class UpdateRecorder(LogitsProcessor):
    """Counts the batch updates it is given (class-wide: the engine builds its own instance)."""

    seen = {"added": 0, "removed": 0, "moved": 0}

    def __init__(self, config, device, is_pin_memory) -> None:
        pass

    def is_argmax_invariant(self) -> bool:
        return True

    def update_state(self, batch_update: BatchUpdate | None) -> None:
        if batch_update is not None:
            for name in self.seen:
                self.seen[name] += len(getattr(batch_update, name))

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        return logits


@pytest.fixture(scope="module")
def llm(llama_dir):
    """Processors on an engine with a pool that holds the longest request and little else, and a
    small token budget: requests are preempted, resumed and reordered."""
    block_bytes = LLM(model=llama_dir, max_model_len=64, kv_cache_memory="1MiB").engine.core.executor.kv_bytes_per_block()
    return LLM(model=llama_dir, max_model_len=64, kv_cache_memory=str(6 * block_bytes), max_num_batched_tokens=32,
               logits_processors=[TokenBanLogitsProcessor,
                                  "kvtide.logits_processors.builtin:NoRepeatNGramLogitsProcessor",
                                  f"{UpdateRecorder.__module__}:UpdateRecorder"])


@functools.cache
def hf_model(model_dir: str):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    model.generation_config.eos_token_id = None
    model.generation_config.pad_token_id = 0
    return model


def hf_generate(model_dir: str, prompt_ids: list[int], **options) -> list[int]:
    ids = torch.tensor([prompt_ids])
    with torch.inference_mode():
        out = hf_model(model_dir).generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=MAX_TOKENS,
                                           do_sample=False, **options)
    return out[0, len(prompt_ids):].tolist()


def greedy(**kwargs) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True, **kwargs)


def test_a_token_ban_equals_hf_bad_words_and_logit_bias(llm, llama_dir):
    plain = llm.generate(PROMPTS[0], greedy())[0]
    token = plain.outputs[0].token_ids[2]
    banned, biased = llm.generate([PROMPTS[0]] * 2, [greedy(extra_args={"banned_token_ids": [token]}),
                                                     greedy(logit_bias={token: -100})])
    expected = hf_generate(llama_dir, plain.prompt_token_ids, bad_words_ids=[[token]])
    assert banned.outputs[0].token_ids == expected != plain.outputs[0].token_ids
    assert biased.outputs[0].token_ids == expected


def test_per_request_args_reach_only_their_request(llm, llama_dir):
    ids = [llm.tokenizer.encode(p) for p in PROMPTS[:3]]
    plain = [hf_generate(llama_dir, i) for i in ids]
    params = [greedy(extra_args={"no_repeat_ngram_size": 2}), greedy(), greedy(extra_args={"other": 1})]
    outs = llm.generate([{"prompt_token_ids": i} for i in ids], params)
    assert outs[0].outputs[0].token_ids == hf_generate(llama_dir, ids[0], no_repeat_ngram_size=2) != plain[0]
    assert outs[1].outputs[0].token_ids == plain[1]
    assert outs[2].outputs[0].token_ids == plain[2]


def test_each_request_keeps_its_state_through_preemption_and_moves(llm, llama_dir):
    """Every request bans a token of its own (the third of its plain greedy output) and some also
    forbid repeated bigrams; the pool forces preemptions, and finishing at different lengths leaves
    holes the batch fills by moving requests: each output still equals its own HF reference."""
    ids = [llm.tokenizer.encode(p) for p in PROMPTS]
    bans = [hf_generate(llama_dir, i)[2] for i in ids]
    params, expected = [], []
    for k, (prompt_ids, ban) in enumerate(zip(ids, bans, strict=True)):
        extra = {"banned_token_ids": [ban]}
        options = {"bad_words_ids": [[ban]]}
        if k % 3 == 0:
            extra["no_repeat_ngram_size"] = 2
            options["no_repeat_ngram_size"] = 2
        params.append(greedy(extra_args=extra))
        expected.append(hf_generate(llama_dir, prompt_ids, **options))
    before = dict(UpdateRecorder.seen)
    preemptions = llm.engine.core.get_stats().num_preemptions
    outs = llm.generate([{"prompt_token_ids": i} for i in ids], params)
    assert llm.engine.core.get_stats().num_preemptions > preemptions, "the pool was meant to force preemption"
    seen = {name: UpdateRecorder.seen[name] - before[name] for name in before}
    assert seen["added"] > len(PROMPTS) and seen["removed"] == seen["added"] and seen["moved"] > 0
    for k, out in enumerate(outs):
        assert out.outputs[0].token_ids == expected[k], f"request {k}"


def test_bad_extra_args_are_refused_before_anything_is_queued(llm):
    with pytest.raises(ValueError, match="banned_token_ids"):
        llm.generate(PROMPTS[:2], [greedy(), greedy(extra_args={"banned_token_ids": "x"})])
    with pytest.raises(ValueError, match="no_repeat_ngram_size"):
        llm.generate(PROMPTS[0], greedy(extra_args={"no_repeat_ngram_size": 0}))
    assert not llm.engine.has_unfinished_requests()


def test_unknown_processors_are_refused_at_startup(llama_dir):
    for spec, message in (("kvtide.no_such_module:X", "cannot import"), ("kvtide.sampling_params:Nope", "no class"),
                          ("kvtide.sampling_params:SamplingParams", "not a logits processor")):
        with pytest.raises(ValueError, match=message):
            LLM(model=llama_dir, max_model_len=64, kv_cache_memory="1MiB", logits_processors=[spec])


class _Record:
    def __init__(self, request_id: str, tokens: list[int], num_prompt: int) -> None:
        self.request_id, self.token_ids, self.num_prompt_tokens = request_id, tokens, num_prompt
        self.sampling_params = SamplingParams(extra_args={"banned_token_ids": [int(request_id)]})


def test_batch_updates_remove_then_add_then_move():
    ban = TokenBanLogitsProcessor(None, torch.device("cpu"), False)
    batch = LogitsProcessorBatch([ban])
    records = {r: _Record(r, [1, 2, 3], 2) for r in ("10", "11", "12", "13")}
    for r in ("10", "11", "12", "13"):
        batch.request_added(records[r])
    step = batch.step([records["13"], records["10"]])
    assert step.indices == [3, 0] and ban.banned == {0: [10], 1: [11], 2: [12], 3: [13]}
    batch.request_removed("10")
    batch.request_removed("11")
    update = batch._batch_update()
    assert update.removed == [0, 1] and update.added == []
    assert update.moved == [(3, 0, MoveDirectionality.UNIDIRECTIONAL), (2, 1, MoveDirectionality.UNIDIRECTIONAL)]
    assert update.batch_size == 2
    ban.update_state(update)
    assert ban.banned == {0: [13], 1: [12]}
    batch.request_removed("12")
    batch.request_added(records["11"])  # takes the freed index, nothing moves
    update = batch._batch_update()
    assert (update.removed, [a[0] for a in update.added], update.moved) == ([1], [1], [])
    ban.update_state(update)
    logits = torch.zeros(2, 16)
    processed = batch.step([records["11"], records["13"]]).apply(logits, argmax_invariant=False)
    assert torch.isneginf(processed[0, 11]) and torch.isneginf(processed[1, 13])
    assert int(torch.isneginf(processed).sum()) == 2


def test_output_tokens_are_a_live_view():
    record = _Record("1", [5, 6, 7], 2)
    view = OutputTokens(record)
    assert list(view) == [7] and len(view) == 1
    record.token_ids.append(8)
    assert view == [7, 8] and view[-1] == 8 and view[0:1] == [7]
    with pytest.raises(IndexError):
        view[2]


def test_no_repeat_ngram_processor_is_unaffected_by_other_rows():
    processor = NoRepeatNGramLogitsProcessor(None, torch.device("cpu"), False)
    params = SamplingParams(extra_args={"no_repeat_ngram_size": 2})
    processor.update_state(BatchUpdate(2, [], [(1, params, [4, 5, 4], [])], []))
    logits = processor.apply(torch.zeros(2, 8))
    assert torch.isneginf(logits[1, 5]) and int(torch.isneginf(logits).sum()) == 1
