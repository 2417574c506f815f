"""`kvtide bench kv-cache`: KV-cache dtypes side by side, in one run, for one --kv-cache-memory.

For each --kv-cache-dtypes entry (default: auto, bfloat16, fp8, int8, k8v4) the model is loaded with
that cache and the same byte budget, and this reports:

  blocks, tokens     what the pool holds
  seqs fit           concurrent sequences of input + output tokens the pool holds at once (blocks //
                     the blocks one holds at most: all of them, or under windows those the window and
                     one step of --max-num-batched-tokens span), and the ratio to the first row
  throughput         output tokens/s of --num-prompts random-token requests (input-len in,
                     output-len out, EOS ignored) submitted at once: with long contexts the pool,
                     not the step's token budget, bounds the running batch
  decode             output tokens/s over --decode-steps steps of a fixed batch of --decode-batch
                     sequences at the full context (default: as many as the first dtype's pool
                     holds: the memory-bound batch), timed after their prefills finished

    kvtide bench kv-cache --model smollm2 --kv-cache-memory 256MiB --input-len 2048 --output-len 128

With --compare-hybrid (models mixing full and windowed layers, e.g. --model bench-qwen2-window) each
dtype runs twice: with a block table per layer group (kv_cache/hybrid.py), then with one table per
request (--disable-hybrid-kv-cache-manager).

Every figure is printed next to the machine (CPU model, ISA, threads).
"""

from __future__ import annotations

import argparse
import gc
import sys
import time

from kvtide.bench.common import (
    BENCH_SHAPES,
    align_rows,
    bench_model_path,
    format_machine,
    machine_record,
    module_main,
    print_and_save,
    random_token_prompts,
)
from kvtide.bench.throughput import engine_kwargs_from_args
from kvtide.engine_args import EngineArgs
from kvtide.kv_compression.formats import KV_CACHE_DTYPES

DEFAULT_DTYPES = "auto,bfloat16,fp8,int8,k8v4"


def add_kv_cache_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default="smollm2",
                        help="checkpoint directory, GGUF file, 'smollm2', 'demo' or a bench shape (bench-qwen2-window)")
    parser.add_argument("--compare-hybrid", action="store_true",
                        help="run each dtype with layer-group block tables and with one table per request")
    parser.add_argument("--kv-cache-dtypes", default=DEFAULT_DTYPES,
                        help=f"comma-separated --kv-cache-dtype values to compare (default {DEFAULT_DTYPES})")
    parser.add_argument("--input-len", type=int, default=2048, help="prompt tokens per request")
    parser.add_argument("--output-len", type=int, default=128, help="output tokens per request")
    parser.add_argument("--num-prompts", type=int, default=16, help="requests of the throughput run (0: skip it)")
    parser.add_argument("--decode-batch", type=int, default=None,
                        help="sequences of the decode run (default: what the first dtype's pool holds)")
    parser.add_argument("--decode-steps", type=int, default=32, help="timed decode steps (0: skip the decode run)")
    parser.add_argument("--output-json", default=None)
    group = parser.add_argument_group("engine (kvtide)")
    EngineArgs.add_cli_args(group, skip=("model", "kv_cache_dtype"))
    parser.set_defaults(kv_cache_memory="256MiB")


def _seqs_fit(llm, tokens: int) -> int:
    """Sequences of `tokens` KV tokens the pool holds at once, each at its most blocks held."""
    core = llm.engine.core
    manager = core.scheduler.kv_cache_manager
    return manager.num_blocks // manager.max_blocks_held(tokens, core.config.scheduler_config.max_num_batched_tokens)


def _throughput(llm, prompts: list[list[int]], output_len: int) -> float:
    from kvtide import SamplingParams

    params = SamplingParams(temperature=0, max_tokens=output_len, ignore_eos=True)
    start = time.perf_counter()
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    elapsed = time.perf_counter() - start
    return sum(len(o.outputs[0].token_ids) for o in outs) / elapsed


def _decode_rate(llm, prompts: list[list[int]], steps: int) -> float:
    """Output tokens/s of `steps` engine steps once every prompt is decoding (prefills excluded)."""
    from kvtide import SamplingParams

    engine = llm.engine
    params = SamplingParams(temperature=0, max_tokens=steps + 2, ignore_eos=True)
    ids = [f"decode-{engine.next_request_id()}" for _ in prompts]
    for request_id, p in zip(ids, prompts, strict=True):
        engine.add_request(request_id, {"prompt_token_ids": p}, params)
    scheduler = engine.core.scheduler
    while any(r.num_computed_tokens < r.num_prompt_tokens for r in scheduler.running) or scheduler.waiting:
        engine.step()
    start = time.perf_counter()
    for _ in range(steps):
        engine.step()
    elapsed = time.perf_counter() - start
    engine.abort_request(ids)
    return len(prompts) * steps / elapsed


def run_kv_cache_bench(model: str, dtypes: list[str], engine_kwargs: dict, input_len: int, output_len: int,
                       num_prompts: int, decode_batch: int | None, decode_steps: int, seed: int = 0,
                       compare_hybrid: bool = False) -> dict:
    from kvtide import LLM

    rows = []
    variants = [(d, one_table) for d in dtypes for one_table in ((False, True) if compare_hybrid else (None,))]
    for dtype, one_table in variants:
        kwargs = dict(engine_kwargs)
        if one_table is not None:
            kwargs["disable_hybrid_kv_cache_manager"] = one_table
        llm = LLM(model=model, kv_cache_dtype=dtype, seed=seed, **kwargs)
        cache = llm.engine.core.config.cache_config
        vocab = llm.engine.core.config.model_config.hf_config.vocab_size
        label = dtype if one_table is None else f"{dtype}, {'one table' if one_table else 'groups'}"
        row = {"kv_cache_dtype": dtype, "label": label, "num_blocks": cache.num_blocks,
               "tokens": cache.num_blocks * cache.block_size, "layer_groups": len(cache.kv_cache_groups or ()),
               "bytes_per_block": llm.engine.core.executor.kv_bytes_per_block(),
               "seqs_fit": _seqs_fit(llm, input_len + output_len)}
        if num_prompts:
            prompts, _ = random_token_prompts(vocab, num_prompts, input_len, output_len, seed)
            row["output_tokens_per_s"] = _throughput(llm, prompts, output_len)
        if decode_steps:
            # the same batch for every dtype: by default the first one's pool, full (memory-bound)
            batch = decode_batch or (rows[0] if rows else row)["seqs_fit"]
            batch = max(1, min(batch, _seqs_fit(llm, input_len + decode_steps + 2)))
            prompts, _ = random_token_prompts(vocab, batch, input_len, 1, seed + 1)
            row["decode_batch"] = batch
            row["decode_tokens_per_s"] = _decode_rate(llm, prompts, decode_steps)
        rows.append(row)
        del llm
        gc.collect()
    first = rows[0]
    for row in rows:
        row["seqs_ratio"] = row["seqs_fit"] / max(first["seqs_fit"], 1)
    return {"model": model, "input_len": input_len, "output_len": output_len,
            "kv_cache_memory": engine_kwargs.get("kv_cache_memory"), "results": rows, "machine": machine_record()}


def format_kv_cache(result: dict) -> str:
    head = (f"{result['model']}: KV cache {result['kv_cache_memory']}, requests of {result['input_len']} in + "
            f"{result['output_len']} out")
    rows = [("kv dtype", "blocks", "tokens", "seqs fit", "x first", "out tok/s", "decode batch", "decode tok/s")]
    for r in result["results"]:
        rows.append((r.get("label", r["kv_cache_dtype"]), str(r["num_blocks"]), str(r["tokens"]), str(r["seqs_fit"]),
                     f"{r['seqs_ratio']:.2f}", f"{r['output_tokens_per_s']:.1f}" if "output_tokens_per_s" in r else "-",
                     str(r.get("decode_batch", "-")),
                     f"{r['decode_tokens_per_s']:.1f}" if "decode_tokens_per_s" in r else "-"))
    return "\n".join([head, *align_rows(rows), format_machine(result["machine"])])


def main_kv_cache(args: argparse.Namespace) -> int:
    dtypes = [d.strip() for d in args.kv_cache_dtypes.split(",") if d.strip()]
    if not dtypes:
        raise ValueError("--kv-cache-dtypes is empty")
    for dtype in dtypes:  # every name checked before the first model loads
        if dtype not in KV_CACHE_DTYPES:
            raise ValueError(f"--kv-cache-dtypes: {dtype!r} is not one of {', '.join(KV_CACHE_DTYPES)}")
    if args.input_len < 1 or args.output_len < 1 or args.num_prompts < 0 or args.decode_steps < 0:
        raise ValueError("--input-len and --output-len must be >= 1, --num-prompts and --decode-steps >= 0")
    kwargs = engine_kwargs_from_args(args)
    seed = kwargs.pop("seed")
    kwargs["dtype"] = "float32" if kwargs.get("dtype", "auto") == "auto" else kwargs["dtype"]
    model = bench_model_path(args.model) if args.model in BENCH_SHAPES else args.model
    result = run_kv_cache_bench(model, dtypes, kwargs, args.input_len, args.output_len, args.num_prompts,
                                args.decode_batch, args.decode_steps, seed, args.compare_hybrid)
    return print_and_save(result, format_kv_cache(result), args.output_json)


def main(argv: list[str] | None = None) -> int:
    return module_main(argv, "kv_cache", __doc__, add_kv_cache_args, main_kv_cache)


if __name__ == "__main__":
    sys.exit(main())
