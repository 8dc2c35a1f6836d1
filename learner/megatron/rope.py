"""Rotary position embeddings in five kernels each way, in place of megatron-core's unfused path.

Without TransformerEngine megatron applies RoPE to queries and keys as ``t * cos + rotate_half(t) *
sin`` and concatenates an empty pass-through part back on: about a dozen kernels per tensor in the
forward (``cos`` and ``sin`` of the frequencies recomputed every call, a negation, two
concatenations) and as many again in the backward, 11 ms of device time in a 1.5B step on an H200
and a host launch each. Here the products go straight into the halves of one output (a rotation by
the angle, and by minus it for the gradient), and ``cos`` and ``sin`` are computed once per
frequency tensor (megatron caches that tensor, and every layer gets the same one).

Only the layout the dense models use takes this path (rotate-half pairs, the whole head rotated, no
packed ``thd`` offsets, no attention-scaling factor); anything else goes to megatron's function.
"""

from __future__ import annotations

from typing import Any

import torch
from megatron.core.models.common.embeddings import rope_utils
from torch import Tensor

__all__ = ["apply_rotary_pos_emb", "install_rope"]

_megatron_rope = rope_utils.apply_rotary_pos_emb


class _Rotation(torch.autograd.Function):
    """``[x1, x2] -> [x1 c - x2 s, x2 c + x1 s]`` over the last dimension's halves."""

    @staticmethod
    def forward(ctx: Any, t: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
        ctx.save_for_backward(cos, sin)
        return _rotate(t, cos, sin, inverse=False)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, None, None]:
        cos, sin = ctx.saved_tensors
        return _rotate(grad, cos, sin, inverse=True), None, None  # a rotation's transpose is its inverse


def _rotate(t: Tensor, cos: Tensor, sin: Tensor, *, inverse: bool) -> Tensor:
    """Rotate by the angles (``cos`` over the whole head, ``sin`` over one half), or by minus them.

    Each product is rounded before the sum, as in ``t * cos + rotate_half(t) * sin`` (transformers'
    and megatron's form): the same result bit for bit.
    """
    x1, x2 = t.chunk(2, dim=-1)
    out = t * cos
    o1, o2 = out.chunk(2, dim=-1)
    if inverse:
        o1.add_(x2 * sin)
        o2.sub_(x1 * sin)
    else:
        o1.sub_(x2 * sin)
        o2.add_(x1 * sin)
    return out


class _CosSin:
    """``cos`` of the last frequency tensor seen and ``sin`` of its first half (megatron's rotate-half
    frequencies are ``cat(f, f)``), in the activations' dtype."""

    def __init__(self) -> None:
        self._last: tuple[Tensor, torch.dtype, Tensor, Tensor] | None = None

    def __call__(self, freqs: Tensor, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
        if self._last is None or self._last[0] is not freqs or self._last[1] != dtype:
            half = freqs[..., : freqs.shape[-1] // 2]
            self._last = (freqs, dtype, freqs.cos().to(dtype), half.sin().to(dtype))
        return self._last[2], self._last[3]


_cos_sin = _CosSin()


def apply_rotary_pos_emb(
    t: Tensor,
    freqs: Tensor,
    config: Any,
    cu_seqlens: Tensor | None = None,
    mscale: float = 1.0,
    cp_group: Any = None,
) -> Tensor:
    """megatron's ``apply_rotary_pos_emb`` (same arguments and result), fewer kernels where it can."""
    plain = (
        cu_seqlens is None
        and mscale == 1.0
        and freqs.shape[-1] == t.shape[-1]
        and not (config.rotary_interleaved or config.multi_latent_attention or config.apply_rope_fusion)
        and getattr(config, "mrope_section", None) is None
    )
    if not plain:
        return _megatron_rope(t, freqs, config=config, cu_seqlens=cu_seqlens, mscale=mscale, cp_group=cp_group)
    return _Rotation.apply(t, *_cos_sin(freqs, t.dtype))


def install_rope() -> None:
    """Have megatron's attention layers call ``apply_rotary_pos_emb`` above."""
    from megatron.core.transformer import attention

    attention.apply_rotary_pos_emb = apply_rotary_pos_emb
