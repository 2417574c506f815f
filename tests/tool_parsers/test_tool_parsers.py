"""Tool-call parsers on recorded model outputs, and the streaming contract: however the text is cut
into chunks, the deltas rebuild exactly the non-streamed result, each call's name first."""

from __future__ import annotations

import ast
import json
import pathlib
import re
import subprocess
import sys

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from text_splits import cut_at, splits

from kvtide.tool_parsers import TOOL_PARSERS, ToolCall, get_tool_parser, make_tool_call_id

# (parser, model output, expected content, expected [(name, arguments)])
RECORDED = [
    # --- hermes: Qwen2.5 / Qwen3 / Hermes / SmolLM ---
    (
        "hermes",
        '<tool_call>\n{"name": "get_current_temperature", "arguments": {"location": "San Francisco, CA, USA", '
        '"unit": "celsius"}}\n</tool_call>',
        None,
        [("get_current_temperature", {"location": "San Francisco, CA, USA", "unit": "celsius"})],
    ),
    (
        "hermes",
        '<tool_call>\n{"name": "get_current_temperature", "arguments": {"location": "San Francisco, CA, USA"}}\n'
        '</tool_call>\n<tool_call>\n{"name": "get_temperature_date", "arguments": {"location": "San Francisco, '
        'CA, USA", "date": "2024-10-01"}}\n</tool_call>',
        None,
        [
            ("get_current_temperature", {"location": "San Francisco, CA, USA"}),
            ("get_temperature_date", {"location": "San Francisco, CA, USA", "date": "2024-10-01"}),
        ],
    ),
    (
        "hermes",
        "I'll look up the weather in both cities for you.\n\n<tool_call>\n"
        '{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>\n'
        "Then the second one:\n<tool_call>\n"
        '{"name": "get_weather", "arguments": {"city": "Tokyo"}}\n</tool_call>\n',
        "I'll look up the weather in both cities for you.\n\n\nThen the second one:",
        [("get_weather", {"city": "Paris"}), ("get_weather", {"city": "Tokyo"})],
    ),
    (
        "hermes",
        '<tool_call>\n{"name": "create_event", "arguments": {"title": "Réunion d\'équipe 🎉", "attendees": '
        '[{"name": "Zoë", "email": "zoe@example.com"}, {"name": "\\u674e\\u96f7"}], "when": {"date": '
        '"2024-10-03", "time": "14:00", "recurring": false}, "room": null}}\n</tool_call>',
        None,
        [
            (
                "create_event",
                {
                    "title": "Réunion d'équipe 🎉",
                    "attendees": [{"name": "Zoë", "email": "zoe@example.com"}, {"name": "李雷"}],
                    "when": {"date": "2024-10-03", "time": "14:00", "recurring": False},
                    "room": None,
                },
            )
        ],
    ),
    (  # stopped at EOS right after the JSON: still a call
        "hermes",
        '<tool_call>\n{"name": "get_time", "arguments": {"timezone": "Asia/Tokyo"}}\n',
        None,
        [("get_time", {"timezone": "Asia/Tokyo"})],
    ),
    (  # a JSON string with brace and tag look-alikes inside
        "hermes",
        '<tool_call>\n{"name": "run_code", "arguments": {"code": "print(\\"}</tool\\")\\nx = {1: [2]}"}}\n'
        "</tool_call>",
        None,
        [("run_code", {"code": 'print("}</tool")\nx = {1: [2]}'})],
    ),
    ("hermes", "The capital of France is Paris.", "The capital of France is Paris.", []),
    ("hermes", "", None, []),
    ("hermes", "  \n ", None, []),
    (  # bad JSON (missing brace): the block is content
        "hermes",
        '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}\n</tool_call>',
        '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}\n</tool_call>',
        [],
    ),
    (  # unterminated with bad JSON: content
        "hermes",
        'Checking.\n<tool_call>\n{"name": "get_weather", "argu',
        'Checking.\n<tool_call>\n{"name": "get_weather", "argu',
        [],
    ),
    (  # arguments as a JSON string, not an object: content
        "hermes",
        '<tool_call>\n{"name": "f", "arguments": "{\\"x\\": 1}"}\n</tool_call>',
        '<tool_call>\n{"name": "f", "arguments": "{\\"x\\": 1}"}\n</tool_call>',
        [],
    ),
    (  # a stray start tag in prose, then a real call
        "hermes",
        'Wrap each call in a <tool_call> tag, like this:\n<tool_call>\n{"name": "f", "arguments": {}}\n</tool_call>',
        "Wrap each call in a <tool_call> tag, like this:",
        [("f", {})],
    ),
    (  # one good call, one malformed: the malformed one stays content
        "hermes",
        '<tool_call>\n{"name": "a", "arguments": {"n": 1}}\n</tool_call>\n<tool_call>\n{"name": "b"}\n</tool_call>',
        '<tool_call>\n{"name": "b"}\n</tool_call>',
        [("a", {"n": 1})],
    ),
    ("hermes", "x </tool_call> y", "x </tool_call> y", []),
    (
        "hermes",
        '<tool_call>\n{"name": "f", "arguments": {"x": NaN}}\n</tool_call>',
        '<tool_call>\n{"name": "f", "arguments": {"x": NaN}}\n</tool_call>',
        [],
    ),
    # --- llama3_json: Llama 3.1 / 3.2 ---
    (
        "llama3_json",
        '{"name": "get_current_conditions", "parameters": {"location": "San Francisco, CA", "unit": "Fahrenheit"}}',
        None,
        [("get_current_conditions", {"location": "San Francisco, CA", "unit": "Fahrenheit"})],
    ),
    (
        "llama3_json",
        '<|python_tag|>{"name": "get_weather", "parameters": {"city": "Paris"}}',
        None,
        [("get_weather", {"city": "Paris"})],
    ),
    (
        "llama3_json",
        '{"name": "get_weather", "parameters": {"city": "Paris"}}; {"name": "get_time", "arguments": '
        '{"tz": "Europe/Paris"}}\n',
        None,
        [("get_weather", {"city": "Paris"}), ("get_time", {"tz": "Europe/Paris"})],
    ),
    (
        "llama3_json",
        '\n{"type": "function", "name": "translate", "parameters": {"text": "こんにちは", "options": '
        '{"formal": true, "targets": ["en", "de"], "depth": {"a": {"b": [1, 2.5]}}}}};',
        None,
        [
            (
                "translate",
                {
                    "text": "こんにちは",
                    "options": {"formal": True, "targets": ["en", "de"], "depth": {"a": {"b": [1, 2.5]}}},
                },
            )
        ],
    ),
    (  # text before the JSON: all content
        "llama3_json",
        'Sure! {"name": "get_weather", "parameters": {"city": "Paris"}}',
        'Sure! {"name": "get_weather", "parameters": {"city": "Paris"}}',
        [],
    ),
    (  # text after the JSON: all content
        "llama3_json",
        '{"name": "get_weather", "parameters": {"city": "Paris"}} Let me know if you need more.',
        '{"name": "get_weather", "parameters": {"city": "Paris"}} Let me know if you need more.',
        [],
    ),
    (  # escaped quotes and brackets inside strings do not end the object
        "llama3_json",
        '{"name": "run", "parameters": {"code": "s = \\"}\\"; t = [\'{\']", "path": "C:\\\\tmp\\\\"}}',
        None,
        [("run", {"code": "s = \"}\"; t = ['{']", "path": "C:\\tmp\\"})],
    ),
    ("llama3_json", '{"name": "Bob", "age": 3}', '{"name": "Bob", "age": 3}', []),
    ("llama3_json", '{"name": "f", "parameters": {"x": }', '{"name": "f", "parameters": {"x": }', []),
    ("llama3_json", '{"name": "f", "parameters": [1, 2]}', '{"name": "f", "parameters": [1, 2]}', []),
    (
        "llama3_json",
        '<|python_tag|>brave_search.call(query="x")',
        '<|python_tag|>brave_search.call(query="x")',
        [],
    ),
    ("llama3_json", "It is sunny in Paris today.", "It is sunny in Paris today.", []),
    (
        "llama3_json",
        '{"name": "a", "parameters": {}} ; ; {"name": "b", "parameters": {}}',
        '{"name": "a", "parameters": {}} ; ; {"name": "b", "parameters": {}}',
        [],
    ),
    # --- mistral: v0.3 array form and v11+ [ARGS] form ---
    (
        "mistral",
        '[TOOL_CALLS] [{"name": "get_current_weather", "arguments": {"location": "Paris, France", "format": '
        '"celsius"}}]',
        None,
        [("get_current_weather", {"location": "Paris, France", "format": "celsius"})],
    ),
    (
        "mistral",
        '[TOOL_CALLS] [{"name": "get_current_weather", "arguments": {"location": "Paris, France"}}, '
        '{"name": "get_current_weather", "arguments": {"location": "São Paulo, Brazil"}}]',
        None,
        [
            ("get_current_weather", {"location": "Paris, France"}),
            ("get_current_weather", {"location": "São Paulo, Brazil"}),
        ],
    ),
    ("mistral", '[TOOL_CALLS]get_weather[ARGS]{"city": "Paris"}', None, [("get_weather", {"city": "Paris"})]),
    (
        "mistral",
        '[TOOL_CALLS]get_weather[ARGS]{"city": "Paris"}[TOOL_CALLS]get_time[ARGS]{"tz": "Europe/Paris"}',
        None,
        [("get_weather", {"city": "Paris"}), ("get_time", {"tz": "Europe/Paris"})],
    ),
    (
        "mistral",
        'Let me look that up.[TOOL_CALLS]search.web[ARGS]{"query": "Zürich café", "filters": {"open_now": true, '
        '"tags": ["[x]", "{y}"]}}',
        "Let me look that up.",
        [("search.web", {"query": "Zürich café", "filters": {"open_now": True, "tags": ["[x]", "{y}"]}})],
    ),
    (
        "mistral",
        '[TOOL_CALLS]run[ARGS]{"code": "print(\\"}]\\")"}[TOOL_CALLS] [{"name": "b", "arguments": {"q": "\\"]"}}]',
        None,
        [("run", {"code": 'print("}]")'}), ("b", {"q": '"]'})],
    ),
    ("mistral", '[TOOL_CALLS]get_time{"tz": "UTC"}', None, [("get_time", {"tz": "UTC"})]),
    (
        "mistral",
        '[TOOL_CALLS] [{"name": "f", "arguments": {"x": 1}]',
        '[TOOL_CALLS] [{"name": "f", "arguments": {"x": 1}]',
        [],
    ),
    (
        "mistral",
        '[TOOL_CALLS]get_weather[ARGS]{"city": "Par',
        '[TOOL_CALLS]get_weather[ARGS]{"city": "Par',
        [],
    ),
    ("mistral", "[TOOL_CALLS] []", "[TOOL_CALLS] []", []),
    ("mistral", "[TOOL_CALLS]f[ARGS][1, 2]", "[TOOL_CALLS]f[ARGS][1, 2]", []),
    (
        "mistral",
        'The [TOOL_CALLS] token starts calls.[TOOL_CALLS]f[ARGS]{"a": "b"}',
        "The [TOOL_CALLS] token starts calls.",
        [("f", {"a": "b"})],
    ),
    ("mistral", "Bonjour ! Comment puis-je vous aider ?", "Bonjour ! Comment puis-je vous aider ?", []),
    # --- pythonic: Llama 3.2 / Llama 4 ---
    (
        "pythonic",
        '[get_weather(city="San Francisco", metric="celsius")]',
        None,
        [("get_weather", {"city": "San Francisco", "metric": "celsius"})],
    ),
    (
        "pythonic",
        '[get_weather(city="San Francisco"), get_time(timezone="America/Los_Angeles")]\n',
        None,
        [("get_weather", {"city": "San Francisco"}), ("get_time", {"timezone": "America/Los_Angeles"})],
    ),
    (
        "pythonic",
        "<|python_start|>[search(query='kvtide [paged] \"kv\"', max_results=5)]<|python_end|>",
        None,
        [("search", {"query": 'kvtide [paged] "kv"', "max_results": 5})],
    ),
    (
        "pythonic",
        '[book_flight(passengers=[{"name": "Zoë", "age": 31}], route=("SFO", "NRT"), refundable=False, '
        "budget=-1.5e3, notes=None, seats={'row': 12})]",
        None,
        [
            (
                "book_flight",
                {
                    "passengers": [{"name": "Zoë", "age": 31}],
                    "route": ["SFO", "NRT"],
                    "refundable": False,
                    "budget": -1500.0,
                    "notes": None,
                    "seats": {"row": 12},
                },
            )
        ],
    ),
    (
        "pythonic",
        "[set_flag(enabled=true, value=null, other=false)]",
        None,
        [("set_flag", {"enabled": True, "value": None, "other": False})],
    ),
    ("pythonic", "[get_time()]", None, [("get_time", {})]),
    (
        "pythonic",
        r"""[say(text='it\'s ]', other="\")")]""",
        None,
        [("say", {"text": "it's ]", "other": '")'})],
    ),
    ("pythonic", '[get_weather("SF")]', '[get_weather("SF")]', []),
    ("pythonic", "[f(x=1)] Here you go.", "[f(x=1)] Here you go.", []),
    ("pythonic", '[f(x=os.system("ls"))]', '[f(x=os.system("ls"))]', []),
    ("pythonic", "[f(**kw)]", "[f(**kw)]", []),
    ("pythonic", "[f(x=1e999)]", "[f(x=1e999)]", []),
    (
        "pythonic",
        "[Click here](https://example.com) for details.",
        "[Click here](https://example.com) for details.",
        [],
    ),
    ("pythonic", "[]", "[]", []),
    ("pythonic", '[get_weather(city="SF"', '[get_weather(city="SF"', []),
    ("pythonic", "Sure, the weather in SF is sunny.", "Sure, the weather in SF is sunny.", []),
    (
        "openai",
        "<|channel|>analysis<|message|>Need the weather.<|end|><|start|>assistant<|channel|>commentary "
        'to=functions.get_weather <|constrain|>json<|message|>{"city": "Paris"}',
        None,
        [("get_weather", {"city": "Paris"})],
    ),
    ("openai", "<|channel|>analysis<|message|>2+2<|end|><|start|>assistant<|channel|>final<|message|>4", "4", []),
    (
        "openai",
        '<|channel|>commentary to=functions.a <|constrain|>json<|message|>{"x": 1}<|call|><|start|>assistant'
        "<|channel|>commentary to=functions.b<|message|>{}<|call|>",
        None,
        [("a", {"x": 1}), ("b", {})],
    ),
    (
        "openai",
        '<|start|>assistant to=functions.f<|channel|>commentary json<|message|>{"q": "é"}',
        None,
        [("f", {"q": "é"})],
    ),
    (
        "openai",
        "<|channel|>commentary<|message|>Let me check.<|end|><|start|>assistant<|channel|>commentary "
        "to=functions.f<|message|>{}",
        "Let me check.",
        [("f", {})],
    ),
    (
        "openai",
        '<|channel|>commentary to=functions.f<|message|>{"x": ',
        '<|channel|>commentary to=functions.f<|message|>{"x":',
        [],
    ),
    ("openai", '<|channel|>commentary to=functions.f<|message|>[1]', "<|channel|>commentary to=functions.f<|message|>[1]", []),
    ("openai", "Plain <|answer|> with |> bars", "Plain <|answer|> with |> bars", []),
    ("openai", "Final text straight away, as after the reasoning parser.", "Final text straight away, as after the reasoning parser.", []),
]

PARSERS = sorted(TOOL_PARSERS)


def _ids(case):
    return f"{case[0]}:{case[1][:40]!r}"


def stream(parser_name: str, chunks: list[str]) -> tuple[str, list[tuple[str, str]]]:
    """Feed `chunks` to a fresh stream; rebuild content and calls, checking the delta order."""
    state = get_tool_parser(parser_name)().streaming()
    messages = [state.feed(chunk) for chunk in chunks] + [state.finish()]
    content = ""
    calls: list[list[str]] = []
    for message in messages:
        if message is None:
            continue
        assert message.content or message.tool_calls, "an empty DeltaMessage instead of None"
        content += message.content or ""
        for delta in message.tool_calls:
            if delta.index == len(calls):  # the first delta of a new call: id and name come first
                assert delta.id and delta.name, delta
                calls.append([delta.name, delta.arguments or ""])
            else:
                assert delta.index < len(calls) and delta.id is None and delta.name is None, delta
                calls[delta.index][1] += delta.arguments or ""
    return content, [(name, arguments) for name, arguments in calls]


def whole(parser_name: str, text: str) -> tuple[str, list[tuple[str, str]]]:
    result = get_tool_parser(parser_name)().extract_tool_calls(text)
    return result.content or "", [(call.name, call.arguments) for call in result.tool_calls]


@pytest.mark.parametrize("case", RECORDED, ids=_ids)
def test_recorded_outputs(case):
    parser_name, text, content, calls = case
    result = get_tool_parser(parser_name)().extract_tool_calls(text)
    assert result.content == content
    assert [(call.name, json.loads(call.arguments)) for call in result.tool_calls] == calls
    for call in result.tool_calls:
        assert call.arguments == json.dumps(json.loads(call.arguments), ensure_ascii=False)  # canonical
        assert re.fullmatch(r"call_[A-Za-z0-9]{24}", call.id)
    assert len({call.id for call in result.tool_calls}) == len(result.tool_calls)


@pytest.mark.parametrize("case", RECORDED, ids=_ids)
def test_streaming_matches_whole_for_every_split(case):
    parser_name, text = case[0], case[1]
    expected = whole(parser_name, text)
    for label, chunks in splits(text, max_chunk=12):
        assert stream(parser_name, chunks) == expected, label


PIECES = [
    "<tool_call>",
    "</tool_call>",
    "<tool_",
    "call>",
    '{"name": "f", "arguments": {"x": [1, "}"]}}',
    '{"name": "g", "parameters": {}}',
    "[TOOL_CALLS]",
    "[ARGS]",
    "get_time",
    '[{"name": "h", "arguments": {}}]',
    "<|python_tag|>",
    "<|python_start|>",
    "<|python_end|>",
    "[f(x=1)]",
    "g(y='a]')",
    "{",
    "}",
    "[",
    "]",
    "(",
    ")",
    ";",
    ",",
    '"',
    "'",
    "\\",
    " ",
    "\n",
    "a",
    "é",
    "Hi.",
    "true",
    "[TOOL_",
    "CALLS]",
    "<|channel|>",
    "commentary to=functions.f",
    "analysis",
    "final",
    "<|message|>",
    "<|start|>assistant",
    "<|end|>",
    "<|call|>",
    "<|",
]


@settings(max_examples=150, deadline=None)
@given(
    parser_name=st.sampled_from(PARSERS),
    pieces=st.lists(st.sampled_from(PIECES), max_size=12),
    cuts=st.lists(st.integers(min_value=0, max_value=400), max_size=8),
)
def test_streaming_matches_whole_on_generated_text(parser_name, pieces, cuts):
    text = "".join(pieces)
    expected = whole(parser_name, text)
    assert stream(parser_name, cut_at(text, cuts)) == expected
    assert stream(parser_name, list(text)) == expected


@pytest.mark.parametrize("parser_name", PARSERS)
def test_no_text_is_lost_when_there_are_no_calls(parser_name):
    text = "  Plain answer: a < b and [x] {y} ; done.\n"
    assert get_tool_parser(parser_name)().extract_tool_calls(text).content == text.strip()


def test_hermes_streams_a_call_as_soon_as_its_block_closes():
    state = get_tool_parser("hermes")().streaming()
    first = state.feed("Checking.\n<tool")
    assert first is not None and first.content == "Checking."
    assert state.feed('_call>\n{"name": "f", "arguments": {"a": 1}}\n') is None
    message = state.feed("</tool_call>")
    assert message is not None and message.content is None
    [delta] = message.tool_calls
    assert (delta.index, delta.name, delta.arguments) == (0, "f", '{"a": 1}')
    assert state.finish() is None


def test_plain_text_streams_without_waiting_for_the_end():
    for parser_name in PARSERS:
        state = get_tool_parser(parser_name)().streaming()
        message = state.feed("The answer is ")
        assert message is not None and message.content == "The answer is", parser_name


def test_tool_call_ids_are_openai_style_and_unique():
    ids = {make_tool_call_id() for _ in range(200)}
    assert len(ids) == 200
    assert all(re.fullmatch(r"call_[A-Za-z0-9]{24}", i) for i in ids)
    assert ToolCall("f", "{}").id != ToolCall("f", "{}").id


def test_registry():
    assert set(TOOL_PARSERS) == {"hermes", "llama3_json", "mistral", "openai", "pythonic"}
    for name, parser in TOOL_PARSERS.items():
        assert get_tool_parser(name) is parser and parser.name == name
        assert parser(tokenizer=object()).extract_tool_calls("hi").content == "hi"
    with pytest.raises(
        ValueError, match=r"unknown tool call parser 'nope'; choose one of: hermes, llama3_json"
    ):
        get_tool_parser("nope")


def test_absurd_nesting_is_content_not_an_error():
    for parser_name, text in [
        (
            "hermes",
            "<tool_call>" + '{"name": "f", "arguments": ' + "[" * 100_000 + "]" * 100_000 + "}</tool_call>",
        ),
        ("llama3_json", '{"name": "f", "parameters": {"a": ' + "[" * 100_000 + "]" * 100_000 + "}}"),
        ("pythonic", "[f(x=" + "[" * 10_000 + "]" * 10_000 + ")]"),
        ("mistral", "[TOOL_CALLS]" + "[" * 100_000 + "]" * 100_000),
        ("openai", "<|channel|>commentary to=functions.f<|message|>" + "[" * 100_000 + "]" * 100_000),
    ]:
        result = get_tool_parser(parser_name)().extract_tool_calls(text)
        assert result.tool_calls == [] and result.content == text, parser_name


def test_parsers_are_pure_python():
    package = pathlib.Path(__file__).resolve().parents[2] / "kvtide" / "tool_parsers"
    for path in package.glob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("kvtide"):
                assert node.module.startswith("kvtide.tool_parsers"), (path.name, node.module)
    code = "import sys, kvtide.tool_parsers; assert 'torch' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], check=True)


def test_gpt_oss_calls_survive_the_reasoning_parser():
    """The server runs the reasoning parser first and gives its content to the tool parser."""
    from kvtide.reasoning import get_reasoning_parser

    text = ("<|channel|>analysis<|message|>Weather first.<|end|><|start|>assistant<|channel|>commentary<|message|>"
            "Checking.<|end|><|start|>assistant<|channel|>commentary to=functions.get_weather <|constrain|>json"
            '<|message|>{"city": "Oslo"}')
    for label, chunks in splits(text, max_chunk=9, num_random=10):
        reasoning_stream = get_reasoning_parser("openai_gptoss")().streaming()
        tool_stream = get_tool_parser("openai")().streaming()
        reasoning, content, calls = "", "", []
        for part in [reasoning_stream.feed(c) for c in chunks] + [reasoning_stream.finish()]:
            reasoning += part[0] or ""
            message = tool_stream.feed(part[1] or "")
            if message is not None:
                content += message.content or ""
                calls += message.tool_calls
        tail = tool_stream.finish()
        if tail is not None:
            content += tail.content or ""
            calls += tail.tool_calls
        assert reasoning == "Weather first." and content == "Checking.", label
        assert [(c.name, json.loads(c.arguments)) for c in calls] == [("get_weather", {"city": "Oslo"})], label
