"""CPU engine memory beyond the weights and the KV pool stays bounded: decoding a pool's worth of
context must not keep a second copy of it (contiguous per-request contexts, whole-batch gathers).

Measured in a fresh process as resident memory: the peak while the workload runs, above what the
process held once the engine was built and warmed up (weights, pool, libraries)."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

POOL_BYTES = 128 << 20

SCRIPT = textwrap.dedent("""
    import json, sys
    from kvtide import LLM, SamplingParams

    def status(key):
        with open("/proc/self/status") as f:
            return next(int(line.split()[1]) * 1024 for line in f if line.startswith(key + ":"))

    model, pool = sys.argv[1], int(sys.argv[2])
    llm = LLM(model=model, dtype="float32", kv_cache_memory=str(pool), max_model_len=1024,
              max_num_seqs=32, max_num_batched_tokens=512, enable_prefix_caching=False)
    llm.generate([[5] * 60] * 2, SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # the peak (VmHWM) starts again from here
    base = status("VmRSS")
    # 32 requests of 250 tokens each (16 KiB of KV per token): most of the pool holds decoding
    # context at the end.
    prompts = [[(7 * i + j) % 200 + 3 for j in range(64)] for i in range(32)]
    llm.generate(prompts, SamplingParams(temperature=0, max_tokens=186, ignore_eos=True))
    core = llm.engine.core
    print(json.dumps({"extra": status("VmHWM") - base, "pool": core.config.cache_config.num_blocks
                      * core.executor.kv_bytes_per_block(), "backend": core.executor.runner.attention_backend.name}))
""")


def test_decoding_a_full_pool_needs_under_half_the_pool_again(checkpoint_factory):
    model = checkpoint_factory("LlamaForCausalLM", hidden_size=256, intermediate_size=512, num_hidden_layers=8,
                               num_attention_heads=4, num_key_value_heads=4)
    done = subprocess.run([sys.executable, "-c", SCRIPT, model, str(POOL_BYTES)], capture_output=True,
                          text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(done.stdout.strip().splitlines()[-1])
    assert result["pool"] > POOL_BYTES * 0.9
    assert result["extra"] < result["pool"] / 2, result
