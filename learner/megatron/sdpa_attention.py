"""Core attention for megatron-core's layer spec through torch's ``scaled_dot_product_attention``.

The local spec's ``DotProductAttention`` materialises ``[b * heads, s, s]`` scores (baddbmm, softmax,
bmm) and refuses packed sequences. This module takes its place in ``SelfAttention``: on a GPU, SDPA
dispatches to flash or memory-efficient kernels; on the CPU it is the same math fused. Packed rows
(``qkv_format="thd"``, what the trainer feeds) attend one sample at a time with ``is_causal``, so no
``[T, T]`` mask is built and every segment can use the flash kernel.

Context parallel (``context_parallel_size`` > 1, packed rows only) is the all-gather-KV form, as in
Llama 3's training, not a ring exchange: each rank holds two chunks of every segment
(``context_parallel``: chunks ``r`` and ``2 * cp - 1 - r``), all-gathers every rank's keys and values
(one collective per layer; its backward reduce-scatters their gradients), puts them back in each
segment's order, and attends each local query chunk to the keys up to its own end, causal along the
lower-right diagonal (``causal_lower_right``: the chunk's global offset). Each rank keeps the whole
row's keys and values of the layer for the backward.

Dropout uses torch's default generator, not megatron's RNG tracker (tandem trains with dropout 0).
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist
import torch.nn.functional as F
from megatron.core import parallel_state
from megatron.core.packed_seq_params import PackedSeqParams
from megatron.core.transformer.enums import AttnMaskType
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.transformer_config import TransformerConfig
from megatron.core.utils import divide
from torch import Tensor
from torch.nn.attention.bias import CausalBias, causal_lower_right

from learner.megatron.context_parallel import all_gather, gather_order

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
        if config.window_size is not None:
            raise ValueError("SDPAttention has no sliding-window attention")
        tp_group = getattr(pg_collection, "tp", None)
        tp = tp_group.size() if tp_group is not None else parallel_state.get_tensor_model_parallel_world_size()
        self.heads = divide(config.num_attention_heads, tp)
        self.groups = divide(config.num_query_groups or config.num_attention_heads, tp)
        self.attn_mask_type = attn_mask_type
        self.scale = softmax_scale if softmax_scale is not None else 1.0 / math.sqrt(config.kv_channels)
        self.dropout = config.attention_dropout if attention_dropout is None else attention_dropout
        self.cp_group: dist.ProcessGroup | None = None
        if config.context_parallel_size > 1:
            cp_group = getattr(pg_collection, "cp", None)
            self.cp_group = cp_group if cp_group is not None else parallel_state.get_context_parallel_group()

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
        if packed_seq_params is None and self.cp_group is None:
            return self._attend(query, key, value, attention_mask)
        if packed_seq_params is None or packed_seq_params.qkv_format != "thd":
            found = None if packed_seq_params is None else packed_seq_params.qkv_format
            raise ValueError(
                f"SDPAttention packs only qkv_format='thd' (context parallel: only packed rows), got {found!r}"
            )
        lengths = packed_seq_params.cu_seqlens_q.diff().tolist()  # host tensor: no device sync
        if self.cp_group is not None:
            return self._attend_context_parallel(query, key, value, lengths, self.cp_group)
        # split, not slices: a slice's backward writes a zero gradient of the whole row per segment.
        segments = zip(*(x.split(lengths) for x in (query, key, value)), strict=True)
        return torch.cat([self._attend(q[:, None], k[:, None], v[:, None], None)[:, 0] for q, k, v in segments])

    def _attend_context_parallel(
        self, query: Tensor, key: Tensor, value: Tensor, lengths: list[int], group: dist.ProcessGroup
    ) -> Tensor:
        """``[t, heads * head_dim]`` for this rank's ``[t, heads|groups, head_dim]`` part of a packed row
        whose padded segments have global ``lengths`` (each a multiple of ``2 * cp``)."""
        size, rank = group.size(), group.rank()
        key_width = key.shape[1] * key.shape[2]
        # keys and values in one collective (MLA's differ in head size), back in global row order
        both = all_gather(torch.cat([key.flatten(1), value.flatten(1)], dim=1), group)
        both = both.index_select(0, gather_order(tuple(lengths), size, both.device))
        keys, values = both.split([key_width, both.shape[1] - key_width], dim=1)
        keys, values = keys.unflatten(1, key.shape[1:]), values.unflatten(1, value.shape[1:])
        out = []
        local = query.split([n // size for n in lengths])
        for q, k, v, length in zip(local, keys.split(lengths), values.split(lengths), lengths, strict=True):
            chunk = length // (2 * size)
            for part, index in zip(q.split(chunk), (rank, 2 * size - 1 - rank), strict=True):
                end = (index + 1) * chunk  # the chunk sees its segment's keys up to its own last token
                causal = causal_lower_right(chunk, end) if end > chunk else None
                out.append(self._attend(part[:, None], k[:end, None], v[:end, None], None, causal)[:, 0])
        return torch.cat(out)

    def _attend(
        self, query: Tensor, key: Tensor, value: Tensor, attention_mask: Tensor | None, causal: CausalBias | None = None
    ) -> Tensor:
        """``causal``: a ``CausalBias`` in place of the top-left causal mask (without ``attention_mask``)."""
        seq, batch = query.shape[:2]
        q, k, v = (x.permute(1, 2, 0, 3) for x in (query, key, value))  # [b, heads, s, head_dim]
        # Megatron's masks are True where attention is NOT allowed; SDPA's bool masks the opposite.
        mask = causal if attention_mask is None else ~attention_mask
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
