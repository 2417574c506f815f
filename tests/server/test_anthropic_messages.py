"""POST /v1/messages (Anthropic's Messages API) through the `anthropic` client, streamed and not,
against a real server: the answer equals /v1/chat/completions on the equivalent messages
(greedy), the stream's events add up to the whole message, a tool call round-trips, stop
sequences stop; errors come in Anthropic's shape.

As in test_tool_calling.py, requests that want text or tool calls use THINKING_OFF (the server
runs --reasoning-parser deepseek_r1); without it the random model's answer is all "thinking".
"""

from __future__ import annotations

import json

import anthropic
import jsonschema
import pytest
from serve_helpers import API_KEY, MODEL_NAME
from test_tool_calling import THINKING_OFF, WEATHER

OFF = {"chat_template": THINKING_OFF}
GREEDY = {"temperature": 0.0}
"""Sampling fields go in extra_body: recent `anthropic` clients no longer take them as arguments."""
TOOLS = [{"name": "get_weather", "description": "Weather", "input_schema": WEATHER}]
CHAT_TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Weather",
                                                "parameters": WEATHER}}]
USER = {"role": "user", "content": "What is the weather in Paris?"}


@pytest.fixture(scope="module")
def client(tools_server):
    return anthropic.Anthropic(base_url=tools_server.base_url, api_key=API_KEY, max_retries=0, timeout=120.0)


def chat_answer(tools_client, messages, max_tokens, **kwargs):
    """The same conversation through /v1/chat/completions (greedy): the ground truth."""
    return tools_client.chat.completions.create(model=MODEL_NAME, messages=messages, max_tokens=max_tokens,
                                                temperature=0.0, extra_body=OFF, **kwargs)


def blocks_of(message) -> list:
    result = []
    for block in message.content:
        if block.type == "tool_use":
            result.append(("tool_use", block.name, block.input))
        else:
            result.append((block.type, getattr(block, "text", None) or getattr(block, "thinking", None)))
    return result


def streamed(client, **kwargs):
    """The raw events, checked in order and rebuilt by hand, and the client's own accumulation."""
    events = list(client.messages.create(stream=True, **kwargs))
    assert events[0].type == "message_start" and events[-2].type == "message_delta"
    assert events[-1].type == "message_stop"
    open_index, texts = None, {}
    for event in events[1:-2]:
        if event.type == "content_block_start":
            assert open_index is None and event.index == len(texts)
            open_index, texts[event.index] = event.index, ""
        elif event.type == "content_block_delta":
            assert event.index == open_index
            delta = event.delta
            texts[event.index] += getattr(delta, "text", None) or getattr(delta, "thinking", None) or \
                getattr(delta, "partial_json", "")
        else:
            assert event.type == "content_block_stop" and event.index == open_index
            open_index = None
    with client.messages.stream(**kwargs) as stream:
        final = stream.get_final_message()
    return events, texts, final


def test_text_equals_chat_and_the_stream_adds_up(client, tools_client):
    kwargs = dict(model=MODEL_NAME, max_tokens=12, system="Be brief.",
                  messages=[{"role": "user", "content": [{"type": "text", "text": "Tell me about Paris."}]}],
                  extra_body={**OFF, **GREEDY})
    message = client.messages.create(**kwargs)
    chat = chat_answer(tools_client, [{"role": "system", "content": "Be brief."},
                                      {"role": "user", "content": "Tell me about Paris."}], 12)
    assert message.type == "message" and message.role == "assistant" and message.id.startswith("msg_")
    assert blocks_of(message) == [("text", chat.choices[0].message.content)]
    assert message.stop_reason == "max_tokens" and message.stop_sequence is None
    assert message.usage.input_tokens == chat.usage.prompt_tokens and message.usage.output_tokens == 12
    events, texts, final = streamed(client, **kwargs)
    assert list(texts.values()) == [chat.choices[0].message.content]
    assert events[-2].delta.stop_reason == "max_tokens" and events[-2].usage.output_tokens == 12
    assert events[0].message.usage.input_tokens == chat.usage.prompt_tokens
    assert blocks_of(final) == blocks_of(message) and final.stop_reason == message.stop_reason


def test_system_blocks_and_count_tokens(client):
    kwargs = dict(model=MODEL_NAME, max_tokens=6, messages=[USER], tools=TOOLS, tool_choice={"type": "none"},
                  extra_body={**OFF, **GREEDY})
    as_string = client.messages.create(system="Be brief. Really.", **kwargs)
    as_blocks = client.messages.create(system=[{"type": "text", "text": "Be brief. "},
                                               {"type": "text", "text": "Really."}], **kwargs)
    assert blocks_of(as_blocks) == blocks_of(as_string)
    assert as_blocks.usage.input_tokens == as_string.usage.input_tokens and as_blocks.usage.cache_read_input_tokens > 0
    count = client.messages.count_tokens(model=MODEL_NAME, messages=[USER], system="Be brief. Really.", tools=TOOLS,
                                         extra_body=OFF)
    assert count.input_tokens == as_string.usage.input_tokens


def test_stop_sequences(client):
    kwargs = dict(model=MODEL_NAME, max_tokens=24, messages=[USER], extra_body={**OFF, **GREEDY})
    text = client.messages.create(**kwargs).content[0].text
    # A random model's text: the first two visible characters after the fourth make the stop string.
    stop = next(text[i:i + 2] for i in range(4, len(text) - 1)
                if "\ufffd" not in text[i:i + 2] and text[i:i + 2].isprintable() and text[i:i + 2].strip())
    message = client.messages.create(stop_sequences=[stop], **kwargs)
    assert message.stop_reason == "stop_sequence" and message.stop_sequence == stop
    assert message.content[0].text == text[:text.index(stop)]
    assert streamed(client, stop_sequences=[stop], **kwargs)[0][-2].delta.stop_sequence == stop


def test_thinking_block(client, tools_client):
    kwargs = dict(model=MODEL_NAME, max_tokens=10, messages=[USER], extra_body=GREEDY)
    message = client.messages.create(**kwargs)
    chat = tools_client.chat.completions.create(model=MODEL_NAME, messages=[USER], max_tokens=10, temperature=0.0)
    assert blocks_of(message) == [("thinking", chat.choices[0].message.reasoning_content)]
    _, _, final = streamed(client, **kwargs)
    assert blocks_of(final) == blocks_of(message)


def test_tool_use_round_trip(client, tools_client):
    kwargs = dict(model=MODEL_NAME, max_tokens=100, messages=[USER], tools=TOOLS,
                  tool_choice={"type": "tool", "name": "get_weather"}, extra_body={**OFF, **GREEDY})
    message = client.messages.create(**kwargs)
    [call] = message.content
    assert call.type == "tool_use" and call.name == "get_weather" and call.id.startswith("toolu_")
    assert message.stop_reason == "tool_use"
    jsonschema.validate(call.input, WEATHER)
    events, texts, final = streamed(client, **kwargs)
    assert json.loads(list(texts.values())[0]) == call.input  # the input_json_deltas
    assert blocks_of(final) == blocks_of(message) and final.stop_reason == "tool_use"
    # The call goes back with its result; the answer equals chat's on the same conversation.
    messages = [USER, {"role": "assistant", "content": [block.model_dump(exclude_none=True) for block in message.content]},
                {"role": "user", "content": [{"type": "tool_result", "tool_use_id": call.id, "content": "sunny"}]}]
    answer = client.messages.create(model=MODEL_NAME, max_tokens=8, messages=messages, tools=TOOLS,
                                    tool_choice={"type": "none"}, extra_body={**OFF, **GREEDY})
    chat = chat_answer(tools_client, [
        USER, {"role": "assistant", "content": None, "tool_calls": [
            {"id": call.id, "type": "function",
             "function": {"name": "get_weather", "arguments": json.dumps(call.input)}}]},
        {"role": "tool", "tool_call_id": call.id, "content": "sunny"}], 8, tools=CHAT_TOOLS, tool_choice="none")
    assert blocks_of(answer) == [("text", chat.choices[0].message.content)]
    assert answer.usage.input_tokens == chat.usage.prompt_tokens


def test_any_tool_choice_streams_its_calls(client):
    kwargs = dict(model=MODEL_NAME, max_tokens=120, messages=[USER], tools=TOOLS,
                  tool_choice={"type": "any", "disable_parallel_tool_use": True}, extra_body={**OFF, **GREEDY})
    message = client.messages.create(**kwargs)
    assert message.content[0].type == "tool_use"
    _, _, final = streamed(client, **kwargs)
    assert blocks_of(final) == blocks_of(message)


def _body(**fields):
    return {"model": MODEL_NAME, "max_tokens": 4, "messages": [USER], **fields}


BAD = [
    ("no max_tokens", {"model": MODEL_NAME, "messages": [USER]}, 400),
    ("no messages", _body(messages=[]), 400),
    ("image block", _body(messages=[{"role": "user", "content": [
        {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "AA=="}}]}]), 400),
    ("tool_use in a user message", _body(messages=[{"role": "user", "content": [
        {"type": "tool_use", "id": "t", "name": "f", "input": {}}]}]), 400),
    ("server tool", _body(tools=[{"type": "web_search_20250305", "name": "web_search", "input_schema": {}}]), 400),
    ("tool choice of an unknown tool", _body(tools=TOOLS, tool_choice={"type": "tool", "name": "g"}), 400),
    ("not an object schema", _body(tools=[{"name": "f", "input_schema": {"type": "string"}}],
                                   tool_choice={"type": "any"}), 400),
    ("too many tokens", _body(max_tokens=100_000), 400),
    ("not JSON", b"{nope", 400),
    ("not UTF-8", b"\xea\x81\xd1", 400),
    ("unknown model", _body(model="claude-nope"), 404),
]


@pytest.mark.parametrize("name,body,status", BAD, ids=[c[0] for c in BAD])
def test_errors_in_anthropics_shape(tools_server, name, body, status):
    with tools_server.client() as http:
        if isinstance(body, bytes):
            response = http.post("/v1/messages", content=body, headers={"content-type": "application/json"})
        else:
            response = http.post("/v1/messages", json=body)
    assert response.status_code == status, response.text
    error = response.json()
    assert set(error) == {"type", "error"} and error["type"] == "error"
    assert error["error"]["type"] == ("invalid_request_error" if status == 400 else "not_found_error")
    assert isinstance(error["error"]["message"], str) and error["error"]["message"]


def test_the_client_raises_its_own_errors(client):
    with pytest.raises(anthropic.BadRequestError) as info:
        client.messages.create(model=MODEL_NAME, max_tokens=5_000, messages=[USER])
    assert info.value.body["error"]["type"] == "invalid_request_error"
    with pytest.raises(anthropic.NotFoundError):
        client.messages.create(model="claude-nope", max_tokens=4, messages=[USER])
