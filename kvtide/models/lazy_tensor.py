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
