"""torch's fused and multi-tensor kernels in place of megatron-core's fallbacks without TE or Apex.

Without TransformerEngine or Apex, megatron-core falls back to loops over the tensors: the gradient
norm is one ``torch.norm`` per tensor gathered by ``torch.tensor(list)`` (a device sync per tensor,
about 340 on a 1.5B model), the main-to-model weight copy writes ``src * 1.0`` through a temporary,
and AdamW runs its multi-kernel form. torch has all three as multi-tensor kernels with the same
math: ``_foreach_norm``, ``_foreach_copy_`` / ``_foreach_mul_`` and the fused AdamW.

Apex's weight-gradient GEMM that accumulates straight into the float32 ``main_grad`` (megatron's
``gradient_accumulation_fusion``) is a single ``addmm`` with ``out_dtype`` in torch on CUDA.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

__all__ = [
    "WeightGradientAccumulation",
    "fuse_weight_gradient_accumulation",
    "install_multi_tensor_kernels",
    "use_fused_adamw",
]


def multi_tensor_l2_norm(
    chunk_size: int, noop_flag: Tensor, tensor_lists: list[list[Tensor]], per_tensor: bool, *args: Any
) -> tuple[Tensor, None]:
    """The l2 norm over every tensor of ``tensor_lists[0]``, as ``amp_C.multi_tensor_l2norm``: a
    one-element float32 tensor on their device, no host sync."""
    norms = torch._foreach_norm(tensor_lists[0], 2, dtype=torch.float32)
    return torch.linalg.vector_norm(torch.stack(norms)).reshape(1), None


def multi_tensor_scale(chunk_size: int, noop_flag: Tensor, tensor_lists: list[list[Tensor]], scale: float) -> None:
    """``tensor_lists[1][i] = tensor_lists[0][i] * scale``, as ``amp_C.multi_tensor_scale`` (casting
    to the destination's dtype)."""
    sources, destinations = tensor_lists
    if all(s is d for s, d in zip(sources, destinations, strict=True)):
        torch._foreach_mul_(destinations, scale)
        return
    torch._foreach_copy_(destinations, sources if scale == 1.0 else torch._foreach_mul(sources, scale))


def install_multi_tensor_kernels() -> None:
    """Point megatron's optimizer modules at the kernels above where they hold the local loops."""
    from megatron.core import utils
    from megatron.core.optimizer import clip_grads, optimizer

    for module in (clip_grads, optimizer):
        if getattr(module, "multi_tensor_scale_impl", None) is utils.local_multi_tensor_scale:
            module.multi_tensor_scale_impl = multi_tensor_scale
    if getattr(clip_grads, "l2_norm_impl", None) is utils.local_multi_tensor_l2_norm:
        clip_grads.l2_norm_impl = multi_tensor_l2_norm


def use_fused_adamw(optimizer: Any) -> None:
    """Without TransformerEngine or Apex, megatron steps torch's AdamW in its multi-kernel (foreach) form,
    30 ms of a 1.5B model's step on an H200 (torch's fused kernel: 8 ms): switch the groups to the fused
    kernel, same math. A CPU-offloaded optimizer is megatron's hybrid one and already fused."""
    for inner in getattr(optimizer, "chained_optimizers", [optimizer]):
        if isinstance(inner.optimizer, torch.optim.AdamW):
            for group in inner.optimizer.param_groups:
                group["foreach"], group["fused"] = False, True


class WeightGradientAccumulation:
    """Apex's ``fused_weight_gradient_mlp_cuda``: ``main_grad += grad_output^T @ input`` in one GEMM.

    Without it megatron writes each weight gradient as a bf16 tensor, and DDP's hook then adds it to
    the float32 ``main_grad`` (a kernel and a read and write of the buffer per weight, 6 ms of a 1.5B
    step on an H200); the fused GEMM accumulates in float32 and never rounds the gradient to bf16.
    """

    @staticmethod
    def wgrad_gemm_accum_fp32(total_input: Tensor, grad_output: Tensor, main_grad: Tensor) -> None:
        """``total_input`` ``[N, in]`` and ``grad_output`` ``[N, out]`` (any dtype) into float32 ``main_grad`` ``[out, in]``."""
        if total_input.dtype == main_grad.dtype:
            main_grad.addmm_(grad_output.t(), total_input)
        elif main_grad.is_cuda:
            torch.addmm(main_grad, grad_output.t(), total_input, out_dtype=main_grad.dtype, out=main_grad)
        else:  # torch has no mixed-dtype GEMM on the CPU
            main_grad.addmm_(grad_output.t().to(main_grad.dtype), total_input.to(main_grad.dtype))

    @staticmethod
    def wgrad_gemm_accum_fp16(total_input: Tensor, grad_output: Tensor, main_grad: Tensor) -> None:
        """The same into a bf16 or fp16 ``main_grad`` (``grad_reduce_in_fp32=False``)."""
        main_grad.addmm_(grad_output.t(), total_input)


def fuse_weight_gradient_accumulation(model: torch.nn.Module) -> None:
    """Have every tensor-parallel linear layer of ``model`` accumulate its weight gradient into
    ``main_grad`` within the GEMM (``WeightGradientAccumulation``).

    Needs megatron's DDP around ``model`` (it creates ``main_grad``) before the next forward. A tied
    output weight also gets the embedding's gradient: megatron zeroes the placeholder gradient it
    hands to autograd for such a weight (``zero_out_wgrad``), and DDP's hook adds the rest.
    """
    from megatron.core.tensor_parallel import layers

    layers.fused_weight_gradient_mlp_cuda = WeightGradientAccumulation  # megatron's backward reads this name
    for module in model.modules():
        if isinstance(module, layers.ColumnParallelLinear | layers.RowParallelLinear):
            module.gradient_accumulation_fusion = True
