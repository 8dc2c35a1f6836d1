"""The fused paths CUDA runs (compiled RoPE, megatron's compiled SwiGLU) against the eager ones, on the CPU."""

from __future__ import annotations

from pathlib import Path

import torch
from megatron.core.models.common.embeddings import rope_utils

from learner.megatron.compiled_fusions import install_compiled_rope, rope_functions
from learner.megatron.config import MegatronConfig
from learner.megatron.model import build_model
from learner.megatron.weights import load_hf_weights
from tests.learner.megatron.conftest import FAMILIES, random_hf, saved_state


def test_compiled_rope_equals_megatrons_eager_rope() -> None:
    eager, compiled = rope_functions()
    generator = torch.Generator().manual_seed(0)
    queries = torch.randn(9, 2, 4, 16, generator=generator).bfloat16()  # [s, b, heads, dim]
    freqs = torch.randn(9, 1, 1, 16, generator=generator)
    torch.testing.assert_close(compiled(queries.float(), freqs), eager(queries.float(), freqs))
    # bf16: the compiled kernel rounds once at the end, eager after every operation: no further from
    # the float32 result than eager
    exact = eager(queries.float(), freqs)
    compiled_error = (compiled(queries, freqs).float() - exact).abs().max()
    assert compiled_error <= (eager(queries, freqs).float() - exact).abs().max()
    install_compiled_rope()
    assert rope_utils._apply_rotary_pos_emb_bshd is not eager  # CUDA tensors take the compiled form
    assert torch.equal(rope_utils._apply_rotary_pos_emb_bshd(queries, freqs), eager(queries, freqs))


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
