"""LLM programs on the in-process engine: gen equal to plain chat calls, select equal to an argmax
over HF's normalized log-likelihoods, forks equal to independent requests with the prefix computed
once, constraints that hold, errors that raise in the program, and run_batch."""

from __future__ import annotations

import json
import re

import pytest
from hf_reference import hf_model_and_tokenizer, hf_prompt_logprobs
from lang_helpers import BLOCK_SIZE, cached_after, make_llm

import kvtide.lang as kl
from kvtide import SamplingParams

SYSTEM = "You are a planner."
QUESTION = "Three steps to learn Rust."
MAX_TOKENS = 8


@pytest.fixture(scope="module")
def llm(llama_dir):
    llm = make_llm(llama_dir)
    yield llm
    llm.shutdown()


@pytest.fixture(scope="module")
def backend(llm):
    return kl.Engine(llm)


def greedy(**kwargs) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True, **kwargs)


def assert_engine_idle(llm) -> None:
    """No request left running or waiting and no KV block held: every call's blocks went back."""
    stats = llm.engine.core.get_stats()
    assert (stats.num_running, stats.num_waiting, stats.num_used_blocks) == (0, 0, 0)
    llm.engine.core.check_integrity()


def tokens_computed(llm) -> int:
    return llm.engine.core.get_stats().iteration_tokens["sum"]


def common_prefix(a: list[int], b: list[int]) -> int:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


@kl.function
def two_turns(s, question):
    s += kl.system(SYSTEM)
    s += kl.user(question)
    s += kl.assistant(kl.gen("first", max_tokens=MAX_TOKENS, ignore_eos=True))
    s += kl.user("And then?")
    s += kl.assistant(kl.gen("second", max_tokens=MAX_TOKENS, ignore_eos=True))


def test_greedy_gen_equals_chat_calls_and_continues_from_the_cached_prefix(llm, backend):
    llm.reset_prefix_cache()
    state = two_turns.run(QUESTION, backend=backend)

    messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": QUESTION}]
    first = llm.chat(messages, greedy())[0]
    assert state["first"] == first.outputs[0].text
    messages += [{"role": "assistant", "content": state["first"]}, {"role": "user", "content": "And then?"}]
    second = llm.chat(messages, greedy())[0]
    assert state["second"] == second.outputs[0].text
    assert state.messages() == [*messages, {"role": "assistant", "content": state["second"]}]
    assert state.text() == llm.get_tokenizer().apply_chat_template(state.messages(), tokenize=False)

    meta1, meta2 = state.get_meta_info("first"), state.get_meta_info("second")
    assert meta1["cached_tokens"] == 0  # a cold cache
    assert meta1["prompt_tokens"] == len(first.prompt_token_ids)
    assert meta2["prompt_tokens"] == len(second.prompt_token_ids)
    # The first call computed KV for its prompt and all but its last generated token; the second
    # call's prompt shares a prefix with those tokens, and the cache serves its full blocks.
    computed = (first.prompt_token_ids + first.outputs[0].token_ids)[:-1]
    shared = common_prefix(computed, second.prompt_token_ids)
    assert shared >= len(first.prompt_token_ids)
    assert meta2["cached_tokens"] == min(shared, len(second.prompt_token_ids) - 1) // BLOCK_SIZE * BLOCK_SIZE
    assert meta2["cached_tokens"] >= 4 * BLOCK_SIZE


COLORS = ["red", "green", "blue", "ultraviolet", "an orange"]


@kl.function
def pick(s, question, choices):
    s += kl.user(question)
    s += kl.assistant(kl.select("answer", choices=choices))
    s += kl.user("Why?")


def hf_normalized_logprobs(model_dir: str, prefix: str, choices: list[str]) -> list[float]:
    """Mean logprob of each choice's tokens after `prefix`, from HF transformers in float32."""
    _, tokenizer = hf_model_and_tokenizer(model_dir)
    prefix_ids = tokenizer.encode(prefix, add_special_tokens=False)
    scores = []
    for choice in choices:
        ids = tokenizer.encode(prefix + choice, add_special_tokens=False)
        assert ids[:len(prefix_ids)] == prefix_ids
        logprobs = hf_prompt_logprobs(model_dir, ids)  # row j predicts token j + 1
        token_logprobs = [logprobs[j - 1, ids[j]].item() for j in range(len(prefix_ids), len(ids))]
        scores.append(sum(token_logprobs) / len(token_logprobs))
    return scores


@pytest.mark.parametrize("question", ["What is your favourite color?", "Name a color of the sky at dusk"])
def test_select_is_the_argmax_of_hf_normalized_logprobs(llama_dir, llm, backend, question):
    state = pick.run(question, COLORS, backend=backend)
    prefix = llm.get_tokenizer().apply_chat_template([{"role": "user", "content": question}], tokenize=False,
                                                      add_generation_prompt=True)
    expected = hf_normalized_logprobs(llama_dir, prefix, COLORS)
    meta = state.get_meta_info("answer")
    assert meta["normalized_prompt_logprobs"] == pytest.approx(expected, abs=1e-4)
    assert [len(lps) for lps in meta["input_token_logprobs"]] == [len(c) for c in COLORS]  # one byte a token
    assert state["answer"] == COLORS[max(range(len(COLORS)), key=expected.__getitem__)]
    # Scored over the cached prompt: each choice request took the prompt's full blocks from the cache.
    num_prompt_tokens = len(llm.get_tokenizer().encode(prefix, add_special_tokens=False))
    assert meta["cached_tokens"] == [cached_after(num_prompt_tokens + 1)] * len(COLORS)
    assert state.messages()[1] == {"role": "assistant", "content": state["answer"]}
    assert state.text().startswith(prefix + state["answer"] + "\n<|user|>Why?")


@kl.function
def branches(s, temperature, seed):
    s += kl.system(SYSTEM)
    s += kl.user(QUESTION)
    forks = s.fork(3)
    for i, f in enumerate(forks):
        f += kl.assistant(kl.gen(f"step{i}", max_tokens=MAX_TOKENS, ignore_eos=True, temperature=temperature,
                                 seed=None if seed is None else seed + i))
    s += kl.user("Which step is hardest?")


def test_greedy_forks_are_equal_and_compute_the_prefix_once(llm, backend):
    llm.reset_prefix_cache()
    state = branches.run(0.0, None, backend=backend)
    steps = [state[f"step{i}"] for i in range(3)]  # the forks' variables, read from the parent
    reference = llm.chat([{"role": "system", "content": SYSTEM}, {"role": "user", "content": QUESTION}],
                         greedy())[0]
    assert steps == [reference.outputs[0].text] * 3
    metas = [state.get_meta_info(f"step{i}") for i in range(3)]
    prompt_tokens = len(reference.prompt_token_ids)
    assert [m["prompt_tokens"] for m in metas] == [prompt_tokens] * 3
    # The first fork computes the shared prompt; the others take its full blocks from the cache.
    assert [m["cached_tokens"] for m in metas] == [0, cached_after(prompt_tokens), cached_after(prompt_tokens)]
    assert cached_after(prompt_tokens) >= 3 * BLOCK_SIZE
    # The parent went on from the text before the fork.
    assert state.text().endswith(f"<|user|>{QUESTION}\n<|user|>Which step is hardest?\n")


def test_seeded_forks_differ_and_equal_independent_seeded_requests(llm, backend):
    state = branches.run(1.0, 11, backend=backend)
    steps = [state[f"step{i}"] for i in range(3)]
    assert len(set(steps)) == 3
    messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": QUESTION}]
    for i in range(3):
        sampled = llm.chat(messages, SamplingParams(temperature=1.0, seed=11 + i, max_tokens=MAX_TOKENS,
                                                    ignore_eos=True))[0]
        assert steps[i] == sampled.outputs[0].text
    assert [branches.run(1.0, 11, backend=backend)[f"step{i}"] for i in range(3)] == steps


def test_fork_group_gen_is_one_request_of_n(llm, backend):
    @kl.function
    def grouped(s):
        s += kl.user(QUESTION)
        forks = s.fork(3)
        forks += kl.assistant(kl.gen("idea", max_tokens=MAX_TOKENS, ignore_eos=True, temperature=1.0, seed=5))
        s += kl.user("Pick one.")
        forks.join()

    llm.reset_prefix_cache()
    before = tokens_computed(llm)
    state = grouped.run(backend=backend)
    computed = tokens_computed(llm) - before
    reference = llm.chat([{"role": "user", "content": QUESTION}],
                         SamplingParams(n=3, temperature=1.0, seed=5, max_tokens=MAX_TOKENS, ignore_eos=True))[0]
    ideas = [c.text for c in sorted(reference.outputs, key=lambda c: c.index)]
    assert state["idea"] == ideas  # joined: the forks' values in fork order
    assert len(set(ideas)) == 3
    # The prompt was computed once (the engine forked its blocks), then each fork decoded.
    prompt_tokens = len(reference.prompt_token_ids)
    assert prompt_tokens <= computed <= prompt_tokens + 3 * MAX_TOKENS < 2 * prompt_tokens
    assert state.messages()[-1] == {"role": "user", "content": "Pick one."}


@kl.function
def constrained(s, regex):
    s += kl.user("Give a code, a verdict and a record.")
    s += kl.assistant(kl.gen("code", max_tokens=16, regex=regex))
    s += kl.user("Verdict?")
    s += kl.assistant(kl.gen("verdict", max_tokens=16, choices=["yes", "no", "maybe"]))
    s += kl.user("Record?")
    s += kl.assistant(kl.gen("record", max_tokens=64, json_schema={
        "type": "object", "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 99}},
        "required": ["n"], "additionalProperties": False}))


def test_constraints_hold(backend):
    state = constrained.run(r"[0-9]{3}-[a-z]{2}", backend=backend)
    assert re.fullmatch(r"[0-9]{3}-[a-z]{2}", state["code"])
    assert state["verdict"] in ("yes", "no", "maybe")
    record = json.loads(state["record"])
    assert set(record) == {"n"} and 0 <= record["n"] <= 99


def test_a_failing_call_raises_in_the_program(llm, backend):
    reached = []

    @kl.function
    def careful(s):
        s += kl.user("Hi")
        try:
            s += kl.assistant(kl.gen("bad", regex="([a-z"))
        except ValueError as e:
            reached.append(str(e))
        s += kl.assistant(kl.gen("good", max_tokens=4, ignore_eos=True))

    state = careful.run(backend=backend)
    assert reached and "regex" in reached[0].lower()
    assert "bad" not in state and len(state.get_meta_info("good")["token_ids"]) == 4
    with pytest.raises(ValueError):
        constrained.run("([a-z", backend=backend)
    assert_engine_idle(llm)


def test_run_batch_keeps_order_and_errors_per_program(llm, backend):
    regexes = [r"[0-9]{3}-[a-z]{2}", r"[a-c]{4}", r"(x|y)+z", "([a-z", r"[0-9]{2}", r"ab?c", r"q{3}", r"[A-Z]{2}"]
    states = constrained.run_batch([{"regex": r} for r in regexes], backend=backend, num_threads=4,
                                   progress_bar=True)
    assert len(states) == 8
    assert isinstance(states[3].error, ValueError) and "code" not in states[3]
    for regex, state in zip(regexes, states, strict=True):
        if state is states[3]:
            continue
        assert state.error is None
        assert re.fullmatch(regex, state["code"])
        assert state.text() == constrained.run(regex, backend=backend).text()  # as if run alone
    assert_engine_idle(llm)


def test_a_gen_cut_by_a_stop_string_is_continued_from_its_text(llm, backend):
    @kl.function
    def stopped(s):
        s += kl.user("Two lines.")
        s += kl.assistant(kl.gen("line", max_tokens=16, regex="abc\ndef", stop="\n"))
        s += kl.user("More?")
        s += kl.assistant(kl.gen("more", max_tokens=2, ignore_eos=True))

    state = stopped.run(backend=backend)
    meta = state.get_meta_info("line")
    assert state["line"] == "abc" and meta["stop_reason"] == "\n"
    assert meta["token_ids"][:4] == llm.get_tokenizer().encode("abc\n", add_special_tokens=False)
    # The next prompt is the text ("abc", then the template's closing), not the tokens generated.
    before_more = "<s><|user|>Two lines.\n<|assistant|>abc\n<|user|>More?\n<|assistant|>"
    assert state.text() == before_more + state["more"] + "\n"
    assert state.get_meta_info("more")["prompt_tokens"] == len(
        llm.get_tokenizer().encode(before_more, add_special_tokens=False))
