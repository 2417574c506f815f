"""BERT-family encoders (`BertModel`, `XLMRobertaModel`, `RobertaModel`) as embedding models.

Bidirectional attention, learned absolute positions, token types, post-LayerNorm. Every token
attends every other token of its prompt, so an encoder keeps no paged KV cache: the scheduler hands
it whole prompts (kvtide/pooling/config.py) and each step is one batched forward over the step's
prompts, padded to the longest:

    flat step tokens  [a a a b b c c c c]  (query_start_loc [0, 3, 5, 9])
    padded (3, 4)     [a a a .]
                      [b b . .]      keys past a prompt's length are masked
                      [c c c c]
Parameter names follow the Hugging Face checkpoints', so they load by name.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
import torch.nn.functional as F
from torch import nn

from kvtide.attention.backend import AttentionMetadata
from kvtide.layers.linear import materialize

_ACTIVATIONS = {"gelu": lambda x: F.gelu(x), "gelu_new": lambda x: F.gelu(x, approximate="tanh"),
                "gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh"), "relu": F.relu}


class _Embeddings(nn.Module):
    def __init__(self, config, position_offset: int) -> None:
        super().__init__()
        self.word_embeddings = nn.Embedding(config.vocab_size, config.hidden_size)
        self.position_embeddings = nn.Embedding(config.max_position_embeddings, config.hidden_size)
        self.token_type_embeddings = nn.Embedding(max(getattr(config, "type_vocab_size", 1), 1), config.hidden_size)
        self.LayerNorm = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)
        self.position_offset = position_offset

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                token_types: torch.Tensor | None = None) -> torch.Tensor:
        """token_types (T,): None is segment 0 everywhere (its row still shifts every token)."""
        x = self.word_embeddings(input_ids) + self.position_embeddings(positions + self.position_offset)
        types = self.token_type_embeddings.weight[0] if token_types is None else self.token_type_embeddings(token_types)
        return self.LayerNorm(x + types)


class _SelfAttention(nn.Module):
    def __init__(self, config) -> None:
        super().__init__()
        h = config.hidden_size
        self.num_heads = config.num_attention_heads
        self.head_dim = h // self.num_heads
        self.query = nn.Linear(h, h)
        self.key = nn.Linear(h, h)
        self.value = nn.Linear(h, h)


class _AttentionOutput(nn.Module):
    def __init__(self, config, in_features: int) -> None:
        super().__init__()
        self.dense = nn.Linear(in_features, config.hidden_size)
        self.LayerNorm = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)

    def forward(self, x: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
        return self.LayerNorm(self.dense(x) + residual)


class _Attention(nn.Module):
    def __init__(self, config) -> None:
        super().__init__()
        self.self = _SelfAttention(config)
        self.output = _AttentionOutput(config, config.hidden_size)


class _Intermediate(nn.Module):
    def __init__(self, config) -> None:
        super().__init__()
        self.dense = nn.Linear(config.hidden_size, config.intermediate_size)
        act = getattr(config, "hidden_act", "gelu")
        if act not in _ACTIVATIONS:
            raise ValueError(f"encoder activation {act!r} is not supported ({', '.join(_ACTIVATIONS)})")
        self.act = _ACTIVATIONS[act]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.act(self.dense(x))


class _Layer(nn.Module):
    def __init__(self, config) -> None:
        super().__init__()
        self.attention = _Attention(config)
        self.intermediate = _Intermediate(config)
        self.output = _AttentionOutput(config, config.intermediate_size)

    def forward(self, x: torch.Tensor, padding: _Padding) -> torch.Tensor:
        attn = self.attention.self
        q, k, v = (padding.pad(proj(x)).view(padding.batch, padding.width, attn.num_heads, attn.head_dim)
                   .transpose(1, 2) for proj in (attn.query, attn.key, attn.value))
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=padding.key_mask)  # (B, heads, L, d)
        out = padding.unpad(out.transpose(1, 2).reshape(padding.batch * padding.width, -1))
        h = self.attention.output(out, x)
        return self.output(self.intermediate(h), h)


class _Encoder(nn.Module):
    def __init__(self, config) -> None:
        super().__init__()
        self.layer = nn.ModuleList(_Layer(config) for _ in range(config.num_hidden_layers))


class _Padding:
    """The step's prompts as a padded batch: where each flat token goes, and which keys are real."""

    def __init__(self, query_start_loc: list[int], device: torch.device) -> None:
        lens = torch.tensor([b - a for a, b in zip(query_start_loc, query_start_loc[1:], strict=False)])
        self.batch, self.width = len(lens), int(lens.max())
        row = torch.repeat_interleave(torch.arange(self.batch), lens)
        col = torch.arange(int(lens.sum())) - torch.repeat_interleave(torch.tensor(query_start_loc[:-1]), lens)
        self.index = (row * self.width + col).to(device)  # (T,) flat token -> padded slot
        valid = torch.arange(self.width)[None, :] < lens[:, None]  # (B, L)
        self.key_mask = valid[:, None, None, :].to(device)  # (B, 1, 1, L): True where a key is attended

    def pad(self, x: torch.Tensor) -> torch.Tensor:
        out = x.new_zeros(self.batch * self.width, x.shape[-1])
        out[self.index] = x
        return out

    def unpad(self, x: torch.Tensor) -> torch.Tensor:
        return x[self.index]


class BertModel(nn.Module):
    position_offset_from_padding = False
    """RoBERTa and XLM-R count positions from padding_idx + 1; BERT from 0."""
    cuda_graph_blocker = "an encoder runs whole prompts (no decode steps to capture)"

    def __init__(self, config, max_model_len: int, dtype: torch.dtype) -> None:
        super().__init__()
        self.config = config
        offset = (int(config.pad_token_id) + 1) if self.position_offset_from_padding else 0
        if max_model_len + offset > config.max_position_embeddings:
            raise ValueError(f"max_model_len={max_model_len} exceeds the encoder's positions "
                             f"({config.max_position_embeddings - offset})")
        self.embeddings = _Embeddings(config, offset)
        self.encoder = _Encoder(config)

    def attention_layers(self) -> list:
        return []  # no paged KV cache: every step attends within its own prompts

    def cuda_graph_unsupported(self) -> str | None:
        return self.cuda_graph_blocker

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, metadata: AttentionMetadata,
                **_: object) -> torch.Tensor:
        """input_ids, positions (T,): whole prompts, flat -> hidden states (T, hidden_size)."""
        padding = _Padding(list(metadata.query_start_loc_cpu), input_ids.device)
        x = self.embeddings(input_ids, positions, self.token_types(input_ids, metadata))
        for layer in self.encoder.layer:
            x = layer(x, padding)
        return x

    def pooling_head(self, pooled: torch.Tensor) -> torch.Tensor:
        return pooled.float()

    def token_types(self, input_ids: torch.Tensor, metadata: AttentionMetadata) -> torch.Tensor | None:
        """Segment ids of a pair prompt (a cross-encoder's): 1 after the first separator token
        (`config.segment_separator_id`, from the tokenizer), 0 up to it; None: one segment."""
        sep = getattr(self.config, "segment_separator_id", None)
        if sep is None or getattr(self.config, "type_vocab_size", 1) < 2:
            return None
        starts = list(metadata.query_start_loc_cpu)
        is_sep = (input_ids == sep).to(torch.int64)
        types = torch.zeros_like(input_ids)
        for a, b in zip(starts, starts[1:], strict=False):  # seps before each token, within its prompt
            seen = torch.cumsum(is_sep[a:b], dim=0) - is_sep[a:b]
            types[a:b] = (seen > 0).to(types.dtype)
        return types

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        params = dict(self.named_parameters())
        loaded = set()
        for name, tensor in weights:
            for prefix in ("bert.", "roberta.", "model."):
                name = name.removeprefix(prefix)
            if (name.startswith("pooler.") and not hasattr(self, "pooler")) or name.startswith(("lm_head.", "cls.")) \
                    or name.endswith("position_ids") or (name.startswith("classifier.") and not hasattr(self, "classifier")):
                continue  # the pooler and MLM heads are not part of the embedding
            param = params.get(name)
            if param is None:
                raise ValueError(f"checkpoint tensor {name!r} has no matching parameter in {type(self).__name__}")
            tensor = materialize(tensor)
            if tuple(param.shape) != tuple(tensor.shape):
                raise ValueError(f"{name}: checkpoint shape {tuple(tensor.shape)}, model {tuple(param.shape)}")
            param.data.copy_(tensor.to(param.dtype))
            loaded.add(name)
        return loaded


class XLMRobertaModel(BertModel):
    position_offset_from_padding = True


class RobertaModel(XLMRobertaModel):
    pass


class _ClassificationHead(nn.Module):
    """RoBERTa's head over the first (<s>) token: dense, tanh, out_proj."""

    def __init__(self, config) -> None:
        super().__init__()
        self.dense = nn.Linear(config.hidden_size, config.hidden_size)
        self.out_proj = nn.Linear(config.hidden_size, config.num_labels)


class XLMRobertaForSequenceClassification(XLMRobertaModel):
    """Cross-encoder rerankers of the bge-reranker kind: CLS pooling (pooling/config.py), then the
    classification head; a pair is one prompt with the tokenizer's pair template."""

    def __init__(self, config, max_model_len: int, dtype: torch.dtype) -> None:
        super().__init__(config, max_model_len, dtype)
        if int(getattr(config, "num_labels", 0) or 0) < 1:
            raise ValueError("a sequence classification checkpoint needs num_labels >= 1 in config.json")
        self.classifier = _ClassificationHead(config)

    def pooling_head(self, pooled: torch.Tensor) -> torch.Tensor:
        """(R, hidden) first-token states -> (R, num_labels) float32 logits."""
        head = self.classifier
        return head.out_proj(torch.tanh(head.dense(pooled))).float()


class RobertaForSequenceClassification(XLMRobertaForSequenceClassification):
    pass


class _Pooler(nn.Module):
    def __init__(self, config) -> None:
        super().__init__()
        self.dense = nn.Linear(config.hidden_size, config.hidden_size)


class BertForSequenceClassification(BertModel):
    """BERT cross-encoders (the ms-marco MiniLM kind): a pair is one prompt whose second segment gets
    token type 1 (`token_types`); CLS pooling, BERT's pooler (dense, tanh), then `classifier`."""

    def __init__(self, config, max_model_len: int, dtype: torch.dtype) -> None:
        super().__init__(config, max_model_len, dtype)
        if int(getattr(config, "num_labels", 0) or 0) < 1:
            raise ValueError("a sequence classification checkpoint needs num_labels >= 1 in config.json")
        self.pooler = _Pooler(config)
        self.classifier = nn.Linear(config.hidden_size, config.num_labels)

    def pooling_head(self, pooled: torch.Tensor) -> torch.Tensor:
        """(R, hidden) [CLS] states -> (R, num_labels) float32 logits."""
        return self.classifier(torch.tanh(self.pooler.dense(pooled))).float()
