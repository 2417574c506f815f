"""Validity as a property: under every kind of constraint, every output of the tiny random
checkpoint (which knows nothing of JSON) parses and validates, sampled at temperature 1 with
many seeds. Each test batches its samples into one generate call."""

from __future__ import annotations

import json
import re

import jsonschema
import pytest

from kvtide import LLM, SamplingParams
from kvtide.sampling_params import StructuredOutputsParams

NUM_SAMPLES = 48
MAX_TOKENS = 400

SCHEMAS = {
    "nested": {
        "type": "object",
        "properties": {
            "user": {"type": "object", "properties": {"name": {"type": "string", "minLength": 1, "maxLength": 6},
                                                      "id": {"type": "integer", "minimum": 1, "maximum": 999}},
                     "required": ["name", "id"]},
            "active": {"type": "boolean"},
        },
        "required": ["user", "active"],
    },
    "arrays_and_enums": {
        "type": "object",
        "properties": {"tags": {"type": "array", "items": {"enum": ["red", "green", "blue"]}, "minItems": 1,
                                "maxItems": 3},
                       "level": {"enum": [1, 2, 3]}},
        "required": ["tags", "level"],
    },
    "numbers_and_optional": {
        "type": "object",
        "properties": {"score": {"type": "number", "minimum": -5, "maximum": 5},
                       "count": {"type": "integer", "exclusiveMinimum": 0, "maximum": 50},
                       "note": {"type": "string", "maxLength": 4}},
        "required": ["score", "count"],
    },
    "any_of": {
        "type": "object",
        "properties": {"value": {"anyOf": [{"type": "integer", "minimum": 0, "maximum": 9},
                                           {"type": "string", "enum": ["none", "all"]},
                                           {"type": "null"}]}},
        "required": ["value"],
    },
    "pattern_and_format": {
        "type": "object",
        "properties": {"code": {"type": "string", "pattern": "^[A-Z]{2}-[0-9]{3}$"},
                       "id": {"type": "string", "format": "uuid"}},
        "required": ["code", "id"],
    },
}


@pytest.fixture(scope="module")
def llm(llama_dir):
    return LLM(llama_dir, device="cpu", dtype="float32", max_model_len=512, kv_cache_memory="48MiB")


def sample(llm, constraint: StructuredOutputsParams, num: int = NUM_SAMPLES, **kwargs) -> list:
    params = [SamplingParams(temperature=1.0, seed=seed, max_tokens=MAX_TOKENS, structured_outputs=constraint,
                             **kwargs) for seed in range(num)]
    outputs = [o.outputs[0] for o in llm.generate([f"Request {seed}:" for seed in range(num)], params)]
    assert all(o.finish_reason == "stop" for o in outputs), [(o.finish_reason, o.text) for o in outputs]
    return outputs


@pytest.mark.parametrize("name", list(SCHEMAS))
def test_json_schema_outputs_validate(llm, name):
    schema = SCHEMAS[name]
    for output in sample(llm, StructuredOutputsParams(json=schema)):
        jsonschema.validate(json.loads(output.text), schema, format_checker=jsonschema.FormatChecker())


def test_json_object_outputs_parse_as_objects(llm):
    """Any object may nest without end: the outputs that finish parse as objects, the others are
    a prefix of one (they end by length)."""
    params = [SamplingParams(temperature=1.0, seed=seed, max_tokens=MAX_TOKENS,
                             structured_outputs=StructuredOutputsParams(json_object=True)) for seed in range(16)]
    outputs = [o.outputs[0] for o in llm.generate(["{"] * 16, params)]
    finished = [o for o in outputs if o.finish_reason == "stop"]
    assert len(finished) >= 8
    for output in finished:
        assert isinstance(json.loads(output.text), dict)
    for output in outputs:
        assert output.text.startswith("{")


def test_without_any_whitespace_json_is_in_one_canonical_layout(llm):
    """disable_any_whitespace: one space after ':' and ',' (json.dumps' layout), none elsewhere."""
    schema = SCHEMAS["arrays_and_enums"]  # no free strings: the layout is the only freedom
    for output in sample(llm, StructuredOutputsParams(json=schema, disable_any_whitespace=True), num=16):
        value = json.loads(output.text)
        jsonschema.validate(value, schema)
        assert output.text == json.dumps(value)


def test_regex_outputs_fullmatch(llm):
    pattern = r"(cat|dog)-[0-9]{2,4}(\.[a-z]+)?"
    for output in sample(llm, StructuredOutputsParams(regex=pattern)):
        assert re.fullmatch(pattern, output.text), output.text


def test_choice_outputs_are_choices(llm):
    choices = ["yes", "no", 'say "maybe"', "naïve ü"]
    texts = {o.text for o in sample(llm, StructuredOutputsParams(choice=choices))}
    assert texts <= set(choices) and len(texts) > 1


ARITHMETIC = r"""
root ::= expr
expr ::= term (("+" | "-") term){0,3}
term ::= factor (("*" | "/") factor){0,2}
factor ::= [0-9]{1,3} | "(" expr ")"
"""


def _parse_arithmetic(text: str) -> None:
    """A recursive-descent check of the EBNF above (raises on anything it does not derive)."""
    pos = 0

    def peek() -> str:
        return text[pos] if pos < len(text) else ""

    def factor() -> None:
        nonlocal pos
        if peek() == "(":
            pos += 1
            expr()
            assert peek() == ")", text
            pos += 1
            return
        start = pos
        while peek().isdigit():
            pos += 1
        assert pos > start, text

    def term() -> None:
        nonlocal pos
        factor()
        while peek() and peek() in "*/":
            pos += 1
            factor()

    def expr() -> None:
        nonlocal pos
        term()
        while peek() and peek() in "+-":
            pos += 1
            term()

    expr()
    assert pos == len(text), text


def test_ebnf_outputs_parse_with_the_grammar(llm):
    for output in sample(llm, StructuredOutputsParams(grammar=ARITHMETIC)):
        _parse_arithmetic(output.text)


def test_properties_come_in_the_schema_order(llm):
    schema = {"type": "object", "properties": {"zeta": {"enum": [1]}, "alpha": {"enum": [2]}},
              "required": ["zeta", "alpha"]}
    for output in sample(llm, StructuredOutputsParams(json=schema, disable_any_whitespace=True), num=2):
        assert output.text == '{"zeta": 1, "alpha": 2}'


def test_structural_tag_outputs_hold_the_tagged_json(llm):
    """An xgrammar structural tag: a fixed tag around a JSON section that must match its schema."""
    schema = {"type": "object", "properties": {"city": {"enum": ["Paris", "Oslo"]},
                                               "days": {"type": "integer", "minimum": 1, "maximum": 7}},
              "required": ["city", "days"]}
    tag = {"type": "structural_tag", "format": {"type": "sequence", "elements": [
        {"type": "const_string", "value": "<function=get_weather>"},
        {"type": "json_schema", "json_schema": schema},
        {"type": "const_string", "value": "</function>"}]}}
    for output in sample(llm, StructuredOutputsParams(structural_tag=json.dumps(tag)), num=16):
        match = re.fullmatch(r"<function=get_weather>(.*)</function>", output.text, re.S)
        assert match, output.text
        jsonschema.validate(json.loads(match.group(1)), schema)
