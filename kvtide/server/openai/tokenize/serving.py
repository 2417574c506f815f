"""/tokenize and /detokenize: the tokenizer the engine uses, as the server uses it."""

from __future__ import annotations

from kvtide.server.errors import OpenAIError
from kvtide.server.openai import offload
from kvtide.server.openai.chat_completions.serving import render_chat_prompt
from kvtide.server.openai.tokenize.protocol import (
    DetokenizeRequest,
    DetokenizeResponse,
    TokenizeRequest,
    TokenizeResponse,
)
from kvtide.server.state import ServerState


async def tokenize(state: ServerState, request: TokenizeRequest) -> TokenizeResponse:
    """The prompt's tokens, rendered and tokenized off the event loop as chat requests are; a text
    too long for max_model_len tokens is refused as in a completion (offload.check_prompt_chars)."""
    state.check_model(request.model)
    if (request.prompt is None) == (request.messages is None):
        raise OpenAIError("give exactly one of prompt and messages", 400, param="prompt")
    if request.messages is not None:
        _, tokens = await render_chat_prompt(state, request.messages, request.add_generation_prompt,
                                             request.chat_template, request.chat_template_kwargs)
    else:
        prompt, tokenizer = request.prompt, state.tokenizer

        def encode() -> list[int]:
            offload.check_prompt_chars(tokenizer, prompt, state.max_model_len, "prompt")
            return tokenizer.encode(prompt, add_special_tokens=request.add_special_tokens)

        tokens = await offload.tokenize(encode, timeout_s=state.limits.render_timeout_s, param="prompt")
    return TokenizeResponse(count=len(tokens), max_model_len=state.max_model_len, tokens=list(tokens))


def detokenize(state: ServerState, request: DetokenizeRequest) -> DetokenizeResponse:
    state.check_model(request.model)
    vocab_size = state.engine.info.vocab_size
    bad = [t for t in request.tokens if t >= vocab_size]
    if bad:
        raise OpenAIError(f"token id {bad[0]} is out of range [0, {vocab_size})", 400, param="tokens")
    return DetokenizeResponse(prompt=state.tokenizer.decode(request.tokens))
