"""Tiny random models of each supported family, megatron's process groups, one CPU thread."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from transformers import (
    AutoModelForCausalLM,
    LlamaConfig,
    PretrainedConfig,
    PreTrainedModel,
    Qwen2Config,
    Qwen3Config,
    Qwen3MoeConfig,
)

from learner.megatron.config import MegatronConfig

COMMON = {"vocab_size": 256, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2}
# Each family with grouped-query attention (and the variants that change the fused layouts).
FAMILIES: dict[str, Callable[[], PretrainedConfig]] = {
    "qwen2": lambda: Qwen2Config(**COMMON, num_attention_heads=4, num_key_value_heads=2, rms_norm_eps=1e-6),
    "qwen2-mqa-tied": lambda: Qwen2Config(
        **COMMON, num_attention_heads=4, num_key_value_heads=1, tie_word_embeddings=True
    ),
    "qwen2-mha": lambda: Qwen2Config(**COMMON, num_attention_heads=4, num_key_value_heads=4),
    # head_dim apart from hidden / heads (Qwen3 sets it explicitly)
    "qwen3": lambda: Qwen3Config(
        **{**COMMON, "hidden_size": 96}, num_attention_heads=4, num_key_value_heads=2, head_dim=16
    ),
    # Llama 3.1's scaled RoPE, with a short original context so the scaling acts within 48 tokens.
    "llama3": lambda: LlamaConfig(
        **{**COMMON, "num_hidden_layers": 3},
        num_attention_heads=8,
        num_key_value_heads=2,
        head_dim=16,  # 8 would make eager's matmul and megatron's baddbmm round differently
        rope_parameters={
            "rope_type": "llama3",
            "rope_theta": 500000.0,
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 16,
        },
    ),
}
MOE: dict[str, Callable[[], PretrainedConfig]] = {
    "qwen3_moe": lambda: Qwen3MoeConfig(
        **{**COMMON, "intermediate_size": 96},
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        moe_intermediate_size=32,
        num_experts=4,
        num_experts_per_tok=2,
        norm_topk_prob=True,
    ),
    # softmax over all experts without renormalising, and a dense first layer
    "qwen3_moe-plain-topk-dense0": lambda: Qwen3MoeConfig(
        **{**COMMON, "intermediate_size": 96},
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        moe_intermediate_size=32,
        num_experts=4,
        num_experts_per_tok=2,
        norm_topk_prob=False,
        mlp_only_layers=[0],
    ),
}


@pytest.fixture(autouse=True)
def one_thread() -> Iterator[None]:
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture
def world() -> Iterator[MegatronConfig]:
    """A one-process megatron world with the default layout."""
    from learner.megatron.runtime import parallel

    config = MegatronConfig()
    with parallel(config):
        yield config


def random_hf(config: PretrainedConfig, attn_implementation: str = "eager", seed: int = 0) -> PreTrainedModel:
    """A random float32 model whose norms and biases are not at their initial 1 and 0."""
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, attn_implementation=attn_implementation, dtype=torch.float32)
    with torch.no_grad():
        for parameter in model.parameters():
            parameter.add_(torch.randn_like(parameter) * 0.05)
    return model.eval()


def saved_state(model: PreTrainedModel, folder: Path) -> dict[str, torch.Tensor]:
    """The tensors as ``save_pretrained`` writes them (per-expert names for MoE models)."""
    model.save_pretrained(folder)
    return load_file(folder / "model.safetensors")
