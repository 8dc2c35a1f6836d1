"""The model CUDA runs (megatron's compiled SwiGLU) against the eager one, on the CPU."""

from __future__ import annotations

from pathlib import Path

import torch

from learner.megatron.model import build_model
from learner.megatron.weights import load_hf_weights
from learner.megatron_config import MegatronConfig
from tests.learner.megatron.conftest import FAMILIES, random_hf, saved_state


def test_fused_model_gives_the_unfused_logits_and_gradients(world: MegatronConfig, tmp_path: Path) -> None:
    config = FAMILIES["qwen2"]()
    saved_state(random_hf(config), tmp_path)
    tokens = torch.randint(0, config.vocab_size, (2, 24), generator=torch.Generator().manual_seed(1))
    positions = torch.arange(24)[None].expand(2, -1)
    results = []
    for fused in (False, True):
        model = build_model(config, world, fused=fused)
        load_hf_weights(model, tmp_path, config, world)
        assert model.config.bias_activation_fusion is fused
        logits = model(tokens, positions, None)
        logits.float().square().mean().backward()
        results.append((logits.detach(), {n: p.grad for n, p in model.named_parameters()}))
    (plain, plain_grads), (fused_logits, fused_grads) = results
    torch.testing.assert_close(fused_logits, plain, rtol=0, atol=1e-5)
    for name, grad in plain_grads.items():
        torch.testing.assert_close(fused_grads[name], grad, rtol=1e-5, atol=1e-6, msg=name)
