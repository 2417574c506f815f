"""`kvtide serve --enable-lora` with the official openai client: adapters by `model`, /v1/models,
runtime load/unload under concurrent streaming traffic, host-cache eviction, and the 404/400s."""

from __future__ import annotations

import asyncio
import os

import httpx
import openai
import pytest
from hf_reference import hf_greedy
from serve_helpers import MODEL_NAME, start_server, wait_ready

MAX_TOKENS = 8
PROMPTS = ["The cache holds blocks of keys", "Seven quantum lattices", "Hello"]


@pytest.fixture(scope="module")
def servers(lora_case_factory):
    """A server that may update adapters at run time (who may not: test_lora_routes.py)."""
    case = lora_case_factory("LlamaForCausalLM")
    handle = wait_ready(start_server(case.base_dir, "--enable-lora", "--max-lora-rank", "16", "--kv-cache-memory", "32MiB",
                           "--lora-modules", f"attn={case.adapter_dirs['attn-r8']}", "--max-loras", "2",
                           "--max-cpu-loras", "2", api_key=None,
                                     env={"VLLM_ALLOW_RUNTIME_LORA_UPDATING": "True"}))
    try:
        yield case, handle
    finally:
        handle.stop()
        os.unlink(handle.log_path)


def client(handle) -> openai.OpenAI:
    return openai.OpenAI(base_url=handle.url("/v1"), api_key="none", max_retries=0)


def complete(handle, model: str, prompt: str) -> str:
    out = client(handle).completions.create(model=model, prompt=prompt, max_tokens=MAX_TOKENS, temperature=0,
                                            extra_body={"ignore_eos": True})
    assert out.model == model
    return out.choices[0].text


def reference(case, name: str | None, prompt: str) -> str:
    return hf_greedy(case.merged_dirs[name] if name else case.base_dir, prompt, MAX_TOKENS).text


def test_models_list_adapters_with_their_parent(servers):
    case, handle = servers
    models = {m.id: m for m in client(handle).models.list().data}
    assert set(models) >= {MODEL_NAME, "attn"}
    assert models["attn"].model_extra["parent"] == MODEL_NAME
    assert models[MODEL_NAME].model_extra["parent"] is None


def test_requests_pick_their_adapter_by_model(servers):
    case, handle = servers
    for prompt in PROMPTS[:2]:
        assert complete(handle, "attn", prompt) == reference(case, "attn-r8", prompt)
        assert complete(handle, MODEL_NAME, prompt) == reference(case, None, prompt)
    chat = client(handle).chat.completions.create(model="attn", messages=[{"role": "user", "content": "Hi"}],
                                                  max_tokens=4)
    assert chat.model == "attn" and chat.choices[0].message.content is not None
    with pytest.raises(openai.NotFoundError, match="does not exist"):
        complete(handle, "no-such-adapter", "Hello")


def post(handle, path: str, body: dict) -> httpx.Response:
    return httpx.post(handle.url(path), json=body, timeout=60.0)


def test_load_use_unload_reuse_under_streaming_traffic(servers):
    case, handle = servers

    async def stream(model: str, prompt: str) -> str:
        aclient = openai.AsyncOpenAI(base_url=handle.url("/v1"), api_key="none", max_retries=0)
        parts = []
        async for chunk in await aclient.completions.create(model=model, prompt=prompt, max_tokens=MAX_TOKENS,
                                                            temperature=0, stream=True,
                                                            extra_body={"ignore_eos": True}):
            parts.append(chunk.choices[0].text if chunk.choices else "")
        await aclient.close()
        return "".join(parts)

    async def traffic_while(update) -> list[str]:
        jobs = [stream(m, p) for m, p in (("attn", PROMPTS[0]), (MODEL_NAME, PROMPTS[1]), ("attn", PROMPTS[2]))]
        *texts, _ = await asyncio.gather(*jobs, asyncio.to_thread(update))
        return texts

    expected = [reference(case, "attn-r8", PROMPTS[0]), reference(case, None, PROMPTS[1]),
                reference(case, "attn-r8", PROMPTS[2])]
    loaded = {}
    texts = asyncio.run(traffic_while(lambda: loaded.setdefault("r", post(handle, "/v1/load_lora_adapter", {
        "lora_name": "mlp", "lora_path": case.adapter_dirs["mlp-r4"]}))))
    assert texts == expected
    assert loaded["r"].status_code == 200, loaded["r"].text
    assert any(m.id == "mlp" for m in client(handle).models.list().data)
    assert complete(handle, "mlp", PROMPTS[0]) == reference(case, "mlp-r4", PROMPTS[0])
    # A third adapter over two host slots: one is evicted from host memory, and reloads when used.
    assert post(handle, "/v1/load_lora_adapter", {"lora_name": "all", "lora_path": case.adapter_dirs[
        "all-r16-rslora"]}).status_code == 200
    assert complete(handle, "all", PROMPTS[1]) == reference(case, "all-r16-rslora", PROMPTS[1])
    assert complete(handle, "attn", PROMPTS[1]) == reference(case, "attn-r8", PROMPTS[1])
    assert complete(handle, "mlp", PROMPTS[1]) == reference(case, "mlp-r4", PROMPTS[1])

    unloaded = {}
    texts = asyncio.run(traffic_while(lambda: unloaded.setdefault("r", post(
        handle, "/v1/unload_lora_adapter", {"lora_name": "mlp"}))))
    assert texts == expected and unloaded["r"].status_code == 200
    with pytest.raises(openai.NotFoundError):
        complete(handle, "mlp", PROMPTS[0])
    assert post(handle, "/v1/load_lora_adapter", {"lora_name": "mlp", "lora_path": case.adapter_dirs[
        "mlp-r4"]}).status_code == 200
    assert complete(handle, "mlp", PROMPTS[2]) == reference(case, "mlp-r4", PROMPTS[2])


def test_bad_updates_are_refused(servers, tmp_path):
    case, handle = servers
    again = post(handle, "/v1/load_lora_adapter", {"lora_name": "attn", "lora_path": case.adapter_dirs["attn-r8"]})
    assert again.status_code == 400 and "already been loaded" in again.json()["error"]["message"]
    base_name = post(handle, "/v1/load_lora_adapter", {"lora_name": MODEL_NAME, "lora_path": case.adapter_dirs[
        "attn-r8"]})
    assert base_name.status_code == 400
    missing = post(handle, "/v1/load_lora_adapter", {"lora_name": "gone", "lora_path": str(tmp_path / "nowhere")})
    assert missing.status_code == 400 and "does not exist" in missing.json()["error"]["message"]
    with pytest.raises(openai.NotFoundError):
        complete(handle, "gone", "Hello")
    unknown = post(handle, "/v1/unload_lora_adapter", {"lora_name": "never-loaded"})
    assert unknown.status_code == 404 and unknown.json()["error"]["type"] == "not_found_error"
    assert post(handle, "/v1/load_lora_adapter", {"lora_name": "x"}).status_code == 400
    assert complete(handle, "attn", PROMPTS[0]) == reference(case, "attn-r8", PROMPTS[0])


def test_metrics_name_running_adapters_and_load_times(servers):
    case, handle = servers
    seen = None
    with httpx.stream("POST", handle.url("/v1/completions"), timeout=60.0, json={
            "model": "attn", "prompt": "Hello", "max_tokens": 1000, "temperature": 0, "ignore_eos": True,
            "stream": True}) as response:
        lines = response.iter_lines()
        next(lines)  # the request is running
        for _ in range(50):  # scrape until a report lands while it runs
            metrics = httpx.get(handle.url("/metrics"), timeout=30.0).text
            info = [line for line in metrics.splitlines() if line.startswith("kvtide:lora_requests_info{")]
            assert len(info) == 1 and 'max_lora="2"' in info[0]
            if 'running_lora_adapters="attn"' in info[0]:
                seen = metrics
                break
    assert seen is not None, "no report named the running adapter"
    assert f'kvtide:lora_adapter_requests{{lora_name="attn",model_name="{MODEL_NAME}",state="running"}} 1.0' in seen
    loads = next(line for line in seen.splitlines() if line.startswith("kvtide:lora_adapter_load_seconds_count"))
    assert float(loads.rsplit(" ", 1)[1]) >= 1
