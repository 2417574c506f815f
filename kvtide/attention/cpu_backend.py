"""The CPU backend (default on CPU): decodes and short query rows through the compiled paged kernel.

    kv_cache: (2, num_kv_heads, num_blocks, block_size, head_dim)    the torch backend's layout

    rows with q_len <= KERNEL_MAX_QUERY_LEN  ->  csrc/paged_attention.cpp: each row reads its blocks
        in place through the block table (no gather copy, no per-layer state), the query heads of
        a GQA group and the row's query tokens sharing every K/V block read
    longer rows (prefill chunks)             ->  the torch backend's SDPA paths

Short multi-token rows over a cached context (speculative verification, the small tail of a chunked
prefill) gain as much as decodes: SDPA would first gather their whole context. Without the compiled
op (no compiler, a failed build, KVTIDE_CPU_KERNELS=0, or a dtype it lacks) every row takes the torch
backend's paths, so results stay correct, only slower.
"""

from __future__ import annotations

import torch

from kvtide.attention.backend import AttentionMetadata
from kvtide.attention.cpu_extension import load_paged_attention
from kvtide.attention.torch_backend import TorchAttentionBackend

KERNEL_MAX_QUERY_LEN = 8
"""Longest query row sent to the kernel. Measured against gather + SDPA (scripts/bench_cpu_attention.py
--prefill: 8 rows over 256 cached tokens, H=12, H_kv=4, D=64, one thread): the kernel takes 0.56x
SDPA's time at 1-4 query tokens, 0.96x at 8, 1.2x at 12 and 1.8x at 32 (it computes each query's
scores one key at a time, while SDPA's blocked matmuls reuse every loaded key across queries)."""
KERNEL_DTYPES = (torch.float32, torch.bfloat16)


class CpuAttentionBackend(TorchAttentionBackend):
    name = "cpu"

    def __init__(self) -> None:
        super().__init__()
        self._op = load_paged_attention()  # None: pure torch (the loader logged why)

    def forward(self, query: torch.Tensor, kv_cache: torch.Tensor, metadata: AttentionMetadata,
                scale: float, sliding_window: int | None, key: torch.Tensor | None = None,
                value: torch.Tensor | None = None) -> torch.Tensor:
        if self._op is None or query.dtype not in KERNEL_DTYPES or query.device.type != "cpu":
            return super().forward(query, kv_cache, metadata, scale, sliding_window, key, value)
        output = torch.empty_like(query)
        kernel_runs, other_rows = self._split_rows(metadata)
        for first, end in kernel_runs:
            # Row slices of the metadata: query_start_loc keeps absolute token offsets.
            self._op(output, query, kv_cache, metadata.block_tables[first:end], metadata.seq_lens[first:end],
                     metadata.query_start_loc[first:end + 1], end - first, scale, sliding_window or 0)
        if other_rows:
            self._prefill(output, query, kv_cache, metadata, other_rows, scale, sliding_window, key, value)
        return output

    @staticmethod
    def _split_rows(md: AttentionMetadata) -> tuple[list[tuple[int, int]], list[int]]:
        """Runs [first, end) of consecutive rows for the kernel, and the other rows, for SDPA.
        Built once per step and shared by every layer."""
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
            md.backend_data["cpu_row_split"] = (runs, others)
        return md.backend_data["cpu_row_split"]
