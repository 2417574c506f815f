"""Triton kernel tests: natively on CUDA when KVTIDE_TEST_DEVICE=cuda (scripts/gpu_check.sh), else
on the CPU under Triton's interpreter.

Triton decides per function, when `@triton.jit` decorates it, whether it is compiled or
interpreted; that includes its own library (tl.zeros, tl.maximum, ...), decorated when triton is
first imported. So the interpreter needs TRITON_INTERPRET=1 before the session's first
`import triton`. Two ways, chosen when this file loads:

  in process   triton not imported yet (or TRITON_INTERPRET=1 already set): set the variable,
               import triton and our kernel modules, restore the environment; tests marked
               `triton` run here with the variable set only while each runs (Triton reads it at
               launch too), so nothing else in the session sees it.
  subprocess   something imported triton first (importing transformers' models does): the
               `triton` tests are deselected here and test_triton_subprocess.py runs them in a
               child pytest that starts with TRITON_INTERPRET=1.

The interpreter also stores bf16 as raw uint16 and would multiply the bit patterns in tl.dot;
`_teach_interpreter_bf16_dot` upcasts them (compiled kernels need no such help).
"""

from __future__ import annotations

import importlib
import importlib.util
import os
import pathlib
import sys
from dataclasses import dataclass

import pytest
import torch

from kvtide.attention.backend import AttentionMetadata

DEVICE = os.environ.get("KVTIDE_TEST_DEVICE", "cpu")
TRITON_MODULES = ("kvtide.attention.triton_kernels", "kvtide.layers.triton_ops")
HERE = pathlib.Path(__file__).resolve().parent


def _prepare_interpreter() -> bool:
    """Import triton and our kernels interpreted; False if triton was already imported compiled."""
    if importlib.util.find_spec("triton") is None:
        return True  # the triton test modules skip themselves
    if os.environ.get("TRITON_INTERPRET") != "1" and "triton" in sys.modules:
        return False
    previous = os.environ.get("TRITON_INTERPRET")
    os.environ["TRITON_INTERPRET"] = "1"
    try:
        for name in TRITON_MODULES:
            importlib.import_module(name)
    finally:
        if previous is None:
            del os.environ["TRITON_INTERPRET"]
        else:
            os.environ["TRITON_INTERPRET"] = previous
    _teach_interpreter_bf16_dot()
    return True


def _teach_interpreter_bf16_dot() -> None:
    import triton.language as tl
    from triton.runtime.interpreter import InterpreterBuilder

    original = InterpreterBuilder.create_dot
    if getattr(original, "upcasts_bf16", False):
        return

    def create_dot(self, a, b, d, input_precision, max_num_imprecise_acc):
        if a.dtype.scalar == tl.bfloat16:
            a = self.cast_impl(a, tl.float32)
        if b.dtype.scalar == tl.bfloat16:
            b = self.cast_impl(b, tl.float32)
        return original(self, a, b, d, input_precision, max_num_imprecise_acc)

    create_dot.upcasts_bf16 = True  # type: ignore[attr-defined]
    InterpreterBuilder.create_dot = create_dot  # type: ignore[method-assign]


if DEVICE == "cuda":
    if not torch.cuda.is_available():
        pytest.exit("KVTIDE_TEST_DEVICE=cuda but torch sees no GPU", returncode=1)
    IN_PROCESS = True
else:
    IN_PROCESS = _prepare_interpreter()


def pytest_configure(config):
    config.addinivalue_line("markers", "triton: runs Triton kernels (interpreted on the CPU)")


def pytest_collection_modifyitems(config, items):
    """Subprocess mode: deselect the `triton` tests here; test_triton_subprocess.py runs them."""
    if IN_PROCESS:
        return
    moved = [i for i in items if HERE in i.path.parents and i.get_closest_marker("triton")]
    if moved:
        config.hook.pytest_deselected(items=moved)
        moved_ids = {id(i) for i in moved}
        items[:] = [i for i in items if id(i) not in moved_ids]


@pytest.fixture(scope="session")
def triton_in_process() -> bool:
    return IN_PROCESS


@pytest.fixture(autouse=True)
def _interpret_while_testing(request, monkeypatch):
    """Triton also reads TRITON_INTERPRET at launch (lazy imports): set only during triton tests."""
    if DEVICE == "cpu" and request.node.get_closest_marker("triton"):
        monkeypatch.setenv("TRITON_INTERPRET", "1")


TOLERANCES = {torch.float32: 1e-4, torch.float16: 1e-2, torch.bfloat16: 2e-2}


@pytest.fixture
def device() -> torch.device:
    return torch.device(DEVICE)


def assert_close(actual: torch.Tensor, expected: torch.Tensor, dtype: torch.dtype) -> None:
    """Within the dtype's tolerance: float32 1e-4, bf16 2e-2 (relative, and absolute near zero)."""
    tol = TOLERANCES[dtype]
    torch.testing.assert_close(actual.float().cpu(), expected.float().cpu(), rtol=tol, atol=tol)


@pytest.fixture
def close():
    return assert_close


# ---- random paged batches -------------------------------------------------------------------------
@dataclass
class PagedBatch:
    query: torch.Tensor
    """(num_tokens, num_heads, head_dim)"""
    key: torch.Tensor
    """(num_tokens, num_kv_heads, head_dim), this step's new keys"""
    value: torch.Tensor
    kv_cache: torch.Tensor
    """(2, num_blocks, block_size, num_kv_heads, head_dim), random everywhere (cached prefixes too)"""
    metadata: AttentionMetadata


def make_paged_batch(requests: list[tuple[int, int]], num_heads: int, num_kv_heads: int, head_dim: int,
                     block_size: int, dtype: torch.dtype, device: torch.device | str = "cpu", seed: int = 0,
                     table_width: int | None = None) -> PagedBatch:
    """A batch of requests given as (query_len, cached_len): query_len new tokens after cached_len
    tokens already in the cache (a prefix hit or earlier chunks). Decodes (query_len 1) are moved to
    the front as the layout requires; blocks are scattered over the pool in random order.

        cached_len = 5, query_len = 3, block_size = 4:
        positions  0 1 2 3 | 4 5 6 7        block table [b7, b2]
                   c c c c | c n n n        c: cached (random), n: written this step at slot_mapping
    """
    gen = torch.Generator().manual_seed(seed)
    reqs = sorted(requests, key=lambda r: r[0] != 1)
    seq_lens = [q + c for q, c in reqs]
    blocks_per_req = [-(-s // block_size) for s in seq_lens]
    num_blocks = sum(blocks_per_req) + 3
    free = torch.randperm(num_blocks, generator=gen).tolist()
    width = table_width or max(blocks_per_req)
    tables = []
    for n in blocks_per_req:
        tables.append(free[:n] + [0] * (width - n))
        free = free[n:]
    slots = []
    for (q, c), table in zip(reqs, tables, strict=True):
        slots.extend(table[p // block_size] * block_size + p % block_size for p in range(c, c + q))
    query_start_loc = [0]
    for q, _ in reqs:
        query_start_loc.append(query_start_loc[-1] + q)
    num_tokens = query_start_loc[-1]

    def randn(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=gen).to(dtype=dtype, device=device)

    metadata = AttentionMetadata(
        num_reqs=len(reqs), num_decodes=sum(1 for q, _ in reqs if q == 1), num_actual_tokens=num_tokens,
        query_start_loc=torch.tensor(query_start_loc, dtype=torch.int32, device=device),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=device),
        block_tables=torch.tensor(tables, dtype=torch.int32, device=device),
        slot_mapping=torch.tensor(slots, dtype=torch.int64, device=device),
        max_query_len=max(q for q, _ in reqs), max_seq_len=max(seq_lens), block_size=block_size,
        query_start_loc_cpu=query_start_loc, seq_lens_cpu=seq_lens)
    return PagedBatch(randn(num_tokens, num_heads, head_dim), randn(num_tokens, num_kv_heads, head_dim),
                      randn(num_tokens, num_kv_heads, head_dim),
                      randn(2, num_blocks, block_size, num_kv_heads, head_dim), metadata)


@pytest.fixture
def paged_batch():
    return make_paged_batch
