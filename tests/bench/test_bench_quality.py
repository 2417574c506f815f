"""`kvtide bench quality`: perplexity, KL and top-1 agreement on tiny seeded Llamas.

The figures are checked against Hugging Face transformers computing the same windows on its own,
so a wrong window, an off-by-one between logits and targets or a wrong KL direction shows."""

from __future__ import annotations

import argparse
import json
import math

import pytest
import torch
from torch_threads import one_torch_thread

from kvtide.bench import quality
from kvtide.bench.quality import Window, evaluate_quality, plan_windows
from kvtide.cli import main as kvtide_main
from kvtide.engine_args import EngineArgs

TEXT = ("A paged KV cache keeps keys and values in blocks; the scheduler decides which requests run, "
        "and the model runner computes exactly what it is told. ") * 3  # ~420 byte tokens
SMALL = dict(kv_cache_memory="16MiB", max_model_len=256)


@pytest.fixture(autouse=True, scope="module")
def _one_torch_thread():
    yield from one_torch_thread()


def hf_windows_figures(model_dir: str, reference_dir: str, text: str, context_length: int, max_tokens: int,
                       stride: int | None = None) -> dict:
    """The same figures from transformers, windows laid out as in Hugging Face's strided-perplexity
    guide: BOS + up to L-1 text tokens every `stride` tokens, scoring those no earlier window did."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    ids = tokenizer(text, add_special_tokens=False).input_ids[:max_tokens]
    models = [AutoModelForCausalLM.from_pretrained(d, dtype=torch.float32).eval() for d in (model_dir, reference_dir)]
    span = context_length - 1
    stride = stride or span
    nll = ref_nll = 0.0
    kls: list[torch.Tensor] = []
    agree = scored = prev_end = 0
    for begin in range(0, len(ids), stride):
        end = min(begin + span, len(ids))
        new = end - prev_end
        window = torch.tensor([[tokenizer.bos_token_id] + ids[begin:end]])
        with torch.inference_mode():
            lp, ref = (m(window).logits[0, -new - 1:-1].float().log_softmax(-1) for m in models)
        targets = window[0, -new:]
        nll -= float(lp.gather(1, targets[:, None]).sum(dtype=torch.float64))
        ref_nll -= float(ref.gather(1, targets[:, None]).sum(dtype=torch.float64))
        kls.append((ref.exp() * (ref - lp)).sum(-1))
        agree += int((ref.argmax(-1) == lp.argmax(-1)).sum())
        scored += new
        prev_end = end
        if end == len(ids):
            break
    kl = torch.cat(kls).double()
    return {"tokens_scored": scored, "perplexity": math.exp(nll / scored),
            "reference_perplexity": math.exp(ref_nll / scored), "mean_kl": float(kl.mean()),
            "max_kl": float(kl.max()), "top1_agreement": agree / scored}


def test_plan_windows():
    # With a BOS every text token is scored; windows hold L - 1 text tokens.
    assert plan_windows(10, 5, bos=True) == [Window(0, 4, 0), Window(4, 8, 4), Window(8, 10, 8)]
    # Without one, a window's first token is context only.
    assert plan_windows(10, 5, bos=False) == [Window(0, 5, 1), Window(5, 10, 6)]
    # Strided: each window scores only what no earlier one did.
    assert plan_windows(10, 5, bos=True, stride=2) == [Window(0, 4, 0), Window(2, 6, 4), Window(4, 8, 6),
                                                       Window(6, 10, 8)]
    assert plan_windows(1, 5, bos=False) == []


def test_float32_against_itself(llama_dir):
    report = evaluate_quality(EngineArgs(model=llama_dir, **SMALL), TEXT, None, context_length=64, max_tokens=300)
    assert report.bos and report.tokens_scored == 300 and report.num_windows == 5  # ceil(300 / 63)
    assert report.configuration == report.reference == "float32"
    assert abs(report.mean_kl) <= 1e-6 and abs(report.max_kl) <= 1e-6
    assert report.top1_agreement == 1.0
    assert report.perplexity == pytest.approx(report.reference_perplexity, rel=1e-6)
    assert 1 < report.perplexity < 1e4


@pytest.mark.parametrize("stride", [None, 20])
def test_figures_match_transformers(checkpoint_factory, llama_dir, stride):
    """Perplexity of both configurations, KL, max KL and top-1 as transformers computes them; the
    reference is another seed's checkpoint, so the KL and disagreement are far from 0."""
    reference_dir = checkpoint_factory("LlamaForCausalLM", seed=1)
    report = evaluate_quality(EngineArgs(model=llama_dir, **SMALL), TEXT, EngineArgs(model=reference_dir, **SMALL),
                              context_length=48, max_tokens=200, stride=stride)
    expected = hf_windows_figures(llama_dir, reference_dir, TEXT, 48, 200, stride)
    assert report.tokens_scored == expected["tokens_scored"] == 200
    for key in ("perplexity", "reference_perplexity", "mean_kl", "max_kl", "top1_agreement"):
        assert getattr(report, key) == pytest.approx(expected[key], rel=1e-4), key
    assert report.mean_kl > 0.1 and report.top1_agreement < 1


def test_cli_end_to_end(llama_dir, tmp_path, capsys):
    text_file, out = tmp_path / "text.txt", tmp_path / "quality.json"
    text_file.write_text(TEXT, encoding="utf-8")
    rc = kvtide_main(["bench", "quality", "--model", llama_dir, "--text", str(text_file), "--context-length", "32",
                      "--max-tokens", "100", "--output-json", str(out), "--kv-cache-memory", "16MiB",
                      "--max-model-len", "256"])
    assert rc == 0
    result = json.loads(out.read_text())
    assert set(result) == {"model", "text_file", "configuration", "reference", "context_length", "stride",
                           "max_tokens", "bos", "num_windows", "tokens_scored", "perplexity",
                           "reference_perplexity", "mean_kl", "max_kl", "top1_agreement"}
    assert result["tokens_scored"] == 100 and result["num_windows"] == 4 and result["stride"] == 31
    assert result["mean_kl"] == pytest.approx(0, abs=1e-6) and result["top1_agreement"] == 1.0
    printed = capsys.readouterr().out
    assert "perplexity" in printed and "float32 (reference)" in printed


def _parse(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    quality.add_quality_args(parser)
    return parser.parse_args(argv)


def test_quantization_flags_reach_engine_args(tmp_path):
    """--quantization goes to EngineArgs' field as given; the reference's 'none' is no quantization,
    on --reference-model when given."""
    text_file = tmp_path / "t.txt"
    text_file.write_text(TEXT)
    args = _parse(["--model", "demo", "--text", str(text_file), "--quantization", "int4",
                   "--quantization-group-size", "32", "--reference-model", "other"])
    [engine_args], reference, _ = quality.quality_args_from_cli(args)
    assert (engine_args.quantization, engine_args.quantization_group_size) == ("int4", 32)
    assert reference.quantization is None and reference.quantization_group_size is None
    assert reference.dtype == "float32" and reference.model == "other"


def test_kv_cache_flags_reach_engine_args(tmp_path):
    """A comma-separated --kv-cache-dtype is one configuration per dtype, scored against one reference
    with the full cache and full attention."""
    text_file = tmp_path / "t.txt"
    text_file.write_text(TEXT)
    args = _parse(["--model", "demo", "--text", str(text_file), "--kv-cache-dtype", "fp8,int8, k8v4",
                   "--kv-window-tokens", "64", "--kv-sink-tokens", "4"])
    configurations, reference, _ = quality.quality_args_from_cli(args)
    assert [c.kv_cache_dtype for c in configurations] == ["fp8", "int8", "k8v4"]
    assert all((c.kv_window_tokens, c.kv_sink_tokens) == (64, 4) for c in configurations)
    assert (reference.kv_cache_dtype, reference.kv_window_tokens, reference.kv_sink_tokens) == ("auto", None, 0)


def test_kv_cache_configurations_scored_against_the_full_cache(llama_dir):
    """On the tiny Llama: a float32 'cache' equals the reference exactly; each quantized cache costs a
    little KL, ordered by its precision (int8 < fp8 e4m3 < e5m2), and sink + window attention over
    a text longer than its window costs more than int8."""
    base = EngineArgs(model=llama_dir, attention_backend="torch", **SMALL)
    configs = [base.replace(kv_cache_dtype=d) for d in ("float32", "int8", "fp8", "fp8_e5m2", "k8v4")]
    configs.append(base.replace(kv_window_tokens=32, kv_sink_tokens=4))
    reports = quality.evaluate_configurations(configs, TEXT, context_length=256, max_tokens=255)
    f32, int8, fp8, e5m2, k8v4, streaming = reports
    assert f32.mean_kl == 0 and f32.perplexity == f32.reference_perplexity
    assert 0 < int8.mean_kl < fp8.mean_kl < e5m2.mean_kl
    assert k8v4.mean_kl > int8.mean_kl
    assert streaming.mean_kl > int8.mean_kl
    assert [r.configuration for r in reports][1:3] == ["float32, kv=int8", "float32, kv=fp8"]
    assert streaming.configuration == "float32, sinks=4 window=32"
    assert all(r.reference == "float32" for r in reports)


@pytest.mark.parametrize("case, message", [
    ("missing", "no such file"), ("empty", "text is empty"), ("context", "context-length must be >= 2"),
    ("max_tokens", "max-tokens must be >= 2"), ("stride", "stride must be in")])
def test_bad_input_fails_before_loading(tmp_path, monkeypatch, capsys, case, message):
    def no_model(*args, **kwargs):
        raise AssertionError("a model was loaded")

    monkeypatch.setattr(EngineArgs, "resolve_model_dir", no_model)
    monkeypatch.setattr("kvtide.worker.model_runner.ModelRunner.__init__", no_model)
    text_file = tmp_path / "t.txt"
    text_file.write_text(" \n" if case == "empty" else TEXT)
    argv = ["bench", "quality", "--model", "demo", "--text", str(tmp_path / "nope.txt" if case == "missing" else text_file)]
    argv += {"context": ["--context-length", "1"], "max_tokens": ["--max-tokens", "0"],
             "stride": ["--stride", "0"]}.get(case, [])
    assert kvtide_main(argv) == 2
    assert message in capsys.readouterr().err
    # The API checks the same before loading anything.
    with pytest.raises(ValueError):
        evaluate_quality(EngineArgs(model="demo"), "" if case in ("missing", "empty") else TEXT, None,
                         context_length=1 if case == "context" else 8,
                         max_tokens=0 if case == "max_tokens" else 16, stride=0 if case == "stride" else None)
