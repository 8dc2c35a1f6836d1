"""Linear layers that multiply by an int8 copy of their weight: weight-only int8, one scale per
output channel, the input rounded to bf16 (torch's ``_weight_int8pack_mm`` CPU kernel).

Decoding a few rows is bound by how fast the weights stream from memory, and int8 streams a quarter
of float32's bytes: SmolLM2-135M decodes about 1.9x faster at batch 1 than with the packed float32
weights (BENCHMARKS.md). It changes the answers slightly (the quality cost is measured there too),
so it is a setting (``TANDEM_LINEAR_WEIGHTS=int8``), not the default. As with ``packed_linear``, the
float parameter stays what the state dict, checksums, weight swaps and LoRA hooks see; the int8
copy is made again whenever a swap changes the weight (its version counter moves).
"""

from __future__ import annotations

import torch
from torch import nn

__all__ = ["Int8Linear", "int8_linears", "quantize_int8"]

INT8_MAX = 127


def quantize_int8(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``weight`` (out x in) as int8 values and their per-row scales (row amax / 127, in bf16)."""
    scale = (weight.detach().float().abs().amax(dim=1) / INT8_MAX).clamp(min=1e-12).to(torch.bfloat16)
    values = (weight.detach().float() / scale.float()[:, None]).round().clamp(-INT8_MAX, INT8_MAX)
    return values.to(torch.int8).contiguous(), scale


class Int8Linear(nn.Linear):
    """An ``nn.Linear`` (its class swapped in place by ``int8_linears``) with an int8 weight copy."""

    _int8: tuple[torch.Tensor, torch.Tensor] | None
    _int8_version: int

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        version = self.weight._version
        if self._int8 is None or self._int8_version != version:
            self._int8, self._int8_version = quantize_int8(self.weight), version
        values, scale = self._int8
        rows = x.reshape(-1, x.shape[-1]).to(torch.bfloat16)
        out = torch._weight_int8pack_mm(rows, values, scale).to(x.dtype).reshape(*x.shape[:-1], -1)
        return out if self.bias is None else out + self.bias


def int8_linears(model: nn.Module) -> int:
    """Turn the model's linear layers into ``Int8Linear``s; returns how many."""
    linears = [m for m in model.modules() if type(m) is nn.Linear]
    for linear in linears:
        linear.__class__ = Int8Linear  # same parameters, hooks and name: only forward changes
        quantized: Int8Linear = linear  # type: ignore[assignment]
        quantized._int8, quantized._int8_version = None, -1
    return len(linears)
