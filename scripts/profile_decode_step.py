"""Where one decode step's time goes, on CPU: kernels vs fixed per-op and Python cost.

    python scripts/profile_decode_step.py --model smollm2      # or demo, or a checkpoint directory;
                                                               # no --model: the bench checkpoint
    python scripts/profile_decode_step.py --batch 64           # 64 requests decoding together

Three measurements of the same warm decode steps (--batch requests, each a --prompt-len token
prompt, greedy):

  1. wall: engine.step() per decode token, no instrumentation (median and quartiles);
  2. timers: an exclusive timer per component (a stack, so each interval is charged to the innermost
     component running): linear GEMMs, LM head, KV write, attention, norms, rotary, activation,
     embedding, the model's Python glue, input preparation, sampling metadata, sampler, the rest of
     the runner, the scheduler/engine core, the output processor. Each timer costs ~0.3 us;
  3. torch.profiler (record_shapes): aten ops per step and the ops with the most self time.

With --compare-input-path OLD.py (a former kvtide/worker/input_batch.py, e.g.
`git show <rev>:kvtide/worker/input_batch.py > /tmp/old_input_batch.py`), the runner's input path
alone (the diffs applied, the step's tensors and sampling metadata built, sampled tokens stored) is
replayed over recorded decode steps, the per-request rebuild of that file against the persistent
InputBatch, interleaved in one process so machine noise hits both alike.

"Non-kernel" below is the step's wall time less the time inside GEMMs (linear + LM head) and the
attention backend's forward: norms, rotary, activation, KV writes, glue, input preparation, sampling
and the engine. Printed with the CPU model and ISA, since all of it depends on the machine.
"""

from __future__ import annotations

import argparse
import collections
import copy
import importlib
import importlib.util
import itertools
import statistics
import sys
import time
from collections.abc import Callable

import numpy as np
import torch

from kvtide.machine import describe_machine


class ExclusiveTimers:
    """Charges each interval to the innermost instrumented function on the stack."""

    def __init__(self, clock: Callable[[], float] = time.perf_counter) -> None:
        self.clock = clock
        """perf_counter, or thread_time: the main thread's CPU time, which a busy machine's run
        queue does not inflate (kernels' other threads are then not counted)."""
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
            now = timers.clock()
            if timers._stack:
                timers.totals[timers._stack[-1]] += now - timers._last
            timers._stack.append(label)
            timers.calls[label] += 1
            timers._last = now
            try:
                return original(*args, **kwargs)
            finally:
                now = timers.clock()
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
        (model_runner.ModelRunner, "_update_states", "update states"),
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
    input_batch = importlib.import_module("kvtide.worker.input_batch")
    if hasattr(input_batch, "InputBatch"):  # the persistent batch's sampling metadata (absent before it)
        targets.append((input_batch.InputBatch, "sampling_metadata", "sampling metadata"))
    for name in ("cos_sin", "forward", "forward_qk"):
        if hasattr(rotary.RotaryEmbedding, name):
            targets.append((rotary.RotaryEmbedding, name, "rotary"))
    for owner, attr, label in targets:
        if hasattr(owner, attr):
            timers.wrap(owner, attr, label)


def start_requests(llm, batch: int, prompt_len: int, max_tokens: int, seed: int) -> None:
    """`batch` requests with random prompts, stepped until every prompt is computed (the steps
    measured after are decodes only)."""
    from kvtide.sampling_params import SamplingParams

    vocab = llm.model_info.vocab_size
    rng = np.random.default_rng(seed)
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    for _ in range(batch):
        prompt = rng.integers(3, vocab, size=prompt_len).tolist()
        llm.engine.add_request(llm.engine.next_request_id(), {"prompt_token_ids": prompt}, params)
    scheduler = llm.engine.core.scheduler
    while len(scheduler.waiting) or any(r.num_computed_tokens < prompt_len for r in scheduler.running):
        llm.engine.step()
    llm.engine.step()  # the last prefill's first token


def decode_steps(llm, num: int) -> list[float]:
    times = []
    for _ in range(num):
        start = time.perf_counter()
        llm.engine.step()
        times.append(time.perf_counter() - start)
    return times


def record_steps(llm, num: int) -> tuple[dict, list[tuple]]:
    """The runner's request records as the first of `num` decode steps starts, and each step's
    (SchedulerOutput, sampled tokens), copied."""
    runner = llm.engine.core.executor.runner
    original = runner.execute
    snapshot: dict = {}
    steps: list[tuple] = []

    def execute(so):
        if not steps and not snapshot:
            snapshot.update(copy.deepcopy(runner.requests))
        out = original(so)
        steps.append((copy.deepcopy(so), dict(out.sampled_token_ids)))
        return out

    runner.execute = execute
    try:
        decode_steps(llm, num)
    finally:
        del runner.execute
    return snapshot, steps


def replay_rebuild(old, snapshot: dict, steps: list[tuple], block_size: int, vocab_size: int) -> list[float]:
    """The former runner's input path over `steps`: per-request records updated from the diffs, the
    step rebuilt from them (`old.prepare_step_inputs`), SamplingMetadata.build over row copies."""
    from kvtide.sampling.metadata import SamplingMetadata

    cpu = torch.device("cpu")
    requests = {r: old.CachedRequestState(s.request_id, list(s.token_ids), s.num_prompt_tokens, s.sampling_params,
                                          list(s.block_ids), s.num_computed_tokens, uid=s.uid)
                for r, s in snapshot.items()}
    times = []
    for so, sampled in steps:
        start = time.perf_counter()
        for req_id in so.finished_req_ids:
            requests.pop(req_id, None)
        for new in so.scheduled_new_reqs:
            requests[new.request_id] = old.CachedRequestState(
                new.request_id, list(new.token_ids), new.num_prompt_tokens, new.sampling_params,
                list(new.block_ids), new.num_computed_tokens, uid=0)
        for cached in so.scheduled_cached_reqs:
            state = requests[cached.request_id]
            for index in cached.dropped_block_indices:
                state.block_ids[index] = -1
            state.block_ids.extend(cached.new_block_ids)
            state.num_computed_tokens = cached.num_computed_tokens
            state.token_ids.extend(cached.new_token_ids)
        inputs = old.prepare_step_inputs(so.num_scheduled_tokens, requests, block_size, cpu)
        states = [requests[inputs.order[i]] for i in inputs.sample_rows]
        SamplingMetadata.build([s.row_state() for s in states], vocab_size, cpu)
        output = {}
        for state in states:
            state.token_ids.append(sampled[state.request_id])
            output[state.request_id] = sampled[state.request_id]
        times.append(time.perf_counter() - start)
    return times


def replay_input_batch(snapshot: dict, steps: list[tuple], block_size: int, vocab_size: int) -> list[float]:
    """The same steps through the persistent InputBatch, as ModelRunner drives it."""
    from kvtide.scheduler.output import NewRequestData, SchedulerOutput
    from kvtide.worker.input_batch import InputBatch

    batch = InputBatch(block_size, vocab_size, torch.device("cpu"), max(len(snapshot), 1))
    batch.update(SchedulerOutput([NewRequestData(s.request_id, s.token_ids, s.num_prompt_tokens, s.sampling_params,
                                                 s.block_ids, s.num_computed_tokens) for s in snapshot.values()],
                                 [], {}, 0), iter([s.uid for s in snapshot.values()]))
    uids = itertools.count(1 << 40)
    times = []
    for so, sampled in steps:
        start = time.perf_counter()
        batch.update(so, uids)
        inputs = batch.prepare(so.num_scheduled_tokens)
        states, _ = batch.sampling_metadata(inputs)
        tokens = [sampled[s.request_id] for s in states]
        output = {}
        for state, token in zip(states, tokens, strict=True):
            output[state.request_id] = token
        batch.append_sampled(inputs.batch_rows[inputs.sample_rows], states, tokens)
        times.append(time.perf_counter() - start)
    return times


def compare_input_paths(llm, old_path: str, num_steps: int, rounds: int) -> None:
    spec = importlib.util.spec_from_file_location("old_input_batch", old_path)
    old = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = old  # dataclasses look their module up
    spec.loader.exec_module(old)
    snapshot, steps = record_steps(llm, num_steps)
    runner = llm.engine.core.executor.runner
    args = (snapshot, steps, runner.block_size, runner.vocab_size)
    rebuild: list[float] = []
    persistent: list[float] = []
    for r in range(rounds):  # alternate which goes first
        for name in (("rebuild", "persistent") if r % 2 == 0 else ("persistent", "rebuild")):
            if name == "rebuild":
                rebuild += replay_rebuild(old, *args)
            else:
                persistent += replay_input_batch(*args)
    a, b = statistics.median(rebuild) * 1e6, statistics.median(persistent) * 1e6
    print(f"\nrunner input path over {len(steps)} recorded steps x {rounds} rounds, interleaved (median per step): "
          f"per-request rebuild ({old_path}) {a:.1f} us, persistent InputBatch {b:.1f} us ({b / a - 1:+.0%})")


def finish(llm) -> None:
    while llm.engine.has_unfinished_requests():
        llm.engine.step()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None, help="smollm2, demo, a checkpoint dir (default: bench model)")
    parser.add_argument("--batch", type=int, default=1, help="requests decoding together")
    parser.add_argument("--prompt-len", type=int, default=128)
    parser.add_argument("--steps", type=int, default=64, help="decode steps measured per mode")
    parser.add_argument("--profile-steps", type=int, default=8)
    parser.add_argument("--rounds", type=int, default=3, help="wall/timer rounds, interleaved")
    parser.add_argument("--top", type=int, default=20)
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--engine-arg", action="append", default=[], help="extra EngineArgs key=value")
    parser.add_argument("--compare-input-path", metavar="OLD.py", default=None,
                        help="a former kvtide/worker/input_batch.py: replay its per-request rebuild against InputBatch")
    parser.add_argument("--compare-rounds", type=int, default=20)
    parser.add_argument("--clock", choices=("wall", "thread"), default="wall",
                        help="the component timers' clock: wall time, or the main thread's CPU time")
    args = parser.parse_args(argv)

    from kvtide import LLM
    from kvtide.bench.common import resolve_model

    extra = {}
    for item in args.engine_arg:
        key, value = item.split("=", 1)
        extra[key] = {"true": True, "false": False}.get(value.lower(), value)
    model_dir = resolve_model(args.model)
    print(describe_machine())
    print(f"model: {model_dir}  dtype {args.dtype}  prompt {args.prompt_len} tokens, batch {args.batch}, greedy")
    start = time.perf_counter()
    llm = LLM(model=model_dir, dtype=args.dtype, **extra)
    print(f"engine built in {time.perf_counter() - start:.1f} s")
    per_round = args.steps + 4
    total_tokens = args.rounds * 2 * per_round + args.profile_steps + 8 + (args.steps if args.compare_input_path else 0)
    if args.prompt_len + total_tokens > llm.model_info.max_model_len:
        raise SystemExit("prompt + steps exceed max_model_len")
    start_requests(llm, args.batch, args.prompt_len, total_tokens, seed=0)
    decode_steps(llm, 4)  # warm up

    timers = ExclusiveTimers(time.thread_time if args.clock == "thread" else time.perf_counter)
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
    print(f"\n{'component (exclusive ' + args.clock + ' time)':30s} {'ms/step':>8s} {'share':>6s} {'calls/step':>10s}")
    accounted = sum(timers.totals.values()) / steps
    for label, total in sorted(timers.totals.items(), key=lambda kv: -kv[1]):
        ms = total / steps * 1e3
        print(f"{label:30s} {ms:8.3f} {ms / (accounted * 1e3):6.1%} {timers.calls[label] / steps:10.1f}")
    kernel_labels = ("linear gemm", "lm head", "attention", "fused decode layers")
    kernel = sum(timers.totals.get(k, 0.0) for k in kernel_labels) / steps * 1e3
    print(f"{'(sum)':30s} {accounted * 1e3:8.3f}")
    runner_labels = ("update states", "prepare_inputs", "sampling metadata", "runner (other)")
    runner_ms = sum(timers.totals.get(k, 0.0) for k in runner_labels) / steps * 1e3
    print(f"runner host time (update states + prepare_inputs + sampling metadata + runner (other)): "
          f"{runner_ms:.3f} ms per step")
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
    if args.compare_input_path:
        compare_input_paths(llm, args.compare_input_path, args.steps, args.compare_rounds)
    finish(llm)
    return 0


if __name__ == "__main__":
    sys.exit(main())
