"""BERT-family encoders through the engine against Hugging Face (CLS and MEAN pooling, mixed
lengths in one batch) and against sentence-transformers' `encode` where a modules.json is present."""

from __future__ import annotations

import json
import os
import shutil

import pytest
import torch
from pooling_reference import PROMPTS, cosine_distance, hf_embedding, hf_model

from kvtide import LLM
from kvtide.pooling.params import PoolingParams

ENCODER = dict(num_key_value_heads=None, intermediate_size=256, max_position_embeddings=512, type_vocab_size=2)


def make_llm(model_dir: str, **kwargs) -> LLM:
    return LLM(model_dir, device="cpu", dtype="float32", max_model_len=256, kv_cache_memory="4MiB",
               max_num_seqs=8, **kwargs)


@pytest.fixture(scope="module")
def bert_dir(checkpoint_factory) -> str:
    return checkpoint_factory("BertModel", seed=17, **ENCODER)


def test_bert_cls_embeddings_match_hf(bert_dir):
    llm = make_llm(bert_dir)
    try:
        config = llm.engine.core.config
        assert config.model_config.pooler_config.pooling_type == "CLS"
        assert not config.cache_config.enable_prefix_caching and not config.scheduler_config.enable_chunked_prefill
        outputs = llm.embed(PROMPTS)
        for prompt, output in zip(PROMPTS, outputs, strict=True):
            assert cosine_distance(output.outputs.embedding, hf_embedding(bert_dir, prompt, "CLS")) < 1e-5
        # A prompt may fill max_model_len (256): nothing is generated after it; one more token is refused.
        long_text = "the quick brown fox jumps over the lazy dog " * 8
        full = llm.embed(long_text, truncate_prompt_tokens=-1)[0]
        assert len(full.prompt_token_ids) == 256
        model, tokenizer = hf_model(bert_dir)
        with torch.inference_mode():
            hidden = model(torch.tensor([tokenizer(long_text, truncation=True, max_length=256).input_ids]))
        assert cosine_distance(full.outputs.embedding, hidden.last_hidden_state[0, 0]) < 1e-5
        with pytest.raises(ValueError, match="more than max_model_len=256"):
            llm.embed({"prompt_token_ids": [5] * 257})
    finally:
        llm.shutdown()


def test_xlm_roberta_mean_embeddings_match_hf(checkpoint_factory):
    model_dir = checkpoint_factory("XLMRobertaModel", seed=19, **{**ENCODER, "max_position_embeddings": 260})
    llm = LLM(model_dir, device="cpu", dtype="float32", kv_cache_memory="4MiB", max_num_seqs=8,
              pooler_config='{"pooling_type": "MEAN", "normalize": false}')
    try:
        # Positions start past the padding id (2 here): 260 - 3 usable, whatever config.json says.
        assert llm.engine.core.config.model_config.max_model_len == 257
        outputs = llm.embed(PROMPTS)
        for prompt, output in zip(PROMPTS, outputs, strict=True):
            reference = hf_embedding(model_dir, prompt, "MEAN", normalize=False)
            assert torch.allclose(torch.tensor(output.outputs.embedding), reference, atol=1e-4, rtol=1e-4)
    finally:
        llm.shutdown()


@pytest.mark.parametrize("base,mode", [("bert", "mean_tokens"), ("bert", "cls_token"), ("qwen3", "lasttoken")])
def test_sentence_transformers_layout_matches_its_encode(bert_dir, checkpoint_factory, tmp_path, base, mode):
    """BERT with mean or CLS pooling (bge, e5 layouts); a Qwen3 embedding checkpoint with last-token
    pooling (the Qwen3-Embedding layout)."""
    from sentence_transformers import SentenceTransformer

    model_dir = str(tmp_path / "st")
    shutil.copytree(bert_dir if base == "bert" else checkpoint_factory("Qwen3Model", seed=3, head_dim=32), model_dir)
    modules = [{"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
               {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"},
               {"idx": 2, "name": "2", "path": "2_Normalize", "type": "sentence_transformers.models.Normalize"}]
    with open(os.path.join(model_dir, "modules.json"), "w") as f:
        json.dump(modules, f)
    os.makedirs(os.path.join(model_dir, "1_Pooling"))
    os.makedirs(os.path.join(model_dir, "2_Normalize"))
    with open(os.path.join(model_dir, "1_Pooling", "config.json"), "w") as f:
        json.dump({"word_embedding_dimension": 128, "pooling_mode_cls_token": mode == "cls_token",
                   "pooling_mode_mean_tokens": mode == "mean_tokens", "pooling_mode_max_tokens": False,
                   "pooling_mode_mean_sqrt_len_tokens": False, "pooling_mode_lasttoken": mode == "lasttoken"}, f)
    with open(os.path.join(model_dir, "sentence_bert_config.json"), "w") as f:
        json.dump({"max_seq_length": 256, "do_lower_case": False}, f)
    reference = SentenceTransformer(model_dir, device="cpu").encode(PROMPTS, convert_to_tensor=True, batch_size=3)
    llm = make_llm(model_dir)
    try:
        expected_type = {"mean_tokens": "MEAN", "cls_token": "CLS", "lasttoken": "LAST"}[mode]
        assert llm.engine.core.config.model_config.pooler_config.pooling_type == expected_type
        outputs = llm.embed(PROMPTS)
        for output, expected in zip(outputs, reference, strict=True):
            assert cosine_distance(output.outputs.embedding, expected) < 1e-5
    finally:
        llm.shutdown()


def test_xlm_roberta_cross_encoder_scores_match_hf(checkpoint_factory):
    """The bge-reranker layout: XLMRobertaForSequenceClassification over a pair, one label, sigmoid."""
    from pooling_reference import hf_logits

    model_dir = checkpoint_factory("XLMRobertaForSequenceClassification", seed=31, num_labels=1,
                                   **{**ENCODER, "max_position_embeddings": 260})
    llm = LLM(model_dir, device="cpu", dtype="float32", kv_cache_memory="4MiB", max_num_seqs=8)
    try:
        query, documents = "which animal is quick", ["the quick brown fox", "a lazy dog sleeps", "x"]
        scores = llm.score(query, documents)
        reference = [float(torch.sigmoid(hf_logits(model_dir, query, d)[0])) for d in documents]
        for score, expected in zip(scores, reference, strict=True):
            assert abs(score.outputs.score - expected) < 1e-5
        raw = llm.classify(documents, pooling_params=PoolingParams(task="classify", use_activation=False))
        for output, document in zip(raw, documents, strict=True):
            assert abs(output.outputs.probs[0] - float(hf_logits(model_dir, document)[0])) < 1e-4
    finally:
        llm.shutdown()


def test_bert_cross_encoder_gives_the_second_text_token_type_1(checkpoint_factory, tmp_path):
    """The ms-marco MiniLM layout: BertForSequenceClassification over "[CLS] query [SEP] doc [SEP]",
    the document's tokens (and the last [SEP]) of token type 1, as the tokenizer marks them."""
    from pooling_reference import hf_logits
    from tokenizers import processors

    from kvtide.models.demo import BOS_ID, EOS_ID, build_byte_tokenizer

    model_dir = str(tmp_path / "cross-encoder")
    shutil.copytree(checkpoint_factory("BertForSequenceClassification", seed=37, num_labels=1, **ENCODER), model_dir)
    tokenizer = build_byte_tokenizer(512)
    tokenizer.backend_tokenizer.post_processor = processors.TemplateProcessing(
        single="<s> $A </s>", pair="<s> $A </s> $B:1 </s>:1", special_tokens=[("<s>", BOS_ID), ("</s>", EOS_ID)])
    tokenizer.sep_token, tokenizer.cls_token = "</s>", "<s>"
    tokenizer.save_pretrained(model_dir)
    query, documents = "which animal is quick", ["the quick brown fox", "a lazy dog sleeps", "x"]
    from pooling_reference import hf_model

    assert 1 in hf_model(model_dir)[1](query, documents[0], return_token_type_ids=True).token_type_ids
    llm = make_llm(model_dir)
    try:
        scores = llm.score(query, documents)
        for score, document in zip(scores, documents, strict=True):
            model, tok = hf_model(model_dir, "classify")
            with torch.inference_mode():
                logits = model(**tok(query, document, return_token_type_ids=True, return_tensors="pt")).logits[0]
            assert abs(score.outputs.score - float(torch.sigmoid(logits[0]))) < 1e-5
        single = llm.classify(["x"], pooling_params=PoolingParams(task="classify", use_activation=False))[0]
        assert abs(single.outputs.probs[0] - float(hf_logits(model_dir, "x")[0])) < 1e-4
    finally:
        llm.shutdown()
