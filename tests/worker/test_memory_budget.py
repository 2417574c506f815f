"""The startup memory budget (worker/memory_budget.py): weights as stored and as held, packed
copies, KV pool and runtime, each checked against a figure computed here from the checkpoint's
files and the loaded model's own tensors; logged at startup, carried in the engine's stats and
exported on /metrics as kvtide:memory_bytes{kind}."""

from __future__ import annotations

import logging
import os

import pytest
import torch
from gguf import GGUFReader
from gguf_writer import build_bpe_checkpoint, write_gguf
from safetensors.torch import load_file

from kvtide import LLM
from kvtide.engine.dp_client import merge_stats
from kvtide.engine.messages import SchedulerStats
from kvtide.server.metrics import ServerMetrics
from kvtide.worker.memory_budget import KINDS


@pytest.fixture(autouse=True)
def _own_cache(tmp_path_factory, monkeypatch, compiled_cpu_ops):
    monkeypatch.setenv("KVTIDE_CACHE", str(tmp_path_factory.getbasetemp() / "kvtide-cache"))


def unique_bytes(tensors) -> int:
    seen = {}
    for t in tensors:
        seen.setdefault(t.data_ptr(), t.nbytes)
    return sum(seen.values())


def check_budget(llm: LLM, stored: int, caplog) -> dict[str, int]:
    core = llm.engine.core
    budget = core.memory
    model = core.executor.runner.model
    assert set(budget) == set(KINDS) | {"resident"}
    assert budget["weights_stored"] == stored
    held = unique_bytes(list(model.parameters()) + list(model.buffers()))
    # buffers beyond the weights (rotary tables) are not weights: held is at most that, at least the parameters'
    assert unique_bytes(model.parameters()) <= budget["weights_held"] <= held
    assert budget["kv_pool"] == unique_bytes(a.kv_cache for a in model.attention_layers())
    copies = [c for m in model.modules() if getattr(m, "gemm_plan", None) is not None
              for c in m.gemm_plan.packed.values()]
    assert budget["packed_copies"] == unique_bytes(copies)
    on_host = budget["weights_held"] + budget["packed_copies"] + budget["kv_pool"]
    assert budget["resident"] > on_host and budget["runtime"] == budget["resident"] - on_host
    line = next(r.getMessage() for r in caplog.records if r.getMessage().startswith("memory: "))
    assert f"weights {stored / 2**20:.1f} MiB as stored, {budget['weights_held'] / 2**20:.1f} MiB as held" in line
    assert f"KV pool {budget['kv_pool'] / 2**20:.1f} MiB" in line
    assert core.get_stats().memory == budget
    return budget


def test_float_checkpoint_budget(checkpoint_factory, caplog):
    model_dir = checkpoint_factory("LlamaForCausalLM")
    caplog.set_level(logging.INFO, logger="kvtide.bootstrap")
    llm = LLM(model=model_dir, device="cpu", dtype="float32", max_model_len=256, kv_cache_memory="8MiB",
              cpu_weight_prepack="off")  # the GEMM chooser's measuring would take a minute here
    stored = sum(t.nbytes for t in load_file(os.path.join(model_dir, "model.safetensors")).values())
    budget = check_budget(llm, stored, caplog)
    assert budget["weights_held"] == stored  # float32 stored, float32 held
    assert budget["packed_copies"] == 0
    assert 0 < budget["kv_pool"] <= 8 * 2**20


def test_gguf_budget_counts_the_files_blocks(tmp_path, caplog):
    ckpt = build_bpe_checkpoint(str(tmp_path / "bpe"), intermediate_size=384)
    path = write_gguf(ckpt, str(tmp_path / "m.gguf"), "Q4_0")
    caplog.set_level(logging.INFO, logger="kvtide.bootstrap")
    llm = LLM(model=path, device="cpu", dtype="float32", max_model_len=256, kv_cache_memory="8MiB")
    stored = sum(int(t.n_bytes) for t in GGUFReader(path).tensors)
    budget = check_budget(llm, stored, caplog)
    float_bytes = sum(t.nbytes for t in load_file(os.path.join(ckpt, "model.safetensors")).values())
    assert stored < budget["weights_held"] < 0.3 * float_bytes  # held decoded, still quantized


def test_metrics_export_the_budget_summed_over_replicas():
    one = {"weights_stored": 100, "weights_held": 200, "packed_copies": 0, "kv_pool": 50, "runtime": 7,
           "resident": 257}
    two = dict(one, runtime=9, resident=259)
    metrics = ServerMetrics("tiny")
    metrics.update_from_engines([SchedulerStats(memory=one), SchedulerStats(memory=two)])
    text = metrics.render().decode()
    for kind in one:
        assert f'kvtide:memory_bytes{{kind="{kind}",model_name="tiny"}} {float(one[kind] + two[kind])}' in text
    assert merge_stats([SchedulerStats(), SchedulerStats()]).memory is None
    assert "kvtide:memory_bytes{" not in ServerMetrics("tiny").render().decode()


def test_budget_without_proc(monkeypatch, checkpoint_factory):
    from kvtide.worker import memory_budget

    monkeypatch.setattr(memory_budget, "resident_bytes", lambda: None)
    model = torch.nn.Linear(4, 4)
    budget = memory_budget.memory_budget(model, 80, 10, checkpoint_factory("LlamaForCausalLM"), "cpu")
    assert budget["runtime"] == 0 and "resident" not in budget
    assert "resident" not in memory_budget.describe(budget)


def test_packed_copies_count_each_copy_once():
    from types import SimpleNamespace

    from kvtide.worker.memory_budget import packed_copy_bytes

    model = torch.nn.Sequential(torch.nn.Linear(32, 16), torch.nn.Linear(16, 8), torch.nn.Linear(8, 8))
    panels, transposed = torch.empty(16, 32), torch.empty(32, 16)
    opaque = torch.randn(8, 16).to_mkldnn()  # no storage: counted as the layer's weight
    model[0].gemm_plan = SimpleNamespace(packed={"panels": panels, "transposed": transposed})
    model[1].gemm_plan = SimpleNamespace(packed={"mkl-packed": opaque})
    model[2].gemm_plan = SimpleNamespace(packed={"panels": panels})  # shared with layer 0: once
    assert packed_copy_bytes(model) == panels.nbytes + transposed.nbytes + model[1].weight.nbytes
