"""The request fields that constrain the output (OpenAI's response_format, vLLM's structured_outputs
and its older guided_* fields) and their translation into one StructuredOutputsParams.

A request names at most one constraint: two would have to hold at once, which no grammar
backend composes, so naming both is a 400 rather than a silent choice of one.
"""

from __future__ import annotations

import json
from typing import Any, Literal

from pydantic import Field

from kvtide.sampling_params import SamplingParams, StructuredOutputsParams
from kvtide.server.errors import OpenAIError, from_value_error
from kvtide.server.openai import offload
from kvtide.server.openai.common import OpenAIBaseModel

SUPPORTED_BACKENDS = ("xgrammar", "auto")
"""guided_decoding_backend values accepted: the engine compiles every constraint with xgrammar."""


class JsonSchemaFormat(OpenAIBaseModel):
    name: str
    description: str | None = None
    schema_: dict[str, Any] | None = Field(default=None, alias="schema")
    strict: bool | None = None
    """Accepted and always true: the engine masks every token the schema forbids."""


class ResponseFormat(OpenAIBaseModel):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


class StructuredOutputsRequest(OpenAIBaseModel):
    """vLLM's `structured_outputs` object: StructuredOutputsParams' public fields."""

    json_: str | dict[str, Any] | None = Field(default=None, alias="json")
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    structural_tag: str | None = None
    disable_any_whitespace: bool = False
    disable_additional_properties: bool = False
    whitespace_pattern: str | None = None


class StructuredOutputFields(OpenAIBaseModel):
    """The constraint fields /v1/completions and /v1/chat/completions share."""

    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputsRequest | None = None
    guided_json: str | dict[str, Any] | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    guided_whitespace_pattern: str | None = None
    guided_decoding_backend: str | None = None

    def constraint_sources(self) -> list[str]:
        """The fields of this request that ask for a constraint, in the order they are declared."""
        sources = []
        if self.response_format is not None and self.response_format.type != "text":
            sources.append("response_format")
        if self.structured_outputs is not None:
            sources.append("structured_outputs")
        sources += [name for name in ("guided_json", "guided_regex", "guided_choice", "guided_grammar")
                    if getattr(self, name) is not None]
        return sources


def structured_outputs_of(request: StructuredOutputFields) -> tuple[StructuredOutputsParams | None, str | None]:
    """The request's constraint and the field it came from (None, None: unconstrained)."""
    backend = request.guided_decoding_backend
    if backend is not None and backend not in SUPPORTED_BACKENDS:
        raise OpenAIError(f"guided_decoding_backend {backend!r} is not available; this server compiles "
                          f"constraints with xgrammar (send 'xgrammar', 'auto' or nothing)", 400,
                          param="guided_decoding_backend")
    if request.guided_whitespace_pattern is not None:
        raise OpenAIError("guided_whitespace_pattern is not supported by the xgrammar backend; use "
                          "structured_outputs.disable_any_whitespace", 400, param="guided_whitespace_pattern")
    sources = request.constraint_sources()
    if len(sources) > 1:
        raise OpenAIError(f"give at most one output constraint; got {', '.join(sources)}", 400, param=sources[1])
    if not sources:
        return None, None
    return make_structured_outputs(_fields_of(request, sources[0]), sources[0]), sources[0]


def make_structured_outputs(fields: dict[str, Any], param: str) -> StructuredOutputsParams:
    """StructuredOutputsParams(**fields); its ValueError is a 400 naming `param`."""
    try:
        return StructuredOutputsParams(**fields)
    except ValueError as e:
        raise OpenAIError(f"{param}: {e}", 400, param=param) from e


def constraint_error(error: ValueError, source: str | None) -> OpenAIError:
    """The engine's refusal of a constraint (a bad schema, regex or grammar), naming the request
    field it came from rather than the internal structured_outputs."""
    result = from_value_error(error)
    if source is not None and result.param == "structured_outputs":
        result.param = source
    return result


async def check_constraint_off_loop(engine: Any, params: SamplingParams, source: str | None) -> None:
    """Parse the request's constraint (seconds for a large schema) on a worker thread, so that the
    engine's own check when the request is added finds it already parsed (input_processor.py)."""
    if params.structured_outputs is None:
        return
    try:
        await offload.render(engine.input_processor.check_params, params, 0)
    except ValueError as e:
        raise constraint_error(e, source) from e


def _fields_of(request: StructuredOutputFields, source: str) -> dict[str, Any]:
    if source == "response_format":
        assert request.response_format is not None
        if request.response_format.type == "json_object":
            return {"json_object": True}
        schema = request.response_format.json_schema
        if schema is None or schema.schema_ is None:
            raise OpenAIError("response_format json_schema needs json_schema.schema", 400,
                              param="response_format")
        return {"json": json.dumps(schema.schema_)}
    if source == "structured_outputs":
        assert request.structured_outputs is not None
        fields = request.structured_outputs.model_dump(exclude_none=True, by_alias=True)
        if isinstance(fields.get("json"), dict):
            fields["json"] = json.dumps(fields["json"])
        return fields
    value = getattr(request, source)
    kind = source.removeprefix("guided_")
    if kind == "json" and not isinstance(value, str):
        value = json.dumps(value)
    return {kind: value}
