"""Qwen3 reasoning: the model writes <think> itself when it thinks, and thinking may be off.

Rules (one rule for streamed and whole outputs, so both agree):
- Output opening with <think> (after whitespace): reasoning up to the first </think>, content
  after it; with no </think> the rest is all reasoning (cut off while thinking).
- Output not opening with <think>: all content, verbatim, even if a </think> appears later; a
  stream cannot take back content already sent, and a non-thinking answer must stream at once.
  Models whose template opens <think> in the prompt (Qwen3 "Thinking-2507") want deepseek_r1.
- With thinking off, Qwen3's template puts an empty <think></think> in the prompt: the output is
  plain content.
"""

from __future__ import annotations

from kvtide.reasoning.base import ReasoningParser


class Qwen3ReasoningParser(ReasoningParser):
    name = "qwen3"
    reasoning_without_start_tag = False
