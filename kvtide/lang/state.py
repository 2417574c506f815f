"""A program's state: its text so far (as prompt pieces), its chat messages, and the variables its
calls filled, with their metadata. `state += expr` runs the expression now, against the backend,
so a program is ordinary Python: a failing call raises at that line.

    s += kl.user("Hi")                   text: the template's user opening, "Hi", its closing
    s += kl.assistant(kl.gen("a"))       one backend call, continuing from every token so far
    forks = s.fork(3)                    three states continuing from the same tokens

Every call continues from the whole state, so on kvtide the prefix cache serves what an earlier
call (or a sibling fork) already computed: the prefix is computed once.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from dataclasses import replace
from typing import Any

from kvtide.lang.backend import Backend, GenResult, Piece, Prompt
from kvtide.lang.chat import ChatRenderer
from kvtide.lang.ops import Expr, Gen, Role, Select


class ProgramState:
    """What `run` hands a program and returns: append to it with `+=`, read it with `state[name]`,
    `text()`, `messages()` and `get_meta_info(name)`."""

    def __init__(self, backend: Backend, renderer: ChatRenderer | None = None) -> None:
        self.backend = backend
        self._renderer = renderer or ChatRenderer(backend.render_chat)
        self._pieces: list[Piece] = []
        self._messages: list[dict[str, str]] = []
        self._variables: dict[str, Any] = {}
        self._meta: dict[str, dict[str, Any]] = {}
        self._own: set[str] = set()
        """Variables this state set itself (the others it inherited when it was forked)."""
        self._fork_groups: list[ForkGroup] = []
        self.error: BaseException | None = None
        """run_batch: the exception that ended this program (None: it ran to its end)."""

    # ---- running expressions ----------------------------------------------------------------------
    def __iadd__(self, expr: Expr | list[Expr]) -> ProgramState:
        for part in expr if isinstance(expr, list) else [expr]:
            self._run(part)
        return self

    def _run(self, expr: Expr) -> None:
        if isinstance(expr, str):
            self._append(expr)
        elif isinstance(expr, Gen):
            result = self.backend.generate([self.prompt()], [expr])[0]
            if isinstance(result, Exception):
                raise result
            self._apply_gen(expr, result)
        elif isinstance(expr, Select):
            self._run_select(expr)
        elif isinstance(expr, Role):
            self._run_role(expr)
        else:
            raise TypeError(f"a program state takes text, gen, select or a role, got {type(expr).__name__}")

    def _append(self, text: str, token_ids: tuple[int, ...] | None = None) -> None:
        if text or token_ids:
            self._pieces.append((text, token_ids))

    def _apply_gen(self, op: Gen, result: GenResult) -> None:
        self._append(result.text, result.token_ids)
        self._set(op.name, result.text, {**result.meta, "text": result.text})

    def _run_select(self, op: Select) -> None:
        scored = self.backend.score(self.prompt(), list(op.choices))
        # token_length_normalized: the mean logprob of each choice's tokens.
        normalized = [sum(lps) / len(lps) for lps in scored.token_logprobs]
        best = max(range(len(op.choices)), key=lambda i: (normalized[i], -i))
        self._append(op.choices[best])
        meta = {**scored.meta, "choices": list(op.choices), "normalized_prompt_logprobs": normalized,
                "input_token_logprobs": scored.token_logprobs,
                "sum_prompt_logprobs": [math.fsum(lps) for lps in scored.token_logprobs]}
        self._set(op.name, op.choices[best], meta)

    def _run_role(self, op: Role) -> None:
        start = self._open_role(op.role)
        for part in op.content:
            self._run(part)
        self._close_role(op.role, start)

    def _open_role(self, role: str) -> int:
        """Append the template's opening of a `role` message; return where its content starts."""
        begin, _ = self._renderer.frame(self._messages, role)
        self._append(begin)
        return len(self.text())

    def _close_role(self, role: str, start: int) -> None:
        _, end = self._renderer.frame(self._messages, role)
        content = self.text()[start:]
        self._append(end)
        self._messages.append({"role": role, "content": content})

    def _set(self, name: str | None, value: Any, meta: dict[str, Any]) -> None:
        if name is not None:
            self._variables[name] = value
            self._meta[name] = meta
            self._own.add(name)

    # ---- forks --------------------------------------------------------------------------------------
    def fork(self, n: int = 1) -> ForkGroup:
        """n states that continue from this one's tokens, messages and variables; their variables
        are readable from this state too (the latest fork that set a name wins)."""
        if n < 1:
            raise ValueError(f"fork: n must be >= 1, got {n}")
        group = ForkGroup([self._copy() for _ in range(n)], self)
        self._fork_groups.append(group)
        return group

    def _copy(self) -> ProgramState:
        child = ProgramState(self.backend, self._renderer)
        child._pieces = list(self._pieces)
        child._messages = [dict(m) for m in self._messages]
        child._variables = dict(self._variables)
        child._meta = dict(self._meta)
        return child

    # ---- inspection ---------------------------------------------------------------------------------
    def prompt(self) -> Prompt:
        return Prompt(tuple(self._pieces))

    def text(self) -> str:
        return "".join(text for text, _ in self._pieces)

    def messages(self) -> list[dict[str, str]]:
        return [dict(m) for m in self._messages]

    def __getitem__(self, name: str) -> Any:
        return self._lookup(name)[0]

    def __contains__(self, name: str) -> bool:
        try:
            self._lookup(name)
        except KeyError:
            return False
        return True

    def get_meta_info(self, name: str) -> dict[str, Any]:
        """What the call that set `name` reported: token counts, cached_tokens, finish_reason for
        gen; per-choice logprobs for select."""
        return self._lookup(name)[1]

    def variables(self) -> dict[str, Any]:
        """This state's own variables and its forks' (a fork's name shadows an earlier one)."""
        merged = dict(self._variables)
        for group in self._fork_groups:
            for child in group:
                merged.update({k: v for k, v in child.variables().items() if k in child._own or k not in merged})
        merged.update({k: self._variables[k] for k in self._own})
        return merged

    def _lookup(self, name: str) -> tuple[Any, dict[str, Any]]:
        found = self._find_set(name)
        if found is None and name in self._variables:  # inherited from the state this one forked from
            found = self._variables[name], self._meta[name]
        if found is None:
            raise KeyError(name)
        return found

    def _find_set(self, name: str) -> tuple[Any, dict[str, Any]] | None:
        """`name` as this state set it, else as its latest fork that set it did."""
        if name in self._own:
            return self._variables[name], self._meta[name]
        for group in reversed(self._fork_groups):
            for child in reversed(group.states):
                found = child._find_set(name)
                if found is not None:
                    return found
        return None

    def __repr__(self) -> str:
        return f"ProgramState(text={self.text()!r}, variables={self.variables()!r})"


class ForkGroup:
    """The states of one `fork(n)`. `group += expr` runs expr on every fork, a `gen` as one batch:
    while the forks' texts are still equal, as one request of n continuations (SamplingParams.n), so
    the engine computes the prompt once and forks its KV blocks copy-on-write. With a seed, fork i
    samples with seed + i: the branches differ and the run reproduces."""

    def __init__(self, states: list[ProgramState], parent: ProgramState) -> None:
        self.states = states
        self.parent = parent
        self._num_pieces_at_fork = len(parent._pieces)

    def __iter__(self) -> Iterator[ProgramState]:
        return iter(self.states)

    def __len__(self) -> int:
        return len(self.states)

    def __getitem__(self, i: int) -> ProgramState:
        return self.states[i]

    def __iadd__(self, expr: Expr) -> ForkGroup:
        if isinstance(expr, Gen):
            prompts = [s.prompt() for s in self.states]
            if all(p == prompts[0] for p in prompts):
                # One request of n continuations: the engine computes the shared prompt once.
                results: list = self.parent.backend.generate_n(prompts[0], expr, len(self))
            else:
                ops = [expr if expr.seed is None else replace(expr, seed=expr.seed + i) for i in range(len(self))]
                results = self.parent.backend.generate(prompts, ops)
            for state, result in zip(self.states, results, strict=True):
                if isinstance(result, Exception):
                    raise result
                state._apply_gen(expr, result)
        elif isinstance(expr, Role):  # the content as group calls, so a gen in it is still one batch
            starts = [state._open_role(expr.role) for state in self.states]
            for part in expr.content:
                self += part
            for state, start in zip(self.states, starts, strict=True):
                state._close_role(expr.role, start)
        else:
            for state in self.states:
                state += expr
        return self

    def join(self, mode: str = "gather_variable") -> None:
        """Bring the forks back: "gather_variable" sets each variable the forks made to the list of
        their values, in fork order, on the parent; "concate_and_append" also appends each fork's
        new text to the parent."""
        if mode not in ("gather_variable", "concate_and_append"):
            raise ValueError(f"join: mode must be 'gather_variable' or 'concate_and_append', got {mode!r}")
        parent = self.parent
        names: list[str] = []
        for state in self.states:
            names += [n for n in state._own if n not in names]
        for name in names:
            holders = [s for s in self.states if name in s._own]
            parent._set(name, [s._variables[name] for s in holders], {"forks": [s._meta[name] for s in holders]})
        if mode == "concate_and_append":
            for state in self.states:
                for piece in state._pieces[self._num_pieces_at_fork:]:
                    parent._append(*piece)
        parent._fork_groups.remove(self)
