"""Draft heads loaded from tiny random checkpoints in the public layouts (FasterDecoding and vLLM Medusa,
yuhuili EAGLE-1 and EAGLE-3), checked against references built here from the raw tensors and Hugging Face
transformers modules: EAGLE runs through kvtide's paged KV cache, as one prefill and as prefill + decode."""

from __future__ import annotations

import json
import os

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import save_file
from torch import nn
from transformers import AutoConfig, LlamaConfig
from transformers.models.llama import modeling_llama as hf

from kvtide.attention.registry import get_attention_backend
from kvtide.layers.cpu_ops import use_cpu_ops
from kvtide.models.loader import load_model
from kvtide.sampling_params import SamplingParams
from kvtide.spec_decode.heads.eagle import EagleDraftModel
from kvtide.spec_decode.heads.loading import detect_head_method
from kvtide.spec_decode.heads.medusa import MedusaHeads
from kvtide.worker.input_batch import CachedRequestState, prepare_step_inputs

HIDDEN, HEADS, KV_HEADS, INTER, TARGET_LAYERS = 64, 4, 2, 128, 8
MAX_LEN, BLOCK_SIZE, NUM_BLOCKS, SEQ = 64, 4, 8, 7
DRAFT_VOCAB = 48
ATOL = 1e-4


def write_checkpoint(path, config: dict, tensors: dict[str, torch.Tensor], fmt: str = "safetensors") -> str:
    os.makedirs(path, exist_ok=True)
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(config, f)
    tensors = {name: t.contiguous() for name, t in tensors.items()}
    if fmt == "safetensors":
        save_file(tensors, os.path.join(path, "model.safetensors"))
    else:
        torch.save(tensors, os.path.join(path, fmt))
    return str(path)


@pytest.fixture(scope="module")
def target(checkpoint_factory):
    """(model dir, hf config, kvtide LlamaForCausalLM) of a tiny 8-layer Llama, on one intra-op
    thread while this module runs."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    path = checkpoint_factory("LlamaForCausalLM", seed=0, hidden_size=HIDDEN, intermediate_size=INTER,
                              num_hidden_layers=TARGET_LAYERS, num_attention_heads=HEADS,
                              num_key_value_heads=KV_HEADS, max_position_embeddings=MAX_LEN)
    config = AutoConfig.from_pretrained(path)
    yield path, config, load_model(path, config, torch.float32, MAX_LEN, "cpu")
    torch.set_num_threads(threads)


# ---- Medusa -------------------------------------------------------------------------------------------
def medusa_tensors(num_heads: int, num_layers: int, vocab: int, seed: int = 0) -> dict[str, torch.Tensor]:
    """FasterDecoding names: `{i}.{j}.linear.weight|bias`, `{i}.{num_layers}.weight`."""
    g = torch.Generator().manual_seed(seed)
    tensors = {}
    for i in range(num_heads):
        for j in range(num_layers):
            tensors[f"{i}.{j}.linear.weight"] = torch.randn(HIDDEN, HIDDEN, generator=g) * 0.1
            tensors[f"{i}.{j}.linear.bias"] = torch.randn(HIDDEN, generator=g) * 0.1
        tensors[f"{i}.{num_layers}.weight"] = torch.randn(vocab, HIDDEN, generator=g) * 0.1
    return tensors


def to_vllm_medusa(tensors: dict[str, torch.Tensor], num_layers: int) -> dict[str, torch.Tensor]:
    out = {}
    for name, t in tensors.items():
        i, j, *rest = name.split(".")
        if int(j) == num_layers:
            out[f"lm_heads.{i}.weight"] = t
        else:
            out[f"blocks.{i}.layers.{j}.{rest[-1]}"] = t
    return out


def medusa_reference(tensors: dict[str, torch.Tensor], num_heads: int, num_layers: int, h: torch.Tensor):
    heads = []
    for i in range(num_heads):
        x = h
        for j in range(num_layers):
            x = x + F.silu(x @ tensors[f"{i}.{j}.linear.weight"].T + tensors[f"{i}.{j}.linear.bias"])
        heads.append(x @ tensors[f"{i}.{num_layers}.weight"].T)
    return torch.stack(heads, dim=1)


def test_medusa_public_layouts_load_and_match_reference(target, tmp_path):
    _, config, _ = target
    k, layers, vocab = 3, 2, config.vocab_size
    raw = medusa_tensors(k, layers, vocab)
    fd_config = {"medusa_num_heads": k, "medusa_num_layers": layers, "base_model_name_or_path": "tiny"}
    dirs = {
        "fasterdecoding": write_checkpoint(tmp_path / "fd", fd_config, raw),
        "prefixed": write_checkpoint(tmp_path / "prefixed", fd_config,
                                     {f"medusa_head.{n}": t for n, t in raw.items()}),
        "legacy_pt": write_checkpoint(tmp_path / "pt", fd_config, raw, fmt="medusa_lm_head.pt"),
        "vllm": write_checkpoint(tmp_path / "vllm", {
            "architectures": ["MedusaModel"], "model_type": "medusa", "num_heads": k, "num_hidden_layers": layers,
            "hidden_size": HIDDEN, "vocab_size": vocab, "medusa_fc_bias": True}, to_vllm_medusa(raw, layers)),
    }
    h = torch.randn(5, HIDDEN)
    expected = medusa_reference(raw, k, layers, h)
    results = {}
    for name, path in dirs.items():
        assert detect_head_method(path) == "medusa", name
        heads = MedusaHeads.from_pretrained(path, config, torch.float32, "cpu")
        results[name] = heads(h)
        assert results[name].dtype == torch.float32 and results[name].shape == (5, k, vocab)
        torch.testing.assert_close(results[name], expected, atol=1e-5, rtol=1e-5)
    for name in dirs:
        assert torch.equal(results[name], results["fasterdecoding"]), name


@pytest.mark.parametrize("case, match", [
    ("hidden_mismatch", "hidden_size is 32"), ("vocab_mismatch", "vocab_size is 7"),
    ("missing_tensor", "missing tensors: 1.0.linear.bias"), ("unexpected_tensor", "unexpected tensors: token_map"),
    ("misshaped", r"mis-shaped tensors: 0.1.weight \(10, 64\)"), ("no_weights", "has no weights"),
    ("no_config", "no config.json"), ("corrupt", "corrupt or truncated"), ("no_num_heads", "medusa_num_heads"),
])
def test_medusa_bad_checkpoints_raise_clear_errors(target, tmp_path, case, match):
    _, config, _ = target
    raw = medusa_tensors(2, 1, config.vocab_size)
    cfg = {"medusa_num_heads": 2, "medusa_num_layers": 1}
    path = tmp_path / case
    if case == "hidden_mismatch":
        cfg["hidden_size"] = 32
    elif case == "vocab_mismatch":
        cfg["vocab_size"] = 7
    elif case == "missing_tensor":
        del raw["1.0.linear.bias"]
    elif case == "unexpected_tensor":
        raw["token_map"] = torch.arange(10)
    elif case == "misshaped":
        raw["0.1.weight"] = torch.zeros(10, HIDDEN)
    elif case == "no_num_heads":
        del cfg["medusa_num_heads"]
    write_checkpoint(path, cfg, raw)
    if case == "no_weights":
        os.remove(path / "model.safetensors")
    elif case == "no_config":
        os.remove(path / "config.json")
    elif case == "corrupt":
        (path / "model.safetensors").write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00{not json")
    with pytest.raises(ValueError, match=match):
        MedusaHeads.from_pretrained(str(path), config, torch.float32, "cpu")


# ---- EAGLE: checkpoints and references ------------------------------------------------------------------
def draft_llama_config(**extra) -> LlamaConfig:
    config = LlamaConfig(hidden_size=HIDDEN, intermediate_size=INTER, num_hidden_layers=1, num_attention_heads=HEADS,
                         num_key_value_heads=KV_HEADS, vocab_size=259, rms_norm_eps=1e-6, rope_theta=10000.0,
                         max_position_embeddings=MAX_LEN, **extra)
    config._attn_implementation = "eager"
    return config


def config_json(config: LlamaConfig, architecture: str, **extra) -> dict:
    return dict(architectures=[architecture], model_type="llama", hidden_size=config.hidden_size,
                intermediate_size=config.intermediate_size, num_hidden_layers=config.num_hidden_layers,
                num_attention_heads=config.num_attention_heads, num_key_value_heads=config.num_key_value_heads,
                vocab_size=config.vocab_size, rms_norm_eps=config.rms_norm_eps, rope_theta=10000.0,
                max_position_embeddings=MAX_LEN, hidden_act="silu", **extra)


def randomize(module: nn.Module, seed: int) -> nn.Module:
    """Random weights large enough that every term shows in the output; norm weights around 1."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in module.named_parameters():
            noise = torch.randn(p.shape, generator=g)
            p.copy_(1 + 0.2 * noise if "norm" in name else 0.15 * noise)
    return module.eval()


def prefixed(module: nn.Module, prefix: str) -> dict[str, torch.Tensor]:
    return {prefix + name: t.detach().clone() for name, t in module.state_dict().items()}


def hf_attention_inputs(config: LlamaConfig, positions: torch.Tensor, x: torch.Tensor):
    """(cos, sin) and the additive causal mask of one sequence, as a full-sequence HF forward sees them."""
    cos_sin = hf.LlamaRotaryEmbedding(config)(x, positions[None])
    n = positions.shape[0]
    mask = torch.full((n, n), float("-inf")).triu(1)[None, None]
    return cos_sin, mask


class Eagle1Reference:
    """EAGLE-1 from its raw parts: fc over [embed; feature], then HF Llama layers, layer 0 without input norm."""

    def __init__(self, seed: int, fc_bias: bool = True) -> None:
        self.config = draft_llama_config()
        self.layer = randomize(hf.LlamaDecoderLayer(self.config, 0), seed)
        self.layer.input_layernorm = nn.Identity()
        self.fc = randomize(nn.Linear(2 * HIDDEN, HIDDEN, bias=fc_bias), seed + 1)

    def tensors(self) -> dict[str, torch.Tensor]:
        return {**prefixed(self.fc, "fc."), **prefixed(self.layer, "layers.0.")}

    def write(self, path, **extra_tensors) -> str:
        return write_checkpoint(path, config_json(self.config, "LlamaForCausalLM"), {**self.tensors(), **extra_tensors})

    @torch.no_grad()
    def __call__(self, embed: torch.Tensor, ids, features, positions) -> torch.Tensor:
        x = self.fc(torch.cat((F.embedding(ids, embed), features), dim=-1))[None]
        cos_sin, mask = hf_attention_inputs(self.config, positions, x)
        return self.layer(x, attention_mask=mask, position_embeddings=cos_sin)[0]


class Eagle3Reference:
    """EAGLE-3 from its raw parts: fc over three target states, one layer whose attention reads
    [input_layernorm(embed); hidden_norm(feature)] with the residual starting at the feature."""

    def __init__(self, seed: int, target_vocab: int) -> None:
        self.config = draft_llama_config()
        c = self.config
        attn = hf.LlamaAttention(c, 0)
        head_dim = HIDDEN // HEADS
        attn.q_proj = nn.Linear(2 * HIDDEN, HEADS * head_dim, bias=False)
        attn.k_proj = nn.Linear(2 * HIDDEN, KV_HEADS * head_dim, bias=False)
        attn.v_proj = nn.Linear(2 * HIDDEN, KV_HEADS * head_dim, bias=False)
        self.midlayer = nn.Module()
        self.midlayer.self_attn = attn
        self.midlayer.mlp = hf.LlamaMLP(c)
        for norm in ("input_layernorm", "hidden_norm", "post_attention_layernorm"):
            setattr(self.midlayer, norm, hf.LlamaRMSNorm(HIDDEN, c.rms_norm_eps))
        randomize(self.midlayer, seed)
        self.fc = randomize(nn.Linear(3 * HIDDEN, HIDDEN, bias=False), seed + 1)
        self.norm = randomize(hf.LlamaRMSNorm(HIDDEN, c.rms_norm_eps), seed + 2)
        self.lm_head = randomize(nn.Linear(HIDDEN, DRAFT_VOCAB, bias=False), seed + 3)
        self.embed = torch.randn(target_vocab, HIDDEN, generator=torch.Generator().manual_seed(seed + 4))
        g = torch.Generator().manual_seed(seed + 5)
        self.draft_ids_in_target = torch.randperm(target_vocab, generator=g)[:DRAFT_VOCAB].sort().values
        self.d2t = self.draft_ids_in_target - torch.arange(DRAFT_VOCAB)
        self.t2d = torch.zeros(target_vocab, dtype=torch.bool)
        self.t2d[self.draft_ids_in_target] = True

    def tensors(self) -> dict[str, torch.Tensor]:
        return {**prefixed(self.midlayer, "midlayer."), **prefixed(self.fc, "fc."), **prefixed(self.norm, "norm."),
                **prefixed(self.lm_head, "lm_head."), "embed_tokens.weight": self.embed, "d2t": self.d2t,
                "t2d": self.t2d}

    def write(self, path, drop: tuple[str, ...] = (), **config_extra) -> str:
        tensors = {n: t for n, t in self.tensors().items() if n not in drop}
        config = config_json(self.config, "LlamaForCausalLMEagle3", draft_vocab_size=DRAFT_VOCAB, **config_extra)
        return write_checkpoint(path, config, tensors)

    @torch.no_grad()
    def __call__(self, ids, features, positions) -> torch.Tensor:
        m = self.midlayer
        embeds = F.embedding(ids, self.embed)[None]
        residual = features[None]
        x = torch.cat((m.input_layernorm(embeds), m.hidden_norm(residual)), dim=-1)
        cos_sin, mask = hf_attention_inputs(self.config, positions, x)
        hidden = residual + m.self_attn(x, position_embeddings=cos_sin, attention_mask=mask)[0]
        return (hidden + m.mlp(m.post_attention_layernorm(hidden)))[0]


def run_paged(model: EagleDraftModel, ids: torch.Tensor, features: torch.Tensor, chunks: list[int]) -> torch.Tensor:
    """Run the draft over one sequence in `chunks` steps through a fresh paged cache (torch backend)."""
    backend = get_attention_backend("torch")
    for attn in model.attention_layers():
        shape = backend.kv_cache_shape(NUM_BLOCKS, BLOCK_SIZE, attn.num_kv_heads, attn.head_dim)
        attn.kv_cache, attn.backend = torch.zeros(shape), backend
    state = CachedRequestState("r", ids.tolist(), len(ids), SamplingParams(), block_ids=[5, 2], num_computed_tokens=0)
    outputs = []
    with torch.inference_mode():
        for n in chunks:
            step = prepare_step_inputs({"r": n}, {"r": state}, BLOCK_SIZE, torch.device("cpu"))
            start = state.num_computed_tokens
            assert torch.equal(step.input_ids, ids[start:start + n])
            outputs.append(model(step.input_ids, features[start:start + n], step.positions, step.metadata))
            state.num_computed_tokens += n
    return torch.cat(outputs)


def sequence(vocab: int, seed: int = 3) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return (torch.randint(0, vocab, (SEQ,), generator=g), torch.randn(SEQ, HIDDEN, generator=g),
            torch.arange(SEQ))


# ---- EAGLE-1 --------------------------------------------------------------------------------------------
def test_eagle1_matches_hf_reference_through_paged_cache(target, tmp_path):
    path, config, model = target
    ref = Eagle1Reference(seed=10)
    draft_dir = ref.write(tmp_path / "eagle")
    assert detect_head_method(draft_dir) == "eagle"
    draft = EagleDraftModel.from_pretrained(draft_dir, "eagle", model, config, MAX_LEN, torch.float32, "cpu")
    assert draft.method == "eagle" and draft.embed_tokens is None  # no embedding in the checkpoint: the target's
    assert len(draft.attention_layers()) == 1
    ids, features, positions = sequence(config.vocab_size)
    assert torch.equal(draft.combine_features(features), features)
    expected = ref(model.embed_tokens.weight, ids, features, positions)
    for chunks in ([SEQ], [SEQ - 1, 1]):
        out = run_paged(draft, ids, features, chunks)
        torch.testing.assert_close(out, expected, atol=ATOL, rtol=0, msg=f"chunks {chunks}")
    logits = draft.compute_logits(out)
    assert logits.dtype == torch.float32 and logits.shape == (SEQ, config.vocab_size)
    torch.testing.assert_close(logits, expected @ model.lm_head.weight.T, atol=ATOL, rtol=0)
    assert {name for name, _ in draft.named_parameters()}.isdisjoint({"embed_tokens.weight", "lm_head.weight"})


def test_eagle1_embedding_copy_of_the_target_is_shared_and_a_different_one_used(target, tmp_path):
    path, config, model = target
    ref = Eagle1Reference(seed=20, fc_bias=False)
    same = ref.write(tmp_path / "same", **{"embed_tokens.weight": model.embed_tokens.weight.clone()})
    draft = EagleDraftModel.from_pretrained(same, "eagle", model, config, MAX_LEN, torch.float32, "cpu")
    assert draft.embed_tokens is None and draft.fc.bias is None
    own = torch.randn(config.vocab_size, HIDDEN)
    other = ref.write(tmp_path / "own", **{"embed_tokens.weight": own})
    draft = EagleDraftModel.from_pretrained(other, "eagle", model, config, MAX_LEN, torch.float32, "cpu")
    ids, features, positions = sequence(config.vocab_size, seed=4)
    torch.testing.assert_close(run_paged(draft, ids, features, [SEQ]), ref(own, ids, features, positions),
                               atol=ATOL, rtol=0)


# ---- EAGLE-3 --------------------------------------------------------------------------------------------
def test_eagle3_matches_hf_reference_through_paged_cache(target, tmp_path):
    path, config, model = target
    ref = Eagle3Reference(seed=30, target_vocab=config.vocab_size)
    draft_dir = ref.write(tmp_path / "eagle3")
    assert detect_head_method(draft_dir) == "eagle3"
    draft = EagleDraftModel.from_pretrained(draft_dir, "eagle3", model, config, MAX_LEN, torch.float32, "cpu")
    assert draft.method == "eagle3" and len(draft.attention_layers()) == 1
    ids, _, positions = sequence(config.vocab_size)
    aux = torch.randn(SEQ, 3 * HIDDEN, generator=torch.Generator().manual_seed(5))
    features = draft.combine_features(aux)
    torch.testing.assert_close(features, ref.fc(aux).detach(), atol=1e-5, rtol=0)
    aux_before = aux.clone()
    expected = ref(ids, features, positions)
    for chunks in ([SEQ], [SEQ - 1, 1]):
        out = run_paged(draft, ids, features, chunks)
        torch.testing.assert_close(out, expected, atol=ATOL, rtol=0, msg=f"chunks {chunks}")
    assert torch.equal(aux, aux_before)

    logits = draft.compute_logits(out)
    assert logits.dtype == torch.float32 and logits.shape == (SEQ, config.vocab_size)
    with torch.no_grad():
        draft_logits = ref.lm_head(ref.norm(expected))
    in_draft = ref.draft_ids_in_target
    torch.testing.assert_close(logits[:, in_draft], draft_logits, atol=ATOL, rtol=0)
    outside = torch.ones(config.vocab_size, dtype=torch.bool)
    outside[in_draft] = False
    assert torch.isneginf(logits[:, outside]).all()
    assert torch.equal(logits.argmax(-1), in_draft[draft_logits.argmax(-1)])
    # the next chain step feeds the output feature back as is (already hidden wide), one decode in the same cache
    next_token = logits[-1:].argmax(-1)
    chain_state = CachedRequestState("r", [*ids.tolist(), int(next_token)], SEQ + 1, SamplingParams(), [5, 2], SEQ)
    step = prepare_step_inputs({"r": 1}, {"r": chain_state}, BLOCK_SIZE, torch.device("cpu"))
    with torch.inference_mode():
        chained = draft(step.input_ids, out[-1:], step.positions, step.metadata)
    longer = ref(torch.cat((ids, next_token)), torch.cat((features, out[-1:])), torch.arange(SEQ + 1))
    torch.testing.assert_close(chained, longer[-1:], atol=ATOL, rtol=0)


def test_eagle3_aux_layers_are_the_targets_layer_inputs(target, tmp_path):
    path, config, model = target
    ref = Eagle3Reference(seed=40, target_vocab=config.vocab_size)
    draft = EagleDraftModel.from_pretrained(ref.write(tmp_path / "default"), "eagle3", model, config, MAX_LEN,
                                            torch.float32, "cpu")
    ids = draft.aux_layer_ids(config)
    assert ids == (2, TARGET_LAYERS // 2, TARGET_LAYERS - 3)
    pinned = ref.write(tmp_path / "pinned", eagle_config={"eagle_aux_hidden_state_layer_ids": [1, 3, 6]})
    pinned_draft = EagleDraftModel.from_pretrained(pinned, "eagle3", model, config, MAX_LEN, torch.float32, "cpu")
    assert pinned_draft.aux_layer_ids(config) == (1, 3, 6)
    top_level = ref.write(tmp_path / "top", eagle_aux_hidden_state_layer_ids=[0, 2, 7])
    top_draft = EagleDraftModel.from_pretrained(top_level, "eagle3", model, config, MAX_LEN, torch.float32, "cpu")
    assert top_draft.aux_layer_ids(config) == (0, 2, 7)
    shallow = AutoConfig.from_pretrained(path)
    shallow.num_hidden_layers = 4  # the default (2, 2, 1) names one layer twice
    with pytest.raises(ValueError, match="three increasing layer ids"):
        draft.aux_layer_ids(shallow)

    # the engine sets the ids on the target; its aux states are HF's hidden_states[layer] (the layer's input)
    tokens = torch.randint(0, config.vocab_size, (SEQ,), generator=torch.Generator().manual_seed(6))
    aux = _aux_states(model, ids, tokens)
    _assert_hf_layer_inputs(path, tokens, ids, aux)
    assert draft.combine_features(torch.cat(aux, dim=-1)).shape == (SEQ, HIDDEN)


def _aux_states(model, ids: tuple[int, ...], tokens: torch.Tensor) -> list[torch.Tensor]:
    """The target's aux hidden states for layers `ids` after one prefill of `tokens`."""
    model.aux_hidden_state_layers = ids
    backend = get_attention_backend("torch")
    try:
        for attn in model.attention_layers():
            attn.kv_cache = torch.zeros(backend.kv_cache_shape(NUM_BLOCKS, BLOCK_SIZE, attn.num_kv_heads,
                                                               attn.head_dim))
            attn.backend = backend
        state = CachedRequestState("t", tokens.tolist(), SEQ, SamplingParams(), [1, 3], 0)
        step = prepare_step_inputs({"t": SEQ}, {"t": state}, BLOCK_SIZE, torch.device("cpu"))
        with torch.inference_mode():
            model(step.input_ids, step.positions, step.metadata)
        return model.aux_hidden_states
    finally:
        model.aux_hidden_state_layers = ()


def _assert_hf_layer_inputs(path: str, tokens: torch.Tensor, ids: tuple[int, ...], aux: list[torch.Tensor]) -> None:
    from transformers import LlamaForCausalLM as HFLlama

    with torch.no_grad():
        hf_states = HFLlama.from_pretrained(path, dtype=torch.float32).eval()(
            tokens[None], output_hidden_states=True).hidden_states
    assert len(aux) == len(ids)
    for layer, state_ in zip(ids, aux, strict=True):
        torch.testing.assert_close(state_, hf_states[layer][0], atol=ATOL, rtol=0, msg=f"layer {layer}")


def test_aux_state_of_layer_0_is_the_embedding_under_the_compiled_ops(target):
    """Layer 0's input is the embedding output, which layer 0 also takes as its residual; the
    compiled add_rms_norm updates the residual in place, so the aux state must be a copy."""
    path, config, _ = target
    model = load_model(path, config, torch.float32, MAX_LEN, "cpu")
    if not use_cpu_ops(model):
        pytest.skip("the compiled CPU layer ops do not build here")
    tokens = torch.randint(0, config.vocab_size, (SEQ,), generator=torch.Generator().manual_seed(7))
    ids = (0, 1, TARGET_LAYERS - 1)
    _assert_hf_layer_inputs(path, tokens, ids, _aux_states(model, ids, tokens))


# ---- EAGLE: bad checkpoints and layout detection ---------------------------------------------------------
@pytest.mark.parametrize("case, method, match", [
    ("eagle3_as_eagle", "eagle", "method is 'eagle' but the checkpoint holds the 'eagle3' layout"),
    ("eagle_as_eagle3", "eagle3", "method is 'eagle3' but the checkpoint holds the 'eagle' layout"),
    ("medusa_as_eagle", "eagle", "holds the 'medusa' layout"),
    ("hidden_mismatch", "eagle", "hidden_size is 32 but the target model's is 64"),
    ("missing", "eagle", "missing tensors: layers.0.mlp.down_proj.weight"),
    ("unexpected", "eagle", "unexpected tensors: layers.0.input_layernorm.weight"),
    ("misshaped", "eagle", r"mis-shaped tensors: fc.weight \(64, 64\) \(expected \(64, 128\)\)"),
    ("no_d2t", "eagle3", "missing tensors: d2t"),
    ("bad_d2t", "eagle3", "outside the target vocabulary"),
    ("no_lm_head", "eagle3", "missing tensors: lm_head.weight"),
])
def test_eagle_bad_checkpoints_raise_clear_errors(target, tmp_path, case, method, match):
    path, config, model = target
    eagle1, eagle3 = Eagle1Reference(seed=50), Eagle3Reference(seed=51, target_vocab=config.vocab_size)
    where = tmp_path / case
    if case == "eagle3_as_eagle":
        eagle3.write(where)
    elif case == "eagle_as_eagle3":
        eagle1.write(where)
    elif case == "medusa_as_eagle":
        write_checkpoint(where, {"medusa_num_heads": 1, "medusa_num_layers": 1}, medusa_tensors(1, 1, 259))
    elif case == "hidden_mismatch":
        small = draft_llama_config()
        small.hidden_size, small.head_dim = 32, 8
        write_checkpoint(where, config_json(small, "LlamaForCausalLM"), eagle1.tensors())
    elif case == "missing":
        tensors = eagle1.tensors()
        del tensors["layers.0.mlp.down_proj.weight"]
        write_checkpoint(where, config_json(eagle1.config, "LlamaForCausalLM"), tensors)
    elif case == "unexpected":
        eagle1.write(where, **{"layers.0.input_layernorm.weight": torch.ones(HIDDEN)})
    elif case == "misshaped":
        eagle1.write(where, **{"fc.weight": torch.zeros(HIDDEN, HIDDEN)})
    elif case == "no_d2t":
        eagle3.write(where, drop=("d2t",))
    elif case == "bad_d2t":
        eagle3.d2t = eagle3.d2t + config.vocab_size
        eagle3.write(where)
    elif case == "no_lm_head":
        eagle3.write(where, drop=("lm_head.weight",))
    with pytest.raises(ValueError, match=match):
        EagleDraftModel.from_pretrained(str(where), method, model, config, MAX_LEN, torch.float32, "cpu")


def test_detect_head_method_on_other_directories(target, tmp_path):
    path, _, _ = target
    assert detect_head_method(path) is None  # a plain Llama checkpoint is no head
    assert detect_head_method(str(tmp_path)) is None  # empty
    assert detect_head_method(str(tmp_path / "absent")) is None
