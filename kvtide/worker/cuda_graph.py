"""CUDA graphs for decode steps: one captured forward pass per batch-size bucket.

A decode step launches a few hundred small kernels whose launch cost exceeds their run time at
small batches. Capturing the model's forward pass once per bucket and replaying it removes that
cost. A graph replays fixed addresses and fixed shapes, so:

  - buckets: 1, 2, 4, 8, ... up to max_num_seqs (the last bucket is max_num_seqs itself); a step
    with n decodes runs the smallest bucket >= n;
  - inputs live in static buffers, one set sized for the largest bucket, whose leading rows every
    graph reads; each step copies its inputs in and pads the rest of its bucket:

        row:           0 .. n-1              n .. bucket-1            bucket .. max
        input_ids      this step's tokens    0                        (not read)
        positions      their positions       0
        seq_lens       context lengths       0   (attend to nothing)
        slot_mapping   cache slots           -1  (write nothing)
        block_tables   their block ids       (not read: seq_len 0)
        query_start_loc  0, 1, 2, ..., bucket: one token per request, constant

  - only the Triton attention backend is captured: it reads device tensors and host ints fixed per
    bucket (num_reqs = bucket, max_query_len = 1); the torch backend slices by host lists.

Sampling stays outside the graph: the runner takes the hidden states of the first n rows.
The bucketing and buffer logic runs on any device (tests/kernels/test_cuda_graph.py, CPU);
capture and replay need CUDA.
"""

from __future__ import annotations

import bisect
import logging
import time
from collections.abc import Sequence

import torch
from torch import nn

from kvtide.attention.backend import AttentionMetadata
from kvtide.config import EngineConfig

logger = logging.getLogger(__name__)


def capture_sizes(max_num_seqs: int) -> list[int]:
    """Bucket sizes: powers of two below max_num_seqs, then max_num_seqs. 6 -> [1, 2, 4, 6]."""
    assert max_num_seqs >= 1, max_num_seqs
    sizes = []
    size = 1
    while size < max_num_seqs:
        sizes.append(size)
        size *= 2
    sizes.append(max_num_seqs)
    return sizes


def choose_bucket(num_reqs: int, sizes: Sequence[int]) -> int | None:
    """The smallest bucket holding num_reqs requests; None if none does (run eagerly)."""
    i = bisect.bisect_left(sizes, num_reqs)
    return sizes[i] if i < len(sizes) and num_reqs >= 1 else None


class DecodeInputBuffers:
    """The static tensors every captured decode graph reads (see the module docstring)."""

    def __init__(self, max_batch: int, max_blocks_per_seq: int, device: torch.device | str) -> None:
        self.max_batch = max_batch
        self.input_ids = torch.zeros(max_batch, dtype=torch.int64, device=device)
        self.positions = torch.zeros(max_batch, dtype=torch.int64, device=device)
        self.seq_lens = torch.zeros(max_batch, dtype=torch.int32, device=device)
        self.slot_mapping = torch.full((max_batch,), -1, dtype=torch.int64, device=device)
        self.block_tables = torch.zeros(max_batch, max_blocks_per_seq, dtype=torch.int32, device=device)
        self.query_start_loc = torch.arange(max_batch + 1, dtype=torch.int32, device=device)

    def fill(self, bucket: int, input_ids: torch.Tensor, positions: torch.Tensor, seq_lens: torch.Tensor,
             block_tables: torch.Tensor, slot_mapping: torch.Tensor) -> None:
        """Copy one decode step (n requests, one token each) into rows 0..n-1, pad n..bucket-1.

        Block-table columns past the step's width keep stale ids; they are never read, since the
        kernel reads only blocks below seq_len."""
        n = input_ids.shape[0]
        width = block_tables.shape[1]
        assert 1 <= n <= bucket <= self.max_batch, (n, bucket, self.max_batch)
        assert width <= self.block_tables.shape[1], (width, self.block_tables.shape)
        self.input_ids[:n].copy_(input_ids, non_blocking=True)
        self.positions[:n].copy_(positions, non_blocking=True)
        self.seq_lens[:n].copy_(seq_lens, non_blocking=True)
        self.slot_mapping[:n].copy_(slot_mapping, non_blocking=True)
        self.block_tables[:n, :width].copy_(block_tables, non_blocking=True)
        if n < bucket:
            self.input_ids[n:bucket].zero_()
            self.positions[n:bucket].zero_()
            self.seq_lens[n:bucket].zero_()
            self.slot_mapping[n:bucket].fill_(-1)

    def metadata(self, bucket: int, block_size: int, max_seq_len: int) -> AttentionMetadata:
        """Metadata over the first `bucket` rows. Its host lists describe the bucket's shape only
        (contexts vary per replay); backends inside a graph must not read seq_lens_cpu."""
        return AttentionMetadata(
            num_reqs=bucket, num_decodes=bucket, num_actual_tokens=bucket,
            query_start_loc=self.query_start_loc[:bucket + 1], seq_lens=self.seq_lens[:bucket],
            block_tables=self.block_tables[:bucket], slot_mapping=self.slot_mapping[:bucket],
            max_query_len=1, max_seq_len=max_seq_len, block_size=block_size,
            query_start_loc_cpu=list(range(bucket + 1)), seq_lens_cpu=[])


class DecodeCudaGraphs:
    """Captured decode forward passes, one per bucket, sharing one memory pool and one set of
    input buffers. `run` replays the right one; the output rows stay valid until the next run."""

    def __init__(self, model: nn.Module, block_size: int, max_num_seqs: int, max_model_len: int,
                 device: torch.device | str) -> None:
        self.model = model
        self.block_size = block_size
        self.max_model_len = max_model_len
        self.sizes = capture_sizes(max_num_seqs)
        self.buffers = DecodeInputBuffers(self.sizes[-1], -(-max_model_len // block_size), device)
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.outputs: dict[int, torch.Tensor] = {}
        """bucket -> the graph's static hidden-state output (bucket, hidden_size)"""

    @torch.inference_mode()
    def capture(self) -> None:
        """Largest bucket first, so the smaller graphs fit in the memory the largest reserved. The
        padding state of the buffers (seq_len 0, slot -1) makes the captures write no KV."""
        pool = None
        for bucket in reversed(self.sizes):
            args = self._args(bucket)
            self.model(*args)  # warm up: Triton compiles this shape outside the capture
            torch.cuda.synchronize()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                self.outputs[bucket] = self.model(*args)
            pool = graph.pool()
            self.graphs[bucket] = graph
        torch.cuda.synchronize()

    def _args(self, bucket: int) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata]:
        b = self.buffers
        return (b.input_ids[:bucket], b.positions[:bucket],
                b.metadata(bucket, self.block_size, self.max_model_len))

    def can_run(self, metadata: AttentionMetadata) -> bool:
        """Decode-only steps that fit a captured bucket."""
        return (metadata.num_decodes == metadata.num_reqs == metadata.num_actual_tokens
                and choose_bucket(metadata.num_reqs, self.sizes) in self.graphs
                and metadata.block_tables.shape[1] <= self.buffers.block_tables.shape[1])

    def run(self, input_ids: torch.Tensor, positions: torch.Tensor, metadata: AttentionMetadata) -> torch.Tensor:
        """input_ids, positions (n,) of n decodes -> hidden states (n, hidden_size)."""
        bucket = choose_bucket(metadata.num_reqs, self.sizes)
        assert bucket is not None
        self.buffers.fill(bucket, input_ids, positions, metadata.seq_lens, metadata.block_tables,
                          metadata.slot_mapping)
        self.graphs[bucket].replay()
        return self.outputs[bucket][:metadata.num_reqs]


# ---- the model runner's hooks ---------------------------------------------------------------------
def maybe_capture_decode_graphs(model: nn.Module, config: EngineConfig,
                                device: torch.device) -> DecodeCudaGraphs | None:
    """Capture on CUDA with the Triton backend unless enforce_eager; call after the KV caches are
    bound (the graphs bake in their addresses). A model whose forward reads per-step host values
    (its `cuda_graph_unsupported()` says why: MLA attention, expert-parallel dispatch) runs eagerly,
    as do layer groups with tables of their own (kv_cache/hybrid.py: the graph's buffers hold one table)."""
    dc = config.device_config
    if device.type != "cuda" or dc.attention_backend != "triton" or dc.enforce_eager:
        return None
    why_not = _cuda_graph_blocker(model)
    if why_not is None and config.cache_config.kv_cache_groups:
        why_not = "KV-cache groups with block tables of their own"
    if why_not is not None:
        logger.info("decode CUDA graphs: off (%s)", why_not)
        return None
    graphs = DecodeCudaGraphs(model, config.cache_config.block_size, config.scheduler_config.max_num_seqs,
                              config.model_config.max_model_len, device)
    start = time.perf_counter()
    graphs.capture()
    logger.info("captured decode CUDA graphs for batch sizes %s in %.1f s", graphs.sizes,
                time.perf_counter() - start)
    return graphs


def _cuda_graph_blocker(model: nn.Module) -> str | None:
    """Why `model`'s decode forward cannot be captured, as its `cuda_graph_unsupported()` declares;
    a model that declares nothing reads no host values per step (None)."""
    declared = getattr(model, "cuda_graph_unsupported", None)
    return declared() if declared is not None else None


def run_model(model: nn.Module, graphs: DecodeCudaGraphs | None, input_ids: torch.Tensor,
              positions: torch.Tensor, metadata: AttentionMetadata) -> torch.Tensor:
    """The step's forward pass: replayed from a graph when one fits, else eager."""
    if graphs is not None and graphs.can_run(metadata):
        return graphs.run(input_ids, positions, metadata)
    return model(input_ids, positions, metadata)


def to_device(tensor: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A host tensor on `device`. On CUDA through pinned memory and a non-blocking copy: the step's
    later work queues behind it without a host stall (PyTorch's caching host allocator keeps the
    pinned block alive until the copy is done)."""
    if device.type != "cuda":
        return tensor.to(device)
    return tensor.pin_memory().to(device, non_blocking=True)
