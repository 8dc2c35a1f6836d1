"""HF <-> megatron: exact logits for Qwen2, Qwen3, Llama 3 and DeepSeek-V3's attention, bitwise round
trips, Qwen3-MoE and DeepSeek-V3 parity."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM, DeepseekV3Config, PretrainedConfig, Qwen2Config, Qwen3MoeConfig

from learner.megatron.hf_convert import UnsupportedModel, to_hf, to_megatron
from learner.megatron.model import build_model, transformer_config
from learner.megatron.runtime import parallel
from learner.megatron.weights import gather_hf_weights, load_hf_weights
from learner.megatron_config import MegatronConfig
from learner.trainers.checkpoint import export_state_dict
from tests.learner.megatron.conftest import FAMILIES, MOE, random_hf, saved_state

# megatron's local attention is HF's eager math; the SDPA path is HF's sdpa call.
HF_ATTENTION = {"local": "eager", "sdpa": "sdpa"}


def megatron_logits(config: PretrainedConfig, folder: Path, attention: str, tokens: torch.Tensor) -> torch.Tensor:
    layout = MegatronConfig()
    with parallel(layout):
        model = build_model(config, layout, attention=attention).eval()
        load_hf_weights(model, folder, config, layout)
        positions = torch.arange(tokens.shape[1])[None].expand_as(tokens)
        with torch.no_grad():
            return model(tokens, positions, None)


@pytest.mark.parametrize("attention", ["local", "sdpa"])
@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_logits_equal_transformers_exactly(family: str, attention: str, tmp_path: Path) -> None:
    config = FAMILIES[family]()
    hf = random_hf(config, HF_ATTENTION[attention])
    saved_state(hf, tmp_path)
    tokens = torch.randint(0, config.vocab_size, (2, 48), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        expected = hf(tokens).logits
    assert torch.equal(megatron_logits(config, tmp_path, attention, tokens), expected)


@pytest.mark.parametrize("family", sorted(FAMILIES) + sorted(MOE))
def test_round_trips_are_bitwise(family: str, tmp_path: Path) -> None:
    config = (FAMILIES | MOE)[family]()
    stored = saved_state(random_hf(config), tmp_path)
    assert to_hf(to_megatron(stored, config), config).keys() == stored.keys()
    # HF folder -> megatron model -> HF tensors, then megatron tensors -> HF -> megatron.
    layout = MegatronConfig()
    with parallel(layout):
        model = build_model(config, layout)
        load_hf_weights(model, tmp_path, config, layout)
        exported = gather_hf_weights(model, config, layout)
        megatron_state = {k: v for k, v in model.state_dict().items() if not k.endswith("_extra_state")}
    assert exported is not None and exported.keys() == stored.keys()
    assert all(torch.equal(exported[name], stored[name]) for name in stored)
    again = to_megatron(to_hf(megatron_state, config), config)
    assert again.keys() == megatron_state.keys()
    assert all(torch.equal(again[name], megatron_state[name]) for name in again)


@pytest.mark.parametrize("family", ["qwen3", "deepseek_v3"])
def test_an_exported_folder_loads_in_transformers_with_the_same_logits(family: str, tmp_path: Path) -> None:
    config = (FAMILIES | MOE)[family]()
    hf = random_hf(config)
    base = tmp_path / "base"
    saved_state(hf, base)
    (base / "tokenizer_config.json").write_text("{}")
    layout = MegatronConfig()
    with parallel(layout):
        model = build_model(config, layout)
        load_hf_weights(model, base, config, layout)
        state = gather_hf_weights(model, config, layout)
    assert state is not None
    result = export_state_dict(state, base, tmp_path / "out", dtype=torch.float32)
    assert {p.name for p in result.path.iterdir()} == {p.name for p in base.iterdir()}
    assert load_file(result.path / "model.safetensors").keys() == load_file(base / "model.safetensors").keys()
    reloaded = AutoModelForCausalLM.from_pretrained(result.path, attn_implementation="eager").eval()
    tokens = torch.randint(0, config.vocab_size, (1, 16))
    with torch.no_grad():
        assert torch.equal(reloaded(tokens).logits, hf(tokens).logits)


def test_llama3_rope_scaling_is_applied(world: MegatronConfig) -> None:
    config = FAMILIES["llama3"]()
    model = build_model(config, world)
    plain = 1.0 / (500000.0 ** (torch.arange(0, 16, 2).float() / 16))
    assert not torch.equal(model.rotary_pos_emb.inv_freq, plain)  # the long wavelengths are stretched


@pytest.mark.parametrize("family", sorted(MOE))
@pytest.mark.parametrize("attention", ["local", "sdpa"])
def test_moe_logits_match_transformers(family: str, attention: str, tmp_path: Path) -> None:
    config = MOE[family]()
    hf = random_hf(config, HF_ATTENTION[attention])
    saved_state(hf, tmp_path)
    tokens = torch.randint(0, config.vocab_size, (2, 48), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        expected = hf(tokens).logits
    # The routing weights' normalisation and the expert sum run in another order than transformers'
    # (and the local attention puts DeepSeek-V3's softmax scale, not a power of two, inside its matmul):
    # float rounding only, measured up to 1e-6.
    torch.testing.assert_close(megatron_logits(config, tmp_path, attention, tokens), expected, rtol=0, atol=1e-5)


@pytest.mark.parametrize(
    ("config", "reason"),
    [
        (Qwen2Config(use_sliding_window=True, sliding_window=16), "sliding-window"),
        (Qwen2Config(rope_parameters={"rope_type": "yarn", "rope_theta": 1e4, "factor": 4.0}), "rope_type 'yarn'"),
        (Qwen2Config(hidden_act="gelu"), "hidden_act"),
        (Qwen3MoeConfig(attention_bias=True), "biases"),
        (DeepseekV3Config(rope_interleave=False), "rope_interleave=False"),
        (DeepseekV3Config(rms_norm_eps=1e-5), "latent norms use 1e-06"),
        (DeepseekV3Config(norm_topk_prob=False), "norm_topk_prob=False with num_experts_per_tok=8"),
        (DeepseekV3Config(num_experts_per_tok=8, n_group=8, topk_group=2), "num_experts_per_tok // topk_group = 4"),
        (DeepseekV3Config(n_shared_experts=0), "no shared experts"),
        (DeepseekV3Config(rope_parameters={"rope_type": "dynamic", "rope_theta": 1e4, "factor": 2.0}), "'dynamic'"),
        (DeepseekV3Config(quantization_config={"quant_method": "fp8"}), "quantized"),
    ],
)
def test_models_it_cannot_reproduce_are_refused(config: PretrainedConfig, reason: str) -> None:
    with pytest.raises(UnsupportedModel, match=reason):
        transformer_config(config, MegatronConfig())


def test_an_unknown_family_is_refused() -> None:
    config = Qwen2Config()
    config.model_type = "gpt2"
    with pytest.raises(UnsupportedModel, match="model_type 'gpt2' has no megatron conversion"):
        to_megatron({}, config)
