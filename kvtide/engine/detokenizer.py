"""Incremental detokenization with stop strings.

Text is produced with tokenizers' DecodeStream, which holds back bytes of a UTF-8 character split
across tokens. On finish the text is reconciled with a full decode, so the concatenated deltas
always equal `tokenizer.decode(all generated ids)` (up to a stop string cut).

Stop strings are searched only in the region new text can affect; with streaming, the last
len(longest stop) - 1 characters are held back so a stop string is never partly emitted.
"""

from __future__ import annotations

from tokenizers.decoders import DecodeStream

from kvtide.sampling_params import SamplingParams


class IncrementalDetokenizer:
    def __init__(self, tokenizer, prompt_token_ids: list[int], params: SamplingParams) -> None:
        self.tokenizer = tokenizer
        self.params = params
        self.skip_special_tokens = params.skip_special_tokens
        self._backend = getattr(tokenizer, "_tokenizer", None)
        # The prompt's tail gives the stream its context (leading-space rules of SentencePiece).
        context = self._stream_context(prompt_token_ids[-4:]) if self._backend is not None else []
        self._stream = DecodeStream(context, skip_special_tokens=self.skip_special_tokens) \
            if self._backend is not None else None
        self.token_ids: list[int] = []
        self.text = ""
        self.stop_reason: str | None = None
        self._stop_strings = list(params.stop or [])
        self._hold = max((len(s) for s in self._stop_strings), default=1) - 1

    def update(self, new_token_ids: list[int], finished: bool) -> bool:
        """Add tokens; returns True if a stop string ended the sequence (text is then cut)."""
        for token_id in new_token_ids:
            self.token_ids.append(token_id)
            old_len = len(self.text)
            piece = self._step(token_id)
            if piece:
                self.text += piece
            if self._check_stop(old_len):
                return True
        if finished:
            full = self._full_decode()
            if full != self.text:
                old_len = len(self.text)
                self.text = full
                return self._check_stop(min(old_len, len(full)))
        return False

    def _stream_context(self, tail: list[int]) -> list[int]:
        """The prompt's tail cut back to a complete character: DecodeStream emits a context whose
        text ends in an incomplete one (U+FFFD) as if it were output."""
        backend = self._backend
        assert backend is not None
        while tail and backend.decode(tail, skip_special_tokens=self.skip_special_tokens).endswith("\ufffd"):
            tail = tail[:-1]
        return tail

    def _step(self, token_id: int) -> str | None:
        if self._stream is not None:
            try:
                return self._stream.step(self._backend, token_id)
            except Exception:
                self._stream = None  # undecodable for the stream: full decodes from now on
        # Without a stream (slow tokenizer, or after the above): what a full decode adds, held back
        # while it ends in an incomplete character.
        full = self._full_decode()
        if full.endswith("\ufffd") or not full.startswith(self.text):
            return None
        return full[len(self.text):]

    def _full_decode(self) -> str:
        return self.tokenizer.decode(self.token_ids, skip_special_tokens=self.skip_special_tokens)

    def _check_stop(self, old_len: int) -> bool:
        if not self._stop_strings or len(self.token_ids) < self.params.min_tokens:
            return False
        search_from = max(0, old_len - self._hold)
        best: tuple[int, str] | None = None
        for stop in self._stop_strings:
            idx = self.text.find(stop, search_from)
            if idx != -1 and (best is None or idx < best[0]):
                best = (idx, stop)
        if best is None:
            return False
        idx, stop = best
        self.text = self.text[:idx + len(stop)] if self.params.include_stop_str_in_output else self.text[:idx]
        self.stop_reason = stop
        return True

    def emittable_length(self, finished: bool) -> int:
        """How much of the text may be sent now: all of it once finished, else all but a tail that
        could still become the start of a stop string."""
        if finished or not self._stop_strings:
            return len(self.text)
        return max(0, len(self.text) - self._hold)
