"""SmolLM2-135M-Instruct behind `kvtide serve`, through the official openai client: a json_schema
response_format answer that validates and carries the asked fields, and a weather tool call
(required and named tool_choice; auto through the hermes parser)."""

from __future__ import annotations

import json

import jsonschema
import openai
import pytest
from serve_helpers import API_KEY, MODEL_NAME, launch_server

PERSON = {"type": "object",
          "properties": {"name": {"type": "string", "pattern": "^[A-Za-z ]{1,20}$"},
                         "age": {"type": "integer", "minimum": 0, "maximum": 130}},
          "required": ["name", "age"], "additionalProperties": False}
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Current weather in a city",
    "parameters": {"type": "object",
                   "properties": {"city": {"type": "string", "pattern": "^[A-Za-z ]{1,20}$"},
                                  "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}},
                   "required": ["city", "unit"]}}}
ASK = [{"role": "user", "content": "What is the weather in Paris, in celsius?"}]


@pytest.fixture(scope="module")
def client():
    server = launch_server("smollm2", "--max-model-len", "1024", "--kv-cache-memory", "64MiB",
                           "--enable-auto-tool-choice", "--tool-call-parser", "hermes")
    try:
        yield openai.OpenAI(base_url=server.url("/v1"), api_key=API_KEY, max_retries=0, timeout=120.0)
    finally:
        assert server.stop() == 0


def test_json_schema_response_format(client):
    response = client.chat.completions.create(
        model=MODEL_NAME, temperature=0, max_tokens=60,
        messages=[{"role": "user", "content": "Give the name and age of a famous scientist as JSON."}],
        response_format={"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON}})
    choice = response.choices[0]
    assert choice.finish_reason == "stop"
    value = json.loads(choice.message.content)
    jsonschema.validate(value, PERSON)
    assert set(value) == {"name", "age"}


@pytest.mark.parametrize("tool_choice, parallel", [
    ("required", True), ("required", False), ({"type": "function", "function": {"name": "get_weather"}}, True),
], ids=["required", "required-single", "named"])
def test_weather_tool_call(client, tool_choice, parallel):
    response = client.chat.completions.create(model=MODEL_NAME, temperature=0, max_tokens=120, messages=ASK,
                                              tools=[WEATHER], tool_choice=tool_choice, parallel_tool_calls=parallel)
    choice = response.choices[0]
    assert choice.finish_reason == "tool_calls"
    calls = choice.message.tool_calls
    assert len(calls) >= 1 if parallel else len(calls) == 1
    for call in calls:
        assert call.type == "function" and call.function.name == "get_weather" and call.id.startswith("call_")
        jsonschema.validate(json.loads(call.function.arguments), WEATHER["function"]["parameters"])


def test_auto_tool_choice_answers_in_one_of_the_two_shapes(client):
    """Whether the 135M model decides to call the tool is its own business; the response is either
    a hermes tool call parsed into tool_calls or plain content, never both half-parsed."""
    response = client.chat.completions.create(model=MODEL_NAME, temperature=0, max_tokens=80, messages=ASK,
                                              tools=[WEATHER], tool_choice="auto")
    choice = response.choices[0]
    if choice.message.tool_calls:
        assert choice.finish_reason == "tool_calls"
        assert all(c.function.name == "get_weather" for c in choice.message.tool_calls)
        assert "<tool_call>" not in (choice.message.content or "")
    else:
        assert choice.finish_reason in ("stop", "length") and choice.message.content
