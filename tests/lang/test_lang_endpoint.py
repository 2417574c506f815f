"""The same programs on a kvtide server (`kl.Endpoint`, over its OpenAI API) as in-process
(`kl.Engine`): the same text, variables and select scores, the server's prefix cache serving the
state's prefix, constrained output, and the server's refusals raising in the program."""

from __future__ import annotations

import re

import pytest
from lang_helpers import BLOCK_SIZE, make_llm
from serve_helpers import API_KEY, pid_alive, start_server, wait_idle, wait_ready

import kvtide.lang as kl

COLORS = ["red", "green", "blue", "ultraviolet"]


@pytest.fixture(scope="module")
def server_and_engine(llama_dir):
    """A tiny-model server on a free port (always stopped, its engine core gone) and the same model
    in-process, loaded while the server starts."""
    handle = start_server(llama_dir, "--max-num-seqs", "8", "--dtype", "float32", "--block-size", str(BLOCK_SIZE))
    llm = None
    try:
        llm = make_llm(llama_dir)
        wait_ready(handle)
        yield handle, kl.Engine(llm)
    finally:
        if llm is not None:
            llm.shutdown()
        code = handle.stop()
        assert code == 0, handle.log()[-3000:]
        assert handle.engine_pid is not None and not pid_alive(handle.engine_pid)


@pytest.fixture(scope="module")
def server(server_and_engine):
    return server_and_engine[0]


@pytest.fixture(scope="module")
def engine(server_and_engine):
    return server_and_engine[1]


@pytest.fixture(scope="module")
def endpoint(server):
    backend = kl.Endpoint(server.base_url, api_key=API_KEY)
    yield backend
    backend.close()


@kl.function
def interview(s, topic):
    s += kl.system("You are terse.")
    s += kl.user(f"Say something about {topic}.")
    s += kl.assistant(kl.gen("remark", max_tokens=8, ignore_eos=True))
    s += kl.user("Pick a color.")
    s += kl.assistant(kl.select("color", choices=COLORS))
    forks = s.fork(2)
    for i, f in enumerate(forks):
        f += kl.user(f"Idea {i}?")
        f += kl.assistant(kl.gen(f"idea{i}", max_tokens=6, ignore_eos=True))
    group = s.fork(2)  # one request of two seeded samples (n=2)
    group += kl.assistant(kl.gen("twist", max_tokens=6, ignore_eos=True, temperature=1.0, seed=3))
    group.join()
    s += kl.user("Once more?")
    s += kl.assistant(kl.gen("coda", max_tokens=6, ignore_eos=True))


def test_endpoint_runs_a_program_as_the_engine_does(endpoint, engine):
    engine.llm.reset_prefix_cache()
    local = interview.run("tides", backend=engine)
    remote = interview.run("tides", backend=endpoint)
    assert remote.text() == local.text()
    assert remote.messages() == local.messages()
    assert remote.variables() == local.variables()
    assert len(remote["twist"]) == 2 and remote["twist"][0] != remote["twist"][1]
    remote_select, local_select = remote.get_meta_info("color"), local.get_meta_info("color")
    assert remote_select["normalized_prompt_logprobs"] == pytest.approx(local_select["normalized_prompt_logprobs"],
                                                                        abs=1e-4)
    assert remote_select["choice_token_ids"] == local_select["choice_token_ids"]
    # Both scored the choices over the cached prompt (kvtide's /v1/lang/score on the server).
    assert remote_select["prompt_tokens"] == local_select["prompt_tokens"]
    assert remote_select["cached_tokens"] == local_select["cached_tokens"]
    assert min(remote_select["cached_tokens"]) >= 4 * BLOCK_SIZE
    # The server's prefix cache served what the program's earlier calls computed, as the engine's did.
    for name in ("idea0", "idea1", "coda"):
        remote_meta, local_meta = remote.get_meta_info(name), local.get_meta_info(name)
        assert remote_meta["prompt_tokens"] == local_meta["prompt_tokens"]
        assert remote_meta["cached_tokens"] == local_meta["cached_tokens"] >= 4 * BLOCK_SIZE


def test_score_extension_equals_scoring_by_completions_prompt_logprobs(endpoint, server):
    prompt = kl.ProgramState(endpoint)
    prompt += kl.user("Pick a color.")
    prompt += "<|assistant|>"
    extension = endpoint.score(prompt.prompt(), COLORS)
    completions = endpoint._score_by_completions(prompt.prompt(), COLORS)  # a server without the extension
    assert extension.meta["choice_token_ids"] == completions.meta["choice_token_ids"]
    for ours, theirs in zip(extension.token_logprobs, completions.token_logprobs, strict=True):
        assert ours == pytest.approx(theirs, abs=1e-4)
    response = server.client().post("/v1/lang/score", json={"prompt": "x", "choices": []})
    assert response.status_code == 400 and response.json()["error"]["param"] == "choices"


def test_a_refused_call_raises_in_the_program_and_run_batch_keeps_going(endpoint, server):
    @kl.function
    def coded(s, regex):
        s += kl.user("Code?")
        s += kl.assistant(kl.gen("code", max_tokens=8, regex=regex))

    with pytest.raises(ValueError, match="regex"):
        coded.run("([a-z", backend=endpoint)
    regexes = [r"[0-9]{3}", "([a-z", r"(ab)+", r"[xyz]{2}"]
    states = coded.run_batch([{"regex": r} for r in regexes], backend=endpoint, num_threads=4)
    assert isinstance(states[1].error, ValueError) and "code" not in states[1]
    for regex, state in zip(regexes, states, strict=True):
        if state is not states[1]:
            assert state.error is None and re.fullmatch(regex, state["code"])
    # Every call's KV blocks went back (the refused ones never took any).
    assert wait_idle(server)["num_used_blocks"] == 0
    assert server.client().post("/internal/check_integrity").json() == {"ok": True}
