"""A Messages request in chat terms, so the chat machinery serves it unchanged.

    system                              -> a leading "system" message
    user: tool_result blocks, text      -> a "tool" message per result, then the user's text
    assistant: thinking, text, tool_use -> one assistant message (reasoning_content, content,
                                           tool_calls with the input as JSON arguments)
    tools (input_schema), tool_choice   -> chat's function tools; "any" is "required", {"type":
                                           "tool"} a named choice; disable_parallel_tool_use
"""

from __future__ import annotations

import json
from typing import Any

from kvtide.server.anthropic.protocol import ContentBlock, MessagesRequest
from kvtide.server.errors import OpenAIError

TOOL_CHOICES = {"auto": "auto", "any": "required", "none": "none"}


def chat_fields(request: MessagesRequest) -> dict[str, Any]:
    """messages, tools, tool_choice and sampling fields of the equivalent chat request."""
    messages: list[dict[str, Any]] = []
    if request.system:
        system = request.system if isinstance(request.system, str) else _text(request.system, "system")
        messages.append({"role": "system", "content": system})
    for index, message in enumerate(request.messages):
        where = f"messages[{index}].content"
        if isinstance(message.content, str):
            messages.append({"role": message.role, "content": message.content})
        elif message.role == "user":
            messages += _user_messages(message.content, where)
        else:
            messages.append(_assistant_message(message.content, where))
    fields: dict[str, Any] = {
        "messages": messages, "max_completion_tokens": request.max_tokens, "stop": request.stop_sequences,
        "temperature": request.temperature, "top_p": request.top_p,
        "top_k": request.top_k or None, "chat_template": request.chat_template,
        "chat_template_kwargs": request.chat_template_kwargs}
    fields.update(_tool_fields(request))
    return {name: value for name, value in fields.items() if value is not None}


def _user_messages(blocks: list[ContentBlock], where: str) -> list[dict[str, Any]]:
    results, texts = [], []
    for block in blocks:
        if block.type == "tool_result":
            if not block.tool_use_id:
                raise OpenAIError(f"{where}: a tool_result block needs tool_use_id", 400, param="messages")
            content = block.content
            text = content if isinstance(content, str) else _text(content or [], where)
            results.append({"role": "tool", "tool_call_id": block.tool_use_id, "content": text})
        elif block.type == "text" and block.text is not None:
            texts.append(block.text)
        else:
            raise OpenAIError(f"{where}: a user message may hold text and tool_result blocks, got {block.type!r}",
                              400, param="messages")
    return results + ([{"role": "user", "content": "".join(texts)}] if texts or not results else [])


def _assistant_message(blocks: list[ContentBlock], where: str) -> dict[str, Any]:
    texts, reasoning, calls = [], [], []
    for block in blocks:
        if block.type == "text" and block.text is not None:
            texts.append(block.text)
        elif block.type == "thinking":
            reasoning.append(block.thinking or "")
        elif block.type == "redacted_thinking":
            continue
        elif block.type == "tool_use":
            if not block.id or not block.name or block.input is None:
                raise OpenAIError(f"{where}: a tool_use block needs id, name and input", 400, param="messages")
            calls.append({"id": block.id, "type": "function",
                          "function": {"name": block.name, "arguments": json.dumps(block.input, ensure_ascii=False)}})
        else:
            raise OpenAIError(f"{where}: an assistant message may hold text, thinking and tool_use blocks, got "
                              f"{block.type!r}", 400, param="messages")
    message: dict[str, Any] = {"role": "assistant", "content": "".join(texts) if texts or not calls else None}
    if calls:
        message["tool_calls"] = calls
    if reasoning:
        message["reasoning_content"] = "".join(reasoning)
    return message


def _text(blocks: list[ContentBlock], where: str) -> str:
    texts = []
    for block in blocks:
        if block.type != "text" or block.text is None:
            raise OpenAIError(f"{where}: only text blocks are supported here, got {block.type!r}", 400,
                              param="messages" if where.startswith("messages") else where)
        texts.append(block.text)
    return "".join(texts)


def _tool_fields(request: MessagesRequest) -> dict[str, Any]:
    fields: dict[str, Any] = {}
    if request.tools:
        tools = []
        for index, tool in enumerate(request.tools):
            if tool.type not in (None, "custom"):
                raise OpenAIError(f"tools[{index}].type {tool.type!r} is not supported (only client tools with an "
                                  f"input_schema)", 400, param="tools")
            function = {"name": tool.name, "parameters": tool.input_schema}
            if tool.description is not None:
                function["description"] = tool.description
            tools.append({"type": "function", "function": function})
        fields["tools"] = tools
    choice = request.tool_choice
    if choice is not None:
        if choice.type == "tool":
            if not choice.name:
                raise OpenAIError('tool_choice of type "tool" needs a name', 400, param="tool_choice")
            fields["tool_choice"] = {"type": "function", "function": {"name": choice.name}}
        else:
            fields["tool_choice"] = TOOL_CHOICES[choice.type]
        fields["parallel_tool_calls"] = not choice.disable_parallel_tool_use
    return fields
