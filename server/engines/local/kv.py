"""KV caches of a running batch: rows are left-padded to one length so a decode step is one forward.

The batch keeps one transformers ``DynamicCache`` across decode steps (its layers grow in place);
rows join, leave and are copied out by editing each layer's key/value tensors directly.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from transformers import DynamicCache
from transformers.cache_utils import DynamicLayer

LayerKV = tuple[torch.Tensor, torch.Tensor]


def _layers(cache: DynamicCache) -> list[DynamicLayer]:
    """The cache's layers, full-attention ones (``load_model`` refuses models with other kinds)."""
    layers = []
    for layer in cache.layers:
        if not isinstance(layer, DynamicLayer):
            raise TypeError(f"the local engine keeps full-attention caches only, not {type(layer).__name__}")
        layers.append(layer)
    return layers


def _kv(layer: DynamicLayer) -> LayerKV:
    """A filled layer's keys and values (a layer is filled by the prefill that created it)."""
    if layer.keys is None or layer.values is None:
        raise ValueError("a cache layer was read before a forward pass filled it")
    return layer.keys, layer.values


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
        return cls([_kv(layer) for layer in _layers(cache)])


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
        row_mask = torch.ones((1, row.length), dtype=torch.long, device=row.layers[0][0].device)
        if self.cache is None:
            self.cache, self.mask = row.to_cache(), row_mask
            return
        length = max(self.length, row.length)
        for layer, (row_k, row_v) in zip(_layers(self.cache), row.layers, strict=True):
            keys, values = _kv(layer)
            layer.keys = torch.cat([_left_pad(keys, length), _left_pad(row_k, length)])
            layer.values = torch.cat([_left_pad(values, length), _left_pad(row_v, length)])
        self.mask = torch.cat([_left_pad_mask(self.mask, length), _left_pad_mask(row_mask, length)])

    def keep_rows(self, keep: list[int]) -> None:
        """Drop finished rows, then the leading columns that only padding still occupies."""
        if not keep or self.cache is None:
            self.cache, self.mask = None, torch.zeros((0, 0), dtype=torch.long)
            return
        index = torch.tensor(keep, device=self.mask.device)
        mask = self.mask.index_select(0, index)
        start = int((mask.cumsum(1) == 0).sum(1).min())
        self.mask = mask[:, start:]
        for layer in _layers(self.cache):
            keys, values = _kv(layer)
            layer.keys = keys.index_select(0, index)[..., start:, :]
            layer.values = values.index_select(0, index)[..., start:, :]

    def row(self, index: int) -> RowKV:
        """A compact copy of one row's real tokens (copied so the batch tensors can be freed)."""
        if self.cache is None:
            raise IndexError("the batch is empty")
        start = int((self.mask[index].cumsum(0) == 0).sum())
        rows = [(k[index : index + 1, :, start:, :], v[index : index + 1, :, start:, :]) for k, v in self._kvs()]
        return RowKV([(k.clone(), v.clone()) for k, v in rows])

    def _kvs(self) -> list[LayerKV]:
        return [_kv(layer) for layer in _layers(self.cache)] if self.cache is not None else []

    def next_positions(self) -> torch.Tensor:
        """Position of every row's next token: the number of its real tokens so far."""
        return self.mask.sum(1, keepdim=True)

    def grow_mask(self) -> torch.Tensor:
        """Mark the token about to be decoded in every row; returns the mask for that forward."""
        self.mask = torch.cat([self.mask, self.mask.new_ones((self.rows, 1))], dim=1)
        return self.mask
