"""`kl.Endpoint(url)`: programs run on a kvtide server through its OpenAI API.

- chat roles: the server renders them (`POST /tokenize` with messages, then `/detokenize`), so the
  template is the one its chat completions use;
- gen: `POST /v1/completions` with the state's text as the prompt and no special tokens added (the
  rendered template holds BOS), sampling and `structured_outputs` as the engine takes them; the
  server's prefix cache serves the state's prefix (`usage.prompt_tokens_details.cached_tokens`);
- select: kvtide's `/v1/lang/score` extension, which scores every choice over the server's prefix
  cache; on a server without it, one `/v1/completions` request whose prompt is the list of
  state + choice texts, with `prompt_logprobs` and max_tokens 1 (each prompt computed in full);
  each choice's tokens are those after the ones it shares with the state's own tokenization.

Calls of a fork group go out concurrently, so the server batches them. An error response raises in
the program: a 4xx refusal of the call (bad regex, prompt too long) as ValueError, anything else as
EndpointError, each with the server's message.
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from typing import Any

import httpx

from kvtide.lang.backend import GenResult, Prompt, ScoreResult, choice_token_span
from kvtide.lang.ops import Gen


class EndpointError(RuntimeError):
    """A server error that is not a refusal of the call itself (5xx, overload, a lost connection)."""


class _NotFound(ValueError):
    """404: a server without the route asked for."""


class Endpoint:
    def __init__(self, url: str, api_key: str | None = None, model: str | None = None,
                 timeout_s: float = 600.0) -> None:
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self.url = url.rstrip("/")
        self.model = model
        self._client = httpx.Client(base_url=self.url, headers=headers, timeout=timeout_s)

    def close(self) -> None:
        self._client.close()

    def __enter__(self) -> Endpoint:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def _post(self, path: str, body: dict[str, Any]) -> dict[str, Any]:
        if self.model is not None:
            body = {"model": self.model, **body}
        try:
            response = self._client.post(path, json=body)
        except httpx.HTTPError as e:
            raise EndpointError(f"{self.url}{path}: {e}") from e
        if response.status_code >= 400:
            try:
                message = response.json()["error"]["message"]
            except (ValueError, KeyError, TypeError):
                message = response.text
            if response.status_code == 404:
                raise _NotFound(f"{path} (404): {message}")
            if 400 <= response.status_code < 500 and response.status_code not in (401, 403, 408, 429):
                raise ValueError(f"{path} ({response.status_code}): {message}")
            raise EndpointError(f"{path} ({response.status_code}): {message}")
        return response.json()

    # ---- text and tokens ------------------------------------------------------------------------------
    def render_chat(self, messages: list[dict[str, str]]) -> str:
        tokens = self._post("/tokenize", {"messages": messages, "add_generation_prompt": False})["tokens"]
        return self._post("/detokenize", {"tokens": tokens})["prompt"]

    def encode(self, text: str) -> list[int]:
        return self._post("/tokenize", {"prompt": text, "add_special_tokens": False})["tokens"]

    # ---- calls ----------------------------------------------------------------------------------------
    def generate(self, prompts: list[Prompt], ops: list[Gen]) -> list[GenResult | Exception]:
        if len(prompts) == 1:
            return [self._generate_one(prompts[0], ops[0])]
        with ThreadPoolExecutor(max_workers=len(prompts)) as pool:
            return list(pool.map(self._generate_one, prompts, ops))

    def generate_n(self, prompt: Prompt, op: Gen, n: int) -> list[GenResult]:
        response = self._post("/v1/completions", self._completion_body(prompt, op, n))
        return [self._gen_result(choice, response) for choice in sorted(response["choices"], key=lambda c: c["index"])]

    def _generate_one(self, prompt: Prompt, op: Gen) -> GenResult | Exception:
        try:
            response = self._post("/v1/completions", self._completion_body(prompt, op, 1))
        except Exception as e:  # returned, to raise in the program that made the call
            return e
        return self._gen_result(response["choices"][0], response)

    @staticmethod
    def _completion_body(prompt: Prompt, op: Gen, n: int) -> dict[str, Any]:
        op.sampling_params()
        body: dict[str, Any] = {"prompt": prompt.text, "n": n, "add_special_tokens": False,
                                "max_tokens": op.max_tokens, "temperature": op.temperature, "top_p": op.top_p,
                                "top_k": op.top_k, "stop": list(op.stop), "ignore_eos": op.ignore_eos}
        if op.seed is not None:
            body["seed"] = op.seed
        constraint = op.structured_outputs()
        if constraint is not None:
            body["structured_outputs"] = {constraint.kind: getattr(constraint, constraint.kind)}
        return body

    @staticmethod
    def _gen_result(choice: dict[str, Any], response: dict[str, Any]) -> GenResult:
        usage = response.get("usage") or {}
        details = usage.get("prompt_tokens_details") or {}
        meta = {"prompt_tokens": usage.get("prompt_tokens"), "completion_tokens": usage.get("completion_tokens"),
                "cached_tokens": details.get("cached_tokens", 0), "finish_reason": choice.get("finish_reason"),
                "stop_reason": choice.get("stop_reason")}
        return GenResult(choice["text"], None, meta)

    def score(self, prompt: Prompt, choices: list[str]) -> ScoreResult:
        """kvtide's `/v1/lang/score` (the prefix cache serves the state's prefix); a server without it
        (404) is asked through `/v1/completions` with prompt_logprobs, which computes every prompt."""
        try:
            response = self._post("/v1/lang/score", {"prompt": prompt.text, "choices": choices,
                                                     "add_special_tokens": False})
        except _NotFound:
            return self._score_by_completions(prompt, choices)
        scored = sorted(response["choices"], key=lambda c: c["index"])
        return ScoreResult([c["token_logprobs"] for c in scored],
                           {"prompt_tokens": [c["prompt_tokens"] for c in scored],
                            "cached_tokens": [c["cached_tokens"] for c in scored],
                            "choice_token_ids": [c["token_ids"] for c in scored]})

    def _score_by_completions(self, prompt: Prompt, choices: list[str]) -> ScoreResult:
        prefix_ids = self.encode(prompt.text)
        full_texts = [prompt.text + c for c in choices]
        full_ids = [self.encode(t) for t in full_texts]
        starts = [choice_token_span(prefix_ids, ids, c) for ids, c in zip(full_ids, choices, strict=True)]
        response = self._post("/v1/completions", {"prompt": full_texts, "add_special_tokens": False,
                                                  "max_tokens": 1, "temperature": 0.0, "prompt_logprobs": 0})
        by_index = sorted(response["choices"], key=lambda c: c["index"])
        token_logprobs = []
        for choice, ids, start in zip(by_index, full_ids, starts, strict=True):
            entries = choice["prompt_logprobs"]
            token_logprobs.append([entries[j][str(ids[j])]["logprob"] for j in range(start, len(ids))])
        return ScoreResult(token_logprobs, {"prompt_tokens": [len(ids) for ids in full_ids],
                                            "choice_token_ids": [ids[s:] for ids, s in zip(full_ids, starts, strict=True)]})
