"""Expert parallelism over two gloo ranks on 127.0.0.1 against the world-size-1 layer.

Two spawned processes (one torch thread each) join a 2-rank group with --enable-expert-parallel. Each
first builds the world-size-1 references, then the expert-parallel layers from the same seeded
weights, loaded expert by expert through `weight_loader`, and runs both on the same inputs: routing
configurations of Mixtral, DeepSeek-V2 (grouped softmax) and V3 (grouped sigmoid + correction bias),
Qwen in bf16, a capacity cap, a replicated-expert placement, an uneven one and one leaving rank 0
without experts, each at T = 0, 1 (rank 1's share empty), 2, 3, 17 and 64 tokens. The workers report
numbers; the assertions run here: outputs within float32 rounding of world size 1 (and bitwise equal
where every expert's rows are the matrix world size 1 multiplies), global load counters equal, the
all-to-all bytes
equal to the count worked out here from the routing ids, each rank's resident expert bytes, and the
Mixtral / Qwen2-MoE / DeepSeek-V3 checkpoints loaded by `load_model` inside the group (its sparse
blocks against world size 1's; the shared experts are tensor-parallel there). The processes are killed
after TIMEOUT_S whatever happens.
"""

from __future__ import annotations

import math
import queue
import socket
import time
import traceback

import pytest
import torch
import torch.multiprocessing as mp

from kvtide.layers.moe import ExpertPlacement, all_to_all_bytes, expected_all_to_all_bytes

NUM_RANKS = 2
TIMEOUT_S = 120
TOKENS = (0, 1, 2, 3, 17, 64)
RELATIVE_TOLERANCE = 1e-5

LAYER_CASES: dict[str, dict] = {
    "mixtral": dict(E=8, k=2, H=64, I=96, kwargs=dict(renormalize=True)),
    "deepseek-v2": dict(E=8, k=2, H=64, I=48, kwargs=dict(num_expert_group=4, topk_group=2, group_score="max",
                                                        routed_scaling_factor=1.5), router_fp32=True),
    "deepseek-v3": dict(E=16, k=4, H=64, I=32, kwargs=dict(
        scoring_func="sigmoid", renormalize=True, num_expert_group=4, topk_group=2, group_score="top2sum",
        use_score_correction_bias=True, routed_scaling_factor=2.5), router_fp32=True),
    "qwen-bf16": dict(E=8, k=2, H=64, I=96, kwargs=dict(weights_in_logits_dtype=True), dtype="bfloat16"),
    "capacity": dict(E=8, k=2, H=64, I=96, kwargs=dict(renormalize=True, capacity_factor=0.75)),
    # experts 0 and 5 hot: on both ranks (each token's assignment goes to replica t % 2)
    "replicated": dict(E=8, k=2, H=64, I=96, kwargs=dict(renormalize=True),
                       replicas=[[0, 1], [0], [0], [0], [1], [1, 0], [1], [1]]),
    "uneven": dict(E=8, k=2, H=64, I=96, kwargs=dict(renormalize=True),
                   replicas=[[1], [1], [0], [1], [0], [1], [1], [1]]),
    "one-rank-holds-all": dict(E=4, k=2, H=64, I=96, kwargs=dict(renormalize=True), replicas=[[1]] * 4),
}
MODEL_CASES = {
    "mixtral": ("MixtralForCausalLM", dict(num_local_experts=4, num_experts_per_tok=2, intermediate_size=96,
                                           num_hidden_layers=2)),
    "qwen2-moe": ("Qwen2MoeForCausalLM", dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=64,
                                              shared_expert_intermediate_size=96, norm_topk_prob=False,
                                              num_hidden_layers=2)),
    "deepseek-v3": ("DeepseekV3ForCausalLM", dict(
        kv_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16, num_key_value_heads=4,
        q_lora_rank=48, n_routed_experts=8, num_experts_per_tok=2, moe_intermediate_size=48, n_shared_experts=1,
        first_k_dense_replace=1, n_group=4, topk_group=2, norm_topk_prob=True, routed_scaling_factor=2.5,
        num_hidden_layers=3)),
}


def _replicas(case: dict) -> list[list[int]]:
    per_rank = case["E"] // NUM_RANKS
    return case.get("replicas") or [[e // per_rank] for e in range(case["E"])]


def _dtype(case: dict) -> torch.dtype:
    return getattr(torch, case.get("dtype", "float32"))


# ---- what each rank runs ------------------------------------------------------------------------
def _case_weights(name: str, case: dict) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(sum(map(ord, name)))
    e, h, i = case["E"], case["H"], case["I"]
    return {"w13": torch.randn(e, 2 * i, h, generator=g) * h ** -0.5,
            "w2": torch.randn(e, h, i, generator=g) * i ** -0.5,
            "router": torch.randn(e, h, generator=g) * h ** -0.5,
            "bias": (torch.rand(e, generator=g) - 0.5) * 0.4}


def _build_layer(name: str, case: dict, placement: ExpertPlacement | None = None, whole: bool = False):
    from kvtide.layers.moe import FusedMoE

    weights, dtype, i = _case_weights(name, case), _dtype(case), case["I"]
    moe = FusedMoE(case["E"], case["k"], case["H"], i, placement=placement, **case["kwargs"]).to(dtype)
    if whole:  # the stacked tensors at once (shard_id None)
        moe.w13_weight.weight_loader(moe.w13_weight, weights["w13"].to(dtype))
        moe.w2_weight.weight_loader(moe.w2_weight, weights["w2"].to(dtype))
    else:
        for e in range(case["E"]):  # every rank is handed every expert's tensors
            moe.w13_weight.weight_loader(moe.w13_weight, weights["w13"][e, :i].to(dtype), (e, "w1"))
            moe.w13_weight.weight_loader(moe.w13_weight, weights["w13"][e, i:].to(dtype), (e, "w3"))
            moe.w2_weight.weight_loader(moe.w2_weight, weights["w2"][e].to(dtype), (e, "w2"))
    if moe.e_score_correction_bias is not None:
        moe.e_score_correction_bias.weight_loader(moe.e_score_correction_bias, weights["bias"])
    return moe


def _inputs(name: str, case: dict, num_tokens: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 * num_tokens + sum(map(ord, name)))
    x = torch.randn(num_tokens, case["H"], generator=g).to(_dtype(case))
    router = _case_weights(name, case)["router"]
    logits = x.float() @ router.t() if case.get("router_fp32") else x @ router.to(x.dtype).t()
    return x, logits


def _resident_bytes(moe) -> int:
    return moe.w13_weight.nbytes + moe.w2_weight.nbytes


class _Unreadable:
    """A lazily read checkpoint tensor that must not be read."""

    def __init__(self, shape: tuple[int, ...]) -> None:
        self.shape = torch.Size(shape)

    def narrow(self, *args):
        raise AssertionError("another rank's expert was read")

    materialize = narrow


def _layer_checks(rank: int, refs: dict) -> dict:
    from kvtide.distributed import COMM_STATS
    from kvtide.layers.moe import FusedMoE

    report: dict = {}
    for name, case in LAYER_CASES.items():
        placement = ExpertPlacement.from_replicas(case["replicas"], NUM_RANKS) if "replicas" in case else None
        moe, ref = _build_layer(name, case, placement), refs[name]
        steps = []
        for num_tokens in TOKENS:
            x, logits = _inputs(name, case, num_tokens)
            ref.count_load = False
            _, ids = ref.route(logits)
            ref.count_load = True
            before, comm_before = dict(moe.dispatcher.bytes), COMM_STATS.snapshot()
            out, expected = moe(x, logits), ref(x, logits)
            comm = COMM_STATS.snapshot()
            sent = {kind: moe.dispatcher.bytes[kind] - before.get(kind, 0)
                    for kind in ("counts", "dispatch", "combine", "all_gather")}
            for kind in ("tp.all_to_all", "tp.all_gather"):
                sent[kind] = comm.get(kind, {}).get("bytes", 0) - comm_before.get(kind, {}).get("bytes", 0)
            steps.append(dict(tokens=num_tokens, ids=ids.tolist(), sent=sent, shape=tuple(out.shape),
                              dtype=str(out.dtype), exact=torch.equal(out, expected),
                              max_diff=(out.double() - expected.double()).abs().max().item()
                              if num_tokens else 0.0,
                              scale=expected.double().abs().max().item() if num_tokens else 0.0))
        load, ref_load = moe.take_expert_load(), ref.take_expert_load()
        report[name] = dict(steps=steps, local_experts=moe.local_experts, resident=_resident_bytes(moe),
                            ref_resident=_resident_bytes(ref), load=[t.tolist() for t in load],
                            ref_load=[t.tolist() for t in ref_load], w13_shape=tuple(moe.w13_weight.shape),
                            weights_equal=all(torch.equal(moe.w13_weight[s], ref.w13_weight[e])
                                              and torch.equal(moe.w2_weight[s], ref.w2_weight[e])
                                              for s, e in enumerate(moe.local_experts)))
    whole = _build_layer("mixtral", LAYER_CASES["mixtral"], whole=True)
    plain = _build_layer("mixtral", LAYER_CASES["mixtral"])
    report["whole_load_equal"] = (torch.equal(whole.w13_weight, plain.w13_weight)
                                  and torch.equal(whole.w2_weight, plain.w2_weight))
    other = next(e for e in range(plain.num_experts) if e not in plain.local_experts)
    plain.w13_weight.weight_loader(plain.w13_weight, _Unreadable((96, 64)), (other, "w1"))  # must not read it
    try:
        FusedMoE(7, 2, 16, 16)
        report["indivisible_error"] = None
    except ValueError as e:
        report["indivisible_error"] = str(e)
    return report


def _model_checks(rank: int, checkpoints: dict[str, str], ref_models: dict) -> dict:
    from kvtide.layers.moe import FusedMoE
    from kvtide.models.sparse_moe import SparseMoeBlock

    report = {}
    for name, model_dir in checkpoints.items():
        model, ref = _load(model_dir), ref_models[name]  # load_model raises if a required shard is missing
        blocks = [(i, layer.mlp, ref.layers[i].mlp) for i, layer in enumerate(model.layers)
                  if isinstance(layer.mlp, SparseMoeBlock)]
        layers = []
        for i, block, ref_block in blocks:
            experts: FusedMoE = block.experts
            x = torch.randn(9, model.config.hidden_size, generator=torch.Generator().manual_seed(i))
            with torch.inference_mode():
                out, expected = block(x), ref_block(x)
            param = f"layers.{i}.mlp.experts.w13_weight"
            layers.append(dict(
                local_experts=experts.local_experts, num_experts=experts.num_experts,
                w13_shape=tuple(experts.w13_weight.shape),
                ref_w13_shape=tuple(ref_block.experts.w13_weight.shape),
                weights_equal=all(torch.equal(experts.w13_weight[s], ref_block.experts.w13_weight[e])
                                  and torch.equal(experts.w2_weight[s], ref_block.experts.w2_weight[e])
                                  for s, e in enumerate(experts.local_experts)),
                required=sorted(model.required_shards(param)),
                max_diff=(out - expected).abs().max().item(), scale=expected.abs().max().item()))
        report[name] = {"layers": layers, "cuda_graph_safe": getattr(model, "cuda_graph_safe", True)}
    return report


def _load(model_dir: str):
    from transformers import AutoConfig

    from kvtide.models.loader import load_model

    return load_model(model_dir, AutoConfig.from_pretrained(model_dir), torch.float32, max_model_len=64)


def _same_product_on_every_rank(stacked: torch.Tensor, rows: int) -> bool:
    """expert_linear's choice of product by row bucket instead of the machine's verdict (timed, or
    read from the disk cache): a rank's outputs are compared with another process's world-size-1
    layer, and both products must run. Decode buckets take (w @ x.T).T, larger ones F.linear; nothing
    is written to the cache."""
    return rows <= 4


def _rank_main(rank: int, port: int, results, checkpoints: dict[str, str]) -> None:
    from kvtide.distributed import ParallelLayout, destroy_distributed, init_distributed
    from kvtide.layers.moe import fused_moe

    try:
        torch.set_num_threads(1)
        fused_moe._weight_major_wins = _same_product_on_every_rank
        refs = {name: _build_layer(name, case) for name, case in LAYER_CASES.items()}  # world size 1
        ref_models = {name: _load(path) for name, path in checkpoints.items()}
        init_distributed(ParallelLayout(tensor_parallel_size=NUM_RANKS, rank=rank, enable_expert_parallel=True),
                         init_method=f"tcp://127.0.0.1:{port}", backend="gloo", timeout_s=TIMEOUT_S)
        with torch.inference_mode():
            report = {"layers": _layer_checks(rank, refs)}
        report["models"] = _model_checks(rank, checkpoints, ref_models)
        results.put((rank, True, report))
    except BaseException:
        results.put((rank, False, traceback.format_exc()))
    finally:
        destroy_distributed()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_ranks(checkpoints: dict[str, str]) -> list[dict]:
    """Both ranks' reports; a rank that fails, dies or outlives TIMEOUT_S fails the test, and no
    process outlives this call."""
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    port = _free_port()
    procs = [ctx.Process(target=_rank_main, args=(rank, port, results, checkpoints), daemon=True)
             for rank in range(NUM_RANKS)]
    reports: dict[int, dict] = {}
    deadline = time.monotonic() + TIMEOUT_S
    try:
        for p in procs:
            p.start()
        while len(reports) < NUM_RANKS:
            if time.monotonic() > deadline:
                pytest.fail(f"expert-parallel ranks did not finish within {TIMEOUT_S} s")
            try:
                rank, ok, payload = results.get(timeout=1.0)
            except queue.Empty:
                dead = [p.exitcode for p in procs if p.exitcode not in (None, 0)]
                if dead:
                    pytest.fail(f"a rank died without a report (exit codes {dead})")
                continue
            if not ok:
                pytest.fail(f"rank {rank} failed:\n{payload}")
            reports[rank] = payload
    finally:  # after a failure the other rank may wait in a collective forever: no grace then
        grace = 10.0 if len(reports) == NUM_RANKS else 0.0
        for p in procs:
            p.join(timeout=grace)
            if p.is_alive():
                p.kill()
                p.join()
    return [reports[r] for r in range(NUM_RANKS)]


@pytest.fixture(scope="module")
def reports(checkpoint_factory) -> list[dict]:
    checkpoints = {name: checkpoint_factory(arch, **config) for name, (arch, config) in MODEL_CASES.items()}
    return run_ranks(checkpoints)


# ---- the layer against world size 1 --------------------------------------------------------------
@pytest.mark.parametrize("name", list(LAYER_CASES))
def test_outputs_equal_world_size_one(reports, name):
    """Without replicas an expert's rows arrive in global token order, the same matrix world size 1
    multiplies (with the same product on both ranks, rows 256-byte aligned), and combine adds a
    token's choices in world size 1's order: bitwise equal. A replicated expert splits its rows
    over two products."""
    case = LAYER_CASES[name]
    exact = 0
    for rank, report in enumerate(reports):
        for step in report["layers"][name]["steps"]:
            assert step["shape"] == (step["tokens"], case["H"]) and step["dtype"] == str(_dtype(case))
            assert step["max_diff"] <= RELATIVE_TOLERANCE * step["scale"], \
                (rank, step["tokens"], step["max_diff"])
            assert step["exact"] or _has_replicas(case), (rank, step["tokens"], step["max_diff"])
            exact += step["exact"]
    print(f"{name}: {exact} of {NUM_RANKS * len(TOKENS)} outputs bitwise equal to world size 1")


def _has_replicas(case: dict) -> bool:
    return any(len(r) > 1 for r in _replicas(case))


@pytest.mark.parametrize("name", list(LAYER_CASES))
def test_routing_and_load_counters_are_global(reports, name):
    first = reports[0]["layers"][name]
    for report in reports:
        layer = report["layers"][name]
        assert [s["ids"] for s in layer["steps"]] == [s["ids"] for s in first["steps"]]
        assert layer["load"] == layer["ref_load"]  # (E,) expert_tokens and dropped_tokens, global
        assert len(layer["load"][0]) == LAYER_CASES[name]["E"]
    if name == "capacity":
        assert sum(first["load"][1]) > 0  # the cap dropped assignments, the same ones on each rank


@pytest.mark.parametrize("name", list(LAYER_CASES))
def test_each_rank_holds_its_experts(reports, name):
    case = LAYER_CASES[name]
    replicas = _replicas(case)
    for rank, report in enumerate(reports):
        layer = report["layers"][name]
        local = [e for e in range(case["E"]) if rank in replicas[e]]
        assert layer["local_experts"] == local
        assert layer["w13_shape"] == (len(local), 2 * case["I"], case["H"])
        assert layer["weights_equal"]
        assert layer["resident"] * case["E"] == layer["ref_resident"] * len(local)
        if "replicas" not in case:
            assert 2 * layer["resident"] == layer["ref_resident"]


def _share_owner(token: int, num_tokens: int) -> int:
    return 0 if token < (num_tokens + 1) // 2 else 1  # rank 0 takes the odd row


@pytest.mark.parametrize("name", list(LAYER_CASES))
def test_all_to_all_bytes_equal_the_routing_count(reports, name):
    case = LAYER_CASES[name]
    replicas, row_bytes = _replicas(case), case["H"] * _dtype(case).itemsize
    num_local = [sum(rank in r for r in replicas) for rank in range(NUM_RANKS)]
    placement = ExpertPlacement.from_replicas(replicas, NUM_RANKS)
    for step_index, num_tokens in enumerate(TOKENS):
        ids = reports[0]["layers"][name]["steps"][step_index]["ids"]
        sent, received = [0] * NUM_RANKS, [0] * NUM_RANKS
        for t, row in enumerate(ids):
            source = _share_owner(t, num_tokens)
            for e in row:
                if e == case["E"]:  # dropped by the capacity cap
                    continue
                dest = replicas[e][t % len(replicas[e])]
                if dest != source:
                    sent[source] += 1
                    received[dest] += 1
        for rank, report in enumerate(reports):
            counted = report["layers"][name]["steps"][step_index]["sent"]
            assert counted["dispatch"] == sent[rank] * row_bytes
            assert counted["combine"] == received[rank] * row_bytes
            assert counted["counts"] == (8 * num_local[1 - rank] if num_tokens else 0)
            assert counted["tp.all_to_all"] == counted["dispatch"] + counted["combine"] + counted["counts"]
            assert counted["all_gather"] == counted["tp.all_gather"] == math.ceil(num_tokens / 2) * row_bytes
        total = sum(r["layers"][name]["steps"][step_index]["sent"]["dispatch"]
                    + r["layers"][name]["steps"][step_index]["sent"]["combine"] for r in reports)
        assert total == 2 * sum(sent) * row_bytes
        assert total == all_to_all_bytes(torch.tensor(ids, dtype=torch.int64).view(num_tokens, case["k"]),
                                          placement, case["H"], _dtype(case).itemsize)
        if num_tokens == TOKENS[-1]:
            model = expected_all_to_all_bytes(num_tokens, case["k"], case["H"], NUM_RANKS,
                                              _dtype(case).itemsize)
            print(f"{name}: T={num_tokens} dispatch + combine {total} B counted, "
                  f"uniform-routing model {model:.0f} B")


def test_whole_stacked_tensor_loads_the_local_experts(reports):
    assert all(r["layers"]["whole_load_equal"] for r in reports)


def test_experts_not_divisible_by_the_group_are_refused(reports):
    for report in reports:
        message = report["layers"]["indivisible_error"]
        assert message is not None and "7" in message and "2" in message
    with pytest.raises(ValueError, match="num_experts 6 is not divisible by the expert-parallel size 4"):
        ExpertPlacement.contiguous(6, 4)


# ---- models built inside the group --------------------------------------------------------------
@pytest.mark.parametrize("name", list(MODEL_CASES))
def test_moe_models_load_and_match_inside_the_group(reports, name):
    for rank, report in enumerate(reports):
        layers = report["models"][name]["layers"]
        assert layers
        assert not report["models"][name]["cuda_graph_safe"]  # dispatch syncs with the host
        for layer in layers:
            num_experts = layer["num_experts"]
            local = list(range(rank * num_experts // 2, (rank + 1) * num_experts // 2))
            assert layer["local_experts"] == local
            assert layer["w13_shape"] == (len(local), *layer["ref_w13_shape"][1:])
            assert layer["weights_equal"]
            assert layer["required"] == sorted((e, w) for e in local for w in ("w1", "w3"))
            assert layer["max_diff"] <= RELATIVE_TOLERANCE * layer["scale"], (rank, layer["max_diff"])


# ---- the placement table, in this process -------------------------------------------------------
def test_placement_tables():
    p = ExpertPlacement.contiguous(8, 2)
    assert [p.owners(e) for e in range(8)] == [[0]] * 4 + [[1]] * 4
    assert p.local_experts(1) == [4, 5, 6, 7] and p.num_local_experts == [4, 4]
    assert p.expert_map(1).tolist() == [-1, -1, -1, -1, 0, 1, 2, 3]
    assert p == ExpertPlacement.from_owners([0, 0, 0, 0, 1, 1, 1, 1], 2)
    q = ExpertPlacement.from_replicas([[1, 0], [0], [1]], 2)
    assert q.local_experts(0) == [0, 1] and q.local_experts(1) == [0, 2] and q.slot_offset == [0, 2]
    ids, tokens = torch.tensor([[0, 3], [0, 2], [1, 0]]), torch.tensor([0, 1, 2])  # 3: "no expert"
    keys = q.destinations(ids, tokens)
    assert keys.tolist() == [[2, 4], [0, 3], [1, 2]]  # expert 0: replica t % 2 (rank 1 first)
    assert q.rank_of_key(keys).tolist() == [[1, 2], [0, 1], [0, 1]]
    for bad, match in [([[0], []], "no owner"), ([[0, 0]], "twice"), ([[2]], "outside the group")]:
        with pytest.raises(ValueError, match=match):
            ExpertPlacement.from_replicas(bad, 2)


def test_byte_model():
    p = ExpertPlacement.contiguous(4, 2)
    # T 4: rank 0's share tokens 0-1, rank 1's 2-3; experts 0-1 on rank 0, 2-3 on rank 1; id 4 dropped.
    # Remote: token 0's expert 2, token 1's 3, token 3's 1 and 0 (token 2's 2 is local): 4 rows, each way.
    ids = torch.tensor([[0, 2], [3, 1], [2, 4], [1, 0]])
    assert all_to_all_bytes(ids, p, hidden_size=10, dtype_bytes=4) == 2 * 4 * 10 * 4
    assert expected_all_to_all_bytes(100, 2, 64, 2, 4) == 2 * 100 * 2 * 64 * 0.5 * 4
    assert expected_all_to_all_bytes(100, 1, 64, 8, 2) == 2 * 100 * 64 * 7 / 8 * 2
    assert expected_all_to_all_bytes(100, 2, 64, 1, 4) == 0
