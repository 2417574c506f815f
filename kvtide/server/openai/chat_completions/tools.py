"""A chat request's tools and tool_choice: validation, what the chat template sees, and the
constraint that makes a named or "required" choice always produce well-formed calls.

    tool_choice        output constraint                                  parsed by
    "none" / no tools  none                                               -
    "auto"             none                                               --tool-call-parser
    {"function": f}    f's parameters schema                              NamedToolStream
    "required"         [{"name": f, "parameters": ...}, ...] (minItems 1)  RequiredToolsStream
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any

from kvtide.server.errors import OpenAIError
from kvtide.server.limits import RequestLimits
from kvtide.server.openai.chat_completions.protocol import ChatCompletionRequest, ChatTool
from kvtide.server.openai.chat_completions.tool_call_streams import (
    AutoToolStream,
    NamedToolStream,
    PlainStream,
    RequiredToolsStream,
)

AUTO_NEEDS_FLAGS = '"auto" tool choice requires --enable-auto-tool-choice and --tool-call-parser to be set'
EMPTY_PARAMETERS: dict[str, Any] = {"type": "object", "properties": {}}
_NAME = re.compile(r"[A-Za-z0-9_.:-]{1,64}")


@dataclass(frozen=True)
class ToolPlan:
    """What a request's tools mean for its output."""

    mode: str
    """"none", "auto", "named" or "required"."""
    tools: list[dict[str, Any]]
    """The tools as the chat template gets them (OpenAI's shape, parameters filled in)."""
    name: str | None = None
    """The function a named tool_choice calls."""
    parallel_tool_calls: bool = True

    def constraint(self) -> dict[str, Any] | None:
        """The JSON schema the answer must follow (named and "required" only)."""
        by_name = {t["function"]["name"]: t["function"]["parameters"] for t in self.tools}
        if self.mode == "named":
            assert self.name is not None
            return by_name[self.name]
        if self.mode != "required":
            return None
        calls = [{"type": "object", "properties": {"name": {"type": "string", "enum": [name]},
                                                    "parameters": parameters},
                  "required": ["name", "parameters"], "additionalProperties": False}
                 for name, parameters in by_name.items()]
        schema: dict[str, Any] = {"type": "array", "minItems": 1,
                                  "items": calls[0] if len(calls) == 1 else {"anyOf": calls}}
        if not self.parallel_tool_calls:
            schema["maxItems"] = 1
        return schema

    def stream(self, tool_parser: Any) -> Any:
        """A fresh per-choice parser of the answer (tool_call_streams.py)."""
        if self.mode == "named":
            assert self.name is not None
            return NamedToolStream(self.name)
        if self.mode == "required":
            return RequiredToolsStream()
        if self.mode == "auto":
            return AutoToolStream(tool_parser, self.parallel_tool_calls)
        return PlainStream()


def plan_tools(request: ChatCompletionRequest, auto_tool_choice: bool,
               limits: RequestLimits | None = None) -> ToolPlan:
    """Validate tools and tool_choice (400s with OpenAI's param) and decide the mode. As in vLLM,
    tools without a tool_choice mean "auto", which needs the server's tool parser."""
    choice = request.tool_choice
    if not request.tools:
        if choice is not None and choice != "none":
            raise OpenAIError("tool_choice is only allowed when tools are given", 400, param="tool_choice")
        return ToolPlan("none", [], parallel_tool_calls=request.parallel_tool_calls)
    check_tool_limits(request.tools, limits or RequestLimits())
    tools = [_tool_dict(tool, i) for i, tool in enumerate(request.tools)]
    names = [t["function"]["name"] for t in tools]
    duplicates = sorted({n for n in names if names.count(n) > 1})
    if duplicates:
        raise OpenAIError(f"tools: duplicate function name(s) {', '.join(duplicates)}", 400, param="tools")
    if choice is None:
        choice = "auto"
    if isinstance(choice, str):
        if choice == "auto" and not auto_tool_choice:
            raise OpenAIError(AUTO_NEEDS_FLAGS, 400, param="tool_choice")
        return ToolPlan(choice, tools, parallel_tool_calls=request.parallel_tool_calls)
    if choice.type != "function":
        raise OpenAIError(f"tool_choice.type must be 'function', got {choice.type!r}", 400, param="tool_choice")
    if choice.function.name not in names:
        raise OpenAIError(f"tool_choice names function {choice.function.name!r}, which is not in tools", 400,
                          param="tool_choice")
    return ToolPlan("named", tools, choice.function.name, request.parallel_tool_calls)


def check_tool_limits(tools: list[ChatTool], limits: RequestLimits) -> None:
    """Every tool is rendered into the prompt and, for a named or "required" choice, compiled into
    the grammar: their number and size are capped before either happens."""
    if len(tools) > limits.max_tools:
        raise OpenAIError(f"tools: at most {limits.max_tools} tools, got {len(tools)}", 400, param="tools")
    size = 0
    for tool in tools:
        size += len(json.dumps(tool.model_dump(exclude_none=True), ensure_ascii=False).encode("utf-8", "surrogatepass"))
        if size > limits.max_tools_bytes:
            raise OpenAIError(f"tools: at most {limits.max_tools_bytes} bytes of tool definitions together (as "
                              f"JSON)", 400, param="tools")


def _tool_dict(tool: ChatTool, index: int) -> dict[str, Any]:
    where = f"tools[{index}]"
    if tool.type != "function":
        raise OpenAIError(f"{where}.type must be 'function', got {tool.type!r}", 400, param="tools")
    function = tool.function
    if not _NAME.fullmatch(function.name):
        raise OpenAIError(f"{where}.function.name must be 1-64 letters, digits or _.:-, got {function.name!r}",
                          400, param="tools")
    parameters = function.parameters
    if parameters is None:
        parameters = dict(EMPTY_PARAMETERS)
    elif parameters.get("type") != "object":
        raise OpenAIError(f"{where}.function.parameters must be a JSON schema of an object "
                          f'({{"type": "object", ...}}), got {json.dumps(parameters)[:200]}', 400, param="tools")
    result: dict[str, Any] = {"name": function.name, "parameters": parameters}
    if function.description is not None:
        result["description"] = function.description
    if function.strict is not None:
        result["strict"] = function.strict
    return {"type": "function", "function": result}
