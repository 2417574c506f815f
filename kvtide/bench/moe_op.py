"""`kvtide bench moe-op`: one MoE layer's forward against a dense gated MLP of the same active size.

  moe     router linear (H -> E) + FusedMoE's torch path (softmax top-k routing, the assignments
          grouped by expert, one pair of matmuls per expert with tokens) + the shared expert MLP
          when --shared-intermediate-size is set
  dense   one gated MLP (gate/up, SiLU-and-mul, down) of intermediate top_k * I + shared: the
          parameters a token's forward touches in the MoE layer, minus the router

The MoE's expert matmuls go through fused_moe.expert_linear (on float32 CPU: F.linear or the
weight-major product (w @ x.T).T, whichever it measured faster per shape and row bucket) and, on
float32 CPU where the compiled ops build, through the one-call experts op on weight panels
(`panels`); the dense MLP is timed with the same products (F.linear, weight-major, the panel
kernel) and on each side the fastest counts ("moe_kernel", "dense_kernel" in the JSON), so neither
side wins by a kernel the other lacks. Same dtype and threads, random weights; the
router's random weights spread the tokens over the experts about evenly.

For each --tokens count the ops are timed alternately, --iters times each after --warmup rounds,
and the medians are reported with their ratio (the target: moe within 1.5x of dense). Once
T * k >= E every expert is active and the MoE streams E / k times the dense MLP's weight bytes
(E 8, k 2: 4x at 8 tokens), in matmuls of ~T * k / E rows each. Mixtral-like shape by default
(E 8, k 2, H 768, I 1024), float32:

    kvtide bench moe-op --tokens 1,8,64,256 --iters 50

Every figure is printed next to the machine (CPU model, ISA, threads).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

from kvtide.bench.common import align_rows, module_main, print_and_save
from kvtide.machine import describe_machine, machine_info

DTYPES = ("float32", "bfloat16", "float16")
TARGET_RATIO = 1.5


def add_moe_op_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--num-experts", type=int, default=8, help="routed experts E")
    parser.add_argument("--top-k", type=int, default=2, help="experts per token k")
    parser.add_argument("--hidden-size", type=int, default=768, help="H")
    parser.add_argument("--intermediate-size", type=int, default=1024, help="I, per expert")
    parser.add_argument("--shared-intermediate-size", type=int, default=0,
                        help="intermediate size of the shared experts (0: none), e.g. n_shared_experts * I")
    parser.add_argument("--tokens", default="1,8,64,256", help="comma-separated token counts T")
    parser.add_argument("--dtype", default="float32", choices=DTYPES)
    parser.add_argument("--iters", type=int, default=20, help="timed forwards per op and token count")
    parser.add_argument("--warmup", type=int, default=3, help="untimed forwards first")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--output-json", default=None)


def _gated_mlp(x, gate_up, down, linear):
    import torch.nn.functional as F

    h = linear(x, gate_up)
    d = h.shape[-1] // 2
    return linear(F.silu(h[:, :d]) * h[:, d:], down)


def _time_ms(fn, x) -> float:
    start = time.perf_counter()
    fn(x)
    return (time.perf_counter() - start) * 1e3


def run_moe_op_bench(num_experts: int, top_k: int, hidden_size: int, intermediate_size: int,
                     shared_intermediate_size: int, tokens: list[int], dtype: str = "float32",
                     iters: int = 20, warmup: int = 3, seed: int = 0) -> dict:
    import torch
    import torch.nn.functional as F

    from kvtide.layers import layer_ops
    from kvtide.layers.moe import FusedMoE
    from kvtide.layers.moe.fused_moe import expert_linear, weight_major_linear

    torch_dtype = getattr(torch, dtype)
    g = torch.Generator().manual_seed(seed)

    def randn(*shape: int, scale: float) -> torch.Tensor:
        return (torch.randn(*shape, generator=g) * scale).to(torch_dtype)

    h, i, s = hidden_size, intermediate_size, shared_intermediate_size
    moe = FusedMoE(num_experts, top_k, h, i, renormalize=True).to(torch_dtype)
    moe.count_load = False
    moe.w13_weight.data.copy_(randn(num_experts, 2 * i, h, scale=h ** -0.5))
    moe.w2_weight.data.copy_(randn(num_experts, h, i, scale=i ** -0.5))
    router = randn(num_experts, h, scale=h ** -0.5)
    shared = (randn(2 * s, h, scale=h ** -0.5), randn(h, s, scale=s ** -0.5)) if s else None
    dense_i = top_k * i + s
    dense = (randn(2 * dense_i, h, scale=h ** -0.5), randn(h, dense_i, scale=dense_i ** -0.5))

    def moe_forward(x):
        out = moe(x, F.linear(x, router))
        return out + _gated_mlp(x, *shared, expert_linear) if shared is not None else out

    moe_forwards = {"torch": moe_forward}
    dense_forwards = {"f.linear": lambda x: _gated_mlp(x, *dense, F.linear),
                      "weight-major": lambda x: _gated_mlp(x, *dense, weight_major_linear)}
    if torch_dtype != torch.float32:  # expert_linear is F.linear there
        del dense_forwards["weight-major"]
    elif layer_ops.layer_op("moe_experts") is not None:
        # The compiled experts call, and the dense MLP on the same panel kernel.
        panels = {id(w): layer_ops.pack_panels(w) for w in dense}
        panel_moe = FusedMoE(num_experts, top_k, h, i, renormalize=True)
        panel_moe.count_load = False
        panel_moe.load_state_dict(moe.state_dict())
        panel_moe.expert_panels = (layer_ops.pack_panels(moe.w13_weight.data), layer_ops.pack_panels(moe.w2_weight.data))

        def panel_linear(x, w):
            return layer_ops.linear_panels(x, w.shape[0], panels[id(w)], None) if id(w) in panels else F.linear(x, w)

        def panel_moe_forward(x):
            out = panel_moe(x, F.linear(x, router))
            return out + _gated_mlp(x, *shared, expert_linear) if shared is not None else out

        moe_forwards["panels"] = panel_moe_forward
        dense_forwards["panels"] = lambda x: _gated_mlp(x, *dense, panel_linear)

    rows = []
    with torch.inference_mode():
        for num_tokens in tokens:
            x = randn(num_tokens, h, scale=1.0)
            forwards = {f"moe {k}": f for k, f in moe_forwards.items()} | dense_forwards
            times: dict[str, list[float]] = {name: [] for name in forwards}
            for step in range(warmup + iters):  # alternating: drift in the machine's load hits all
                for name, forward in forwards.items():
                    elapsed = _time_ms(forward, x)
                    if step >= warmup:
                        times[name].append(elapsed)
            medians = {name: statistics.median(t) for name, t in times.items()}
            dense_kernel = min(dense_forwards, key=medians.__getitem__)
            moe_kernel = min(moe_forwards, key=lambda k: medians[f"moe {k}"])
            moe_ms = medians[f"moe {moe_kernel}"]
            rows.append({"tokens": num_tokens, "moe_ms": moe_ms, "moe_kernel": moe_kernel,
                         "dense_ms": medians[dense_kernel], "dense_kernel": dense_kernel,
                         "ratio": moe_ms / medians[dense_kernel],
                         "moe_ms_by_kernel": {k: medians[f"moe {k}"] for k in moe_forwards},
                         "dense_ms_by_kernel": {name: medians[name] for name in dense_forwards}})
    return {"num_experts": num_experts, "top_k": top_k, "hidden_size": h, "intermediate_size": i,
            "shared_intermediate_size": s, "dense_intermediate_size": dense_i, "dtype": dtype, "iters": iters,
            "target_ratio": TARGET_RATIO, "results": rows, "machine": machine_info()}


def format_moe_op(result: dict) -> str:
    shared = f" + shared {result['shared_intermediate_size']}" if result["shared_intermediate_size"] else ""
    head = (f"MoE E={result['num_experts']} k={result['top_k']} H={result['hidden_size']} "
            f"I={result['intermediate_size']}{shared} vs dense MLP I={result['dense_intermediate_size']}, "
            f"{result['dtype']}, median of {result['iters']}")
    rows = [("tokens", "moe ms", "(kernel)", "dense ms", "(kernel)", "ratio")]
    for r in result["results"]:
        rows.append((str(r["tokens"]), f"{r['moe_ms']:.3f}", r.get("moe_kernel", "torch"), f"{r['dense_ms']:.3f}",
                     r["dense_kernel"], f"{r['ratio']:.2f}"))
    met = [str(r["tokens"]) for r in result["results"] if r["ratio"] <= result["target_ratio"]]
    target = (f"target moe <= {result['target_ratio']:.1f}x dense: met at tokens "
              f"{', '.join(met) if met else 'none'} of {len(result['results'])}")
    return "\n".join([describe_machine(result["machine"]), head, *align_rows(rows), target])


def _positive_ints(text: str, flag: str) -> list[int]:
    try:
        values = [int(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise ValueError(f"{flag}: {text!r} is not a comma-separated list of integers") from None
    if not values or min(values) < 1:
        raise ValueError(f"{flag} must list token counts >= 1; got {text!r}")
    return values


def main_moe_op(args: argparse.Namespace) -> int:
    tokens = _positive_ints(args.tokens, "--tokens")
    if min(args.num_experts, args.hidden_size, args.intermediate_size, args.iters) < 1:
        raise ValueError("--num-experts, --hidden-size, --intermediate-size and --iters must be >= 1")
    if not 1 <= args.top_k <= args.num_experts:
        raise ValueError(f"--top-k must be in [1, --num-experts={args.num_experts}]; got {args.top_k}")
    if args.shared_intermediate_size < 0 or args.warmup < 0:
        raise ValueError("--shared-intermediate-size and --warmup must be >= 0")
    result = run_moe_op_bench(args.num_experts, args.top_k, args.hidden_size, args.intermediate_size,
                              args.shared_intermediate_size, tokens, args.dtype, args.iters, args.warmup, args.seed)
    return print_and_save(result, format_moe_op(result), args.output_json)


def main(argv: list[str] | None = None) -> int:
    return module_main(argv, "moe_op", __doc__, add_moe_op_args, main_moe_op)


if __name__ == "__main__":
    sys.exit(main())
