"""The model's LoRA state on one rank: preallocated slot tensors on every targetable linear, the
host-memory LRU cache of loaded adapters, and the step's rows grouped by slot.

    host cache (max_cpu_loras, LRU)        slots (max_loras, on the model's device)
    id 3 -> LoadedAdapter  ───copy────▶    slot 0: id 3   lora_a[0], lora_b[0] of every linear
    id 7 -> LoadedAdapter                  slot 1: id 9
    id 9 -> LoadedAdapter                  (an adapter evicted from the host stays in its slot,
                                            and reloads from disk when it needs one again)

Each targetable linear gets a forward hook that adds its rows' LoRA (ops.add_lora) while a step
is set (`begin_step` .. `end_step`); passes outside a step (profiling, calibration) run the base.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor

import numpy as np
import torch
from torch import nn

from kvtide.lora.adapter import LoadedAdapter, TargetLinear, find_lora_targets, load_adapter
from kvtide.lora.config import LoRAConfig
from kvtide.lora.ops import LoRAStepGroups, add_lora, group_tokens_by_slot
from kvtide.lora.request import LoRARequest

logger = logging.getLogger(__name__)


class _SlotTensors:
    """One linear's slots: lora_a (slots, num_shards * R, in), lora_b (slots, out, R)."""

    def __init__(self, linear: TargetLinear, config: LoRAConfig, dtype: torch.dtype, device: torch.device) -> None:
        rank, slots = config.max_lora_rank, config.max_loras
        self.linear = linear
        module = linear.module
        self.lora_a = torch.zeros(slots, len(linear.out_slices) * rank, module.input_size, dtype=dtype, device=device)
        self.lora_b = torch.zeros(slots, module.output_size, rank, dtype=dtype, device=device)
        self.filled = np.zeros(slots, dtype=bool)
        """Slots holding weights for this linear (an adapter need not target every linear)."""

    def write(self, slot: int, shards: dict[int, tuple[torch.Tensor, torch.Tensor]] | None) -> None:
        self.lora_a[slot].zero_()
        self.lora_b[slot].zero_()
        self.filled[slot] = bool(shards)
        rank = self.lora_b.shape[-1]
        for index, (a, b) in (shards or {}).items():
            offset, size = self.linear.out_slices[index]
            r = a.shape[0]
            self.lora_a[slot, index * rank:index * rank + r].copy_(a)
            self.lora_b[slot, offset:offset + size, :r].copy_(b)


class LoRAModelState:
    def __init__(self, model: nn.Module, config: LoRAConfig, dtype: torch.dtype, device: torch.device) -> None:
        self.config = config
        self.dtype = dtype
        self.device = device
        self.targets, linears = find_lora_targets(model)
        self._checkpoint_name: Callable[[str], str | None] = getattr(model, "checkpoint_name", lambda name: name)
        self.linears = {name: _SlotTensors(linear, config, dtype, device) for name, linear in linears.items()}
        self.host: OrderedDict[int, LoadedAdapter] = OrderedDict()
        """lora_int_id -> adapter in host memory, least recently used first."""
        self.slot_ids = [0] * config.max_loras
        """The adapter id in each slot (0: free)."""
        self._slot_used = [0.0] * config.max_loras
        self._step: LoRAStepGroups | None = None
        self._subsets: dict[tuple, LoRAStepGroups] = {}
        """This step's groups restricted to the slots a linear has weights in, by those segments."""
        self._model = model
        self._fused_decode = getattr(model, "fused_decode", None)
        """The model's fused CPU decode layers (layers/fused_decode.py), if any: they run the
        linears inside one compiled call, past the hooks, so only steps without adapter rows use them."""
        self._add_lora = _choose_op(device)
        """The batched op: the Triton kernels on CUDA (when Triton is installed), else the torch op."""
        self.load_seconds: list[float] = []
        """How long each adapter load from disk took (the metrics report them)."""
        self._lock = threading.Lock()
        """Guards the host cache, the pins and the pending loads (the loader thread writes them)."""
        self._loader: ThreadPoolExecutor | None = None
        self._pending: dict[int, Future] = {}
        """lora_int_id -> its load ahead, until a prefetch sees it done."""
        self._pinned: set[int] = set()
        """Adapters loaded ahead and not yet run: the host cache keeps them."""
        self._hooks = [slots.linear.module.register_forward_hook(self._hook(slots)) for slots in self.linears.values()]

    def weights_derived_again(self) -> None:
        """The model's fused decode layers were built again from new weights (worker/sleep_mode.py):
        the ones to switch back on are those."""
        self._fused_decode = getattr(self._model, "fused_decode", None)

    # ---- adapters ----------------------------------------------------------------------------
    def add_adapter(self, request: LoRARequest) -> float:
        """Load an adapter into host memory, checked against the model; ValueError, with nothing
        changed, for a bad one or an id that names another adapter. Returns the seconds the load
        took (0.0: it was held already)."""
        loads = len(self.load_seconds)
        self._load(request)
        return self.load_seconds[-1] if len(self.load_seconds) > loads else 0.0

    def stats(self) -> dict:
        """Adapter ids in the slots and in host memory, and every load's seconds so far."""
        with self._lock:
            host = list(self.host)
        return {"resident": self.resident_ids(), "host": host, "load_seconds": list(self.load_seconds)}

    def shutdown(self) -> None:
        if self._loader is not None:
            self._loader.shutdown(wait=True, cancel_futures=True)

    def _load(self, request: LoRARequest) -> LoadedAdapter:
        with self._lock:
            held = self.host.get(request.lora_int_id)
            if held is not None:
                if (held.request.lora_name, held.request.lora_path) != (request.lora_name, request.lora_path):
                    raise ValueError(f"lora_int_id {request.lora_int_id} already names adapter "
                                     f"{held.request.lora_name!r} ({held.request.lora_path})")
                self.host.move_to_end(request.lora_int_id)
                return held
        adapter = self._read(request)
        self._keep(adapter, pin=False)
        if request.lora_int_id in self.slot_ids:  # a slot keeps what it held: refresh it from the files read now
            slot = self.slot_ids.index(request.lora_int_id)
            for name, slots in self.linears.items():
                slots.write(slot, adapter.weights.get(name))
        return adapter

    def _read(self, request: LoRARequest) -> LoadedAdapter:
        start = time.perf_counter()
        adapter = load_adapter(request, self.targets, self.config.max_lora_rank, self.dtype,
                               lambda name: self._checkpoint_name(name) or name)
        self.load_seconds.append(time.perf_counter() - start)
        return adapter

    def _keep(self, adapter: LoadedAdapter, pin: bool) -> None:
        """Into the host cache, evicting the least recently used adapters over max_cpu_loras (never
        a pinned one: loaded ahead for a waiting request that has not run yet)."""
        lora_id = adapter.request.lora_int_id
        with self._lock:
            if pin and lora_id not in self._pending:  # removed while it loaded
                return
            self.host[lora_id] = adapter
            self.host.move_to_end(lora_id)
            if pin:
                self._pinned.add(lora_id)
            for victim in [i for i in self.host if i not in self._pinned and i != lora_id]:
                if len(self.host) <= self.config.max_cpu_loras:
                    break
                del self.host[victim]
                logger.info("LoRA adapter %d evicted from host memory", victim)

    # ---- loading ahead (off the step loop) ----------------------------------------------------
    def prefetch(self, request: LoRARequest) -> bool:
        """Whether `request`'s adapter is ready for a step (in a slot or in host memory); if not,
        start reading it on the loader thread and say False (the request waits in the queue, and
        the steps go on). A load that failed says True: the step then fails that request alone."""
        lora_id = request.lora_int_id
        with self._lock:
            if lora_id in self.host or lora_id in self.slot_ids:
                return True
            future = self._pending.get(lora_id)
            if future is None:
                if self._loader is None:
                    self._loader = ThreadPoolExecutor(1, "kvtide-lora-load")
                self._pending[lora_id] = self._loader.submit(self._load_ahead, request)
                return False
            if not future.done():
                return False
            del self._pending[lora_id]
        return True

    def _load_ahead(self, request: LoRARequest) -> None:
        self._keep(self._read(request), pin=True)

    def remove_adapter(self, lora_int_id: int) -> bool:
        """Forget an adapter: its host copy and its slot. Whether it was held."""
        with self._lock:
            held = self.host.pop(lora_int_id, None) is not None
            self._pinned.discard(lora_int_id)
            self._pending.pop(lora_int_id, None)
        if lora_int_id in self.slot_ids:
            slot = self.slot_ids.index(lora_int_id)
            for slots in self.linears.values():
                slots.write(slot, None)
            self.slot_ids[slot] = 0
            held = True
        return held

    def resident_ids(self) -> list[int]:
        return [i for i in self.slot_ids if i]

    def _slot_for(self, request: LoRARequest, needed: set[int]) -> int:
        """The slot holding `request`'s adapter, loading it there (into a free slot, else the least
        recently used one no row of this step needs)."""
        lora_id = request.lora_int_id
        if lora_id in self.slot_ids:
            slot = self.slot_ids.index(lora_id)
        else:
            free = [s for s, i in enumerate(self.slot_ids) if i not in needed]
            assert free, "the scheduler admits at most max_loras adapters at once"
            slot = min(free, key=lambda s: (self.slot_ids[s] != 0, self._slot_used[s]))
            adapter = self._load(request)
            for name, slots in self.linears.items():
                slots.write(slot, adapter.weights.get(name))
            self.slot_ids[slot] = lora_id
            with self._lock:
                self._pinned.discard(lora_id)
        self._slot_used[slot] = time.monotonic()
        return slot

    # ---- the step ----------------------------------------------------------------------------
    def begin_step(self, requests: list[LoRARequest | None], lens: np.ndarray) -> dict[int, str]:
        """The step's rows: `requests` per scheduled request in batch order, `lens` its tokens.
        Returns {index into `requests`: error} for the rows whose adapter could not be loaded again
        (its files changed or went away since it was checked): they run as the base model here and
        are the caller's to fail."""
        needed = {r.lora_int_id for r in requests if r is not None}
        if self._fused_decode is not None:
            self._model.fused_decode = None if needed else self._fused_decode
        if not needed:
            self._step = None
            return {}
        by_id = {r.lora_int_id: r for r in requests if r is not None}
        slot_of: dict[int, int] = {}
        errors: dict[int, str] = {}
        for lora_id, request in by_id.items():
            try:
                slot_of[lora_id] = self._slot_for(request, needed)
            except ValueError as e:
                errors[lora_id] = f"LoRA adapter {request.lora_name!r} could not be loaded: {e}"
        req_slots = np.fromiter((slot_of.get(r.lora_int_id, -1) if r is not None else -1 for r in requests),
                                dtype=np.int64, count=len(requests))
        self._step = group_tokens_by_slot(np.repeat(req_slots, lens), self.device)
        self._subsets = {}
        return {i: errors[r.lora_int_id] for i, r in enumerate(requests) if r is not None and r.lora_int_id in errors}

    def end_step(self) -> None:
        self._step = None
        self._subsets = {}

    def _hook(self, slots: _SlotTensors):
        def add_rows_lora(module: nn.Module, args: tuple, output: torch.Tensor) -> torch.Tensor | None:
            step = self._step
            if step is None:
                return None
            x = args[0]
            assert x.shape[0] == step.num_tokens, "a LoRA step's rows and the forward's rows differ"
            segments = tuple(seg for seg in step.segments if slots.filled[seg[0]])
            if not segments:
                return None
            groups = step
            if len(segments) < len(step.segments):  # the same few subsets recur over the layers
                groups = self._subsets.get(segments) or self._subsets.setdefault(segments, _subset(step, segments))
            return self._add_lora(output, x, slots.lora_a, slots.lora_b, groups, slots.linear.out_slices)
        return add_rows_lora


def _choose_op(device: torch.device):
    if device.type == "cuda":
        from kvtide.lora import triton_ops

        if triton_ops.triton is not None:
            return triton_ops.add_lora_triton
    return add_lora


def _subset(step: LoRAStepGroups, segments: tuple[tuple[int, int, int], ...]) -> LoRAStepGroups:
    """The groups of `step` for only some of its slots (a linear some adapters leave alone)."""
    perm = torch.cat([step.perm[start:end] for _, start, end in segments])
    new_segments, at = [], 0
    for slot, start, end in segments:
        new_segments.append((slot, at, at + end - start))
        at += end - start
    return LoRAStepGroups(step.num_tokens, perm, new_segments)
