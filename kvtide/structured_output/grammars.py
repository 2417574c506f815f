"""StructuredOutputsParams -> xgrammar Grammar. One function, used by the frontend to validate a
request (no tokenizer needed) and by the compiler in the core."""

from __future__ import annotations

import json

from kvtide.sampling_params import StructuredOutputsParams


def build_grammar(params: StructuredOutputsParams, max_whitespace_cnt: int | None = None):
    """The xgrammar Grammar of a constraint; ValueError naming the field and xgrammar's reason.
    `max_whitespace_cnt` bounds each run of optional whitespace in JSON (None: unbounded)."""
    import xgrammar as xgr

    kind = params.kind
    whitespace = {"any_whitespace": not params.disable_any_whitespace}
    if not params.disable_any_whitespace and max_whitespace_cnt is not None:
        whitespace["max_whitespace_cnt"] = max_whitespace_cnt
    try:
        if kind == "json":
            # strict mode: objects take no properties the schema does not name (unless it allows them)
            # the schema as given (its key order is the output's order), not the sorted cache key
            schema = json.loads(params.json) if isinstance(params.json, str) else params.json
            schema = _bounded_strings_as_patterns(schema)
            return xgr.Grammar.from_json_schema(json.dumps(schema), strict_mode=True, **whitespace)
        if kind == "json_object":  # any object (xgrammar's builtin JSON grammar admits any value)
            return xgr.Grammar.from_json_schema('{"type": "object"}', **whitespace)
        if kind == "regex":
            return xgr.Grammar.from_regex(params.regex)
        if kind == "choice":
            # each choice a JSON-escaped EBNF string literal
            return xgr.Grammar.from_ebnf("root ::= " + " | ".join(json.dumps(c, ensure_ascii=False)
                                                                    for c in params.choice))
        if kind == "grammar":
            return xgr.Grammar.from_ebnf(params.grammar)
        return xgr.Grammar.from_structural_tag(params.structural_tag)
    except (RuntimeError, ValueError, TypeError) as e:
        raise ValueError(f"structured_outputs.{kind}: {error_reason(e)}") from e


def _bounded_strings_as_patterns(schema):
    """Strings with minLength/maxLength (and no pattern or format) as a pattern of as many
    characters. xgrammar 0.2.9 compiles a bounded string to characters that include raw control
    characters, which JSON forbids; the pattern excludes them. Such values then
    hold no quote or backslash (the pattern admits no escapes). Invalid UTF-8 byte runs the
    matcher admits are masked by the Utf8Guard."""
    if isinstance(schema, list):
        return [_bounded_strings_as_patterns(item) for item in schema]
    if not isinstance(schema, dict):
        return schema
    schema = {key: _bounded_strings_as_patterns(value) for key, value in schema.items()}
    bounded = "minLength" in schema or "maxLength" in schema
    if (schema.get("type") == "string" and bounded and not {"pattern", "format", "enum", "const"} & set(schema)
            and all(isinstance(schema.get(k, 0), int) for k in ("minLength", "maxLength"))):
        low, high = schema.pop("minLength", 0), schema.pop("maxLength", "")
        schema["pattern"] = f"^[^\\x00-\\x1f]{{{low},{high}}}$"
    return schema


def error_reason(error: Exception) -> str:
    """xgrammar's message without its '[time] /project/cpp/file.cc:123: ' prefix."""
    text = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
    if text.startswith("[") and ": " in text:
        parts = text.split(": ", 1)
        if ".cc:" in parts[0] or ".h:" in parts[0]:
            text = parts[1]
    return text
