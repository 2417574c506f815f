"""A checkpoint tensor not read yet. Under tensor parallelism each rank reads only its rows or
columns of a weight (`narrow`), so a rank's resident and read bytes are about 1/tp of the model's."""

from __future__ import annotations

import torch


class LazyTensor:
    """One safetensors tensor behind `safe_open(...).get_slice(name)`: its shape, and reads of a slice."""

    def __init__(self, safe_slice) -> None:
        self._slice = safe_slice
        self.shape = torch.Size(safe_slice.get_shape())

    def dim(self) -> int:
        return len(self.shape)

    def narrow(self, dim: int, start: int, length: int) -> torch.Tensor:
        index = [slice(None)] * len(self.shape)
        index[dim] = slice(start, start + length)
        return self._slice[tuple(index)]

    def materialize(self) -> torch.Tensor:
        return self._slice[:] if self.shape else self._slice[()]


class LazyRows:
    """Rows [start, start + length) of a LazyTensor, read only where narrowed: one shard of a fused
    checkpoint tensor (Phi-3's qkv_proj), so a tensor-parallel rank still reads just its part."""

    def __init__(self, parent: LazyTensor, start: int, length: int) -> None:
        self._parent, self._start = parent, start
        self.shape = torch.Size((length, *parent.shape[1:]))

    def dim(self) -> int:
        return len(self.shape)

    def narrow(self, dim: int, start: int, length: int) -> torch.Tensor:
        if dim == 0:
            return self._parent.narrow(0, self._start + start, length)
        return self.materialize().narrow(dim, start, length)

    def materialize(self) -> torch.Tensor:
        return self._parent.narrow(0, self._start, self.shape[0])


def row_range(tensor: torch.Tensor | LazyTensor | LazyRows, start: int, length: int
              ) -> torch.Tensor | LazyRows:
    """Rows [start, start + length) of a checkpoint tensor, lazy where it is."""
    if isinstance(tensor, torch.Tensor):
        return tensor.narrow(0, start, length)
    if isinstance(tensor, LazyRows):
        return LazyRows(tensor._parent, tensor._start + start, length)
    return LazyRows(tensor, start, length)
