"""/tokenize and /detokenize: the tokenizer the engine uses, as the server uses it."""

from __future__ import annotations

from kvtide.server.errors import OpenAIError
from kvtide.server.openai.chat_completions.serving import render_chat_prompt
from kvtide.server.openai.tokenize.protocol import (
    DetokenizeRequest,
    DetokenizeResponse,
    TokenizeRequest,
    TokenizeResponse,
)
from kvtide.server.state import ServerState


def tokenize(state: ServerState, request: TokenizeRequest) -> TokenizeResponse:
    state.check_model(request.model)
    if (request.prompt is None) == (request.messages is None):
        raise OpenAIError("give exactly one of prompt and messages", 400, param="prompt")
    if request.messages is not None:
        tokens = render_chat_prompt(state, request.messages, request.add_generation_prompt,
                                    request.chat_template, request.chat_template_kwargs)
    else:
        tokens = state.tokenizer.encode(request.prompt, add_special_tokens=request.add_special_tokens)
    return TokenizeResponse(count=len(tokens), max_model_len=state.max_model_len, tokens=list(tokens))


def detokenize(state: ServerState, request: DetokenizeRequest) -> DetokenizeResponse:
    state.check_model(request.model)
    vocab_size = state.engine.info.vocab_size
    bad = [t for t in request.tokens if t >= vocab_size]
    if bad:
        raise OpenAIError(f"token id {bad[0]} is out of range [0, {vocab_size})", 400, param="tokens")
    return DetokenizeResponse(prompt=state.tokenizer.decode(request.tokens))
