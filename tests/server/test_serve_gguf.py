"""`kvtide serve FILE.gguf`: the server loads a GGUF checkpoint as the offline engine does, with the
file's tokenizer and chat template."""

from __future__ import annotations

import pytest
from gguf import GGUFReader
from gguf_writer import build_bpe_checkpoint, write_gguf
from serve_helpers import launch_server

from kvtide import LLM, SamplingParams

MESSAGES = [{"role": "user", "content": "Hello 🙂, what is a KV cache?"}]


@pytest.fixture(scope="module")
def gguf_file(tmp_path_factory) -> str:
    ckpt = build_bpe_checkpoint(str(tmp_path_factory.mktemp("bpe")), intermediate_size=384)
    return write_gguf(ckpt, str(tmp_path_factory.mktemp("gguf") / "tiny.Q8_0.gguf"), "Q8_0")


def test_served_gguf_answers_as_the_offline_engine(gguf_file, fresh_kvtide_cache, monkeypatch):
    monkeypatch.setenv("KVTIDE_CACHE", fresh_kvtide_cache)
    offline = LLM(model=gguf_file, max_model_len=512, kv_cache_memory="8MiB")
    expected = offline.chat(MESSAGES, SamplingParams(temperature=0, max_tokens=12, ignore_eos=True))[0]
    server = launch_server(gguf_file, "--max-model-len", "512")
    try:
        with server.client() as client:
            body = client.post("/v1/chat/completions", json={
                "model": "tiny-llama", "messages": MESSAGES, "temperature": 0, "max_tokens": 12,
                "ignore_eos": True}).json()
            assert body["choices"][0]["message"]["content"] == expected.outputs[0].text
            assert body["usage"]["prompt_tokens"] == len(expected.prompt_token_ids)
            # The startup memory budget on /metrics: the file's blocks as stored, the weights as held.
            memory = {line.split('"')[1]: float(line.rsplit(" ", 1)[1])
                      for line in client.get("/metrics").text.splitlines()
                      if line.startswith("kvtide:memory_bytes{")}
            assert set(memory) == {"weights_stored", "weights_held", "packed_copies", "kv_pool", "runtime", "resident"}
            assert memory["weights_stored"] == sum(int(t.n_bytes) for t in GGUFReader(gguf_file).tensors)
            assert memory["weights_held"] == offline.engine.core.memory["weights_held"], memory
            assert "memory: weights " in server.log()  # the startup line, in the server's log
    finally:
        server.stop()
