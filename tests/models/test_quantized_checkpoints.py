"""Quantized checkpoints in GPTQ, AWQ, compressed-tensors and FP8 formats, served in their format.

Each checkpoint is written here from a tiny seeded HF Llama: its linear weights are quantized by
round-to-nearest and packed by this file's own writers, following each format's documentation
(the format is what is under test, not how GPTQ or AWQ choose their numbers). Beside it goes the
"dequantized" float checkpoint whose weights are exactly the values the format stands for. kvtide
must then decode the same greedy tokens from both, with the same logprobs up to summation order
(weight-only formats), hold the weights in a fraction of the float bytes, and refuse malformed or
unsupported checkpoints with a message that says what is wrong.
"""

from __future__ import annotations

import functools
import json
import os
import shutil
import zlib

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file

from kvtide import LLM, SamplingParams
from kvtide.layers.quantization import weight_bytes

MODEL = dict(seed=3, hidden_size=128, intermediate_size=256, num_hidden_layers=2)
"""Hidden 128, 4 heads of 32 (2 kv heads), MLP 256: every K is a multiple of 32 (int4 blocks)."""
PROMPTS = ["Hello", "The quick brown fox", "def add(a, b):", "机器学习 🙂"]
MAX_TOKENS = 12
GREEDY = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True, logprobs=0)
LOGPROB_TOL = 1e-4
"""Weight-only formats: the quantized and the dequantized float model hold the same weights; only
the order of float32 sums differs (and s*q - s*z against s*(q - z): one rounding)."""
W8A8_LOGPROB_TOL = 0.4
"""W8A8 rounds every linear's input rows to int8 (per-token scale max|x| / 127), which the
dequantized float model does not. On this random checkpoint the logits spread with a std of ~2.3
and the MLP's input (silu(gate) * up) is heavy-tailed, so its typical elements keep only a few
bits: 14 such matmuls move the chosen tokens' logprobs by up to ~0.35 (measured; kvtide's
on-the-fly w8a8 of the same weights moves them alike). Greedy tokens must then agree except at a
near-tie of the reference, where the two tokens' logprobs are within this tolerance."""
AWQ_ORDER = [0, 2, 4, 6, 1, 3, 5, 7]
FP8_MAX = 448.0


# ---- writing checkpoints ---------------------------------------------------------------------------
def pack_int32(values: torch.Tensor, bits: int, dim: int) -> torch.Tensor:
    """Non-negative codes -> int32 words of 32 // bits codes along `dim`, the first in the lowest bits
    (zero-padded at the end of `dim`)."""
    pack = 32 // bits
    v = values.to(torch.int64).movedim(dim, -1)
    v = F.pad(v, (0, (-v.shape[-1]) % pack)).reshape(*v.shape[:-1], -1, pack)
    words = sum(v[..., j] << (bits * j) for j in range(pack))
    words = torch.where(words >= 2 ** 31, words - 2 ** 32, words)  # two's complement int32
    return words.to(torch.int32).movedim(-1, dim)


def write_checkpoints(base_dir: str, root: str, quant_config: dict, encode) -> tuple[str, str]:
    """(quantized dir, dequantized float dir). encode(module, weight) -> (the module's tensors in the
    format, the weight they stand for) or None to keep the module float."""
    quant_dir, float_dir = os.path.join(root, "quantized"), os.path.join(root, "dequantized")
    quantized, dense = {}, {}
    for name, tensor in load_file(os.path.join(base_dir, "model.safetensors")).items():
        module = name.removesuffix(".weight")
        encoded = encode(module, tensor) if tensor.dim() == 2 and "embed_tokens" not in name else None
        if encoded is None:
            quantized[name] = dense[name] = tensor
            continue
        tensors, dequantized = encoded
        quantized.update({f"{module}.{key}": t.contiguous() for key, t in tensors.items()})
        dense[name] = dequantized.float().contiguous()
    for directory, tensors in ((quant_dir, quantized), (float_dir, dense)):
        shutil.copytree(base_dir, directory, ignore=shutil.ignore_patterns("*.safetensors"))
        save_file(tensors, os.path.join(directory, "model.safetensors"))
    edit_config(quant_dir, quantization_config=quant_config)
    return quant_dir, float_dir


def edit_config(model_dir: str, **changes) -> None:
    path = os.path.join(model_dir, "config.json")
    with open(path) as f:
        config = json.load(f)
    config.update(changes)
    with open(path, "w") as f:
        json.dump(config, f, indent=1)


def edit_quantization_config(model_dir: str, **changes) -> None:
    path = os.path.join(model_dir, "config.json")
    with open(path) as f:
        config = json.load(f)
    config["quantization_config"].update(changes)
    with open(path, "w") as f:
        json.dump(config, f, indent=1)


def edit_tensors(model_dir: str, **replace: torch.Tensor) -> None:
    path = os.path.join(model_dir, "model.safetensors")
    tensors = load_file(path)
    tensors.update(replace)
    save_file(tensors, path)


def input_group(module: str) -> str:
    """Modules that read the same input (q/k/v, gate/up): GPTQ gives them one act-order permutation."""
    layer = module.split(".")[2] if module.startswith("model.layers.") else module
    leaf = module.rsplit(".", 1)[-1]
    kind = {"q_proj": "qkv", "k_proj": "qkv", "v_proj": "qkv", "gate_proj": "gate_up", "up_proj": "gate_up"}
    if ".experts." in module:  # one expert's w1 and w3 (gate and up) read the same rows
        expert = module.rsplit(".", 1)[0]
        return f"{expert}.{'w2' if leaf in ('w2', 'down_proj') else 'w13'}"
    return f"{layer}.{kind.get(leaf, leaf)}"


# ---- the formats' encoders (round to nearest) ---------------------------------------------------------
def gptq_encoder(bits: int, group_size: int, sym: bool, v1: bool, act_order: bool = False,
                 write_g_idx: bool = True, zero_bias: bool = False):
    """GPTQ: qweight (K / pack, N) packs input rows, qzeros (G, N / pack) packs output columns (v1
    stores z - 1), scales fp16 (G, N), g_idx (K,); w = s * (q - z) with g = g_idx[k]."""
    maxq = 2 ** bits - 1

    def encode(module: str, w: torch.Tensor):
        if module == "lm_head":
            return None
        n, k = w.shape
        group = k if group_size == -1 else group_size
        g_idx = act_order_groups(module, k, group) if act_order else torch.arange(k) // group
        wt = w.t()  # (K, N)
        scales = torch.empty(k // group, n)
        zeros = torch.empty(k // group, n)
        for g in range(k // group):
            cols = wt[g_idx == g]
            if sym:
                scales[g] = (2 * cols.abs().amax(0) / maxq).clamp_min(1e-6)
                zeros[g] = (maxq + 1) // 2
            else:
                lo, hi = cols.amin(0).clamp(max=0), cols.amax(0).clamp(min=0)
                scales[g] = ((hi - lo) / maxq).clamp_min(1e-6)
                # v1 cannot store z = 0 (it would be -1): the quirk AutoGPTQ checkpoints live with
                zeros[g] = torch.round(-lo / scales[g]).clamp(1 if v1 else 0, maxq)
        scales = scales.half()
        s, z = scales.float()[g_idx], zeros[g_idx]  # (K, N)
        q = torch.clamp(torch.round(wt / s) + z, 0, maxq)
        tensors = {"qweight": pack_int32(q, bits, dim=0), "qzeros": pack_int32(zeros - (1 if v1 else 0), bits, dim=1),
                   "scales": scales}
        if write_g_idx:
            tensors["g_idx"] = g_idx.to(torch.int32)
        if zero_bias:
            tensors["bias"] = torch.zeros(n, dtype=torch.float16)
        return tensors, (s * (q - z)).t()

    return encode


def awq_encoder(group_size: int):
    """AWQ GEMM: qweight (K, N / 8) and qzeros (G, N / 8) pack 8 output columns per int32 in the order
    [0, 2, 4, 6, 1, 3, 5, 7], scales fp16 (G, N); w = s * (q - z)."""

    def encode(module: str, w: torch.Tensor):
        if module == "lm_head":
            return None
        n, k = w.shape
        wg = w.t().reshape(k // group_size, group_size, n)
        lo, hi = wg.amin(1).clamp(max=0), wg.amax(1).clamp(min=0)
        scales = ((hi - lo) / 15).clamp_min(1e-6).half()
        s = scales.float()
        zeros = torch.round(-lo / s).clamp(0, 15)
        q = torch.clamp(torch.round(wg / s[:, None]) + zeros[:, None], 0, 15)
        deq = (s[:, None] * (q - zeros[:, None])).reshape(k, n).t()

        def interleave(codes: torch.Tensor) -> torch.Tensor:  # (R, N): nibble i <- column AWQ_ORDER[i]
            rows = codes.shape[0]
            return pack_int32(codes.reshape(rows, n // 8, 8)[:, :, AWQ_ORDER].reshape(rows, n), 4, dim=1)

        return {"qweight": interleave(q.reshape(k, n)), "qzeros": interleave(zeros), "scales": scales}, deq

    return encode


def ct_pack_encoder(bits: int, group_size: int | None, sym: bool, quantize_lm_head: bool):
    """compressed-tensors pack-quantized: weight_packed (N, K / pack) packs input columns, values
    stored as q + 2^(bits-1); weight_scale (N, G) bf16; asymmetric: weight_zero_point packed along
    the output dim; weight_shape [N, K]; w = s * (q - zp)."""
    qmin, qmax = -2 ** (bits - 1), 2 ** (bits - 1) - 1

    def encode(module: str, w: torch.Tensor):
        if module == "lm_head" and not quantize_lm_head:
            return None
        n, k = w.shape
        group = group_size or k
        wg = w.reshape(n, k // group, group)
        if sym:
            scales = (wg.abs().amax(-1) / ((qmax - qmin) / 2)).clamp_min(1e-6).bfloat16()
            zp = torch.zeros(n, k // group)
        else:
            lo, hi = wg.amin(-1).clamp(max=0), wg.amax(-1).clamp(min=0)
            scales = ((hi - lo) / (qmax - qmin)).clamp_min(1e-6).bfloat16()
            zp = torch.round(qmin - lo / scales.float()).clamp(qmin, qmax)
        s = scales.float()
        q = torch.clamp(torch.round(wg / s[..., None]) + zp[..., None], qmin, qmax)
        deq = (s[..., None] * (q - zp[..., None])).reshape(n, k)
        tensors = {"weight_packed": pack_int32(q.reshape(n, k) - qmin, bits, dim=1), "weight_scale": scales,
                   "weight_shape": torch.tensor([n, k])}
        if not sym:
            tensors["weight_zero_point"] = pack_int32(zp - qmin, bits, dim=0)
        return tensors, deq

    return encode


def act_order_groups(module: str, k: int, group: int) -> torch.Tensor:
    """An act-order g_idx: a random column order per input (shared by the modules that read it),
    cut into groups of `group` columns that then lie scattered over K."""
    gen = torch.Generator().manual_seed(zlib.crc32(input_group(module).encode()))
    g_idx = torch.empty(k, dtype=torch.int64)
    g_idx[torch.randperm(k, generator=gen)] = torch.arange(k) // group
    return g_idx


def ct_naive_act_order_encoder(bits: int, group_size: int):
    """compressed-tensors naive-quantized, asymmetric, actorder "group": weight int8 (N, K) holding the
    signed values unpacked, weight_scale (N, G) bf16, weight_zero_point int8 (N, G), weight_g_idx (K,)
    naming each (checkpoint-ordered) column's group."""
    qmin, qmax = -2 ** (bits - 1), 2 ** (bits - 1) - 1

    def encode(module: str, w: torch.Tensor):
        if module == "lm_head":
            return None
        n, k = w.shape
        g_idx = act_order_groups(module, k, group_size)
        scales, zp = torch.empty(n, k // group_size), torch.empty(n, k // group_size)
        for g in range(k // group_size):
            cols = w[:, g_idx == g]
            lo, hi = cols.amin(1).clamp(max=0), cols.amax(1).clamp(min=0)
            scales[:, g] = ((hi - lo) / (qmax - qmin)).clamp_min(1e-6)
            zp[:, g] = torch.round(qmin - lo / scales[:, g].bfloat16().float()).clamp(qmin, qmax)
        scales = scales.bfloat16()
        s, z = scales.float()[:, g_idx], zp[:, g_idx]
        q = torch.clamp(torch.round(w / s) + z, qmin, qmax)
        return {"weight": q.to(torch.int8), "weight_scale": scales, "weight_zero_point": zp.to(torch.int8),
                "weight_g_idx": g_idx.to(torch.int32)}, s * (q - z)

    return encode


def ct_int8_encoder(static_scales: dict[str, float] | None = None):
    """compressed-tensors int-quantized W8A8: weight int8 (N, K), weight_scale (N, 1); input_scale
    (1,) for static activations."""

    def encode(module: str, w: torch.Tensor):
        if module == "lm_head":
            return None
        scales = (w.abs().amax(-1, keepdim=True) / 127).clamp_min(1e-6).bfloat16()
        q = torch.clamp(torch.round(w / scales.float()), -128, 127)
        tensors = {"weight": q.to(torch.int8), "weight_scale": scales}
        if static_scales is not None:
            tensors["input_scale"] = torch.tensor([static_scales[module]], dtype=torch.bfloat16)
        return tensors, scales.float() * q

    return encode


def fp8_encoder(granularity: str, block: tuple[int, int] | None = None, scale_name: str = "weight_scale",
                input_scale: bool = False, scale_dtype: torch.dtype = torch.float32, keep_lm_head: bool = True):
    """float8_e4m3fn weight (N, K) with a float scale per tensor (a scalar), per row (N, 1) or per block
    ((ceil(N / bn), ceil(K / bk)), the last blocks partial); static checkpoints add input_scale."""

    def encode(module: str, w: torch.Tensor):
        if module == "lm_head" and keep_lm_head:
            return None
        n, k = w.shape
        if granularity == "tensor":
            scale = (w.abs().amax() / FP8_MAX).to(scale_dtype).reshape(())
            expanded = scale.float().expand(n, k)
        elif granularity == "channel":
            scale = (w.abs().amax(-1, keepdim=True) / FP8_MAX).to(scale_dtype)
            expanded = scale.float().expand(n, k)
        else:
            bn, bk = block
            rows, cols = -(-n // bn), -(-k // bk)
            padded = F.pad(w.abs(), (0, cols * bk - k, 0, rows * bn - n))
            scale = (padded.reshape(rows, bn, cols, bk).amax((1, 3)) / FP8_MAX).to(scale_dtype)
            expanded = scale.float().repeat_interleave(bn, 0)[:n].repeat_interleave(bk, 1)[:, :k]
        codes = (w / expanded).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
        tensors = {"weight": codes, scale_name: scale}
        if input_scale:  # a plausible calibrated value; the CPU path does not use it
            tensors["input_scale"] = torch.tensor(0.05, dtype=scale_dtype)
        return tensors, codes.float() * expanded

    return encode


def ct_config(scheme: dict, fmt: str, ignore=("lm_head",)) -> dict:
    return {"quant_method": "compressed-tensors", "format": fmt, "quantization_status": "compressed",
            "config_groups": {"group_0": {"targets": ["Linear"], **scheme}}, "ignore": list(ignore),
            "kv_cache_scheme": None, "sparsity_config": {}}


def int_args(bits: int, strategy: str, group_size: int | None = None, symmetric: bool = True) -> dict:
    return {"num_bits": bits, "type": "int", "symmetric": symmetric, "strategy": strategy,
            "group_size": group_size, "dynamic": False, "actorder": None, "observer": "minmax"}


def gptq_config(bits: int, group_size: int, sym: bool, desc_act: bool = False, fmt: str = "gptq") -> dict:
    return {"quant_method": "gptq", "bits": bits, "group_size": group_size, "desc_act": desc_act, "sym": sym,
            "damp_percent": 0.01, "true_sequential": True, "static_groups": False, "checkpoint_format": fmt}


# variant -> (quantization_config, encoder factory, kind of the decoder linears, max byte fraction).
# The fraction is of the float32 model's weight bytes; the float token table and (but for one
# variant) LM head are ~18% of them here, so 4-bit weights come to ~0.31-0.35 and 8-bit to ~0.39-0.41.
VARIANTS = {
    "gptq-4bit-sym": (gptq_config(4, 32, True), lambda: gptq_encoder(4, 32, True, True, zero_bias=True),
                      "int4", 0.45),
    "gptq-4bit-asym": (gptq_config(4, 64, False), lambda: gptq_encoder(4, 64, False, True), "int4", 0.45),
    "gptq-8bit-channel": (gptq_config(8, -1, True),
                          lambda: gptq_encoder(8, -1, True, True, write_g_idx=False), "int8", 0.55),
    "gptq-desc-act": (gptq_config(4, 32, False, desc_act=True, fmt="gptq_v2"),
                      lambda: gptq_encoder(4, 32, False, False, act_order=True), "int4", 0.45),
    "awq": ({"quant_method": "awq", "bits": 4, "group_size": 64, "zero_point": True, "version": "gemm"},
            lambda: awq_encoder(64), "int4", 0.45),
    "ct-w4a16-group": (ct_config({"weights": int_args(4, "group", 32), "input_activations": None},
                                 "pack-quantized"),
                       lambda: ct_pack_encoder(4, 32, True, False), "int4", 0.45),
    "ct-w8a16-channel-asym": (ct_config({"weights": int_args(8, "channel", symmetric=False),
                                         "input_activations": None}, "pack-quantized", ignore=()),
                              lambda: ct_pack_encoder(8, None, False, True), "int8", 0.45),
    "ct-naive-w4a16-act-order": (ct_config({"weights": {**int_args(4, "group", 32, symmetric=False),
                                                        "actorder": "group"}, "input_activations": None},
                                           "naive-quantized"),
                                 lambda: ct_naive_act_order_encoder(4, 32), "int4", 0.45),
    "ct-w8a8-int": (ct_config({"weights": int_args(8, "channel"),
                               "input_activations": {"num_bits": 8, "type": "int", "symmetric": True,
                                                     "strategy": "token", "dynamic": True}}, "int-quantized"),
                    lambda: ct_int8_encoder(), "int8", 0.55),
    "ct-fp8": (ct_config({"weights": {"num_bits": 8, "type": "float", "symmetric": True, "strategy": "channel"},
                          "input_activations": {"num_bits": 8, "type": "float", "symmetric": True,
                                                "strategy": "token", "dynamic": True}}, "float-quantized"),
               lambda: fp8_encoder("channel", scale_dtype=torch.bfloat16), "fp8", 0.55),
    "fp8-per-tensor": ({"quant_method": "fp8", "activation_scheme": "static"},
                       lambda: fp8_encoder("tensor", input_scale=True), "fp8", 0.55),
    "fp8-block": ({"quant_method": "fp8", "activation_scheme": "dynamic", "fmt": "e4m3",
                   "weight_block_size": [48, 96]},
                  lambda: fp8_encoder("block", (48, 96), scale_name="weight_scale_inv"), "fp8", 0.55),
}
WEIGHT_ONLY = [v for v in VARIANTS if v != "ct-w8a8-int"]


@pytest.fixture(scope="module")
def base_dir(checkpoint_factory) -> str:
    return checkpoint_factory("LlamaForCausalLM", **MODEL)


@pytest.fixture(scope="module")
def checkpoints(base_dir, tmp_path_factory):
    """variant -> (quantized dir, dequantized float dir), each written once per module."""

    @functools.cache
    def get(variant: str) -> tuple[str, str]:
        config, encoder, _, _ = VARIANTS[variant]
        return write_checkpoints(base_dir, str(tmp_path_factory.mktemp(variant)), config, encoder())

    return get


def make_llm(path: str, **kwargs) -> LLM:
    return LLM(path, device="cpu", dtype="float32", kv_cache_memory="16MiB", max_model_len=256, **kwargs)


def runner_model(llm: LLM) -> torch.nn.Module:
    return llm.engine.core.executor.runner.model


def copy_of(src: str, dst) -> str:
    return shutil.copytree(src, str(dst))


def assert_same_decoding(quant: LLM, dequantized: LLM, tol: float) -> None:
    """Greedy tokens equal and chosen-token logprobs within `tol`."""
    got, ref = quant.generate(PROMPTS, GREEDY), dequantized.generate(PROMPTS, GREEDY)
    for prompt, out, want in zip(PROMPTS, got, ref, strict=True):
        tokens, ref_tokens = out.outputs[0].token_ids, want.outputs[0].token_ids
        assert tokens == ref_tokens, f"{prompt!r}: quantized {tokens} != dequantized float {ref_tokens}"
        for step, (token, lp, ref_lp) in enumerate(zip(tokens, out.outputs[0].logprobs, want.outputs[0].logprobs,
                                                       strict=True)):
            assert abs(lp[token].logprob - ref_lp[token].logprob) < tol, (prompt, step)


def assert_close_decoding(quant: LLM, dequantized: LLM, tol: float) -> None:
    """Greedy tokens equal and logprobs within `tol`, up to a step where the reference's own top
    two tokens are within `tol` of each other and the quantized model took the other one (after
    which the continuations differ by right); most steps must be compared."""
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True, logprobs=5)
    got, ref = quant.generate(PROMPTS, params), dequantized.generate(PROMPTS, params)
    compared = 0
    for prompt, out, want in zip(PROMPTS, got, ref, strict=True):
        for step, (token, ref_token) in enumerate(zip(out.outputs[0].token_ids, want.outputs[0].token_ids,
                                                      strict=True)):
            lp, ref_lp = out.outputs[0].logprobs[step], want.outputs[0].logprobs[step]
            if token != ref_token:
                assert token in ref_lp and ref_lp[ref_token].logprob - ref_lp[token].logprob < tol, \
                    f"{prompt!r} step {step}: quantized {token} where the dequantized model clearly prefers {ref_token}"
                break
            assert abs(lp[token].logprob - ref_lp[token].logprob) < tol, (prompt, step)
            compared += 1
    assert compared >= len(PROMPTS) * MAX_TOKENS // 2, f"only {compared} steps agreed"


# ---- every format decodes like the float weights it stands for --------------------------------------
@pytest.mark.parametrize("variant", list(VARIANTS))
def test_checkpoint_decodes_like_its_dequantized_weights(checkpoints, variant):
    quant_dir, float_dir = checkpoints(variant)
    _, _, kind, max_fraction = VARIANTS[variant]
    quant, dequantized = make_llm(quant_dir), make_llm(float_dir)
    if variant in WEIGHT_ONLY:
        assert_same_decoding(quant, dequantized, LOGPROB_TOL)
    else:
        assert_close_decoding(quant, dequantized, W8A8_LOGPROB_TOL)

    model = runner_model(quant)
    for layer in model.layers:
        for linear in (layer.self_attn.qkv_proj, layer.self_attn.o_proj, layer.mlp.gate_up_proj,
                       layer.mlp.down_proj):
            assert linear.quantized.kind == kind
            assert "weight" not in linear._parameters  # neither the float nor the checkpoint tensors stay
            assert not any(p.dtype in (torch.int32, torch.float8_e4m3fn) for p in linear.parameters())
    assert (getattr(model.lm_head, "quantized", None) is not None) == (variant == "ct-w8a16-channel-asym")
    assert getattr(model.embed_tokens, "quantized", None) is None
    fraction = weight_bytes(model) / weight_bytes(runner_model(dequantized))
    assert fraction < max_fraction, f"{variant}: the weights take {fraction:.2f} of the float bytes"


def test_act_order_sorts_the_input_columns_by_group(checkpoints):
    for variant, name in (("gptq-desc-act", "g_idx"), ("ct-naive-w4a16-act-order", "weight_g_idx")):
        quant_dir, _ = checkpoints(variant)
        g_idx = load_file(os.path.join(quant_dir, "model.safetensors"))[f"model.layers.0.self_attn.q_proj.{name}"]
        qkv = runner_model(make_llm(quant_dir)).layers[0].self_attn.qkv_proj.quantized
        assert qkv.input_perm is not None
        assert torch.equal(g_idx[qkv.input_perm].long(), torch.arange(128) // 32)


def test_gptq_lm_head_flag_quantizes_the_lm_head_only():
    from kvtide.layers.embedding import LMHead, VocabEmbedding
    from kvtide.layers.quantization.gptq import GPTQConfig, GPTQMethod

    head, table = LMHead(256, 128), VocabEmbedding(256, 128)
    assert isinstance(GPTQConfig(4, 128, lm_head=True).method_for("lm_head", head), GPTQMethod)
    assert GPTQConfig(4, 128).method_for("lm_head", head) is None
    assert GPTQConfig(4, 128, lm_head=True).method_for("embed_tokens", table) is None


def test_8bit_symmetric_gptq_needs_no_mins(checkpoints):
    quant_dir, _ = checkpoints("gptq-8bit-channel")
    qw = runner_model(make_llm(quant_dir)).layers[0].mlp.down_proj.quantized
    assert qw.kind == "int8" and qw.mins is None and qw.group_size == qw.in_features == 256


def test_fp8_block_scales_become_exact_row_groups(checkpoints):
    """48 x 96 blocks over K = 128: groups of gcd(96, 128) = 32 columns, each inside one block."""
    quant_dir, _ = checkpoints("fp8-block")
    qw = runner_model(make_llm(quant_dir)).layers[0].self_attn.qkv_proj.quantized
    assert qw.group_size == 32 and tuple(qw.scales.shape) == (256, 4)


def test_w8a8_checkpoint_holds_what_on_the_fly_w8a8_makes_of_its_weights(checkpoints):
    """The exact check of the reading that activation rounding hides from the decoding test."""
    quant_dir, float_dir = checkpoints("ct-w8a8-int")
    got, ref = runner_model(make_llm(quant_dir)), runner_model(make_llm(float_dir, quantization="w8a8"))
    for mine, theirs in zip(got.layers, ref.layers, strict=True):
        for name in ("self_attn.qkv_proj", "self_attn.o_proj", "mlp.gate_up_proj", "mlp.down_proj"):
            a, b = mine.get_submodule(name), theirs.get_submodule(name)
            assert torch.equal(a.quantized.codes, b.quantized.codes), name
            torch.testing.assert_close(a.quantized.scales, b.quantized.scales, rtol=1e-6, atol=0)
            assert a.w8a8_input_scale is None  # dynamic per-token activations


def test_static_w8a8_takes_the_largest_input_scale_of_a_fused_layer(base_dir, tmp_path):
    scales = {}
    for layer in range(MODEL["num_hidden_layers"]):
        for i, name in enumerate(["q_proj", "k_proj", "v_proj", "o_proj"]):
            scales[f"model.layers.{layer}.self_attn.{name}"] = 0.02 + 0.01 * i
        for i, name in enumerate(["gate_proj", "up_proj", "down_proj"]):
            scales[f"model.layers.{layer}.mlp.{name}"] = 0.03 + 0.01 * i
    config = ct_config({"weights": int_args(8, "channel"),
                        "input_activations": {"num_bits": 8, "type": "int", "symmetric": True, "strategy": "tensor",
                                              "dynamic": False}}, "int-quantized")
    quant_dir, _ = write_checkpoints(base_dir, str(tmp_path), config, ct_int8_encoder(scales))
    llm = make_llm(quant_dir)
    model = runner_model(llm)
    qkv, o_proj = model.layers[0].self_attn.qkv_proj, model.layers[0].self_attn.o_proj
    assert qkv.w8a8_input_scale.dim() == 0
    assert qkv.w8a8_input_scale.item() == pytest.approx(0.04, rel=1e-2)  # max of q, k, v (bf16-rounded)
    assert o_proj.w8a8_input_scale.item() == pytest.approx(0.05, rel=1e-2)
    assert len(llm.generate(PROMPTS[:1], GREEDY)[0].outputs[0].token_ids) == MAX_TOKENS


# ---- refusals ----------------------------------------------------------------------------------------
def test_gptq_declaring_3_bits_is_refused(checkpoints, tmp_path):
    path = copy_of(checkpoints("gptq-4bit-sym")[0], tmp_path / "m")
    edit_quantization_config(path, bits=3)
    with pytest.raises(ValueError, match="GPTQ bits must be 4 or 8; the checkpoint declares bits=3"):
        make_llm(path)


def test_gptq_group_size_must_divide_the_input_size(checkpoints, tmp_path):
    path = copy_of(checkpoints("gptq-4bit-sym")[0], tmp_path / "m")
    edit_quantization_config(path, group_size=48)
    with pytest.raises(ValueError, match=r"model\.layers\.0\.self_attn\.q_proj: GPTQ group_size 48 does not divide "
                                         r"the input size 128"):
        make_llm(path)


def test_gptq_tensors_that_disagree_with_the_declared_bits_name_the_layer(checkpoints, tmp_path):
    path = copy_of(checkpoints("gptq-4bit-sym")[0], tmp_path / "m")
    edit_quantization_config(path, bits=8)
    with pytest.raises(ValueError, match=r"model\.layers\.\d\.\w+\.\w+_proj: qweight shape mismatch: parameter "
                                         r"\(\d+, \d+\) vs checkpoint \(\d+, \d+\) \(the config declares bits=8"):
        make_llm(path)


def test_gptq_fused_shards_need_one_g_idx(checkpoints, tmp_path):
    path = copy_of(checkpoints("gptq-desc-act")[0], tmp_path / "m")
    name = "model.layers.0.self_attn.k_proj.g_idx"
    g_idx = load_file(os.path.join(path, "model.safetensors"))[name]
    edit_tensors(path, **{name: g_idx.flip(0).contiguous()})
    with pytest.raises(ValueError, match=r"model\.layers\.0\.self_attn\.[qkv]_proj: g_idx: the shards of a fused layer "
                                         r"carry different values"):
        make_llm(path)


def test_gptq_nonzero_bias_without_a_model_bias_is_refused(checkpoints, tmp_path):
    path = copy_of(checkpoints("gptq-4bit-sym")[0], tmp_path / "m")
    edit_tensors(path, **{"model.layers.1.mlp.down_proj.bias": torch.full((128,), 0.5, dtype=torch.float16)})
    with pytest.raises(ValueError, match=r"'layers\.1\.mlp\.down_proj\.bias' is a non-zero bias"):
        make_llm(path)


def test_awq_forced_on_a_gptq_checkpoint_is_refused(checkpoints):
    with pytest.raises(ValueError, match="the checkpoint is gptq-quantized; --quantization awq disagrees"):
        make_llm(checkpoints("gptq-4bit-sym")[0], quantization="awq")


def test_awq_gemv_is_refused(checkpoints, tmp_path):
    path = copy_of(checkpoints("awq")[0], tmp_path / "m")
    edit_quantization_config(path, version="gemv")
    with pytest.raises(ValueError, match="AWQ version 'gemv' is not supported"):
        make_llm(path)


@pytest.mark.parametrize("method, config, message", [
    ("gptq", gptq_config(4, 128, True, fmt="marlin"), "checkpoint_format 'marlin' is not supported"),
    ("gptq", {**gptq_config(4, 128, True), "is_marlin_format": True}, "Marlin layout"),
    ("awq", {"bits": 4, "group_size": 128, "zero_point": False}, "zero_point false"),
    ("awq", {"bits": 8, "group_size": 128}, "AWQ bits must be 4"),
    ("compressed-tensors", ct_config({"weights": {"num_bits": 4, "type": "float", "strategy": "group",
                                                  "group_size": 16}}, "nvfp4-pack-quantized"),
     "format 'nvfp4-pack-quantized' is not supported"),
    ("compressed-tensors", {**ct_config({"weights": int_args(4, "group", 128)}, "pack-quantized"),
                            "sparsity_config": {"format": "sparse-24-bitmask"}}, "sparsity"),
    ("compressed-tensors", {**ct_config({"weights": int_args(8, "channel")}, "int-quantized"),
                            "kv_cache_scheme": {"num_bits": 8, "type": "float"}}, "kv_cache_scheme"),
    ("compressed-tensors", ct_config({"weights": int_args(8, "channel"),
                                      "input_activations": {**int_args(8, "token"), "symmetric": False,
                                                            "dynamic": True}}, "int-quantized"),
     "symmetric weights and activations"),
    ("fp8", {"activation_scheme": "sometimes"}, "activation_scheme must be dynamic or static"),
    ("fp8", {"activation_scheme": "dynamic", "fmt": "e5m2"}, "'e5m2' are not supported"),
])
def test_unsupported_variants_are_refused(method, config, message):
    from kvtide.layers.quantization import _checkpoint_config

    with pytest.raises(ValueError, match=message):
        _checkpoint_config(method, {"quant_method": method, **config})
