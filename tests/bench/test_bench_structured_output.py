"""Structured-output benchmarking: the json-schema dataset, --structured-output-ratio, constrained
payloads, the validity check and the report (against the fake server; no model)."""

from __future__ import annotations

import importlib.util
import json
import pathlib

import pytest
from bench_fake_server import ServerThread, make_app
from test_bench_datasets import dataset_args

from kvtide.bench.client import PayloadOptions, build_payload, parse_prometheus
from kvtide.bench.datasets import build_dataset
from kvtide.bench.json_schemas import TASKS, json_schema_jobs
from kvtide.bench.metrics import RequestRecord, format_report
from kvtide.bench.structured_figures import check_output, server_figures, validity_counts
from kvtide.cli import main as kvtide_main

SCRIPT = pathlib.Path(__file__).resolve().parents[2] / "scripts" / "bench_structured_output.py"




def smallest_instance(schema: dict):
    """A value the schema accepts: the first enum value, the minimum, one array item, 'a' strings."""
    if "enum" in schema:
        return schema["enum"][0]
    kind = schema["type"]
    if kind == "object":
        return {key: smallest_instance(value) for key, value in schema["properties"].items()}
    if kind == "array":
        return [smallest_instance(schema["items"])] * schema["minItems"]
    if kind == "integer":
        return schema["minimum"]
    if kind == "boolean":
        return True
    return {"^[A-Z]{2}[0-9]{3}$": "AB123", "^[A-Z]{3}$": "ABC", "^[A-Z]{2}[0-9]{2,4}$": "AB12",
            "^[A-Z]{3}-[0-9]{4}$": "ABC-1234", "^[A-Z]{4}$": "ABCD", "^[A-Z]{3}[0-9]{3}$": "ABC123",
            "^[a-z]{1,8}[0-9]{1,2}$": "a1"}.get(schema["pattern"], "a")


def bounded(schema: dict) -> bool:
    """Every string has a pattern or enum, every array maxItems, every object all keys required."""
    if "enum" in schema:
        return True
    kind = schema["type"]
    if kind == "string":
        return "pattern" in schema and "maxLength" not in schema
    if kind == "array":
        return "maxItems" in schema and bounded(schema["items"])
    if kind == "object":
        return set(schema["required"]) == set(schema["properties"]) and all(
            bounded(value) for value in schema["properties"].values())
    return kind == "boolean" or {"minimum", "maximum"} <= set(schema)


def test_json_schema_dataset_is_seeded_and_every_schema_compiles(tokenizer):
    from kvtide.sampling_params import StructuredOutputsParams
    from kvtide.structured_output.grammars import build_grammar

    args = dataset_args("--dataset-name", "json-schema", "--num-prompts", "24", "--seed", "3")
    jobs = build_dataset(args, tokenizer)
    again = build_dataset(args, tokenizer)
    assert [(j.user_turns, j.structured_outputs) for j in jobs] == [(j.user_turns, j.structured_outputs)
                                                                     for j in again]
    other = build_dataset(dataset_args("--dataset-name", "json-schema", "--num-prompts", "24", "--seed", "4"),
                          tokenizer)
    assert [j.user_turns for j in other] != [j.user_turns for j in jobs]
    assert all(j.constrained and j.output_lens == [256] and j.num_turns == 1 for j in jobs)
    assert all(j.prompt_lens[0] == len(tokenizer.encode(j.user_turns[0], add_special_tokens=False)) for j in jobs)
    schemas = {json.dumps(j.structured_outputs["json"], sort_keys=True) for j in jobs}
    assert 8 <= len(TASKS) <= 16 and len(schemas) == len(TASKS)
    assert all(j.structured_outputs["disable_any_whitespace"] is True for j in jobs)
    for task in TASKS:
        assert bounded(task.schema), task.name
        assert check_output({"json": task.schema}, json.dumps(smallest_instance(task.schema))), task.name
        build_grammar(StructuredOutputsParams(json=task.schema))
        build_grammar(StructuredOutputsParams(json=task.schema, disable_any_whitespace=True))
    loose = json_schema_jobs(3, 0, any_whitespace=True)
    assert all("disable_any_whitespace" not in constraint for _, constraint in loose)


def test_ratio_picks_constrained_jobs_and_keeps_the_prompts(tokenizer):
    def jobs(ratio: str, seed: str = "0"):
        return build_dataset(dataset_args("--dataset-name", "json-schema", "--num-prompts", "20",
                                          "--structured-output-ratio", ratio, "--seed", seed), tokenizer)

    full, half, none = jobs("1"), jobs("0.5"), jobs("0")
    assert [j.user_turns for j in half] == [j.user_turns for j in full] == [j.user_turns for j in none]
    assert sum(j.constrained for j in full) == 20 and sum(j.constrained for j in none) == 0
    picked = [j.constrained for j in half]
    assert sum(picked) == 10 and picked == [j.constrained for j in jobs("0.5")]
    assert picked != [j.constrained for j in jobs("0.5", seed="1")]
    assert all(j.structured_outputs is not None for j in none)  # paired, just not sent
    with pytest.raises(ValueError, match="structured-output-ratio"):
        jobs("1.5")


def test_jsonl_items_carry_their_constraint(tmp_path, tokenizer):
    schema = {"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"]}
    path = tmp_path / "items.jsonl"
    path.write_text("\n".join(json.dumps(item) for item in [
        {"prompt": "count it", "schema": schema},
        {"prompt": "as text", "schema": json.dumps(schema)},
        {"prompt": "a word", "structured_outputs": {"regex": "[a-z]+"}},
        {"prompt": "free"},
    ]))
    jobs = build_dataset(dataset_args("--dataset-name", "jsonl", "--dataset-path", str(path)), tokenizer)
    by_prompt = {j.user_turns[0]: j for j in jobs}
    assert by_prompt["count it"].structured_outputs == {"json": schema} == by_prompt["as text"].structured_outputs
    assert by_prompt["a word"].structured_outputs == {"regex": "[a-z]+"}
    assert by_prompt["free"].structured_outputs is None and not by_prompt["free"].constrained
    assert all(j.constrained for j in jobs if j.structured_outputs is not None)
    path.write_text(json.dumps({"prompt": "x", "schema": [1]}))
    with pytest.raises(ValueError, match="schema"):
        build_dataset(dataset_args("--dataset-name", "jsonl", "--dataset-path", str(path)), tokenizer)


def test_constrained_payload_sends_max_tokens_only():
    options = PayloadOptions(ignore_eos=True, min_tokens=True)
    constraint = {"json": TASKS[0].schema}
    payload = build_payload("m", "p", 64, options, constraint)
    assert payload["structured_outputs"] is constraint and payload["max_tokens"] == 64
    assert "ignore_eos" not in payload and "min_tokens" not in payload
    plain = build_payload("m", "p", 64, options)
    assert plain["ignore_eos"] is True and plain["min_tokens"] == 64 and "structured_outputs" not in plain


def record(constraint: dict | None, text: str, finish: str = "stop", success: bool = True) -> RequestRecord:
    return RequestRecord(prompt_len=4, expected_output_len=64, success=success, generated_text=text,
                         finish_reason=finish, structured_outputs=constraint)


def test_validity_counts_valid_invalid_truncated():
    schema = TASKS[2].schema
    good = json.dumps(smallest_instance(schema))
    wrong_type = json.dumps({**smallest_instance(schema), "temperature_celsius": "warm"})
    constraint = {"json": schema, "disable_any_whitespace": True}
    records = [
        record(constraint, good), record(constraint, " " + good + "\n"),
        record(constraint, wrong_type), record(constraint, good[:-1]),  # fails the schema; is not JSON
        record(constraint, good[:20], finish="length"),
        record(constraint, "", success=False),  # failed: counted by the serving metrics, not here
        record(None, "free text"),  # unconstrained
        record({"regex": "[a-z]{2,3}"}, "abc"), record({"regex": "[a-z]{2,3}"}, "abcd"),
        record({"choice": ["yes", "no"]}, "no"), record({"grammar": "root ::= \"a\""}, "a"),
        record({"json_object": True}, "[1]"),
    ]
    counts = validity_counts(records)
    assert counts == {"num_valid": 4, "num_invalid": 4, "num_truncated": 1, "num_unchecked": 1,
                      "valid_rate": 0.5}
    assert validity_counts([record(constraint, good[:5], finish="length")])["valid_rate"] is None


def test_server_figures_from_metrics_deltas():
    def scrape(generated: int, jump: int, compiled: int, compile_s: float, hits: int, requests: int) -> dict:
        return parse_prometheus(
            f"# TYPE kvtide:generation_tokens counter\nkvtide:generation_tokens_total {generated}\n"
            f"# TYPE kvtide:structured_output_jump_forward_tokens counter\n"
            f"kvtide:structured_output_jump_forward_tokens_total {jump}\n"
            f"# TYPE kvtide:structured_output_grammar_cache_hits counter\n"
            f"kvtide:structured_output_grammar_cache_hits_total {hits}\n"
            f"# TYPE kvtide:structured_output_requests counter\nkvtide:structured_output_requests_total {requests}\n"
            f"# TYPE kvtide:structured_output_grammar_compile_seconds histogram\n"
            f'kvtide:structured_output_grammar_compile_seconds_bucket{{le="+Inf"}} {compiled}\n'
            f"kvtide:structured_output_grammar_compile_seconds_count {compiled}\n"
            f"kvtide:structured_output_grammar_compile_seconds_sum {compile_s}\n")

    figures = server_figures(scrape(100, 10, 1, 1.5, 0, 1), scrape(1100, 760, 4, 1.53, 9, 13))
    assert figures["grammars_compiled"] == 3 and figures["grammar_cache_hits"] == 9
    assert figures["num_constrained_requests"] == 12 and figures["jump_forward_tokens"] == 750
    assert figures["compile_mean_ms"] == pytest.approx(10.0)
    assert figures["output_tokens_per_forward_pass"] == pytest.approx(1000 / 250)
    assert server_figures(scrape(1, 0, 0, 0, 0, 0), scrape(9, 0, 0, 0, 0, 0))["compile_mean_ms"] is None
    no_families = parse_prometheus("# TYPE vllm:generation_tokens counter\nvllm:generation_tokens_total 5\n")
    assert server_figures(no_families, no_families) is None and server_figures(None, None) is None


def fake_reply(body: dict) -> tuple[str, str]:
    """Valid, schema-breaking and truncated replies in turn (the warm-up's choice: a choice)."""
    constraint = body["structured_outputs"]
    if "choice" in constraint:
        return constraint["choice"][0], "stop"
    instance = smallest_instance(constraint["json"])
    kind = sum(map(ord, body["prompt"])) % 3
    if kind == 1:
        instance[next(iter(instance))] = None
    text = json.dumps(instance)
    return (text[:10], "length") if kind == 2 else (text, "stop")


def test_bench_serve_structured_run_reports(tmp_path, capsys):
    app = make_app(faulty=False, token_delay_s=0.0, constrained_text=fake_reply)
    out = tmp_path / "serve.json"
    argv = ["bench", "serve", "--model", "fake-model", "--tokenizer", "demo", "--dataset-name", "json-schema",
            "--num-prompts", "12", "--max-concurrency", "4", "--structured-output-ratio", "0.5",
            "--output-len", "300", "--disable-tqdm", "--output-json", str(out)]
    with ServerThread(app) as server:
        assert kvtide_main([*argv[:2], "--base-url", server.url, *argv[2:]]) == 0
    result = json.loads(out.read_text())
    bodies = app.state.fake["bodies"]
    assert bodies[1]["structured_outputs"] == {"choice": ["yes", "no"]}  # the warm-up's check
    measured = bodies[2:]
    constrained = [b for b in measured if "structured_outputs" in b]
    assert len(measured) == 12 and len(constrained) == 6
    assert all("ignore_eos" not in b and "min_tokens" not in b and b["max_tokens"] == 300 for b in constrained)
    assert all(b["ignore_eos"] is True for b in measured if "structured_outputs" not in b)
    figures = result["structured_output"]
    assert result["structured_output_ratio"] == 0.5
    assert result["num_short_outputs"] == 0  # constrained replies end where their grammar does
    assert figures["num_constrained_requests"] == 6 and figures["num_unconstrained_requests"] == 6
    texts = [r for r in result["requests"] if r["structured_outputs"] is not None]
    expected = validity_counts([RequestRecord(**{k: r[k] for k in ("prompt_len", "expected_output_len", "success",
                                                                    "generated_text", "finish_reason",
                                                                    "structured_outputs")}) for r in texts])
    assert {k: figures[k] for k in expected} == expected
    assert figures["num_valid"] + figures["num_invalid"] + figures["num_truncated"] == 6
    server = figures["server"]
    assert server["num_constrained_requests"] == 6 and server["grammars_compiled"] + server["grammar_cache_hits"] == 6
    assert server["compile_mean_ms"] == pytest.approx(5.0)
    assert server["output_tokens_per_forward_pass"] > 1.0
    assert figures["median_tpot_constrained_ms"] is not None and figures["median_tpot_unconstrained_ms"] is not None
    text = capsys.readouterr().out
    for label in ("Structured Output", "Constrained requests:", "Valid / invalid / truncated / unchecked:",
                  "Grammars compiled (server):", "Mean grammar compile (ms):", "Jump-forward tokens (server):",
                  "Output tokens per forward pass:"):
        assert label in text
    assert "Structured Output" not in format_report({**result, "structured_output": None})


def test_driver_table():
    spec = importlib.util.spec_from_file_location("bench_structured_output", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)

    def mode(tpot: float, constrained: int, per_forward: float, valid: float | None, truncated: int = 0) -> dict:
        return {"completed": 4, "failed": 0, "num_requests": 4, "output_throughput": 100.0, "median_tpot_ms": tpot,
                "p99_tpot_ms": 2 * tpot, "structured_output": {
                    "num_constrained_requests": constrained, "valid_rate": valid, "num_truncated": truncated,
                    "server": {"output_tokens_per_forward_pass": per_forward}}}

    probe = {"ttft_new_schema_ms": 40.0, "ttft_cached_schema_ms": 30.0, "compile_median_ms": 4.5,
             "first_compile_ms": 1500.0}
    summary = {"modes": {module.MODES[0]: mode(10.0, 0, 1.0, None), module.MODES[1]: mode(5.0, 4, 4.0, 1.0),
                         module.MODES[2]: mode(20.0, 4, 1.0, 0.75, truncated=1)},
               "compile_probe": {module.MODES[1]: probe, module.MODES[2]: probe}}
    table = module.markdown_table(summary).splitlines()
    assert table[0].startswith("| mode | requests | output tok/s | TPOT median / p99 ms | TPOT / unconstrained")
    assert all(line.count("|") == table[0].count("|") for line in table[:5])
    assert "| 0.50 | 4.00 | 40.0 / 30.0 | 4.50 | 100.0 |" in table[3]
    assert "| 2.00 | 1.00 | 40.0 / 30.0 | 4.50 | 75.0 (1 truncated) |" in table[4]
    assert table[2].endswith("| 1.00 | 1.00 | – | – | – |") and "1500 and 1500 ms" in table[-1]
