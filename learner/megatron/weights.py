"""Moving weights between a HF checkpoint folder and the megatron model parts on each rank.

``load_hf_weights`` reads the folder's safetensors, converts (``hf_convert``), cuts out this rank's
part (``sharding``) and loads it strictly. ``gather_hf_weights`` does the reverse: every rank of the
first expert-data-parallel replica (the first data-parallel one, widened by expert parallel) sends
its part to global rank 0, which merges and converts them back to HF names (the other ranks get None).
"""

from __future__ import annotations

from pathlib import Path

import torch.distributed as dist
from megatron.core import parallel_state
from torch import Tensor, nn

from learner.megatron.hf_convert import num_experts, to_hf, to_megatron
from learner.megatron.sharding import RankPosition, merge, shard
from learner.megatron_config import MegatronConfig
from learner.trainers.checkpoint import read_hf_weights

__all__ = ["gather_hf_weights", "load_hf_weights"]


def _position() -> RankPosition:
    return RankPosition(
        tensor=parallel_state.get_tensor_model_parallel_rank(),
        pipeline=parallel_state.get_pipeline_model_parallel_rank(),
        expert=parallel_state.get_expert_model_parallel_rank(),
    )


def _sizes(hf: object) -> tuple[int, int]:
    return hf.num_hidden_layers, num_experts(hf)  # type: ignore[attr-defined]


def load_hf_weights(model: nn.Module, model_dir: Path, hf: object, config: MegatronConfig) -> None:
    """Load the checkpoint in ``model_dir`` (config ``hf``) into this rank's ``model`` part.

    Raises:
        ValueError: the checkpoint lacks tensors the model has, or has ones it does not.
    """
    full = to_megatron(read_hf_weights(model_dir), hf)
    if getattr(hf, "tie_word_embeddings", False) and config.pipeline_parallel > 1:
        full["output_layer.weight"] = full["embedding.word_embeddings.weight"]  # the last stage's copy
    local = shard(full, config, *_sizes(hf), _position())
    result = model.load_state_dict(local, strict=False)
    missing = [k for k in result.missing_keys if not k.endswith("_extra_state")]
    if missing or result.unexpected_keys:
        raise ValueError(f"{model_dir}: missing {missing[:5]}, unexpected {result.unexpected_keys[:5]}")


def gather_hf_weights(model: nn.Module, hf: object, config: MegatronConfig) -> dict[str, Tensor] | None:
    """The whole model under HF names on global rank 0 (on the CPU); None on every other rank."""
    # copies: with the distributed optimizer the weights are views into one flat buffer, which gather_object
    # pickles whole and the safetensors export refuses (tensors sharing a storage they do not cover)
    local = {
        k: v.detach().to("cpu", copy=True) for k, v in model.state_dict().items() if not k.endswith("_extra_state")
    }
    if dist.get_world_size() == 1:
        return to_hf(local, hf)
    # Expert-parallel ranks are carved out of the data-parallel ones: the first replica of the experts
    # spans as many data-parallel ranks as there are expert-parallel ones (the same ranks without EP).
    first_replica = parallel_state.get_expert_data_parallel_rank() == 0
    mine = (_position(), local) if first_replica else None
    gathered: list[tuple[RankPosition, dict[str, Tensor]] | None] | None = (
        [None] * dist.get_world_size() if dist.get_rank() == 0 else None
    )
    dist.gather_object(mine, gathered, dst=0)
    if gathered is None:
        return None
    parts = {where: part for item in gathered if item is not None for where, part in [item]}
    return to_hf(merge(parts, config, *_sizes(hf)), hf)
