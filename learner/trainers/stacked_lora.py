"""Many LoRA adapters over one frozen model, trained together: every row of a batch goes through its
own adapter (the serving engine's Punica / S-LoRA gather, made trainable).

Each targeted ``nn.Linear`` gets stacked factors ``A [S, r, in]`` and ``B [S, out, r]`` (one slot per
adapter) and a forward hook that adds ``scale * (dropout(x) A[row]^T) B[row]^T`` for each row, so the
base runs one forward for all of them and each adapter's gradient reaches its own slot only. AdamW
is elementwise, so one optimizer over the stacks updates every slot as its own optimizer would;
gradient clipping is per slot (``clip_per_slot``), as each adapter alone would be clipped.

Slots are initialised as peft initialises a fresh LoRA (A Kaiming-uniform, B zero: training starts
from the base's own answers) or loaded from a PEFT folder, and each is exported as one
(``export_slot``): the folders are the ones peft, the engines and ``export_adapter`` write.
"""

from __future__ import annotations

import contextlib
import json
import math
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file
from torch import Tensor, nn

from learner.trainers.checkpoint import ExportResult, publish_folder
from learner.trainers.train_config import AdapterSpec

__all__ = ["StackedLoRA", "spec_of_folder"]

_PREFIX = "base_model.model."  # peft's prefix of the wrapped model's module names


def spec_of_folder(folder: Path) -> AdapterSpec:
    """The ``AdapterSpec`` a PEFT LoRA folder was trained with (rank, alpha, dropout, targets)."""
    config = json.loads((folder / "adapter_config.json").read_text())
    targets = config["target_modules"]
    return AdapterSpec(
        rank=int(config["r"]),
        alpha=config["lora_alpha"],
        dropout=float(config.get("lora_dropout") or 0.0),
        target_modules=tuple(sorted(targets)) if isinstance(targets, list) else (targets,),
    )


class StackedLoRA(nn.Module):
    """``slots`` LoRA adapters of one ``spec`` hooked into ``model`` (frozen here); ``rows`` picks each
    row's slot for the forwards inside it."""

    def __init__(self, model: nn.Module, spec: AdapterSpec, slots: int) -> None:
        super().__init__()
        if slots < 1:
            raise ValueError(f"slots must be >= 1, got {slots}")
        model.requires_grad_(False)
        self.spec = spec
        self.slots = slots
        self.scale = spec.alpha / spec.rank
        self.dropout = nn.Dropout(spec.dropout) if spec.dropout > 0 else nn.Identity()
        self.linears = {name: m for name, m in model.named_modules() if _targeted(name, m, spec.target_modules)}
        if not self.linears:
            raise ValueError(f"no linear layer of the model matches the target modules {list(spec.target_modules)}")
        parameter = next(model.parameters())
        self.a = nn.ParameterDict()
        self.b = nn.ParameterDict()
        for name, linear in self.linears.items():
            key = name.replace(".", "/")  # ParameterDict keys cannot hold dots
            a = torch.empty(slots, spec.rank, linear.in_features, dtype=parameter.dtype, device=parameter.device)
            for slot in a:
                nn.init.kaiming_uniform_(slot, a=math.sqrt(5))  # peft's (and nn.Linear's) initialisation
            self.a[key] = nn.Parameter(a)
            self.b[key] = nn.Parameter(a.new_zeros(slots, linear.out_features, spec.rank))
        self._rows: Tensor | None = None
        self._handles = [linear.register_forward_hook(self._hook(name)) for name, linear in self.linears.items()]

    @contextlib.contextmanager
    def rows(self, slots: Tensor | int) -> Iterator[None]:
        """Forwards in this block run row ``i`` of their batch through adapter ``slots[i]`` (an int:
        every row through that one)."""
        self._rows = torch.as_tensor(slots, dtype=torch.long, device=next(self.parameters()).device)
        try:
            yield
        finally:
            self._rows = None

    def _hook(self, name: str) -> Any:
        key = name.replace(".", "/")

        def add_lora(_module: nn.Module, inputs: tuple[Tensor, ...], output: Tensor) -> Tensor:
            if self._rows is None:
                raise RuntimeError("StackedLoRA: a forward ran outside rows(...): which adapter serves which row?")
            x = inputs[0]
            rows = self._rows.expand(x.shape[0]) if self._rows.dim() == 0 else self._rows
            a = self.a[key].index_select(0, rows)  # [B, r, in]
            b = self.b[key].index_select(0, rows)  # [B, out, r]
            low = torch.bmm(self.dropout(x), a.transpose(1, 2))
            return output + self.scale * torch.bmm(low, b.transpose(1, 2))

        return add_lora

    def clip_per_slot(self, max_norm: float) -> Tensor:
        """Clip each slot's gradient to ``max_norm`` by its own norm (as ``clip_grad_norm_`` clips one
        adapter alone) and return the ``[slots]`` norms before clipping."""
        grads = [p.grad for p in self.parameters() if p.grad is not None]
        if not grads:
            return torch.zeros(self.slots)
        norms = torch.stack([g.float().pow(2).flatten(1).sum(1) for g in grads]).sum(0).sqrt()
        if math.isfinite(max_norm):
            coef = (max_norm / (norms + 1e-6)).clamp(max=1.0)
            for grad in grads:
                grad.mul_(coef.view(-1, *[1] * (grad.dim() - 1)).to(grad.dtype))
        return norms

    def load_slot(self, slot: int, folder: Path) -> None:
        """Slot ``slot`` takes a stored PEFT adapter's weights (trained with this spec).

        Raises:
            ValueError: the folder's spec or modules differ from this stack's.
        """
        stored = spec_of_folder(folder)
        mine = (self.spec.rank, self.spec.alpha, tuple(sorted(self.spec.target_modules)))
        if (stored.rank, stored.alpha, stored.target_modules) != mine:
            raise ValueError(f"{folder}: trained with another rank, alpha or target modules than this stack's")
        tensors = load_file(folder / "adapter_model.safetensors")
        names = {f"{_PREFIX}{name}.lora_{kind}.weight" for name in self.linears for kind in "AB"}
        if set(tensors) != names:
            raise ValueError(f"{folder}: its LoRA modules are not this model's targeted layers")
        with torch.no_grad():
            for name in self.linears:
                key = name.replace(".", "/")
                self.a[key][slot].copy_(tensors[f"{_PREFIX}{name}.lora_A.weight"])
                self.b[key][slot].copy_(tensors[f"{_PREFIX}{name}.lora_B.weight"])

    def export_slot(self, slot: int, out_dir: Path, base_model_dir: Path) -> ExportResult:
        """Write slot ``slot`` as a PEFT adapter folder (config and safetensors), atomically."""
        spec = self.spec
        config = {
            "peft_type": "LORA",
            "task_type": "CAUSAL_LM",
            "base_model_name_or_path": str(base_model_dir),
            "r": spec.rank,
            "lora_alpha": spec.alpha,
            "lora_dropout": spec.dropout,
            "target_modules": sorted(spec.target_modules),
            "bias": "none",
            "use_rslora": False,
            "use_dora": False,
            "fan_in_fan_out": False,
            "inference_mode": True,
        }
        tensors = {}
        for name in self.linears:
            key = name.replace(".", "/")
            tensors[f"{_PREFIX}{name}.lora_A.weight"] = self.a[key][slot].detach().cpu().contiguous()
            tensors[f"{_PREFIX}{name}.lora_B.weight"] = self.b[key][slot].detach().cpu().contiguous()

        def write(staging: Path) -> None:
            staging.mkdir()
            save_file(tensors, staging / "adapter_model.safetensors", metadata={"format": "pt"})
            (staging / "adapter_config.json").write_text(json.dumps(config, indent=2) + "\n")

        return publish_folder(Path(out_dir), write)


def _targeted(name: str, module: nn.Module, targets: tuple[str, ...]) -> bool:
    """peft's rule for a list of target names: the module's name is one, or ends with ``.`` + one."""
    return isinstance(module, nn.Linear) and any(name == t or name.endswith(f".{t}") for t in targets)
