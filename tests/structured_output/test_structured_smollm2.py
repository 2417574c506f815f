"""Structured output on the real SmolLM2-135M-Instruct: schema answers validate and carry the
fields asked for; a constrained tool-call block parses as the hermes format."""

from __future__ import annotations

import json
import re

import jsonschema

from kvtide import SamplingParams
from kvtide.sampling_params import StructuredOutputsParams
from kvtide.tool_parsers import get_tool_parser

PERSON = {
    "type": "object",
    "properties": {"name": {"type": "string", "pattern": "^[A-Za-z ]{1,20}$"},
                   "age": {"type": "integer", "minimum": 0, "maximum": 130},
                   "city": {"type": "string", "pattern": "^[A-Za-z ]{1,20}$"}},
    "required": ["name", "age", "city"],
}

WEATHER_CALL = {
    "type": "object",
    "properties": {"name": {"const": "get_weather"},
                   "arguments": {"type": "object",
                                 "properties": {"city": {"type": "string", "pattern": "^[A-Za-z ]{1,20}$"},
                                                "unit": {"enum": ["celsius", "fahrenheit"]}},
                                 "required": ["city", "unit"]}},
    "required": ["name", "arguments"],
}


def test_json_schema_answers_validate_and_carry_the_fields(smollm2_llm):
    messages = [[{"role": "user", "content": f"Describe a person called {name} as JSON with name, age and city."}]
                for name in ("Alice", "Bob", "Chen")]
    outputs = smollm2_llm.chat(messages, SamplingParams(temperature=0, max_tokens=80,
                                                        structured_outputs=StructuredOutputsParams(json=PERSON)))
    for out in outputs:
        completion = out.outputs[0]
        assert completion.finish_reason == "stop", completion.text
        value = json.loads(completion.text)
        jsonschema.validate(value, PERSON)
        assert set(value) == {"name", "age", "city"}


def test_a_hermes_tool_call_block_for_a_weather_tool(smollm2_llm):
    """The block a hermes-style model writes, constrained to the tool's argument shape, read back
    by the hermes tool parser."""
    messages = [{"role": "system", "content": "You can call get_weather(city, unit). Answer with a tool call."},
                {"role": "user", "content": "What is the weather in Paris?"}]
    pattern = r'<tool_call>\n\{"name": "get_weather", "arguments": \{"city": "[A-Za-z ]{1,20}", ' \
              r'"unit": "(celsius|fahrenheit)"\}\}\n</tool_call>'
    out = smollm2_llm.chat([messages], SamplingParams(temperature=0, max_tokens=60,
                                                     structured_outputs=StructuredOutputsParams(regex=pattern)))[0]
    text = out.outputs[0].text
    assert re.fullmatch(pattern, text), text
    parsed = get_tool_parser("hermes")(smollm2_llm.get_tokenizer()).extract_tool_calls(text)
    assert parsed.content is None and [c.name for c in parsed.tool_calls] == ["get_weather"]
    jsonschema.validate({"name": "get_weather", "arguments": json.loads(parsed.tool_calls[0].arguments)},
                        WEATHER_CALL)
