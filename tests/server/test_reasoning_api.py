"""Reasoning output (--reasoning-parser): reasoning_content apart from content, streamed and not;
structured output waiting for the end of the reasoning; the startup checks of the parser flags."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
from serve_helpers import MODEL_NAME
from test_tool_calling import (
    MESSAGES,
    THINKING_OFF,
    TOOLS,
    assert_stream_equals_whole,
    flatten_response,
    rebuild_stream,
)

from kvtide.cli import build_parser, main
from kvtide.models.demo import build_byte_tokenizer
from kvtide.reasoning import get_reasoning_parser
from kvtide.server.openai.chat_completions.assembly import ChoiceAssembler
from kvtide.server.openai.chat_completions.protocol import ChatCompletionRequest
from kvtide.server.openai.chat_completions.serving import ChatServing
from kvtide.server.openai.chat_completions.tool_call_streams import AutoToolStream, PlainStream
from kvtide.server.openai.chat_completions.tools import plan_tools
from kvtide.server.output_parsers import OutputParsers
from kvtide.tool_parsers import get_tool_parser


def _qwen3():
    return get_reasoning_parser("qwen3")()


# ---- unit: assembly ------------------------------------------------------------------------------
@pytest.mark.parametrize("name,text,reasoning,content", [
    ("qwen3", "<think>\nLet me think.\n</think>\n\nThe answer is 4.", "Let me think.", "The answer is 4."),
    ("qwen3", "No thinking here.", None, "No thinking here."),
    ("qwen3", "<think>cut off while thin", "cut off while thin", ""),
    ("deepseek_r1", "thinking from the first token</think>answer", "thinking from the first token", "answer"),
    ("deepseek_r1", "never finished thinking", "never finished thinking", ""),
])
def test_reasoning_split_streamed_equals_whole(name, text, reasoning, content):
    parser = get_reasoning_parser(name)()
    expected = assert_stream_equals_whole(lambda: ChoiceAssembler(parser, PlainStream()), text)
    assert expected["reasoning"] == reasoning and expected["content"] == content


def test_tags_split_across_chunks():
    assembler = ChoiceAssembler(_qwen3(), PlainStream())
    pieces = ["<th", "ink>ab", "c</t", "hink", ">\n", "ans", "wer"]
    deltas = [assembler.feed(p) for p in pieces] + [assembler.finish()]
    assert "".join(d.reasoning for d in deltas) == "abc"
    assert "".join(d.content for d in deltas) == "answer"
    assert all("<" not in d.reasoning + d.content for d in deltas)


def test_tool_calls_are_parsed_after_the_reasoning():
    text = ('<think>The user wants weather; <tool_call> is how I call.</think>\n'
            '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Lima", "days": 1}}\n</tool_call>')
    hermes = get_tool_parser("hermes")()
    expected = assert_stream_equals_whole(lambda: ChoiceAssembler(_qwen3(), AutoToolStream(hermes)), text)
    assert expected["reasoning"] == "The user wants weather; <tool_call> is how I call."
    assert expected["calls"] == [("get_weather", '{"city": "Lima", "days": 1}')]
    assert expected["content"] == ""


def test_gpt_oss_harmony_reasoning_then_calls():
    text = ("<|channel|>analysis<|message|>Weather needs a call.<|end|><|start|>assistant<|channel|>commentary "
            'to=functions.get_weather <|constrain|>json<|message|>{"city": "Lima", "days": 1}<|call|>')
    gptoss, harmony_calls = get_reasoning_parser("openai_gptoss")(), get_tool_parser("openai")()
    expected = assert_stream_equals_whole(lambda: ChoiceAssembler(gptoss, AutoToolStream(harmony_calls)), text)
    assert expected["reasoning"] == "Weather needs a call."
    assert expected["calls"] == [("get_weather", '{"city": "Lima", "days": 1}')]
    assert expected["content"] == ""
    answer = "<|channel|>analysis<|message|>Easy.<|end|><|start|>assistant<|channel|>final<|message|>4"
    expected = assert_stream_equals_whole(lambda: ChoiceAssembler(gptoss, AutoToolStream(harmony_calls)), answer)
    assert (expected["reasoning"], expected["content"], expected["calls"]) == ("Easy.", "4", [])


def test_harmony_markers_as_special_tokens_keep_special_tokens_in_the_text():
    """gpt-oss's tags are several tokens, but its markers are special ones: the text must keep them."""
    tokenizer = build_byte_tokenizer()
    assert not OutputParsers.create(tokenizer, None, False, "openai_gptoss").reasoning_tags_special
    tokenizer.add_special_tokens({"additional_special_tokens": ["<|channel|>", "<|message|>", "<|end|>"]})
    parsers = OutputParsers.create(tokenizer, "openai", True, "openai_gptoss")
    assert parsers.reasoning_tags_special
    assert tokenizer.decode(parsers.reasoning_end_token_ids) == "<|channel|>final<|message|>"


def test_include_reasoning_false_drops_it():
    assembler = ChoiceAssembler(_qwen3(), PlainStream(), include_reasoning=False)
    delta = assembler.feed("<think>secret</think>shown")
    delta.add(assembler.finish())
    assert delta.reasoning == "" and delta.content == "shown"


# ---- unit: what the request asks of the engine ---------------------------------------------------
def _serving(reasoning: str | None = "qwen3") -> ChatServing:
    tokenizer = build_byte_tokenizer()
    parsers = OutputParsers.create(tokenizer, None, False, reasoning)
    return ChatServing(SimpleNamespace(parsers=parsers, tokenizer=tokenizer))  # type: ignore[arg-type]


def _request(**fields) -> ChatCompletionRequest:
    return ChatCompletionRequest.model_validate({"messages": MESSAGES, **fields})


def test_constraint_waits_for_the_reasoning_end():
    serving = _serving()
    end_ids = build_byte_tokenizer().encode("</think>", add_special_tokens=False)
    assert serving.state.parsers.reasoning_end_token_ids == end_ids
    request = _request(guided_regex="[0-9]+")
    structured, source = serving.constraint_for(request, plan_tools(request, False), reasoning=True)
    assert source == "guided_regex" and structured.regex == "[0-9]+"
    assert structured.reasoning_end_token_ids == end_ids
    structured, _ = serving.constraint_for(request, plan_tools(request, False), reasoning=False)
    assert structured.reasoning_end_token_ids is None
    named = _request(tools=TOOLS, tool_choice={"type": "function", "function": {"name": "get_time"}})
    structured, source = serving.constraint_for(named, plan_tools(named, False), reasoning=True)
    assert source == "tools" and structured.reasoning_end_token_ids == end_ids


@pytest.mark.parametrize("prompt,active", [
    ("<|user|>hi\n<|assistant|>", True),
    ("<|user|>hi\n<|assistant|><think>\n", True),
    ("<|user|>hi\n<|assistant|><think>\n\n</think>\n\n", False),  # Qwen3 with thinking off
    ("<|assistant|><think>a</think>old answer\n<|user|>hi\n<|assistant|><think>\n", True),
])
def test_a_prompt_that_closed_the_reasoning_turns_the_parser_off(prompt, active):
    assert (_serving().reasoning_parser_for(prompt) is not None) == active
    assert _serving(None).reasoning_parser_for(prompt) is None


class _NoThinkTokenizer:
    unk_token_id = 0
    all_special_tokens = ["<unk>"]

    def encode(self, text, add_special_tokens=False):
        return [0]

    def decode(self, ids, skip_special_tokens=False):
        return "<unk>"


def test_startup_checks():
    with pytest.raises(ValueError, match="cannot write the end tag"):
        OutputParsers.create(_NoThinkTokenizer(), None, False, "deepseek_r1")
    with pytest.raises(ValueError, match="--tool-call-parser"):
        OutputParsers.create(build_byte_tokenizer(), None, True, None)
    parsers = OutputParsers.create(build_byte_tokenizer(), "hermes", True, None)
    assert parsers.auto_tool_choice and parsers.reasoning_parser is None
    assert not OutputParsers.create(build_byte_tokenizer(), "hermes", False, None).auto_tool_choice


def test_serve_flags(capsys):
    args = build_parser().parse_args(["serve", "demo", "--enable-auto-tool-choice", "--tool-call-parser",
                                      "pythonic", "--reasoning-parser", "qwen3"])
    assert args.enable_auto_tool_choice and args.tool_call_parser == "pythonic" and args.reasoning_parser == "qwen3"
    assert main(["serve", "demo", "--enable-auto-tool-choice"]) == 2
    assert "--tool-call-parser" in capsys.readouterr().err
    for flag in ("--reasoning-parser", "--tool-call-parser"):
        with pytest.raises(SystemExit) as exit_info:
            build_parser().parse_args(["serve", "demo", flag, "nonexistent"])
        assert exit_info.value.code == 2


# ---- end to end (--reasoning-parser deepseek_r1) ---------------------------------------------------
def test_reasoning_content_end_to_end(tools_client):
    kwargs = dict(model=MODEL_NAME, messages=MESSAGES, max_tokens=40, temperature=1.0, seed=8, n=2)
    response = tools_client.chat.completions.create(**kwargs)
    for choice in response.choices:
        # deepseek_r1: the output is reasoning until </think>, which a random model never writes.
        assert choice.message.reasoning_content and choice.message.content is None
        assert choice.finish_reason in ("stop", "length")
    assert rebuild_stream(tools_client.chat.completions.create(stream=True, **kwargs)) == flatten_response(response)


def test_no_reasoning_when_the_prompt_closed_it(tools_client):
    kwargs = dict(model=MODEL_NAME, messages=MESSAGES, max_tokens=20, seed=8,
                  extra_body={"chat_template": THINKING_OFF})
    choice = tools_client.chat.completions.create(**kwargs).choices[0]
    assert getattr(choice.message, "reasoning_content", None) is None and choice.message.content is not None


def test_named_tool_choice_while_reasoning(tools_client):
    # The constraint waits for </think>: until then the model reasons freely (here: until max_tokens).
    response = tools_client.chat.completions.create(
        model=MODEL_NAME, messages=MESSAGES, tools=TOOLS, max_tokens=30, seed=2,
        tool_choice={"type": "function", "function": {"name": "get_time"}})
    choice = response.choices[0]
    assert choice.finish_reason == "length" and choice.message.reasoning_content
    assert [c.function.name for c in choice.message.tool_calls] == ["get_time"]
