"""Decoder LMs as pooling models against Hugging Face: embedders (LAST / MEAN pooling, chunked
prefill with the pooled state carried, the prefix cache), sequence classifiers (logits, scores,
rerank order), and the refusals of the offline API."""

from __future__ import annotations

import pytest
import torch
from pooling_reference import PROMPTS, cosine_distance, hf_embedding, hf_ids, hf_logits

from kvtide import LLM
from kvtide.pooling.outputs import ClassificationRequestOutput, EmbeddingRequestOutput, ScoringRequestOutput
from kvtide.pooling.params import PoolingParams

QWEN3 = dict(head_dim=32)


def make_llm(model_dir: str, **kwargs) -> LLM:
    kwargs.setdefault("max_model_len", 512)
    return LLM(model_dir, device="cpu", dtype="float32", kv_cache_memory="16MiB", max_num_seqs=8, **kwargs)


@pytest.fixture(scope="module")
def qwen3_embedder(checkpoint_factory) -> str:
    return checkpoint_factory("Qwen3Model", seed=3, **QWEN3)


@pytest.fixture(scope="module")
def qwen3_llm(qwen3_embedder):
    llm = make_llm(qwen3_embedder)
    yield llm
    llm.shutdown()


def test_qwen2_gte_layout_embeddings_match_hf(checkpoint_factory):
    model_dir = checkpoint_factory("Qwen2Model", seed=29)
    llm = make_llm(model_dir)
    try:
        for prompt, output in zip(PROMPTS, llm.embed(PROMPTS), strict=True):
            assert cosine_distance(output.outputs.embedding, hf_embedding(model_dir, prompt, "LAST")) < 1e-5
    finally:
        llm.shutdown()


def test_qwen3_embeddings_match_hf_in_a_mixed_batch(qwen3_embedder, qwen3_llm):
    outputs = qwen3_llm.embed(PROMPTS)
    assert all(isinstance(o, EmbeddingRequestOutput) for o in outputs)
    for prompt, output in zip(PROMPTS, outputs, strict=True):
        assert output.prompt_token_ids == hf_ids(qwen3_embedder, prompt)
        assert len(output.outputs.embedding) == 128
        assert abs(float(torch.tensor(output.outputs.embedding).norm()) - 1.0) < 1e-5
        assert cosine_distance(output.outputs.embedding, hf_embedding(qwen3_embedder, prompt, "LAST")) < 1e-5


def test_chunked_prefill_and_prefix_cache_keep_last_token_embeddings(qwen3_embedder):
    llm = make_llm(qwen3_embedder, max_num_batched_tokens=24)  # the long prompts run in chunks
    try:
        first = llm.embed(PROMPTS)
        again = llm.encode(PROMPTS)  # the same prompts: their full blocks come from the prefix cache
        assert max(o.num_cached_tokens for o in again) >= 16
        for prompt, a, b in zip(PROMPTS, first, again, strict=True):
            reference = hf_embedding(qwen3_embedder, prompt, "LAST")
            assert cosine_distance(a.outputs.embedding, reference) < 1e-5
            assert cosine_distance(b.outputs.data, reference) < 1e-5
    finally:
        llm.shutdown()


def test_mean_pooling_carries_its_sum_across_chunks(checkpoint_factory):
    model_dir = checkpoint_factory("LlamaModel", seed=5)
    # Async scheduling too: the next step is scheduled while one runs, and no pooling request runs past its prompt.
    llm = make_llm(model_dir, max_num_batched_tokens=20, async_scheduling=True,
                   pooler_config={"pooling_type": "MEAN", "normalize": False})
    try:
        assert not llm.engine.core.config.cache_config.enable_prefix_caching  # MEAN reads every position
        outputs = llm.embed(PROMPTS)
        for prompt, output in zip(PROMPTS, outputs, strict=True):
            reference = hf_embedding(model_dir, prompt, "MEAN", normalize=False)
            assert cosine_distance(output.outputs.embedding, reference) < 1e-5
            assert torch.allclose(torch.tensor(output.outputs.embedding), reference, atol=1e-4, rtol=1e-4)
    finally:
        llm.shutdown()


def test_causal_lm_converted_to_an_embedder(checkpoint_factory):
    model_dir = checkpoint_factory("Qwen2ForCausalLM", seed=7)
    llm = make_llm(model_dir, runner="pooling", convert="embed")
    try:
        outputs = llm.embed(PROMPTS[:3], pooling_params=PoolingParams(normalize=False))
        for prompt, output in zip(PROMPTS, outputs, strict=False):
            reference = hf_embedding(model_dir, prompt, "LAST", normalize=False)
            assert torch.allclose(torch.tensor(output.outputs.embedding), reference, atol=1e-4, rtol=1e-4)
    finally:
        llm.shutdown()


@pytest.fixture(scope="module")
def qwen3_classifier(checkpoint_factory) -> str:
    return checkpoint_factory("Qwen3ForSequenceClassification", seed=11, num_labels=3, **QWEN3)


def test_classification_logits_and_probs_match_hf(qwen3_classifier):
    llm = make_llm(qwen3_classifier)
    try:
        logits = llm.classify(PROMPTS, pooling_params=PoolingParams(task="classify", use_activation=False))
        probs = llm.classify(PROMPTS)
        assert all(isinstance(o, ClassificationRequestOutput) for o in probs)
        for prompt, raw, prob in zip(PROMPTS, logits, probs, strict=True):
            reference = hf_logits(qwen3_classifier, prompt)
            assert torch.allclose(torch.tensor(raw.outputs.probs), reference, atol=1e-4, rtol=0)
            assert torch.allclose(torch.tensor(prob.outputs.probs), reference.softmax(-1), atol=1e-5, rtol=0)
        with pytest.raises(ValueError, match="embed"):
            llm.embed(PROMPTS[:1])
    finally:
        llm.shutdown()


@pytest.mark.parametrize("architecture", ["LlamaForSequenceClassification", "Qwen2ForSequenceClassification"])
def test_cross_encoder_scores_and_rerank_order_match_hf(checkpoint_factory, architecture):
    model_dir = checkpoint_factory(architecture, seed=13, num_labels=1)
    query = "which animal is quick"
    documents = ["the quick brown fox", "a lazy dog sleeps", "quick animals run fast", "weather today", "x"]
    llm = make_llm(model_dir)
    try:
        scores = llm.score(query, documents)
        assert all(isinstance(s, ScoringRequestOutput) for s in scores)
        reference = [float(torch.sigmoid(hf_logits(model_dir, query, d)[0])) for d in documents]
        for s, r, d in zip(scores, reference, documents, strict=True):
            assert abs(s.outputs.score - r) < 1e-5
            assert s.prompt_token_ids == hf_ids(model_dir, query, d)
        by_score = sorted(range(len(documents)), key=lambda i: -scores[i].outputs.score)
        assert by_score == sorted(range(len(documents)), key=lambda i: -reference[i])
        pairs = llm.score([query, "another query"], documents[:2])  # one-to-one
        assert abs(pairs[1].outputs.score - float(torch.sigmoid(hf_logits(model_dir, "another query",
                                                                            documents[1])[0]))) < 1e-5
        with pytest.raises(ValueError, match="one-to-one or one-to-many"):
            llm.score([query, "b"], documents)
    finally:
        llm.shutdown()


def test_embedding_model_scores_by_cosine(qwen3_embedder, qwen3_llm):
    scores = qwen3_llm.score("hello world", ["hello there", "x"])
    for s, d in zip(scores, ["hello there", "x"], strict=True):
        expected = float(torch.dot(hf_embedding(qwen3_embedder, "hello world", "LAST"),
                                   hf_embedding(qwen3_embedder, d, "LAST")))
        assert abs(s.outputs.score - expected) < 1e-5


def test_refusals_and_truncation(qwen3_embedder, qwen3_llm, llama_dir):
    with pytest.raises(ValueError, match="Matryoshka"):
        qwen3_llm.embed("hello", pooling_params=PoolingParams(dimensions=8))
    with pytest.raises(ValueError, match="classify model"):
        qwen3_llm.classify("hello")
    with pytest.raises(ValueError, match="empty"):
        qwen3_llm.embed([""])
    out = qwen3_llm.embed("hello world, and more", truncate_prompt_tokens=5)[0]
    ids = hf_ids(qwen3_embedder, "hello world, and more")[:5]
    assert out.prompt_token_ids == ids
    ids_out = qwen3_llm.embed({"prompt_token_ids": [0, 5, 6, 7, 8, 9]}, truncate_prompt_tokens=3)[0]
    assert ids_out.prompt_token_ids == [7, 8, 9]  # token ids keep their last tokens
    generator = make_llm(llama_dir)
    try:
        with pytest.raises(ValueError, match="generation model"):
            generator.embed("hello")
    finally:
        generator.shutdown()


def test_matryoshka_dimensions(checkpoint_factory):
    model_dir = checkpoint_factory("Qwen3Model", seed=3, matryoshka_dimensions=[32, 64], **QWEN3)
    llm = make_llm(model_dir)
    try:
        out = llm.embed("hello world", pooling_params=PoolingParams(dimensions=32))[0].outputs.embedding
        full = hf_embedding(model_dir, "hello world", "LAST", normalize=False)
        assert len(out) == 32
        assert cosine_distance(out, full[:32]) < 1e-5 and abs(float(torch.tensor(out).norm()) - 1) < 1e-5
        with pytest.raises(ValueError, match="dimensions"):
            llm.embed("hello", pooling_params=PoolingParams(dimensions=48))
    finally:
        llm.shutdown()


def test_token_classifier_convention_scores_yes_against_no(checkpoint_factory):
    """Qwen3-Reranker's layout: a causal LM whose relevance is P(yes) over {no, yes} at the last position."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model_dir = checkpoint_factory("Qwen3ForCausalLM", seed=23, **QWEN3)
    llm = make_llm(model_dir, runner="pooling", pooler_config={"classifier_from_token": ["n", "y"]})
    try:
        query, documents = "is the fox quick", ["the quick brown fox", "weather today", "x"]
        scores = llm.score(query, documents)
        model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
        tokenizer = AutoTokenizer.from_pretrained(model_dir)
        no, yes = tokenizer.convert_tokens_to_ids(["n", "y"])
        for score, document in zip(scores, documents, strict=True):
            with torch.inference_mode():
                logits = model(torch.tensor([tokenizer(query, document).input_ids])).logits[0, -1]
            expected = float(logits[[no, yes]].softmax(-1)[1])
            assert abs(score.outputs.score - expected) < 1e-5
    finally:
        llm.shutdown()


def test_a_pooling_model_does_not_generate(qwen3_llm):
    with pytest.raises(ValueError, match="does not generate"):
        qwen3_llm.generate("hello")
