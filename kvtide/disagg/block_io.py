"""KVBlockIO: whole KV blocks out of, and into, every cached layer, as bytes.

Each layer's cache keeps its blocks along some axis of its own layout (the float layouts of the
attention backends, a quantized format's bytes, MLA's latent cache); the axis is found by asking
the layout for one block and for two. A block's bytes are its slice of every layer, in layer
order, so a block written back lands exactly where it was read from in any engine whose `layout_id`
is the same.
"""

from __future__ import annotations

import hashlib

import numpy as np
import torch


class KVBlockIO:
    def __init__(self, caches: list[torch.Tensor], shapes_for: list, layout_name: str) -> None:
        """caches: each cached layer's tensor; shapes_for[i](num_blocks): layer i's cache shape
        for that many blocks (the axis whose size changes is the block axis)."""
        self.caches = caches
        self.axes = [_block_axis(shape(1), shape(2)) for shape in shapes_for]
        self.layer_bytes = [c.select(a, 0).numel() * c.element_size() for c, a in zip(caches, self.axes, strict=True)]
        self.block_bytes = sum(self.layer_bytes)
        desc = layout_name + "|" + ";".join(f"{tuple(c.shape[:a]) + tuple(c.shape[a + 1:])}@{a}:{c.dtype}"
                                            for c, a in zip(caches, self.axes, strict=True))
        self.layout_id = hashlib.sha256(desc.encode()).hexdigest()[:16]
        """Names the model, cache dtype, block size and layout: entries from another never load here."""

    def read(self, block_ids: list[int]) -> list[bytes]:
        """The bytes of each block, in order."""
        if not block_ids:
            return []
        index = torch.tensor(block_ids, dtype=torch.int64, device=self.caches[0].device)
        joined = torch.cat([cache.index_select(axis, index).movedim(axis, 0).reshape(len(block_ids), -1)
                            .view(torch.uint8) for cache, axis in zip(self.caches, self.axes, strict=True)], dim=1)
        rows = joined.cpu().numpy()
        return [rows[i].tobytes() for i in range(len(block_ids))]

    def write(self, block_ids: list[int], payloads: list[bytes]) -> None:
        """Put each payload (as `read` made it) into its block."""
        if not block_ids:
            return
        assert all(len(p) == self.block_bytes for p in payloads), "payload size does not match this layout"
        index = torch.tensor(block_ids, dtype=torch.int64, device=self.caches[0].device)
        joined = torch.from_numpy(np.stack([np.frombuffer(p, dtype=np.uint8) for p in payloads]))
        offset = 0
        for cache, axis, size in zip(self.caches, self.axes, self.layer_bytes, strict=True):
            part = joined[:, offset:offset + size].contiguous().view(cache.dtype)
            shape = (len(block_ids),) + cache.shape[:axis] + cache.shape[axis + 1:]
            cache.index_copy_(axis, index, part.reshape(shape).movedim(0, axis).to(cache.device))
            offset += size


def _block_axis(one: tuple[int, ...], two: tuple[int, ...]) -> int:
    diff = [i for i, (a, b) in enumerate(zip(one, two, strict=True)) if a != b]
    assert len(diff) == 1, f"cannot find the block axis of cache shapes {one} / {two}"
    return diff[0]
