"""DeepSeek-R1 style reasoning: the chat template opens <think> in the prompt, so the output is
reasoning from its first character (a leading <think>, if the model writes one anyway, is dropped)
up to </think>, and content after it. With no </think> at all the whole output is reasoning: the
model was cut off while thinking. Models whose template opens the tag in the prompt (DeepSeek-R1,
QwQ, Qwen3 "Thinking-2507") want this parser."""

from __future__ import annotations

from kvtide.reasoning.base import ReasoningParser


class DeepSeekR1ReasoningParser(ReasoningParser):
    name = "deepseek_r1"
    reasoning_without_start_tag = True
