"""Reference implementations of KV policies written plainly on Hugging Face transformers: greedy
decoding one token at a time over HF's own KV cache, with a 4-D attention mask built from the
policy's definition of which key positions each query sees (eager attention, which also returns
the softmax weights a score-based policy accumulates)."""

from __future__ import annotations

from collections.abc import Callable

import torch


def _cache_argument() -> str:
    """The keyword of the KV cache in transformers' forward: `cache` since 5.x deprecated
    `past_key_values`."""
    import inspect

    from transformers import LlamaForCausalLM

    return "cache" if "cache" in inspect.signature(LlamaForCausalLM.forward).parameters else "past_key_values"


CACHE_ARG = _cache_argument()


def load_eager(model_dir: str):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32, attn_implementation="eager").eval()


def masked_greedy(model, prompt_ids: list[int], max_tokens: int,
                  visible: Callable[[int, int], torch.Tensor],
                  before_step: Callable[[int], None] | None = None,
                  on_weights: Callable[[list[torch.Tensor]], None] | None = None) -> list[int]:
    """Greedy tokens. `visible(p, n)` -> (n,) bool: the keys 0..n-1 the query at position p sees
    (called after `before_step(num_tokens_with_kv)`, which may change the policy's state);
    `on_weights` gets each forward's attention weights, one (heads, queries, keys) tensor per layer."""
    tokens: list[int] = []
    past = None
    ids = list(prompt_ids)
    start = 0
    with torch.inference_mode():
        while len(tokens) < max_tokens:
            if before_step is not None:
                before_step(start)
            positions = list(range(start, len(ids)))
            rows = torch.stack([visible(p, len(ids)) for p in positions])
            mask = torch.zeros(1, 1, len(positions), len(ids)).masked_fill_(~rows[None, None], float("-inf"))
            out = model(torch.tensor([ids[start:]]), attention_mask=mask, position_ids=torch.tensor([positions]),
                        **{CACHE_ARG: past}, use_cache=True, output_attentions=on_weights is not None)
            if on_weights is not None:
                on_weights([w[0] for w in out.attentions])
            past = getattr(out, "cache", None) or out.past_key_values
            token = int(out.logits[0, -1].argmax())
            tokens.append(token)
            start = len(ids)
            ids.append(token)
    return tokens
