"""Quantized checkpoints the engines load: blockwise FP8 and packed INT4, written and read back.

Both quantize the linear weights of the decoder layers only; embeddings, the LM head, norms and
biases stay in the checkpoint's dtype.

- **Blockwise FP8**, DeepSeek-V3's layout (SGLang and vLLM: ``quant_method: fp8`` with
  ``weight_block_size``): each weight in ``float8_e4m3fn``, 128 x 128 blocks, one float32
  ``<name>_scale_inv`` per block (block amax / 448, so its largest value lands on e4m3's largest).
- **INT4, compressed-tensors ``pack-quantized``** (SGLang and vLLM: ``quant_method:
  compressed-tensors``), as slime exports it after quantization-aware training: symmetric per-group
  scales (group amax / 7, stored in the checkpoint's dtype) in ``<prefix>.weight_scale``, values
  ``round(w / scale)`` clamped to [-8, 7], shifted by 8 and packed eight to an int32 (the first in
  the lowest bits) in ``<prefix>.weight_packed``, the shape in ``<prefix>.weight_shape``.

``dequantize_state_dict`` is the way back for engines without these kernels (the local engine on
the CPU): weight = value x its scale.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any, Literal

import torch
from safetensors.torch import save_file

FP8 = torch.float8_e4m3fn
FP8_MAX = torch.finfo(FP8).max  # 448
BLOCK = 128
SCALE_SUFFIX = "_scale_inv"
INT4_MAX = 7  # symmetric scale: amax / 7; values are clamped to [-8, 7]
INT4_GROUP = 128
Format = Literal["fp8", "int4"]


def is_quantized_weight(name: str, tensor: torch.Tensor) -> bool:
    """A decoder layer's linear weight: what the quantized checkpoints quantize."""
    return tensor.ndim == 2 and ".layers." in name and name.endswith("proj.weight")


# FP8 blocks


def fp8_config(block: int = BLOCK) -> dict[str, Any]:
    return {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic", "weight_block_size": [block, block]}


def quantize(weight: torch.Tensor, block: int = BLOCK) -> tuple[torch.Tensor, torch.Tensor]:
    """``weight`` (rows x cols) in FP8 and its per-block inverse scales (ceil(rows/block) x ceil(cols/block))."""
    rows, cols = weight.shape
    padded = torch.zeros(-(-rows // block) * block, -(-cols // block) * block, dtype=torch.float32)
    padded[:rows, :cols] = weight.float()
    blocks = padded.view(padded.shape[0] // block, block, padded.shape[1] // block, block)
    amax = blocks.abs().amax(dim=(1, 3))
    scale_inv = torch.where(amax > 0, amax / FP8_MAX, torch.ones_like(amax))  # an all-zero block keeps 1
    quantized = (blocks / scale_inv[:, None, :, None]).clamp(-FP8_MAX, FP8_MAX).to(FP8)
    return quantized.view_as(padded)[:rows, :cols].contiguous(), scale_inv


def dequantize(
    quantized: torch.Tensor, scale_inv: torch.Tensor, dtype: torch.dtype, block: int = BLOCK
) -> torch.Tensor:
    rows, cols = quantized.shape
    scales = scale_inv.repeat_interleave(block, dim=0).repeat_interleave(block, dim=1)[:rows, :cols]
    return (quantized.float() * scales).to(dtype)


# INT4 groups


def int4_config(group: int = INT4_GROUP) -> dict[str, Any]:
    weights = {
        "num_bits": 4,
        "type": "int",
        "symmetric": True,
        "strategy": "group",
        "group_size": group,
        "dynamic": False,
        "actorder": None,
        "observer": "minmax",
    }
    return {
        "quant_method": "compressed-tensors",
        "format": "pack-quantized",
        "quantization_status": "compressed",
        "config_groups": {"group_0": {"targets": ["Linear"], "weights": weights, "input_activations": None}},
        "ignore": ["lm_head"],
    }


def int4_quantizable(name: str, tensor: torch.Tensor, group: int) -> bool:
    return is_quantized_weight(name, tensor) and tensor.shape[1] % group == 0 and tensor.shape[1] % 8 == 0


def quantize_int4(
    weight: torch.Tensor, group: int = INT4_GROUP, scale_dtype: torch.dtype = torch.bfloat16
) -> tuple[torch.Tensor, torch.Tensor]:
    """``weight`` (rows x cols) as int8 values in [-8, 7] and its per-group scales (rows x cols/group),
    rounded to ``scale_dtype`` before use so that the stored scale reproduces the values exactly."""
    rows, cols = weight.shape
    groups = weight.float().view(rows, cols // group, group)
    scale = (groups.abs().amax(dim=-1) / INT4_MAX).clamp(min=1e-5).to(scale_dtype)
    values = (groups / scale.float()[..., None]).round().clamp(-8, 7).to(torch.int8)
    return values.view(rows, cols), scale


def dequantize_int4(values: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    group = values.shape[1] // scale.shape[1]
    return (values.float() * scale.float().repeat_interleave(group, dim=1)).to(dtype)


def pack_int4(values: torch.Tensor) -> torch.Tensor:
    """int8 values in [-8, 7] (rows x cols, cols a multiple of 8) as int32s holding eight each."""
    unsigned = (values.to(torch.int32) + 8).view(values.shape[0], -1, 8)
    shifts = torch.arange(0, 32, 4, dtype=torch.int32)
    words = (unsigned.to(torch.int64) << shifts).sum(dim=-1)  # 0 .. 2^32 - 1
    return (words - ((words >> 31) << 32)).to(torch.int32)  # the same 32 bits, as a signed int32


def unpack_int4(packed: torch.Tensor, cols: int) -> torch.Tensor:
    shifts = torch.arange(0, 32, 4, dtype=torch.int32)
    unsigned = (packed[..., None] >> shifts) & 0xF  # an arithmetic shift; the mask drops the sign
    return (unsigned.view(packed.shape[0], -1)[:, :cols] - 8).to(torch.int8)


# checkpoints


def quantize_state_dict(
    tensors: dict[str, torch.Tensor], form: Format, scale_dtype: torch.dtype = torch.bfloat16, group: int = INT4_GROUP
) -> dict[str, torch.Tensor]:
    """``group``: the INT4 group size (compressed-tensors engines take 32, 64 or 128)."""
    out: dict[str, torch.Tensor] = {}
    for name, tensor in tensors.items():
        if form == "fp8" and is_quantized_weight(name, tensor):
            out[name], out[name + SCALE_SUFFIX] = quantize(tensor)
        elif form == "int4" and int4_quantizable(name, tensor, group):
            prefix = name.removesuffix(".weight")
            values, out[f"{prefix}.weight_scale"] = quantize_int4(tensor, group, scale_dtype)
            out[f"{prefix}.weight_packed"] = pack_int4(values)
            out[f"{prefix}.weight_shape"] = torch.tensor(tensor.shape, dtype=torch.int32)
        else:
            out[name] = tensor.contiguous()
    return out


def checkpoint_format(config: dict[str, Any]) -> Format | None:
    """Which quantized format a ``config.json`` describes; None for an unquantized checkpoint."""
    quant = config.get("quantization_config") or {}
    method = quant.get("quant_method")
    if method is None:
        return None
    if method == "fp8" and list(quant.get("weight_block_size") or [BLOCK, BLOCK]) == [BLOCK, BLOCK]:
        return "fp8"
    if method == "compressed-tensors" and quant.get("format") == "pack-quantized":
        weights = quant.get("config_groups", {}).get("group_0", {}).get("weights", {})
        if (weights.get("num_bits"), weights.get("symmetric"), weights.get("strategy")) == (4, True, "group"):
            return "int4"  # the group size follows from the shapes of each weight and its scales
    raise ValueError(f"unsupported quantization_config {json.dumps(quant)[:200]}")


def dequantize_state_dict(tensors: dict[str, torch.Tensor], dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """The checkpoint's tensors with every FP8 or packed INT4 weight multiplied back out."""
    out: dict[str, torch.Tensor] = {}
    for name, tensor in tensors.items():
        if name.endswith((SCALE_SUFFIX, ".weight_scale", ".weight_shape")):
            continue
        if name.endswith(".weight_packed"):
            prefix = name.removesuffix(".weight_packed")
            _, cols = tensors[f"{prefix}.weight_shape"].tolist()
            out[f"{prefix}.weight"] = dequantize_int4(
                unpack_int4(tensor, cols), tensors[f"{prefix}.weight_scale"], dtype
            )
        elif tensor.dtype == FP8:
            scale = tensors.get(name + SCALE_SUFFIX)
            if scale is None:
                raise ValueError(f"FP8 tensor {name} has no {name + SCALE_SUFFIX}")
            out[name] = dequantize(tensor, scale, dtype)
        else:
            out[name] = tensor
    return out


def write_quantized_checkpoint(
    tensors: dict[str, torch.Tensor],
    source: Path,
    out_dir: Path,
    form: Format,
    scale_dtype: torch.dtype,
    group: int = INT4_GROUP,
) -> None:
    """``tensors`` (the checkpoint in ``source``) quantized to ``form`` in the new folder ``out_dir``,
    with ``source``'s config (plus ``quantization_config``), tokenizer and other files."""
    out_dir.mkdir(parents=True)
    for item in source.iterdir():
        if item.is_file() and item.suffix != ".safetensors" and item.name != "model.safetensors.index.json":
            shutil.copy2(item, out_dir / item.name)
    config = json.loads((source / "config.json").read_text())
    config["quantization_config"] = fp8_config() if form == "fp8" else int4_config(group)
    (out_dir / "config.json").write_text(json.dumps(config, indent=2))
    quantized = quantize_state_dict(tensors, form, scale_dtype, group)
    save_file(quantized, out_dir / "model.safetensors", metadata={"format": "pt"})
