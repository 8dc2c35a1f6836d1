"""KV caches of a running batch: rows are left-padded to one length so a decode step is one forward.

The batch keeps one transformers ``DynamicCache`` across decode steps (its layers grow in place);
rows join, leave and are copied out by editing each layer's key/value tensors directly.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from transformers import DynamicCache

LayerKV = tuple[torch.Tensor, torch.Tensor]


@dataclass(slots=True)
class RowKV:
    """The cached keys and values of one sequence's tokens, without padding: [1, heads, tokens, dim]."""

    layers: list[LayerKV]

    @property
    def length(self) -> int:
        return self.layers[0][0].shape[-2] if self.layers else 0

    @property
    def nbytes(self) -> int:
        return sum(k.numel() * k.element_size() + v.numel() * v.element_size() for k, v in self.layers)

    def truncated(self, length: int) -> RowKV:
        return RowKV([(k[..., :length, :], v[..., :length, :]) for k, v in self.layers])

    def to_cache(self) -> DynamicCache:
        return DynamicCache(ddp_cache_data=self.layers)

    @classmethod
    def from_cache(cls, cache: DynamicCache) -> RowKV:
        return cls([(layer.keys, layer.values) for layer in cache.layers])


def _left_pad(tensor: torch.Tensor, length: int) -> torch.Tensor:
    missing = length - tensor.shape[-2]
    if missing == 0:
        return tensor
    pad = tensor.new_zeros((*tensor.shape[:-2], missing, tensor.shape[-1]))
    return torch.cat([pad, tensor], dim=-2)


def _left_pad_mask(mask: torch.Tensor, length: int) -> torch.Tensor:
    return torch.cat([mask.new_zeros((mask.shape[0], length - mask.shape[1])), mask], dim=1)


class BatchKV:
    """The shared cache and attention mask of the rows being decoded together."""

    def __init__(self) -> None:
        self.cache: DynamicCache | None = None
        self.mask = torch.zeros((0, 0), dtype=torch.long)

    @property
    def rows(self) -> int:
        return self.mask.shape[0]

    @property
    def length(self) -> int:
        return self.mask.shape[1]

    def append_row(self, row: RowKV) -> None:
        """Join a freshly prefilled sequence, left-padding whichever side is shorter."""
        row_mask = torch.ones((1, row.length), dtype=torch.long)
        if self.cache is None:
            self.cache, self.mask = row.to_cache(), row_mask
            return
        length = max(self.length, row.length)
        for layer, (row_k, row_v) in zip(self.cache.layers, row.layers, strict=True):
            layer.keys = torch.cat([_left_pad(layer.keys, length), _left_pad(row_k, length)])
            layer.values = torch.cat([_left_pad(layer.values, length), _left_pad(row_v, length)])
        self.mask = torch.cat([_left_pad_mask(self.mask, length), _left_pad_mask(row_mask, length)])

    def keep_rows(self, keep: list[int]) -> None:
        """Drop finished rows, then the leading columns that only padding still occupies."""
        if not keep or self.cache is None:
            self.cache, self.mask = None, torch.zeros((0, 0), dtype=torch.long)
            return
        index = torch.tensor(keep)
        mask = self.mask.index_select(0, index)
        start = int((mask.cumsum(1) == 0).sum(1).min())
        self.mask = mask[:, start:]
        for layer in self.cache.layers:
            layer.keys = layer.keys.index_select(0, index)[..., start:, :]
            layer.values = layer.values.index_select(0, index)[..., start:, :]

    def row(self, index: int) -> RowKV:
        """A compact copy of one row's real tokens (copied so the batch tensors can be freed)."""
        if self.cache is None:
            raise IndexError("the batch is empty")
        start = int((self.mask[index].cumsum(0) == 0).sum())
        return RowKV(
            [
                (
                    layer.keys[index : index + 1, :, start:, :].clone(),
                    layer.values[index : index + 1, :, start:, :].clone(),
                )
                for layer in self.cache.layers
            ]
        )

    def next_positions(self) -> torch.Tensor:
        """Position of every row's next token: the number of its real tokens so far."""
        return self.mask.sum(1, keepdim=True)

    def grow_mask(self) -> torch.Tensor:
        """Mark the token about to be decoded in every row; returns the mask for that forward."""
        self.mask = torch.cat([self.mask, torch.ones((self.rows, 1), dtype=torch.long)], dim=1)
        return self.mask
