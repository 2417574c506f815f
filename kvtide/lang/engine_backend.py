"""`kl.Engine(llm)`: programs run on an in-process `kvtide.LLM`, through its public `generate`.

Calls that arrive together run together: `LLM.generate` is one synchronous batch, so concurrent
programs (run_batch's threads) queue their calls and whichever thread next holds the engine runs
every queued call as one batch; the others find their results done. A batch that fails (a call
refused before it was queued, e.g. a malformed regex) is rerun call by call, so only the failing
call's program sees the error.

Prompts go in as token ids: the state's text pieces are tokenized (without special tokens: the chat
template places BOS), and a generation's own token ids are reused as they are, so the next call's
prompt starts with exactly the tokens whose KV the engine holds in its prefix cache.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from kvtide.lang.backend import GenResult, Prompt, ScoreResult, choice_token_span
from kvtide.lang.ops import Gen
from kvtide.sampling_params import SamplingParams

if TYPE_CHECKING:
    from kvtide.llm import LLM
    from kvtide.outputs import RequestOutput


@dataclass
class _Call:
    token_ids: list[int]
    params: SamplingParams
    output: RequestOutput | None = None
    error: Exception | None = None
    done: threading.Event = field(default_factory=threading.Event)


class Engine:
    """An in-process backend over `llm` (prefix caching on, as LLM's default, shares prefixes)."""

    def __init__(self, llm: LLM) -> None:
        self.llm = llm
        self.tokenizer = llm.get_tokenizer()
        if self.tokenizer is None:
            raise ValueError("kl.Engine needs an LLM with a tokenizer")
        self._tokenizer_lock = threading.Lock()
        self._queue_lock = threading.Lock()
        self._engine_lock = threading.Lock()
        self._queue: list[_Call] = []

    # ---- text and tokens ------------------------------------------------------------------------------
    def render_chat(self, messages: list[dict[str, str]]) -> str:
        with self._tokenizer_lock:
            return self.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=False)

    def encode(self, text: str) -> list[int]:
        with self._tokenizer_lock:
            return self.tokenizer.encode(text, add_special_tokens=False)

    def token_ids(self, prompt: Prompt) -> list[int]:
        """The prompt's tokens: generated tokens as they are, each run of text between them tokenized
        as a whole."""
        ids: list[int] = []
        text = ""
        for piece_text, piece_ids in prompt.pieces:
            if piece_ids is None:
                text += piece_text
                continue
            if text:
                ids += self.encode(text)
                text = ""
            ids += piece_ids
        if text:
            ids += self.encode(text)
        return ids

    # ---- calls ----------------------------------------------------------------------------------------
    def generate(self, prompts: list[Prompt], ops: list[Gen]) -> list[GenResult | Exception]:
        calls = []
        for prompt, op in zip(prompts, ops, strict=True):
            calls.append(_Call(self.token_ids(prompt), op.sampling_params()))
        self._run(calls)
        return [call.error if call.error is not None else self._gen_result(call) for call in calls]

    def generate_n(self, prompt: Prompt, op: Gen, n: int) -> list[GenResult]:
        call = _Call(self.token_ids(prompt), op.sampling_params().clone(n=n))
        self._run([call])
        if call.error is not None:
            raise call.error
        return [self._gen_result(call, i) for i in range(n)]

    def _gen_result(self, call: _Call, index: int = 0) -> GenResult:
        output = call.output
        assert output is not None
        completion = next(c for c in output.outputs if c.index == index)
        ids = tuple(completion.token_ids)
        # The tokens stand for the text only if they decode to it and hold no partial character (a
        # U+FFFD in the text): otherwise the state's text is what the next call sees, re-tokenized,
        # as a server backend (which returns only text) would see it too.
        with self._tokenizer_lock:
            exact = ("\ufffd" not in completion.text
                     and self.tokenizer.decode(list(ids), skip_special_tokens=False) == completion.text)
        meta = {"prompt_tokens": len(output.prompt_token_ids), "completion_tokens": len(ids),
                "cached_tokens": output.num_cached_tokens, "finish_reason": completion.finish_reason,
                "stop_reason": completion.stop_reason, "token_ids": list(ids)}
        return GenResult(completion.text, ids if exact else None, meta)

    def score(self, prompt: Prompt, choices: list[str]) -> ScoreResult:
        """Each choice appended to the prompt, scored by one batch of one-token requests that return
        their prompt logprobs from the choice's first token on (`prompt_logprobs_start`), so the
        prefix cache serves the shared prefix. A one-token request for the prompt alone goes first
        (as SGLang's select does) and caches what earlier calls left uncomputed; only each choice's
        tokens and the prompt's last partial block are then computed per choice."""
        prefix_ids = self.token_ids(prompt)
        calls, starts = [], []
        for choice in choices:
            full_ids = self.token_ids(prompt.extended(choice))
            start = choice_token_span(prefix_ids, full_ids, choice)
            starts.append(start)
            calls.append(_Call(full_ids, SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=0,
                                                        prompt_logprobs_start=start)))
        warm = _Call(prefix_ids, SamplingParams(max_tokens=1, temperature=0.0))
        self._run([warm])
        if warm.error is not None:
            raise warm.error
        self._run(calls)
        token_logprobs = []
        for call, start in zip(calls, starts, strict=True):
            if call.error is not None:
                raise call.error
            assert call.output is not None and call.output.prompt_logprobs is not None
            entries = call.output.prompt_logprobs
            token_logprobs.append([entries[j][call.token_ids[j]].logprob for j in range(start, len(call.token_ids))])
        meta = {"prompt_tokens": [len(c.token_ids) for c in calls],
                "cached_tokens": [c.output.num_cached_tokens for c in calls if c.output is not None],
                "choice_token_ids": [c.token_ids[s:] for c, s in zip(calls, starts, strict=True)]}
        return ScoreResult(token_logprobs, meta)

    def _run(self, calls: list[_Call]) -> None:
        with self._queue_lock:
            self._queue += calls
        for call in calls:
            while not call.done.is_set():
                with self._engine_lock:
                    if call.done.is_set():
                        break
                    with self._queue_lock:
                        batch, self._queue = self._queue, []
                    self._run_batch(batch)

    def _run_batch(self, batch: list[_Call]) -> None:
        try:
            self._generate(batch)
        except Exception as e:
            if len(batch) == 1:
                batch[0].error = e
            else:
                for call in batch:  # find the call(s) that failed; the others still run
                    try:
                        self._generate([call])
                    except Exception as single_error:
                        call.error = single_error
        finally:
            for call in batch:
                if call.output is None and call.error is None:
                    call.error = RuntimeError("the engine stopped before this call finished")
                call.done.set()

    def _generate(self, batch: list[_Call]) -> None:
        outputs = self.llm.generate([{"prompt_token_ids": c.token_ids} for c in batch], [c.params for c in batch])
        for call, output in zip(batch, outputs, strict=True):
            call.output = output
