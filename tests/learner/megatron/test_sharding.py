"""Cutting the whole-model state into tensor/pipeline/expert-parallel parts and joining them again."""

from __future__ import annotations

import pytest
import torch

from learner.megatron.hf_convert import num_experts, to_megatron
from learner.megatron.sharding import RankPosition, merge, shard
from learner.megatron_config import MegatronConfig
from tests.learner.megatron.conftest import MOE, random_hf, saved_state


@pytest.fixture(scope="module", params=["qwen3_moe", "deepseek_v3"])
def moe_state(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> tuple[dict[str, torch.Tensor], int, int]:
    config = MOE[request.param]()
    config.num_hidden_layers = 2  # a whole number of layers per pipeline stage
    state = saved_state(random_hf(config), tmp_path_factory.mktemp("moe"))
    return to_megatron(state, config), config.num_hidden_layers, num_experts(config)


@pytest.mark.parametrize(
    "layout",
    [
        MegatronConfig(devices=2, tensor_parallel=2),
        MegatronConfig(devices=2, pipeline_parallel=2),
        MegatronConfig(devices=2, expert_parallel=2),
        MegatronConfig(devices=8, tensor_parallel=2, pipeline_parallel=2, expert_parallel=2),
    ],
    ids=["tp2", "pp2", "ep2", "tp2-pp2-ep2"],
)
def test_shards_merge_back_bit_for_bit(
    moe_state: tuple[dict[str, torch.Tensor], int, int], layout: MegatronConfig
) -> None:
    full, layers, experts = moe_state
    positions = [
        RankPosition(t, p, e)
        for t in range(layout.tensor_parallel)
        for p in range(layout.pipeline_parallel)
        for e in range(layout.expert_parallel)
    ]
    parts = {where: shard(full, layout, layers, experts, where) for where in positions}
    merged = merge(parts, layout, layers, experts)
    assert merged.keys() == full.keys()
    assert all(torch.equal(merged[name], full[name]) for name in full)


def test_a_rank_holds_its_layers_experts_and_slices() -> None:
    full = {
        "embedding.word_embeddings.weight": torch.arange(8.0).reshape(4, 2),
        "decoder.layers.1.self_attention.linear_proj.weight": torch.arange(8.0).reshape(2, 4),
        "decoder.layers.1.mlp.linear_fc1.weight": torch.arange(8.0).reshape(4, 2),  # [gate 2 rows; up 2 rows]
        "decoder.layers.1.mlp.experts.local_experts.3.linear_fc2.weight": torch.ones(2, 2),
        "decoder.final_layernorm.weight": torch.ones(2),
    }
    layout = MegatronConfig(devices=8, tensor_parallel=2, pipeline_parallel=2, expert_parallel=2)
    part = shard(full, layout, 2, 4, RankPosition(tensor=1, pipeline=1, expert=1))
    assert set(part) == {
        "decoder.layers.0.self_attention.linear_proj.weight",
        "decoder.layers.0.mlp.linear_fc1.weight",
        "decoder.layers.0.mlp.experts.local_experts.1.linear_fc2.weight",
        "decoder.final_layernorm.weight",
    }
    assert part["decoder.layers.0.self_attention.linear_proj.weight"].tolist() == [[2.0, 3.0], [6.0, 7.0]]
    assert part["decoder.layers.0.mlp.linear_fc1.weight"].tolist() == [[2.0, 3.0], [6.0, 7.0]]  # gate 1, up 1
    with pytest.raises(ValueError, match="missing"):
        merge({RankPosition(): part}, layout, 2, 4)
