"""ChatSession: a multi-turn conversation on an LLM, each answer streamed as it is generated.

Each turn renders the whole history with the tokenizer's chat template, exactly as `LLM.chat`
does, and sends it as one new request. The earlier turns' KV blocks are found again by the prefix
cache, so a turn computes little more than its new message.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from kvtide.engine.output_processor import RequestOutputKind
from kvtide.sampling_params import SamplingParams


@dataclass
class TurnResult:
    text: str
    """The answer as streamed (when interrupted: the part that was shown)."""
    finish_reason: str | None
    """'stop', 'length', or 'abort' (interrupted, or failed in the engine)."""
    num_prompt_tokens: int
    num_output_tokens: int
    num_cached_tokens: int
    """Prompt tokens whose KV came from the prefix cache (the earlier turns)."""
    interrupted: bool


class ChatSession:
    """`send(message, on_text)` runs one turn and keeps both sides in `history`; `interrupt()`
    (safe to call from a signal handler) ends the answer being generated after the current step."""

    def __init__(self, llm, params: SamplingParams, system: str | None = None,
                 chat_template: str | None = None) -> None:
        tokenizer = llm.get_tokenizer()
        if tokenizer is None or not (chat_template or getattr(tokenizer, "chat_template", None)):
            raise ValueError(f"the tokenizer of model {llm.engine_args.model!r} has no chat template, so "
                             f"there is no way to write a conversation for it; use a chat (instruct) model "
                             f"or give --chat-template")
        if params.n != 1 or params.use_beam_search:
            raise ValueError("chat streams one answer per message: n must be 1, without beam search")
        self.llm = llm
        self.tokenizer = tokenizer
        self.params = params
        self.system = system
        self.chat_template = chat_template
        """Overrides the tokenizer's template when given."""
        self.history: list[dict[str, Any]] = []
        """User and assistant turns, oldest first (the system message is not in it)."""
        self._interrupted = False

    @property
    def messages(self) -> list[dict[str, Any]]:
        system = [{"role": "system", "content": self.system}] if self.system is not None else []
        return system + self.history

    def reset(self) -> None:
        """Forget the conversation; the system message stays."""
        self.history.clear()

    def interrupt(self) -> None:
        self._interrupted = True

    def prompt_token_ids(self, messages: list[dict[str, Any]]) -> list[int]:
        # The template places BOS itself: tokenize once, adding no special tokens (as LLM.chat).
        text = self.tokenizer.apply_chat_template(messages, chat_template=self.chat_template,
                                                  add_generation_prompt=True, tokenize=False)
        return self.tokenizer.encode(text, add_special_tokens=False)

    def send(self, content: str, on_text: Callable[[str], None] | None = None) -> TurnResult:
        """One turn: `on_text` gets each new piece of the answer as soon as it is decoded.

        A message the engine refuses (e.g. the conversation no longer fits in max_model_len)
        raises ValueError and leaves the history as it was. An interrupted answer is kept in the
        history as far as it was shown; one interrupted before showing anything is forgotten
        with its message."""
        user = {"role": "user", "content": content}
        prompt_ids = self.prompt_token_ids(self.messages + [user])
        engine = self.llm.engine
        request_id = f"chat-{engine.next_request_id()}"
        self._interrupted = False
        engine.add_request(request_id, {"prompt_token_ids": prompt_ids}, self.params,
                           output_kind=RequestOutputKind.DELTA)
        pieces: list[str] = []
        finish_reason: str | None = None
        num_output_tokens = num_cached_tokens = 0
        try:
            while True:
                finished = False
                for output in engine.step():
                    if output.request_id != request_id:
                        continue
                    num_cached_tokens = output.num_cached_tokens
                    for completion in output.outputs:
                        num_output_tokens += len(completion.token_ids)
                        finish_reason = completion.finish_reason
                        if completion.text:
                            pieces.append(completion.text)
                            if on_text is not None:
                                on_text(completion.text)
                    finished = output.finished
                if finished:
                    break
                if self._interrupted or not engine.has_unfinished_requests():
                    # Abort frees the request's KV blocks now; the full ones stay in the
                    # prefix cache for the next turn.
                    engine.abort_request([request_id])
                    finish_reason = "abort"
                    break
        except BaseException:
            engine.abort_request([request_id])  # no-op when it already finished
            raise
        text = "".join(pieces)
        interrupted = self._interrupted and finish_reason == "abort"
        self._interrupted = False
        if text or not interrupted:
            self.history += [user, {"role": "assistant", "content": text}]
        return TurnResult(text, finish_reason, len(prompt_ids), num_output_tokens, num_cached_tokens,
                          interrupted)
