"""Speculative-decoding figures of a benchmark run, from the engine's counters before and after it.

    mean accepted length     1 + accepted / drafts: tokens a verification step yields per request
    acceptance rate a        accepted / draft tokens
    per position             accepted at draft position i / drafts
    theory (Leviathan)       (1 - a^(k+1)) / (1 - a) tokens per step

The theory value is printed next to the measured mean accepted length. Offline, with the engine's
rejection count, a is the per-token acceptance accepted / (accepted + rejections) and k the mean
draft length (draft tokens / drafts), so theory and measurement agree when acceptances are
independent of position; from a server's /metrics (no rejection count) a is the acceptance rate
and k = num_speculative_tokens, which understates the theory.

Offline benchmarks read the counters from SchedulerStats.spec_decoding; `bench serve` from the
server's /metrics (kvtide:spec_decode_* or vllm:spec_decode_* families).
"""

from __future__ import annotations

SPEC_FAMILIES = {"num_drafts": "spec_decode_num_drafts", "num_draft_tokens": "spec_decode_num_draft_tokens",
                 "num_accepted_tokens": "spec_decode_num_accepted_tokens"}
PER_POS_FAMILY = "spec_decode_num_accepted_tokens_per_pos"


def speculative_config_record(value: str | dict | None) -> dict | str | None:
    """--speculative-config as the result JSON records it: the parsed object (the text if it is not JSON)."""
    import json

    if not isinstance(value, str):
        return value
    try:
        return json.loads(value)
    except ValueError:
        return value


def spec_decode_figures(counters: dict | None, num_speculative_tokens: int) -> dict | None:
    """Counters accumulated over the measured part (spec_decode.metrics.difference) -> the figures;
    None without speculative decoding. A run without drafts keeps its counts and has None figures."""
    from kvtide.spec_decode.metrics import summarize
    from kvtide.spec_decode.policy import expected_tokens

    if counters is None:
        return None
    k = int(num_speculative_tokens)
    out: dict = {"num_speculative_tokens": k, "num_drafts": int(counters["num_drafts"]),
                 "num_draft_tokens": int(counters["num_draft_tokens"]),
                 "num_accepted_tokens": int(counters["num_accepted_tokens"]),
                 "num_rejections": counters.get("num_rejections"),
                 "accepted_per_pos": [int(n) for n in counters["accepted_per_pos"]],
                 "mean_accepted_length": None, "acceptance_rate": None, "acceptance_rate_per_pos": None,
                 "mean_draft_length": None, "theoretical_tokens_per_step": None}
    summary = summarize(counters)
    if summary is None:
        return out
    mean_draft = out["num_draft_tokens"] / out["num_drafts"]
    if summary["per_token_acceptance"] is not None:
        rate, length = summary["per_token_acceptance"], mean_draft
        theory = expected_tokens(rate, length)
    else:
        rate, length = min(1.0, max(0.0, summary["acceptance_rate"])), k
        theory = expected_tokens(rate, k)
    out.update(mean_accepted_length=summary["mean_accepted_length"], acceptance_rate=summary["acceptance_rate"],
               acceptance_rate_per_pos=summary["acceptance_rate_per_pos"], mean_draft_length=mean_draft,
               theory_acceptance=rate, theory_draft_length=length, theoretical_tokens_per_step=theory)
    return out


def format_spec_decode(figures: dict | None, label: str = "speculative decoding") -> str:
    """Two lines: the figures, then the per-position acceptance (empty without speculation)."""
    if not figures:
        return ""
    k = figures["num_speculative_tokens"]
    if not figures["num_drafts"]:
        return f"{label} (K={k}): no drafts during the measured run"
    per_pos = ", ".join(f"{r:.3f}" for r in figures["acceptance_rate_per_pos"])
    return (f"{label} (K={k}): mean accepted length {figures['mean_accepted_length']:.3f} tokens/step "
            f"(theory for a={figures['theory_acceptance']:.3f}, k={figures['theory_draft_length']:.2f}: "
            f"{figures['theoretical_tokens_per_step']:.3f}), "
            f"acceptance rate {figures['acceptance_rate']:.3f}, {figures['num_drafts']} drafts, "
            f"{figures['num_draft_tokens']} draft tokens (mean {figures['mean_draft_length']:.2f}), "
            f"{figures['num_accepted_tokens']} accepted\n"
            f"{label} acceptance per position: {per_pos}")


def counters_from_prometheus(values: dict[str, float] | None) -> dict | None:
    """kvtide.bench.client.parse_prometheus's dict -> spec-decoding counters, or None when the server
    reports no speculation: no families (another server), or no per-position samples (kvtide and
    vLLM create those only with speculative decoding on)."""
    if not values:
        return None

    def total(family: str) -> float | None:
        found = [v for name, v in values.items() if name.split(":", 1)[-1] in (family, family + "_total")]
        return sum(found) if found else None

    counts = {key: total(family) for key, family in SPEC_FAMILIES.items()}
    per_pos: dict[int, float] = {}
    for name, v in values.items():
        base, _, labels = name.partition("{")
        if base.split(":", 1)[-1] in (PER_POS_FAMILY, PER_POS_FAMILY + "_total") and labels.startswith("position="):
            position = int(labels[len("position="):].strip('"}'))
            per_pos[position] = per_pos.get(position, 0.0) + v
    if not per_pos or any(v is None for v in counts.values()):
        return None
    return {**counts, "accepted_per_pos": [per_pos.get(i, 0.0) for i in range(max(per_pos) + 1)]}


def counter_difference(after: dict | None, before: dict | None) -> dict | None:
    """spec_decode.metrics.difference of two scrapes, None unless both have the same positions (a
    missing 'before' would count everything since the server started)."""
    from kvtide.spec_decode.metrics import difference

    if after is None or before is None or len(before["accepted_per_pos"]) != len(after["accepted_per_pos"]):
        return None
    return difference(after, before)
