"""LoRA adapters in the local engine: PEFT folders loaded into a byte-budgeted LRU cache, and every
row of a batch decoded with its own adapter in one base forward (Punica / S-LoRA style).

Each targeted ``nn.Linear`` gets a forward hook. Before a forward the runner names each row's
adapter; the hook gathers the rows' low-rank factors from a stack of the batch's distinct adapters
(rebuilt only when that set changes) and adds ``scale * (x A^T) B^T`` per row with two batched
matmuls, so 16 users with 16 adapters still cost one base forward plus small products, not 16
sub-batches. Rows without an adapter add nothing, and a batch without adapters skips the hooks'
work entirely.

An adapter folder is PEFT's format (``adapter_config.json`` + ``adapter_model.safetensors``), the
one ``peft``, SGLang's ``/load_lora_adapter`` and vLLM read. Only plain LoRA is served: DoRA,
trained biases, ``modules_to_save`` and per-module alphas are refused at load with the reason.
"""

from __future__ import annotations

import json
import math
import threading
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file
from torch import nn

from server.engines.base import EngineError

_PREFIX = "base_model.model."
_UNSUPPORTED = {
    "use_dora": "DoRA",
    "modules_to_save": "modules_to_save",
    "alpha_pattern": "per-module alphas (alpha_pattern)",
    "rank_pattern": "per-module ranks (rank_pattern: each module's own scale)",
    "fan_in_fan_out": "fan_in_fan_out",
}


class AdapterError(EngineError):
    """An adapter folder that cannot be served (missing, malformed, or for another model)."""

    def __init__(self, message: str) -> None:
        super().__init__(message, 400)


@dataclass(frozen=True, slots=True)
class LoraModule:
    a: torch.Tensor  # [rank, in_features]
    b: torch.Tensor  # [out_features, rank]


@dataclass(frozen=True, slots=True)
class Adapter:
    """One loaded adapter: its low-rank factors by module name (``model.layers.0.self_attn.q_proj``)."""

    key: str  # what the prefix cache and the batch stacks know it by (its version id)
    scale: float
    modules: dict[str, LoraModule]

    @property
    def nbytes(self) -> int:
        return sum(m.a.numel() * m.a.element_size() + m.b.numel() * m.b.element_size() for m in self.modules.values())


_CONFIG, _WEIGHTS = "adapter_config.json", "adapter_model.safetensors"
_FACTORS = (".lora_A.weight", ".lora_B.weight")
_MAX_HEADER_BYTES = 100 << 20  # safetensors' own limit on the JSON header


def check_adapter_folder(folder: Path) -> None:
    """Refuse, with the reason, a folder that is not a plain PEFT LoRA, without a model: the admin API
    checks a folder with it before recording it, and ``read_adapter`` runs the same checks first.

    Checks the config (LoRA, a positive ``r`` and ``lora_alpha``, nothing the engine cannot serve) and
    the weights file's header (every tensor a ``lora_A`` or ``lora_B`` factor); not the shapes, which
    only the model can tell.

    Raises:
        AdapterError: what is wrong with it.
    """
    _checked_config(folder)


def _checked_config(folder: Path) -> dict[str, Any]:
    config = _config(folder)
    names = _tensor_names(folder / _WEIGHTS, folder)
    if not names:
        raise AdapterError(f"{folder}: the adapter has no LoRA tensors")
    for name in names:
        if not name.endswith(_FACTORS):
            raise AdapterError(f"{folder}: unexpected tensor {name}")
    return config


def _config(folder: Path) -> dict[str, Any]:
    config_path, weights_path = folder / _CONFIG, folder / _WEIGHTS
    if not config_path.is_file() or not weights_path.is_file():
        raise AdapterError(f"{folder} is not a PEFT adapter folder ({_CONFIG}, {_WEIGHTS})")
    try:
        config = json.loads(config_path.read_text())
    except (OSError, UnicodeDecodeError, ValueError) as exc:
        raise AdapterError(f"{folder}: {_CONFIG} is not readable JSON ({exc})") from exc
    if not isinstance(config, dict):
        raise AdapterError(f"{folder}: {_CONFIG} is not a JSON object")
    if config.get("peft_type", "LORA") != "LORA":
        raise AdapterError(f"{folder}: only LoRA adapters are served, not {config.get('peft_type')}")
    for field, what in _UNSUPPORTED.items():
        if config.get(field):
            raise AdapterError(f"{folder}: {what} is not supported by the local engine")
    if config.get("bias", "none") != "none":
        raise AdapterError(f"{folder}: trained biases (bias={config['bias']!r}) are not supported")
    rank, alpha = config.get("r"), config.get("lora_alpha")
    if isinstance(rank, bool) or not isinstance(rank, int) or rank < 1:
        raise AdapterError(f"{folder}: {_CONFIG} needs a positive integer r, not {rank!r}")
    if isinstance(alpha, bool) or not isinstance(alpha, int | float) or not math.isfinite(alpha) or alpha <= 0:
        raise AdapterError(f"{folder}: {_CONFIG} needs a positive lora_alpha, not {alpha!r}")
    return config


def _tensor_names(path: Path, folder: Path) -> list[str]:
    """The tensor names of a safetensors file, from its header (8 bytes of length, then JSON)."""
    try:
        with path.open("rb") as handle:
            size = int.from_bytes(handle.read(8), "little")
            if not 0 < size <= min(_MAX_HEADER_BYTES, path.stat().st_size - 8):
                raise ValueError(f"a header of {size} bytes")
            header = json.loads(handle.read(size))
    except (OSError, UnicodeDecodeError, ValueError) as exc:
        raise AdapterError(f"{folder}: {_WEIGHTS} is not a safetensors file ({exc})") from exc
    if not isinstance(header, dict):
        raise AdapterError(f"{folder}: {_WEIGHTS} is not a safetensors file (its header is not an object)")
    return [name for name in header if name != "__metadata__"]


def read_adapter(key: str, folder: Path, model: nn.Module) -> Adapter:
    """Load a PEFT LoRA folder for ``model`` (factors cast to the model's dtype and device)."""
    config = _checked_config(folder)  # what check_adapter_folder checks, so the two never disagree
    rank, alpha = config["r"], float(config["lora_alpha"])
    scale = alpha / math.sqrt(rank) if config.get("use_rslora") else alpha / rank
    linears = {name: m for name, m in model.named_modules() if isinstance(m, nn.Linear)}
    dtype, device = next(model.parameters()).dtype, next(model.parameters()).device
    factors: dict[str, dict[str, torch.Tensor]] = {}
    for name, tensor in load_file(folder / _WEIGHTS).items():
        module, _, kind = name.removeprefix(_PREFIX).rpartition(".lora_")
        if kind not in ("A.weight", "B.weight"):
            raise AdapterError(f"{folder}: unexpected tensor {name}")
        factors.setdefault(module, {})[kind[0]] = tensor.to(dtype=dtype, device=device)
    modules = {}
    for module, pair in factors.items():
        linear = linears.get(module)
        if linear is None or set(pair) != {"A", "B"}:
            raise AdapterError(f"{folder}: {module} is not a linear layer of this model, or lacks lora_A/lora_B")
        a, b = pair["A"], pair["B"]
        if a.shape[1] != linear.in_features or b.shape[0] != linear.out_features or a.shape[0] != b.shape[1]:
            raise AdapterError(f"{folder}: {module}'s factors {tuple(a.shape)}, {tuple(b.shape)} do not fit the model")
        modules[module] = LoraModule(a.contiguous(), b.contiguous())
    if not modules:
        raise AdapterError(f"{folder}: the adapter has no LoRA tensors")
    return Adapter(key, scale, modules)


class AdapterCache:
    """Loaded adapters, least recently used evicted past ``capacity_bytes`` (thread-safe).

    A request holds its ``Adapter`` object, so evicting one that still decodes only stops caching it.
    A folder is read once however many requests want it at the same time: the others wait for it.
    """

    def __init__(self, capacity_bytes: int) -> None:
        self.capacity_bytes = capacity_bytes
        self._entries: OrderedDict[str, Adapter] = OrderedDict()
        self._lock = threading.Lock()
        self._loading: dict[str, threading.Lock] = {}  # key -> held while its folder is read
        self.loads = 0  # misses that read a folder: the admin API's and the benchmark's counter

    def get(self, key: str, folder: Path, model: nn.Module) -> Adapter:
        with self._lock:
            adapter = self._cached(key)
            if adapter is not None:
                return adapter
            loading = self._loading.setdefault(key, threading.Lock())
        with loading:
            try:
                with self._lock:
                    adapter = self._cached(key)  # read meanwhile by the request this one waited for
                if adapter is not None:
                    return adapter
                adapter = read_adapter(key, folder, model)  # outside the lock: other lookups go on meanwhile
                with self._lock:
                    self.loads += 1
                    self._entries[key] = adapter
                    self._entries.move_to_end(key)
                    while (
                        len(self._entries) > 1 and sum(a.nbytes for a in self._entries.values()) > self.capacity_bytes
                    ):
                        self._entries.popitem(last=False)
                return adapter
            finally:
                with self._lock:
                    if self._loading.get(key) is loading:  # after a failed read, another may be loading
                        del self._loading[key]

    def _cached(self, key: str) -> Adapter | None:
        """The loaded adapter, now the most recently used (under ``_lock``)."""
        adapter = self._entries.get(key)
        if adapter is not None:
            self._entries.move_to_end(key)
        return adapter

    def drop(self, key: str) -> None:
        with self._lock:
            self._entries.pop(key, None)

    @property
    def resident(self) -> list[str]:
        with self._lock:
            return list(self._entries)

    @property
    def nbytes(self) -> int:
        with self._lock:
            return sum(a.nbytes for a in self._entries.values())


@dataclass(frozen=True, slots=True)
class _Stack:
    """One module's factors for the batch's distinct adapters, padded to the largest rank."""

    a: torch.Tensor  # [adapters, rank, in]
    b: torch.Tensor  # [adapters, out, rank]
    scale: torch.Tensor  # [adapters]


class BatchLora:
    """The per-row adapters of the next forward, applied by hooks on the targeted linear layers."""

    def __init__(self, model: nn.Module) -> None:
        self._linears = {name: m for name, m in model.named_modules() if isinstance(m, nn.Linear)}
        self._device = next(model.parameters()).device
        self._hooked: set[str] = set()
        self._distinct: tuple[str, ...] = ()
        self._stacks: dict[str, _Stack | None] = {}
        self._rows: torch.Tensor | None = None  # batch row -> index into the stacks, for rows with an adapter
        self._slots: torch.Tensor | None = None

    def set_rows(self, adapters: list[Adapter | None]) -> None:
        """Name each row's adapter (None: the base alone) for the forwards that follow."""
        distinct = tuple(dict.fromkeys(a.key for a in adapters if a is not None))
        if not distinct:
            self._rows = self._slots = None
            return
        if distinct != self._distinct:
            by_key = {a.key: a for a in adapters if a is not None}
            self._restack([by_key[k] for k in distinct])
            self._distinct = distinct
        rows = [i for i, a in enumerate(adapters) if a is not None]
        self._rows = torch.tensor(rows, device=self._device)
        slots = [distinct.index(adapters[i].key) for i in rows]  # type: ignore[union-attr]
        self._slots = torch.tensor(slots, device=self._device)

    def _restack(self, adapters: list[Adapter]) -> None:
        targets = {name for adapter in adapters for name in adapter.modules}
        for name in targets - self._hooked:
            self._linears[name].register_forward_hook(self._hook(name))
            self._hooked.add(name)
        self._stacks = {name: self._stack(name, adapters) for name in self._hooked}

    def _stack(self, name: str, adapters: list[Adapter]) -> _Stack | None:
        present = [a.modules.get(name) for a in adapters]
        if not any(present):
            return None
        linear = self._linears[name]
        rank = max(m.a.shape[0] for m in present if m is not None)
        weight = linear.weight
        a = weight.new_zeros((len(adapters), rank, linear.in_features))
        b = weight.new_zeros((len(adapters), linear.out_features, rank))
        for slot, module in enumerate(present):
            if module is not None:
                a[slot, : module.a.shape[0]] = module.a
                b[slot, :, : module.b.shape[1]] = module.b
        scale = weight.new_tensor([adapter.scale for adapter in adapters])
        return _Stack(a, b, scale)

    def _hook(self, name: str) -> Any:
        def add_lora(_module: nn.Module, inputs: tuple[torch.Tensor, ...], output: torch.Tensor) -> torch.Tensor:
            stack = self._stacks.get(name) if self._rows is not None else None
            if stack is None or self._rows is None or self._slots is None:
                return output
            x = inputs[0].index_select(0, self._rows)  # [rows, tokens, in]
            a, b = stack.a.index_select(0, self._slots), stack.b.index_select(0, self._slots)
            delta = torch.bmm(torch.bmm(x, a.transpose(1, 2)), b.transpose(1, 2))
            delta = delta * stack.scale.index_select(0, self._slots)[:, None, None]
            return output.index_add(0, self._rows, delta)

        return add_lora
