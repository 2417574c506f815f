"""Sleep mode and weight updates on a model runner: the hooks RL frameworks (veRL, OpenRLHF, TRL)
drive between training steps, under vLLM's names.

    sleep(1)  the KV pool is freed (the engine has reset its prefix cache: that KV is gone)
    sleep(2)  the weights too: every parameter's storage, the packed GEMM copies and the fused
              decode panels derived from them
    wake_up() the weights reload from the checkpoint directory (level 2), the pool is allocated
              again, zeroed, with the same number of blocks
    update_weights(named tensors)  new values for parameters by their checkpoint names, same
              shapes; every tensor is checked against a meta-device twin of the model before any
              parameter changes, and what derives from the weights is derived again

Freed memory goes back to the OS (glibc's malloc_trim: kvtide raises glibc's trim threshold, so
it would otherwise stay in the heap). Float CPU models only for now: a quantized model derives
its held weights at load (process_weights_after_loading, online quantization), a CUDA model has
Triton layers and decode graphs bound to its tensors; both refuse with a ValueError.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import gc
import logging
from collections.abc import Iterable
from dataclasses import dataclass, field

import torch

logger = logging.getLogger(__name__)

LEVELS = (1, 2)


@dataclass
class SleepState:
    level: int = 0
    """0 awake; 1 without its KV pool; 2 without its weights too."""
    shapes: dict[str, tuple[torch.Size, torch.dtype]] = field(default_factory=dict)
    """Level 2: each parameter's shape and dtype, to give it storage again."""
    weight_version: int = 0
    """Weight updates (from disk or tensors) applied since the model was loaded."""


def _state(runner) -> SleepState:
    if not hasattr(runner, "sleep_state"):
        runner.sleep_state = SleepState()
    return runner.sleep_state


def check_weights_replaceable(runner, what: str) -> None:
    """ValueError where `what` (dropping or updating the weights) cannot keep the model correct."""
    config = runner.config
    if config.model_config.quant_config is not None:
        raise ValueError(f"{what}: this model's weights are quantized ({config.model_config.quant_config.name}); "
                         f"kvtide replaces float weights only")
    if runner.device.type != "cpu":
        raise ValueError(f"{what}: on {runner.device.type} kvtide does not yet rebind its Triton layers and decode "
                         f"graphs to new weights; CPU engines only")
    if runner.spec is not None:
        raise ValueError(f"{what}: speculative decoding keeps a draft model beside the target; not with it yet")
    if config.model_config.model_impl != "kvtide":
        raise ValueError(f"{what}: the transformers fallback's modules are not rebuilt on a meta device; "
                         f"kvtide's own modules only")


def sleep(runner, level: int) -> None:
    """Free the KV pool (level 1) and the weights (level 2). The engine ran no request since it
    reset its prefix cache."""
    state = _state(runner)
    if level not in LEVELS:
        raise ValueError(f"sleep level must be 1 (free the KV cache) or 2 (the weights too), got {level!r}")
    if state.level:
        raise ValueError(f"the engine is already asleep (level {state.level}); wake it up first")
    if level == 2:
        check_weights_replaceable(runner, "sleep level 2")
    for attn in runner._cached_attention_layers():
        attn.kv_cache = None
    runner.kv_caches, runner._own_layout_caches, runner._kv_to_collapse = [], [], []
    runner.cuda_graphs = None
    if level == 2:
        _drop_derived(runner.model)
        state.shapes = {}
        for name, param in runner.model.named_parameters():
            state.shapes[name] = (param.shape, param.dtype)
            param.data = torch.empty(0, dtype=param.dtype, device=param.device)
    state.level = level
    release_freed_memory()
    logger.info("asleep at level %d: the KV pool%s freed", level, " and the weights" if level == 2 else "")


def wake_up(runner, model_dir: str | None = None) -> None:
    """Weights back from `model_dir` (default: the one loaded at start; level 2), then the KV pool,
    as before the sleep."""
    state = _state(runner)
    if not state.level:
        raise ValueError("the engine is awake")
    if state.level == 2:
        params = dict(runner.model.named_parameters())
        for name, (shape, dtype) in state.shapes.items():
            params[name].data = torch.empty(shape, dtype=dtype, device=runner.device)
        _load_from_dir(runner, model_dir or runner.model_dir)
        state.shapes = {}
    runner.initialize_kv_cache(runner.num_kv_blocks)
    state.level = 0
    logger.info("awake: %d KV blocks", runner.num_kv_blocks)


def update_weights(runner, weights: Iterable[tuple[str, torch.Tensor]]) -> int:
    """Load new values (checkpoint names, the model's shapes) into the parameters; returns the
    weight version after. Nothing changes unless every tensor fits."""
    state = _state(runner)
    check_weights_replaceable(runner, "updating weights")
    if state.level == 2:
        raise ValueError("the engine sleeps without its weights (level 2): wake it up before updating them")
    tensors = [(name, tensor) for name, tensor in weights]
    if not tensors:
        raise ValueError("no weights to update")
    _check_against_meta_twin(runner, ((name, tensor.shape) for name, tensor in tensors))
    with torch.no_grad():
        runner.model.load_weights(iter(tensors))
    _derive_again(runner)
    state.weight_version += 1
    return state.weight_version


def update_weights_from_disk(runner, model_dir: str) -> int:
    """Every weight from a checkpoint directory of the same architecture and shapes: checked by
    their shapes alone (nothing read), then streamed in."""
    from kvtide.models.loader import iterate_weights

    state = _state(runner)
    check_weights_replaceable(runner, "updating weights")
    if state.level == 2:
        raise ValueError("the engine sleeps without its weights (level 2): wake it up before updating them")
    _check_against_meta_twin(runner, ((name, t.shape) for name, t in iterate_weights(model_dir, None, lazy=True)))
    _load_from_dir(runner, model_dir)
    state.weight_version += 1
    return state.weight_version


def release_freed_memory() -> None:
    """Hand the heap's free pages back to the OS (glibc's malloc_trim; elsewhere nothing)."""
    gc.collect()
    name = ctypes.util.find_library("c")
    if name is None:
        return
    trim = getattr(ctypes.CDLL(name), "malloc_trim", None)
    if trim is not None:
        trim(0)


# ---- what derives from the weights ---------------------------------------------------------------
def _drop_derived(model: torch.nn.Module) -> None:
    """The packed GEMM copies and the fused decode layers: rebuilt from the weights after a load."""
    for module in model.modules():
        if hasattr(module, "gemm_plan"):
            module.gemm_plan = None
    if hasattr(model, "fused_decode"):
        model.fused_decode = None


def _derive_again(runner) -> None:
    from kvtide.worker.cpu_kernels import use_cpu_kernels

    _drop_derived(runner.model)
    use_cpu_kernels(runner.model, runner.config.device_config.cpu_weight_prepack)
    for hook in runner.after_weights_derived:  # e.g. LoRA, which switches the fused decode layers per step
        hook()


def _load_from_dir(runner, model_dir: str) -> None:
    from kvtide.models.loader import iterate_weights

    with torch.no_grad():
        runner.model.load_weights(iterate_weights(model_dir, None))
    _derive_again(runner)


def _check_against_meta_twin(runner, shapes: Iterable[tuple[str, torch.Size]]) -> None:
    """Run the model's own loader on a meta-device twin: an unknown name or a shape that does not
    fit raises there, before the real parameters are touched."""
    from kvtide.models.registry import get_model_class

    mc = runner.config.model_config
    with torch.device("meta"):
        twin = get_model_class(mc.hf_config, mc.model_impl)(mc.hf_config, mc.max_model_len, mc.dtype)
    try:
        twin.load_weights((name, torch.empty(shape, device="meta")) for name, shape in shapes)
    except (ValueError, RuntimeError, AssertionError) as e:
        raise ValueError(f"the new weights do not fit the model (nothing was changed): {e}") from None


def is_sleeping(runner) -> bool:
    return bool(_state(runner).level)


def weight_version(runner) -> int:
    return _state(runner).weight_version


RUNNER_CALLS = {"sleep": sleep, "wake_up": wake_up, "update_weights": update_weights,
                "update_weights_from_disk": update_weights_from_disk, "is_sleeping": is_sleeping,
                "weight_version": weight_version}
"""The calls an executor's collective_rpc runs on a runner by name."""
