"""Loading a model and swapping its weights in place from an HF safetensors folder."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from transformers import AutoConfig, AutoModelForCausalLM, DynamicCache, PreTrainedModel
from transformers.cache_utils import DynamicLayer

from server.weight_delta import read_checkpoint, tensor_sha256
from tandem.quantized_weights import checkpoint_format, dequantize_state_dict


class WeightLoadError(ValueError):
    pass


def load_model(path: Path, *, device: str, dtype: torch.dtype) -> PreTrainedModel:
    if _format(path) is None:
        model: PreTrainedModel = AutoModelForCausalLM.from_pretrained(path, dtype=dtype, attn_implementation="sdpa")
    else:
        model = _load_quantized(path, dtype)
    layer_types = {type(layer) for layer in DynamicCache(config=model.config).layers}
    if layer_types - {DynamicLayer}:
        names = ", ".join(sorted(t.__name__ for t in layer_types))
        raise WeightLoadError(f"{path}: the local engine serves full-attention models only (cache layers: {names})")
    model = model.to(torch.device(device))  # type: ignore[arg-type]  # transformers types .to oddly
    model.eval()
    return model


def _load_quantized(path: Path, dtype: torch.dtype) -> PreTrainedModel:
    """An FP8 or INT4 checkpoint with its weights multiplied back out: the CPU has no such kernels."""
    config = AutoConfig.from_pretrained(path)
    del config.quantization_config  # transformers' own quantized paths want a GPU or more packages
    model: PreTrainedModel = AutoModelForCausalLM.from_config(config, dtype=dtype, attn_implementation="sdpa")
    tensors = read_state_dict(path)
    check_compatible(model, tensors)
    copy_weights(model, tensors)
    return model


def _config(path: Path) -> dict[str, Any]:
    try:
        config: dict[str, Any] = json.loads((path / "config.json").read_text())
    except (OSError, ValueError):
        return {}  # a folder of weights alone (a swap's checkpoint) is read as it is
    return config


def _format(path: Path) -> str | None:
    try:
        return checkpoint_format(_config(path))
    except ValueError as exc:
        raise WeightLoadError(f"{path}: {exc}") from exc


def read_state_dict(path: Path) -> dict[str, torch.Tensor]:
    """All tensors of the checkpoint folder (single or sharded safetensors); those of an FP8 or INT4
    checkpoint multiplied back out to float32 (the parameters they are copied into convert them)."""
    tensors = read_checkpoint(path, error=WeightLoadError)
    if _format(path) is None:
        return tensors
    try:
        return dequantize_state_dict(tensors, torch.float32)
    except (KeyError, ValueError, RuntimeError) as exc:
        raise WeightLoadError(f"{path}: unreadable quantized checkpoint: {exc}") from exc


def check_compatible(model: PreTrainedModel, tensors: dict[str, torch.Tensor]) -> None:
    """Refuse a checkpoint that does not fit the serving model, before anything is touched."""
    params = model.state_dict()
    # A tied weight (lm_head sharing the embedding) is saved once; it is covered by its twin.
    provided = {params[name].data_ptr() for name in tensors if name in params}
    missing = [name for name, p in params.items() if name not in tensors and p.data_ptr() not in provided]
    unexpected = [name for name in tensors if name not in params]
    wrong = [
        f"{name} {tuple(tensors[name].shape)} != {tuple(p.shape)}"
        for name, p in params.items()
        if name in tensors and tensors[name].shape != p.shape
    ]
    problems = [f"missing {missing[:5]}"] * bool(missing) + [f"unexpected {unexpected[:5]}"] * bool(unexpected)
    if wrong:
        problems.append(f"wrong shapes {wrong[:5]}")
    if problems:
        raise WeightLoadError("checkpoint does not match the served model: " + "; ".join(problems))


def converts_exactly(source: torch.dtype, target: torch.dtype) -> bool:
    """Whether every value of ``source`` is a value of ``target`` (bfloat16 -> float32: yes; back: no)."""
    if source == target:
        return True
    if not (source.is_floating_point and target.is_floating_point):
        return False
    src, dst = torch.finfo(source), torch.finfo(target)
    return dst.max >= src.max and dst.eps <= src.eps and dst.smallest_normal <= src.smallest_normal


def check_bucket(model: PreTrainedModel, tensors: dict[str, torch.Tensor]) -> None:
    """Refuse part of the weights (one bucket of a distributed update) that does not fit the model:
    unknown names, other shapes, or a dtype the served one cannot hold exactly."""
    params = model.state_dict()
    unknown = [name for name in tensors if name not in params]
    wrong = [
        f"{name} {str(t.dtype).removeprefix('torch.')}{list(t.shape)} into {str(p.dtype).removeprefix('torch.')}"
        f"{list(p.shape)}"
        for name, t in tensors.items()
        if (p := params.get(name)) is not None and (t.shape != p.shape or not converts_exactly(t.dtype, p.dtype))
    ]
    problems = [f"unknown {unknown[:5]}"] * bool(unknown) + [f"does not fit {wrong[:5]}"] * bool(wrong)
    if problems:
        raise WeightLoadError("tensors do not match the served model: " + "; ".join(problems))


@torch.no_grad()
def copy_weights(model: PreTrainedModel, tensors: dict[str, torch.Tensor]) -> None:
    """Overwrite parameters in place (tied weights follow because they share storage)."""
    for name, param in model.state_dict().items():
        if name in tensors:
            param.copy_(tensors[name])


def weight_checksums(model: PreTrainedModel) -> dict[str, dict[str, Any]]:
    """Per parameter: dtype, shape and the sha256 of its bytes (equal hashes: bitwise-equal weights)."""
    return {
        name: {"dtype": str(t.dtype).removeprefix("torch."), "shape": list(t.shape), "sha256": tensor_sha256(t)}
        for name, t in model.state_dict().items()
    }
