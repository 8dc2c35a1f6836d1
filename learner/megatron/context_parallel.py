"""Context parallel without TransformerEngine: each packed row split over the CP ranks, keys and values all-gathered.

The layout is the one megatron-core's ``thd`` RoPE and slime use: every segment (sample) of a packed
row is padded to a multiple of ``2 * cp`` tokens and cut into ``2 * cp`` equal chunks; CP rank ``r``
holds chunks ``r`` and ``2 * cp - 1 - r`` of every segment, in that order, segment after segment.
Under causal attention a chunk's cost grows with its position, so pairing an early chunk with a late
one gives every rank the same work (``r + 1`` plus ``2 * cp - r`` chunk blocks: ``2 * cp + 1``). The
model is handed the padded segments' global ``cu_seqlens``: megatron's RoPE reads them and gives
each held position the rotation of its true position, and ``SDPAttention`` reads them to put the
all-gathered keys and values back in order.

``RowSplit`` is one row seen from one rank: its inputs, the next token at each held position (the
log-prob targets) and the gather that rebuilds the row's per-token values from every rank's part.
``all_gather`` is the autograd-aware collective both use; its backward reduce-scatters (sums each
rank's gradient over the group, keeps this rank's part).
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

__all__ = ["RowSplit", "all_gather", "gather_order", "held_positions", "split_row"]


class _AllGather(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, tensor: Tensor, group: dist.ProcessGroup) -> Tensor:
        ctx.group = group
        out = tensor.new_empty((group.size() * tensor.shape[0], *tensor.shape[1:]))
        dist.all_gather_into_tensor(out, tensor.contiguous(), group=group)
        return out

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, None]:
        out = grad.new_empty((grad.shape[0] // ctx.group.size(), *grad.shape[1:]))
        dist.reduce_scatter_tensor(out, grad.contiguous(), group=ctx.group)
        return out, None


def all_gather(tensor: Tensor, group: dist.ProcessGroup) -> Tensor:
    """Every rank's ``tensor`` (same shape on each) stacked along dim 0 in rank order, with gradient:
    the backward sums the gradient over the group and hands each rank its part (reduce-scatter)."""
    return _AllGather.apply(tensor, group)


@functools.lru_cache(maxsize=256)
def held_positions(padded: tuple[int, ...], size: int, rank: int) -> Tensor:
    """The global-row positions CP rank ``rank`` of ``size`` holds, in its order: chunks ``rank`` and
    ``2 * size - 1 - rank`` of each segment (``padded``: segment lengths, multiples of ``2 * size``)."""
    parts, start = [], 0
    for length in padded:
        chunk = length // (2 * size)
        for index in (rank, 2 * size - 1 - rank):
            parts.append(torch.arange(start + index * chunk, start + (index + 1) * chunk))
        start += length
    return torch.cat(parts)


@functools.lru_cache(maxsize=256)
def gather_order(padded: tuple[int, ...], size: int, device: torch.device) -> Tensor:
    """For each global-row position, its index in the all-gather of every rank's held part (rank-major)."""
    held = torch.cat([held_positions(padded, size, rank) for rank in range(size)])
    order = torch.empty_like(held)
    order[held] = torch.arange(len(held))
    return order.to(device)


@dataclass(frozen=True, slots=True, eq=False)
class RowSplit:
    """One packed row over the context-parallel group, seen from one of its ranks (``split_row``)."""

    size: int
    cu_seqlens: Tensor  # int32 [S + 1] on the host: the padded segments' bounds in the global row
    max_seqlen: int
    held: Tensor  # [padded / size]: the global positions this rank holds, in its order
    tokens: Tensor  # [T]: each of the row's tokens' global position
    positions: Tensor  # [padded / size]: the position within its segment of each held position
    row_index: Tensor  # [T]: each token's index in the all-gather of every rank's held values

    def local(self, row: Tensor, fill: int = 0) -> Tensor:
        """This rank's part of a ``[T]`` row tensor (padding filled with ``fill``)."""
        padded = row.new_full((int(self.cu_seqlens[-1]),), fill)
        padded[self.tokens] = row
        return padded[self.held]

    def targets(self, input_ids: Tensor) -> Tensor:
        """The token after each held position in the global row (what its logits are scored on)."""
        padded = input_ids.new_zeros(int(self.cu_seqlens[-1]))
        padded[self.tokens] = input_ids
        return padded.roll(-1)[self.held]

    def gather_row(self, values: Tensor, group: dist.ProcessGroup) -> Tensor:
        """The row's ``[T, ...]`` values, in row order and without the padding, from each rank's
        ``[held, ...]`` part; with gradient (each rank gets back its part's, summed over the group)."""
        return all_gather(values, group).index_select(0, self.row_index.to(values.device))


@functools.lru_cache(maxsize=64)
def split_row(lengths: tuple[int, ...], *, size: int, rank: int, row_multiple: int = 1) -> RowSplit:
    """CP rank ``rank`` of ``size`` (>= 2)'s part of a packed row of segments of ``lengths``.

    Each segment is padded to a multiple of ``2 * size``; when ``row_multiple`` > 1 (sequence
    parallel splits each rank's part over the tensor-parallel ranks) a padding segment makes every
    rank's part a multiple of it.
    """
    if size < 2:
        raise ValueError(f"split_row is for context parallel sizes >= 2, got {size}")
    multiple = 2 * size
    padded = [length + -length % multiple for length in lengths]
    filler = -sum(padded) % math.lcm(multiple, size * row_multiple)  # itself a multiple of 2 * size
    if filler:
        padded.append(filler)
    starts = torch.tensor([0, *padded]).cumsum(0)
    held = held_positions(tuple(padded), size, rank)
    tokens = torch.cat([torch.arange(int(start), int(start) + n) for start, n in zip(starts, lengths, strict=False)])
    segment = torch.repeat_interleave(torch.arange(len(padded)), torch.tensor(padded))
    positions = torch.arange(int(starts[-1])) - starts[segment]
    return RowSplit(
        size=size,
        cu_seqlens=starts.to(torch.int32),
        max_seqlen=max(padded),
        held=held,
        tokens=tokens,
        positions=positions[held],
        row_index=gather_order(tuple(padded), size, torch.device("cpu"))[tokens],
    )
