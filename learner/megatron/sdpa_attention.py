"""Core attention for megatron-core's layer spec through torch's ``scaled_dot_product_attention``.

The local spec's ``DotProductAttention`` materialises ``[b * heads, s, s]`` scores (baddbmm, softmax,
bmm) and refuses packed sequences. This module takes its place in ``SelfAttention``: on a GPU, SDPA
dispatches to flash or memory-efficient kernels; on the CPU it is the same math fused. Packed rows
(``qkv_format="thd"``, what the trainer feeds) attend one sample at a time with ``is_causal``, so no
``[T, T]`` mask is built and every segment can use the flash kernel.

Dropout uses torch's default generator, not megatron's RNG tracker (tandem trains with dropout 0).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from megatron.core import parallel_state
from megatron.core.packed_seq_params import PackedSeqParams
from megatron.core.transformer.enums import AttnMaskType
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.transformer_config import TransformerConfig
from megatron.core.utils import divide
from torch import Tensor

__all__ = ["SDPAttention"]


class SDPAttention(MegatronModule):
    """Drop-in for ``DotProductAttention`` (same constructor and forward signatures), also as MLA's core
    attention (keys of another head size than values)."""

    def __init__(
        self,
        config: TransformerConfig,
        layer_number: int,
        attn_mask_type: AttnMaskType,
        attention_type: str,
        attention_dropout: float | None = None,
        softmax_scale: float | None = None,
        cp_comm_type: str | None = None,
        pg_collection: object | None = None,
        k_channels: int | None = None,
        v_channels: int | None = None,
    ) -> None:
        # Multi-latent attention passes its key and value head sizes; SDPA reads them off the tensors.
        super().__init__(config=config)
        if config.context_parallel_size != 1:
            raise ValueError("SDPAttention sees whole sequences: context_parallel_size must be 1")
        if config.window_size is not None:
            raise ValueError("SDPAttention has no sliding-window attention")
        tp_group = getattr(pg_collection, "tp", None)
        tp = tp_group.size() if tp_group is not None else parallel_state.get_tensor_model_parallel_world_size()
        self.heads = divide(config.num_attention_heads, tp)
        self.groups = divide(config.num_query_groups or config.num_attention_heads, tp)
        self.attn_mask_type = attn_mask_type
        self.scale = softmax_scale if softmax_scale is not None else 1.0 / math.sqrt(config.kv_channels)
        self.dropout = config.attention_dropout if attention_dropout is None else attention_dropout

    def forward(
        self,
        query: Tensor,
        key: Tensor,
        value: Tensor,
        attention_mask: Tensor | None,
        attn_mask_type: AttnMaskType | None = None,
        attention_bias: Tensor | None = None,
        packed_seq_params: PackedSeqParams | None = None,
    ) -> Tensor:
        """``[s, b, heads * head_dim]`` from ``[s, b, heads|groups, head_dim]`` (or ``[t, ...]`` packed)."""
        if attention_bias is not None:
            raise ValueError("SDPAttention takes no attention bias")
        if packed_seq_params is None:
            return self._attend(query, key, value, attention_mask)
        if packed_seq_params.qkv_format != "thd":
            raise ValueError(f"SDPAttention packs only qkv_format='thd', got {packed_seq_params.qkv_format!r}")
        lengths = packed_seq_params.cu_seqlens_q.diff().tolist()  # host tensor: no device sync
        # split, not slices: a slice's backward writes a zero gradient of the whole row per segment.
        segments = zip(*(x.split(lengths) for x in (query, key, value)), strict=True)
        return torch.cat([self._attend(q[:, None], k[:, None], v[:, None], None)[:, 0] for q, k, v in segments])

    def _attend(self, query: Tensor, key: Tensor, value: Tensor, attention_mask: Tensor | None) -> Tensor:
        seq, batch = query.shape[:2]
        q, k, v = (x.permute(1, 2, 0, 3) for x in (query, key, value))  # [b, heads, s, head_dim]
        # Megatron's masks are True where attention is NOT allowed; SDPA's bool masks the opposite.
        mask = None if attention_mask is None else ~attention_mask
        out = F.scaled_dot_product_attention(
            q,
            k,
            v,
            attn_mask=mask,
            dropout_p=self.dropout if self.training else 0.0,
            is_causal=mask is None,
            scale=self.scale,
            enable_gqa=self.heads != self.groups,
        )
        return out.permute(2, 0, 1, 3).reshape(seq, batch, -1)
