"""MLA attention over the latent paged cache against a naive float64 expansion of K and V per head,
on mixed paged batches (decodes of different lengths, prefills with and without a cached prefix, a
short multi-token row over a long context); absorbed and expanded paths against each other; the
latent cache's contents and size; copy_blocks; the softmax scale against HF's DeepSeek attention."""

from __future__ import annotations

import pytest
import torch
from paged_batches import make_paged_batch
from torch import nn

import kvtide.layers.mla as mla
from kvtide.attention.backend import AttentionMetadata
from kvtide.layers.mla import MLAAttention, mla_softmax_scale, yarn_mscale

H, NOPE, ROPE, V, L = 4, 16, 8, 12, 32
BLOCK = 16
MIXED = [(1, 37), (1, 16), (1, 0), (1, 100), (1, 15), (7, 0), (20, 0), (5, 11), (19, 16), (40, 33), (3, 90)]
"""(query_len, cached_len): five decodes (block edges among them), two uncached prompts, three chunks
after a cached prefix, and a speculative-verification-like row (3 queries over 90 cached tokens)."""
EDGES = [(1, 31), (1, 32), (16, 0), (17, 16), (2, 31), (16, 16)]
TOL = {torch.float32: dict(rtol=1e-5, atol=1e-6), torch.bfloat16: dict(rtol=3e-2, atol=3e-2)}


def make_setup(requests, dtype, seed=0):
    batch = make_paged_batch(requests, 1, 1, 1, BLOCK, dtype, seed=seed)  # metadata only
    md = batch.metadata
    num_blocks, num_tokens = batch.kv_cache.shape[1], md.num_actual_tokens
    gen = torch.Generator().manual_seed(seed + 1)

    def randn(*shape, std=1.0):
        return (torch.randn(*shape, generator=gen) * std).to(dtype)

    kv_b_proj = nn.Linear(L, H * (NOPE + V), bias=False, dtype=dtype)
    with torch.no_grad():
        kv_b_proj.weight.copy_(randn(H * (NOPE + V), L, std=L ** -0.5))
    scale = (NOPE + ROPE) ** -0.5
    layer = MLAAttention(H, NOPE, ROPE, V, L, scale, kv_b_proj)
    cache = randn(*layer.cache_shape(num_blocks, BLOCK))  # cached prefixes: random latents
    # Split from one tensor each, as a model does (non-contiguous views).
    q_nope, q_pe = randn(num_tokens, H, NOPE + ROPE).split((NOPE, ROPE), dim=-1)
    kv_c_normed, k_pe = randn(num_tokens, L + ROPE).split((L, ROPE), dim=-1)
    inputs = dict(q_nope=q_nope, q_pe=q_pe, kv_c_normed=kv_c_normed, k_pe=k_pe)
    return layer, cache, inputs, md


def run(layer, cache, inputs, md, path="auto"):
    layer.kv_cache = cache.clone()
    md.backend_data.clear()
    return layer(**inputs, metadata=md, path=path)


def naive_reference(layer, cache, inputs, md) -> torch.Tensor:
    """Each request's dense latent sequence (cached prefix from its blocks, then this step's tokens),
    expanded to K and V per head in float64, causal softmax attention -> (T, H * V)."""
    w = layer.kv_b_proj.weight.double()  # (H * (NOPE + V), L)
    qsl, out = md.query_start_loc_cpu, []
    for row in range(md.num_reqs):
        start, end, seq_len = qsl[row], qsl[row + 1], md.seq_lens_cpu[row]
        cached = seq_len - (end - start)
        table = md.block_tables[row].tolist()
        prefix = [cache[table[p // BLOCK], p % BLOCK] for p in range(cached)]
        new = torch.cat((inputs["kv_c_normed"][start:end], inputs["k_pe"][start:end]), dim=-1)
        seq = torch.stack(prefix + list(new)).double()  # (S, L + R)
        kv = (seq[:, :L] @ w.T).view(seq_len, H, NOPE + V)
        key = torch.cat((kv[..., :NOPE], seq[:, None, L:].expand(seq_len, H, ROPE)), dim=-1)
        value = kv[..., NOPE:]
        query = torch.cat((inputs["q_nope"][start:end], inputs["q_pe"][start:end]), dim=-1).double()
        scores = torch.einsum("qhd,shd->hqs", query, key) * layer.scale
        q_pos = torch.arange(cached, seq_len)[:, None]
        scores = scores.masked_fill(torch.arange(seq_len)[None, :] > q_pos, float("-inf"))
        out.append(torch.einsum("hqs,shv->qhv", scores.softmax(-1), value).reshape(end - start, H * V))
    return torch.cat(out)


@pytest.mark.parametrize("requests", [MIXED, EDGES], ids=["mixed", "edges"])
@pytest.mark.parametrize("path", ["auto", "absorbed", "expanded"])
def test_float32_equals_naive_expanded_reference(requests, path):
    layer, cache, inputs, md = make_setup(requests, torch.float32, seed=len(requests))
    actual = run(layer, cache, inputs, md, path)
    assert actual.shape == (md.num_actual_tokens, H * V)
    torch.testing.assert_close(actual.double(), naive_reference(layer, cache, inputs, md), **TOL[torch.float32])


def test_bfloat16_equals_naive_reference():
    layer, cache, inputs, md = make_setup(MIXED, torch.bfloat16, seed=5)
    actual = run(layer, cache, inputs, md)
    assert actual.dtype == torch.bfloat16
    torch.testing.assert_close(actual.double(), naive_reference(layer, cache, inputs, md), **TOL[torch.bfloat16])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_absorbed_equals_expanded(dtype):
    layer, cache, inputs, md = make_setup(MIXED, dtype, seed=11)
    absorbed = run(layer, cache, inputs, md, "absorbed")
    expanded = run(layer, cache, inputs, md, "expanded")
    tol = dict(rtol=1e-5, atol=1e-6) if dtype == torch.float32 else TOL[dtype]
    torch.testing.assert_close(absorbed, expanded, **tol)


def test_auto_routes_decodes_and_short_cached_rows_absorbed():
    layer, _, _, _ = make_setup(MIXED, torch.float32)
    assert layer.absorb_max_query_len == L * (NOPE + V) // (2 * L - NOPE - V)  # 24 for these dims
    assert layer._absorbs("auto", 3, 93)  # speculative verification over a long context
    assert not layer._absorbs("auto", 40, 73)  # a long chunk: expanded
    assert not layer._absorbs("auto", 20, 20)  # no cached prefix: expanded
    v3 = MLAAttention(128, 128, 64, 128, 512, 0.1, nn.Linear(512, 128 * 256, bias=False, device="meta"))
    assert v3.absorb_max_query_len == 170


def test_decode_rows_gathered_a_few_at_a_time_equal_all_at_once(monkeypatch):
    layer, cache, inputs, md = make_setup(MIXED, torch.float32, seed=7)
    whole = run(layer, cache, inputs, md)
    monkeypatch.setattr(mla, "GATHER_CHUNK_BYTES", 1)  # one decode row per chunk
    torch.testing.assert_close(run(layer, cache, inputs, md), whole, rtol=1e-6, atol=1e-7)


def test_decode_layout_is_built_once_per_step_and_shared():
    layer, cache, inputs, md = make_setup(MIXED, torch.float32)
    first = run(layer, cache, inputs, md)
    block_ids, bias = md.backend_data[("mla_decode_bias",)]
    assert block_ids.shape == (md.num_decodes, -(-101 // BLOCK)) and bias.shape[:2] == (md.num_decodes, 1)
    layer.kv_cache = cache.clone()
    again = layer(**inputs, metadata=md)  # a second layer of the same step reuses the layout
    assert md.backend_data[("mla_decode_bias",)][0] is block_ids
    assert torch.equal(first, again)


def test_cache_holds_latent_at_slot_mapping_and_nothing_else_changes():
    layer, cache, inputs, md = make_setup(MIXED, torch.float32, seed=3)
    run(layer, cache, inputs, md)
    flat, before = layer.kv_cache.view(-1, L + ROPE), cache.view(-1, L + ROPE)
    slots = md.slot_mapping
    assert torch.equal(flat[slots], torch.cat((inputs["kv_c_normed"], inputs["k_pe"]), dim=-1))
    untouched = torch.ones(flat.shape[0], dtype=torch.bool)
    untouched[slots] = False
    assert torch.equal(flat[untouched], before[untouched])


def test_bytes_per_token_and_deepseek_v3_latent_is_576_values_vs_40960_expanded():
    """DeepSeek-V3: 576 cached values per token per layer instead of 128 * (192 + 128) = 40960 (71x)."""
    layer, _, _, _ = make_setup(MIXED, torch.float32)
    assert layer.cache_shape(10, BLOCK) == (10, BLOCK, L + ROPE)
    assert layer.kv_bytes_per_token(torch.float32) == (L + ROPE) * 4
    assert layer.kv_bytes_per_token(torch.bfloat16) == (L + ROPE) * 2
    assert (layer.num_kv_heads, layer.head_dim, layer.sliding_window, layer.sink_tokens) == (1, L + ROPE, None, 0)
    assert layer.kv_cache is None and layer.backend is None and layer.calculate_kv_scales is False
    assert torch.equal(layer.kv_scale, torch.ones(2)) and "kv_scale" not in layer.state_dict()
    assert not list(layer.parameters())  # kv_b_proj stays the model's, not registered twice

    v3 = MLAAttention(128, 128, 64, 128, 512, 0.1, nn.Linear(512, 128 * 256, bias=False, device="meta"))
    assert v3.head_dim == 576 and v3.cache_shape(1, 64) == (1, 64, 576)
    assert v3.kv_bytes_per_token(torch.bfloat16) == 576 * 2
    assert v3.expanded_kv_bytes_per_token(torch.bfloat16) == 128 * (192 + 128) * 2 == 40960 * 2
    assert v3.expanded_kv_bytes_per_token(torch.bfloat16) // v3.kv_bytes_per_token(torch.bfloat16) == 71


def test_copy_blocks_copies_whole_blocks():
    cache = torch.randn(6, 4, L + ROPE)
    before = cache.clone()
    MLAAttention.copy_blocks(cache, torch.tensor([1, 4]), torch.tensor([3, 0]))
    assert torch.equal(cache[3], before[1]) and torch.equal(cache[0], before[4])
    untouched = [1, 2, 4, 5]
    assert torch.equal(cache[untouched], before[untouched])


def test_dropped_blocks_are_refused():
    layer, cache, inputs, md = make_setup(MIXED, torch.float32)
    md.has_dropped_blocks = True
    with pytest.raises(ValueError, match="dropped KV blocks"):
        run(layer, cache, inputs, md)


def test_yarn_mscale():
    assert yarn_mscale(1.0, 5.0) == 1.0 and yarn_mscale(0.5) == 1.0
    assert yarn_mscale(40.0, 0.707) == pytest.approx(0.1 * 0.707 * 3.6888794541139363 + 1.0)


YARN = {"rope_type": "yarn", "factor": 40.0, "mscale": 1.0, "original_max_position_embeddings": 256,
        "beta_fast": 32.0, "beta_slow": 1.0, "rope_theta": 10000.0}


@pytest.mark.parametrize("architecture", ["deepseek_v2", "deepseek_v3"])
@pytest.mark.parametrize("rope", [None, dict(YARN, mscale_all_dim=0.707), dict(YARN, mscale_all_dim=1.0), YARN,
                                  "legacy_rope_scaling"],
                         ids=["default", "yarn_mscale_all_dim_0.707", "yarn_mscale_all_dim_1", "yarn_without",
                              "legacy_rope_scaling"])
def test_softmax_scale_equals_hf_attention_scaling(architecture, rope):
    if architecture == "deepseek_v2":
        from transformers.models.deepseek_v2 import modeling_deepseek_v2 as hf
        from transformers.models.deepseek_v2.configuration_deepseek_v2 import DeepseekV2Config as Config
        attention_class = hf.DeepseekV2Attention
    else:
        from transformers.models.deepseek_v3 import modeling_deepseek_v3 as hf
        from transformers.models.deepseek_v3.configuration_deepseek_v3 import DeepseekV3Config as Config
        attention_class = hf.DeepseekV3Attention
    dims = dict(hidden_size=64, num_attention_heads=H, num_key_value_heads=H, q_lora_rank=None,
                kv_lora_rank=L, qk_nope_head_dim=NOPE, qk_rope_head_dim=ROPE, v_head_dim=V,
                max_position_embeddings=10240)
    if rope == "legacy_rope_scaling":  # the older config field, "type" instead of "rope_type"
        legacy = {"type": "yarn", "factor": 40.0, "mscale": 0.707, "mscale_all_dim": 0.707,
                  "original_max_position_embeddings": 256, "beta_fast": 32, "beta_slow": 1}
        config = Config(rope_scaling=legacy, **dims)
    else:
        config = Config(rope_parameters=rope, **dims) if rope is not None else Config(**dims)
    expected = attention_class(config, layer_idx=0).scaling
    assert mla_softmax_scale(config) == pytest.approx(expected, rel=1e-12)
    base = (NOPE + ROPE) ** -0.5
    if isinstance(rope, dict) and rope.get("mscale_all_dim"):
        assert expected != pytest.approx(base)  # the case where mscale matters
        assert mla_softmax_scale(config) == pytest.approx(base * yarn_mscale(40.0, rope["mscale_all_dim"]) ** 2)
    elif rope != "legacy_rope_scaling":
        assert expected == pytest.approx(base)


def one_request_metadata(q_len: int, cached: int, table: list[int]) -> AttentionMetadata:
    seq_len = cached + q_len
    slots = [table[p // BLOCK] * BLOCK + p % BLOCK for p in range(cached, seq_len)]
    return AttentionMetadata(
        num_reqs=1, num_decodes=int(q_len == 1), num_actual_tokens=q_len,
        query_start_loc=torch.tensor([0, q_len], dtype=torch.int32), seq_lens=torch.tensor([seq_len], dtype=torch.int32),
        block_tables=torch.tensor([table], dtype=torch.int32), slot_mapping=torch.tensor(slots, dtype=torch.int64),
        max_query_len=q_len, max_seq_len=seq_len, block_size=BLOCK, query_start_loc_cpu=[0, q_len],
        seq_lens_cpu=[seq_len])


def test_chunked_prefill_verify_and_decode_match_hf_deepseek_v3_attention():
    """HF's eager DeepseekV3Attention (q LoRA, YaRN with mscale_all_dim) over 37 tokens against the
    same projections fed to MLAAttention in three steps over one block table: a 33-token prefill,
    a 3-token row over its cached context, then a decode. Checks kv_b_proj's row order, the q/kv
    splits and the softmax scale against the reference implementation itself."""
    from transformers.models.deepseek_v3 import modeling_deepseek_v3 as hf
    from transformers.models.deepseek_v3.configuration_deepseek_v3 import DeepseekV3Config

    config = DeepseekV3Config(hidden_size=64, num_attention_heads=H, num_key_value_heads=H, q_lora_rank=24,
                              kv_lora_rank=L, qk_nope_head_dim=NOPE, qk_rope_head_dim=ROPE, v_head_dim=V,
                              rope_interleave=False, rope_parameters=dict(YARN, mscale_all_dim=0.707),
                              max_position_embeddings=10240)
    config._attn_implementation = "eager"
    torch.manual_seed(0)
    attn = hf.DeepseekV3Attention(config, layer_idx=0).eval()
    seq_len = 37
    x = torch.randn(1, seq_len, 64)
    cos, sin = hf.DeepseekV3RotaryEmbedding(config)(x, torch.arange(seq_len)[None])
    causal = torch.full((seq_len, seq_len), float("-inf")).triu(1)[None, None]
    with torch.no_grad():
        expected = attn(x, (cos, sin), causal)[0][0]  # (S, hidden)

        q = attn.q_b_proj(attn.q_a_layernorm(attn.q_a_proj(x[0]))).view(seq_len, H, NOPE + ROPE)
        q_nope, q_pe = q.split((NOPE, ROPE), dim=-1)
        kv_c, k_pe = attn.kv_a_proj_with_mqa(x[0]).split((L, ROPE), dim=-1)
        q_pe, k_pe = hf.apply_rotary_pos_emb(q_pe.transpose(0, 1)[None], k_pe[None, None], cos, sin)
        q_pe, k_pe, kv_c = q_pe[0].transpose(0, 1), k_pe[0, 0], attn.kv_a_layernorm(kv_c)

        layer = MLAAttention(H, NOPE, ROPE, V, L, mla_softmax_scale(config), attn.kv_b_proj)
        assert layer.scale == attn.scaling
        table = [5, 2, 7]
        outputs = []
        for path in ("auto", "absorbed", "expanded"):
            layer.kv_cache = torch.randn(layer.cache_shape(8, BLOCK))
            out = []
            for start, end in ((0, 33), (33, 36), (36, 37)):
                md = one_request_metadata(end - start, start, table)
                out.append(layer(q_nope[start:end], q_pe[start:end], kv_c[start:end], k_pe[start:end], md,
                                 path=path))
            outputs.append(attn.o_proj(torch.cat(out)))
    for actual in outputs:
        torch.testing.assert_close(actual, expected, rtol=1e-5, atol=1e-6)
