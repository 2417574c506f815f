"""The fast PyTorch backend (CPU default): head-major paged cache, decode as two batched matmuls.

    kv_cache: (2, num_kv_heads, num_blocks, block_size, head_dim)

    decode:  attends over the decode mirror below, or over blocks gathered along dim 2 with one
             index_select -> (2, H_kv, rows, ctx, D), where each (ctx, D) matrix is contiguous and
             (H_kv, rows) merge into one bmm batch with no further copy. (SDPA on the reference
             layout needs the gather plus a transpose copy, and its flash kernel is built for query
             blocks, not one query per request.)
    prefill: a chunk without cached prefix attends its own fresh K/V (no gather at all); a chunk
             with one gathers its request's blocks, already in SDPA's (H_kv, ctx, D) layout.

Decode mirror: each layer keeps its decode rows' contexts in slots of contiguous buffers (keys
(slots, H_kv, D, capacity), values (slots, H_kv, capacity, D)). A request holds its slot while it decodes, so a step only writes its
new token there; only a row that is new to the mirror (just prefilled, resumed, or re-received)
copies its context from the paged cache, once. The step then attends over the slots in use as one
batch: rows of requests that left (holes) get zero queries and are dropped from the output. A
server's churn (a request joining or ending every few steps) thus costs one context copy per
arrival, not a gather of the whole batch each step. The slot map is built once per step and shared
by all layers; each layer's buffer records the step it reflects and is refilled whole if it missed one.
Its memory is extra to the KV pool, so it is bounded per layer (MIRROR_MAX_BYTES, and the size of
the layer's paged cache: what it mirrors lives there) and given back after a burst (MIRROR_SHRINK_FACTOR).

Without a mirror (over that bound) the contexts are gathered a few rows at a time
(GATHER_CHUNK_BYTES), each chunk attended while it is still in cache: gathering a whole large batch
at once writes a copy of every context to memory and reads it back.

Checked against torch_ref.py on random mixed batches in tests/attention.
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from kvtide.attention.backend import AttentionBackend, AttentionMetadata, decode_context_layout, prefill_mask

SOFTMAX_CUTOFF = 64.0
"""Decode keys scoring more than this below their row's best get weight exactly 0. Their true
weight (< e^-64 ~ 1.6e-28) is invisible in a float32 result, but softmax would return it as a
subnormal float, and x86 cores multiply subnormals through slow microcode assists: on the bench
model P @ V ran over 2x slower for it (see `_softmax_without_subnormals`)."""
GATHER_CHUNK_BYTES = 8 << 20
"""Contexts gathered at once on the chunked decode path: small enough to stay in cache."""
MIRROR_MAX_BYTES = 128 << 20
"""Largest decode mirror kept for one layer..."""
MIRROR_MIN_BYTES = 16 << 20
"""...and no larger than the layer's paged cache unless under this (small pools keep a mirror)."""
MIRROR_HEADROOM_TOKENS = 128
"""Context growth a mirror absorbs before it is reallocated larger."""
MIRROR_SHRINK_FACTOR = 4
"""A mirror this many times larger than the batch needs (slots or context) is dropped and
reallocated to fit, so a burst's memory is given back once it has passed."""
MIRROR_SPARE_SLOTS = 8
"""Fewest slots a mirror allocates beyond the batch (a quarter of it when that is more)."""
MAX_HOLES = 8
"""Free slots below the highest one in use tolerated beyond half the rows, before the slots are
reassigned compactly (and every layer's mirror refilled)."""


@dataclass
class _DecodeMirror:
    """Each slot one decoding request's context. Slot-major, so the slots in use and the heads merge
    into one bmm batch dimension."""
    keys_t: torch.Tensor
    """(slots, H_kv, D, capacity): keys stored transposed, so q @ K^T is a plain matmul (no per-call
    transpose-packing of K: 30% faster, and bit-identical on MKL: same sums over D)."""
    values: torch.Tensor
    """(slots, H_kv, capacity, D)."""
    step: int
    """The _SlotPlan.step whose contexts it holds."""


@dataclass
class _SlotPlan:
    """One step's decode rows on mirror slots, built at the first layer and shared by all."""
    step: int
    slots: torch.Tensor
    """(num_decodes,) int64: each row's slot."""
    num_slots: int
    """Highest slot in use + 1: the batch the layers attend over."""
    fill_rows: torch.Tensor
    """Rows whose slot must be copied whole from the paged cache (new to the mirror)."""
    append_rows: torch.Tensor | None
    """Rows one token longer than last step: only their newest K/V is written (None: every row)..."""
    append_slots: torch.Tensor
    """...into these slots..."""
    append_positions: torch.Tensor
    """...at these positions (seq_len - 1)."""
    reset: bool
    """Slots reassigned: every layer refills every row."""
    identity: bool
    """Row i is in slot i and there are no holes: attend the rows as they are."""


class TorchAttentionBackend(AttentionBackend):
    name = "torch"

    def __init__(self) -> None:
        self._mirrors: dict[int, _DecodeMirror] = {}
        """Per layer (keyed by its cache's data pointer)."""
        self._slot_of: dict[int, tuple[int, int]] = {}
        """Row uid -> (its mirror slot, its seq_len), for the requests of the last decode batch."""
        self._free_slots: list[int] = []
        """Freed slots below _num_slots (a min-heap: the lowest is reused first)."""
        self._num_slots = 0
        self._step = 0

    def kv_cache_shape(self, num_blocks: int, block_size: int, num_kv_heads: int,
                       head_dim: int) -> tuple[int, ...]:
        return (2, num_kv_heads, num_blocks, block_size, head_dim)

    def copy_blocks(self, kv_cache: torch.Tensor, src: torch.Tensor, dst: torch.Tensor) -> None:
        kv_cache[:, :, dst] = kv_cache[:, :, src]

    def write_kv(self, key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor,
                 slot_mapping: torch.Tensor) -> None:
        _, num_kv_heads, _, _, head_dim = kv_cache.shape
        # (H_kv, num_slots, D) views; key (T, H_kv, D) enters as (H_kv, T, D).
        kv_cache[0].view(num_kv_heads, -1, head_dim).index_copy_(1, slot_mapping, key.transpose(0, 1))
        kv_cache[1].view(num_kv_heads, -1, head_dim).index_copy_(1, slot_mapping, value.transpose(0, 1))

    def forward(self, query: torch.Tensor, kv_cache: torch.Tensor, metadata: AttentionMetadata,
                scale: float, sliding_window: int | None, key: torch.Tensor | None = None,
                value: torch.Tensor | None = None) -> torch.Tensor:
        num_decodes = metadata.num_decodes
        new_kv = None if key is None or value is None else (key[:num_decodes], value[:num_decodes])
        if num_decodes == metadata.num_reqs:
            return self._decode(query, kv_cache, metadata, scale, sliding_window, new_kv)
        output = torch.empty_like(query)
        if num_decodes:
            output[:num_decodes] = self._decode(query[:num_decodes], kv_cache, metadata, scale,
                                                sliding_window, new_kv)
        qsl = metadata.query_start_loc_cpu
        for first, last in self._prefill_runs(metadata, key is not None and value is not None):
            start, end = qsl[first], qsl[last + 1]
            fresh = None if key is None or value is None else (key[start:end], value[start:end])
            if last > first:
                output[start:end] = self._prefill_run(query[start:end], fresh, last - first + 1, scale,  # type: ignore[arg-type]
                                                      sliding_window)
            else:
                output[start:end] = self._prefill_one(query[start:end], kv_cache, metadata, first, scale,
                                                      sliding_window, fresh)
        return output

    @staticmethod
    def _prefill_runs(md: AttentionMetadata, have_fresh: bool) -> list[tuple[int, int]]:
        """Prefill requests as runs [first, last] of neighbours that can share one SDPA call:
        same length and no cached prefix (their K/V are this step's, packed back to back). Any
        other request is a run of one."""
        qsl, seq_lens = md.query_start_loc_cpu, md.seq_lens_cpu
        runs: list[tuple[int, int]] = []
        for i in range(md.num_decodes, md.num_reqs):
            q_len = qsl[i + 1] - qsl[i]
            batchable = have_fresh and seq_lens[i] == q_len
            if runs and batchable and runs[-1][1] == i - 1:
                first = runs[-1][0]
                if seq_lens[first] == qsl[first + 1] - qsl[first] == q_len:
                    runs[-1] = (first, i)
                    continue
            runs.append((i, i))
        return runs

    @staticmethod
    def _prefill_run(query: torch.Tensor, fresh: tuple[torch.Tensor, torch.Tensor], num: int, scale: float,
                     window: int | None) -> torch.Tensor:
        """`num` uncached prompts of equal length L in one causal SDPA over (num, H, L, D) views."""
        total, num_heads, head_dim = query.shape
        q_len = total // num
        key, value = fresh
        num_kv_heads = key.shape[1]
        mask = prefill_mask(q_len, q_len, window, query.device)
        out = F.scaled_dot_product_attention(
            query.view(num, q_len, num_heads, head_dim).transpose(1, 2),
            key.view(num, q_len, num_kv_heads, head_dim).transpose(1, 2),
            value.view(num, q_len, num_kv_heads, head_dim).transpose(1, 2),
            attn_mask=mask, is_causal=mask is None, scale=scale, enable_gqa=num_heads != num_kv_heads)
        return out.transpose(1, 2).reshape(total, num_heads, head_dim)

    # ---- decodes -----------------------------------------------------------------------------
    def _decode(self, query: torch.Tensor, kv_cache: torch.Tensor, md: AttentionMetadata,
                scale: float, window: int | None,
                new_kv: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
        num_decodes, num_heads, head_dim = query.shape
        num_kv_heads = kv_cache.shape[1]
        block_ids, bias = self._decode_layout(md, window, query.dtype)
        group = num_heads // num_kv_heads
        q = (query * scale).view(num_decodes, num_kv_heads, group, head_dim)
        mirrored = self._mirrored_context(kv_cache, md, block_ids, new_kv)
        if mirrored is not None:
            keys_t, values, plan = mirrored  # (num_slots, H_kv, D, ctx), (num_slots, H_kv, ctx, D)
            bias = bias.unsqueeze(1)  # (num_decodes, 1, 1, ctx)
            if plan.identity:
                out = _attend(q, keys_t, values, bias)
            else:  # holes: zero queries, visible everywhere (finite, then dropped)
                q_slots = q.new_zeros(plan.num_slots, num_kv_heads, group, head_dim)
                q_slots[plan.slots] = q
                bias_slots = bias.new_zeros(plan.num_slots, *bias.shape[1:])
                bias_slots[plan.slots] = bias
                out = _attend(q_slots, keys_t, values, bias_slots)[plan.slots]
            return out.reshape(num_decodes, num_heads, head_dim)
        # Gathered contexts come head-major: (2, H_kv, rows, ctx, D), queries (H_kv, rows, group, D).
        q = q.transpose(0, 1)
        out = torch.empty_like(q)
        row_bytes = 2 * num_kv_heads * block_ids.shape[1] * kv_cache.shape[3] * head_dim * kv_cache.element_size()
        rows = max(1, GATHER_CHUNK_BYTES // row_bytes)
        for first in range(0, num_decodes, rows):
            chunk = slice(first, first + rows)
            kv = self._gather(kv_cache, block_ids[chunk])
            out[:, chunk] = _attend(q[:, chunk], kv[0].transpose(-1, -2), kv[1], bias[chunk])
        return out.transpose(0, 1).reshape(num_decodes, num_heads, head_dim)

    def _gather(self, kv_cache: torch.Tensor, block_ids: torch.Tensor) -> torch.Tensor:
        """(num_rows, num_blocks) block ids -> (2, H_kv, num_rows, num_blocks * block_size, D)."""
        _, num_kv_heads, num_blocks_total, block_size, head_dim = kv_cache.shape
        # As 3-D (2 * H_kv, blocks, block_size * D), index_select takes its fast row-copy path.
        kv = kv_cache.view(2 * num_kv_heads, num_blocks_total, block_size * head_dim)
        kv = kv.index_select(1, block_ids.flatten())
        return kv.view(2, num_kv_heads, block_ids.shape[0], block_ids.shape[1] * block_size, head_dim)

    def _slot_plan(self, md: AttentionMetadata) -> _SlotPlan:
        """This step's rows on slots: a request keeps its slot while it decodes; a new one takes the
        lowest free slot; slots of requests that left are freed. Built once per step."""
        if "torch_slot_plan" in md.backend_data:
            return md.backend_data["torch_slot_plan"]
        uids, seq_lens = md.row_uids[:md.num_decodes], md.seq_lens_cpu[:md.num_decodes]
        present = set(uids)
        for uid in [u for u in self._slot_of if u not in present]:
            heapq.heappush(self._free_slots, self._slot_of.pop(uid)[0])
        reset = len(uids) and self._num_slots - len(self._slot_of) > len(uids) // 2 + MAX_HOLES
        if reset:  # too many holes: reassign compactly
            self._slot_of, self._free_slots, self._num_slots = {}, [], 0
        slots, fills, appends = [], [], []
        for row, (uid, seq_len) in enumerate(zip(uids, seq_lens, strict=True)):
            slot, last_len = self._slot_of.get(uid, (None, None))
            if slot is None:
                if self._free_slots:
                    slot = heapq.heappop(self._free_slots)
                else:
                    slot, self._num_slots = self._num_slots, self._num_slots + 1
            (appends if last_len == seq_len - 1 else fills).append(row)
            self._slot_of[uid] = (slot, seq_len)
            slots.append(slot)
        while self._free_slots and self._num_slots - 1 in self._free_slots:  # trim the top
            self._free_slots.remove(self._num_slots - 1)
            heapq.heapify(self._free_slots)
            self._num_slots -= 1
        self._step += 1
        device = md.seq_lens.device

        def index(values: list[int]) -> torch.Tensor:
            return torch.tensor(values, dtype=torch.int64, device=device)

        plan = _SlotPlan(self._step, index(slots), self._num_slots, index(fills),
                         None if len(appends) == len(uids) else index(appends),
                         index([slots[r] for r in appends]), index([seq_lens[r] - 1 for r in appends]),
                         bool(reset), slots == list(range(len(slots))) and self._num_slots == len(slots))
        md.backend_data["torch_slot_plan"] = plan
        return plan

    def _mirrored_context(self, kv_cache: torch.Tensor, md: AttentionMetadata, block_ids: torch.Tensor,
                          new_kv: tuple[torch.Tensor, torch.Tensor] | None
                          ) -> tuple[torch.Tensor, torch.Tensor, _SlotPlan] | None:
        """The decode rows' contexts as this layer's mirror slots (brought up to this step), with
        the step's slot plan; None where there is no mirror (over its memory bound): gather then."""
        num_decodes = md.num_decodes
        if new_kv is None or len(md.row_uids) < num_decodes:
            return None
        plan = self._slot_plan(md)
        _, num_kv_heads, _, block_size, head_dim = kv_cache.shape
        ctx = block_ids.shape[1] * block_size
        layer = kv_cache.data_ptr()
        mirror = self._mirrors.get(layer)
        # The size this batch would allocate; a mirror far above it is dropped (refilled whole below).
        num_slots = plan.num_slots + max(MIRROR_SPARE_SLOTS, plan.num_slots // 4)
        capacity = -(-(ctx + MIRROR_HEADROOM_TOKENS) // block_size) * block_size
        if mirror is not None and (mirror.values.shape[0] > MIRROR_SHRINK_FACTOR * num_slots
                                   or mirror.values.shape[2] > MIRROR_SHRINK_FACTOR * capacity):
            mirror = None
        current = mirror is not None and mirror.step == plan.step - 1 and not plan.reset
        if mirror is None or mirror.values.shape[0] < plan.num_slots or mirror.values.shape[2] < ctx:
            if mirror is not None:  # grow only: never below what the mirror already holds
                num_slots, capacity = max(num_slots, mirror.values.shape[0]), max(capacity, mirror.values.shape[2])
            nbytes = 2 * num_kv_heads * num_slots * capacity * head_dim * kv_cache.element_size()
            if nbytes > min(MIRROR_MAX_BYTES, max(kv_cache.nbytes, MIRROR_MIN_BYTES)):
                self._mirrors.pop(layer, None)
                return None
            # Zeroed, not empty: unused slots and the headroom are read (masked or dropped), and
            # garbage can be NaN, which a -inf mask does not cancel (0 * NaN = NaN).
            keys_t = kv_cache.new_zeros(num_slots, num_kv_heads, head_dim, capacity)
            values = kv_cache.new_zeros(num_slots, num_kv_heads, capacity, head_dim)
            if current:
                old_slots, old_capacity = mirror.values.shape[0], mirror.values.shape[2]  # type: ignore[union-attr]
                keys_t[:old_slots, ..., :old_capacity] = mirror.keys_t  # type: ignore[union-attr]
                values[:old_slots, :, :old_capacity] = mirror.values  # type: ignore[union-attr]
            mirror = _DecodeMirror(keys_t, values, mirror.step if current else -1)  # type: ignore[union-attr]
            self._mirrors[layer] = mirror
        keys_t, values = mirror.keys_t, mirror.values
        if current:
            fill_rows = plan.fill_rows
            if plan.append_slots.numel():
                rows, slots, positions = plan.append_rows, plan.append_slots, plan.append_positions
                new_keys, new_values = new_kv if rows is None else (new_kv[0][rows], new_kv[1][rows])
                keys_t[slots, :, :, positions] = new_keys  # (rows, H_kv, D) either side
                values[slots, :, positions] = new_values
        else:
            fill_rows = torch.arange(num_decodes, device=plan.slots.device)
        if fill_rows.numel():
            kv = self._gather(kv_cache, block_ids[fill_rows])  # (2, H_kv, rows, ctx, D)
            fill_slots = plan.slots[fill_rows]
            keys_t[fill_slots, :, :, :ctx] = kv[0].permute(1, 0, 3, 2)
            values[fill_slots, :, :ctx] = kv[1].transpose(0, 1)
        mirror.step = plan.step
        return keys_t[:plan.num_slots, :, :, :ctx], values[:plan.num_slots, :, :ctx], plan

    @staticmethod
    def _decode_layout(md: AttentionMetadata, window: int | None,
                       dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """Block ids covering the longest decode context, and an additive (num_decodes, 1, ctx)
        float32 mask: 0 where a key is visible, -inf past the sequence or outside the window.
        Built once per step and shared by every layer."""
        cache_key = ("torch_decode_bias", window)
        if cache_key not in md.backend_data:
            block_ids, visible = decode_context_layout(md, window)
            bias = torch.zeros(visible.shape, dtype=torch.float32, device=visible.device)
            bias.masked_fill_(~visible, float("-inf"))
            md.backend_data[cache_key] = (block_ids, bias[:, None, :])
        return md.backend_data[cache_key]

    # ---- prefill chunks ----------------------------------------------------------------------
    def _prefill_one(self, query: torch.Tensor, kv_cache: torch.Tensor, md: AttentionMetadata, i: int,
                     scale: float, window: int | None,
                     fresh: tuple[torch.Tensor, torch.Tensor] | None) -> torch.Tensor:
        q_len, num_heads, head_dim = query.shape
        seq_len = md.seq_lens_cpu[i]
        num_kv_heads = kv_cache.shape[1]
        if fresh is not None and seq_len == q_len:
            key, value = fresh[0].transpose(0, 1), fresh[1].transpose(0, 1)  # (H_kv, q_len, D)
        else:
            num_blocks = -(-seq_len // kv_cache.shape[3])
            kv = self._gather(kv_cache, md.block_tables[i:i + 1, :num_blocks].to(torch.int64))[:, :, 0]
            key, value = kv[0, :, :seq_len], kv[1, :, :seq_len]
        mask = prefill_mask(q_len, seq_len, window, query.device)
        out = F.scaled_dot_product_attention(
            query.transpose(0, 1).unsqueeze(0), key.unsqueeze(0), value.unsqueeze(0),
            attn_mask=mask, is_causal=mask is None, scale=scale,
            enable_gqa=num_heads != num_kv_heads)
        return out.squeeze(0).transpose(0, 1)


def _softmax_without_subnormals(scores: torch.Tensor) -> torch.Tensor:
    """softmax over the last dim of a fresh float32 tensor (modified in place), with weights below
    e^-SOFTMAX_CUTOFF of the row's largest set to exactly 0 instead of left subnormal."""
    scores -= scores.amax(dim=-1, keepdim=True)
    F.threshold_(scores, -SOFTMAX_CUTOFF, float("-inf"))  # x <= -cutoff -> -inf, in one pass
    return scores.softmax(dim=-1)


def _attend(q: torch.Tensor, keys_t: torch.Tensor, values: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
    """q (B1, B2, group, D), keys_t (B1, B2, D, ctx), values (B1, B2, ctx, D), bias broadcastable to
    (B1, B2, group, ctx) -> (B1, B2, group, D). (B1, B2) is (H_kv, rows) for gathered contexts,
    (slots, H_kv) for the mirror."""
    scores = torch.matmul(q, keys_t)  # (B1, B2, group, ctx)
    probs = _softmax_without_subnormals(scores.float() + bias).to(q.dtype)
    return torch.matmul(probs, values)
