"""Whole-model megatron state dicts <-> the part one rank holds under tensor/pipeline/expert parallelism.

``hf_convert`` produces and consumes the whole model with global layer numbers and every expert;
``shard`` cuts out one rank's tensors under megatron's naming (pipeline stages number their layers
from 0, expert-parallel ranks their experts from 0), ``merge`` puts all ranks' parts back together.
Tensor-parallel splits follow megatron-core's layers:

* column-parallel (split rows): ``linear_qkv`` (whole KV groups per rank), MLA's down- and
  up-projections (the up-projections whole heads per rank; megatron gathers the down-projections'
  latents again), the word embeddings and output layer (vocabulary rows), ``linear_fc1`` (gate and
  up halves split separately);
* row-parallel (split columns): ``linear_proj``, ``linear_fc2``;
* everything else (norms, the router and its expert bias) is replicated.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass

import torch
from torch import Tensor

from learner.megatron_config import MegatronConfig

__all__ = ["RankPosition", "merge", "shard"]

_LAYER = re.compile(r"^decoder\.layers\.(\d+)\.(.*)$")
_EXPERT = re.compile(r"^mlp\.experts\.local_experts\.(\d+)\.(.*)$")
_COLUMN = (
    "self_attention.linear_qkv.weight",
    "self_attention.linear_qkv.bias",
    "self_attention.linear_q_proj.weight",
    "self_attention.linear_q_down_proj.weight",
    "self_attention.linear_q_up_proj.weight",
    "self_attention.linear_kv_down_proj.weight",
    "self_attention.linear_kv_up_proj.weight",
)
_ROW = ("self_attention.linear_proj.weight", "linear_fc2.weight")


@dataclass(frozen=True, slots=True)
class RankPosition:
    """Where a rank sits: its tensor, pipeline and expert-parallel ranks."""

    tensor: int = 0
    pipeline: int = 0
    expert: int = 0


def _tp_dim(name: str) -> int | None:
    """0 for column-parallel tensors, 1 for row-parallel ones, None for replicated ones."""
    if name.endswith(_COLUMN) or name in ("embedding.word_embeddings.weight", "output_layer.weight"):
        return 0
    if name.endswith(_ROW):
        return 1
    return None


def _split(name: str, tensor: Tensor, tp: int, rank: int) -> Tensor:
    if tp == 1:
        return tensor
    if name.endswith("linear_fc1.weight"):  # [gate; up]: each rank holds [its gate rows; its up rows]
        return torch.cat([half.chunk(tp)[rank] for half in tensor.chunk(2)])
    dim = _tp_dim(name)
    return tensor if dim is None else tensor.chunk(tp, dim=dim)[rank]


def _join(name: str, parts: list[Tensor]) -> Tensor:
    if len(parts) == 1:
        return parts[0]
    if name.endswith("linear_fc1.weight"):
        halves = [p.chunk(2) for p in parts]
        return torch.cat([torch.cat([h[0] for h in halves]), torch.cat([h[1] for h in halves])])
    dim = _tp_dim(name)
    return parts[0] if dim is None else torch.cat(parts, dim=dim)


def _local_name(
    name: str, config: MegatronConfig, num_layers: int, num_experts: int, where: RankPosition
) -> str | None:
    """``name`` as rank ``where`` calls it, or None when that rank does not hold it."""
    per_stage = num_layers // config.pipeline_parallel
    first, last = where.pipeline == 0, where.pipeline == config.pipeline_parallel - 1
    match = _LAYER.match(name)
    if match is None:
        if name.startswith("embedding."):
            return name if first else None
        return name if last else None  # final norm and output layer
    layer, rest = int(match[1]), match[2]
    if layer // per_stage != where.pipeline:
        return None
    expert = _EXPERT.match(rest)
    if expert is not None:
        per_rank = num_experts // config.expert_parallel
        index = int(expert[1])
        if index // per_rank != where.expert:
            return None
        rest = f"mlp.experts.local_experts.{index % per_rank}.{expert[2]}"
    return f"decoder.layers.{layer % per_stage}.{rest}"


def shard(
    state: Mapping[str, Tensor], config: MegatronConfig, num_layers: int, num_experts: int, where: RankPosition
) -> dict[str, Tensor]:
    """The tensors rank ``where`` holds, under its local names.

    With tied embeddings the last pipeline stage also holds ``output_layer.weight``; pass it in
    ``state`` (a copy of the embeddings) for such a layout.
    """
    out = {}
    for name, tensor in state.items():
        local = _local_name(name, config, num_layers, num_experts, where)
        if local is not None:
            out[local] = _split(name, tensor, config.tensor_parallel, where.tensor)
    return out


def _positions(config: MegatronConfig) -> list[RankPosition]:
    return [
        RankPosition(t, p, e)
        for p in range(config.pipeline_parallel)
        for e in range(config.expert_parallel)
        for t in range(config.tensor_parallel)
    ]


def merge(
    parts: Mapping[RankPosition, Mapping[str, Tensor]], config: MegatronConfig, num_layers: int, num_experts: int
) -> dict[str, Tensor]:
    """The whole-model state dict from every rank's part (one per tensor x pipeline x expert position).

    Raises:
        ValueError: a rank position is missing.
    """
    missing = [p for p in _positions(config) if p not in parts]
    if missing:
        raise ValueError(f"merge needs every rank's part; missing {missing}")
    per_stage = num_layers // config.pipeline_parallel
    per_rank = max(num_experts // config.expert_parallel, 1)
    pieces: dict[str, list[Tensor]] = {}
    for where in _positions(config):  # tensor rank varies fastest: pieces arrive in tensor-rank order
        for local, tensor in parts[where].items():
            name = local
            match = _LAYER.match(local)
            if match is not None:
                rest = match[2]
                expert = _EXPERT.match(rest)
                if expert is not None:
                    rest = f"mlp.experts.local_experts.{where.expert * per_rank + int(expert[1])}.{expert[2]}"
                elif where.expert != 0:
                    continue  # non-expert tensors repeat on every expert rank
                name = f"decoder.layers.{where.pipeline * per_stage + int(match[1])}.{rest}"
            elif where.expert != 0:
                continue  # repeated on every expert rank
            pieces.setdefault(name, []).append(tensor)
    return {name: _join(name, tensors) for name, tensors in pieces.items()}
