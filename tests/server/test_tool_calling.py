"""Tool calling on /v1/chat/completions: the JSON re-serialisation and tool-call streams (unit),
then named, "required" and "auto" tool choice against a real server, streamed and not.

The server runs --reasoning-parser deepseek_r1, so requests that want the tool output from the
first token use THINKING_OFF, a template that closes the reasoning section in the prompt (as
Qwen3's does with thinking off): then the constraint applies at once and the answer is all content.
"""

from __future__ import annotations

import json
import random

import jsonschema
import pytest
from serve_helpers import MODEL_NAME
from test_errors import check_error

from kvtide.models.demo import CHAT_TEMPLATE
from kvtide.server.openai.chat_completions.assembly import ChoiceAssembler, assemble_message
from kvtide.server.openai.chat_completions.json_text import JsonLexer, canonical_json
from kvtide.server.openai.chat_completions.tool_call_streams import (
    AutoToolStream,
    NamedToolStream,
    RequiredToolsStream,
    merge_tool_calls,
)
from kvtide.server.openai.chat_completions.tools import AUTO_NEEDS_FLAGS
from kvtide.tool_parsers import get_tool_parser

THINKING_OFF = CHAT_TEMPLATE.replace("<|assistant|>{% endif %}", "<|assistant|><think>\n\n</think>\n\n{% endif %}")
WEATHER = {"type": "object",
           "properties": {"city": {"type": "string", "enum": ["Paris", "Tokyo", "Lima"]},
                          "days": {"type": "integer", "minimum": 1, "maximum": 9}},
           "required": ["city", "days"], "additionalProperties": False}
TIME = {"type": "object", "properties": {"zone": {"type": "string", "enum": ["utc", "cet"]}},
        "required": ["zone"], "additionalProperties": False}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Weather", "parameters": WEATHER}},
         {"type": "function", "function": {"name": "get_time", "parameters": TIME}}]
SCHEMAS = {"get_weather": WEATHER, "get_time": TIME}
MESSAGES = [{"role": "user", "content": "What is the weather in Paris?"}]
CHAT = "/v1/chat/completions"


def random_pieces(text: str, seed: int) -> list[str]:
    rng = random.Random(seed)
    pieces, i = [], 0
    while i < len(text):
        j = i + rng.randint(1, 6)
        pieces.append(text[i:j])
        i = j
    return pieces


def streamed(make_assembler, text: str, seed: int) -> dict:
    """The message a client rebuilds from the stream of `text` cut into random pieces."""
    assembler = make_assembler()
    deltas = [assembler.feed(piece) for piece in random_pieces(text, seed)] + [assembler.finish()]
    content = "".join(d.content for d in deltas)
    calls = merge_tool_calls([c for d in deltas for c in d.tool_calls])
    return {"reasoning": "".join(d.reasoning for d in deltas) or None, "content": content,
            "calls": [(c["function"]["name"], c["function"]["arguments"]) for c in calls],
            "num_tool_calls": assembler.num_tool_calls}


def whole(make_assembler, text: str) -> dict:
    message = assemble_message(make_assembler(), text)
    return {"reasoning": message["reasoning_content"], "content": message["content"] or "",
            "calls": [(c["function"]["name"], c["function"]["arguments"]) for c in message["tool_calls"]]}


def assert_stream_equals_whole(make_assembler, text: str) -> dict:
    expected = whole(make_assembler, text)
    for seed in range(12):
        got = streamed(make_assembler, text, seed)
        assert got["num_tool_calls"] == len(expected["calls"])
        del got["num_tool_calls"]
        assert got == expected, (seed, text)
    return expected


# ---- unit: canonical JSON ------------------------------------------------------------------------
@pytest.mark.parametrize("text", ['{"a" :1.50,"b":[true , null],"c":"h\\u00e9\\"\\\\","d":{}, "e":-0,"f":1e2}',
                                  '[]', '"x"', '  {"nested": {"deep": [[], [{}], -12.5e-3]}}  '])
def test_canonical_json_is_json_dumps(text):
    assert canonical_json(text) == json.dumps(json.loads(text), ensure_ascii=False)


def test_canonical_json_keeps_what_is_not_json():
    assert canonical_json('{"a": 1, "b": tru') == '{"a": 1, "b": tru'
    assert canonical_json('{"a": 1} and then prose') == '{"a": 1}and then prose'
    assert canonical_json('{"big": 1e999}') == '{"big": 1e999}'
    assert canonical_json('"\\ud800"') == '"\\ud800"'  # a lone surrogate stays escaped (valid UTF-8)


@pytest.mark.parametrize("seed", range(8))
def test_lexer_tokens_do_not_depend_on_the_split(seed):
    text = '{"city" : "Paris", "list": [1, 22, 333e1, false], "s": "a\\"b\\\\"}  trailing'
    lexer = JsonLexer()
    pieces = [t for piece in random_pieces(text, seed) for t in lexer.feed(piece)] + lexer.finish()
    assert "".join(t.canonical for t in pieces) == canonical_json(text)


# ---- unit: the three tool-call streams --------------------------------------------------------
def test_named_stream():
    text = '{ "city":"Lima" ,"days": 3 }'
    expected = assert_stream_equals_whole(lambda: ChoiceAssembler(None, NamedToolStream("get_weather")), text)
    assert expected == {"reasoning": None, "content": "",
                        "calls": [("get_weather", '{"city": "Lima", "days": 3}')]}


def test_named_stream_cut_by_max_tokens_keeps_what_was_generated():
    expected = assert_stream_equals_whole(lambda: ChoiceAssembler(None, NamedToolStream("f")), '{"city": "Li')
    assert expected["calls"] == [("f", '{"city": "Li')]


@pytest.mark.parametrize("text,calls,content", [
    ('[{"name": "get_time", "parameters": {"zone": "utc"}}, {"name":"get_weather","parameters":{"city":"Paris",'
     '"days":2}}]', [("get_time", '{"zone": "utc"}'), ("get_weather", '{"city": "Paris", "days": 2}')], ""),
    ('[{"parameters": {"zone": "cet"}, "name": "get_time"}]', [("get_time", '{"zone": "cet"}')], ""),
    ('[{"name": "get_time", "parameters": {"zone": "u', [("get_time", '{"zone": "u')], ""),  # cut
    ('not a tool call at all', [], "not a tool call at all"),
    ('[{"name": 5}]', [], '[{"name": 5}]'),
    ('[{"name": "a", "parameters": {}}] trailing', [("a", "{}")], "trailing"),
])
def test_required_stream(text, calls, content):
    expected = assert_stream_equals_whole(lambda: ChoiceAssembler(None, RequiredToolsStream()), text)
    assert expected["calls"] == calls and expected["content"] == content


HERMES_TEXT = ('Let me look.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "days": 2}}\n'
               '</tool_call>\n<tool_call>\n{"name": "get_time", "arguments": {"zone": "utc"}}\n</tool_call>')


@pytest.mark.parametrize("parallel", [True, False])
def test_auto_stream_with_hermes(parallel):
    parser = get_tool_parser("hermes")(None)
    expected = assert_stream_equals_whole(lambda: ChoiceAssembler(None, AutoToolStream(parser, parallel)),
                                          HERMES_TEXT)
    calls = [("get_weather", '{"city": "Paris", "days": 2}'), ("get_time", '{"zone": "utc"}')]
    assert expected["calls"] == (calls if parallel else calls[:1])
    assert expected["content"] == "Let me look."


def test_auto_stream_with_prose_only_is_content():
    parser = get_tool_parser("hermes")(None)
    expected = assert_stream_equals_whole(lambda: ChoiceAssembler(None, AutoToolStream(parser)),
                                          "No tools needed <tool_call> here, as text.")
    assert expected["calls"] == [] and "tool_call" in expected["content"]


def test_finish_reason_rules():
    assembler = ChoiceAssembler(None, NamedToolStream("f"))
    assembler.feed("{}")
    assembler.finish()
    assert assembler.finish_reason("stop") == "tool_calls"
    assert assembler.finish_reason("length") == "length"
    plain = ChoiceAssembler(None, RequiredToolsStream())
    plain.feed("prose")
    plain.finish()
    assert plain.finish_reason("stop") == "stop"


def test_a_failing_parser_gives_content():
    class Broken:
        def streaming(self):
            return self

        def feed(self, text):
            raise RuntimeError("parser bug")

        def finish(self):
            raise RuntimeError("parser bug")

    message = assemble_message(ChoiceAssembler(None, AutoToolStream(Broken())), "some text")
    assert message["content"] == "some text" and message["tool_calls"] == []


# ---- end to end --------------------------------------------------------------------------------
def _call_args(call) -> dict:
    return json.loads(call.function.arguments)


def test_named_tool_choice(tools_client):
    response = tools_client.chat.completions.create(
        model=MODEL_NAME, messages=MESSAGES, tools=TOOLS, max_tokens=200, temperature=1.0, seed=3, n=3,
        tool_choice={"type": "function", "function": {"name": "get_weather"}},
        extra_body={"chat_template": THINKING_OFF})
    assert len(response.choices) == 3
    for choice in response.choices:
        assert choice.finish_reason == "tool_calls", choice
        assert choice.message.content is None
        [call] = choice.message.tool_calls
        assert call.type == "function" and call.id.startswith("call_") and call.function.name == "get_weather"
        jsonschema.validate(_call_args(call), WEATHER)
        assert call.function.arguments == json.dumps(_call_args(call))


@pytest.mark.parametrize("parallel", [False, True])
def test_required_tool_choice(tools_client, parallel):
    response = tools_client.chat.completions.create(
        model=MODEL_NAME, messages=MESSAGES, tools=TOOLS, tool_choice="required", parallel_tool_calls=parallel,
        max_tokens=300, temperature=1.0, seed=4, n=2, extra_body={"chat_template": THINKING_OFF})
    for choice in response.choices:
        if parallel and choice.finish_reason == "length":  # a random model may list calls for long
            assert choice.message.tool_calls
            continue
        assert choice.finish_reason == "tool_calls", choice
        calls = choice.message.tool_calls
        assert len(calls) >= 1 and (parallel or len(calls) == 1)
        for call in calls:
            jsonschema.validate(_call_args(call), SCHEMAS[call.function.name])


def rebuild_stream(stream) -> dict[int, dict]:
    """Concatenate a chat stream's deltas per choice, as a client would."""
    choices: dict[int, dict] = {}
    for chunk in stream:
        for c in chunk.choices:
            got = choices.setdefault(c.index, {"content": "", "reasoning": "", "calls": {}, "finish_reason": None})
            got["content"] += c.delta.content or ""
            got["reasoning"] += getattr(c.delta, "reasoning_content", None) or ""
            for delta in c.delta.tool_calls or []:
                if delta.index not in got["calls"]:
                    assert delta.id and delta.type == "function" and delta.function.name
                    got["calls"][delta.index] = [delta.function.name, delta.function.arguments or ""]
                else:
                    assert delta.id is None and delta.function.name is None
                    got["calls"][delta.index][1] += delta.function.arguments or ""
            if c.finish_reason is not None:
                got["finish_reason"] = c.finish_reason
    return choices


def flatten_response(response) -> dict[int, dict]:
    return {c.index: {"content": c.message.content or "",
                      "reasoning": getattr(c.message, "reasoning_content", None) or "",
                      "calls": {i: [t.function.name, t.function.arguments]
                                for i, t in enumerate(c.message.tool_calls or [])},
                      "finish_reason": c.finish_reason} for c in response.choices}


@pytest.mark.parametrize("tool_choice", [{"type": "function", "function": {"name": "get_weather"}}, "required",
                                         "auto"])
def test_stream_concatenates_to_the_response(tools_client, tool_choice):
    kwargs = dict(model=MODEL_NAME, messages=MESSAGES, tools=TOOLS, tool_choice=tool_choice, max_tokens=120,
                  temperature=1.0, seed=21, n=2, extra_body={"chat_template": THINKING_OFF})
    whole_response = flatten_response(tools_client.chat.completions.create(**kwargs))
    assert rebuild_stream(tools_client.chat.completions.create(stream=True, **kwargs)) == whole_response


def test_auto_tool_choice_answers_with_a_valid_shape(tools_client):
    # A random model does not write <tool_call> by itself: this checks the path and the shape.
    for stream in (False, True):
        kwargs = dict(model=MODEL_NAME, messages=MESSAGES, tools=TOOLS, max_tokens=30, seed=1, stream=stream,
                      extra_body={"chat_template": THINKING_OFF})
        if stream:
            assert rebuild_stream(tools_client.chat.completions.create(**kwargs))[0]["finish_reason"] in ("stop", "length")
        else:
            choice = tools_client.chat.completions.create(**kwargs).choices[0]
            assert choice.finish_reason in ("stop", "length") and not choice.message.tool_calls
            assert isinstance(choice.message.content, str)


def test_tool_conversation_is_accepted(tools_client):
    messages = MESSAGES + [
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_1", "type": "function",
             "function": {"name": "get_weather", "arguments": '{"city": "Paris", "days": 1}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny"}]
    response = tools_client.chat.completions.create(model=MODEL_NAME, messages=messages, tools=TOOLS,
                                                    tool_choice="none", max_tokens=5)
    assert response.choices[0].message.tool_calls in (None, [])


def _tool(name="f", parameters=None, type_="function"):
    function = {"name": name}
    if parameters is not None:
        function["parameters"] = parameters
    return {"type": type_, "function": function}


BAD = [
    ("tool type", {"tools": [_tool(type_="retrieval")]}, "tools"),
    ("tool without function", {"tools": [{"type": "function"}]}, "tools"),
    ("function without name", {"tools": [{"type": "function", "function": {"parameters": TIME}}]}, "tools"),
    ("duplicate names", {"tools": [_tool("f"), _tool("f")]}, "tools"),
    ("parameters not an object schema", {"tools": [_tool(parameters={"type": "string"})]}, "tools"),
    ("parameters a list", {"tools": [_tool(parameters=[1])]}, "tools"),
    ("bad function name", {"tools": [_tool(name="no spaces please")]}, "tools"),
    ("unknown tool in tool_choice", {"tools": [_tool("f")],
                                     "tool_choice": {"type": "function", "function": {"name": "g"}}}, "tool_choice"),
    ("tool_choice without tools", {"tool_choice": "required"}, "tool_choice"),
    ("tool_choice nonsense", {"tools": [_tool()], "tool_choice": "sometimes"}, "tool_choice"),
    ("constraint with named choice", {"tools": [_tool()], "guided_regex": "a",
                                      "tool_choice": {"type": "function", "function": {"name": "f"}}},
     "guided_regex"),
    ("constraint with required", {"tools": [_tool()], "tool_choice": "required",
                                  "response_format": {"type": "json_object"}}, "response_format"),
    ("invalid parameters schema", {"tools": [_tool(parameters={"type": "object", "properties": {"a": {
        "type": "nonsense"}}})], "tool_choice": "required"}, "tools"),
]


@pytest.mark.parametrize("name,fields,param", BAD, ids=[c[0] for c in BAD])
def test_bad_tools_are_400(tools_server, name, fields, param):
    body = {"model": MODEL_NAME, "messages": MESSAGES, "max_tokens": 5, **fields}
    with tools_server.client() as client:
        check_error(client.post(CHAT, json=body), 400, param)


def test_auto_needs_the_server_flags(server):
    with server.client() as client:
        for fields in ({"tools": [_tool()]}, {"tools": [_tool()], "tool_choice": "auto"}):
            body = {"model": MODEL_NAME, "messages": MESSAGES, "max_tokens": 5, **fields}
            error = check_error(client.post(CHAT, json=body), 400, "tool_choice")
            assert error["message"] == AUTO_NEEDS_FLAGS
        # Named and required need no parser.
        body = {"model": MODEL_NAME, "messages": MESSAGES, "max_tokens": 60, "tools": [_tool(parameters=TIME)],
                "tool_choice": {"type": "function", "function": {"name": "f"}}}
        message = client.post(CHAT, json=body).json()["choices"][0]["message"]
        assert message["tool_calls"][0]["function"]["name"] == "f"
