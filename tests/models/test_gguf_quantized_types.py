"""GGUF's Q5_0, Q5_1, Q2_K, Q3_K, IQ4_NL and IQ4_XS kept quantized: files written in the test (Q5_0
and Q5_1 by the `gguf` package's quantizers, the others by tests/gguf_reference_quants.py, whose
packing is checked against gguf's dequantization) load with each linear and the token table held in
the layout the type is documented to keep (a fused layer mixing them with a wider type, as llama.cpp's
mixes do, in the layout its shards are promoted to); the compiled kernels of every ISA build this CPU runs
reproduce the float64 product with gguf's dequantized weights; the fused decode layers run on them;
greedy tokens and logprobs equal transformers' on the same file."""

from __future__ import annotations

import functools
import os

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType, GGUFReader
from gguf.quants import dequantize
from gguf_reference_quants import REFERENCE_QUANTIZERS
from gguf_writer import build_bpe_checkpoint, write_gguf

from kvtide import LLM, SamplingParams
from kvtide.attention.cpu_extension import available_isas, load_cpu_op
from kvtide.layers import fused_decode
from kvtide.layers.quantization import cpu_kernels

CODES = {"int8": (torch.int8, 1), "int4": (torch.uint8, 2), "iq4": (torch.uint8, 2)}
"""Kind -> the codes' dtype and weights per byte (int8 one, int4 and iq4 two nibbles)."""
HELD = {  # GGUF type: (kind, group size, has mins) as layers/quantization/gguf.py documents it
    "Q5_0": ("int8", 32, False),   # codes q - 16
    "Q5_1": ("int8", 32, True),    # codes q, min m
    "IQ4_NL": ("iq4", 32, False),  # codes: the nibbles, indices into the 16-level grid
    "IQ4_XS": ("iq4", 32, False),
    "Q2_K": ("int4", 16, True),    # 16-weight sub-blocks
    "Q3_K": ("int4", 16, True),    # codes q + 4, min -4 s
}
LOGPROB_TOL = dict.fromkeys(HELD, 1e-4)
"""Per type: every type decodes into codes and float32 scales that reproduce gguf's dequantized
weights exactly (or within one float32 rounding where a min is added), so kvtide and transformers
compute with the same weights and differ only in float32 summation order, as on a float checkpoint."""
KERNEL_ROUNDINGS = dict.fromkeys(HELD, 4)
"""Per type: the kernel output may differ from the float64 product by (K + this) float32 roundoffs
times sum_k |x_k w_k|: K for the float32 accumulation, the rest for the group scale's multiply;
plus WEIGHT_ROUNDINGS roundoffs of the row's largest weight times sum_k |x_k| for forming each
weight s * q + m (where s * q and m nearly cancel, that rounding is relative to them, not to w).
Exact decoding leaves no format-specific term."""
WEIGHT_ROUNDINGS = 8
U = 2.0 ** -24

SMALL = dict(intermediate_size=384)
"""Rows of 32-weight blocks (Q5_0, Q5_1, IQ4_NL)."""
WIDE = dict(hidden_size=256, intermediate_size=512, num_attention_heads=4, num_key_value_heads=2)
"""Rows of 256-weight super-blocks (Q2_K, Q3_K, IQ4_XS)."""
FILES = {  # name: (config, {GGUF name substring: type, first match wins}, each module's type, or its
    #        shards' types and the layout they are promoted to together)
    "block32": (SMALL, {"attn": "Q5_0", "ffn_down": "IQ4_NL", "ffn": "Q5_1", "token_embd": "IQ4_NL",
                        "default": "Q5_1"},
                {"qkv": "Q5_0", "o": "Q5_0", "gate_up": "Q5_1", "down": "IQ4_NL", "embed": "IQ4_NL",
                 "lm_head": "Q5_1"}),
    "super256": (WIDE, {"attn_output": "IQ4_XS", "ffn_down": "Q3_K", "attn": "Q3_K", "ffn": "Q2_K",
                        "token_embd": "Q2_K", "default": "IQ4_XS"},
                 {"qkv": "Q3_K", "o": "IQ4_XS", "gate_up": "Q2_K", "down": "Q3_K", "embed": "Q2_K",
                  "lm_head": "IQ4_XS"}),
    # As llama.cpp's mixes do: a wider type beside the narrow one in a fused layer, both promoted.
    "mixed": (WIDE, {"attn_v": "Q6_K", "attn": "Q3_K", "ffn_gate": "IQ4_XS", "ffn_up": "Q2_K", "ffn_down": "IQ4_XS",
                     "token_embd": "Q3_K", "default": "Q2_K"},
              {"qkv": (("Q3_K", "Q3_K", "Q6_K"), ("int8", 16, True)), "o": "Q3_K",
               "gate_up": (("IQ4_XS", "Q2_K"), ("int8", 16, True)), "down": "IQ4_XS", "embed": "Q3_K",
               "lm_head": "Q2_K"}),
}
KERNEL_TENSORS = {  # type: (file, a tensor of that type stored unpermuted, the module holding it)
    "Q5_0": ("block32", "blk.1.attn_output.weight", "layers.1.self_attn.o_proj"),
    "Q5_1": ("block32", "output.weight", "lm_head"),
    "IQ4_NL": ("block32", "blk.0.ffn_down.weight", "layers.0.mlp.down_proj"),
    "Q3_K": ("super256", "blk.1.ffn_down.weight", "layers.1.mlp.down_proj"),
    "Q2_K": ("super256", "token_embd.weight", "embed_tokens"),
    "IQ4_XS": ("super256", "blk.0.attn_output.weight", "layers.0.self_attn.o_proj"),
}
PROMPTS = ["The quick brown fox", "def add(a, b):", "机器学习 🙂 café", "Hello"]
MAX_TOKENS = 12
ISAS = available_isas()


@pytest.fixture(scope="module")
def isa_ops() -> dict[str, tuple]:
    """quantized_linear and dequantize_rows of every ISA build this CPU runs, loaded from the usual
    cache (built there once) before the tests point $KVTIDE_CACHE elsewhere."""
    ops = {}
    for isa in ISAS:
        linear = load_cpu_op(cpu_kernels.SOURCE, "kvtide_quant", "quantized_linear", "gguf types test", isa)
        rows = load_cpu_op(cpu_kernels.SOURCE, "kvtide_quant", "dequantize_rows", "gguf types test", isa)
        if linear is None or rows is None:
            pytest.fail(f"the {isa} build of quantized_linear.cpp failed (see the warning logged)")
        ops[isa] = linear, rows
    return ops


@pytest.fixture(autouse=True)
def _own_cache(tmp_path_factory, monkeypatch, compiled_cpu_ops, isa_ops):
    monkeypatch.setenv("KVTIDE_CACHE", str(tmp_path_factory.getbasetemp() / "kvtide-cache"))


@pytest.fixture(scope="module")
def files(tmp_path_factory) -> dict[str, str]:
    out = {}
    for name, (config, types, _) in FILES.items():
        ckpt = build_bpe_checkpoint(str(tmp_path_factory.mktemp(f"bpe-{name}")), **config)
        out[name] = write_gguf(ckpt, str(tmp_path_factory.mktemp(f"gguf-{name}") / "model.gguf"), types)
    return out


@pytest.fixture(scope="module")
def engines(files):
    cache: dict[str, LLM] = {}

    def get(name: str) -> LLM:
        if name not in cache:
            cache[name] = LLM(model=files[name], device="cpu", dtype="float32", max_model_len=256,
                              kv_cache_memory="8MiB")
        return cache[name]

    return get


def model_of(llm: LLM):
    return llm.engine.core.executor.runner.model


def stored(path: str, gguf_name: str) -> tuple[str, np.ndarray]:
    """(type, raw bytes (rows, bytes per row)) of one tensor as the file holds it."""
    tensor = next(t for t in GGUFReader(path).tensors if t.name == gguf_name)
    return tensor.tensor_type.name, np.asarray(tensor.data)


# ---- the hand-written quantizers write what gguf reads -------------------------------------------
@pytest.mark.parametrize("name", sorted(REFERENCE_QUANTIZERS))
def test_reference_quantizer_packs_what_gguf_dequantizes(name):
    weight = np.random.default_rng(0).standard_normal((4, 512)).astype(np.float32) * 0.2
    weight[0, :64] = 0  # an all-zero block
    blocks, values = REFERENCE_QUANTIZERS[name](weight)
    np.testing.assert_array_equal(dequantize(blocks, GGMLQuantizationType[name]), values)
    rel_rms = np.sqrt(np.mean((values - weight) ** 2)) / np.sqrt(np.mean(weight ** 2))
    assert 0 < rel_rms < (0.5 if name == "Q2_K" else 0.25), rel_rms  # a real quantizer, not a copy


# ---- held in the documented layout, on the fused decode layers, greedy equal to transformers -----
@pytest.mark.parametrize("name", list(FILES))
def test_loads_held_quantized_runs_fused_and_equals_transformers(files, engines, monkeypatch, name):
    _, _, roles = FILES[name]
    runs: list[fused_decode.FusedDecodeLayers] = []
    run = fused_decode.FusedDecodeLayers.run

    def counted(self, *args):
        runs.append(self)
        return run(self, *args)

    monkeypatch.setattr(fused_decode.FusedDecodeLayers, "run", counted)
    llm = engines(name)
    model = model_of(llm)
    modules = {"embed": [(model.embed_tokens, 1)], "lm_head": [(model.lm_head, 1)],
               "qkv": [(layer.self_attn.qkv_proj, 3) for layer in model.layers],
               "o": [(layer.self_attn.o_proj, 1) for layer in model.layers],
               "gate_up": [(layer.mlp.gate_up_proj, 2) for layer in model.layers],
               "down": [(layer.mlp.down_proj, 1) for layer in model.layers]}
    for role, held in modules.items():
        spec = roles[role]
        shard_types, layout = spec if isinstance(spec, tuple) else (None, HELD[spec])
        kind, group, has_mins = layout
        for module, shards in held:
            qw = module.quantized
            assert module.gguf_types == (shard_types or (spec,) * shards), role
            assert "weight" not in module._parameters, role  # no float copy beside the codes
            dtype, per_byte = CODES[kind]
            assert qw.kind == kind and qw.codes.dtype == dtype, role
            assert qw.codes.shape == (qw.out_features, qw.in_features // per_byte), role
            assert (qw.group_size, qw.mins is not None) == (group, has_mins), role
            assert qw.scales.shape == (qw.out_features, qw.in_features // group)
    # The table stays quantized: a lookup dequantizes just the rows asked for, gguf's values.
    _, raw = stored(files[name], "token_embd.weight")
    table = torch.from_numpy(dequantize(raw, GGMLQuantizationType[roles["embed"]]))
    ids = torch.tensor([3, 0, 77, 3])
    torch.testing.assert_close(model.embed_tokens(ids), table[ids], rtol=0, atol=1e-6 * table.abs().max().item())

    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True, logprobs=0)
    outputs = llm.generate(PROMPTS, params)
    assert model.fused_decode is not None and runs and set(runs) == {model.fused_decode}
    tol = min(LOGPROB_TOL.get(t, 1e-4) for spec in roles.values()
              for t in (spec[0] if isinstance(spec, tuple) else (spec,)))
    for prompt, out in zip(PROMPTS, outputs, strict=True):
        ref_tokens, ref_logprobs = hf_greedy(files[name], tuple(out.prompt_token_ids))
        got = out.outputs[0].token_ids
        assert got == ref_tokens, f"{prompt!r}: kvtide {got} != transformers {ref_tokens}"
        for step, (token, lp) in enumerate(zip(got, out.outputs[0].logprobs, strict=True)):
            assert abs(lp[token].logprob - ref_logprobs[step, token].item()) < tol, (prompt, step)


@functools.cache
def hf_model(path: str):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(os.path.dirname(path), gguf_file=os.path.basename(path),
                                                 dtype=torch.float32).eval()
    model.generation_config.eos_token_id = None
    return model


def hf_greedy(path: str, prompt_ids: tuple[int, ...]) -> tuple[list[int], torch.Tensor]:
    ids = torch.tensor([prompt_ids])
    with torch.inference_mode():
        out = hf_model(path).generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=MAX_TOKENS,
                                      do_sample=False, output_logits=True, return_dict_in_generate=True,
                                      pad_token_id=2)
    return out.sequences[0, len(prompt_ids):].tolist(), torch.cat(out.logits).float().log_softmax(-1)


# ---- the compiled kernels against float64 --------------------------------------------------------
@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("gguf_type", list(KERNEL_TENSORS))
def test_kernels_equal_the_float64_product_with_ggufs_weights(files, engines, isa_ops, gguf_type, isa):
    """The decode kernel (x rows 1..5: one and several 4-row passes) and the prefill path's
    dequantized rows, on the weight as the layer holds it, against float64 with gguf's own
    dequantization of the file's bytes."""
    name, gguf_name, module_name = KERNEL_TENSORS[gguf_type]
    stored_type, raw = stored(files[name], gguf_name)
    assert stored_type == gguf_type
    weight = torch.from_numpy(dequantize(raw, GGMLQuantizationType[gguf_type])).double()  # (N, K)
    qw = model_of(engines(name)).get_submodule(module_name).quantized
    assert (qw.out_features, qw.in_features) == tuple(weight.shape)
    linear, rows = isa_ops[isa]
    n, k = weight.shape
    row_peak = weight.abs().amax(1, keepdim=True)  # (N, 1)
    generator = torch.Generator().manual_seed(1)
    for m in (1, 5):
        x = torch.randn(m, k, generator=generator)
        out = torch.empty(m, n)
        linear(out, x, qw.codes, qw.scales, qw.mins, cpu_kernels.kind_code(qw), qw.group_size)
        expected = x.double() @ weight.t()
        bound = (k + KERNEL_ROUNDINGS[gguf_type]) * U * (x.double().abs() @ weight.abs().t()) \
            + WEIGHT_ROUNDINGS * U * x.double().abs().sum(1, keepdim=True) * row_peak.t()
        assert ((out.double() - expected).abs() <= bound).all(), (gguf_type, isa, m)
    dequantized = torch.empty(n, k)
    rows(dequantized, qw.codes, qw.scales, qw.mins, cpu_kernels.kind_code(qw), qw.group_size)
    # s * q (+ m) in float32 here and in gguf: a few roundings of terms the size of the row's weights.
    assert ((dequantized.double() - weight).abs() <= WEIGHT_ROUNDINGS * U * row_peak).all(), (gguf_type, isa)
