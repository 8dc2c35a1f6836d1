"""Fused elementwise code for megatron-core on CUDA without TransformerEngine, through ``torch.compile``.

TransformerEngine fuses RoPE and SwiGLU; without it megatron-core runs each as a chain of
elementwise kernels (RoPE: multiply, split, negate, concatenate, multiply, add, concatenate, for
queries and keys of every layer, and as many again backward). SwiGLU has megatron's own switch,
``bias_activation_fusion``, whose kernel megatron compiles itself (``megatron.core.jit``); RoPE has
none without TE, so ``install_compiled_rope`` compiles megatron's own unfused function. Both are the
same math as the eager code, one kernel each way; on the CPU everything stays eager (no compile
time in CI, and the numerics the conversion tests check).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor

__all__ = ["install_compiled_rope"]


@functools.cache
def rope_functions() -> tuple[Callable[..., Tensor], Callable[..., Tensor]]:
    """megatron's unfused RoPE (the ``[s, b, heads, dim]`` form, what unpacked rows use) and its
    ``torch.compile``'d form."""
    from megatron.core.models.common.embeddings import rope_utils

    eager = rope_utils._apply_rotary_pos_emb_bshd
    return eager, torch.compile(eager, dynamic=True)


@functools.cache
def install_compiled_rope() -> None:
    """Route megatron's RoPE through the compiled form for CUDA tensors; CPU tensors stay eager."""
    from megatron.core.models.common.embeddings import rope_utils

    eager, compiled = rope_functions()

    def apply(t: Tensor, freqs: Tensor, *args: Any, **kwargs: Any) -> Tensor:
        return (compiled if t.is_cuda else eager)(t, freqs, *args, **kwargs)

    rope_utils._apply_rotary_pos_emb_bshd = apply
