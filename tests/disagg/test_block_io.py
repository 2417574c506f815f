"""KVBlockIO moves whole blocks of any cache layout: read, write elsewhere, read back the same
bytes, and nothing else changes."""

from __future__ import annotations

import pytest
import torch

from kvtide.disagg.block_io import KVBlockIO

LAYOUTS = {
    # name: (shape for n blocks, dtype)
    "torch/cpu float (2, H, N, B, D)": (lambda n: (2, 3, n, 16, 8), torch.float32),
    "base float (2, N, B, H, D)": (lambda n: (2, n, 16, 3, 8), torch.bfloat16),
    "quantized bytes (H, N, block_bytes)": (lambda n: (3, n, 400), torch.uint8),
    "MLA latent (N, B, rank + rope)": (lambda n: (n, 16, 40), torch.float16),
}


@pytest.mark.parametrize("name", LAYOUTS)
def test_blocks_round_trip_in_every_layout(name):
    shape, dtype = LAYOUTS[name]
    num_blocks = 10
    g = torch.Generator().manual_seed(0)
    caches = [torch.randint(0, 200, shape(num_blocks), generator=g).to(dtype) for _ in range(2)]
    io = KVBlockIO(caches, [shape, shape], name)
    payloads = io.read([1, 7])
    assert all(len(p) == io.block_bytes for p in payloads)
    before = [c.clone() for c in caches]
    io.write([4, 2], payloads)
    assert io.read([4, 2]) == payloads
    axis = io.axes[0]
    for cache, old in zip(caches, before, strict=True):
        assert torch.equal(cache.select(axis, 4), old.select(axis, 1))
        assert torch.equal(cache.select(axis, 2), old.select(axis, 7))
        for b in set(range(num_blocks)) - {2, 4}:
            assert torch.equal(cache.select(axis, b), old.select(axis, b))


def test_layout_id_tells_layouts_apart():
    shape, dtype = LAYOUTS["torch/cpu float (2, H, N, B, D)"]
    a = KVBlockIO([torch.zeros(shape(4), dtype=dtype)], [shape], "torch|float32|16")
    b = KVBlockIO([torch.zeros(shape(4), dtype=torch.float16)], [shape], "torch|float16|16")
    c = KVBlockIO([torch.zeros(shape(4), dtype=dtype)], [shape], "cpu|float32|16")
    assert len({a.layout_id, b.layout_id, c.layout_id}) == 3
    assert a.layout_id == KVBlockIO([torch.ones(shape(9), dtype=dtype)], [shape], "torch|float32|16").layout_id
