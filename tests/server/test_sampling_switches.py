"""vLLM's smaller sampling switches at the HTTP edge: prompt_logprobs (equal to Hugging Face's
log-softmax over the prompt), echo (the prompt before the completion, with its logprobs), bad_words,
allowed_token_ids and truncate_prompt_tokens, and their bad values refused with 400."""

from __future__ import annotations

import functools
import json
import os
import shutil

import pytest
import torch
from serve_helpers import MODEL_NAME, start_server, wait_ready

PROMPT = "Once upon a time"
LOGPROB_TOL = 1e-4


@functools.cache
def hf_prompt_logprobs(model_dir: str, prompt_ids: tuple[int, ...]) -> torch.Tensor:
    """(P - 1, vocab) float32 log-softmax of HF's logits: row j predicts prompt token j + 1."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    with torch.inference_mode():
        return model(torch.tensor([prompt_ids])).logits[0, :-1].float().log_softmax(dim=-1)


def tokenize(client, **body) -> list[int]:
    r = client.post("/tokenize", json={"model": MODEL_NAME, **body})
    assert r.status_code == 200, r.text
    return r.json()["tokens"]


def completion(client, **body) -> dict:
    r = client.post("/v1/completions", json={"model": MODEL_NAME, "prompt": PROMPT, "max_tokens": 6,
                                             "temperature": 0, "ignore_eos": True, **body})
    assert r.status_code == 200, r.text
    return r.json()


def assert_matches_hf(entries: list, prompt_ids: list[int], reference: torch.Tensor, k: int) -> None:
    """vLLM's shape: None first, then per position {token id: {logprob, rank, decoded_token}} with the
    prompt's token and the top k, each logprob within LOGPROB_TOL of HF's and ranked as HF ranks it."""
    assert len(entries) == len(prompt_ids) and entries[0] is None
    for j, entry in enumerate(entries[1:]):
        row = reference[j]
        token = prompt_ids[j + 1]
        expected_ids = {token, *row.topk(k).indices.tolist()} if k else {token}
        assert {int(t) for t in entry} == expected_ids, f"position {j + 1}"
        for token_id, logprob in entry.items():
            assert logprob["logprob"] == pytest.approx(row[int(token_id)].item(), abs=LOGPROB_TOL)
            assert logprob["rank"] == int((row > row[int(token_id)]).sum()) + 1
            assert isinstance(logprob["decoded_token"], str)


def test_prompt_logprobs_on_completions_equal_hf(server, llama_dir):
    with server.client() as c:
        body = completion(c, prompt_logprobs=3)
        prompt_ids = tokenize(c, prompt=PROMPT)
        assert body["usage"]["prompt_tokens"] == len(prompt_ids)
        assert_matches_hf(body["choices"][0]["prompt_logprobs"], prompt_ids,
                          hf_prompt_logprobs(llama_dir, tuple(prompt_ids)), 3)
        assert "prompt_logprobs" not in completion(c)["choices"][0]  # only when asked


def test_prompt_logprobs_on_chat_equal_hf(server, llama_dir):
    messages = [{"role": "user", "content": "Name a colour."}]
    with server.client() as c:
        r = c.post("/v1/chat/completions", json={"model": MODEL_NAME, "messages": messages, "max_tokens": 3,
                                                 "temperature": 0, "prompt_logprobs": 0})
        assert r.status_code == 200, r.text
        prompt_ids = tokenize(c, messages=messages)
        assert_matches_hf(r.json()["prompt_logprobs"], prompt_ids,
                          hf_prompt_logprobs(llama_dir, tuple(prompt_ids)), 0)
        streamed = c.post("/v1/chat/completions", json={"model": MODEL_NAME, "messages": messages, "stream": True,
                                                        "prompt_logprobs": 1})
        assert streamed.status_code == 400 and streamed.json()["error"]["param"] == "prompt_logprobs"


def test_echo_text_is_prompt_then_completion(server):
    with server.client() as c:
        plain = completion(c)["choices"][0]["text"]
        echoed = completion(c, echo=True)["choices"][0]["text"]
        assert echoed == PROMPT + plain
        ids = tokenize(c, prompt=PROMPT)
        by_ids = completion(c, prompt=ids, echo=True)["choices"][0]["text"]
        decoded = c.post("/detokenize", json={"model": MODEL_NAME, "tokens": ids}).json()["prompt"]
        assert by_ids == decoded + plain
        with c.stream("POST", "/v1/completions", json={"model": MODEL_NAME, "prompt": PROMPT, "max_tokens": 6,
                                                       "temperature": 0, "ignore_eos": True, "echo": True,
                                                       "stream": True}) as r:
            assert r.status_code == 200
            chunks = [json.loads(line[6:]) for line in r.iter_lines()
                      if line.startswith("data: ") and line != "data: [DONE]"]
        assert "".join(ch["choices"][0]["text"] for ch in chunks if ch["choices"]) == PROMPT + plain


def test_echo_with_logprobs_leads_with_the_prompts_logprobs(server, llama_dir):
    with server.client() as c:
        plain = completion(c, logprobs=2)["choices"][0]
        echoed = completion(c, logprobs=2, echo=True)["choices"][0]
        prompt_ids = tokenize(c, prompt=PROMPT)
    reference = hf_prompt_logprobs(llama_dir, tuple(prompt_ids))
    lp, num_prompt = echoed["logprobs"], len(prompt_ids)
    assert len(lp["tokens"]) == num_prompt + len(plain["logprobs"]["tokens"])
    assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
    for j in range(1, num_prompt):
        assert lp["token_logprobs"][j] == pytest.approx(reference[j - 1, prompt_ids[j]].item(), abs=LOGPROB_TOL)
        assert len(lp["top_logprobs"][j]) <= 2
    assert lp["tokens"][num_prompt:] == plain["logprobs"]["tokens"]
    assert lp["token_logprobs"][num_prompt:] == pytest.approx(plain["logprobs"]["token_logprobs"], abs=1e-5)
    assert lp["text_offset"][0] == 0 and lp["text_offset"] == sorted(lp["text_offset"])
    assert "prompt_logprobs" not in echoed  # echo's logprobs are the legacy ones, not vLLM's field


def test_bad_words_allowed_token_ids_and_truncation(server):
    with server.client() as c:
        greedy = completion(c, max_tokens=16)["choices"][0]["text"]
        word = next(greedy[i:i + 2] for i in range(len(greedy) - 1)
                    if greedy[i:i + 2].isascii() and greedy[i:i + 2].isalnum())
        banned = completion(c, max_tokens=16, bad_words=[word])["choices"][0]["text"]
        assert word in greedy and word not in banned
        allowed = tokenize(c, prompt="abc", add_special_tokens=False)
        body = completion(c, temperature=1.0, n=8, max_tokens=8, allowed_token_ids=allowed, logprobs=0)
        for choice in body["choices"]:
            assert set(choice["logprobs"]["tokens"]) <= {"a", "b", "c"}
        ids = tokenize(c, prompt=PROMPT)
        cut = completion(c, truncate_prompt_tokens=4)
        assert cut["usage"]["prompt_tokens"] == 4
        assert cut["choices"][0]["text"] == completion(c, prompt=ids[-4:])["choices"][0]["text"]
        chat = c.post("/v1/chat/completions", json={"model": MODEL_NAME, "max_tokens": 2, "truncate_prompt_tokens": 5,
                                                    "messages": [{"role": "user", "content": "hello there"}]})
        assert chat.status_code == 200 and chat.json()["usage"]["prompt_tokens"] == 5


@pytest.mark.parametrize("extra, param", [
    ({"allowed_token_ids": [10**6]}, "allowed_token_ids"),
    ({"allowed_token_ids": []}, "allowed_token_ids"),
    ({"allowed_token_ids": [-1]}, "allowed_token_ids"),
    ({"truncate_prompt_tokens": -2}, "truncate_prompt_tokens"),
    ({"truncate_prompt_tokens": 0}, "truncate_prompt_tokens"),
    ({"bad_words": "word"}, "bad_words"),
    ({"bad_words": [" "]}, "bad_words"),
    ({"bad_words": ["x"] * 65}, "bad_words"),
    ({"echo": True, "logprobs": 1, "stream": True}, "echo"),
])
def test_bad_values_are_400(server, extra, param):
    with server.client() as c:
        r = c.post("/v1/completions", json={"model": MODEL_NAME, "prompt": PROMPT, "max_tokens": 2, **extra})
        assert r.status_code == 400, r.text
        assert param in r.text


# ---- a server with logits processors and a model that samples greedily by default ----------------
@pytest.fixture(scope="module")
def plugin_server(llama_dir, tmp_path_factory):
    """The tiny Llama with generation_config.json setting top_k 1 (greedy unless a request says
    otherwise), served with the token-ban logits processor."""
    model = str(tmp_path_factory.mktemp("gen") / "model")
    shutil.copytree(llama_dir, model)
    with open(os.path.join(model, "generation_config.json")) as f:
        config = json.load(f)
    with open(os.path.join(model, "generation_config.json"), "w") as f:
        json.dump(dict(config, top_k=1, temperature=0.8), f)
    handle = wait_ready(start_server(model, "--max-num-seqs", "8", "--logits-processors",
                                     "kvtide.logits_processors.builtin:TokenBanLogitsProcessor"))
    try:
        yield handle
    finally:
        handle.stop()
        os.unlink(handle.log_path)


def test_unset_sampling_fields_take_the_models_defaults(plugin_server):
    assert "top_k=1" in plugin_server.log()  # the startup log names the defaults in force
    with plugin_server.client() as c:
        greedy = completion(c)["choices"][0]["text"]
        body = {"model": MODEL_NAME, "prompt": PROMPT, "max_tokens": 6, "ignore_eos": True, "n": 3}
        unset = c.post("/v1/completions", json=body).json()["choices"]
        assert [ch["text"] for ch in unset] == [greedy] * 3
        free = c.post("/v1/completions", json=dict(body, top_k=-1, temperature=1.0)).json()["choices"]
        assert len({ch["text"] for ch in free}) > 1
        messages = [{"role": "user", "content": "hi"}]
        chat = [c.post("/v1/chat/completions", json={"model": MODEL_NAME, "messages": messages, "max_tokens": 6,
                                                     **extra}).json()["choices"][0]["message"]["content"]
                for extra in ({}, {"temperature": 0})]
        assert chat[0] == chat[1]


def test_vllm_xargs_reach_the_logits_processor(plugin_server):
    with plugin_server.client() as c:
        plain = completion(c, logprobs=0, max_tokens=12)["choices"][0]["logprobs"]["tokens"]
        word = next(t for t in plain if len(t) == 1 and t.isascii() and t.isprintable())
        ids = tokenize(c, prompt=word, add_special_tokens=False)
        assert len(ids) == 1
        banned = completion(c, vllm_xargs={"banned_token_ids": ids}, max_tokens=12)["choices"][0]["text"]
        biased = completion(c, logit_bias={str(ids[0]): -100}, max_tokens=12)["choices"][0]["text"]
        assert banned == biased != "".join(plain)
        r = c.post("/v1/completions", json={"model": MODEL_NAME, "prompt": PROMPT, "max_tokens": 2,
                                            "vllm_xargs": {"banned_token_ids": "x"}})
        assert r.status_code == 400 and "banned_token_ids" in r.text
        r = c.post("/v1/chat/completions", json={"model": MODEL_NAME, "max_tokens": 4, "temperature": 0,
                                                 "messages": [{"role": "user", "content": "hi"}],
                                                 "vllm_xargs": {"banned_token_ids": ids}})
        assert r.status_code == 200
