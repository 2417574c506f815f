"""Where one batch-1 decode step's time goes, on CPU: kernels vs fixed per-op and Python cost.

    python scripts/profile_decode_step.py --model smollm2      # or demo, or a checkpoint directory;
                                                               # no --model: the bench checkpoint

Three measurements of the same warm decode steps (one request, a --prompt-len token prompt, greedy):

  1. wall: engine.step() per decode token, no instrumentation (median and quartiles);
  2. timers: an exclusive timer per component (a stack, so each interval is charged to the innermost
     component running): linear GEMMs, LM head, KV write, attention, norms, rotary, activation,
     embedding, the model's Python glue, input preparation, sampling metadata, sampler, the rest of
     the runner, the scheduler/engine core, the output processor. Each timer costs ~0.3 us;
  3. torch.profiler (record_shapes): aten ops per step and the ops with the most self time.

"Non-kernel" below is the step's wall time less the time inside GEMMs (linear + LM head) and the
attention backend's forward: norms, rotary, activation, KV writes, glue, input preparation, sampling
and the engine. Printed with the CPU model and ISA, since all of it depends on the machine.
"""

from __future__ import annotations

import argparse
import collections
import statistics
import sys
import time
from collections.abc import Callable

import numpy as np

from kvtide.machine import describe_machine


class ExclusiveTimers:
    """Charges each interval to the innermost instrumented function on the stack."""

    def __init__(self) -> None:
        self.totals: dict[str, float] = collections.defaultdict(float)
        self.calls: dict[str, int] = collections.defaultdict(int)
        self._stack: list[str] = []
        self._last = 0.0
        self._patches: list[tuple[object, str, Callable]] = []
        self.enabled = False

    def wrap(self, owner: object, attr: str, label: str) -> None:
        original = getattr(owner, attr)
        timers = self

        def timed(*args, **kwargs):
            if not timers.enabled:
                return original(*args, **kwargs)
            now = time.perf_counter()
            if timers._stack:
                timers.totals[timers._stack[-1]] += now - timers._last
            timers._stack.append(label)
            timers.calls[label] += 1
            timers._last = now
            try:
                return original(*args, **kwargs)
            finally:
                now = time.perf_counter()
                timers.totals[timers._stack.pop()] += now - timers._last
                timers._last = now

        setattr(owner, attr, timed)
        self._patches.append((owner, attr, original))

    def unwrap(self) -> None:
        for owner, attr, original in reversed(self._patches):
            setattr(owner, attr, original)
        self._patches.clear()

    def reset(self) -> None:
        self.totals.clear()
        self.calls.clear()


def instrument(timers: ExclusiveTimers, llm) -> None:
    from kvtide.layers import activation, embedding, fused_decode, linear, norm, rotary
    from kvtide.models import llama
    from kvtide.sampling import metadata, sampler
    from kvtide.worker import model_runner

    runner = llm.engine.core.executor.runner
    backend_cls = type(runner.attention_backend)
    targets = [
        (llm.engine, "step", "output processor"),
        (llm.engine.core, "step", "scheduler + engine core"),
        (model_runner.ModelRunner, "execute", "runner (other)"),
        (model_runner.ModelRunner, "_prepare_inputs", "prepare_inputs"),
        (metadata.SamplingMetadata, "build", "sampling metadata"),
        (sampler.Sampler, "__call__", "sampler"),
        (llama.LlamaForCausalLM, "forward", "model glue (python)"),
        (llama.LlamaDecoderLayer, "forward", "model glue (python)"),
        (llama.LlamaAttention, "forward", "model glue (python)"),
        (llama.LlamaMLP, "forward", "model glue (python)"),
        (llama.LlamaForCausalLM, "compute_logits", "lm head"),
        (fused_decode.FusedDecodeLayers, "run", "fused decode layers"),
        (linear.LinearBase, "forward", "linear gemm"),
        (norm.RMSNorm, "forward", "rmsnorm (+residual)"),
        (activation.SiluAndMul, "forward", "silu_and_mul"),
        (embedding.VocabEmbedding, "forward", "embedding"),
        (backend_cls, "write_kv", "kv write"),
        (backend_cls, "forward", "attention"),
    ]
    for name in ("cos_sin", "forward", "forward_qk"):
        if hasattr(rotary.RotaryEmbedding, name):
            targets.append((rotary.RotaryEmbedding, name, "rotary"))
    for owner, attr, label in targets:
        if hasattr(owner, attr):
            timers.wrap(owner, attr, label)


def start_request(llm, prompt_len: int, max_tokens: int, seed: int) -> None:
    from kvtide.sampling_params import SamplingParams

    vocab = llm.model_info.vocab_size
    rng = np.random.default_rng(seed)
    prompt = rng.integers(3, vocab, size=prompt_len).tolist()
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    llm.engine.add_request(llm.engine.next_request_id(), {"prompt_token_ids": prompt}, params)
    llm.engine.step()  # prefill (and the first token)


def decode_steps(llm, num: int) -> list[float]:
    times = []
    for _ in range(num):
        start = time.perf_counter()
        llm.engine.step()
        times.append(time.perf_counter() - start)
    return times


def finish(llm) -> None:
    while llm.engine.has_unfinished_requests():
        llm.engine.step()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None, help="smollm2, demo, a checkpoint dir (default: bench model)")
    parser.add_argument("--prompt-len", type=int, default=128)
    parser.add_argument("--steps", type=int, default=64, help="decode steps measured per mode")
    parser.add_argument("--profile-steps", type=int, default=8)
    parser.add_argument("--rounds", type=int, default=3, help="wall/timer rounds, interleaved")
    parser.add_argument("--top", type=int, default=20)
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--engine-arg", action="append", default=[], help="extra EngineArgs key=value")
    args = parser.parse_args(argv)

    from kvtide import LLM
    from kvtide.bench.common import resolve_model

    extra = {}
    for item in args.engine_arg:
        key, value = item.split("=", 1)
        extra[key] = {"true": True, "false": False}.get(value.lower(), value)
    model_dir = resolve_model(args.model)
    print(describe_machine())
    print(f"model: {model_dir}  dtype {args.dtype}  prompt {args.prompt_len} tokens, batch 1, greedy")
    start = time.perf_counter()
    llm = LLM(model=model_dir, dtype=args.dtype, **extra)
    print(f"engine built in {time.perf_counter() - start:.1f} s")
    per_round = args.steps + 4
    total_tokens = args.rounds * 2 * per_round + args.profile_steps + 8
    if args.prompt_len + total_tokens > llm.model_info.max_model_len:
        raise SystemExit("prompt + steps exceed max_model_len")
    start_request(llm, args.prompt_len, total_tokens, seed=0)
    decode_steps(llm, 4)  # warm up

    timers = ExclusiveTimers()
    instrument(timers, llm)
    walls: list[float] = []
    timed_walls: list[float] = []
    for _ in range(args.rounds):  # interleaved, so drift on a shared machine hits both alike
        timers.enabled = False
        walls += decode_steps(llm, per_round)[4:]
        timers.enabled = True
        timed_walls += decode_steps(llm, per_round)[4:]
    timers.enabled = False
    steps = args.rounds * per_round  # the timers saw every step, the 4 dropped from the walls too

    wall_ms = statistics.median(walls) * 1e3
    q1, _, q3 = (q * 1e3 for q in statistics.quantiles(walls, n=4))
    print(f"\nwall per decode step: median {wall_ms:.2f} ms (quartiles {q1:.2f} .. {q3:.2f}; "
          f"with timers {statistics.median(timed_walls) * 1e3:.2f} ms), {len(walls)} steps")
    print(f"\n{'component (exclusive time)':30s} {'ms/step':>8s} {'share':>6s} {'calls/step':>10s}")
    accounted = sum(timers.totals.values()) / steps
    for label, total in sorted(timers.totals.items(), key=lambda kv: -kv[1]):
        ms = total / steps * 1e3
        print(f"{label:30s} {ms:8.3f} {ms / (accounted * 1e3):6.1%} {timers.calls[label] / steps:10.1f}")
    kernel_labels = ("linear gemm", "lm head", "attention", "fused decode layers")
    kernel = sum(timers.totals.get(k, 0.0) for k in kernel_labels) / steps * 1e3
    print(f"{'(sum)':30s} {accounted * 1e3:8.3f}")
    print(f"\nkernel time (linear gemm + lm head + attention; fused decode layers, whose norms, rotary and "
          f"K/V writes run inside): {kernel:.2f} ms; non-kernel: {accounted * 1e3 - kernel:.2f} ms per step")
    timers.unwrap()

    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], record_shapes=True) as prof:
        decode_steps(llm, args.profile_steps)
    events = prof.key_averages(group_by_input_shape=True)
    top_level = [e for e in prof.events() if e.name.startswith("aten::") and e.cpu_parent is None]
    all_aten = [e for e in prof.events() if e.name.startswith("aten::")]
    print(f"\ntorch.profiler over {args.profile_steps} steps: {len(top_level) / args.profile_steps:.0f} "
          f"top-level aten ops per step ({len(all_aten) / args.profile_steps:.0f} counting nested ones)")
    by_name = collections.Counter(e.name for e in top_level)
    print("top-level ops per step: " + ", ".join(f"{n.removeprefix('aten::')} {c / args.profile_steps:.0f}"
                                                 for n, c in by_name.most_common(16)))
    print(f"\n{'op':28s} {'shapes':56s} {'calls/step':>10s} {'self ms/step':>12s}")
    for e in sorted(events, key=lambda e: -e.self_cpu_time_total)[:args.top]:
        shapes = str(e.input_shapes)[:56]
        print(f"{e.key:28s} {shapes:56s} {e.count / args.profile_steps:10.1f} "
              f"{e.self_cpu_time_total / args.profile_steps / 1e3:12.3f}")
    finish(llm)
    return 0


if __name__ == "__main__":
    sys.exit(main())
