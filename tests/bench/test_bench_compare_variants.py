"""`bench compare --engines kvtide:int8,llamacpp:Q4_0,...`: several configurations of one engine in one
sitting, each its own worker and label, ratios to the float kvtide, errors before any worker starts."""

from __future__ import annotations

import argparse
import json
import os

import pytest
from gguf_writer import build_bpe_checkpoint, write_gguf

from kvtide.bench import compare, peers
from kvtide.cli import main as kvtide_main

SMALL = ["--repeats", "1", "--num-prompts", "2", "--input-len", "8", "--output-len", "4", "--pause", "0",
         "--threads", "2", "--kv-cache-memory", "64MiB", "--max-model-len", "256"]
LLAMACPP_PYTHON = peers.default_python("llamacpp")
needs_llamacpp = pytest.mark.skipif(LLAMACPP_PYTHON is None,
                                    reason=f"no llama-cpp-python peer under {peers.peers_dir()}/llamacpp")


def _args(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    compare.add_compare_args(parser)
    return parser.parse_args(list(argv))


@pytest.fixture(scope="module")
def bpe_dir(tmp_path_factory) -> str:
    """A tiny Llama whose shapes every variant divides (int4 g32: hidden 128, intermediate 384), with
    a BPE tokenizer llama.cpp loads."""
    return build_bpe_checkpoint(str(tmp_path_factory.mktemp("bpe")), intermediate_size=384)


@pytest.fixture(scope="module")
def ggufs(bpe_dir, tmp_path_factory) -> dict[str, str]:
    """The checkpoint as an F32 GGUF and as a Q8_0 one (gguf-py's quantizer)."""
    out = tmp_path_factory.mktemp("gguf")
    return {"F32": write_gguf(bpe_dir, str(out / "tiny-f32.gguf"), "F32"),
            "Q8_0": write_gguf(bpe_dir, str(out / "tiny.Q8_0.gguf"), "Q8_0")}


# ---- parsing ---------------------------------------------------------------------------------------
@pytest.mark.parametrize("text, label, fields", [
    ("kvtide", "kvtide", {"engine": "kvtide", "variant": None, "quantization": None}),
    ("kvtide:int8", "kvtide:int8", {"engine": "kvtide", "quantization": "int8", "group_size": None}),
    ("kvtide:int4", "kvtide:int4", {"quantization": "int4", "group_size": None}),
    ("kvtide:INT4-g32", "kvtide:int4-g32", {"quantization": "int4", "group_size": 32}),
    ("kvtide:fp8", "kvtide:fp8", {"quantization": "fp8"}),
    ("kvtide:w8a8", "kvtide:w8a8", {"quantization": "w8a8"}),
    ("kvtide:gguf", "kvtide:gguf", {"quantization": None, "from_gguf": True}),
    ("kvtide:gguf-q4_0", "kvtide:gguf-Q4_0", {"quantization": None, "from_gguf": True, "gguf_type": "Q4_0"}),
    ("llamacpp:q8_0", "llamacpp:Q8_0", {"engine": "llamacpp", "gguf_type": "Q8_0"}),
    ("llamacpp:Q4_K_M", "llamacpp:Q4_K_M", {"gguf_type": "Q4_K_M"}),
    (" hf ", "hf", {"engine": "hf", "variant": None}),
])
def test_variants_parse_to_their_label_and_configuration(text, label, fields):
    entry = compare.parse_engine(text)
    assert entry.label == label
    for key, value in fields.items():
        assert getattr(entry, key) == value, key


@pytest.mark.parametrize("text, names", [
    ("kvtide:int3", "kvtide:int4-g32"), ("kvtide:int4-g16", "kvtide:int4-g64"), ("kvtide:", "kvtide:gguf"),
    ("hf:int8", "hf has no variants"), ("vllm:foo", "vllm has no variants"), ("llamacpp:Q9", "llamacpp:Q4_0"),
    ("kvtide:gguf-Q9", "kvtide:gguf-Q8_0"),
    ("sglang", "kvtide, hf, vllm, llamacpp"),
])
def test_a_bad_variant_is_an_error_that_lists_the_choices(text, names):
    with pytest.raises(ValueError, match="--engines") as e:
        compare.parse_engine(text)
    assert names in str(e.value)


def test_engine_list_refuses_repeats_and_flags_that_would_quantize_the_baseline():
    with pytest.raises(ValueError, match="more than once"):
        compare._engine_list(_args("--engines", "kvtide,kvtide:int8,kvtide:INT8"))
    with pytest.raises(ValueError, match="--quantization with kvtide variants"):
        compare._engine_list(_args("--engines", "kvtide,kvtide:int8", "--quantization", "int4"))
    with pytest.raises(ValueError, match="--quantization-group-size"):
        compare._engine_list(_args("--engines", "kvtide:int4", "--quantization-group-size", "32"))
    with pytest.raises(ValueError, match="kvtide:w8a8"):
        compare._engine_list(_args("--engines", "kvtide,kvtide:int8", "--calibration-data", "text.txt"))
    # without variants the flags describe plain kvtide, as before
    entries = compare._engine_list(_args("--engines", "kvtide,hf", "--quantization", "int8"))
    assert [e.label for e in entries] == ["kvtide", "hf"]


def test_bad_variants_stop_the_run_before_any_worker_starts(monkeypatch, ggufs, capsys):
    started = []
    monkeypatch.setattr(peers, "EngineWorker", lambda *a, **k: started.append(a))
    for engines in ("kvtide,kvtide:int3", "hf:int8", "kvtide,vllm:foo", "llamacpp:Q9"):
        assert compare.main(["--model", "demo", "--engines", engines]) == 2
    # a quantized --gguf is not requantized for llamacpp:TYPE
    assert compare.main(["--model", "demo", "--engines", "kvtide,llamacpp:Q4_0", "--gguf", ggufs["Q8_0"]]) == 2
    err = capsys.readouterr().err
    assert "already quantized (Q8_0)" in err and "F32/F16/BF16" in err
    assert started == []


def test_base_is_plain_kvtide_else_the_first_kvtide_entry():
    def base(text):
        return compare.base_label([compare.parse_engine(e) for e in text.split(",")])

    assert base("hf,kvtide:int8,kvtide") == "kvtide"
    assert base("llamacpp,kvtide:int4-g32,kvtide:int8") == "kvtide:int4-g32"
    assert base("hf,llamacpp") is None  # no kvtide: no ratios, as before


# ---- what each worker gets -------------------------------------------------------------------------
def test_engine_kwargs_per_variant_are_merged_over_the_cli_flags():
    cli = compare.engine_kwargs_from_args(_args("--kv-cache-memory", "64MiB", "--calibration-data", "cal.txt"))
    assert cli["kv_cache_memory"] == "64MiB" and cli["calibration_data"] == "cal.txt"

    def kwargs(text, listed=True):
        return compare.engine_kwargs_for(compare.parse_engine(text), cli, listed)

    int8 = kwargs("kvtide:int8")
    assert int8["quantization"] == "int8" and "quantization_group_size" not in int8
    assert "calibration_data" not in int8 and int8["kv_cache_memory"] == "64MiB" and int8["seed"] == 0
    assert kwargs("kvtide:int4-g32")["quantization_group_size"] == 32
    assert "quantization_group_size" not in kwargs("kvtide:int4")  # the engine's default group
    assert kwargs("kvtide:w8a8")["calibration_data"] == "cal.txt"  # the one knob a name cannot carry
    assert kwargs("kvtide:fp8")["quantization"] == "fp8"
    gguf = kwargs("kvtide:gguf")  # the engine detects the format from the file
    assert not {"quantization", "quantization_group_size", "calibration_data"} & set(gguf)
    assert "calibration_data" not in kwargs("kvtide")  # plain kvtide stays float next to variants
    assert kwargs("kvtide", listed=False) == cli  # without variants: unchanged
    assert kwargs("hf") == cli


def test_variant_record_names_the_effective_configuration():
    record = compare.variant_record(compare.parse_engine("kvtide:int4"), {"seed": 0})
    assert record == {"engine": "kvtide", "variant": "int4", "quantization": "int4", "group_size": 128,
                      "gguf_type": None, "gguf_path": None}
    assert compare.variant_record(compare.parse_engine("llamacpp:Q4_1"), {})["gguf_type"] == "Q4_1"


def test_quantized_gguf_is_cached_beside_the_float_one(tmp_path):
    source = tmp_path / "SmolLM2-f32.gguf"
    assert compare.quantized_gguf_path(str(source), "Q4_0") == str(tmp_path / "SmolLM2-Q4_0.gguf")
    assert compare.quantized_gguf_path(str(tmp_path / "m.gguf"), "Q8_0") == str(tmp_path / "m-Q8_0.gguf")


def test_table_footer_shows_weights_and_ratios_to_the_base():
    summary = {"base": "kvtide:int8", "raw": {},
               "figures": {"throughput": {"output_tok_s": compare.ratio_stats(
                   {"kvtide:int8": [10.0], "llamacpp:Q4_K_M": [20.0]}, "kvtide:int8")}},
               "engines": {"kvtide:int8": {"ok": True, "startup_s": 3.1, "weight_bytes": int(129.2 * 2**20)},
                           "llamacpp:Q4_K_M": {"ok": True, "startup_s": 1.0, "version": "0.3.36"}},
               "variants": {"llamacpp:Q4_K_M": {"gguf_type": "Q4_K_M", "gguf_path": "/m-Q4_K_M.gguf"}}}
    text = compare.format_table(summary)
    assert "ratio to kvtide:int8" in text
    assert "kvtide:int8: ready in 3.1 s, weights 129.2 MiB" in text
    assert "llamacpp:Q4_K_M: 0.3.36, ready in 1.0 s, GGUF Q4_K_M (/m-Q4_K_M.gguf)" in text
    assert "llamacpp:Q4_K_M    " in text and "2.00 / 2.00 / 2.00" in text


# ---- end to end ------------------------------------------------------------------------------------
def test_compare_runs_float_and_quantized_kvtide_side_by_side(bpe_dir, ggufs, tmp_path, capsys):
    """kvtide, kvtide:int8 and kvtide:gguf (on a Q8_0 GGUF) in one sitting: each its own worker."""
    out = tmp_path / "compare.json"
    rc = kvtide_main(["bench", "compare", "--model", bpe_dir, "--engines", "kvtide,kvtide:int8,kvtide:gguf",
                      "--workloads", "throughput", "--gguf", ggufs["Q8_0"], "--log-dir", str(tmp_path / "logs"),
                      "--output-json", str(out), *SMALL])
    assert rc == 0
    summary = json.loads(out.read_text())
    labels = ["kvtide", "kvtide:int8", "kvtide:gguf"]
    assert all(summary["engines"][label]["ok"] for label in labels), summary["engines"]
    tp = summary["figures"]["throughput"]["output_tok_s"]
    assert set(tp) == set(labels) and all(tp[label]["median"] > 0 for label in labels)
    assert tp["kvtide"]["ratio_median"] == pytest.approx(1.0) and tp["kvtide:int8"]["ratio_median"] > 0
    assert summary["base"] == "kvtide" and set(summary["greedy_agreement"]) == {"kvtide:int8", "kvtide:gguf"}
    variants = summary["variants"]
    assert variants["kvtide:int8"]["quantization"] == "int8"
    assert variants["kvtide:gguf"] | {"weight_bytes": 0} == {
        "engine": "kvtide", "variant": "gguf", "quantization": "gguf", "group_size": None, "gguf_type": "Q8_0",
        "gguf_path": os.path.abspath(ggufs["Q8_0"]), "weight_bytes": 0}
    weights = {label: variants[label]["weight_bytes"] for label in labels}
    assert weights["kvtide:int8"] < weights["kvtide"] / 2 and weights["kvtide:gguf"] < weights["kvtide"] / 2
    assert os.path.exists(tmp_path / "logs" / "kvtide-int8.log")
    text = capsys.readouterr().out
    for label in labels:
        assert f"{label}: " in text and "MiB" in text.split(f"\n{label}: ", 1)[1].split("\n", 1)[0]
    assert "kvtide:int8: greedy tokens identical to kvtide's" in text
    # The GEMM lines name this model's linears (q/k/v and gate/up fused, as loaded), not every shape
    # the machine's disk cache holds from other models.
    with open(os.path.join(bpe_dir, "config.json")) as f:
        c = json.load(f)
    h, i, d = c["hidden_size"], c["intermediate_size"], c["hidden_size"] // c["num_attention_heads"]
    q, kv = c["num_attention_heads"] * d, c["num_key_value_heads"] * d
    assert set(summary["machine"]["gemm"]) == {f"{q + 2 * kv}x{h}", f"{h}x{q}", f"{2 * i}x{h}", f"{h}x{i}",
                                               f"{c['vocab_size']}x{h}"}
    assert "gemm" not in summary["engines"]["kvtide"]


@needs_llamacpp
def test_llamacpp_quantizer_makes_the_variant_gguf(ggufs, tmp_path):
    """llama.cpp's own quantizer, run in the peer's python, from a float GGUF; cached by mtime."""
    source = str(tmp_path / "tiny-f32.gguf")
    with open(ggufs["F32"], "rb") as f, open(source, "wb") as g:
        g.write(f.read())
    sizes = {}
    for kind in ("Q8_0", "Q4_0"):
        path = peers.quantize_gguf(source, compare.quantized_gguf_path(source, kind), kind, LLAMACPP_PYTHON, 2)
        assert path == str(tmp_path / f"tiny-{kind}.gguf")
        assert compare.gguf_weight_type(path) == (kind, False)
        sizes[kind] = os.path.getsize(path)
    assert sizes["Q4_0"] < sizes["Q8_0"] < os.path.getsize(source) / 3
    mtime = os.path.getmtime(path)
    assert peers.quantize_gguf(source, path, "Q4_0", LLAMACPP_PYTHON) == path and os.path.getmtime(path) == mtime
    with pytest.raises(ValueError, match="Q4_0"):
        peers.quantize_gguf(source, str(tmp_path / "x.gguf"), "Q9", LLAMACPP_PYTHON)


@needs_llamacpp
def test_compare_runs_llamacpp_on_its_quantized_gguf(bpe_dir, ggufs, tmp_path):
    """llamacpp and llamacpp:Q8_0 next to kvtide:int8, the base when plain kvtide is not listed."""
    source = str(tmp_path / "tiny-f32.gguf")
    with open(ggufs["F32"], "rb") as f, open(source, "wb") as g:
        g.write(f.read())
    out = tmp_path / "compare.json"
    rc = kvtide_main(["bench", "compare", "--model", bpe_dir, "--engines", "kvtide:int8,llamacpp,llamacpp:Q8_0",
                      "--workloads", "throughput", "--gguf", source, "--output-json", str(out), *SMALL])
    assert rc == 0
    summary = json.loads(out.read_text())
    assert all(info["ok"] for info in summary["engines"].values()), summary["engines"]
    assert summary["base"] == "kvtide:int8"
    tp = summary["figures"]["throughput"]["output_tok_s"]
    assert tp["kvtide:int8"]["ratio_median"] == pytest.approx(1.0) and tp["llamacpp:Q8_0"]["ratio_median"] > 0
    q8 = summary["variants"]["llamacpp:Q8_0"]
    assert q8["gguf_type"] == "Q8_0" and q8["gguf_path"] == str(tmp_path / "tiny-Q8_0.gguf")
    assert summary["variants"]["llamacpp"]["gguf_type"] == "F32"
    assert q8["weight_bytes"] < summary["variants"]["llamacpp"]["weight_bytes"] / 3
