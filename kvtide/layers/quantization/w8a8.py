"""W8A8: int8 weights (per output channel) times int8 activations (per token), SmoothQuant-style.

    y = (round(x / s_x) @ codes.T) * s_x * s_w       s_x per token (or a checkpoint's static scale)

The matmul runs on integers (torch._int_mm: oneDNN's VNNI kernels on x86 CPUs, cuBLASLt on CUDA),
which reads int8 weights like the weight-only path and also multiplies 4x cheaper than float32 —
what makes prefill and large batches faster, not only decode.

Activations have outlier channels that a per-token scale would spread over the whole row.
SmoothQuant moves them into the weights: per input channel j, s_j = max|X_j|^a / max|W_j|^(1-a)
(a = 0.5), W'[:, j] = W[:, j] * s_j and x'_j = x_j / s_j, which leaves x @ W.T unchanged and
evens the two ranges out. max|X_j| comes from a short calibration on user text
(`--calibration-data FILE`): the float model runs over it once at load, before quantizing, with an
observer on each W8A8 layer's input. Without calibration data the factors are 1 (plain W8A8).
The 1 / s division runs on the activations at run time (one elementwise pass) rather than folded
into the preceding norm: o_proj and down_proj have no norm before them.

The LM head and a tied embedding take int8 weight-only (their input is the final norm's output,
and the logits are what sampling reads: no activation rounding there). A MoE layer's experts take
the linears' scheme, int8 per-channel weights times per-token int8 activations (`w8a8_expert_linear`),
unsmoothed; the router stays float.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from kvtide.layers.quantization.base import QuantizationConfig, QuantizeMethod
from kvtide.layers.quantization.online import OnlineWeightOnlyMethod, quantize_shard, quantizes
from kvtide.layers.quantization.qweight import QuantizedWeight, quantize_int8

SMOOTH_ALPHA = 0.5
"""SmoothQuant's migration strength: 0.5 balances activation and weight ranges (the paper's default
for Llama-class models)."""
CALIBRATION_TOKENS = 512
"""Tokens of the calibration text the observers see (SmoothQuant's statistics settle within a few
hundred tokens)."""
CUDA_MIN_ROWS = 17
"""torch._int_mm on CUDA needs more than 16 rows; decode batches are padded up to this."""


def quantize_per_token_int8(x: torch.Tensor, static_scale: torch.Tensor | None = None,
                            row_max: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """x (M, K) float -> (int8 codes (M, K), float32 scales (M, 1)); one scale per row, max|x| / 127
    (max|x| given as row_max (M, 1) when x is a rank's part of the rows), or the checkpoint's
    static per-tensor scale."""
    x = x.float()
    if static_scale is not None:
        scale = static_scale.float().reshape(1, 1).expand(x.shape[0], 1)
    else:
        row_max = x.abs().amax(-1, keepdim=True) if row_max is None else row_max
        scale = row_max.clamp_min(1e-12) / 127.0
    return torch.round(x / scale).clamp(-128, 127).to(torch.int8), scale


def int8_matmul(x_codes: torch.Tensor, w_codes: torch.Tensor) -> torch.Tensor:
    """(M, K) int8 @ (N, K) int8 .T -> (M, N) int32."""
    m = x_codes.shape[0]
    if x_codes.device.type == "cuda" and m < CUDA_MIN_ROWS:
        padded = torch.zeros(CUDA_MIN_ROWS, x_codes.shape[1], dtype=torch.int8, device=x_codes.device)
        padded[:m] = x_codes
        return torch._int_mm(padded, w_codes.t())[:m]
    return torch._int_mm(x_codes, w_codes.t())


def row_parallel_token_max(layer: nn.Module, x: torch.Tensor) -> torch.Tensor | None:
    """max |x| of each token over the whole input row, (M, 1), for a row-parallel rank under dynamic
    per-token scales (None otherwise): it holds in/tp of the columns, and a scale from those alone
    would round differently from world size 1 (and from rank to rank). One all-gather of (M,) a
    layer, a step; a static scale needs none."""
    tp = getattr(layer, "tp", None)
    if tp is None or tp.world_size == 1 or not hasattr(layer, "input_size_per_partition") \
            or layer.w8a8_input_scale is not None:
        return None
    local = x.float().abs().amax(-1, keepdim=True).contiguous()  # (M, 1)
    return tp.all_gather(local, dim=-1).amax(-1, keepdim=True)  # (M, tp) -> (M, 1)


class W8A8Method(QuantizeMethod):
    def __init__(self, build: Callable[[nn.Module], tuple[QuantizedWeight, torch.Tensor | None]]) -> None:
        self.build = build
        """layer -> (int8 per-channel symmetric weight, static per-tensor input scale or None: dynamic)."""

    def process_weights_after_loading(self, layer: nn.Module) -> QuantizedWeight:
        qw, input_scale = self.build(layer)
        if qw.kind != "int8" or qw.mins is not None or qw.group_size != qw.in_features:
            raise ValueError("W8A8 needs int8 symmetric weights with one scale per output channel")
        layer.w8a8_input_scale = input_scale
        return qw

    def apply(self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        qw: QuantizedWeight = layer.quantized
        shape = x.shape
        x2 = x.reshape(-1, shape[-1])
        if qw.input_perm is not None:
            x2 = x2.index_select(1, qw.input_perm)
        smooth = getattr(layer, "qsmooth", None)
        if smooth is not None:
            x2 = x2 / smooth
        y = int8_linear(x2, qw, bias, layer.w8a8_input_scale, row_parallel_token_max(layer, x2))
        return y.to(x.dtype).reshape(*shape[:-1], qw.out_features)


def int8_linear(x: torch.Tensor, qw: QuantizedWeight, bias: torch.Tensor | None,
                static_scale: torch.Tensor | None = None, row_max: torch.Tensor | None = None) -> torch.Tensor:
    """x (M, K) rounded to int8 per row (quantize_per_token_int8) times qw's per-channel int8 codes,
    scaled back: (M, N) float32."""
    codes, scale = quantize_per_token_int8(x, static_scale, row_max)
    y = int8_matmul(codes, qw.codes).float() * scale * qw.scales.reshape(1, -1)
    if bias is not None:
        y += bias
    return y


def w8a8_expert_linear(x: torch.Tensor, qw: QuantizedWeight, bias: torch.Tensor | None) -> torch.Tensor:
    """A MoE expert's GEMM under w8a8 (FusedMoE.expert_kernel): int8_linear over the rows routed to
    it, one token each. Experts are not smoothed: calibration observes the linears, and an expert
    sees only the tokens routed to it."""
    return int8_linear(x, qw, bias).to(x.dtype)


class SmoothQuantMethod(W8A8Method):
    """On-the-fly W8A8 of a float layer, smoothed by the calibration's activation maxima if any."""

    def __init__(self) -> None:
        super().__init__(self._quantize)

    def _quantize(self, layer: nn.Module) -> tuple[QuantizedWeight, None]:
        weight = layer.weight.data.float()
        act_max = getattr(layer, "w8a8_act_max", None)
        if act_max is not None:
            w_max = weight.abs().amax(0).clamp_min(1e-5)
            smooth = (act_max.clamp_min(1e-5) ** SMOOTH_ALPHA / w_max ** (1 - SMOOTH_ALPHA)).clamp(1e-5, 1e5)
            weight = weight * smooth
            layer.register_buffer("qsmooth", smooth.to(layer.weight.dtype), persistent=False)
            del layer.w8a8_act_max
        return quantize_shard(layer, weight, quantize_int8, "int8"), None  # a row-parallel rank: whole rows' scales


class W8A8Config(QuantizationConfig):
    name = "w8a8"

    def __init__(self, calibration_data: str | None = None) -> None:
        self.calibration_data = calibration_data
        if calibration_data is not None:
            import os

            if not os.path.isfile(calibration_data):
                raise ValueError(f"--calibration-data {calibration_data}: no such file")

    @property
    def needs_calibration(self) -> bool:
        return self.calibration_data is not None

    def check_parallel(self, hf_config, tensor_parallel_size: int, pipeline_parallel_size: int) -> None:
        """Calibration is refused: every rank would run the calibration prefill on its own at load
        (`runner.prefill_hidden_states`, outside the scheduler), which passes no activations from
        one pipeline stage to the next, so later stages would observe nothing; and under tensor
        parallelism a column-parallel rank would smooth by the weight maxima of its own rows only,
        not the layer's. Plain W8A8 (no calibration) shards: a row-parallel rank rounds its in/tp
        input columns per token by the whole row's max (row_parallel_token_max), as world size 1 does."""
        if self.calibration_data is not None:
            raise ValueError(f"w8a8 with --calibration-data does not combine with tensor or pipeline parallelism "
                             f"(tensor_parallel_size={tensor_parallel_size}, pipeline_parallel_size="
                             f"{pipeline_parallel_size}): the calibration prefill runs on one rank; leave out "
                             f"--calibration-data (plain W8A8) or run with world size 1")

    def method_for(self, prefix: str, layer: nn.Module) -> QuantizeMethod | None:
        from kvtide.layers.linear import LinearBase

        if not quantizes(prefix, layer):
            return None
        return SmoothQuantMethod() if isinstance(layer, LinearBase) else OnlineWeightOnlyMethod(quantize_int8, "int8")

    def expert_quantizer(self):
        """A MoE layer's experts: int8 per-channel weights, as the linears'."""
        return quantize_int8

    def expert_kernel(self):
        """The experts' GEMM multiplies per-token int8 activations by those weights."""
        return w8a8_expert_linear

    def describe(self) -> str:
        return "w8a8 (SmoothQuant)" if self.calibration_data else "w8a8"


# ---- calibration -------------------------------------------------------------------------------
def observe_activations(model: nn.Module) -> Callable[[], None]:
    """Hook every SmoothQuant layer to keep the per-input-channel max |x| it sees; returns the
    function that removes the hooks."""
    handles = []
    for module in model.modules():
        if isinstance(getattr(module, "quant_method", None), SmoothQuantMethod):
            def record(mod: nn.Module, args: tuple) -> None:
                seen = args[0].detach().reshape(-1, args[0].shape[-1]).abs().amax(0).float()
                old = getattr(mod, "w8a8_act_max", None)
                mod.w8a8_act_max = seen if old is None else torch.maximum(old, seen)

            handles.append(module.register_forward_pre_hook(record))
    return lambda: [h.remove() for h in handles]



def calibrate(runner, text_path: str, tokenizer, max_tokens: int) -> None:
    """Run the float model over the start of `text_path` with observers on, so that quantizing
    afterwards (finish_quantization) smooths each layer by what it saw."""
    with open(text_path, encoding="utf-8") as f:
        text = f.read()
    ids = tokenizer.encode(text, add_special_tokens=False)[:min(CALIBRATION_TOKENS, max_tokens)]
    if len(ids) < 2:
        raise ValueError(f"--calibration-data {text_path} holds fewer than 2 tokens of text")
    remove = observe_activations(runner.model)
    try:
        runner.prefill_hidden_states(ids)
    finally:
        remove()
