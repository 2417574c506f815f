"""Decode CUDA-graph bucketing on the CPU: bucket sizes and choice, the static buffers' padding and
reuse across buckets, and that a padded bucket computes the same hidden states for its real rows
as the unpadded batch (what a replay computes, run eagerly)."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from kvtide.worker.cuda_graph import (
    DecodeCudaGraphs,
    DecodeInputBuffers,
    capture_sizes,
    choose_bucket,
    maybe_capture_decode_graphs,
    run_model,
    to_device,
)


@pytest.mark.parametrize("max_num_seqs,sizes", [
    (1, [1]), (2, [1, 2]), (6, [1, 2, 4, 6]), (8, [1, 2, 4, 8]),
    (256, [1, 2, 4, 8, 16, 32, 64, 128, 256]), (300, [1, 2, 4, 8, 16, 32, 64, 128, 256, 300])])
def test_capture_sizes(max_num_seqs, sizes):
    assert capture_sizes(max_num_seqs) == sizes


def test_choose_bucket():
    sizes = capture_sizes(6)
    assert [choose_bucket(n, sizes) for n in range(0, 8)] == [None, 1, 2, 4, 4, 6, 6, None]
    big = capture_sizes(256)
    assert choose_bucket(33, big) == 64 and choose_bucket(64, big) == 64 and choose_bucket(257, big) is None


def _step(n: int, width: int, seed: int) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return dict(input_ids=torch.randint(3, 200, (n,), generator=gen),
                positions=torch.randint(0, 60, (n,), generator=gen),
                seq_lens=torch.randint(1, 61, (n,), generator=gen, dtype=torch.int32),
                block_tables=torch.randint(1, 30, (n, width), generator=gen, dtype=torch.int32),
                slot_mapping=torch.randint(0, 400, (n,), generator=gen))


def test_fill_pads_the_bucket_and_reuses_one_set_of_buffers():
    buffers = DecodeInputBuffers(max_batch=8, max_blocks_per_seq=6, device="cpu")
    big = _step(7, 6, seed=0)
    buffers.fill(8, **big)
    small = _step(3, 2, seed=1)
    buffers.fill(4, **small)
    assert torch.equal(buffers.input_ids[:3], small["input_ids"])
    assert torch.equal(buffers.positions[:3], small["positions"])
    assert torch.equal(buffers.seq_lens[:3], small["seq_lens"])
    assert torch.equal(buffers.slot_mapping[:3], small["slot_mapping"])
    assert torch.equal(buffers.block_tables[:3, :2], small["block_tables"])
    # padding rows of the bucket: token 0 at position 0, attending to nothing, writing nothing
    assert buffers.input_ids[3].item() == 0 and buffers.positions[3].item() == 0
    assert buffers.seq_lens[3].item() == 0 and buffers.slot_mapping[3].item() == -1
    # rows past the bucket are not touched (no graph of this bucket reads them)
    assert torch.equal(buffers.input_ids[4:7], big["input_ids"][4:7])

    md4, md8 = buffers.metadata(4, 16, 96), buffers.metadata(8, 16, 96)
    assert md4.seq_lens.data_ptr() == md8.seq_lens.data_ptr() == buffers.seq_lens.data_ptr()
    assert md4.block_tables.shape == (4, 6) and md4.slot_mapping.shape == (4,)
    assert md4.query_start_loc.tolist() == [0, 1, 2, 3, 4] == md4.query_start_loc_cpu
    assert (md4.num_reqs, md4.num_decodes, md4.num_actual_tokens, md4.max_query_len) == (4, 4, 4, 1)


def test_fill_rejects_what_no_bucket_holds():
    buffers = DecodeInputBuffers(max_batch=4, max_blocks_per_seq=2, device="cpu")
    with pytest.raises(AssertionError):
        buffers.fill(2, **_step(3, 2, seed=2))  # more requests than the bucket
    with pytest.raises(AssertionError):
        buffers.fill(4, **_step(2, 3, seed=3))  # block table wider than max_model_len allows


def test_graphs_are_off_on_cpu_with_the_torch_backend_or_when_eager(llama_dir):
    from kvtide.engine_args import EngineArgs

    config = EngineArgs(model=llama_dir, max_model_len=64).create_engine_config(llama_dir)
    assert maybe_capture_decode_graphs(torch.nn.Identity(), config, torch.device("cpu")) is None
    for change in (dict(attention_backend="torch"), dict(attention_backend="triton", enforce_eager=True)):
        cuda_config = dataclasses.replace(config, device_config=dataclasses.replace(
            config.device_config, device="cuda", **change))
        assert maybe_capture_decode_graphs(torch.nn.Identity(), cuda_config, torch.device("cuda")) is None


def test_uncaptured_graphs_fall_back_to_eager():
    graphs = DecodeCudaGraphs(torch.nn.Identity(), block_size=16, max_num_seqs=4, max_model_len=64, device="cpu")
    md = graphs.buffers.metadata(2, 16, 64)
    assert not graphs.can_run(md)  # nothing captured
    calls = []
    model = lambda ids, pos, metadata: calls.append(ids.shape) or ids  # noqa: E731
    run_model(model, graphs, torch.zeros(2), torch.zeros(2), md)
    run_model(model, None, torch.zeros(3), torch.zeros(3), md)
    assert calls == [(2,), (3,)]


def test_to_device_on_cpu():
    t = torch.arange(5)
    assert torch.equal(to_device(t, torch.device("cpu")), t)


BLOCK_SIZE, NUM_BLOCKS, MAX_MODEL_LEN = 8, 64, 64
TABLE_WIDTH = MAX_MODEL_LEN // BLOCK_SIZE


def _model_with_random_caches(llama_dir: str, device: torch.device):
    from transformers import AutoConfig

    from kvtide.attention.registry import get_attention_backend
    from kvtide.models.loader import load_model

    model = load_model(llama_dir, AutoConfig.from_pretrained(llama_dir), torch.float32, MAX_MODEL_LEN, str(device))
    backend = get_attention_backend("triton")
    gen = torch.Generator().manual_seed(0)
    for attn in model.attention_layers():
        attn.kv_cache = torch.randn(2, NUM_BLOCKS, BLOCK_SIZE, attn.num_kv_heads, attn.head_dim,
                                    generator=gen).to(device)
        attn.backend = backend
    return model, [attn.kv_cache for attn in model.attention_layers()]


def _decode_step(seq_lens: list[int], device: torch.device, seed: int):
    """input_ids, positions and metadata of one decode per request (context lengths seq_lens)."""
    from kvtide.attention.backend import AttentionMetadata

    n = len(seq_lens)
    gen = torch.Generator().manual_seed(seed)
    tables = torch.randperm(NUM_BLOCKS, generator=gen)[:n * TABLE_WIDTH].view(n, TABLE_WIDTH).to(torch.int32)
    positions = torch.tensor([s - 1 for s in seq_lens])
    slots = torch.tensor([int(tables[i, p // BLOCK_SIZE]) * BLOCK_SIZE + p % BLOCK_SIZE
                          for i, p in enumerate(positions.tolist())])
    md = AttentionMetadata(
        num_reqs=n, num_decodes=n, num_actual_tokens=n,
        query_start_loc=torch.arange(n + 1, dtype=torch.int32, device=device),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=device), block_tables=tables.to(device),
        slot_mapping=slots.to(device), max_query_len=1, max_seq_len=max(seq_lens), block_size=BLOCK_SIZE,
        query_start_loc_cpu=list(range(n + 1)), seq_lens_cpu=seq_lens)
    return torch.randint(3, 250, (n,), generator=gen).to(device), positions.to(device), md


@pytest.mark.triton
def test_padded_bucket_computes_the_unpadded_rows(llama_dir, device, close):
    """Run the model eagerly on a bucket of 8 holding 5 decodes (what a replay computes) and
    on the 5 decodes alone: same hidden states, same KV writes (padding writes none)."""
    pytest.importorskip("triton")
    model, caches = _model_with_random_caches(llama_dir, device)
    input_ids, positions, md = _decode_step([1, 9, 16, 17, 30], device, seed=1)
    before = [c.clone() for c in caches]
    with torch.inference_mode():
        expected = model(input_ids, positions, md)
        expected_caches = [c.clone() for c in caches]
        for c, b in zip(caches, before, strict=True):
            c.copy_(b)
        buffers = DecodeInputBuffers(max_batch=8, max_blocks_per_seq=MAX_MODEL_LEN // BLOCK_SIZE, device=device)
        buffers.fill(8, input_ids, positions, md.seq_lens, md.block_tables, md.slot_mapping)
        padded = model(buffers.input_ids[:8], buffers.positions[:8],
                       buffers.metadata(8, BLOCK_SIZE, MAX_MODEL_LEN))
    assert padded.shape[0] == 8
    close(padded[:5], expected, torch.float32)
    for c, e in zip(caches, expected_caches, strict=True):  # close, not equal: 8 and 5 rows round apart
        close(c, e, torch.float32)


class _EagerReplay:
    """Stands in for a captured graph on the CPU: replay() runs the model on the static buffers
    into the static output, which is what the real graph does."""

    def __init__(self, graphs: DecodeCudaGraphs, bucket: int) -> None:
        self.graphs, self.bucket = graphs, bucket

    def replay(self) -> None:
        self.graphs.outputs[self.bucket].copy_(self.graphs.model(*self.graphs._args(self.bucket)))


@pytest.mark.triton
def test_graph_replay_equals_eager(llama_dir, device, close):
    """Buckets 1, 2, 4, 6; steps of 3, 1, 6 and 5 decodes go through the shared buffers and each
    equals the eager forward pass, KV writes included. On CUDA (scripts/gpu_check.sh) the graphs
    are really captured; on the CPU an eager stand-in replays them."""
    model, caches = _model_with_random_caches(llama_dir, device)
    graphs = DecodeCudaGraphs(model, BLOCK_SIZE, max_num_seqs=6, max_model_len=MAX_MODEL_LEN, device=device)
    if device.type == "cuda":
        graphs.capture()
    else:
        hidden_size = model.config.hidden_size
        for bucket in graphs.sizes:
            graphs.graphs[bucket] = _EagerReplay(graphs, bucket)  # type: ignore[assignment]
            graphs.outputs[bucket] = torch.empty(bucket, hidden_size, device=device)
    assert sorted(graphs.graphs) == [1, 2, 4, 6]
    with torch.inference_mode():
        for seed, seq_lens in enumerate(([3, 17, 40], [1], [5, 8, 9, 16, 33, 64], [2, 2, 2, 2, 2])):
            input_ids, positions, md = _decode_step(seq_lens, device, seed=seed)
            before = [c.clone() for c in caches]
            expected = model(input_ids, positions, md).clone()
            expected_caches = [c.clone() for c in caches]
            for c, b in zip(caches, before, strict=True):
                c.copy_(b)
            assert graphs.can_run(md)
            replayed = run_model(model, graphs, input_ids, positions, md)
            assert replayed.shape == expected.shape
            close(replayed, expected, torch.float32)
            for c, e in zip(caches, expected_caches, strict=True):
                close(c, e, torch.float32)


@pytest.mark.triton
def test_draft_model_chain_steps_replay_its_graphs(llama_dir, device):
    """A draft model's single-token chain steps go through its decode graphs (here eager stand-ins
    on the CPU, real captures on CUDA); the output stays the non-speculative output."""
    from kvtide import LLM, SamplingParams

    spec = {"method": "draft_model", "model": llama_dir, "num_speculative_tokens": 3, "adaptive": False}
    kwargs = dict(device=device.type, dtype="float32", max_model_len=MAX_MODEL_LEN, kv_cache_memory="8MiB",
                  block_size=BLOCK_SIZE, max_num_seqs=4)
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    prompts = ["Hello, my name is", "The capital of France"]
    expected = [o.outputs[0].token_ids for o in LLM(llama_dir, attention_backend="torch", **kwargs).generate(prompts, params)]
    llm = LLM(llama_dir, attention_backend="triton", speculative_config=spec, **kwargs)
    worker = llm.engine.core.executor.runner.spec.proposer
    if device.type != "cuda":
        graphs = DecodeCudaGraphs(worker.draft_model, BLOCK_SIZE, max_num_seqs=4, max_model_len=MAX_MODEL_LEN,
                                  device=device)
        replays: list[int] = []
        for bucket in graphs.sizes:
            stand_in = _EagerReplay(graphs, bucket)
            graphs.graphs[bucket] = _Counted(stand_in, replays)  # type: ignore[assignment]
            graphs.outputs[bucket] = torch.empty(bucket, worker.draft_model.config.hidden_size, device=device)
        worker.draft_graphs = graphs
    assert worker.draft_graphs is not None
    got = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
    assert got == expected
    if device.type != "cuda":
        assert len(replays) > 0
    assert llm.engine.core.get_stats().spec_decoding["num_accepted_tokens"] > 0


class _Counted:
    def __init__(self, replay: _EagerReplay, calls: list[int]) -> None:
        self.inner, self.calls = replay, calls

    def replay(self) -> None:
        self.calls.append(self.inner.bucket)
        self.inner.replay()
