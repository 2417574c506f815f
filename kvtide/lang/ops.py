"""The expressions a program appends to its state: `gen`, `select` and the chat roles.

They are plain values: building one does no work and touches no backend, so a program can build
them anywhere; `state += expr` runs them against the state's backend.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

from kvtide.sampling_params import SamplingParams, StructuredOutputsParams

CHOICES_METHOD = "token_length_normalized"
"""How `select` ranks its choices (SGLang's default): the mean logprob of each choice's tokens, so
longer choices are not penalized for having more tokens to pay for."""


@dataclass(frozen=True)
class Gen:
    """Generate text into the variable `name` (None: append it unnamed)."""

    name: str | None
    max_tokens: int = 128
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = -1
    seed: int | None = None
    stop: tuple[str, ...] = ()
    ignore_eos: bool = False
    regex: str | None = None
    json_schema: str | None = None
    """A JSON schema as JSON text (a dict given to `gen` is serialized here, so Gen stays hashable)."""
    choices: tuple[str, ...] | None = None
    """Generate exactly one of these strings (a grammar constraint: compare `select`, which scores)."""

    def structured_outputs(self) -> StructuredOutputsParams | None:
        """The constraint as kvtide's structured output (ValueError on a malformed one)."""
        if self.regex is not None:
            return StructuredOutputsParams(regex=self.regex)
        if self.json_schema is not None:
            return StructuredOutputsParams(json=self.json_schema)
        if self.choices is not None:
            return StructuredOutputsParams(choice=list(self.choices))
        return None

    def sampling_params(self) -> SamplingParams:
        """kvtide's SamplingParams for this call, validated (ValueError names the bad field)."""
        return SamplingParams(max_tokens=self.max_tokens, temperature=self.temperature, top_p=self.top_p,
                              top_k=self.top_k, seed=self.seed, stop=list(self.stop), ignore_eos=self.ignore_eos,
                              structured_outputs=self.structured_outputs())


@dataclass(frozen=True)
class Select:
    """Pick one of `choices` by the model's likelihood of each continuing the state (scored, not
    sampled), into the variable `name`."""

    name: str | None
    choices: tuple[str, ...]
    choices_method: str = CHOICES_METHOD


@dataclass(frozen=True)
class Role:
    """A chat message of `role` whose content is text and/or calls, rendered through the model's
    chat template: the template's text before and after the content wraps whatever the content
    appends (so `assistant(gen(...))` generates the assistant's reply in place)."""

    role: str
    content: tuple[str | Gen | Select, ...] = field(default_factory=tuple)


Expr = str | Gen | Select | Role


def gen(name: str | None = None, max_tokens: int = 128, temperature: float = 0.0, top_p: float = 1.0,
        top_k: int = -1, seed: int | None = None, stop: str | list[str] | None = None, ignore_eos: bool = False,
        regex: str | None = None, json_schema: str | dict[str, Any] | None = None,
        choices: list[str] | None = None) -> Gen:
    """Generate into `name`: greedy by default; at most one of regex, json_schema and choices
    constrains the output (kvtide's structured output)."""
    if sum(c is not None for c in (regex, json_schema, choices)) > 1:
        raise ValueError("gen: give at most one of regex, json_schema and choices")
    stops = (stop,) if isinstance(stop, str) else tuple(stop or ())
    schema = json.dumps(json_schema) if isinstance(json_schema, dict) else json_schema
    op = Gen(name, max_tokens, temperature, top_p, top_k, seed, stops, ignore_eos, regex, schema,
             tuple(choices) if choices is not None else None)
    op.sampling_params()  # validate now, where the program builds the call
    return op


def select(name: str | None = None, choices: list[str] | None = None,
           choices_method: str = CHOICES_METHOD) -> Select:
    """Choose one of `choices` by its token-length-normalized log-likelihood after the state."""
    if not choices or not all(isinstance(c, str) and c for c in choices):
        raise ValueError(f"select: choices must be a non-empty list of non-empty strings, got {choices!r}")
    if choices_method != CHOICES_METHOD:
        raise ValueError(f"select: choices_method must be {CHOICES_METHOD!r}, got {choices_method!r}")
    return Select(name, tuple(choices), choices_method)


def _role(role: str, content: Expr | list[Expr] | None) -> Role:
    if content is None:
        parts: tuple[Expr, ...] = ()
    elif isinstance(content, (list, tuple)):
        parts = tuple(content)
    else:
        parts = (content,)
    for part in parts:
        if not isinstance(part, (str, Gen, Select)):
            raise ValueError(f"{role}: content must be text, gen or select, got {type(part).__name__}")
    return Role(role, parts)


def system(content: Expr | list[Expr] | None = None) -> Role:
    return _role("system", content)


def user(content: Expr | list[Expr] | None = None) -> Role:
    return _role("user", content)


def assistant(content: Expr | list[Expr] | None = None) -> Role:
    return _role("assistant", content)
