"""Float32 CPU linears through the GEMM kernel that is fastest on this machine, chosen by measurement.

Which kernel is fastest depends on the CPU, not only on the ISA: MKL's sgemm re-packs the weight on
every call and runs its best paths on Intel parts; MKL's packed sgemm (`_mkl_linear`) skips that
copy; oneDNN's brgemm on a weight reordered once into its blocked layout
(`mkldnn._linear_pointwise`, what Inductor's CPU weight prepacking uses) dispatches on the ISA
alone. On a Sapphire Rapids machine the MKL-packed weight won at 16-256 rows; on a Zen 4 EPYC it
lost overall. So nothing is assumed: each distinct linear shape (N, K, bias) is measured once per
row-count bucket at model load, and the fastest candidate whose products pass the numerics bound
is used for that bucket. kvtide's own small-row kernel on 16-column weight panels (`panels`,
csrc/layer_ops.cpp) is one more candidate. The decode buckets (up to STREAM_ROWS rows) are timed
with the weight coming from memory, as it does in a model, not from the cache.

  rows  1 | 2-8 | 9-64 | 65-256 | 257+ (prefill)
        each bucket: its own kernel, e.g. onednn | onednn | onednn | mkl | f.linear

Numerics bound: the products need not be bit-identical to F.linear's, but no worse than a small
multiple of F.linear's own error against the float64 product (`numerics_ok`). A different summation
order in float32 stays inside it; a reduced-precision path (bf16 or tf32 math) is far outside it.

Verdicts are cached on disk per machine (CPU model, ISA, torch version, threads) and shape under
`cache_root()/gemm/` (gemm_tuning.py, with the panel kernels' prefetch distance), so a warm start
measures nothing. Every packed weight is an extra copy; a layer keeps at most two packed kinds
(MAX_PACKED_KINDS), and `cpu_weight_prepack='auto'` packs only when the copies fit in a quarter of
the memory available at load time (one kind per layer, if two do not fit).
"""

from __future__ import annotations

import collections
import itertools
import logging
import math
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from kvtide.layers import layer_ops
from kvtide.layers.gemm_tuning import (
    MAX_RING,
    cache_path,
    choose_panel_prefetch,
    load_cache,
    machine_key,
    save_cache,
    stream_bytes,
)

logger = logging.getLogger(__name__)

MODES = ("auto", "on", "off")
F_LINEAR = "f.linear"
PANELS = "panels"


@dataclass(frozen=True)
class Bucket:
    """Row counts that share one kernel choice; measured at `probe_rows`."""
    name: str
    low: int
    high: int | None
    probe_rows: int


BUCKETS = (Bucket("1", 1, 1, 1), Bucket("2-8", 2, 8, 8), Bucket("9-64", 9, 64, 64),
           Bucket("65-256", 65, 256, 256), Bucket("257+", 257, None, 512))
MAX_DECODE_ROWS = 256
"""The last row count with a bucket below prefill's; GemmPlan indexes its kernels by row up to it."""


# ---- candidates --------------------------------------------------------------------------------
Run = Callable[[torch.Tensor, torch.Tensor, "torch.Tensor | None", "torch.Tensor | None", int], torch.Tensor]
"""(x (rows, K), weight (N, K), bias (N,) or None, packed copy or None, rows) -> (rows, N)."""


@dataclass(frozen=True)
class Candidate:
    name: str
    run: Run
    prepare: Callable[[torch.Tensor], torch.Tensor] | None
    """Builds the candidate's copy of the weight (None: it uses the plain weight)."""
    available: Callable[[], bool]


def _run_f_linear(x, weight, bias, packed, rows):
    return F.linear(x, weight, bias)


def _run_mkl(x, weight, bias, packed, rows):
    # The packed path runs only when the last argument equals the row count (else plain sgemm).
    return torch.ops.mkl._mkl_linear(x, packed, weight, bias, rows)


def _run_onednn(x, weight, bias, packed, rows):
    return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")


def _run_transposed(x, weight, bias, packed, rows):
    # packed: (K, N), the weight transposed: sgemm without a transposed operand.
    return torch.mm(x, packed) if bias is None else torch.addmm(bias, x, packed)


def _run_panels(x, weight, bias, packed, rows):
    return layer_ops.linear_panels(x, weight.shape[0], packed, bias)


def _mkl_available() -> bool:
    return torch.backends.mkl.is_available() and hasattr(torch.ops.mkl, "_mkl_linear")


def _onednn_available() -> bool:
    return torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_linear_pointwise")


CANDIDATES: dict[str, Candidate] = {
    F_LINEAR: Candidate(F_LINEAR, _run_f_linear, None, lambda: True),
    # Packed once for 64 rows; the packed panels serve any row count.
    "mkl-packed": Candidate("mkl-packed", _run_mkl,
                            lambda w: torch.ops.mkl._mkl_reorder_linear_weight(w, 64), _mkl_available),
    # Without a batch size oneDNN picks its blocked layout (AB16b64a on AVX-512), the one it
    # expects for every row count above 1, so no call reorders the weight again.
    "onednn-packed": Candidate("onednn-packed", _run_onednn,
                               lambda w: torch.ops.mkldnn._reorder_linear_weight(w), _onednn_available),
    "transposed": Candidate("transposed", _run_transposed, lambda w: w.t().contiguous(), lambda: True),
    # kvtide's own small-row kernel (csrc/layer_ops.cpp) on 16-column panels of the weight.
    "panels": Candidate("panels", _run_panels, layer_ops.pack_panels,
                        lambda: layer_ops.layer_op("linear_panels") is not None),
}
"""Every kernel a linear may run on, by name; F_LINEAR is the reference and the fallback."""


def check_mode(mode: str) -> None:
    """ValueError unless `mode` is a cpu_weight_prepack choice (EngineArgs checks it before loading)."""
    if mode not in MODES:
        raise ValueError(f"cpu_weight_prepack must be one of {', '.join(MODES)}; got {mode!r}")


def cache_key() -> dict:
    """This machine's key in the verdict cache (gemm_tuning.py), with the candidates it runs."""
    return machine_key(available_candidates())


def available_candidates() -> list[str]:
    return [name for name, c in CANDIDATES.items() if c.available()]


# ---- the hot path ------------------------------------------------------------------------------
class GemmPlan:
    """The kernel chosen for each row count of one layer, with the packed copy it needs.

    `by_rows[r]` for r <= MAX_DECODE_ROWS, `prefill` above; each entry is (run, packed or None)."""

    __slots__ = ("by_rows", "prefill", "choices", "packed")

    def __init__(self, choices: dict[str, str], packed: dict[str, torch.Tensor]) -> None:
        self.choices = choices
        """Bucket name -> candidate name."""
        self.packed = packed
        """Candidate name -> its copy of the weight (at most MAX_PACKED_KINDS entries)."""
        entries = {b.name: (CANDIDATES[choices[b.name]].run, packed.get(choices[b.name])) for b in BUCKETS}
        self.by_rows = [entries[bucket_of(max(rows, 1)).name] for rows in range(MAX_DECODE_ROWS + 1)]
        self.prefill = entries[BUCKETS[-1].name]

    def __call__(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        if x.dim() != 2:
            return self(x.reshape(-1, x.shape[-1]), weight, bias).reshape(*x.shape[:-1], weight.shape[0])
        rows = x.shape[0]
        if rows == 0 or not x.is_contiguous():
            return F.linear(x, weight, bias)
        run, packed = self.by_rows[rows] if rows <= MAX_DECODE_ROWS else self.prefill
        return run(x, weight, bias, packed, rows)


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
           plan: GemmPlan | None) -> torch.Tensor:
    """F.linear(x, weight, bias) through the kernels `plan` chose for this layer (None: F.linear)."""
    if plan is None:
        return F.linear(x, weight, bias)
    return plan(x, weight, bias)


def bucket_of(rows: int) -> Bucket:
    for bucket in BUCKETS:
        if bucket.high is None or rows <= bucket.high:
            return bucket
    raise AssertionError(rows)


# ---- numerics ------------------------------------------------------------------------------------
ERROR_FACTOR = 4.0
"""A candidate's max error vs float64 may be this many times F.linear's (or the floor below)."""


def numerics_ok(out: torch.Tensor, reference: torch.Tensor, f_linear_out: torch.Tensor,
                abs_sums: torch.Tensor, k: int) -> bool:
    """Whether `out` is as close to the float64 `reference` as F.linear is, within ERROR_FACTOR.

    The bound is ERROR_FACTOR * max(F.linear's max error, u * sqrt(K) * max|x||W|^T), u = 2^-24:
    the floor is the typical rounding error of a K-term float32 dot product, so a lucky F.linear
    error does not reject an equally accurate kernel. Any float32 summation order lands well inside;
    bf16 (u = 2^-8) or tf32 (2^-11) arithmetic lands 100-1000x outside. It is an absolute bound on
    the outputs, scaled like them, so it carries over to the logits' softmax as an error of the same
    order as F.linear's between two batch sizes."""
    if not torch.isfinite(out).all():
        return False
    floor = 2.0**-24 * math.sqrt(k) * float(abs_sums.max())
    f_err = float((f_linear_out.double() - reference).abs().max())
    err = float((out.double() - reference).abs().max())
    return err <= ERROR_FACTOR * max(f_err, floor)


# ---- measuring -----------------------------------------------------------------------------------
TIME_ROUNDS = 3
"""Interleaved rounds per bucket; each candidate's best round counts (interference only adds time)."""
MIN_SAMPLE_S = 0.5e-3
"""Calls are repeated until one sample lasts this long (small shapes take microseconds)."""
SLICE_FLOPS = 0.3e9
"""Above this many FLOPs per call (M >= 64 only, where GEMMs are compute-bound), timing and the
numerics check use the weight's first rows: the per-FLOP speed is that of the whole weight."""
SLICE_BYTES = 48 << 20
"""At most this much of a weight is measured: beyond the last-level cache a call streams the weight
from memory, and a larger slice only takes longer to time (LM heads of 100 MB)."""
REFERENCE_COLUMNS = 256
"""Output columns (spread over N) compared against the float64 product."""
MEASURE_BUDGET_S = 5.0
"""Once measuring has taken this long (a machine busy with other work makes every call slow), the
remaining shapes keep F.linear unmeasured and uncached."""
STREAM_ROWS = 8
"""Buckets of up to this many rows are bound by reading the weight, and in a model each layer's
weight comes from memory: the whole model does not stay in the cache from one step to the next.
So they are timed over a ring of copies of the weight larger than the last-level cache, the way a
decode step reads its layers one after another. Timed on one cache-resident copy instead, a library
GEMV that streams poorly looked fastest (SmolLM2's 960x576 qkv on a Zen 5 EPYC, one row: sgemm on
the transposed weight 37 us cached but 112 us streamed, against 47-68 us for the packed kernels)."""
MAX_PACKED_KINDS = 2
"""Packed copies a layer may keep: a small-row kernel for decode and a GEMM for batches and prefill
are often different kernels (measured: the panel kernel won at 1-8 rows on a Zen 5 EPYC, oneDNN
above); each costs a copy of the weight, within 'auto''s memory budget."""
MARGIN = 0.03
"""In 'auto', another kernel must beat F.linear by this fraction (it costs a copy of the weight)."""


def _sample_seconds(fn: Callable[[], object], repeat: int) -> float:
    start = time.perf_counter()
    for _ in range(repeat):
        fn()
    return (time.perf_counter() - start) / repeat


def _time_calls(fns: dict[str, Callable[[], object]]) -> dict[str, float]:
    """Best seconds per call of each fn, measured in interleaved rounds."""
    repeat = {}
    for name, fn in fns.items():
        once = _sample_seconds(fn, 1)  # also the warm-up: oneDNN builds its kernel on the first call
        if once < MIN_SAMPLE_S:
            once = _sample_seconds(fn, 1)
        repeat[name] = max(1, min(1000, int(MIN_SAMPLE_S / max(once, 1e-7))))
    best = dict.fromkeys(fns, math.inf)
    for _ in range(TIME_ROUNDS):
        for name, fn in fns.items():
            best[name] = min(best[name], _sample_seconds(fn, repeat[name]))
    return best


def _probe_rows_of(weight: torch.Tensor, rows: int) -> int:
    """How many of the weight's rows (output columns) a bucket measures on (SLICE_FLOPS, SLICE_BYTES)."""
    n, k = weight.shape
    limit = min(n if rows < 64 else int(SLICE_FLOPS / (2 * rows * k)), SLICE_BYTES // (4 * k))
    return n if limit >= n else max(256, limit // 64 * 64)


def measure_shape(weight: torch.Tensor, bias: torch.Tensor | None, names: list[str],
                  packed: dict[str, torch.Tensor]) -> dict[str, dict[str, float | None]]:
    """Per bucket, each candidate's seconds per call, None where its products fail numerics_ok.

    `packed` holds the candidates' copies of the whole weight (prepare(weight)); smaller copies
    are built for sliced buckets."""
    gen = torch.Generator().manual_seed(0)
    verdicts: dict[str, dict[str, float | None]] = {}
    slices: dict[int, dict[str, torch.Tensor]] = {weight.shape[0]: packed}
    rings: dict[int, list[tuple[torch.Tensor, torch.Tensor | None, dict[str, torch.Tensor]]]] = {}
    for bucket in BUCKETS:
        rows = bucket.probe_rows
        n = _probe_rows_of(weight, rows)
        w, b = (weight, bias) if n == weight.shape[0] else (weight[:n].contiguous(),
                                                            None if bias is None else bias[:n].contiguous())
        if n not in slices:
            slices[n] = {name: CANDIDATES[name].prepare(w) for name in names if CANDIDATES[name].prepare}
        copies = slices[n]
        x = torch.randn(rows, weight.shape[1], generator=gen)
        passing = _passing(x, w, b, names, copies)
        if rows <= STREAM_ROWS:
            if n not in rings:
                rings[n] = _weight_ring(w, b, copies, names)
            timings = _time_calls({name: _ring_call(name, x, rings[n]) for name in passing})
        else:
            timings = _time_calls({name: _bound_call(name, x, w, b, copies.get(name)) for name in passing})
        verdicts[bucket.name] = {name: timings.get(name) for name in names}
    return verdicts


def _weight_ring(w: torch.Tensor, b: torch.Tensor | None, copies: dict[str, torch.Tensor], names: list[str]
                 ) -> list[tuple[torch.Tensor, torch.Tensor | None, dict[str, torch.Tensor]]]:
    """(weight, bias, candidates' copies) enough times over to exceed stream_bytes(): calls that
    go round it read every weight from memory, as a decode step reads its layers."""
    count = max(1, min(MAX_RING, math.ceil(stream_bytes() / (w.numel() * w.element_size()))))
    ring = [(w, b, copies)]
    for _ in range(count - 1):
        wc = w.clone()
        ring.append((wc, b, {name: CANDIDATES[name].prepare(wc) for name in names if CANDIDATES[name].prepare}))
    return ring


def _ring_call(name: str, x: torch.Tensor,
               ring: list[tuple[torch.Tensor, torch.Tensor | None, dict[str, torch.Tensor]]]) -> Callable[[], object]:
    calls = itertools.cycle([_bound_call(name, x, w, b, copies.get(name)) for w, b, copies in ring])
    return lambda: next(calls)()


def _bound_call(name: str, x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None,
                packed: torch.Tensor | None) -> Callable[[], object]:
    run, rows = CANDIDATES[name].run, x.shape[0]
    return lambda: run(x, w, b, packed, rows)


def _passing(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None, names: list[str],
             copies: dict[str, torch.Tensor]) -> list[str]:
    """The candidates whose products at these rows pass numerics_ok (F.linear always does)."""
    n, k = w.shape
    cols = torch.linspace(0, n - 1, min(n, REFERENCE_COLUMNS)).round().long().unique()
    w64 = w[cols].double()
    reference = x.double() @ w64.T + (0 if b is None else b[cols].double())
    abs_sums = x.double().abs() @ w64.abs().T + (0 if b is None else b[cols].double().abs())
    f_out = F.linear(x, w, b)[:, cols]
    passing = []
    for name in names:
        try:
            out = CANDIDATES[name].run(x, w, b, copies.get(name), x.shape[0])
        except RuntimeError as e:  # a kernel this build cannot run for this shape
            logger.debug("gemm candidate %s failed on %dx%d: %s", name, n, k, e)
            continue
        if name == F_LINEAR or (out.shape == (x.shape[0], n) and numerics_ok(out[:, cols], reference, f_out,
                                                                             abs_sums, k)):
            passing.append(name)
    return passing


# ---- choosing ------------------------------------------------------------------------------------
FUSION_BUCKETS = ("1", "2-8", "9-64")
"""Decode row counts at which a model that runs each decoder layer as one call (layers/fused_decode.py,
on weight panels) may move its linears onto the panel kernel: every linear of every layer must run
panels at a row count for any layer to fuse there."""
FUSION_SAVING_S = {"1": 40e-6, "2-8": 40e-6, "9-64": 150e-6}
"""Per linear, what fusing its decoder layer saves at these rows: ~35-40 us of per-op time at 1-8
rows (SmolLM2, 120 linears a step: 4.5 ms of a 28 ms step on a Xeon with AVX-512; ~150 us a layer on
a Zen 4 core), ~150 us at 64 rows (the bench model's step: 92 -> 84 ms with AVX-512, 118-122 -> 110-115
ms with AVX2 code paths)."""


def fusion_buckets(choices: dict[str, dict[str, str]], verdicts: dict[str, dict[str, dict[str, float | None]]],
                   counts: dict[str, int]) -> list[str]:
    """The FUSION_BUCKETS at which the fusable linears (`counts`: shape key -> how many) should all run
    panels: panels pass the numerics on every one of those shapes, and the time they add over
    `choices`, summed over the linears, is less than fusing saves (FUSION_SAVING_S each).

    Decided over the whole model, not shape by shape: fusing needs every shape on panels, and one
    shape's verdict alone swings by a quarter between measurements (SmolLM2's down projection at one
    row: panels 137-172 us against F.linear's 127-131 us in four runs on one Xeon), which decided
    fusion for the whole model (a 24 -> 29 ms step when it lost)."""
    chosen = []
    for bucket in FUSION_BUCKETS:
        extra, linears = 0.0, 0
        for skey, count in counts.items():
            times = verdicts[skey][bucket]
            panels, current = times.get(PANELS), times.get(choices[skey][bucket])
            if panels is None or current is None:
                break
            extra += count * max(0.0, panels - current)
            linears += count
        else:
            if linears and extra <= linears * FUSION_SAVING_S[bucket]:
                chosen.append(bucket)
    return chosen


def choose(verdicts: dict[str, dict[str, float | None]], mode: str, max_kinds: int = MAX_PACKED_KINDS,
           panels_at: Iterable[str] = ()) -> dict[str, str]:
    """Bucket -> candidate, from measure_shape's verdicts, with at most `max_kinds` packed kinds
    per shape.

    'auto': the fastest passing candidate, another than F.linear only if it is MARGIN faster.
    'on': the fastest passing packed candidate wherever one passes, whatever the speed.
    `panels_at` (fusion_buckets, for a fusable decoder layer's linears): panels there where they pass,
    and kept when the packed kinds are trimmed."""
    panels_at = set(panels_at)
    choices = _choose_each(verdicts, mode, allowed=None, panels_at=panels_at)
    kinds = {c for c in choices.values() if c != F_LINEAR}
    if len(kinds) > max_kinds:  # keep the kinds that save the most time over the buckets they won
        def saving(kind: str) -> float:
            return sum((verdicts[b][F_LINEAR] or 0.0) - (verdicts[b][kind] or 0.0)
                       for b, c in choices.items() if c == kind)
        pinned = PANELS in kinds and any(choices[b] == PANELS for b in panels_at)
        ranked = sorted(sorted(kinds), key=lambda k: (pinned and k == PANELS,
                                                      sum(c == k for c in choices.values()) if mode == "on" else 0,
                                                      saving(k)), reverse=True)
        choices = _choose_each(verdicts, mode, allowed={F_LINEAR, *ranked[:max_kinds]}, panels_at=panels_at)
    return choices


def _choose_each(verdicts: dict[str, dict[str, float | None]], mode: str, allowed: set[str] | None,
                 panels_at: set[str] = frozenset()) -> dict[str, str]:
    choices = {}
    for bucket in (b.name for b in BUCKETS):
        times = verdicts[bucket]
        ok = {name: t for name, t in times.items() if t is not None and (allowed is None or name in allowed)}
        packed = {name: t for name, t in ok.items() if name != F_LINEAR}
        if mode == "on" and packed:
            best = min(packed, key=packed.__getitem__)
        else:
            best = min(ok, key=ok.__getitem__) if ok else F_LINEAR
            f_time = times.get(F_LINEAR)
            if best != F_LINEAR and f_time is not None and ok[best] > f_time * (1 - MARGIN):
                best = F_LINEAR
        if bucket in panels_at and PANELS in ok:
            best = PANELS
        choices[bucket] = best
    return choices


# ---- model load ----------------------------------------------------------------------------------
def shape_key(weight: torch.Tensor, bias: torch.Tensor | None) -> str:
    return f"{weight.shape[0]}x{weight.shape[1]}{'+bias' if bias is not None else ''}"


LAST_CHOICES: dict[str, dict[str, str]] = {}
"""Shape key -> bucket -> candidate, as chosen by the latest prepack_weights (benchmarks print it)."""
_PLANNED_HERE = False
"""Whether prepack_weights ran in this process (then LAST_CHOICES is this process's truth)."""
MEASURED_SHAPES: list[str] = []
"""Shape keys measured (not taken from the cache) by prepack_weights in this process."""


def prepack_weights(model: nn.Module, mode: str, available_bytes: int | None = None,
                    use_cache: bool = True, prefer_panels: Iterable[nn.Module] = ()) -> int:
    """Give each CPU float32 layer with a `gemm_plan` attribute (linears, LM head) the GemmPlan of
    its shape, with the packed copy it needs. Returns the number of layers given a plan.
    `available_bytes` (default: MemAvailable) bounds 'auto'; the `prefer_panels` layers (fusable
    decoder layers' linears) run panels at the decode rows fusion_buckets picks."""
    global _PLANNED_HERE
    check_mode(mode)
    _PLANNED_HERE = True
    candidates = list(model.modules())
    candidates += [view for m in candidates if hasattr(m, "gemm_views") for view in m.gemm_views()]  # MoE experts
    layers = [m for m in candidates if hasattr(m, "gemm_plan") and getattr(m, "quant_method", None) is None
              and m.weight.dtype == torch.float32
              and m.weight.device.type == "cpu" and m.weight.dim() == 2]
    for layer in layers:
        layer.gemm_plan = None
    LAST_CHOICES.clear()
    if mode == "off":
        LAST_CHOICES.update({shape_key(m.weight, _bias(m)): {b.name: F_LINEAR for b in BUCKETS} for m in layers})
    if mode == "off" or not layers:
        return 0
    choose_panel_prefetch(cache_key(), use_cache)  # before the shapes are timed: their verdicts depend on it
    verdicts = _verdicts_by_shape(layers, use_cache)
    prefer = {id(m) for m in prefer_panels}  # quantized ones among them hold no float weight: not here
    fusable = collections.Counter(shape_key(m.weight, _bias(m)) for m in layers if id(m) in prefer)

    def choose_all(max_kinds: int) -> dict[str, dict[str, str]]:
        fastest = {skey: choose(v, mode, max_kinds) for skey, v in verdicts.items()}
        panels_at = fusion_buckets(fastest, verdicts, fusable) if fusable else []
        if panels_at:
            logger.info("GEMM: panels for the fusable decoder layers' linears at rows %s", ", ".join(panels_at))
        return {skey: choose(v, mode, max_kinds, panels_at if skey in fusable else ()) for skey, v in verdicts.items()}

    choices = choose_all(MAX_PACKED_KINDS)
    copies = _copy_bytes(layers, choices)
    if mode == "auto":
        budget = (_available_memory() if available_bytes is None else available_bytes) // 4
        if copies > budget:  # one packed kind per layer may still fit
            one_kind = choose_all(1)
            if _copy_bytes(layers, one_kind) <= budget:
                logger.info("GEMM: one packed kind per layer: %.1f GiB of copies for two exceed a quarter of "
                            "free memory", copies / 2**30)
                choices, copies = one_kind, _copy_bytes(layers, one_kind)
        if copies > budget:
            logger.info("GEMM: F.linear only: %.1f GiB of packed copies exceed a quarter of free memory",
                        copies / 2**30)
            LAST_CHOICES.update({k: dict.fromkeys(v, F_LINEAR) for k, v in choices.items()})
            return 0
    for skey, chosen in choices.items():
        logger.info("GEMM %s: %s", skey, format_choices(chosen))
    LAST_CHOICES.update(choices)
    planned = 0
    for layer in layers:
        chosen = choices[shape_key(layer.weight, _bias(layer))]
        kinds = {c for c in chosen.values() if c != F_LINEAR}
        if kinds:
            packed = {kind: CANDIDATES[kind].prepare(layer.weight) for kind in kinds}
            layer.gemm_plan = GemmPlan(chosen, packed)
            planned += 1
    logger.info("GEMM: %d of %d CPU linear layers use a packed weight (%.0f MiB of copies)", planned,
                len(layers), copies / 2**20 if planned else 0)
    fused = sum(m.use_expert_panels(choices) for m in model.modules() if hasattr(m, "use_expert_panels"))
    if fused:
        logger.info("GEMM: %d MoE layers run their experts in one call on weight panels", fused)
    return planned


def _bias(layer: nn.Module) -> torch.Tensor | None:
    return getattr(layer, "bias", None)


def _copy_bytes(layers: list[nn.Module], choices: dict[str, dict[str, str]]) -> int:
    """Bytes of the packed copies `choices` makes: one copy of a layer's weight per packed kind."""
    return sum(layer.weight.nbytes * len(set(choices[shape_key(layer.weight, _bias(layer))].values()) - {F_LINEAR})
               for layer in layers)


def _verdicts_by_shape(layers: list[nn.Module], use_cache: bool) -> dict[str, dict[str, dict[str, float | None]]]:
    """Measure each distinct shape once, or read its verdicts from the disk cache; a shape left
    unmeasured (MEASURE_BUDGET_S) has F.linear's verdict alone."""
    key = cache_key()
    path = cache_path(key)
    cached = load_cache(path) if use_cache else {}
    names = available_candidates()
    new: dict[str, dict] = {}
    by_shape: dict[str, dict[str, dict[str, float | None]]] = {}
    start = time.perf_counter()
    for layer in layers:
        weight, bias = layer.weight, _bias(layer)
        skey = shape_key(weight, bias)
        if skey in by_shape:
            continue
        verdicts = cached.get(skey)
        if verdicts is None or {b.name for b in BUCKETS} - verdicts.keys():
            if time.perf_counter() - start > MEASURE_BUDGET_S:
                logger.info("GEMM %s: f.linear (measuring ran past %.0f s; not measured)", skey, MEASURE_BUDGET_S)
                by_shape[skey] = {b.name: {F_LINEAR: 1.0} for b in BUCKETS}
                continue
            packed = {n: CANDIDATES[n].prepare(weight) for n in names if CANDIDATES[n].prepare}
            verdicts = new[skey] = measure_shape(weight, bias, names, packed)
            MEASURED_SHAPES.append(skey)
            logger.info("GEMM %s measured: %s", skey, format_verdicts(verdicts))
        by_shape[skey] = verdicts
    if new:
        logger.info("GEMM: measured %d shapes in %.2f s on %s", len(new), time.perf_counter() - start,
                    key["cpu_model"])
        if use_cache:
            save_cache(path, key, new)
    return by_shape


def gemm_choices(mode: str = "auto") -> dict[str, dict[str, str]]:
    """Shape -> bucket -> kernel: this process's latest prepack_weights, else (the engine ran in
    another process, e.g. a server) what `mode` would choose from this machine's disk cache."""
    if LAST_CHOICES or _PLANNED_HERE:
        return dict(LAST_CHOICES)
    return {shape: choose(verdicts, mode) for shape, verdicts in sorted(load_cache(cache_path(cache_key())).items())}


def format_choices(choices: dict[str, str]) -> str:
    """'rows 1: onednn-packed, 2-8: onednn-packed, ...'"""
    return "rows " + ", ".join(f"{bucket}: {name}" for bucket, name in choices.items())


def format_verdicts(verdicts: dict[str, dict[str, float | None]]) -> str:
    return "; ".join(f"{bucket}: " + " ".join(f"{name}={'fail' if t is None else f'{t * 1e6:.0f}us'}"
                                               for name, t in times.items())
                     for bucket, times in verdicts.items())


def _available_memory() -> int:
    """MemAvailable from /proc/meminfo in bytes; 0 where it cannot be read (then 'auto' packs nothing)."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0
