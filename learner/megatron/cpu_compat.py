"""Running megatron-core on a machine without CUDA: the few patches it needs, applied only there.

megatron-core assumes a GPU in a handful of places (shared/reference/megatron-core-cpu.md §2-§4):
rotary embeddings and the attention buffer ask ``torch.cuda.current_device()``, the default causal
mask is built on ``"cuda"``, activation recompute saves the CUDA generator's state, gradient
buffers and the MoE token dispatcher use CUDA streams, pipeline sends synchronise the device, and
the DDP wrapper, optimizer and pipeline schedules create tensors on ``"cuda"`` and compare
``param.type()`` with ``"torch.cuda.FloatTensor"``. ``apply_cpu_patches`` fixes the device queries,
streams, synchronisation, mask and RNG state for the process;
``cuda_as_cpu`` is a ``TorchFunctionMode`` that redirects the rest while it is active. On a CUDA
machine both do nothing, so the GPU path runs megatron-core unchanged.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch.overrides import TorchFunctionMode

__all__ = ["apply_cpu_patches", "cuda_as_cpu", "on_cpu", "patch_missing_te"]

_patched = False


def on_cpu() -> bool:
    """True when this process has no CUDA device: the patches below are needed."""
    return not torch.cuda.is_available()


def _cpu_causal_mask(sq: int) -> torch.Tensor:
    return torch.triu(torch.ones(sq, sq, dtype=torch.bool), diagonal=1)


class _NoStream:
    """The one stream there is without CUDA: gradient buffers and the MoE token dispatcher wait on
    streams and events; on the CPU everything has already happened."""

    def wait_event(self, event: object) -> None:
        return None

    def wait_stream(self, stream: object) -> None:
        return None

    def record_event(self, event: object = None) -> _NoStream:
        return self  # an "event" whose synchronize() returns at once

    def synchronize(self) -> None:
        return None


_NO_STREAM = _NoStream()


def _host_copy(tensor: Any, as_numpy: bool = False, record_stream: bool = False) -> Any:
    """megatron's device-to-host copy of the MoE dispatcher's sizes makes numpy arrays of CUDA tensors
    only; ``all_to_all_single`` refuses split sizes given as a tensor (expert parallel on the CPU)."""
    return tensor.numpy() if as_numpy and torch.is_tensor(tensor) else tensor


def patch_missing_te() -> None:
    """What megatron-core 0.16 gets wrong without TransformerEngine (CPU or GPU; idempotent).

    * Its MoE router reads ``moe_utils.te_general_gemm``, which is only defined when TE imports:
      every MoE forward raises NameError. None selects its plain torch matmul.
    * Multi-latent attention takes TE's layer classes from ``extensions.transformer_engine``, which
      imports without TE and then defines them as ``MagicMock`` objects; MLA believes TE is there and
      its ``isinstance`` check on them raises TypeError while the layer is built.
    """
    from megatron.core.extensions import transformer_engine
    from megatron.core.transformer import multi_latent_attention
    from megatron.core.transformer.moe import moe_utils

    if not hasattr(moe_utils, "te_general_gemm"):
        moe_utils.te_general_gemm = None  # type: ignore[attr-defined]
    if not transformer_engine.HAVE_TE:
        multi_latent_attention.HAVE_TE = False


def apply_cpu_patches() -> None:
    """Patch torch.cuda and megatron-core for a CUDA-less process (idempotent; a no-op with CUDA).

    Call it before the first model forward: ``RotaryEmbedding.forward`` caches its result.
    """
    global _patched
    if _patched or not on_cpu():
        return
    from megatron.core.fusions import fused_softmax
    from megatron.core.tensor_parallel import random as megatron_random
    from megatron.core.transformer import utils as transformer_utils
    from megatron.core.transformer.moe import token_dispatcher
    from megatron.core.transformer.moe.token_dispatcher import MoEAlltoAllTokenDispatcher

    torch.cuda.current_device = lambda: torch.device("cpu")  # type: ignore[assignment,return-value]
    torch.cuda.current_stream = lambda device=None: _NO_STREAM  # type: ignore[assignment,misc,return-value]
    torch.cuda.stream = lambda stream=None: contextlib.nullcontext()  # type: ignore[assignment,misc]
    # Pipeline stages synchronise the device around their sends and receives; CPU ops are done already.
    torch.cuda.synchronize = lambda device=None: None  # type: ignore[assignment]
    # The dispatcher makes its side stream once, as a class attribute; torch.cuda.Stream itself stays
    # (other libraries use it in annotations).
    MoEAlltoAllTokenDispatcher.cuda_dtoh_stream = _NO_STREAM
    token_dispatcher.maybe_move_tensor_to_cpu = _host_copy  # imported there by name
    transformer_utils.get_default_causal_mask = _cpu_causal_mask
    fused_softmax.get_default_causal_mask = _cpu_causal_mask  # imported there by name
    # Activation recompute saves and restores the CUDA generator around each checkpointed chunk;
    # there is none (dropout uses the CPU generator, which megatron saves as well).
    megatron_random._get_cuda_rng_state = lambda *args, **kwargs: torch.empty(0, dtype=torch.uint8)
    megatron_random._set_cuda_rng_state = lambda *args, **kwargs: None
    _patched = True


def _is_cuda(device: object) -> bool:
    if isinstance(device, torch.device):
        return device.type == "cuda"
    if isinstance(device, str):
        return device.startswith("cuda")
    return isinstance(device, int) and not isinstance(device, bool)  # a bare index means a CUDA device


class _CudaAsCpu(TorchFunctionMode):
    """Redirects CUDA placements to the CPU and makes CPU tensors report CUDA type names."""

    def __torch_function__(
        self,
        func: Callable[..., Any],
        types: Any,
        args: tuple[Any, ...] = (),
        kwargs: dict[str, Any] | None = None,
    ) -> Any:
        kwargs = dict(kwargs or {})
        if _is_cuda(kwargs.get("device")):
            kwargs["device"] = torch.device("cpu")
        if kwargs.get("pin_memory"):  # pinning needs CUDA (YaRN's RoPE cache under context parallel asks)
            kwargs["pin_memory"] = False
        if func is torch.Tensor.cuda:
            return args[0]
        if func is torch.Tensor.to:
            args = tuple(torch.device("cpu") if _is_cuda(a) else a for a in args)
        result = func(*args, **kwargs)
        if func is torch.Tensor.type and len(args) == 1 and isinstance(result, str) and "cuda" not in result:
            return result.replace("torch.", "torch.cuda.", 1)  # megatron asserts on "torch.cuda.FloatTensor"
        return result


@contextlib.contextmanager
def cuda_as_cpu() -> Iterator[None]:
    """While active, megatron's hard-coded ``"cuda"`` tensors land on the CPU (nothing to do with CUDA).

    Enter it around DDP construction, the optimizer's construction and step, and the pipeline schedule.
    """
    if not on_cpu():
        yield
        return
    with _CudaAsCpu():
        yield
