"""The accelerator path proven in one short run on an NVIDIA GPU; prints a table at the end.

    bash scripts/gpu_check.sh                        # GPU machine: < 8 minutes, no downloads
    python scripts/gpu_check.py --device cpu --small # smoke test of this script (tests/kernels)

Sections (each prints its rows as it finishes; a failing section does not stop the others):

  1. kernels     tests/kernels natively on CUDA (KVTIDE_TEST_DEVICE=cuda: no interpreter)
  2. parity      greedy tokens vs HF transformers on tiny seeded checkpoints: float32 must be
                 equal (eager and with CUDA graphs); bf16 by the top-k containment rule: every
                 token we pick is among HF's top-5 for our own prefix (teacher forced), since
                 bf16 near-ties may part the two greedy paths
  3. decode      batch 1 on a Llama-3-8B-shaped random bf16 model built on the GPU (no files):
                 ms per output token through the engine, eager and with CUDA graphs, next to the
                 bandwidth floor = weight bytes read per token / measured copy bandwidth
  4. throughput  batch 64 and 256, 128 prompt / 128 output tokens, output tokens/s, and the same
                 with HF transformers generate on the same weights
  5. parallel    with 2+ GPUs (else SKIP): TP=2 (NCCL) on a dense model and TP=2 with expert
                 parallelism on a MoE one, greedy tokens equal to world size 1's, and rank 0's
                 collective bytes and milliseconds per step

Pure helpers (table, containment rule, floor, config) are imported by tests/kernels/test_gpu_check.py.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import os
import pathlib
import re
import subprocess
import sys
import tempfile
import time
import traceback
from dataclasses import dataclass

REPO = pathlib.Path(__file__).resolve().parent.parent
TOP_K = 5


# ---- the table ------------------------------------------------------------------------------------
@dataclass
class Row:
    section: str
    item: str
    status: str
    """PASS, FAIL, SKIP or INFO (a measurement)."""
    value: str = ""
    note: str = ""


def format_table(rows: list[Row]) -> str:
    header = Row("section", "item", "status", "value", "note")
    cells = [[r.section, r.item, r.status, r.value, r.note] for r in [header, *rows]]
    widths = [max(len(c[i]) for c in cells) for i in range(5)]
    lines = [" | ".join(c[i].ljust(widths[i]) for i in range(5)).rstrip() for c in cells]
    lines.insert(1, "-+-".join("-" * w for w in widths))
    return "\n".join(lines)


class Budget:
    """Seconds left before the deadline; a section that needs more is skipped, not started."""

    def __init__(self, seconds: float) -> None:
        self.deadline = time.monotonic() + seconds

    def left(self) -> float:
        return self.deadline - time.monotonic()


# ---- pure helpers ---------------------------------------------------------------------------------
def parse_pytest_summary(text: str) -> dict[str, int]:
    """'3 failed, 80 passed, 1 skipped in 12.3s' -> {'failed': 3, 'passed': 80, 'skipped': 1}."""
    lines = [line for line in text.splitlines() if re.search(r"\d+ (passed|failed|error)", line)]
    if not lines:
        return {}
    return {kind.rstrip("s") if kind == "errors" else kind: int(n)
            for n, kind in re.findall(r"(\d+) (passed|failed|skipped|errors?|deselected|xfailed|xpassed)",
                                      lines[-1])}


def first_uncontained(tokens: list[int], topk_ids: list[list[int]]) -> int | None:
    """Top-k containment: the first position whose token is not among the reference's top-k at that
    position (computed on our own prefix), or None when every token is."""
    assert len(tokens) == len(topk_ids)
    for i, (token, allowed) in enumerate(zip(tokens, topk_ids, strict=True)):
        if token not in allowed:
            return i
    return None


def common_prefix_len(a: list[int], b: list[int]) -> int:
    n = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        n += 1
    return n


def llama3_8b_config(num_layers: int = 32, small: bool = False):
    """Llama-3-8B's shape (GQA 32:8, head_dim 128, vocab 128256), or a tiny one of the same form."""
    from transformers import LlamaConfig

    from kvtide.models.demo import BOS_ID, EOS_ID

    if small:
        shape = dict(hidden_size=128, intermediate_size=344, num_hidden_layers=2, num_attention_heads=4,
                     num_key_value_heads=2, vocab_size=512)
    else:
        shape = dict(hidden_size=4096, intermediate_size=14336, num_hidden_layers=num_layers,
                     num_attention_heads=32, num_key_value_heads=8, vocab_size=128256)
    return LlamaConfig(**shape, max_position_embeddings=8192, rope_theta=500000.0, rms_norm_eps=1e-5,
                       tie_word_embeddings=False, bos_token_id=BOS_ID, eos_token_id=EOS_ID,
                       architectures=["LlamaForCausalLM"])


def weight_bytes_per_token(model) -> int:
    """Bytes of weights one decode step reads: all of them except the embedding table, of which it
    reads one row per token."""
    total = sum(p.numel() * p.element_size() for p in model.parameters())
    embedding = model.embed_tokens.weight
    if embedding is model.lm_head.weight:  # tied: the LM head reads it whole
        return total
    return total - embedding.numel() * embedding.element_size() + embedding[0].numel() * embedding.element_size()


def floor_ms(weight_bytes: int, bandwidth_bytes_per_s: float) -> float:
    return weight_bytes / bandwidth_bytes_per_s * 1e3


def synchronize(device: str) -> None:
    import torch

    if device == "cuda":
        torch.cuda.synchronize()


def free_memory(device: str) -> None:
    gc.collect()
    if device == "cuda":
        import torch

        torch.cuda.empty_cache()


def hf_from_pretrained(model_dir: str, dtype, device: str):
    import transformers
    from transformers import AutoModelForCausalLM

    key = "dtype" if int(transformers.__version__.split(".")[0]) >= 5 else "torch_dtype"
    return AutoModelForCausalLM.from_pretrained(model_dir, **{key: dtype}).to(device).eval()


# ---- 1. kernel tests ------------------------------------------------------------------------------
def section_kernels(args, budget: Budget) -> list[Row]:
    env = dict(os.environ, KVTIDE_TEST_DEVICE=args.device)
    env.pop("TRITON_INTERPRET", None)
    start = time.monotonic()
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-m", "not slow",
                           "tests/kernels"],
                          cwd=REPO, env=env, capture_output=True, text=True,
                          timeout=max(30.0, min(args.kernel_timeout, budget.left() - 60)))
    counts = parse_pytest_summary(proc.stdout)
    if proc.returncode != 0:
        print(proc.stdout[-6000:], proc.stderr[-3000:], sep="\n")
    detail = ", ".join(f"{n} {k}" for k, n in counts.items())
    return [Row("kernels", f"tests/kernels on {args.device}", "PASS" if proc.returncode == 0 else "FAIL",
                f"{time.monotonic() - start:.0f} s", detail or f"exit {proc.returncode}")]


# ---- 2. parity with HF ----------------------------------------------------------------------------
PARITY_PROMPTS = ["Hello, my name is", "The capital of France is", "def fibonacci(n):",
                  "In 1492, Columbus sailed"]


def section_parity(args, budget: Budget) -> list[Row]:
    import torch

    from kvtide import LLM, SamplingParams
    from kvtide.models.demo import make_random_checkpoint

    rows = []
    root = tempfile.mkdtemp(prefix="kvtide_gpu_check_")
    cases = [("LlamaForCausalLM", {}), ("Qwen2ForCausalLM", {}), ("MistralForCausalLM", {"sliding_window": 8})]
    if args.small:
        cases = cases[:1]
    max_tokens = 8 if args.small else 24
    backend = "triton" if args.device == "cuda" else "torch"
    for arch, overrides in cases:
        model_dir = make_random_checkpoint(os.path.join(root, arch), arch, seed=7, **overrides)
        for dtype_name, dtype in (("float32", torch.float32), ("bfloat16", torch.bfloat16)):
            hf = hf_from_pretrained(model_dir, dtype, args.device)
            tokenizer = None
            for eager in ((True, False) if dtype == torch.float32 and args.device == "cuda" else (True,)):
                llm = LLM(model=model_dir, device=args.device, dtype=dtype_name, attention_backend=backend,
                          enforce_eager=eager, kv_cache_memory="64MiB", max_model_len=256, max_num_seqs=8)
                tokenizer = llm.get_tokenizer()
                params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
                ours = [list(o.outputs[0].token_ids) for o in llm.generate(PARITY_PROMPTS, params)]
                del llm
                free_memory(args.device)
                item = f"{arch} {dtype_name} {'eager' if eager else 'graphs'}"
                rows.append(_compare_with_hf(hf, tokenizer, ours, dtype, args.device, item))
            del hf
            free_memory(args.device)
    return rows


def _compare_with_hf(hf, tokenizer, ours: list[list[int]], dtype, device: str, item: str) -> Row:
    import torch

    exact, bad = 0, []
    with torch.no_grad():
        for prompt, tokens in zip(PARITY_PROMPTS, ours, strict=True):
            prompt_ids = tokenizer(prompt)["input_ids"]
            forced = torch.tensor([prompt_ids + tokens[:-1]], device=device)
            logits = hf(forced).logits[0, len(prompt_ids) - 1:]
            # HF's greedy token after each of our prefixes: equal at every position is HF's own greedy
            # sequence. (HF generate's min_new_tokens would forbid EOS, which ignore_eos lets a
            # sequence emit and go past, as vLLM's does.)
            exact += logits.argmax(-1).tolist() == tokens
            miss = first_uncontained(tokens, logits.topk(TOP_K, dim=-1).indices.tolist())
            if miss is not None:
                bad.append(miss)
    n = len(ours)
    if dtype == torch.float32:
        status = "PASS" if exact == n else "FAIL"
        note = "" if exact == n else f"{len(bad)} sequences leave HF's top-{TOP_K}"
    else:
        status = "PASS" if not bad else "FAIL"
        note = f"top-{TOP_K} containment" + (f"; first miss at token {min(bad)}" if bad else "")
    return Row("parity", item, status, f"{exact}/{n} equal to HF", note)


# ---- 3 & 4. the Llama-3-8B-shaped model ------------------------------------------------------------
def measure_bandwidth(device: str, nbytes: int = 1 << 30, reps: int = 10) -> float:
    """Device copy bandwidth in bytes/s (read + write counted)."""
    import torch

    src = torch.empty(nbytes, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    dst.copy_(src)
    synchronize(device)
    start = time.perf_counter()
    for _ in range(reps):
        dst.copy_(src)
    synchronize(device)
    return 2 * nbytes * reps / (time.perf_counter() - start)


def build_models(config, device: str, dtype, with_hf: bool):
    """(ours, hf or None) with the same random weights, made on the device: HF initializes, ours
    loads HF's tensors through its weight loaders."""
    import torch
    from transformers import LlamaForCausalLM as HFLlama

    from kvtide.models.llama import LlamaForCausalLM

    old = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device):
            hf = HFLlama(config).eval()
            ours = LlamaForCausalLM(config, 1024, dtype).eval()
    finally:
        torch.set_default_dtype(old)
    with torch.no_grad():
        ours.load_weights((name, t.detach()) for name, t in hf.state_dict().items())
    if not with_hf:
        del hf
        free_memory(device)
        hf = None
    return ours, hf


@contextlib.contextmanager
def engine_on_model(model, config, **engine_kwargs):
    """An LLM whose runner uses `model` (already on the device) instead of loading a checkpoint;
    the directory holds only config.json and the byte tokenizer."""
    import kvtide.worker.model_runner as model_runner
    from kvtide import LLM
    from kvtide.models.demo import build_byte_tokenizer

    with tempfile.TemporaryDirectory(prefix="kvtide_gpu_check_") as model_dir:
        config.save_pretrained(model_dir)
        build_byte_tokenizer().save_pretrained(model_dir)
        original = model_runner.load_model
        model_runner.load_model = lambda *args, **kwargs: model
        try:
            llm = LLM(model=model_dir, **engine_kwargs)
        finally:
            model_runner.load_model = original
        try:
            yield llm
        finally:
            for attn in model.attention_layers():
                attn.kv_cache = None
            del llm  # the caller drops its name too, then frees device memory


def random_prompts(n: int, length: int, vocab_size: int, seed: int) -> list[list[int]]:
    import torch

    gen = torch.Generator().manual_seed(seed)
    return torch.randint(3, vocab_size, (n, length), generator=gen).tolist()


def timed_generate(llm, prompts: list[list[int]], max_tokens: int, device: str) -> float:
    from kvtide import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True, detokenize=False)
    synchronize(device)
    start = time.perf_counter()
    llm.generate([{"prompt_token_ids": p} for p in prompts], params)
    synchronize(device)
    return time.perf_counter() - start


def section_decode(args, budget: Budget, models) -> list[Row]:
    ours, _, config = models
    in_len, out_len = (16, 8) if args.small else (128, 128)
    bandwidth = measure_bandwidth(args.device, (1 << 24) if args.small else (1 << 30))
    weight_bytes = weight_bytes_per_token(ours)
    floor = floor_ms(weight_bytes, bandwidth)
    rows = [Row("decode", "bandwidth floor (batch 1)", "INFO", f"{floor:.2f} ms/token",
                f"{weight_bytes / 1e9:.2f} GB weights / {bandwidth / 1e9:.0f} GB/s copy")]
    prompt = random_prompts(1, in_len, config.vocab_size, seed=1)
    for eager in (True, False) if args.device == "cuda" else (True,):
        with engine_on_model(ours, config, **_engine_kwargs(args, eager)) as llm:
            timed_generate(llm, prompt, 2, args.device)  # warm up (and compile)
            prefill = timed_generate(llm, prompt, 1, args.device)
            total = timed_generate(llm, prompt, out_len + 1, args.device)
        del llm  # its KV cache and graph pool go before the next engine is built
        free_memory(args.device)
        ms = (total - prefill) / out_len * 1e3
        rows.append(Row("decode", f"batch 1 {'eager' if eager else 'CUDA graphs'}", "INFO", f"{ms:.2f} ms/token",
                        f"{floor / ms:.0%} of the floor's speed; {in_len} in / {out_len} out"))
    return rows


def section_throughput(args, budget: Budget, models) -> list[Row]:
    import torch

    ours, hf, config = models
    in_len, out_len = (16, 16) if args.small else (128, 128)
    rows = []
    for batch in args.batches:
        prompts = random_prompts(batch, in_len, config.vocab_size, seed=batch)
        with engine_on_model(ours, config, **_engine_kwargs(args, eager=False)) as llm:
            timed_generate(llm, prompts[:2], 2, args.device)
            seconds = timed_generate(llm, prompts, out_len, args.device)
        del llm
        free_memory(args.device)
        rows.append(Row("throughput", f"kvtide batch {batch}", "INFO", f"{batch * out_len / seconds:.0f} tok/s",
                        f"{in_len} in / {out_len} out, {seconds:.1f} s"))
        if hf is None:
            rows.append(Row("throughput", f"HF batch {batch}", "SKIP", "", "not enough device memory for both"))
            continue
        if budget.left() < 60:
            rows.append(Row("throughput", f"HF batch {batch}", "SKIP", "", "time budget"))
            continue
        ids = torch.tensor(prompts, device=args.device)
        with torch.no_grad():
            hf.generate(ids[:2, :8], max_new_tokens=2, do_sample=False, pad_token_id=0)
            synchronize(args.device)
            start = time.perf_counter()
            hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=out_len, min_new_tokens=out_len,
                        do_sample=False, pad_token_id=0)
            synchronize(args.device)
        hf_seconds = time.perf_counter() - start
        rows.append(Row("throughput", f"HF generate batch {batch}", "INFO",
                        f"{batch * out_len / hf_seconds:.0f} tok/s",
                        f"kvtide {hf_seconds / seconds:.2f}x HF; {hf_seconds:.1f} s"))
        free_memory(args.device)
    return rows


def _engine_kwargs(args, eager: bool) -> dict:
    return dict(device=args.device, dtype="bfloat16" if args.device == "cuda" else "float32",
                attention_backend="triton" if args.device == "cuda" else "torch", enforce_eager=eager,
                kv_cache_memory="256MiB" if args.small else "12GiB", max_model_len=1024,
                max_num_seqs=max(args.batches))


def build_big_models(args) -> tuple:
    import torch

    config = llama3_8b_config(small=args.small)
    if args.device == "cuda":
        total = torch.cuda.get_device_properties(0).total_memory
        with_hf = total > 60e9  # two bf16 copies of 8B (32 GB) + KV and activations
        if total < 40e9:  # one copy + 12 GiB KV must fit: fewer layers, same width
            config = llama3_8b_config(num_layers=max(4, int(32 * (total - 16e9) / 32e9)))
    else:
        with_hf = True
    dtype = torch.bfloat16 if args.device == "cuda" else torch.float32
    ours, hf = build_models(config, args.device, dtype, with_hf)
    return ours, hf, config


def environment_row(device: str) -> Row:
    import torch
    import transformers

    name = torch.cuda.get_device_name(0) if device == "cuda" else "cpu"
    try:
        import triton

        triton_version = triton.__version__
    except ImportError:
        triton_version = "-"
    return Row("env", name, "INFO", f"torch {torch.__version__}",
               f"triton {triton_version}, transformers {transformers.__version__}")


# ---- main -----------------------------------------------------------------------------------------
# ---- 5. tensor and expert parallelism (NCCL), with two or more GPUs --------------------------------
def section_parallel(args, budget: Budget) -> list[Row]:
    """TP=2 on a dense model and TP=2 with expert parallelism on a MoE model: greedy tokens equal
    to world size 1's, and the all-reduce / all-to-all bytes and time per step rank 0 measured."""
    import torch

    from kvtide import LLM, SamplingParams
    from kvtide.models.demo import make_random_checkpoint

    if args.device == "cuda" and torch.cuda.device_count() < 2:
        return [Row("parallel", "TP=2 / EP=2 (NCCL)", "SKIP", "", f"{torch.cuda.device_count()} GPU")]
    rows = []
    root = tempfile.mkdtemp(prefix="kvtide_gpu_check_parallel_")
    params = SamplingParams(temperature=0.0, max_tokens=8 if args.small else 24, ignore_eos=True)
    common = dict(device=args.device, dtype="float32", kv_cache_memory="64MiB", max_model_len=256, max_num_seqs=8)
    if args.device == "cpu":
        common["cpu_threads_per_rank"] = 1
    for arch, layout in (("LlamaForCausalLM", dict(tensor_parallel_size=2)),
                         ("MixtralForCausalLM", dict(tensor_parallel_size=2, enable_expert_parallel=True))):
        model_dir = make_random_checkpoint(os.path.join(root, arch), arch, seed=7)
        whole = LLM(model=model_dir, **common)
        expected = [list(o.outputs[0].token_ids) for o in whole.generate(PARITY_PROMPTS, params)]
        whole.shutdown()
        llm = LLM(model=model_dir, **common, **layout)
        try:
            before, steps_before = llm.engine.core.executor.comm_stats()[0], llm.engine.core.num_steps
            start = time.monotonic()
            got = [list(o.outputs[0].token_ids) for o in llm.generate(PARITY_PROMPTS, params)]
            elapsed = time.monotonic() - start
            after = llm.engine.core.executor.comm_stats()[0]
            stats = {kind: {f: v - before.get(kind, {}).get(f, 0) for f, v in figures.items()}
                     for kind, figures in after.items()}
            steps = max(llm.engine.core.num_steps - steps_before, 1)
        finally:
            llm.shutdown()
        same = sum(a == b for a, b in zip(got, expected, strict=True))
        label = f"{arch} " + " ".join(f"{k}={v}" for k, v in layout.items())
        rows.append(Row("parallel", label, "PASS" if same == len(expected) else "FAIL",
                        f"{same}/{len(expected)} equal", f"{elapsed:.1f} s"))
        for kind, figures in sorted(stats.items()):
            rows.append(Row("parallel", f"  {kind} per step", "INFO",
                            f"{figures['bytes'] / steps / 1024:.1f} KiB",
                            f"{figures['seconds'] / steps * 1e3:.2f} ms, {figures['calls'] / steps:.1f} calls"))
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    parser.add_argument("--small", action="store_true", help="tiny shapes: a smoke test of the script")
    parser.add_argument("--sections", default="kernels,parity,decode,throughput,parallel")
    parser.add_argument("--batches", default="64,256", help="throughput batch sizes")
    parser.add_argument("--budget", type=float, default=450.0, help="seconds for all sections")
    parser.add_argument("--kernel-timeout", type=float, default=240.0)
    args = parser.parse_args(argv)
    args.batches = [int(b) for b in args.batches.split(",")]
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
    sys.path.insert(0, str(REPO))
    budget = Budget(args.budget)
    sections = args.sections.split(",")
    # Rough needs in seconds; a section that cannot finish in what is left is skipped.
    needs = {"kernels": 60, "parity": 40, "decode": 60, "throughput": 60, "parallel": 60}
    rows: list[Row] = [environment_row(args.device)]
    models = None
    for name in sections:
        if budget.left() < needs[name]:
            rows.append(Row(name, "(section)", "SKIP", "", "time budget"))
            continue
        print(f"[gpu_check] {name} ({budget.left():.0f} s left)", flush=True)
        try:
            if name in ("decode", "throughput") and models is None:
                models = build_big_models(args)
            fn = {"kernels": section_kernels, "parity": section_parity, "parallel": section_parallel}.get(name)
            new = fn(args, budget) if fn else {"decode": section_decode,
                                                "throughput": section_throughput}[name](args, budget, models)
        except Exception as e:  # one broken section must not hide the others' results
            traceback.print_exc()
            new = [Row(name, "(section)", "FAIL", "", f"{type(e).__name__}: {str(e)[:120]}")]
        for row in new:
            print(f"[gpu_check]   {row.item}: {row.status} {row.value} {row.note}", flush=True)
        rows += new
    print("\n" + format_table(rows))
    return 1 if any(r.status == "FAIL" for r in rows) else 0


if __name__ == "__main__":
    sys.exit(main())
