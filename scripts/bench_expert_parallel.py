"""One MoE layer's forward with expert parallelism over 2 gloo ranks against world size 1, on CPU.

    python scripts/bench_expert_parallel.py [--tokens 1,8,64,256] [--iters 20] [--output-json F]

The layer is `kvtide bench moe-op`'s shape (E 8, k 2, H 768, I 1024, float32, softmax top-2
renormalized, a random replicated router). Rank 0 first times the world-size-1 layer alone (rank 1
waits): on one torch thread, and on both cores (the fair baseline for 2 ranks on a 2-core machine);
then both join a 2-rank group with --enable-expert-parallel, one thread each, and time the EP layer
(4 experts each), a barrier before every forward so both ranks start together. Per token count: the median forward time (the slower rank's), and per
forward what each exchange sent from one rank (bytes, as the group coordinator counts them) and the
median seconds of the three all-to-alls (counts, dispatch, combine) and of the gather, next to the uniform-routing model 2 x T x k x H x (n - 1) / n x 4 bytes (the
group's dispatch + combine; a rank sends half of it).
"""

from __future__ import annotations

import argparse
import json
import socket
import statistics
import sys
import time

import torch
import torch.multiprocessing as mp

NUM_RANKS = 2
KINDS = ("counts", "dispatch", "combine", "all_gather")


def _build(args, seed: int = 0):
    from kvtide.layers.moe import FusedMoE

    e, h, i = args.num_experts, args.hidden_size, args.intermediate_size
    moe = FusedMoE(e, args.top_k, h, i, renormalize=True)
    moe.count_load = False
    for expert in range(e):  # per expert, as a checkpoint loads: each rank keeps its own
        g = torch.Generator().manual_seed(seed + expert)
        w13 = torch.randn(2 * i, h, generator=g) * h ** -0.5
        moe.w13_weight.weight_loader(moe.w13_weight, w13[:i], (expert, "w1"))
        moe.w13_weight.weight_loader(moe.w13_weight, w13[i:], (expert, "w3"))
        moe.w2_weight.weight_loader(moe.w2_weight, torch.randn(h, i, generator=g) * i ** -0.5, (expert, "w2"))
    return moe


def _inputs(args, num_tokens: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(10_000 + num_tokens)
    router = torch.randn(args.num_experts, args.hidden_size, generator=g) * args.hidden_size ** -0.5
    x = torch.randn(num_tokens, args.hidden_size, generator=g)
    return x, x @ router.t()


def _time_forwards(moe, x, logits, iters: int, warmup: int, barrier) -> tuple[list[float], list[dict]]:
    """Per timed forward: its seconds, and the seconds of each collective inside it."""
    from kvtide.distributed import COMM_STATS

    times, comm = [], []
    for step in range(warmup + iters):
        barrier()
        COMM_STATS.reset()
        start = time.perf_counter()
        moe(x, logits)
        if step >= warmup:
            times.append(time.perf_counter() - start)
            comm.append(dict(COMM_STATS.seconds))
    return times, comm


def _rank_main(rank: int, port: int, args, results) -> None:
    from kvtide.distributed import ParallelLayout, get_ep_group, init_distributed

    torch.set_num_threads(1)
    tokens = [int(t) for t in args.tokens.split(",")]
    report: dict = {"rank": rank, "ep": {}}
    with torch.inference_mode():
        if rank == 0:  # world size 1 alone on the machine (rank 1 waits in the rendezvous)
            dense = _build(args)
            for threads, key in ((1, "ws1"), (NUM_RANKS, "ws1_all_cores")):
                torch.set_num_threads(threads)
                report[key] = {t: _time_forwards(dense, *_inputs(args, t), args.iters, args.warmup,
                                                 lambda: None)[0] for t in tokens}
            torch.set_num_threads(1)
            del dense
        init_distributed(ParallelLayout(tensor_parallel_size=NUM_RANKS, rank=rank, enable_expert_parallel=True),
                         init_method=f"tcp://127.0.0.1:{port}", backend="gloo")
        group = get_ep_group()
        moe = _build(args)
        report["resident_bytes"] = moe.w13_weight.nbytes + moe.w2_weight.nbytes
        for t in tokens:
            x, logits = _inputs(args, t)
            moe(x, logits)
            before = dict(moe.dispatcher.bytes)
            times, comm = _time_forwards(moe, x, logits, args.iters, args.warmup, group.barrier)
            forwards = args.iters + args.warmup
            report["ep"][t] = {
                "times": times,
                "bytes": {k: (moe.dispatcher.bytes[k] - before.get(k, 0)) / forwards for k in KINDS},
                "all_to_all_s": statistics.median(c.get("tp.all_to_all", 0.0) for c in comm),
                "all_gather_s": statistics.median(c.get("tp.all_gather", 0.0) for c in comm),
            }
    results.put(report)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--num-experts", type=int, default=8)
    parser.add_argument("--top-k", type=int, default=2)
    parser.add_argument("--hidden-size", type=int, default=768)
    parser.add_argument("--intermediate-size", type=int, default=1024)
    parser.add_argument("--tokens", default="1,8,64,256")
    parser.add_argument("--iters", type=int, default=20)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--timeout", type=float, default=600.0, help="seconds before the ranks are killed")
    parser.add_argument("--output-json", default=None)
    args = parser.parse_args(argv)

    from kvtide.layers.moe import expected_all_to_all_bytes
    from kvtide.machine import describe_machine, machine_info

    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    port = _free_port()
    procs = [ctx.Process(target=_rank_main, args=(rank, port, args, results), daemon=True) for rank in range(NUM_RANKS)]
    for p in procs:
        p.start()
    try:
        reports = sorted((results.get(timeout=args.timeout) for _ in procs), key=lambda r: r["rank"])
    finally:
        for p in procs:
            p.join(timeout=10)
            if p.is_alive():
                p.kill()
    info = machine_info() | {"torch_threads": 1}
    rows = []
    for t in [int(t) for t in args.tokens.split(",")]:
        ws1 = statistics.median(reports[0]["ws1"][t])
        ws1_all = statistics.median(reports[0]["ws1_all_cores"][t])
        # a forward ends when the slower rank's does: per iteration, the max over ranks
        ep = statistics.median(max(ts) for ts in zip(*(r["ep"][t]["times"] for r in reports), strict=True))
        rank_bytes = {k: statistics.mean(r["ep"][t]["bytes"][k] for r in reports) for k in KINDS}
        model = expected_all_to_all_bytes(t, args.top_k, args.hidden_size, NUM_RANKS, 4) / NUM_RANKS
        rows.append({"tokens": t, "ws1_ms": ws1 * 1e3, "ws1_all_cores_ms": ws1_all * 1e3, "ep_ms": ep * 1e3,
                     "bytes_per_rank": rank_bytes,
                     "model_dispatch_combine_bytes_per_rank": model,
                     "all_to_all_ms": 1e3 * statistics.mean(r["ep"][t]["all_to_all_s"] for r in reports),
                     "all_gather_ms": 1e3 * statistics.mean(r["ep"][t]["all_gather_s"] for r in reports)})
    result = {"num_experts": args.num_experts, "top_k": args.top_k, "hidden_size": args.hidden_size,
              "intermediate_size": args.intermediate_size, "dtype": "float32", "ep_size": NUM_RANKS,
              "iters": args.iters, "resident_expert_bytes_per_rank": reports[0]["resident_bytes"],
              "results": rows, "machine": info}
    print(describe_machine(info))
    print(f"MoE E={args.num_experts} k={args.top_k} H={args.hidden_size} I={args.intermediate_size} float32, "
          f"EP {NUM_RANKS} ranks (gloo, 1 thread each) vs world size 1 (1 thread), median of {args.iters}; "
          f"expert weights per rank {reports[0]['resident_bytes'] / 2**20:.1f} MiB")
    print(f"{'tokens':>6} {'ws1 ms':>8} {'ws1 2thr':>8} {'EP2 ms':>8} {'a2a KiB/rank':>13} {'model KiB':>10} "
          f"{'a2a ms':>7} {'gather KiB':>10} {'gather ms':>9}")
    for r in rows:
        b = r["bytes_per_rank"]
        print(f"{r['tokens']:>6} {r['ws1_ms']:>8.3f} {r['ws1_all_cores_ms']:>8.3f} {r['ep_ms']:>8.3f} "
              f"{(b['dispatch'] + b['combine']) / 1024:>13.1f} {r['model_dispatch_combine_bytes_per_rank'] / 1024:>10.1f} "
              f"{r['all_to_all_ms']:>7.3f} {b['all_gather'] / 1024:>10.1f} {r['all_gather_ms']:>9.3f}")
    if args.output_json:
        with open(args.output_json, "w") as f:
            json.dump(result, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
