"""Blockwise FP8 checkpoints: the layout DeepSeek-V3 ships and SGLang and vLLM load.

Each linear weight of the decoder layers is stored as ``float8_e4m3fn`` in 128 x 128 blocks, each
block with its own float32 inverse scale in ``<name>_scale_inv`` (block amax / 448, so the largest
value of a block lands on e4m3's largest); ``config.json`` says so with ``quantization_config``:
``{"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic", "weight_block_size":
[128, 128]}``. Embeddings, the LM head, norms and biases stay in the source dtype, as in DeepSeek-V3.

``dequantize_checkpoint`` is the way back, for engines without FP8 matmuls (the local engine on the
CPU): weight = fp8 value x its block's inverse scale.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file

FP8 = torch.float8_e4m3fn
FP8_MAX = torch.finfo(FP8).max  # 448
BLOCK = 128
SCALE_SUFFIX = "_scale_inv"


def quantization_config(block: int = BLOCK) -> dict[str, Any]:
    return {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic", "weight_block_size": [block, block]}


def is_quantized_weight(name: str, tensor: torch.Tensor) -> bool:
    """A decoder layer's linear weight: what DeepSeek-V3's FP8 checkpoints quantize."""
    return tensor.ndim == 2 and ".layers." in name and name.endswith("proj.weight")


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


def quantize_state_dict(tensors: dict[str, torch.Tensor], block: int = BLOCK) -> dict[str, torch.Tensor]:
    out: dict[str, torch.Tensor] = {}
    for name, tensor in tensors.items():
        if is_quantized_weight(name, tensor):
            out[name], out[name + SCALE_SUFFIX] = quantize(tensor, block)
        else:
            out[name] = tensor.contiguous()
    return out


def dequantize_state_dict(tensors: dict[str, torch.Tensor], dtype: torch.dtype, block: int) -> dict[str, torch.Tensor]:
    """The checkpoint's tensors with every FP8 weight multiplied back out, scales dropped."""
    out: dict[str, torch.Tensor] = {}
    for name, tensor in tensors.items():
        if name.endswith(SCALE_SUFFIX):
            continue
        if tensor.dtype == FP8:
            scale = tensors.get(name + SCALE_SUFFIX)
            if scale is None:
                raise ValueError(f"FP8 tensor {name} has no {name + SCALE_SUFFIX}")
            out[name] = dequantize(tensor, scale, dtype, block)
        else:
            out[name] = tensor
    return out


def fp8_block_size(config: dict[str, Any]) -> int | None:
    """The block size of a blockwise FP8 checkpoint's ``config.json``; None for any other checkpoint."""
    quant = config.get("quantization_config") or {}
    if quant.get("quant_method") != "fp8":
        return None
    rows, cols = quant.get("weight_block_size") or (BLOCK, BLOCK)
    if rows != cols:
        raise ValueError(f"FP8 blocks of {rows} x {cols}: only square blocks are supported")
    return int(rows)


def write_fp8_checkpoint(tensors: dict[str, torch.Tensor], source: Path, out_dir: Path, block: int = BLOCK) -> None:
    """``tensors`` (the checkpoint in ``source``) as a blockwise FP8 checkpoint in the new folder
    ``out_dir``, with ``source``'s config (plus ``quantization_config``), tokenizer and other files."""
    out_dir.mkdir(parents=True)
    for item in source.iterdir():
        if item.is_file() and item.suffix != ".safetensors" and item.name != "model.safetensors.index.json":
            shutil.copy2(item, out_dir / item.name)
    config = json.loads((source / "config.json").read_text())
    config["quantization_config"] = quantization_config(block)
    (out_dir / "config.json").write_text(json.dumps(config, indent=2))
    save_file(quantize_state_dict(tensors, block), out_dir / "model.safetensors", metadata={"format": "pt"})
