"""Reasoning parsers on recorded outputs, and the streaming contract: however the text is cut into
chunks (tags split across them included), the deltas rebuild exactly the non-streamed split."""

from __future__ import annotations

import subprocess
import sys

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from text_splits import cut_at, splits

from kvtide.reasoning import REASONING_PARSERS, get_reasoning_parser

R1_OUTPUT = (
    "Okay, the user wants 17 * 24. Let me compute: 17 * 24 = 17 * 20 + 17 * 4 = 340 + 68 = 408.\n"
    "</think>\n\n**17 × 24 = 408**"
)
QWEN3_OUTPUT = (
    "<think>\nThe user greets me in French; I should answer in French.\n</think>\n\nBonjour ! Comment puis-je "
    "vous aider aujourd'hui ?"
)

# (parser, model output, expected reasoning, expected content)
RECORDED = [
    (
        "deepseek_r1",
        R1_OUTPUT,
        "Okay, the user wants 17 * 24. Let me compute: 17 * 24 = 17 * 20 + 17 * 4 = 340 + 68 = 408.",
        "**17 × 24 = 408**",
    ),
    ("deepseek_r1", "<think>\nHmm, 2 + 2.\n</think>\n\n4", "Hmm, 2 + 2.", "4"),
    (
        "deepseek_r1",
        "Still thinking about the proof; the induction step needs",
        "Still thinking about the proof; the induction step needs",
        None,
    ),
    ("deepseek_r1", "</think>\n\nJust the answer.", None, "Just the answer."),
    ("deepseek_r1", "<think>\n\n</think>\n\nHi!", None, "Hi!"),
    ("deepseek_r1", "a</think>b</think>c", "a", "b</think>c"),
    ("deepseek_r1", "", None, None),
    ("deepseek_r1", "<thi", "<thi", None),
    ("deepseek_r1", "Is x < y? Yes.</think>Yes, x < y.", "Is x < y? Yes.", "Yes, x < y."),
    (
        "qwen3",
        QWEN3_OUTPUT,
        "The user greets me in French; I should answer in French.",
        "Bonjour ! Comment puis-je vous aider aujourd'hui ?",
    ),
    (
        "qwen3",
        "<think>\n\n</think>\n\nParis is the capital of France.",
        None,
        "Paris is the capital of France.",
    ),
    (
        "qwen3",
        "<think>\nLet me count the r's in strawberry: s-t-r-a-w-b-e-r-r-y",
        "Let me count the r's in strawberry: s-t-r-a-w-b-e-r-r-y",
        None,
    ),
    ("qwen3", "Paris is the capital of France.\n", None, "Paris is the capital of France.\n"),
    ("qwen3", "\n\nHello", None, "\n\nHello"),
    ("qwen3", "Not thinking.</think> still content", None, "Not thinking.</think> still content"),
    ("qwen3", "  <think>思考中…</think>答案：四", "思考中…", "答案：四"),
    ("qwen3", "", None, None),
    ("qwen3", "<think", None, "<think"),
    ("qwen3", "<think>x</thin", "x</thin", None),
    (
        "openai_gptoss",
        "<|channel|>analysis<|message|>The user asks 2+2. Answer 4.<|end|><|start|>assistant<|channel|>final"
        "<|message|>2 + 2 = 4.",
        "The user asks 2+2. Answer 4.",
        "2 + 2 = 4.",
    ),
    (
        "openai_gptoss",
        "<|channel|>analysis<|message|>Need the weather.<|end|><|start|>assistant<|channel|>commentary "
        'to=functions.get_weather <|constrain|>json<|message|>{"city": "Paris"}<|call|>',
        "Need the weather.",
        '<|start|>assistant<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>'
        '{"city": "Paris"}<|call|>',
    ),
    ("openai_gptoss", "<|channel|>analysis<|message|>Still thinking", "Still thinking", None),
    ("openai_gptoss", "<|channel|>final<|message|>Hi!<|return|>", None, "Hi!"),
    ("openai_gptoss", "No harmony at all <|", None, "No harmony at all <|"),
    ("openai_gptoss", "<|channel|>final", None, "<|channel|>final"),
    ("openai_gptoss", "", None, None),
]


def _ids(case):
    return f"{case[0]}:{case[1][:30]!r}"


def stream(parser_name: str, chunks: list[str]) -> tuple[str, str]:
    state = get_reasoning_parser(parser_name)().streaming()
    parts = [state.feed(chunk) for chunk in chunks] + [state.finish()]
    for reasoning, content in parts:
        assert reasoning != "" and content != "", "empty delta instead of None"
    return "".join(r or "" for r, _ in parts), "".join(c or "" for _, c in parts)


def whole(parser_name: str, text: str) -> tuple[str, str]:
    reasoning, content = get_reasoning_parser(parser_name)().extract_reasoning(text)
    return reasoning or "", content or ""


@pytest.mark.parametrize("case", RECORDED, ids=_ids)
def test_recorded_outputs(case):
    parser_name, text, reasoning, content = case
    assert get_reasoning_parser(parser_name)().extract_reasoning(text) == (reasoning, content)


@pytest.mark.parametrize("case", RECORDED, ids=_ids)
def test_streaming_matches_whole_for_every_split(case):
    parser_name, text = case[0], case[1]
    expected = whole(parser_name, text)
    for label, chunks in splits(text, max_chunk=6):
        assert stream(parser_name, chunks) == expected, label


PIECES = ["<think>", "</think>", "<th", "ink>", "</", "think", ">", "<", " ", "\n", "a", "é", "x < y",
          "<|channel|>", "<|message|>", "<|start|>assistant", "<|end|>", "<|call|>", "analysis", "final",
          " to=functions.f", "<|", "|>"]


@settings(max_examples=200, deadline=None)
@given(
    parser_name=st.sampled_from(sorted(REASONING_PARSERS)),
    pieces=st.lists(st.sampled_from(PIECES), max_size=12),
    cuts=st.lists(st.integers(min_value=0, max_value=80), max_size=8),
)
def test_streaming_matches_whole_on_generated_text(parser_name, pieces, cuts):
    text = "".join(pieces)
    expected = whole(parser_name, text)
    assert stream(parser_name, cut_at(text, cuts)) == expected
    assert stream(parser_name, list(text)) == expected


def test_end_tag_split_across_chunks_is_held_then_decided():
    state = get_reasoning_parser("deepseek_r1")().streaming()
    assert state.feed("Two plus two is four.</th") == ("Two plus two is four.", None)
    assert state.feed("ink>\n\n4") == (None, "4")
    assert state.finish() == (None, None)


def test_start_tag_split_across_chunks():
    state = get_reasoning_parser("qwen3")().streaming()
    assert state.feed("<th") == (None, None)
    assert state.feed("ink>\nHm") == ("Hm", None)
    assert state.feed("m.\n</think>\n\nDone.") == ("m.", "Done.")


def test_a_tag_look_alike_is_released_when_the_next_chunk_rules_it_out():
    state = get_reasoning_parser("deepseek_r1")().streaming()
    assert state.feed("if a </") == ("if a", None)
    assert state.feed("b> then") == (" </b> then", None)
    assert state.finish() == (None, None)
    state = get_reasoning_parser("qwen3")().streaming()
    assert state.feed("<") == (None, None)
    assert state.feed("3 is less than 4") == (None, "<3 is less than 4")


def test_qwen3_without_thinking_streams_content_at_once():
    state = get_reasoning_parser("qwen3")().streaming()
    assert state.feed("Paris") == (None, "Paris")
    assert state.feed(" is the capital.") == (None, " is the capital.")
    assert state.finish() == (None, None)


def test_gptoss_streams_reasoning_then_content_without_headers():
    state = get_reasoning_parser("openai_gptoss")().streaming()
    assert state.feed("<|channel|>analy") == (None, None)
    assert state.feed("sis<|message|>Think") == ("Think", None)
    assert state.feed("ing.<|end|><|start|>assistant<|chan") == ("ing.", None)
    assert state.feed("nel|>final<|message|>Par") == (None, "Par")
    assert state.feed("is.") == (None, "is.")
    assert state.finish() == (None, None)


def test_gptoss_ignores_final_messages_of_earlier_turns_in_the_prompt():
    parser = get_reasoning_parser("openai_gptoss")()
    prompt = ("<|start|>user<|message|>hi<|end|><|start|>assistant<|channel|>final<|message|>hello<|end|>"
              "<|start|>user<|message|>2+2?<|end|><|start|>assistant")
    assert not parser.closed_by_prompt(prompt)
    assert get_reasoning_parser("qwen3")().closed_by_prompt("<think>\n\n</think>\n\n")


def test_registry():
    assert set(REASONING_PARSERS) == {"deepseek_r1", "openai_gptoss", "qwen3"}
    for name, parser in REASONING_PARSERS.items():
        assert get_reasoning_parser(name) is parser and parser.name == name
        if name != "openai_gptoss":
            assert (parser.start_tag, parser.end_tag) == ("<think>", "</think>")
            assert parser(tokenizer=object()).extract_reasoning("<think>a</think>b") == ("a", "b")
    with pytest.raises(
        ValueError, match=r"unknown reasoning parser 'nope'; choose one of: deepseek_r1, openai_gptoss, qwen3"
    ):
        get_reasoning_parser("nope")


def test_parsers_are_pure_python():
    code = "import sys, kvtide.reasoning; assert 'torch' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], check=True)
