"""Data-parallel replicas each run their own connector: every replica writes the prompts it
computes through to Redis, where a separate instance finds them."""

from __future__ import annotations

import json
import os
import random
import signal
import time

import httpx
import pytest
from serve_helpers import MODEL_NAME, pid_alive, start_server, wait_idle, wait_ready


def test_each_replica_writes_through_to_redis(llama_dir, redis_url):
    import redis

    client = redis.Redis.from_url(redis_url)
    client.flushdb()
    config = ["--kv-transfer-config", json.dumps({"kv_connector": "redis", "redis_url": redis_url})]
    rng = random.Random(3)
    prompts = ["".join(rng.choice("abcdefghij ") for _ in range(300)) for _ in range(4)]
    dp = wait_ready(start_server(llama_dir, "--data-parallel-size", "2", "--kv-cache-memory", "4MiB",
                                 "--max-num-seqs", "8", *config, api_key=None))
    try:
        with httpx.Client(timeout=60.0) as http:
            for prompt in prompts:
                r = http.post(dp.url("/v1/completions"),
                              json={"model": MODEL_NAME, "prompt": prompt, "max_tokens": 2, "temperature": 0.0})
                assert r.status_code == 200, r.text
        stats = wait_idle(dp)
        assert len(stats["engine_core_pids"]) == 2
        deadline = time.monotonic() + 30
        while dp.stats()["kv_connector"]["saved_blocks"].get("redis", 0) < 4 * 18 and time.monotonic() < deadline:
            time.sleep(0.2)
        # 300 prompt tokens: 18 full blocks each, written by whichever replica computed it.
        assert dp.stats()["kv_connector"]["saved_blocks"]["redis"] == 4 * 18
        served = httpx.get(dp.url("/metrics")).text
        assert 'kvtide:kv_connector_saved_blocks_total{model_name="tiny-llama",tier="redis"} 72.0' in served
    finally:
        dp.stop()
        for pid in getattr(dp, "engine_pids", []):
            if pid_alive(pid):
                os.kill(pid, signal.SIGKILL)
    single = wait_ready(start_server(llama_dir, "--kv-cache-memory", "4MiB", *config, api_key=None))
    try:
        for prompt in prompts:
            r = httpx.post(single.url("/v1/completions"), timeout=60.0,
                           json={"model": MODEL_NAME, "prompt": prompt, "max_tokens": 2, "temperature": 0.0})
            assert r.json()["usage"]["prompt_tokens_details"]["cached_tokens"] == 288
        assert single.stats()["kv_connector"]["hit_tokens"] == {"redis": 4 * 288}
    finally:
        single.stop()


def test_dp_with_a_fixed_p2p_port_is_refused(llama_dir):
    from kvtide.engine_args import EngineArgs

    args = EngineArgs(model=llama_dir, data_parallel_size=2,
                      kv_transfer_config={"kv_connector": "p2p", "kv_role": "kv_producer", "kv_port": 15000,
                                          "kv_secret": "s"})
    with pytest.raises(ValueError, match="kv_port at 0"):
        args.create_engine_config(args.resolve_model_dir())
