"""Export a trained model as a Hugging Face safetensors folder that serving engines load as is.

The folder appears whole or not at all: it is written under a hidden temporary name next to the
destination and renamed at the end (atomic on one filesystem), so an engine told to load it never
sees half a checkpoint. Its sha256 covers the weight files only, in name order, so it identifies the
weights whatever the config or tokenizer files hold.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import uuid
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path

import torch
from huggingface_hub import save_torch_state_dict
from safetensors.torch import load_file
from transformers import PreTrainedModel

from tandem.quantized_weights import Format, write_quantized_checkpoint

__all__ = [
    "CheckpointError",
    "ExportResult",
    "checkpoint_dtype",
    "export_adapter",
    "export_checkpoint",
    "export_state_dict",
    "publish_folder",
    "weights_sha256",
]

# What a tokenizer can be made of; config and weights come from the model itself.
TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "added_tokens.json",
    "vocab.json",
    "merges.txt",
    "tokenizer.model",
    "chat_template.jinja",
    "chat_template.json",
)
_HASH_CHUNK = 1 << 20


class CheckpointError(RuntimeError):
    """A checkpoint that cannot be exported (destination taken, no tokenizer to copy)."""


@dataclass(frozen=True, slots=True)
class ExportResult:
    """Where the checkpoint is and the sha256 of its weight files."""

    path: Path
    sha256: str

    def __post_init__(self) -> None:
        if len(self.sha256) != 64 or any(c not in "0123456789abcdef" for c in self.sha256):
            raise ValueError(f"sha256 must be 64 lowercase hex digits, got {self.sha256!r}")


def weights_sha256(path: Path) -> str:
    """sha256 over every ``*.safetensors`` file of ``path`` in name order, each as its name then its bytes."""
    digest = hashlib.sha256()
    files = sorted(Path(path).glob("*.safetensors"))
    if not files:
        raise CheckpointError(f"{path}: no *.safetensors files")
    for file in files:
        digest.update(file.name.encode() + b"\0")
        with file.open("rb") as handle:
            while chunk := handle.read(_HASH_CHUNK):
                digest.update(chunk)
    return digest.hexdigest()


def checkpoint_dtype(path: Path) -> torch.dtype:
    """The dtype a checkpoint folder declares in its ``config.json`` (float32 when it says nothing)."""
    config = json.loads((Path(path) / "config.json").read_text())
    name = config.get("dtype") or config.get("torch_dtype") or "float32"
    dtype = getattr(torch, str(name), None)
    if not isinstance(dtype, torch.dtype):
        raise CheckpointError(f"{path}: config.json names an unknown dtype {name!r}")
    return dtype


def _fsync_tree(root: Path) -> None:
    for file in sorted(root.iterdir()):
        with file.open("rb") as handle:
            os.fsync(handle.fileno())
    descriptor = os.open(root, os.O_RDONLY)
    try:
        os.fsync(descriptor)
    finally:
        os.close(descriptor)


def _stamp_dtype(config_path: Path, dtype: torch.dtype) -> None:
    config = json.loads(config_path.read_text())
    # The config describes the model as it trains; the files hold ``dtype`` (older readers, SGLang's
    # among them, look for ``torch_dtype``).
    config["dtype"] = config["torch_dtype"] = str(dtype).removeprefix("torch.")
    config_path.write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")


def publish_folder(out_dir: Path, write: Callable[[Path], None]) -> ExportResult:
    """Stage ``write(staging)``, sync, hash, and rename it to ``out_dir``: readers see all or nothing."""
    if out_dir.exists():
        raise CheckpointError(f"{out_dir} exists: checkpoints are never overwritten")
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    staging = out_dir.parent / f".{out_dir.name}.partial-{uuid.uuid4().hex[:8]}"
    try:
        write(staging)
        _fsync_tree(staging)
        sha256 = weights_sha256(staging)
        os.rename(staging, out_dir)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    return ExportResult(path=out_dir, sha256=sha256)


def _write_atomically(out_dir: Path, source: Path, dtype: torch.dtype, write: Callable[[Path], None]) -> ExportResult:
    """Publish ``write(staging)`` plus the source's tokenizer, with ``dtype`` stamped in the config."""
    tokenizer_files = [source / name for name in TOKENIZER_FILES if (source / name).is_file()]
    if not tokenizer_files:
        raise CheckpointError(f"{source}: no tokenizer files ({', '.join(TOKENIZER_FILES[:2])}, ...)")

    def write_checkpoint(staging: Path) -> None:
        write(staging)
        _stamp_dtype(staging / "config.json", dtype)
        for file in tokenizer_files:
            shutil.copy2(file, staging / file.name)

    return publish_folder(out_dir, write_checkpoint)


def export_adapter(model: torch.nn.Module, out_dir: Path) -> ExportResult:
    """Write a peft model's adapter as a PEFT folder (adapter_config.json, adapter_model.safetensors),
    the format the engines load; the base weights are not written (peft would add the frozen
    embedding and output layers when an adapter targets lm_head)."""

    def write(staging: Path) -> None:
        model.save_pretrained(staging, safe_serialization=True, save_embedding_layers=False)  # type: ignore[operator]

    return publish_folder(Path(out_dir), write)


def export_checkpoint(
    model: PreTrainedModel,
    tokenizer_source_dir: Path,
    out_dir: Path,
    *,
    dtype: torch.dtype | None = None,
) -> ExportResult:
    """Write ``model`` to the new folder ``out_dir``: config, safetensors weights, the source's tokenizer.

    Args:
        model: the trained model (left unchanged, whatever dtype it trains in).
        tokenizer_source_dir: the base checkpoint folder; its tokenizer files are copied.
        out_dir: must not exist yet; its parent is created.
        dtype: the weights' dtype on disk, normally the base checkpoint's (``checkpoint_dtype``);
            None keeps the model's.

    Raises:
        CheckpointError: ``out_dir`` exists, or the source folder holds no tokenizer file.
    """
    dtype = dtype or model.dtype

    def write(staging: Path) -> None:
        state = {name: tensor.detach().to(device="cpu", dtype=dtype) for name, tensor in model.state_dict().items()}
        model.save_pretrained(staging, state_dict=state, safe_serialization=True)

    return _write_atomically(Path(out_dir), Path(tokenizer_source_dir), dtype, write)


def export_state_dict(
    state: Mapping[str, torch.Tensor], base_dir: Path, out_dir: Path, *, dtype: torch.dtype
) -> ExportResult:
    """Write HF-named tensors as a checkpoint like ``base_dir``: its config (and generation config) and
    tokenizer, the weights in ``dtype`` (sharded with an index past 5 GB, as transformers does).

    For trainers that hold weights in another layout (the megatron backend) and convert them back.

    Raises:
        CheckpointError: ``out_dir`` exists, or ``base_dir`` holds no tokenizer file.
    """
    base_dir = Path(base_dir)

    def write(staging: Path) -> None:
        staging.mkdir()
        tensors = {name: tensor.detach().to(device="cpu", dtype=dtype).contiguous() for name, tensor in state.items()}
        save_torch_state_dict(tensors, staging, max_shard_size="5GB")
        for name in ("config.json", "generation_config.json"):
            if (base_dir / name).is_file():
                shutil.copy2(base_dir / name, staging / name)

    return _write_atomically(Path(out_dir), base_dir, dtype, write)


def export_quantized(checkpoint: Path, form: Format) -> Path:
    """A quantized copy of ``checkpoint`` beside it (``<name>-fp8``, ``<name>-int4``) for the engines
    (``tandem.quantized_weights``); the full-precision checkpoint stays what the next round trains.
    A copy already there (written by quantization-aware training) is kept."""
    checkpoint = Path(checkpoint)
    out_dir = checkpoint.parent / f"{checkpoint.name}-{form}"
    if out_dir.exists():
        return out_dir
    tensors = read_hf_weights(checkpoint)
    scale_dtype = checkpoint_dtype(checkpoint)
    written = publish_folder(
        out_dir, lambda staging: write_quantized_checkpoint(tensors, checkpoint, staging, form, scale_dtype)
    )
    return written.path


def read_hf_weights(model_dir: Path) -> dict[str, torch.Tensor]:
    """Every tensor of the checkpoint folder's ``*.safetensors`` files, by name.

    Raises:
        FileNotFoundError: the folder holds no safetensors file.
    """
    files = sorted(Path(model_dir).glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"{model_dir}: no *.safetensors files")
    state: dict[str, torch.Tensor] = {}
    for file in files:
        state |= load_file(file)
    return state
