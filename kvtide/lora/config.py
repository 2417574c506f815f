"""LoRAConfig: how many adapters the engine holds where (plain Python, read by the scheduler)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class LoRAConfig:
    max_loras: int = 1
    """Adapters resident in the model's slots at once: at most this many distinct adapters run in
    one batch (a request whose adapter finds no slot waits in the queue)."""
    max_lora_rank: int = 16
    """The largest rank an adapter may have; the slots are preallocated at this rank."""
    max_cpu_loras: int = 1
    """Adapters kept loaded in host memory (least recently used evicted, reloaded from disk)."""

    def __post_init__(self) -> None:
        if self.max_loras < 1:
            raise ValueError(f"max_loras must be >= 1, got {self.max_loras}")
        if self.max_lora_rank < 1:
            raise ValueError(f"max_lora_rank must be >= 1, got {self.max_lora_rank}")
        if self.max_cpu_loras < self.max_loras:
            raise ValueError(f"max_cpu_loras ({self.max_cpu_loras}) must be >= max_loras ({self.max_loras})")


def resolve_lora_config(enable_lora: bool, max_loras: int, max_lora_rank: int,
                        max_cpu_loras: int | None) -> LoRAConfig | None:
    """The engine's LoRAConfig from its flags, or None with LoRA off."""
    if not enable_lora:
        return None
    return LoRAConfig(max_loras, max_lora_rank, max_cpu_loras if max_cpu_loras is not None else max_loras)
