"""The CPU backend (default on CPU): decodes and short query rows through the compiled paged kernel.

    kv_cache: (2, num_kv_heads, num_blocks, block_size, head_dim)    the torch backend's layout, in
              float32, bfloat16 or float16 (not necessarily the query's dtype), or
              (num_kv_heads, num_blocks, block_bytes) uint8            a quantized format's layout

    rows with q_len <= KERNEL_MAX_QUERY_LEN  ->  csrc/paged_attention.cpp: each row reads its blocks
        in place through the block table (no gather copy, no per-layer state), the query heads of
        a GQA group and the row's query tokens sharing every K/V block read; a quantized block is
        dequantized inside the kernel, into a block-sized buffer
    longer rows (prefill chunks)             ->  the torch backend's SDPA paths
    layers with a logits soft cap (Gemma 2)  ->  the torch backend's paths for every row (the kernel
    or with learned sink logits (gpt-oss)        does not cap scores nor add sinks to its softmax)

A quantized cache's K/V are written by the compiled write_kv_quant, which produces the reference
codec's bytes (kv_compression/formats.py) without its per-call tensor temporaries.

Short multi-token rows over a cached context (speculative verification, the small tail of a chunked
prefill) gain as much as decodes: SDPA would first gather their whole context. Without the compiled
op (no compiler, a failed build, KVTIDE_CPU_KERNELS=0, or a dtype it lacks) every row takes the torch
backend's paths, so results stay correct, only slower.
"""

from __future__ import annotations

import torch

from kvtide.attention.backend import AttentionMetadata
from kvtide.attention.cpu_extension import load_attention_op, load_paged_attention
from kvtide.attention.torch_backend import TorchAttentionBackend
from kvtide.kv_compression.formats import KIND_IDS, KVQuantFormat

KERNEL_MAX_QUERY_LEN = 8
"""Longest query row sent to the kernel. Measured against gather + SDPA (scripts/bench_cpu_attention.py
--prefill: 8 rows over 256 cached tokens, H=12, H_kv=4, D=64, one thread): the kernel takes 0.56x
SDPA's time at 1-4 query tokens, 0.96x at 8, 1.2x at 12 and 1.8x at 32 (it computes each query's
scores one key at a time, while SDPA's blocked matmuls reuse every loaded key across queries)."""
KERNEL_DTYPES = (torch.float32, torch.bfloat16)
"""Query dtypes the kernel takes."""
KERNEL_CACHE_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
"""Float cache dtypes it reads (converted to float32 in its workspace when not float32)."""


class CpuAttentionBackend(TorchAttentionBackend):
    name = "cpu"

    def __init__(self, kv_quant: KVQuantFormat | None = None) -> None:
        super().__init__(kv_quant)
        # None: pure torch (the loader logged why). One build holds all three.
        self._op = load_paged_attention()
        self._quant_op = load_attention_op("paged_attention_quant")
        self._write_op = load_attention_op("write_kv_quant")
        self._write_float_op = load_attention_op("write_kv")
        self._kinds = (KIND_IDS[kv_quant.k_kind], KIND_IDS[kv_quant.v_kind]) if kv_quant is not None else None

    def write_kv(self, key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor,
                 slot_mapping: torch.Tensor, kv_scale: torch.Tensor | None = None) -> None:
        if self.kv_quant is None and self._write_float_op is not None and key.device.type == "cpu" \
                and key.dtype == kv_cache.dtype and key.stride(-1) == 1 and value.stride(-1) == 1:
            self._write_float_op(key, value, kv_cache, slot_mapping)
            return
        if self.kv_quant is None or self._write_op is None or key.device.type != "cpu":
            return super().write_kv(key, value, kv_cache, slot_mapping, kv_scale)
        block_size = kv_cache.shape[2] // self.kv_quant.bytes_per_token(key.shape[-1])
        self._write_op(key, value, kv_cache, slot_mapping, *self._kinds, kv_scale, block_size)

    def forward(self, query: torch.Tensor, kv_cache: torch.Tensor, metadata: AttentionMetadata,
                scale: float, sliding_window: int | None, key: torch.Tensor | None = None,
                value: torch.Tensor | None = None, *, sink_tokens: int = 0,
                kv_scale: torch.Tensor | None = None, logits_soft_cap: float | None = None,
                sink_logits: torch.Tensor | None = None) -> torch.Tensor:
        quantized = self.kv_quant is not None
        op = self._quant_op if quantized else self._op
        if (op is None or query.dtype not in KERNEL_DTYPES or query.device.type != "cpu"
                or not (quantized or kv_cache.dtype in KERNEL_CACHE_DTYPES) or metadata.has_dropped_blocks
                or logits_soft_cap is not None or sink_logits is not None):
            # dropped (-1) blocks: the torch paths mask them; the kernel takes only live ids. A soft
            # cap or sink logits: the compiled kernel neither bends scores nor adds sinks, the torch
            # paths do.
            return super().forward(query, kv_cache, metadata, scale, sliding_window, key, value,
                                   sink_tokens=sink_tokens, kv_scale=kv_scale, logits_soft_cap=logits_soft_cap,
                                   sink_logits=sink_logits)
        output = torch.empty_like(query)
        kernel_runs, other_rows = self.split_rows(metadata)
        for run in kernel_runs:
            rows = (output, query, kv_cache, *run, scale, sliding_window or 0)
            if quantized:
                op(*rows, sink_tokens, *self._kinds, kv_scale, query.shape[-1], metadata.block_size)
            else:
                op(*rows, 0, sink_tokens)
        if other_rows:
            self._prefill(output, query, kv_cache, metadata, other_rows, scale, sliding_window, key, value,
                          sink_tokens=sink_tokens, kv_scale=kv_scale)
        return output

    def float_kernels_loaded(self) -> bool:
        """Whether a float cache's K/V go through the compiled write_kv and paged_attention ops (the
        ones layers/fused_decode.py calls from C++): no quantized format here, and the ops built."""
        return self.kv_quant is None and self._op is not None and self._write_float_op is not None

    @staticmethod
    def split_rows(md: AttentionMetadata) -> tuple[list[tuple], list[int]]:
        """The kernel's runs of consecutive rows, as its (block_tables, seq_lens, query_start_loc,
        num_rows) arguments (row slices; query_start_loc keeps absolute token offsets), and the
        other rows, for SDPA. Built once per step and shared by every layer."""
        if "cpu_row_split" not in md.backend_data:
            qsl = md.query_start_loc_cpu
            runs: list[tuple[int, int]] = []
            others: list[int] = []
            for i in range(md.num_reqs):
                if qsl[i + 1] - qsl[i] > KERNEL_MAX_QUERY_LEN:
                    others.append(i)
                elif runs and runs[-1][1] == i:
                    runs[-1] = (runs[-1][0], i + 1)
                else:
                    runs.append((i, i + 1))
            args = [(md.block_tables[first:end], md.seq_lens[first:end], md.query_start_loc[first:end + 1],
                     end - first) for first, end in runs]
            md.backend_data["cpu_row_split"] = (args, others)
        return md.backend_data["cpu_row_split"]
