"""EAGLE-1 and EAGLE-3 draft heads for Llama-family targets, built on kvtide's layers so their K/V live
in the paged cache like the target's.

A draft step at position i pairs the token at i + 1 with the feature at i and predicts the token at
i + 2. "Feature" means:

    EAGLE-1  in:  the target's final hidden state (after its final norm, the LM head's input)
             x = fc(cat(embed(token), feature));  N decoder layers (layer 0 without input_layernorm)
             out = the last layer's hidden + residual: the next step's feature, and the logits'
             input as is: logits = target.lm_head(out), no norm (EAGLE trains its output to stand in
             for the target's post-norm hidden state, which the target's LM head reads directly)
    EAGLE-3  in:  fc(cat(aux_0, aux_1, aux_2)), three residual-stream states of the target (the input
             of layers aux_layer_ids()); later chain steps feed the draft's own output instead, which
             already has the hidden width, so fc applies only to the target's (3 * hidden) states
             one "midlayer": attention over cat(input_layernorm(embed(token)), hidden_norm(feature)),
             the residual stream starting from the feature itself (before hidden_norm, unless the
             config sets norm_before_residual)
             out = midlayer output before the final norm: the next step's feature
             logits = lm_head(norm(out)) over the draft vocabulary, mapped into target ids through d2t
             (target_id = draft_id + d2t[draft_id]); target tokens outside the draft vocabulary: -inf

Checkpoint names are the public ones (yuhuili/EAGLE-*, yuhuili/EAGLE3-*): EAGLE-1 `fc.weight` [+ `fc.bias`],
`layers.{i}.*`, optional `embed_tokens.weight`; EAGLE-3 `midlayer.*`, `fc.weight`, `norm.weight`,
`lm_head.weight`, `d2t`, optional `t2d` and `embed_tokens.weight`. A head without its own embedding (or
EAGLE-1's LM head) uses the target's module, held as a reference and not registered as a submodule, so
the draft's parameters are only its own.
"""

from __future__ import annotations

import torch
from torch import nn

from kvtide.attention.backend import AttentionMetadata
from kvtide.distributed import get_tp_group
from kvtide.layers.attention import Attention
from kvtide.layers.embedding import LMHead, VocabEmbedding
from kvtide.layers.linear import (
    ColumnParallelLinear,
    MergedColumnParallelLinear,
    QKVParallelLinear,
    ReplicatedLinear,
    RowParallelLinear,
)
from kvtide.layers.norm import RMSNorm
from kvtide.layers.rotary import RotaryEmbedding
from kvtide.models.llama import LlamaAttention, LlamaDecoderLayer, LlamaForCausalLM, LlamaMLP
from kvtide.spec_decode.heads.loading import (
    check_tensors,
    construction,
    load_head_checkpoint,
    method_from_layout,
)

METHODS = ("eagle", "eagle3")
_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)


class Eagle3DecoderLayer(nn.Module):
    """EAGLE-3's one decoder layer: q, k, v read the token embedding and the feature side by side (2 x
    hidden wide); the residual stream and the MLP are a Llama layer's."""

    def __init__(self, config, max_model_len: int, dtype: torch.dtype, rotary: RotaryEmbedding) -> None:
        super().__init__()
        bias = bool(getattr(config, "attention_bias", False))
        self.self_attn = LlamaAttention(config, 0, max_model_len, dtype, bias, bias, False, rotary)
        attn = self.self_attn
        heads = config.num_attention_heads  # the whole layer's: QKVParallelLinear takes this rank's share
        attn.qkv_proj = QKVParallelLinear(2 * config.hidden_size, attn.head_dim, heads,
                                          getattr(config, "num_key_value_heads", None) or heads, bias=bias)
        self.mlp = LlamaMLP(config.hidden_size, config.intermediate_size, bias=getattr(config, "mlp_bias", False))
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.hidden_norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.norm_before_residual = bool(getattr(config, "norm_before_residual", False))

    def forward(self, cos_sin: tuple[torch.Tensor, torch.Tensor], embeds: torch.Tensor, features: torch.Tensor,
                metadata: AttentionMetadata) -> torch.Tensor:
        """-> hidden + residual (T, hidden), before the final norm."""
        normed = self.hidden_norm(features)
        # the fused norm below adds into `residual` in place: never the caller's tensor
        residual = normed if self.norm_before_residual else features.clone()
        hidden = self.self_attn(cos_sin, torch.cat((self.input_layernorm(embeds), normed), dim=-1), metadata)
        hidden, residual = self.post_attention_layernorm(hidden, residual)
        return self.mlp(hidden) + residual


class EagleDraftModel(nn.Module):
    method: str
    """"eagle" (EAGLE-1) or "eagle3"."""
    maps_identity = True
    """EAGLE-3: whether every draft id is its own target id (full vocabulary, d2t all zero)."""

    def __init__(self, config, method: str, max_model_len: int, dtype: torch.dtype, target_vocab_size: int,
                 own_embedding: bool, own_lm_head: bool, fc_bias: bool = False) -> None:
        super().__init__()
        if method not in METHODS:
            raise ValueError(f"EAGLE method must be one of {', '.join(METHODS)}, got {method!r}")
        self.config = config
        self.method = method
        self.hidden_size = config.hidden_size
        self.target_vocab_size = target_vocab_size
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        self.rotary_emb = RotaryEmbedding(config, head_dim, max_model_len, dtype)
        self.embed_tokens = VocabEmbedding(config.vocab_size, config.hidden_size) if own_embedding else None
        self.shared: dict[str, nn.Module] = {}
        """The target's modules this head uses instead of its own (embed_tokens, lm_head); not submodules."""
        self.midlayer: Eagle3DecoderLayer | None = None
        self.layers: nn.ModuleList | None = None
        self.norm: RMSNorm | None = None
        self.lm_head: LMHead | None = None
        if method == "eagle":
            bias = bool(getattr(config, "attention_bias", False))
            self.fc = ReplicatedLinear(2 * config.hidden_size, config.hidden_size, bias=fc_bias)
            self.layers = nn.ModuleList(
                LlamaDecoderLayer(config, i, max_model_len, dtype, bias, bias, False, self.rotary_emb)
                for i in range(config.num_hidden_layers))
            self.layers[0].input_layernorm = nn.Identity()
            if own_lm_head:
                self.lm_head = LMHead(config.vocab_size, config.hidden_size)
        else:
            target_hidden = getattr(config, "target_hidden_size", None) or config.hidden_size
            self.fc = ReplicatedLinear(3 * target_hidden, config.hidden_size, bias=fc_bias)
            self.midlayer = Eagle3DecoderLayer(config, max_model_len, dtype, self.rotary_emb)
            self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
            self.draft_vocab_size = getattr(config, "draft_vocab_size", None) or config.vocab_size
            if own_lm_head:
                self.lm_head = LMHead(self.draft_vocab_size, config.hidden_size)
            self.register_buffer("draft_to_target", torch.arange(self.draft_vocab_size, dtype=torch.int64))
            """Target token id of each draft-vocabulary row (arange + d2t)."""

    # ---- the engine's interface ------------------------------------------------------------------------
    def attention_layers(self) -> list[Attention]:
        if self.midlayer is not None:
            return [self.midlayer.self_attn.attn]
        assert self.layers is not None
        return [layer.self_attn.attn for layer in self.layers]

    def aux_layer_ids(self, target_hf_config) -> tuple[int, ...]:
        """EAGLE-3: the target layers whose input (residual stream) the fc reads, in fc order; the engine
        sets them as the target's `aux_hidden_state_layers`. The checkpoint's top-level
        eagle_aux_hidden_state_layer_ids, else eagle_config.eagle_aux_hidden_state_layer_ids, else
        (2, L // 2, L - 3) for a target of L layers, the choice EAGLE-3 trains with."""
        if self.method != "eagle3":
            raise ValueError("aux_layer_ids: only EAGLE-3 heads read auxiliary hidden states")
        return eagle3_aux_layer_ids(self.config, target_hf_config)

    def combine_features(self, target_features: torch.Tensor) -> torch.Tensor:
        """EAGLE-1: the target's (T, hidden) post-norm hidden states, unchanged. EAGLE-3: the (T, 3 * hidden)
        concatenated auxiliary states -> fc -> (T, hidden)."""
        if self.method == "eagle":
            self._check_width(target_features, self.hidden_size, "combine_features")
            return target_features
        self._check_width(target_features, self.fc.input_size, "combine_features")
        return self.fc(target_features)

    def forward(self, input_ids: torch.Tensor, features: torch.Tensor, positions: torch.Tensor,
                metadata: AttentionMetadata) -> torch.Tensor:
        """(T,) tokens (token_{i+1} paired with feature_i), (T, hidden) features (already combined),
        positions (T,) -> (T, hidden) output features: the next features of the chain."""
        self._check_width(features, self.hidden_size, "forward (features go through combine_features first)")
        embeds = self._embedding()(input_ids)
        cos_sin = self.rotary_emb.cos_sin(positions)
        if self.midlayer is not None:
            return self.midlayer(cos_sin, embeds, features, metadata)
        assert self.layers is not None
        hidden = self.fc(torch.cat((embeds, features), dim=-1))
        residual = None
        for layer in self.layers:
            hidden, residual = layer(cos_sin, hidden, residual, metadata)
        return hidden + residual

    def compute_logits(self, features: torch.Tensor) -> torch.Tensor:
        """(T, hidden) output features -> (T, target vocab) float32 logits in target token ids."""
        lm_head = self.lm_head if self.lm_head is not None else self.shared["lm_head"]
        if self.method == "eagle":
            return lm_head.logits(features).float()
        assert self.norm is not None
        logits = lm_head.logits(self.norm(features)).float()
        if logits.shape[1] == self.target_vocab_size and self.maps_identity:
            return logits
        out = logits.new_full((logits.shape[0], self.target_vocab_size), float("-inf"))
        out[:, self.draft_to_target] = logits
        return out

    # ---- loading ---------------------------------------------------------------------------------------
    def _embedding(self) -> nn.Module:
        return self.embed_tokens if self.embed_tokens is not None else self.shared["embed_tokens"]

    @staticmethod
    def _check_width(x: torch.Tensor, width: int, what: str) -> None:
        if x.dim() != 2 or x.shape[1] != width:
            raise ValueError(f"EAGLE {what}: expected (T, {width}), got {tuple(x.shape)}")

    def checkpoint_layout(self) -> dict[str, tuple[str, object, tuple[int, ...]]]:
        """Checkpoint tensor name -> (parameter name, shard id, shape) for every parameter of this head,
        fused projections split back into their public q/k/v and gate/up names. Shapes are the
        checkpoint's whole tensors: under tensor parallelism each parameter holds a rank's shard
        of one (the parallel layers' weight loaders cut it), so they are derived from the config."""
        unfused: dict[str, list[tuple[str, object]]] = {}
        for ckpt_name, (fused, shard) in LlamaForCausalLM.packed_modules_mapping.items():
            unfused.setdefault(fused, []).append((ckpt_name, shard))
        modules = dict(self.named_modules())
        tp = get_tp_group().world_size
        heads = self.config.num_attention_heads
        kv_heads = getattr(self.config, "num_key_value_heads", None) or heads
        layout: dict[str, tuple[str, object, tuple[int, ...]]] = {}
        for name, param in self.named_parameters():
            module_name, _, leaf = name.rpartition(".")
            parent, _, short = module_name.rpartition(".")
            module = modules[module_name]
            if short not in unfused:
                layout[name] = (name, None, _whole_shape(module, param, tp))
                continue
            for ckpt_name, shard in unfused[short]:
                if isinstance(module, QKVParallelLinear):
                    rows = (heads if shard == "q" else kv_heads) * module.head_dim
                else:
                    assert isinstance(module, MergedColumnParallelLinear) and isinstance(shard, int)
                    rows = module.output_sizes[shard] * tp
                layout[f"{parent}.{ckpt_name}.{leaf}"] = (name, shard, (rows, *param.shape[1:]))
        return layout

    @classmethod
    def from_pretrained(cls, path: str, method: str, target_model: nn.Module, target_hf_config,
                        max_model_len: int, dtype: torch.dtype, device: str | torch.device) -> EagleDraftModel:
        """Load a public EAGLE-1 or EAGLE-3 checkpoint for `target_model`. ValueError when the layout is
        another method's, the head does not fit the target (hidden size, vocabulary), or tensors are
        missing, unexpected or mis-shaped."""
        from transformers import LlamaConfig

        if method not in METHODS:
            raise ValueError(f"EAGLE method must be one of {', '.join(METHODS)}, got {method!r}")
        ckpt = load_head_checkpoint(path)
        what = f"{'EAGLE-3' if method == 'eagle3' else 'EAGLE'} checkpoint {ckpt.path}"
        detected = method_from_layout(ckpt.config, ckpt.tensors)
        if detected != method:
            found = (f"the {detected!r} layout" if detected
                     else "no EAGLE layout (fc.weight with layers.*, or midlayer.*)")
            raise ValueError(f"{what}: speculative method is {method!r} but the checkpoint holds {found}")
        tensors = {name.removeprefix("model."): t for name, t in ckpt.tensors.items()
                   if not name.endswith(_IGNORED_SUFFIXES)}
        config_dict = {k: v for k, v in ckpt.config.items() if k != "model_type"}
        try:
            config = LlamaConfig(**config_dict)
        except (TypeError, ValueError) as e:
            raise ValueError(f"{what}: config.json is not a Llama config ({e})") from e
        target_hidden, target_vocab = target_hf_config.hidden_size, target_hf_config.vocab_size
        _check_fits_target(config, method, tensors, target_hidden, target_vocab, what)
        for attr in ("embed_tokens", "lm_head"):
            if not isinstance(getattr(target_model, attr, None), VocabEmbedding):
                raise ValueError(f"{what}: the target model ({type(target_model).__name__}) has no {attr} to share")

        own_embedding = "embed_tokens.weight" in tensors
        if own_embedding and _same_table(tensors["embed_tokens.weight"], target_model.embed_tokens):
            del tensors["embed_tokens.weight"]  # EAGLE trains with the target's embedding frozen: keep one copy
            own_embedding = False
        own_lm_head = "lm_head.weight" in tensors
        with construction(dtype, device):
            model = cls(config, method, max_model_len, dtype, target_vocab, own_embedding, own_lm_head,
                        fc_bias="fc.bias" in tensors)
        if not own_embedding:
            model.shared["embed_tokens"] = target_model.embed_tokens
        if not own_lm_head:
            model.shared["lm_head"] = target_model.lm_head

        layout = model.checkpoint_layout()
        expected = {name: shape for name, (_, _, shape) in layout.items()}
        if method == "eagle3":
            expected.update(_vocab_map_shapes(model.draft_vocab_size, target_vocab, tensors))
        check_tensors(tensors, expected, what)
        params = dict(model.named_parameters())
        for name, (param_name, shard, _) in layout.items():
            param = params[param_name]
            param.weight_loader(param, tensors[name].to(param.dtype), shard)  # type: ignore[attr-defined]
        if method == "eagle3" and "d2t" in tensors:
            _load_d2t(model, tensors["d2t"], target_vocab, what)
        return model.eval()


def _whole_shape(module: nn.Module, param: nn.Parameter, tp: int) -> tuple[int, ...]:
    """The checkpoint shape of an unfused parameter that may hold a rank's shard of it."""
    shape = tuple(param.shape)
    if isinstance(module, VocabEmbedding):  # LMHead too: rows padded to a multiple of tp, split
        return (module.vocab_size, *shape[1:])
    if isinstance(module, RowParallelLinear) and param is module.weight:
        return (shape[0], shape[1] * tp)
    if isinstance(module, ColumnParallelLinear):
        return (shape[0] * tp, *shape[1:])
    return shape


def _same_table(table: torch.Tensor, embedding: VocabEmbedding) -> bool:
    """Whether a checkpoint's (vocab, hidden) table is the target's embedding, as every rank of the
    TP group sees it: each compares its own rows, and they agree (one all-reduce at load), so all
    share the target's table or all keep their own."""
    weight = embedding.weight
    rows = embedding.rows_here
    same = tuple(table.shape) == (embedding.vocab_size, weight.shape[1]) and torch.equal(
        table[embedding.vocab_start:embedding.vocab_start + rows].to(weight), weight[:rows])
    tp = get_tp_group()
    if tp.world_size == 1:
        return same
    votes = torch.tensor([int(same)], dtype=torch.int64, device=weight.device)
    return int(tp.all_reduce(votes).item()) == tp.world_size


def eagle3_aux_layer_ids(config, target_hf_config) -> tuple[int, ...]:
    """See EagleDraftModel.aux_layer_ids; ValueError when the ids cannot be the input of three distinct
    target layers in increasing order (the order the target collects them in)."""
    num_layers = target_hf_config.num_hidden_layers
    eagle_config = getattr(config, "eagle_config", None)
    ids = getattr(config, "eagle_aux_hidden_state_layer_ids", None)
    if not ids and isinstance(eagle_config, dict):
        ids = eagle_config.get("eagle_aux_hidden_state_layer_ids")
    if not ids:
        ids = (2, num_layers // 2, num_layers - 3)
        source = f"the default (2, L // 2, L - 3) for a target of L = {num_layers} layers"
    else:
        source = "the checkpoint's eagle_aux_hidden_state_layer_ids"
    try:
        ids = tuple(int(i) for i in ids)
    except (TypeError, ValueError) as e:
        raise ValueError(f"EAGLE-3 auxiliary layers must be a list of layer ids, got {ids!r}") from e
    if (len(ids) != 3 or any(not 0 <= i < num_layers for i in ids)
            or any(a >= b for a, b in zip(ids, ids[1:], strict=False))):
        raise ValueError(f"EAGLE-3 auxiliary layers {ids} ({source}) must be three increasing layer ids in "
                         f"[0, {num_layers})")
    return ids


def _check_fits_target(config, method: str, tensors: dict[str, torch.Tensor], target_hidden: int,
                       target_vocab: int, what: str) -> None:
    if method == "eagle":
        if config.hidden_size != target_hidden:
            raise ValueError(f"{what}: hidden_size is {config.hidden_size} but the target model's is "
                             f"{target_hidden}; this head was trained for another model")
        if config.num_hidden_layers < 1:
            raise ValueError(f"{what}: num_hidden_layers must be >= 1, got {config.num_hidden_layers}")
    else:
        fc_in = getattr(config, "target_hidden_size", None) or config.hidden_size
        if fc_in != target_hidden:
            raise ValueError(f"{what}: the head reads target hidden states of size {fc_in} but the target "
                             f"model's hidden_size is {target_hidden}; this head was trained for another model")
        if config.num_hidden_layers != 1:
            raise ValueError(f"{what}: only one draft layer (midlayer) is supported, config has "
                             f"num_hidden_layers={config.num_hidden_layers}")
        eagle_config = getattr(config, "eagle_config", None)
        if isinstance(eagle_config, dict) and eagle_config.get("use_aux_hidden_state") is False:
            raise ValueError(f"{what}: heads without auxiliary hidden states (use_aux_hidden_state=false) are not "
                             f"supported")
    if "embed_tokens.weight" not in tensors and config.hidden_size != target_hidden:
        raise ValueError(f"{what}: the head has no embedding of its own and its hidden_size "
                         f"({config.hidden_size}) differs from the target's ({target_hidden})")
    if config.vocab_size != target_vocab:
        raise ValueError(f"{what}: vocab_size is {config.vocab_size} but the target model's is {target_vocab}")
    if "lm_head.weight" not in tensors:
        draft_vocab = getattr(config, "draft_vocab_size", None) or config.vocab_size
        if method == "eagle3" and (draft_vocab != target_vocab or config.hidden_size != target_hidden):
            raise ValueError(f"{what}: missing tensors: lm_head.weight (a draft vocabulary of {draft_vocab} "
                             f"cannot share the target's LM head)")


def _vocab_map_shapes(draft_vocab: int, target_vocab: int, tensors: dict[str, torch.Tensor]
                      ) -> dict[str, tuple[int, ...]]:
    """d2t is required when the draft vocabulary is smaller than the target's; t2d is optional."""
    shapes: dict[str, tuple[int, ...]] = {}
    if "d2t" in tensors or draft_vocab != target_vocab:
        shapes["d2t"] = (draft_vocab,)
    if "t2d" in tensors:
        shapes["t2d"] = (target_vocab,)
    return shapes


def _load_d2t(model: EagleDraftModel, d2t: torch.Tensor, target_vocab: int, what: str) -> None:
    if d2t.dtype.is_floating_point or d2t.dtype == torch.bool:
        raise ValueError(f"{what}: d2t must hold integer offsets, got {d2t.dtype}")
    targets = torch.arange(d2t.shape[0], dtype=torch.int64) + d2t.to(torch.int64).cpu()
    if targets.numel() and (int(targets.min()) < 0 or int(targets.max()) >= target_vocab):
        raise ValueError(f"{what}: d2t maps draft ids outside the target vocabulary [0, {target_vocab})")
    if targets.unique().numel() != targets.numel():
        raise ValueError(f"{what}: d2t maps two draft ids to the same target id")
    model.draft_to_target.copy_(targets)
    model.maps_identity = bool((d2t == 0).all()) and d2t.shape[0] == target_vocab
