"""The fused Triton layers equal their torch versions: RMSNorm (+ residual), rotary in place,
SiLU-and-mul; and a whole model with them (and the Triton attention backend) equals the torch
model on a prefill step followed by a decode step."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

pytest.importorskip("triton")

from kvtide.attention.registry import get_attention_backend  # noqa: E402
from kvtide.layers.activation import SiluAndMul  # noqa: E402
from kvtide.layers.norm import RMSNorm  # noqa: E402
from kvtide.layers.rotary import RotaryEmbedding  # noqa: E402
from kvtide.layers.triton_ops import (  # noqa: E402
    TritonRMSNorm,
    TritonRotaryEmbedding,
    TritonSiluAndMul,
    rms_norm,
    rotary_embedding_,
    silu_and_mul,
    use_triton_ops,
)

pytestmark = pytest.mark.triton

DTYPES = [torch.float32, torch.bfloat16, torch.float16]


def _rand(*shape: int, dtype: torch.dtype, device, seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=gen).to(dtype=dtype, device=device)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("hidden", [96, 128])
def test_rms_norm(device, close, dtype, hidden):
    norm = RMSNorm(hidden, eps=1e-5).to(device=device, dtype=dtype)
    norm.weight.data = _rand(hidden, dtype=dtype, device=device, seed=1)
    x = _rand(7, hidden, dtype=dtype, device=device, seed=2)
    residual = _rand(7, hidden, dtype=dtype, device=device, seed=3)
    close(rms_norm(x, norm.weight, norm.eps), norm(x), dtype)
    ref_out, ref_summed = norm(x, residual.clone())
    out, summed = rms_norm(x, norm.weight, norm.eps, residual)
    assert summed is residual  # summed in place, as RMSNorm does
    close(out, ref_out, dtype)
    if dtype == torch.bfloat16:  # the interpreter truncates float32 -> bf16 (GPUs round to nearest)
        close(summed, ref_summed, dtype)
    else:
        assert torch.equal(summed, ref_summed)  # one rounding of the same float32 sum


def test_rms_norm_per_head_on_a_strided_view(device, close):
    """Qwen3's q_norm: (T, H, D) heads sliced out of the fused qkv output."""
    norm = RMSNorm(16).to(device)
    norm.weight.data = _rand(16, dtype=torch.float32, device=device, seed=4)
    qkv = _rand(5, 6 * 16, dtype=torch.float32, device=device, seed=5)
    q = qkv[:, :4 * 16].view(5, 4, 16)
    close(rms_norm(q, norm.weight, norm.eps), norm(q), torch.float32)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("head_dim", [32, 40])
def test_rotary_in_place_on_qkv_views(device, close, dtype, head_dim):
    config = SimpleNamespace(rope_theta=10000.0, max_position_embeddings=64)
    rope = RotaryEmbedding(config, head_dim, 64, dtype).to(device)
    num_tokens, heads, kv_heads = 6, 4, 2
    qkv = _rand(num_tokens, (heads + 2 * kv_heads) * head_dim, dtype=dtype, device=device, seed=6)
    original = qkv.clone()
    cos_sin = rope.cos_sin(torch.tensor([0, 1, 2, 17, 40, 63], device=device))

    def split(t: torch.Tensor):
        q, k, v = t.split([heads * head_dim, kv_heads * head_dim, kv_heads * head_dim], dim=-1)
        return (q.view(num_tokens, heads, head_dim), k.view(num_tokens, kv_heads, head_dim),
                v.view(num_tokens, kv_heads, head_dim))

    q, k, v = split(qkv)
    ref_q, ref_k = rope(cos_sin, *split(original)[:2])
    out_q, out_k = rotary_embedding_(cos_sin, q, k)
    assert out_q.data_ptr() == q.data_ptr() and out_k.data_ptr() == k.data_ptr()
    close(q, ref_q, dtype)
    close(k, ref_k, dtype)
    assert torch.equal(v, split(original)[2])  # v untouched


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("d", [40, 1100])
def test_silu_and_mul(device, close, dtype, d):
    x = _rand(2, 3, 2 * d, dtype=dtype, device=device, seed=7)
    out = silu_and_mul(x)
    assert out.shape == (2, 3, d)
    close(out, SiluAndMul()(x), dtype)


def test_empty_inputs(device):
    norm_weight = torch.ones(8, device=device)
    assert rms_norm(torch.empty(0, 8, device=device), norm_weight, 1e-6).shape == (0, 8)
    assert silu_and_mul(torch.empty(0, 8, device=device)).shape == (0, 4)


def test_use_triton_ops_swaps_exact_types_and_checks_names():
    model = torch.nn.Sequential(RMSNorm(8), SiluAndMul(), RMSNorm(8))
    assert use_triton_ops(model, ops=("rms_norm",)) == 2
    assert [type(m) for m in model] == [TritonRMSNorm, SiluAndMul, TritonRMSNorm]
    assert use_triton_ops(model) == 1  # already swapped norms stay; the activation swaps
    assert type(model[1]) is TritonSiluAndMul
    with pytest.raises(ValueError, match="unknown Triton ops"):
        use_triton_ops(model, ops=("layer_norm",))


@pytest.mark.parametrize("architecture", ["LlamaForCausalLM", "Qwen3ForCausalLM"])
def test_model_with_triton_ops_and_backend_equals_torch(checkpoint_factory, device, close, architecture):
    from transformers import AutoConfig

    from kvtide.attention.backend import AttentionMetadata
    from kvtide.models.loader import load_model

    model_dir = checkpoint_factory(architecture)
    hf_config = AutoConfig.from_pretrained(model_dir)
    block_size, num_blocks = 8, 12

    def run(triton: bool) -> list[torch.Tensor]:
        model = load_model(model_dir, hf_config, torch.float32, 128, str(device))
        backend = get_attention_backend("triton" if triton else "torch")
        if triton:
            assert use_triton_ops(model) > 0
            assert type(model.layers[0].self_attn.rotary_emb) is TritonRotaryEmbedding
        for attn in model.attention_layers():
            shape = backend.kv_cache_shape(num_blocks, block_size, attn.num_kv_heads, attn.head_dim)
            attn.kv_cache = torch.zeros(shape, device=device)
            attn.backend = backend
        tables = [[3, 7, 1], [5, 0, 2]]
        outs = []
        with torch.inference_mode():
            # step 1: prefills of 11 and 6 tokens; step 2: one decode each
            for lens, starts in (([11, 6], [0, 0]), ([1, 1], [11, 6])):
                ids, pos, slots = [], [], []
                for r, (n, s) in enumerate(zip(lens, starts, strict=True)):
                    ids += [(7 * r + 3 * p + 1) % 200 for p in range(s, s + n)]
                    pos += list(range(s, s + n))
                    slots += [tables[r][p // block_size] * block_size + p % block_size for p in range(s, s + n)]
                qsl = [0, lens[0], lens[0] + lens[1]]
                seq_lens = [s + n for n, s in zip(lens, starts, strict=True)]
                md = AttentionMetadata(
                    num_reqs=2, num_decodes=2 if lens == [1, 1] else 0, num_actual_tokens=sum(lens),
                    query_start_loc=torch.tensor(qsl, dtype=torch.int32, device=device),
                    seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=device),
                    block_tables=torch.tensor(tables, dtype=torch.int32, device=device),
                    slot_mapping=torch.tensor(slots, device=device), max_query_len=max(lens),
                    max_seq_len=max(seq_lens), block_size=block_size, query_start_loc_cpu=qsl,
                    seq_lens_cpu=seq_lens)
                outs.append(model(torch.tensor(ids, device=device), torch.tensor(pos, device=device), md))
        return outs

    for actual, expected in zip(run(triton=True), run(triton=False), strict=True):
        close(actual, expected, torch.float32)
