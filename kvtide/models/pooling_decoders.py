"""Decoder LMs as pooling models: embedders (`Qwen3Model`, `LlamaModel`, ...: the backbone without
an LM head) and sequence classifiers (`*ForSequenceClassification`: a `score` head over the pooled
hidden state). Each runs the causal decoder of its family on the paged KV cache unchanged; the
pooler (kvtide/pooling/runner.py) reads the final hidden states through `pooling_head`."""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import nn

from kvtide.layers.linear import materialize
from kvtide.models.llama import LlamaForCausalLM, MistralForCausalLM
from kvtide.models.qwen2 import Qwen2ForCausalLM
from kvtide.models.qwen3 import Qwen3ForCausalLM

_PREFILL_ONLY = "a pooling model runs prompts only (no decode steps to capture)"


class _DecoderEmbedder:
    """Mixed in before a causal LM class: no LM head; the pooled hidden state is the embedding."""

    cuda_graph_blocker = _PREFILL_ONLY

    def __init__(self, config, max_model_len: int, dtype: torch.dtype) -> None:
        super().__init__(config, max_model_len, dtype)  # type: ignore[call-arg]
        self.lm_head = None

    def checkpoint_name(self, name: str) -> str | None:
        # A causal LM checkpoint served as an embedder (--convert embed) leaves its LM head unread.
        return None if name.startswith("lm_head.") else super().checkpoint_name(name)  # type: ignore[misc]

    def pooling_head(self, pooled: torch.Tensor) -> torch.Tensor:
        """(R, hidden) pooled states -> (R, hidden) float32 embeddings (before normalization)."""
        return pooled.float()


class _DecoderClassifier(_DecoderEmbedder):
    """A `score` linear layer (hidden -> num_labels, no bias) over the pooled (last) hidden state.

    A causal LM checkpoint with `classifier_token_ids` [no, yes] (the Qwen3-Reranker convention,
    pooling/config.py) has no `score` tensor: its one row is the LM head's yes row minus its no row,
    so the label's logit is logit(yes) - logit(no) and its sigmoid the two-token softmax's P(yes)."""

    def __init__(self, config, max_model_len: int, dtype: torch.dtype) -> None:
        super().__init__(config, max_model_len, dtype)
        num_labels = int(getattr(config, "num_labels", 0) or 0)
        if num_labels < 1:
            raise ValueError("a sequence classification checkpoint needs num_labels >= 1 in config.json")
        self.score = nn.Linear(config.hidden_size, num_labels, bias=False)
        self.token_ids = getattr(config, "classifier_token_ids", None)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        if self.token_ids is None:
            return super().load_weights(weights)  # type: ignore[misc]
        rows: dict[str, torch.Tensor] = {}

        def keeping_token_rows(stream):
            for name, tensor in stream:
                short = name.removeprefix("model.")
                if short in ("lm_head.weight", "embed_tokens.weight"):
                    tensor = materialize(tensor)
                    rows[short] = tensor[self.token_ids].clone()  # (2, hidden): the no and yes rows
                yield name, tensor

        loaded = super().load_weights(keeping_token_rows(weights))  # type: ignore[misc]
        tied = getattr(self.config, "tie_word_embeddings", False)
        head = rows.get("embed_tokens.weight" if tied else "lm_head.weight")
        if head is None:
            raise ValueError("classifier_from_token needs the checkpoint's LM head (lm_head.weight)")
        self.score.weight.data.copy_((head[1] - head[0])[None].to(self.score.weight.dtype))
        return loaded | {"score.weight"}

    def pooling_head(self, pooled: torch.Tensor) -> torch.Tensor:
        """(R, hidden) -> (R, num_labels) float32 logits."""
        return self.score(pooled).float()


class LlamaModel(_DecoderEmbedder, LlamaForCausalLM):
    pass


class MistralModel(_DecoderEmbedder, MistralForCausalLM):
    pass


class Qwen2Model(_DecoderEmbedder, Qwen2ForCausalLM):
    pass


class Qwen3Model(_DecoderEmbedder, Qwen3ForCausalLM):
    pass


class LlamaForSequenceClassification(_DecoderClassifier, LlamaForCausalLM):
    pass


class Qwen2ForSequenceClassification(_DecoderClassifier, Qwen2ForCausalLM):
    pass


class Qwen3ForSequenceClassification(_DecoderClassifier, Qwen3ForCausalLM):
    pass
