"""Tiny random models of each supported family, megatron's process groups, one CPU thread."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from transformers import (
    AutoModelForCausalLM,
    DeepseekV3Config,
    LlamaConfig,
    PretrainedConfig,
    PreTrainedModel,
    Qwen2Config,
    Qwen3Config,
    Qwen3MoeConfig,
)

from learner.megatron_config import MegatronConfig

COMMON = {"vocab_size": 256, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2}
# DeepSeek-V3: multi-latent attention (query and key/value latents), 12 routed experts in 3 groups of
# which the best 2 are searched for 4 experts (2 = 4 // 2 per group, as megatron scores groups), a
# shared expert, a dense first layer.
DEEPSEEK = {
    **COMMON,
    "num_hidden_layers": 3,
    "num_attention_heads": 4,
    "num_key_value_heads": 4,
    "q_lora_rank": 48,
    "kv_lora_rank": 32,
    "qk_nope_head_dim": 8,
    "qk_rope_head_dim": 8,  # a query/key head of 16: a softmax scale of 1/4 (see "llama3" below)
    "v_head_dim": 24,
    "moe_intermediate_size": 32,
    "n_routed_experts": 12,
    "n_group": 3,
    "topk_group": 2,
    "num_experts_per_tok": 4,
    "n_shared_experts": 1,
    "routed_scaling_factor": 2.5,
    "first_k_dense_replace": 1,
    "max_position_embeddings": 256,
}
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
    # multi-latent attention alone (every layer dense)
    "deepseek_v3-dense": lambda: DeepseekV3Config(**{**DEEPSEEK, "first_k_dense_replace": 3}),
    # queries without a latent, YaRN with its factor on cos and sin (no mscale_all_dim: softmax scale 1/4)
    "deepseek_v3-dense-yarn-q-proj": lambda: DeepseekV3Config(
        **{**DEEPSEEK, "first_k_dense_replace": 3, "q_lora_rank": None, "max_position_embeddings": 64},
        rope_parameters={
            "rope_type": "yarn",
            "rope_theta": 10000.0,
            "factor": 4.0,
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
    # DeepSeek-V3's own RoPE settings: YaRN with mscale = mscale_all_dim (softmax scale times mscale^2)
    "deepseek_v3": lambda: DeepseekV3Config(
        **{**DEEPSEEK, "qk_nope_head_dim": 16, "max_position_embeddings": 64},
        rope_parameters={
            "rope_type": "yarn",
            "rope_theta": 10000.0,
            "factor": 4.0,
            "original_max_position_embeddings": 16,
            "mscale": 1.0,
            "mscale_all_dim": 1.0,
            "beta_fast": 32,
            "beta_slow": 1,
        },
    ),
    # every group searched, two experts, no routed scaling, queries without a latent
    "deepseek_v3-no-groups-q-proj": lambda: DeepseekV3Config(
        **{
            **DEEPSEEK,
            "q_lora_rank": None,
            "n_group": 1,
            "topk_group": 1,
            "num_experts_per_tok": 2,
            "routed_scaling_factor": 1.0,
        }
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
    """A random float32 model whose norms, biases and saved buffers (DeepSeek-V3's routing bias) are not
    at their initial 1 and 0."""
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, attn_implementation=attn_implementation, dtype=torch.float32)
    saved = model.state_dict().keys()
    with torch.no_grad():
        for parameter in model.parameters():
            parameter.add_(torch.randn_like(parameter) * 0.05)
        for name, buffer in model.named_buffers():
            if name in saved:
                buffer.add_(torch.randn_like(buffer) * 0.05)
    return model.eval()


def saved_state(model: PreTrainedModel, folder: Path) -> dict[str, torch.Tensor]:
    """The tensors as ``save_pretrained`` writes them (per-expert names for MoE models)."""
    model.save_pretrained(folder)
    return load_file(folder / "model.safetensors")
