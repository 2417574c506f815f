"""LoRARequest: which adapter a request runs with (vLLM's field names)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class LoRARequest:
    """An adapter by name, a positive integer id unique per adapter while it is loaded, and the
    directory holding its PEFT files. The id keys the slots, the host cache and the prefix cache, so
    two adapters never share KV blocks and one adapter always finds its own."""

    lora_name: str
    lora_int_id: int
    lora_path: str = ""
    base_model_name: str | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.lora_name, str) or not self.lora_name:
            raise ValueError(f"lora_name must be a non-empty string, got {self.lora_name!r}")
        if not isinstance(self.lora_int_id, int) or isinstance(self.lora_int_id, bool) or self.lora_int_id < 1:
            raise ValueError(f"lora_int_id must be an integer >= 1, got {self.lora_int_id!r}")
        if not isinstance(self.lora_path, str) or not self.lora_path:
            raise ValueError(f"lora_path must name the adapter's directory, got {self.lora_path!r}")

    @classmethod
    def from_wire(cls, value: LoRARequest | dict[str, Any] | None) -> LoRARequest | None:
        """As it arrives over a process boundary (a dict of its fields), or as it is."""
        if value is None or isinstance(value, LoRARequest):
            return value
        return cls(**value)
