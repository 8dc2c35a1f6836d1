"""Linear layers that multiply by a oneDNN-packed copy of their weight: the same math in the same dtype,
faster on the CPU (measured in BENCHMARKS.md: decode 1.3x at batch 1, 1.5x at batch 8 in fp32; the
vocabulary projection, a 576 x 49k matrix on SmolLM2, 2-3x).

Decoding multiplies a few rows by every weight matrix, so its speed is how fast the weights stream
from memory; oneDNN's blocked layout streams them better than the plain row-major one. The packed
copy is made on first use and again whenever the weight changes: a weight swap copies into the
parameter in place, which bumps its version counter. The parameter itself stays as it was, so the
state dict, checksums, tied weights and LoRA hooks see an ordinary ``nn.Linear``.
"""

from __future__ import annotations

import logging

import torch
from torch import nn

log = logging.getLogger("tandem.engine")

__all__ = ["PackedLinear", "pack_linears"]


class PackedLinear(nn.Linear):
    """An ``nn.Linear`` (its class swapped in place by ``pack_linears``) with a packed weight copy."""

    _packed: torch.Tensor | None
    _packed_version: int
    _rows_hint: int

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        version = self.weight._version
        if self._packed is None or self._packed_version != version:
            self._packed = torch.ops.mkldnn._reorder_linear_weight(self.weight.detach(), self._rows_hint)
            self._packed_version = version
        out: torch.Tensor = torch.ops.mkldnn._linear_pointwise(x, self._packed, self.bias, "none", [None], "")
        return out


def pack_linears(model: nn.Module, rows_hint: int) -> int:
    """Turn the model's linear layers into ``PackedLinear``s when oneDNN can pack their dtype on this
    CPU (bf16 needs AVX-512 or AVX-NE-CONVERT); returns how many. ``rows_hint``: the rows a forward
    usually has (the batch size), which picks oneDNN's blocking."""
    linears = [m for m in model.modules() if type(m) is nn.Linear]
    if not linears or not torch.backends.mkldnn.is_available():
        return 0
    try:
        torch.ops.mkldnn._reorder_linear_weight(linears[0].weight.detach(), rows_hint)
    except RuntimeError as exc:  # this dtype has no packed path on this CPU: plain matmuls
        log.info("linear layers not packed", extra={"reason": str(exc).splitlines()[0]})
        return 0
    for linear in linears:
        linear.__class__ = PackedLinear  # same parameters, hooks and name: only forward changes
        packed: PackedLinear = linear  # type: ignore[assignment]
        packed._packed, packed._packed_version, packed._rows_hint = None, -1, rows_hint
    return len(linears)
