"""AdamW with its state on the host: the torch backend's optimizer CPU offload.

AdamW keeps two float32 moments per parameter, twice the weights' own memory; on the accelerator
with float32 weights and gradients that is half of what training holds before activations. Here the
device keeps the weights and gradients; the host keeps a float32 master copy of every weight and the
moments. A step copies the gradients to the host, steps there and copies the weights back, which
costs host time each step and frees the moments' memory on the device (megatron's distributed
optimizer offload is the same idea, overlapped with the copies).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch


class HostAdamW(torch.optim.Optimizer):
    def __init__(self, groups: Iterable[dict[str, Any]], *, lr: float, weight_decay: float) -> None:
        groups = [dict(group) for group in groups]
        super().__init__(groups, {"lr": lr, "weight_decay": weight_decay})
        pin = torch.cuda.is_available()
        self._pairs: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = []  # param, master, grad buffer
        host_groups = []
        for group in self.param_groups:
            masters = []
            for param in group["params"]:
                master = param.detach().to("cpu", dtype=torch.float32, copy=True)
                master = master.pin_memory() if pin else master
                master.requires_grad_(True)
                # The gradient's host buffer, kept: a fresh one per step would be pageable and slow.
                buffer = torch.zeros_like(master).pin_memory() if pin else torch.zeros_like(master)
                self._pairs.append((param, master, buffer))
                masters.append(master)
            host_groups.append({**{k: v for k, v in group.items() if k != "params"}, "params": masters})
        # fused: one vectorised kernel over all tensors on the CPU (several times the per-tensor loop).
        self._host = torch.optim.AdamW(host_groups, lr=lr, weight_decay=weight_decay, fused=True)
        self._on_gpu = any(param.is_cuda for param, _, _ in self._pairs)

    @torch.no_grad()
    def step(self, closure: Any = None) -> None:  # type: ignore[override]
        for param, master, buffer in self._pairs:
            # No gradient: AdamW leaves the parameter and its moments alone, so the host step must too.
            master.grad = None if param.grad is None else buffer.copy_(param.grad, non_blocking=True)
        if self._on_gpu:
            torch.cuda.synchronize()  # the gradients are on the host before the step reads them
        for group, host_group in zip(self.param_groups, self._host.param_groups, strict=True):
            host_group["lr"] = group["lr"]  # a scheduler changes the visible groups
        self._host.step()
        for param, master, _ in self._pairs:
            param.copy_(master, non_blocking=True)
        if self._on_gpu:
            torch.cuda.synchronize()  # the pinned masters must not change under a pending copy

    def zero_grad(self, set_to_none: bool = True) -> None:
        super().zero_grad(set_to_none=set_to_none)  # the device's; the host buffers are overwritten
