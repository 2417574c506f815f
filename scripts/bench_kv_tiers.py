"""Time to first token of one long prompt: computed, loaded from host memory, loaded from Redis.

    python scripts/bench_kv_tiers.py --redis-url redis://127.0.0.1:6379/0 [--model smollm2]
        [--prompt-len 2000] [--repeats 3]

Offline engines (float32, one process, the machine's cores), each request max_tokens 1, so the time
is the prompt's prefill plus one sampled token:
  recomputed  a prompt no tier holds (every run a fresh prompt);
  cpu tier    the same prompt after another prompt evicted it from the device pool (the pool holds
              one prompt), so its blocks come back from host memory;
  redis       a second engine with an empty device pool and only the Redis tier, which the first
              engine wrote through as it computed the prompt.
Prints the median of --repeats, the ratios, and the CPU model and ISA.
"""

from __future__ import annotations

import argparse
import random
import statistics
import time


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="smollm2")
    p.add_argument("--redis-url", required=True)
    p.add_argument("--prompt-len", type=int, default=2000)
    p.add_argument("--repeats", type=int, default=3)
    args = p.parse_args()

    import redis

    from kvtide import LLM, SamplingParams
    from kvtide.machine import describe_machine

    redis.Redis.from_url(args.redis_url).flushdb()
    rng = random.Random(0)
    max_len = args.prompt_len + 16
    params = SamplingParams(temperature=0.0, max_tokens=1)

    def prompt() -> list[int]:
        return [rng.randint(100, 20000) for _ in range(args.prompt_len)]

    def ttft(llm, token_ids) -> tuple[float, int]:
        start = time.perf_counter()
        out = llm.generate([{"prompt_token_ids": token_ids}], params, use_tqdm=False)[0]
        return time.perf_counter() - start, out.num_cached_tokens

    # The device pool holds one prompt (and a little), so the next prompt evicts the last one.
    common = dict(dtype="float32", max_model_len=max_len, max_num_batched_tokens=max_len)
    first = LLM(args.model, kv_transfer_config={"kv_connector": "multi", "redis_url": args.redis_url,
                                                "kv_offload_memory": 4 << 30}, **common,
                kv_cache_memory=str(_pool_bytes(args.model, max_len)))
    ttft(first, prompt())  # warm-up
    computed, from_cpu, prompts = [], [], []
    for _ in range(args.repeats):
        tokens = prompt()
        seconds, cached = ttft(first, tokens)
        assert cached == 0
        computed.append(seconds)
        prompts.append(tokens)
        ttft(first, prompt())  # evicts `tokens` to host memory
        seconds, cached = ttft(first, tokens)
        assert cached > 0.9 * args.prompt_len, cached
        from_cpu.append(seconds)
    first.engine.core.kv_connector.worker.flush()
    first.shutdown()

    second = LLM(args.model, kv_transfer_config={"kv_connector": "redis", "redis_url": args.redis_url}, **common)
    ttft(second, prompt())  # warm-up
    from_redis = []
    for tokens in prompts:
        seconds, cached = ttft(second, tokens)
        assert cached > 0.9 * args.prompt_len, cached
        from_redis.append(seconds)
    second.shutdown()

    c, m, r = (statistics.median(x) for x in (computed, from_cpu, from_redis))
    print(describe_machine())
    print(f"TTFT of a {args.prompt_len}-token prompt ({args.model}, float32), median of {args.repeats}:")
    print(f"  recomputed       {c * 1000:8.1f} ms")
    print(f"  from host memory {m * 1000:8.1f} ms   {c / m:5.2f}x lower")
    print(f"  from Redis       {r * 1000:8.1f} ms   {c / r:5.2f}x lower")


def _pool_bytes(model: str, max_len: int) -> int:
    """A device pool of about one prompt: the model's KV bytes per token x (max_len + 2 blocks)."""
    from kvtide.engine_args import EngineArgs

    engine_args = EngineArgs(model=model, dtype="float32")
    hf = engine_args.create_engine_config(engine_args.resolve_model_dir()).model_config.hf_config
    head_dim = getattr(hf, "head_dim", None) or hf.hidden_size // hf.num_attention_heads
    per_token = 2 * hf.num_hidden_layers * hf.num_key_value_heads * head_dim * 4
    return per_token * (max_len + 32)


if __name__ == "__main__":
    main()
