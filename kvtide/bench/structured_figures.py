"""Structured-output figures of a `kvtide bench serve` run: were the constrained completions valid, and
what did the server's grammar machinery do meanwhile.

    validity                  of the constrained requests that finished with "stop", the share whose
                              text satisfies the constraint (JSON that validates against its schema,
                              a regex full match, one of the choices); "length" ones are counted
                              apart as truncated: their text was cut, not wrong
    grammars compiled         kvtide:structured_output_grammar_compile_seconds _count delta
    compile mean              that histogram's _sum delta / _count delta
    cache hits                kvtide:structured_output_grammar_cache_hits delta
    jump-forward tokens       kvtide:structured_output_jump_forward_tokens delta: tokens the grammar
                              forced, appended without a forward pass each
    output tokens per forward generation tokens / (generation tokens - jump-forward tokens), over the
    pass                      run (unconstrained requests included): 1.0 without jump-forward

The server figures are None when the server has no such /metrics families (vLLM has none of the
structured-output ones).
"""

from __future__ import annotations

import json
import re
import statistics

from kvtide.bench.request_record import RequestRecord

SERVER_PREFIXES = ("kvtide:", "vllm:")


def check_output(constraint: dict, text: str) -> bool | None:
    """Whether `text` satisfies `constraint` (a structured_outputs object); None when it cannot be
    checked here (grammar, structural_tag; a JSON schema without the jsonschema package)."""
    if "choice" in constraint:
        return text in constraint["choice"]
    if "regex" in constraint:
        try:
            return re.fullmatch(constraint["regex"], text) is not None
        except re.error:
            return None
    if "json" in constraint or constraint.get("json_object"):
        try:
            value = json.loads(text)
        except ValueError:
            return False
        if "json" not in constraint:
            return isinstance(value, dict)
        schema = constraint["json"]
        if isinstance(schema, str):
            schema = json.loads(schema)
        try:
            import jsonschema
        except ImportError:
            return None
        try:
            return jsonschema.validators.validator_for(schema)(schema).is_valid(value)
        except Exception:  # a schema jsonschema cannot apply (unknown type, unresolvable $ref): unchecked
            return None
    return None


def validity_counts(records: list[RequestRecord]) -> dict:
    """Valid / invalid / truncated / unchecked among the successful constrained requests."""
    counts = {"num_valid": 0, "num_invalid": 0, "num_truncated": 0, "num_unchecked": 0}
    for record in records:
        if record.structured_outputs is None or not record.success:
            continue
        if record.finish_reason == "length":
            counts["num_truncated"] += 1
            continue
        verdict = check_output(record.structured_outputs, record.generated_text) \
            if record.finish_reason == "stop" else None
        key = "num_unchecked" if verdict is None else "num_valid" if verdict else "num_invalid"
        counts[key] += 1
    checked = counts["num_valid"] + counts["num_invalid"]
    counts["valid_rate"] = counts["num_valid"] / checked if checked else None
    return counts


def _sample(values: dict[str, float], name: str) -> float | None:
    found = [values[p + name] for p in SERVER_PREFIXES if p + name in values]
    return sum(found) if found else None


def _delta(before: dict[str, float], after: dict[str, float], name: str) -> float | None:
    old, new = _sample(before, name), _sample(after, name)
    return None if old is None or new is None else new - old


def server_figures(before: dict[str, float] | None, after: dict[str, float] | None) -> dict | None:
    """The grammar counters' deltas over the run (scraped by kvtide.bench.client.scrape_metrics)."""
    if not before or not after:
        return None
    compiled = _delta(before, after, "structured_output_grammar_compile_seconds_count")
    if compiled is None:
        return None
    compile_s = _delta(before, after, "structured_output_grammar_compile_seconds_sum") or 0.0
    jump_forward = _delta(before, after, "structured_output_jump_forward_tokens_total") or 0.0
    generated = _delta(before, after, "generation_tokens_total")
    forward_tokens = generated - jump_forward if generated is not None else None
    return {
        "num_constrained_requests": _int(_delta(before, after, "structured_output_requests_total")),
        "grammars_compiled": int(compiled),
        "grammar_cache_hits": _int(_delta(before, after, "structured_output_grammar_cache_hits_total")),
        "compile_seconds_total": compile_s,
        "compile_mean_ms": 1000.0 * compile_s / compiled if compiled > 0 else None,
        "jump_forward_tokens": int(jump_forward),
        "generation_tokens": _int(generated),
        "output_tokens_per_forward_pass":
            generated / forward_tokens if generated is not None and forward_tokens and forward_tokens > 0 else None,
    }


def _int(value: float | None) -> int | None:
    return None if value is None else int(value)


def structured_output_summary(records: list[RequestRecord], before: dict[str, float] | None,
                              after: dict[str, float] | None) -> dict:
    """result["structured_output"] of a run whose dataset pairs jobs with constraints."""
    constrained = [r for r in records if r.structured_outputs is not None]
    out: dict = {"num_constrained_requests": len(constrained),
                 "num_unconstrained_requests": len(records) - len(constrained)}
    out.update(validity_counts(records))
    for name, group in (("constrained", constrained), ("unconstrained",
                                                       [r for r in records if r.structured_outputs is None])):
        tpots = [r.tpot for r in group if r.success and r.tpot is not None]
        out[f"median_tpot_{name}_ms"] = 1000.0 * statistics.median(tpots) if tpots else None
    out["server"] = server_figures(before, after)
    return out


def report_rows(figures: dict) -> list[tuple[str, object, str]]:
    """(label, value, format) rows for kvtide.bench.metrics.format_report."""
    rows: list[tuple[str, object, str]] = [
        ("Constrained requests:", figures["num_constrained_requests"], "{}"),
        ("Unconstrained requests:", figures["num_unconstrained_requests"], "{}"),
    ]
    if figures["num_constrained_requests"]:
        rows.append(("Valid / invalid / truncated / unchecked:", "{num_valid} / {num_invalid} / "
                     "{num_truncated} / {num_unchecked}".format(**figures), "{}"))
        if figures["valid_rate"] is not None:
            rows.append(("Valid of finished (%):", 100 * figures["valid_rate"], "{:.2f}"))
    for key, label in (("median_tpot_constrained_ms", "Median TPOT constrained (ms):"),
                       ("median_tpot_unconstrained_ms", "Median TPOT unconstrained (ms):")):
        if figures.get(key) is not None:
            rows.append((label, figures[key], "{:.2f}"))
    server = figures.get("server")
    if server:
        rows += [("Grammars compiled (server):", server["grammars_compiled"], "{}"),
                 ("Grammar cache hits (server):", server["grammar_cache_hits"], "{}")]
        if server["compile_mean_ms"] is not None:
            rows.append(("Mean grammar compile (ms):", server["compile_mean_ms"], "{:.2f}"))
        rows.append(("Jump-forward tokens (server):", server["jump_forward_tokens"], "{}"))
        if server["output_tokens_per_forward_pass"] is not None:
            rows.append(("Output tokens per forward pass:", server["output_tokens_per_forward_pass"], "{:.3f}"))
    return rows
