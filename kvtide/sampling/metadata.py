"""SamplingMetadata: one step's sampling parameters as batched tensors (one row per request)."""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np
import torch

from kvtide.sampling_params import SamplingParams, SamplingType


class SamplingRow(Protocol):
    """What the sampler needs of one request: its parameters and token history (RowState, or the
    runner's request record, which slices its tokens only when asked)."""

    @property
    def params(self) -> SamplingParams: ...

    @property
    def prompt_token_ids(self) -> list[int]: ...

    @property
    def output_token_ids(self) -> list[int]: ...


@dataclass
class RowState:
    """A SamplingRow as plain data."""

    params: SamplingParams
    prompt_token_ids: list[int]
    output_token_ids: list[int]


@dataclass
class SamplingMetadata:
    all_greedy: bool
    all_random: bool
    temperature: torch.Tensor
    """(R,) float32; 1.0 on greedy rows so division is harmless."""
    greedy_mask: torch.Tensor
    """(R,) bool."""
    top_k: torch.Tensor | None
    """(R,) int64, vocab size where disabled; None when no row uses it."""
    top_p: torch.Tensor | None
    min_p: torch.Tensor | None
    generators: dict[int, torch.Generator]
    """row -> generator for seeded rows, seeded from (seed, output position) so a draw does not
    depend on the batch it lands in, nor on preemption."""
    rows: Sequence[SamplingRow]
    needs_processing: bool
    """Any token filter, penalty, logit bias or min_tokens mask to apply."""
    max_num_logprobs: int | None
    """Largest `logprobs` asked for in the batch (None: no row wants logprobs)."""
    logits_processors: Any = None
    """The engine's logits processors for this step (logits_processors/batch.py LogitsProcessorStep:
    `apply(logits, argmax_invariant)`), or None."""

    @classmethod
    def build(cls, rows: Sequence[SamplingRow], vocab_size: int, device: torch.device | str = "cpu") -> SamplingMetadata:
        types = [r.params.sampling_type for r in rows]
        greedy = [t == SamplingType.GREEDY for t in types]
        temperature = torch.tensor([1.0 if g else r.params.temperature for g, r in zip(greedy, rows, strict=True)],
                                   dtype=torch.float32, device=device)
        top_k = top_p = min_p = None
        random_rows = [r for g, r in zip(greedy, rows, strict=True) if not g]
        if any(r.params.top_k > 0 for r in random_rows):
            top_k = torch.tensor([r.params.top_k if r.params.top_k > 0 else vocab_size for r in rows],
                                 dtype=torch.int64, device=device)
        if any(r.params.top_p < 1.0 for r in random_rows):
            top_p = torch.tensor([r.params.top_p for r in rows], dtype=torch.float32, device=device)
        if any(r.params.min_p > 0.0 for r in random_rows):
            min_p = torch.tensor([r.params.min_p for r in rows], dtype=torch.float32, device=device)
        generators = {}
        for i, r in enumerate(rows):
            if types[i] == SamplingType.RANDOM_SEED:
                g = torch.Generator(device=device)
                g.manual_seed(step_seed(r.params.seed, len(r.output_token_ids)))  # type: ignore[arg-type]
                generators[i] = g
        needs_processing = any(
            r.params.presence_penalty or r.params.frequency_penalty or r.params.repetition_penalty != 1.0
            or r.params.logit_bias or r.params.filters_tokens or len(r.output_token_ids) < r.params.min_tokens
            for r in rows)
        wanted = [r.params.logprobs for r in rows if r.params.logprobs is not None]
        return cls(all_greedy=all(greedy), all_random=not any(greedy), temperature=temperature,
                   greedy_mask=torch.tensor(greedy, dtype=torch.bool, device=device), top_k=top_k,
                   top_p=top_p, min_p=min_p, generators=generators, rows=rows,
                   needs_processing=needs_processing, max_num_logprobs=max(wanted) if wanted else None)


class SamplingRowTable:
    """The sampling parameters of a persistent batch's rows (worker/input_batch.py) as arrays,
    written once when a request takes a row: a step's SamplingMetadata gathers its sampling rows
    from them, as SamplingMetadata.build derives it from the parameters, and reuses the previous
    step's tensors when its rows and their parameters are the same (a steady decode batch). Only
    what moves with the output length is redone each step: the seeded rows' generators and the
    min_tokens mask."""

    def __init__(self, vocab_size: int, rows: int) -> None:
        self.vocab_size = vocab_size
        self.temperature = np.ones(rows, dtype=np.float32)
        """1.0 on greedy rows."""
        self.greedy = np.zeros(rows, dtype=bool)
        self.top_k = np.full(rows, vocab_size, dtype=np.int64)
        """The vocabulary size where disabled."""
        self.top_p = np.ones(rows, dtype=np.float32)
        self.min_p = np.zeros(rows, dtype=np.float32)
        self.uses_top_k = np.zeros(rows, dtype=bool)
        self.uses_top_p = np.zeros(rows, dtype=bool)
        self.uses_min_p = np.zeros(rows, dtype=bool)
        """Whether each of the three is set (decided on the Python values, as build decides)."""
        self.seeded = np.zeros(rows, dtype=bool)
        self.seeds: dict[int, int] = {}
        """row -> seed of a seeded random row (a Python int: any size)."""
        self.penalized = np.zeros(rows, dtype=bool)
        """Any penalty, logit bias or token filter (min_tokens is checked per step)."""
        self.min_tokens = np.zeros(rows, dtype=np.int64)
        self.logprobs = np.full(rows, -1, dtype=np.int64)
        """-1: no logprobs asked."""
        self._version = 0
        """Bumped on every write: tensors gathered at an older version are stale."""
        self._last: tuple[int, bytes, dict] | None = None
        """(version, rows as bytes, the step-independent fields) of the last metadata built."""

    def write(self, row: int, params: SamplingParams) -> None:
        greedy = params.sampling_type == SamplingType.GREEDY
        self.greedy[row] = greedy
        self.temperature[row] = 1.0 if greedy else params.temperature
        self.top_k[row] = params.top_k if params.top_k > 0 else self.vocab_size
        self.top_p[row] = params.top_p
        self.min_p[row] = params.min_p
        self.uses_top_k[row] = params.top_k > 0
        self.uses_top_p[row] = params.top_p < 1.0
        self.uses_min_p[row] = params.min_p > 0.0
        self.seeded[row] = params.sampling_type == SamplingType.RANDOM_SEED
        if self.seeded[row]:
            self.seeds[row] = params.seed  # type: ignore[assignment]
        self.penalized[row] = bool(params.presence_penalty or params.frequency_penalty
                                   or params.repetition_penalty != 1.0 or params.logit_bias
                                   or params.filters_tokens)
        self.min_tokens[row] = params.min_tokens
        self.logprobs[row] = -1 if params.logprobs is None else params.logprobs
        self._version += 1

    def clear(self, row: int) -> None:
        self.seeds.pop(row, None)
        self.seeded[row] = False
        self._version += 1

    def grow(self, rows: int) -> None:
        fill = {"temperature": 1.0, "top_k": self.vocab_size, "top_p": 1.0, "logprobs": -1}
        for name in ("temperature", "greedy", "top_k", "top_p", "min_p", "uses_top_k", "uses_top_p", "uses_min_p",
                     "seeded", "penalized", "min_tokens", "logprobs"):
            old = getattr(self, name)
            new = np.full(rows, fill.get(name, 0), dtype=old.dtype)
            new[:len(old)] = old
            setattr(self, name, new)

    def metadata(self, rows: np.ndarray, views: Sequence[SamplingRow], num_output: np.ndarray,
                 device: torch.device | str = "cpu") -> SamplingMetadata:
        """SamplingMetadata of table `rows` (the step's sampling rows in logits order); `views`
        their SamplingRows, `num_output` their output lengths so far."""
        key = rows.astype(np.int64, copy=False).tobytes()
        last = self._last
        if last is not None and last[0] == self._version and last[1] == key:
            fixed = last[2]
        else:
            fixed = self._fixed_fields(rows, device)
            self._last = (self._version, key, fixed)
        generators = {}
        if fixed["seeded"]:
            for i in np.nonzero(self.seeded[rows])[0].tolist():
                g = torch.Generator(device=device)
                g.manual_seed(step_seed(self.seeds[int(rows[i])], int(num_output[i])))
                generators[i] = g
        needs_processing = fixed["penalized"] or \
            (fixed["min_tokens"] and bool((num_output < self.min_tokens[rows]).any()))
        return SamplingMetadata(all_greedy=fixed["all_greedy"], all_random=fixed["all_random"],
                                temperature=fixed["temperature"], greedy_mask=fixed["greedy_mask"],
                                top_k=fixed["top_k"], top_p=fixed["top_p"], min_p=fixed["min_p"],
                                generators=generators, rows=views, needs_processing=needs_processing,
                                max_num_logprobs=fixed["max_num_logprobs"])

    def _fixed_fields(self, rows: np.ndarray, device: torch.device | str) -> dict:
        """What SamplingMetadata.build derives from the parameters alone, for these rows."""
        greedy = self.greedy[rows]
        random = ~greedy
        logprobs = int(self.logprobs[rows].max())

        def tensor(values: np.ndarray) -> torch.Tensor:
            return torch.from_numpy(values).to(device)

        return dict(
            all_greedy=bool(greedy.all()), all_random=not greedy.any(), temperature=tensor(self.temperature[rows]),
            greedy_mask=tensor(greedy),
            top_k=tensor(self.top_k[rows]) if (random & self.uses_top_k[rows]).any() else None,
            top_p=tensor(self.top_p[rows]) if (random & self.uses_top_p[rows]).any() else None,
            min_p=tensor(self.min_p[rows]) if (random & self.uses_min_p[rows]).any() else None,
            penalized=bool(self.penalized[rows].any()), max_num_logprobs=logprobs if logprobs >= 0 else None,
            seeded=bool(self.seeded[rows].any()), min_tokens=bool(self.min_tokens[rows].any()))


def step_seed(seed: int, position: int) -> int:
    """A 63-bit seed for the draw at output `position` of a request seeded with `seed`."""
    digest = hashlib.blake2b(f"{seed}:{position}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") & ((1 << 63) - 1)
