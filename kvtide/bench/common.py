"""What the offline benchmarks share: the bench checkpoint, token-id prompts, FLOP counts, matmul peak.

The bench checkpoint is a random Llama of ~125M parameters (hidden 768, 12 layers, 12 heads, 4 KV
heads, intermediate 2048, vocab 32000, untied), float32, built once with
`kvtide.models.demo.make_random_checkpoint` and cached under ~/.cache/kvtide/bench-models/ (or
$KVTIDE_CACHE/bench-models/). Its tokenizer is the byte tokenizer with every further id added as a
token of its own ('<|t300|>'), so each generated token has text. Offline benchmarks feed token ids.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from collections.abc import Callable

import numpy as np

from kvtide.machine import describe_machine, machine_info
from kvtide.models.cache_dir import build_cached_dir, cache_dir, cache_root

BENCH_MODEL_VERSION = "v2"
BENCH_MODEL_CONFIG = dict(hidden_size=768, num_hidden_layers=12, num_attention_heads=12, num_key_value_heads=4,
                          intermediate_size=2048, vocab_size=32000, max_position_embeddings=2048,
                          tie_word_embeddings=False)
BENCH_MODEL_SEED = 0
# Token ids 0-2 are <s>, </s>, <pad>; prompts draw from the rest of the vocabulary.
FIRST_PROMPT_TOKEN = 3


BENCH_SHAPES: dict[str, tuple[str, dict]] = {
    # ~150M parameters, ~40M active: 8 layers of 8 experts (top-2), GQA 8:2.
    "bench-mixtral": ("MixtralForCausalLM", dict(
        hidden_size=512, num_hidden_layers=8, num_attention_heads=8, num_key_value_heads=2, intermediate_size=1024,
        num_local_experts=8, num_experts_per_tok=2, vocab_size=32000, max_position_embeddings=2048,
        tie_word_embeddings=False)),
    # ~125M parameters, ~50M active: MLA with DeepSeek-V3's latent (512 + rope 64: the one vLLM's CPU
    # MLA runs) and q LoRA 192, 1 dense layer, then 16 routed experts (top-4 of 4 groups, 2 groups kept)
    # and a shared one.
    "bench-deepseek-v3": ("DeepseekV3ForCausalLM", dict(
        hidden_size=512, num_hidden_layers=8, num_attention_heads=8, num_key_value_heads=8, intermediate_size=1536,
        q_lora_rank=192, kv_lora_rank=512, qk_nope_head_dim=64, qk_rope_head_dim=64, v_head_dim=64,
        n_routed_experts=16, num_experts_per_tok=4, moe_intermediate_size=384, n_shared_experts=1,
        first_k_dense_replace=1, n_group=4, topk_group=2, routed_scaling_factor=2.5, vocab_size=32000,
        topk_method="noaux_tc", scoring_func="sigmoid",  # what DeepSeek-V3's config.json says (vLLM reads them)
        max_position_embeddings=2048, tie_word_embeddings=False)),
    # The ~110M bench shape as Qwen2 with layers 6-11 attending within 256 tokens (max_window_layers):
    # full and windowed layers mixed half and half, as in Gemma-2, for the layer-group KV cache.
    "bench-qwen2-window": ("Qwen2ForCausalLM", dict(
        BENCH_MODEL_CONFIG, use_sliding_window=True, sliding_window=256, max_window_layers=6)),
}
"""Random checkpoints of other shapes `bench --model` knows by name: MoE and MLA, mixed windows."""
BENCH_SHAPES_VERSION = "v3"


def bench_model_path(shape: str | None = None) -> str:
    """The bench checkpoint's directory (or that of a BENCH_SHAPES name), built on first use
    (about 10 s and 0.5 GB)."""
    from kvtide.models.demo import make_random_checkpoint

    architecture, config = ("LlamaForCausalLM", BENCH_MODEL_CONFIG) if shape is None else BENCH_SHAPES[shape]
    name = f"llama-h768-l12-{BENCH_MODEL_VERSION}" if shape is None else f"{shape}-{BENCH_SHAPES_VERSION}"
    path = cache_dir("bench-models", name, create=False)  # checked before it is read
    marker = os.path.join(path, "kvtide_bench_model.json")
    if os.path.exists(marker):
        return path

    def build(tmp: str) -> None:
        make_random_checkpoint(tmp, architecture, seed=BENCH_MODEL_SEED, **config)
        _cover_vocabulary(tmp, config["vocab_size"])
        with open(os.path.join(tmp, "kvtide_bench_model.json"), "w") as f:
            json.dump({"version": BENCH_MODEL_VERSION, "config": config, "seed": BENCH_MODEL_SEED}, f)

    return build_cached_dir(path, build)


def _cover_vocabulary(path: str, vocab_size: int) -> None:
    """Give every id the byte tokenizer lacks a text of its own ('<|t300|>'), as a real tokenizer has.

    The random model mostly emits ids above the 259 byte tokens; without this they decode to nothing,
    servers stream empty chunks and text-based token timing sees no tokens."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(path)
    tokenizer.add_tokens([f"<|t{i}|>" for i in range(len(tokenizer), vocab_size)])
    tokenizer.save_pretrained(path)


def resolve_model(model: str | None) -> str:
    """--model: None builds/uses the bench checkpoint; a BENCH_SHAPES name ('bench-mixtral', ...)
    that one; 'demo' the demo one; a GGUF file (or 'smollm2')
    its float32 export, so that every engine, those that read only HF checkpoints too, runs the same
    weights; else a directory."""
    from kvtide.models.builtin import builtin_model_path
    from kvtide.models.gguf_checkpoint import export_hf_checkpoint, is_gguf_file

    if model is None:
        return bench_model_path()
    if model in BENCH_SHAPES:
        return bench_model_path(model)
    path = builtin_model_path(model) or model
    if is_gguf_file(path):
        stem = os.path.splitext(os.path.basename(path))[0]
        return export_hf_checkpoint(path, os.path.join(cache_root(), "bench-models", f"{stem}-f32"))
    if not os.path.isdir(path):
        raise ValueError(f"--model {model!r} is neither a checkpoint directory nor a GGUF file")
    return path


def read_config(model_dir: str) -> dict:
    with open(os.path.join(model_dir, "config.json")) as f:
        return json.load(f)


def random_token_prompts(vocab_size: int, num_prompts: int, input_len: int, output_len: int,
                         seed: int, range_ratio: float = 0.0) -> tuple[list[list[int]], list[int]]:
    """Token-id prompts and output lengths, lengths uniform in [len*(1-r), len*(1+r)]."""
    if not 0 <= range_ratio < 1:
        raise ValueError(f"--random-range-ratio must be in [0, 1), got {range_ratio}")
    if input_len < 1 or output_len < 1 or num_prompts < 1:
        raise ValueError("--input-len, --output-len and --num-prompts must be >= 1")
    rng = np.random.default_rng(seed)

    def lengths(mean: int) -> list[int]:
        low, high = max(1, int(mean * (1 - range_ratio))), max(1, int(mean * (1 + range_ratio)))
        return rng.integers(low, high + 1, size=num_prompts).tolist()

    in_lens, out_lens = lengths(input_len), lengths(output_len)
    prompts = [rng.integers(FIRST_PROMPT_TOKEN, vocab_size, size=n).tolist() for n in in_lens]
    return prompts, out_lens


def matmul_flops_per_token(config: dict) -> tuple[float, float]:
    """(FLOPs of one token through all decoder layers' weight matmuls, FLOPs of the LM head).

    2·in·out per linear: q, k, v, o projections (MLA: its down- and up-projections, the latent
    expanded once per token) and the gated MLP (gate, up, down); a sparse MoE layer counts the
    experts a token is routed to plus the shared ones and the router. Attention's own QK^T and PV
    products grow with context and are left out, as is everything that is not a matmul, so the
    count is a floor of the work done."""
    hidden = config["hidden_size"]
    total = sum(_attention_flops(config) + _mlp_flops(config, i) for i in range(config["num_hidden_layers"]))
    return float(total), float(2 * hidden * config["vocab_size"])


def _attention_flops(config: dict) -> int:
    hidden, heads = config["hidden_size"], config["num_attention_heads"]
    if "kv_lora_rank" in config:  # MLA
        qk_dim = config["qk_nope_head_dim"] + config["qk_rope_head_dim"]
        q_lora = config.get("q_lora_rank")
        q = hidden * q_lora + q_lora * heads * qk_dim if q_lora else hidden * heads * qk_dim
        kv = hidden * (config["kv_lora_rank"] + config["qk_rope_head_dim"]) + \
            config["kv_lora_rank"] * heads * (config["qk_nope_head_dim"] + config["v_head_dim"])
        return 2 * (q + kv + heads * config["v_head_dim"] * hidden)
    kv_heads = config.get("num_key_value_heads") or heads
    head_dim = config.get("head_dim") or hidden // heads
    q_dim, kv_dim = heads * head_dim, kv_heads * head_dim
    return 2 * hidden * (q_dim + 2 * kv_dim) + 2 * q_dim * hidden


def _mlp_flops(config: dict, layer: int) -> int:
    """The gated MLP, or what a token computes in a sparse layer (routed + shared experts, router)."""
    hidden = config["hidden_size"]
    experts = config.get("num_local_experts") or config.get("n_routed_experts") or config.get("num_experts") or 0
    sparse = experts > 0
    if "first_k_dense_replace" in config:
        sparse = sparse and layer >= config["first_k_dense_replace"]
    elif "decoder_sparse_step" in config:
        sparse = sparse and layer not in (config.get("mlp_only_layers") or []) and \
            (layer + 1) % config["decoder_sparse_step"] == 0
    if not sparse:
        return 2 * 3 * hidden * config["intermediate_size"]
    expert_inter = config.get("moe_intermediate_size") or config["intermediate_size"]
    shared = (config.get("n_shared_experts") or 0) * expert_inter + (config.get("shared_expert_intermediate_size") or 0)
    return 2 * 3 * hidden * (config["num_experts_per_tok"] * expert_inter + shared) + 2 * hidden * experts


def workload_flops(config: dict, prompt_lens: list[int], output_lens: list[int]) -> float:
    """Matmul FLOPs of generating output_lens[i] tokens after prompt_lens[i], without recomputation:
    every prompt token through the layers, the LM head on the last prompt token (it yields the first
    output token), then each later output token is fed back through layers and LM head."""
    layers, lm_head = matmul_flops_per_token(config)
    total = 0.0
    for n_in, n_out in zip(prompt_lens, output_lens, strict=True):
        total += n_in * layers + lm_head
        total += max(0, n_out - 1) * (layers + lm_head)
    return total


def measure_matmul_peak(n: int = 2048, reps: int = 5) -> float:
    """Best GFLOP/s of torch.mm on n×n float32 matrices over `reps` runs (after one warm-up)."""
    import torch

    a = torch.randn(n, n, dtype=torch.float32)
    b = torch.randn(n, n, dtype=torch.float32)
    torch.mm(a, b)
    best = float("inf")
    for _ in range(reps):
        start = time.perf_counter()
        torch.mm(a, b)
        best = min(best, time.perf_counter() - start)
    return 2 * n**3 / best / 1e9


def greedy_agreement(a: list[list[int]], b: list[list[int]]) -> dict:
    """How many sequences are identical, and the mean length of the common prefix."""
    same = sum(x == y for x, y in zip(a, b, strict=False))
    prefix = []
    for x, y in zip(a, b, strict=False):
        k = 0
        while k < min(len(x), len(y)) and x[k] == y[k]:
            k += 1
        prefix.append(k)
    return {"identical": same, "of": min(len(a), len(b)),
            "mean_common_prefix": float(np.mean(prefix)) if prefix else 0.0}


def machine_record(with_gemm: bool = True) -> dict:
    """What every benchmark figure is printed next to: CPU model, ISA, cores, torch and threads,
    and the GEMM kernel chosen per linear shape and row bucket (layers/cpu_gemm.py)."""
    record = machine_info()
    if with_gemm:
        from kvtide.layers.cpu_gemm import gemm_choices

        record["gemm"] = gemm_choices()
    return record


def format_machine(record: dict) -> str:
    """'machine: ...' and one 'gemm SHAPE: rows 1: ..., 2-8: ...' line per linear shape."""
    from kvtide.layers.cpu_gemm import format_choices

    lines = [describe_machine(record)]
    lines += [f"gemm {shape}: {format_choices(choices)}" for shape, choices in record.get("gemm", {}).items()]
    return "\n".join(lines)


def align_rows(rows: list[tuple[str, ...]]) -> list[str]:
    """A text table: the first column left-aligned, the others right-aligned, two spaces apart."""
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    return ["  ".join(cell.ljust(w) if i == 0 else cell.rjust(w) for i, (cell, w) in enumerate(zip(row, widths, strict=True)))
            for row in rows]


def print_and_save(result: dict, text: str, output_json: str | None) -> int:
    """Print a benchmark's figures, and write the result to output_json if given; exit status 0."""
    print(text)
    if output_json:
        with open(output_json, "w") as f:
            json.dump(result, f, indent=2)
    return 0


def module_main(argv: list[str] | None, name: str, doc: str | None,
                add_args: Callable[[argparse.ArgumentParser], None], main: Callable[[argparse.Namespace], int]) -> int:
    """`python -m kvtide.bench.NAME`, with the flags of `kvtide bench NAME`; a ValueError (bad
    flags, a missing model) is one line on stderr and exit status 2."""
    parser = argparse.ArgumentParser(prog=f"python -m kvtide.bench.{name}", description=doc,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    add_args(parser)
    args = parser.parse_args(argv)
    try:
        return main(args)
    except ValueError as e:
        print(f"kvtide bench {name}: error: {e}", file=sys.stderr)
        return 2
