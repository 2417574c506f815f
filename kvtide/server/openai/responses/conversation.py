"""A Responses request in chat terms: its input items as chat messages, its tools, tool_choice and
text.format as the chat fields that mean the same, so the chat machinery serves it unchanged.

    instructions                        -> a leading "system" message
    message (system/developer/user/...) -> a message of that role ("developer" reads as "system")
    reasoning                           -> reasoning_content of the next assistant message
    function_call                       -> a tool call of the assistant message before it (or a new one)
    function_call_output                -> a "tool" message answering that call_id
"""

from __future__ import annotations

from typing import Any

from kvtide.server.errors import OpenAIError
from kvtide.server.openai.responses.protocol import ContentPart, InputItem, ResponsesRequest

ROLES = {"system": "system", "developer": "system", "user": "user", "assistant": "assistant"}
TEXT_PARTS = ("input_text", "output_text", "text", "summary_text", "reasoning_text")
"""Content parts read as text; any other part (images, files, audio) is a 400."""
FUNCTION_TOOL_FIELDS = ("name", "description", "parameters", "strict")


def input_items(request: ResponsesRequest) -> list[dict[str, Any]]:
    """The request's own input as item dicts (a string is one user message): what is stored."""
    if isinstance(request.input, str):
        return [{"type": "message", "role": "user", "content": request.input}]
    return [item.model_dump(exclude_none=True) for item in request.input]


def chat_messages(items: list[dict[str, Any]], instructions: str | None) -> list[dict[str, Any]]:
    """Input items (a stored conversation, then the request's own) -> chat messages."""
    messages: list[dict[str, Any]] = []
    if instructions:
        messages.append({"role": "system", "content": instructions})
    reasoning: list[str] = []
    previous_kind = None
    for index, raw in enumerate(items):
        item = InputItem.model_validate(raw)
        kind = item.type or "message"
        where = f"input[{index}]"
        if kind == "message":
            role = ROLES.get(item.role or "")
            if role is None:
                raise OpenAIError(f"{where}.role must be one of {', '.join(ROLES)}, got {item.role!r}", 400,
                                  param="input")
            message: dict[str, Any] = {"role": role, "content": _text(item.content, f"{where}.content")}
            if role == "assistant" and reasoning:
                message["reasoning_content"] = "".join(reasoning)
                reasoning = []
            messages.append(message)
        elif kind == "reasoning":
            reasoning.append(_text(item.content, f"{where}.content") or _text(item.summary, f"{where}.summary"))
        elif kind == "function_call":
            if not item.call_id or not item.name or item.arguments is None:
                raise OpenAIError(f"{where}: a function_call item needs call_id, name and arguments", 400,
                                  param="input")
            call = {"id": item.call_id, "type": "function",
                    "function": {"name": item.name, "arguments": item.arguments}}
            last = messages[-1] if messages else None
            if last is not None and last["role"] == "assistant" and previous_kind in ("message", "function_call"):
                last.setdefault("tool_calls", []).append(call)
            else:
                message = {"role": "assistant", "content": None, "tool_calls": [call]}
                if reasoning:
                    message["reasoning_content"] = "".join(reasoning)
                    reasoning = []
                messages.append(message)
        elif kind == "function_call_output":
            if not item.call_id or item.output is None:
                raise OpenAIError(f"{where}: a function_call_output item needs call_id and output", 400,
                                  param="input")
            messages.append({"role": "tool", "tool_call_id": item.call_id,
                             "content": _text(item.output, f"{where}.output")})
        else:
            raise OpenAIError(f"{where}.type {kind!r} is not supported (this server takes message, function_call, "
                              f"function_call_output and reasoning items)", 400, param="input")
        previous_kind = kind
    if not messages:
        raise OpenAIError("input is empty: give at least one message", 400, param="input")
    return messages


def _text(content: str | list[ContentPart] | None, where: str) -> str:
    if content is None or isinstance(content, str):
        return content or ""
    texts = []
    for part in content:
        if part.type not in TEXT_PARTS or part.text is None:
            raise OpenAIError(f"{where}: only text content is supported, got a {part.type!r} part", 400,
                              param="input")
        texts.append(part.text)
    return "".join(texts)


def chat_tool_fields(request: ResponsesRequest) -> dict[str, Any]:
    """tools, tool_choice and parallel_tool_calls in chat's shape (the chat code validates them)."""
    fields: dict[str, Any] = {"parallel_tool_calls": request.parallel_tool_calls}
    if request.tools:
        tools = []
        for index, tool in enumerate(request.tools):
            if tool.type != "function":
                raise OpenAIError(f"tools[{index}].type {tool.type!r} is not supported (only function tools)", 400,
                                  param="tools")
            if tool.name is None:
                raise OpenAIError(f"tools[{index}]: a function tool needs a name", 400, param="tools")
            function = {name: getattr(tool, name) for name in FUNCTION_TOOL_FIELDS if getattr(tool, name) is not None}
            tools.append({"type": "function", "function": function})
        fields["tools"] = tools
    choice = request.tool_choice
    if isinstance(choice, str):
        fields["tool_choice"] = choice
    elif choice is not None:
        if choice.type != "function" or choice.name is None:
            raise OpenAIError(f"tool_choice: only {{\"type\": \"function\", \"name\": ...}} is supported, got type "
                              f"{choice.type!r}", 400, param="tool_choice")
        fields["tool_choice"] = {"type": "function", "function": {"name": choice.name}}
    return fields


def response_format(request: ResponsesRequest) -> dict[str, Any] | None:
    """text.format as chat's response_format (None for plain text)."""
    text_format = request.text.format if request.text is not None else None
    if text_format is None or text_format.type == "text":
        return None
    if text_format.type == "json_object":
        return {"type": "json_object"}
    if text_format.schema_ is None:
        raise OpenAIError("text.format of type json_schema needs a schema", 400, param="text.format")
    schema: dict[str, Any] = {"name": text_format.name or "response", "schema": text_format.schema_}
    if text_format.strict is not None:
        schema["strict"] = text_format.strict
    return {"type": "json_schema", "json_schema": schema}
