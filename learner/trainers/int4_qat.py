"""INT4 quantization-aware training for the torch backend (slime's INT4 QAT, per-group symmetric).

Every linear weight that the INT4 export packs (``tandem.quantized_weights``) trains through a fake
quantizer: the forward sees the weight as the engine will (``round(w / scale)`` clamped to [-8, 7],
times its group's scale, the scale rounded to the checkpoint's dtype), and the gradient passes
straight through to the full-precision weight underneath (the straight-through estimator). The
export then packs those same values, so the served INT4 model computes what training computed.
"""

from __future__ import annotations

from pathlib import Path

import torch
from torch import nn
from torch.nn.utils import parametrize

from learner.trainers.checkpoint import publish_folder
from tandem.quantized_weights import (
    INT4_GROUP,
    dequantize_int4,
    int4_quantizable,
    quantize_int4,
    write_quantized_checkpoint,
)


class FakeInt4(nn.Module):
    def __init__(self, scale_dtype: torch.dtype, group: int) -> None:
        super().__init__()
        self.scale_dtype = scale_dtype
        self.group = group

    def forward(self, weight: torch.Tensor) -> torch.Tensor:
        with torch.no_grad():
            quantized = dequantize_int4(*quantize_int4(weight, self.group, self.scale_dtype), weight.dtype)
        return weight + (quantized - weight).detach()  # the value quantized, the gradient straight through


def apply_int4_qat(model: nn.Module, scale_dtype: torch.dtype, group: int = INT4_GROUP) -> int:
    """Put the fake quantizer on every linear weight the INT4 export packs; how many it put it on."""
    wrapped = 0
    for name, module in model.named_modules():
        if isinstance(module, nn.Linear) and int4_quantizable(f"{name}.weight", module.weight, group):
            parametrize.register_parametrization(module, "weight", FakeInt4(scale_dtype, group))
            wrapped += 1
    return wrapped


def remove_int4_qat(model: nn.Module) -> None:
    """Back to plain parameters holding the full-precision weights (what the checkpoint keeps)."""
    for module in model.modules():
        if parametrize.is_parametrized(module, "weight"):
            parametrize.remove_parametrizations(module, "weight", leave_parametrized=False)


def write_int4_copy(model: nn.Module, checkpoint: Path, scale_dtype: torch.dtype, group: int = INT4_GROUP) -> Path:
    """The INT4 checkpoint of ``model`` (QAT removed) beside ``checkpoint``, quantized from the weights
    as they trained (not from the checkpoint's rounding of them)."""
    tensors = {name: t.detach().to("cpu") for name, t in model.state_dict().items()}

    def write(staging: Path) -> None:
        write_quantized_checkpoint(tensors, checkpoint, staging, "int4", scale_dtype, group)

    return publish_folder(checkpoint.parent / f"{checkpoint.name}-int4", write).path
