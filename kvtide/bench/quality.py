"""`kvtide bench quality`: what a configuration (a quantization, a dtype) costs in output quality.

Speed figures say nothing about what a quantization does to the model, so this scores the same
tokens of a text file twice, with a reference configuration (the same model in float32, no
quantization, by default) and with the configuration under test, and reports per configuration:

  tokens       tokens scored (each predicted from the tokens before it in its window)
  perplexity   exp(mean negative log-likelihood of the scored tokens)
  mean KL      mean over scored positions of KL(reference || configuration) of the full next-token
               distributions, in nats; max KL is the largest one
  top-1        fraction of scored positions where both configurations' argmax agree

    kvtide bench quality --model smollm2 --quantization int8 --text wiki.txt
    kvtide bench quality --model smollm2 --kv-cache-dtype fp8,int8,k8v4 --text wiki.txt

The KV cache counts as part of a configuration: --kv-cache-dtype (several, comma-separated, each
scored against the one reference run), --kv-window-tokens with --kv-sink-tokens. The reference keeps
the full-precision cache and full attention unless --reference-kv-cache-dtype says otherwise.

Tokenization: the text is tokenized once with the model's tokenizer without special tokens and cut
to --max-tokens. If the tokenizer adds a BOS by default (Llama's and the byte tokenizer of the demo
checkpoints do; GPT-2-style ones do not), each window is that BOS followed by L - 1 text tokens, and
every text token is scored; otherwise a window is L text tokens and its first one is context only.
Windows are non-overlapping unless --stride S (in text tokens) is smaller than a window's text: a
window then starts every S tokens and scores only the tokens no earlier window scored, so most of
them see more context (Hugging Face's strided perplexity).

Logits: the engine's sampler returns only top-k logprobs and KL needs the whole distribution, so
each window runs as one prefill straight through a ModelRunner's model (`prefill_hidden_states`,
over a KV cache of one window's blocks), and compute_logits gives float32 logits over the whole
vocabulary.

Memory: the two configurations are loaded one at a time (the reference, then the one under test),
so the peak is one model, never two. The reference's full log-probs are kept on disk in float32 in
the run's temporary directory (tokens x vocab x 4 bytes: 400 MB for 2048 tokens of a 49152-token
vocabulary), read back one window at a time. float16 would halve that but rounds log-probs by up
to ~1e-3 nats, the size of the KL of a good 8-bit quantization, and float32 vs itself would no
longer read 0.

--output-json keys: model, text_file, configuration, reference, context_length, stride, max_tokens,
bos, num_windows, tokens_scored, perplexity, reference_perplexity, mean_kl, max_kl, top1_agreement.
"""

from __future__ import annotations

import argparse
import gc
import math
import os
import sys
import tempfile
from collections.abc import Iterator
from dataclasses import asdict, dataclass

import numpy as np
import torch

from kvtide.bench.common import align_rows, module_main, print_and_save
from kvtide.bench.throughput import engine_kwargs_from_args
from kvtide.engine_args import EngineArgs


@dataclass
class QualityReport:
    """The figures `kvtide bench quality` prints and writes (see the module docstring)."""

    model: str
    configuration: str
    """e.g. 'float32' or 'float32, quantization=int8'."""
    reference: str
    context_length: int
    stride: int
    """Text tokens between window starts."""
    max_tokens: int
    bos: bool
    """Whether each window starts with the tokenizer's BOS."""
    num_windows: int
    tokens_scored: int
    perplexity: float
    reference_perplexity: float
    mean_kl: float
    """Mean KL(reference || configuration) per scored position, nats."""
    max_kl: float
    top1_agreement: float

    def to_dict(self) -> dict:
        return asdict(self)


@dataclass(frozen=True)
class Window:
    """One prefill: text tokens start..end-1 after the BOS (if any), scoring first_scored..end-1."""

    start: int
    """First text token in the window."""
    end: int
    """One past its last text token."""
    first_scored: int
    """First text token whose log-likelihood counts (earlier ones are context only)."""


def check_quality_args(text: str, context_length: int, max_tokens: int, stride: int | None) -> None:
    """The checks that need no model: raised before anything loads."""
    if not text.strip():
        raise ValueError("the text is empty: give a file with some text to score")
    if context_length < 2:
        raise ValueError(f"--context-length must be >= 2 (a token and one to predict it from), got {context_length}")
    if max_tokens < 2:
        raise ValueError(f"--max-tokens must be >= 2, got {max_tokens}")
    if stride is not None and not 1 <= stride <= context_length:
        raise ValueError(f"--stride must be in [1, --context-length={context_length}], got {stride}")


def plan_windows(num_tokens: int, context_length: int, bos: bool, stride: int | None = None) -> list[Window]:
    """Windows over text tokens 0..num_tokens-1, each at most context_length tokens with the BOS; a
    token is scored in the first window that holds it at a position other than the window's first."""
    span = context_length - int(bos)  # text tokens per window
    stride = span if stride is None else min(stride, span)
    windows: list[Window] = []
    start = scored_to = 0
    while True:
        end = min(start + span, num_tokens)
        first = max(scored_to, start + (0 if bos else 1))
        if end > first:
            windows.append(Window(start, end, first))
            scored_to = end
        if end >= num_tokens:
            return windows
        start += stride


def describe(args: EngineArgs, dtype: torch.dtype) -> str:
    """A configuration's label: its dtype as loaded, and its quantization and KV cache settings
    when they differ from the defaults."""
    label = str(dtype).removeprefix("torch.")
    if args.quantization:
        label += f", quantization={args.quantization}"
        if args.quantization_group_size:
            label += f" g{args.quantization_group_size}"
    if args.kv_cache_dtype != "auto":
        label += f", kv={args.kv_cache_dtype}"
    if args.kv_window_tokens is not None:
        label += f", sinks={args.kv_sink_tokens} window={args.kv_window_tokens}"
    return label


FULL_KV = dict(kv_cache_dtype="auto", calculate_kv_scales=False, kv_window_tokens=None, kv_sink_tokens=0)
"""The reference's KV cache: the model's dtype, every token kept."""


def _tokenize(args: EngineArgs, model_dir: str, text: str, max_tokens: int) -> tuple[list[int], int | None]:
    """(text token ids without special tokens, cut to max_tokens; the BOS id if the tokenizer adds one)."""
    from kvtide.tokenizer import load_tokenizer

    tokenizer = load_tokenizer(args.tokenizer or model_dir, args.trust_remote_code)
    ids = tokenizer(text, add_special_tokens=False, verbose=False).input_ids[:max_tokens]
    probe = tokenizer("a", add_special_tokens=True).input_ids
    bos = tokenizer.bos_token_id
    adds_bos = bos is not None and bool(probe) and probe[0] == bos and \
        tokenizer("a", add_special_tokens=False).input_ids[:1] != [bos]
    return ids, bos if adds_bos else None


def _load_runner(args: EngineArgs, context_length: int):
    """A ModelRunner for `args` with a KV cache of one window's blocks, which every window reuses
    (so --kv-cache-memory is not consulted)."""
    from kvtide.worker.model_runner import ModelRunner

    # Decode graphs and a draft model are of no use to prefills of one sequence.
    args = args.replace(enforce_eager=True, speculative_config=None)
    model_dir = args.resolve_model_dir()
    config = args.create_engine_config(model_dir)
    if context_length > config.model_config.max_model_len:
        raise ValueError(f"--context-length {context_length} exceeds max_model_len "
                         f"({config.model_config.max_model_len}); lower it or raise --max-model-len")
    runner = ModelRunner(config, model_dir)
    runner.initialize_kv_cache(-(-context_length // runner.block_size))
    return runner


def _free_memory() -> None:
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def _window_log_probs(runner, token_ids: list[int], windows: list[Window],
                      bos: int | None) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    """Per window, one prefill: (log-probs of its scored tokens (scored, vocab) float32, their ids)."""
    for w in windows:
        ids = ([bos] if bos is not None else []) + token_ids[w.start:w.end]
        # Position p predicts position p + 1; the first scored token sits at first_pos.
        first_pos = w.first_scored - w.start + (bos is not None)
        with torch.inference_mode():
            hidden = runner.prefill_hidden_states(ids)
            logits = runner.model.compute_logits(hidden[first_pos - 1:len(ids) - 1])
            yield logits.float().log_softmax(dim=-1), torch.tensor(ids[first_pos:], device=logits.device)


def _nll(log_probs: torch.Tensor, targets: torch.Tensor) -> float:
    return -float(log_probs.gather(1, targets[:, None]).sum(dtype=torch.float64))


def evaluate_quality(engine_args: EngineArgs, text: str, reference_args: EngineArgs | None = None,
                     context_length: int = 512, max_tokens: int = 2048, stride: int | None = None) -> QualityReport:
    """Perplexity of `engine_args` on `text`, and its KL / top-1 agreement to `reference_args`
    (default: the same arguments in float32 without quantization). See the module docstring."""
    return evaluate_configurations([engine_args], text, reference_args, context_length, max_tokens, stride)[0]


def evaluate_configurations(configurations: list[EngineArgs], text: str, reference_args: EngineArgs | None = None,
                            context_length: int = 512, max_tokens: int = 2048, stride: int | None = None
                            ) -> list[QualityReport]:
    """evaluate_quality for several configurations of one model against one reference, which runs
    once (default: the first configuration in float32 without quantization). The tokens scored are
    those of the first configuration's tokenizer."""
    check_quality_args(text, context_length, max_tokens, stride)
    first = configurations[0]
    if reference_args is None:
        reference_args = first.replace(dtype="float32", quantization=None, quantization_group_size=None,
                                       calibration_data=None, **FULL_KV)
    token_ids, bos = _tokenize(first, first.resolve_model_dir(), text, max_tokens)
    span = context_length - (bos is not None)  # text tokens per window
    stride = span if stride is None else min(stride, span)
    windows = plan_windows(len(token_ids), context_length, bos is not None, stride)
    if not windows:
        raise ValueError(f"the text is {len(token_ids)} token(s), too few to score (a tokenizer that adds "
                         f"no BOS needs 2)")
    num_scored = sum(w.end - w.first_scored for w in windows)

    reports = []
    with tempfile.TemporaryDirectory(prefix="kvtide-quality-") as tmp:
        # Pass 1: the reference, its log-probs to disk.
        runner = _load_runner(reference_args, context_length)
        reference_label = describe(reference_args, runner.config.model_config.dtype)
        reference = np.lib.format.open_memmap(os.path.join(tmp, "reference_log_probs.npy"), mode="w+",
                                              dtype=np.float32, shape=(num_scored, runner.vocab_size))
        ref_nll, row = 0.0, 0
        for log_probs, targets in _window_log_probs(runner, token_ids, windows, bos):
            reference[row:row + len(targets)] = log_probs.cpu().numpy()
            ref_nll += _nll(log_probs, targets)
            row += len(targets)
        del runner
        _free_memory()

        # Pass 2: each configuration under test, against the reference one window at a time.
        for engine_args in configurations:
            runner = _load_runner(engine_args, context_length)
            label = describe(engine_args, runner.config.model_config.dtype)
            if runner.vocab_size != reference.shape[1]:
                raise ValueError(f"the reference has a vocabulary of {reference.shape[1]} tokens, the configuration "
                                 f"{runner.vocab_size}: compare configurations of the same model")
            nll = kl_sum = max_kl = 0.0
            agree = row = 0
            for log_probs, targets in _window_log_probs(runner, token_ids, windows, bos):
                ref = torch.from_numpy(np.asarray(reference[row:row + len(targets)])).to(log_probs.device)
                kl = (ref.exp() * (ref - log_probs)).sum(dim=-1)  # KL(reference || configuration) per position
                kl_sum += float(kl.sum(dtype=torch.float64))
                max_kl = max(max_kl, float(kl.max()))
                agree += int((ref.argmax(dim=-1) == log_probs.argmax(dim=-1)).sum())
                nll += _nll(log_probs, targets)
                row += len(targets)
            del runner
            _free_memory()
            reports.append(QualityReport(
                model=engine_args.model, configuration=label, reference=reference_label,
                context_length=context_length, stride=stride, max_tokens=max_tokens, bos=bos is not None,
                num_windows=len(windows), tokens_scored=num_scored, perplexity=math.exp(nll / num_scored),
                reference_perplexity=math.exp(ref_nll / num_scored), mean_kl=kl_sum / num_scored, max_kl=max_kl,
                top1_agreement=agree / num_scored))
        del reference
    return reports


# ---- CLI ---------------------------------------------------------------------------------------
def add_quality_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", required=True, help="checkpoint directory, GGUF file, hub id, 'demo' or 'smollm2'")
    parser.add_argument("--text", required=True, help="UTF-8 text file to score")
    parser.add_argument("--reference-quantization", default="none",
                        help="quantization of the reference configuration (default none)")
    parser.add_argument("--reference-dtype", default="float32", help="dtype of the reference (default float32)")
    parser.add_argument("--max-tokens", type=int, default=2048, help="score at most this many text tokens")
    parser.add_argument("--context-length", type=int, default=512, help="tokens per window (with the BOS)")
    parser.add_argument("--stride", type=int, default=None,
                        help="text tokens between window starts (default: a whole window, no overlap)")
    parser.add_argument("--output-json", default=None)
    parser.add_argument("--reference-model", default=None,
                        help="the reference's checkpoint (default: --model), e.g. a float32 export of a GGUF, "
                             "whose own quantization the engine keeps")
    parser.add_argument("--reference-kv-cache-dtype", default="auto",
                        help="KV cache dtype of the reference (default auto: the model's dtype, full precision)")
    group = parser.add_argument_group("engine (kvtide; the configuration under test; --kv-cache-dtype "
                                      "may list several, comma-separated)")
    EngineArgs.add_cli_args(group, skip=("model",))


def _quantization(value: str | None) -> dict:
    """The EngineArgs keywords for a --quantization-style flag ('none' and None: no quantization)."""
    return {"quantization": None if value is None or value.lower() == "none" else value}


def quality_args_from_cli(args: argparse.Namespace) -> tuple[list[EngineArgs], EngineArgs, str]:
    """(configurations, reference, text) from the parsed flags; reads and checks the text file.
    One configuration per --kv-cache-dtype listed."""
    if not os.path.isfile(args.text):
        raise ValueError(f"--text {args.text}: no such file")
    with open(args.text, encoding="utf-8") as f:
        text = f.read()
    check_quality_args(text, args.context_length, args.max_tokens, args.stride)
    kwargs = engine_kwargs_from_args(args)
    kwargs.update(_quantization(args.quantization))
    kv_dtypes = [d.strip() for d in str(kwargs.pop("kv_cache_dtype", "auto")).split(",") if d.strip()] or ["auto"]
    configurations = [EngineArgs(model=args.model, kv_cache_dtype=d, **kwargs) for d in kv_dtypes]
    reference = configurations[0].replace(model=args.reference_model or args.model, dtype=args.reference_dtype,
                                          quantization_group_size=None, calibration_data=None,
                                          **_quantization(args.reference_quantization),
                                          **{**FULL_KV, "kv_cache_dtype": args.reference_kv_cache_dtype})
    return configurations, reference, text


def format_report(report: QualityReport | list[QualityReport]) -> str:
    """One table: the reference's row, then one row per configuration."""
    reports = report if isinstance(report, list) else [report]
    r = reports[0]
    head = (f"{r.model}: {r.tokens_scored} tokens in {r.num_windows} window(s) of {r.context_length} "
            f"(stride {r.stride}{', BOS first' if r.bos else ''})")
    rows = [("configuration", "tokens", "perplexity", "mean KL", "max KL", "top-1"),
            (f"{r.reference} (reference)", str(r.tokens_scored), f"{r.reference_perplexity:.4f}", "0", "0", "1")]
    rows += [(c.configuration, str(c.tokens_scored), f"{c.perplexity:.4f}", f"{c.mean_kl:.3e}", f"{c.max_kl:.3e}",
              f"{c.top1_agreement:.4f}") for c in reports]
    return "\n".join([head, *align_rows(rows)])


def main_quality(args: argparse.Namespace) -> int:
    configurations, reference, text = quality_args_from_cli(args)
    reports = evaluate_configurations(configurations, text, reference, args.context_length, args.max_tokens,
                                      args.stride)
    if len(reports) == 1:
        result: dict = {**reports[0].to_dict(), "text_file": args.text}
    else:
        result = {"text_file": args.text, "configurations": [r.to_dict() for r in reports]}
    return print_and_save(result, format_report(reports), args.output_json)


def main(argv: list[str] | None = None) -> int:
    return module_main(argv, "quality", __doc__, add_quality_args, main_quality)


if __name__ == "__main__":
    sys.exit(main())
