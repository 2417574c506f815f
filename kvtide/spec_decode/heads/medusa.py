"""Medusa heads: k small heads on the target's last hidden state, each guessing one token further ahead.

    head i:  x = h;  num_layers x [x = x + SiLU(W x + b)];  logits_i = LM_i x      (LM_i: vocab x hidden)

h is the target's final hidden state (after its final norm, the LM head's input) at the position whose
next token the target itself predicts; head i predicts the token i + 1 positions after that one.

Two public key layouts load:
    FasterDecoding  `{i}.{j}.linear.weight|bias` blocks, `{i}.{num_layers}.weight` LM head, optionally
                    prefixed `medusa_head.`; config `medusa_num_heads`, `medusa_num_layers`
    vLLM            `blocks.{i}.layers.{j}.weight|bias`, `lm_heads.{i}.weight`; config `num_heads`,
                    `num_hidden_layers`, `hidden_size`, `vocab_size` (biases only with `medusa_fc_bias`)
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from kvtide.layers.embedding import LMHead
from kvtide.layers.linear import ReplicatedLinear
from kvtide.spec_decode.heads.loading import check_tensors, construction, load_head_checkpoint

_PREFIXES = ("medusa_head.", "medusa_heads.")


class MedusaHead(nn.Module):
    def __init__(self, num_layers: int, hidden_size: int, vocab_size: int, bias: bool = True) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(ReplicatedLinear(hidden_size, hidden_size, bias=bias) for _ in range(num_layers))
        self.lm_head = LMHead(vocab_size, hidden_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = x + F.silu(block(x))
        return self.lm_head.logits(x)


class MedusaHeads(nn.Module):
    def __init__(self, num_heads: int, num_layers: int, hidden_size: int, vocab_size: int,
                 bias: bool = True) -> None:
        super().__init__()
        if num_heads < 1 or num_layers < 0:
            raise ValueError(f"Medusa needs num_heads >= 1 and num_layers >= 0, got {num_heads} and {num_layers}")
        self.num_heads = num_heads
        self.num_layers = num_layers
        self.hidden_size = hidden_size
        self.vocab_size = vocab_size
        self.bias = bias
        self.heads = nn.ModuleList(MedusaHead(num_layers, hidden_size, vocab_size, bias) for _ in range(num_heads))

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        """(N, hidden) target last hidden states (post final norm) -> (N, num_heads, vocab) float32 logits;
        head i predicts the token i+1 positions after the token the hidden state predicted."""
        if hidden_states.dim() != 2 or hidden_states.shape[1] != self.hidden_size:
            raise ValueError(f"Medusa heads take (N, {self.hidden_size}) hidden states, got "
                             f"{tuple(hidden_states.shape)}")
        return torch.stack([head(hidden_states).float() for head in self.heads], dim=1)

    def checkpoint_shapes(self, layout: str) -> dict[str, tuple[str, tuple[int, ...]]]:
        """Checkpoint name -> (parameter name, shape) in `layout` ("fasterdecoding" or "vllm")."""
        h, v = self.hidden_size, self.vocab_size
        names: dict[str, tuple[str, tuple[int, ...]]] = {}
        for i in range(self.num_heads):
            for j in range(self.num_layers):
                block = f"{i}.{j}.linear" if layout == "fasterdecoding" else f"blocks.{i}.layers.{j}"
                names[f"{block}.weight"] = (f"heads.{i}.blocks.{j}.weight", (h, h))
                if self.bias:
                    names[f"{block}.bias"] = (f"heads.{i}.blocks.{j}.bias", (h,))
            lm = f"{i}.{self.num_layers}.weight" if layout == "fasterdecoding" else f"lm_heads.{i}.weight"
            names[lm] = (f"heads.{i}.lm_head.weight", (v, h))
        return names

    @classmethod
    def from_pretrained(cls, path: str, target_hf_config, dtype: torch.dtype,
                        device: str | torch.device) -> MedusaHeads:
        """Load either public layout; ValueError when the heads do not fit the target or the checkpoint is
        incomplete, has extra tensors, or has a tensor of the wrong shape."""
        ckpt = load_head_checkpoint(path)
        config = ckpt.config
        what = f"Medusa checkpoint {ckpt.path}"
        num_heads = _first_int(config, ("medusa_num_heads", "num_heads"), what)
        num_layers = _first_int(config, ("medusa_num_layers", "num_hidden_layers"), what)
        if num_heads is None:
            raise ValueError(f"{what}: config.json has no medusa_num_heads (or num_heads)")
        num_layers = 1 if num_layers is None else num_layers
        target_hidden, target_vocab = target_hf_config.hidden_size, target_hf_config.vocab_size
        for key, target_value in (("hidden_size", target_hidden), ("vocab_size", target_vocab)):
            value = config.get(key)
            if value is not None and value != target_value:
                raise ValueError(f"{what}: {key} is {value} but the target model's is {target_value}; "
                                 f"these heads were trained for another model")
        truncated = config.get("truncated_vocab_size")
        if truncated is not None and truncated != target_vocab:
            raise ValueError(f"{what}: a truncated vocabulary (truncated_vocab_size={truncated}, token_map) is "
                             f"not supported")
        if config.get("original_lm_head"):
            raise ValueError(f"{what}: original_lm_head (one LM head shared by all heads) is not supported")

        tensors = _strip_prefixes(ckpt.tensors, what)
        vllm_layout = any(name.startswith(("blocks.", "lm_heads.")) for name in tensors)
        layout = "vllm" if vllm_layout else "fasterdecoding"
        bias = config.get("medusa_fc_bias")
        if bias is None:  # FasterDecoding's blocks are nn.Linear with bias; vLLM's only with medusa_fc_bias
            first = "blocks.0.layers.0.bias" if vllm_layout else "0.0.linear.bias"
            bias = first in tensors or (not vllm_layout and num_layers > 0)
        with construction(dtype, device):
            model = cls(num_heads, num_layers, target_hidden, target_vocab, bias=bool(bias))
        names = model.checkpoint_shapes(layout)
        check_tensors(tensors, {name: shape for name, (_, shape) in names.items()},
                      f"{what} ({layout} layout, {num_heads} heads x {num_layers} layers)")
        params = dict(model.named_parameters())
        with torch.no_grad():  # through the layers' loaders: under tensor parallelism an LM head keeps its rows
            for name, (param_name, _) in names.items():
                param = params[param_name]
                param.weight_loader(param, tensors[name].to(param.dtype))  # type: ignore[attr-defined]
        return model.eval()


def _first_int(config: dict, keys: tuple[str, ...], what: str) -> int | None:
    for key in keys:
        if key in config:
            value = config[key]
            if not isinstance(value, int) or isinstance(value, bool):
                raise ValueError(f"{what}: {key} must be an integer, got {value!r}")
            return value
    return None


def _strip_prefixes(tensors: dict[str, torch.Tensor], what: str) -> dict[str, torch.Tensor]:
    out: dict[str, torch.Tensor] = {}
    for name, tensor in tensors.items():
        short = name
        for prefix in _PREFIXES:
            short = short.removeprefix(prefix)
        if short in out:
            raise ValueError(f"{what}: tensor {short!r} appears both with and without a medusa_head. prefix")
        out[short] = tensor
    return out
