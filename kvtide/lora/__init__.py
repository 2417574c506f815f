"""Multi-LoRA serving: PEFT adapters over one base model, many of them in one batch.

    request.py      LoRARequest (vLLM's names), the handle a request names its adapter by
    config.py       LoRAConfig: slots, the largest rank, the host cache (no torch)
    peft_config.py  adapter_config.json read and checked before anything loads (no torch)
    adapter.py      adapter_model.safetensors mapped onto the model's (fused) linears
    ops.py          the batched shrink/expand: rows grouped by adapter slot (torch)
    triton_ops.py   the same as two Triton kernels (segmented shrink, expand), used on CUDA
    model_state.py  slot tensors per targeted linear, the host LRU cache, the step's row mapping
"""

from kvtide.lora.request import LoRARequest

__all__ = ["LoRARequest"]
