"""Pinned memory made a no-op in SGLang's processes on a machine without an accelerator.

This folder is on an SGLang CPU server's ``PYTHONPATH`` (``environment.cpu_environment``), so Python
imports this module at start-up in every SGLang process, the scheduler and detokenizer children
included (they inherit the variable). It imports nothing itself: a one-shot import hook patches
``torch`` right after it loads.

Why: SGLang 0.5.23's LoRA path stages host-to-device copies in pinned memory (``pin_memory=True``
in sglang/srt/lora/layers.py at start-up, ``Tensor.pin_memory()`` and ``pin_memory=True`` in
sglang/srt/lora/backend/torch_backend.py's ``prepare_lora_batch`` for every LoRA batch). Without an
accelerator torch has no pinned allocator and both raise, so ``--enable-lora`` crashed the server.
Here "pinned" host memory is just host memory: ``Tensor.pin_memory()`` returns the tensor and the
factories drop the argument. Nothing is patched where an accelerator exists, and nothing else
changes: only calls that would have raised behave differently.
"""

from __future__ import annotations

import functools
import importlib.abc
import importlib.machinery
import sys
from collections.abc import Callable, Sequence
from types import ModuleType
from typing import Any

_FACTORIES = (
    "tensor",
    "empty",
    "zeros",
    "ones",
    "full",
    "arange",
    "empty_like",
    "zeros_like",
    "ones_like",
    "full_like",
)


def _without_pinning(factory: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(factory)
    def call(*args: Any, **kwargs: Any) -> Any:
        kwargs.pop("pin_memory", None)
        return factory(*args, **kwargs)

    return call


def _patch(torch: ModuleType) -> None:
    if torch.accelerator.is_available():
        return
    torch.Tensor.pin_memory = lambda self, device=None: self
    for name in _FACTORIES:
        setattr(torch, name, _without_pinning(getattr(torch, name)))


class _PatchTorchOnImport(importlib.abc.MetaPathFinder):
    def find_spec(
        self, fullname: str, path: Sequence[str] | None, target: ModuleType | None = None
    ) -> importlib.machinery.ModuleSpec | None:
        if fullname != "torch":
            return None
        sys.meta_path.remove(self)  # one shot, and the lookup below must not find this hook again
        spec = importlib.machinery.PathFinder.find_spec(fullname, path)
        if spec is None or spec.loader is None:
            return spec
        execute = spec.loader.exec_module

        def execute_then_patch(module: ModuleType) -> None:
            execute(module)
            _patch(module)

        spec.loader.exec_module = execute_then_patch  # type: ignore[method-assign]
        return spec


if "torch" in sys.modules:
    _patch(sys.modules["torch"])
else:
    sys.meta_path.insert(0, _PatchTorchOnImport())
